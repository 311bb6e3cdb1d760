from __future__ import annotations

from typing import Any

from rest_framework import serializers

from controlplane.api import ModelSerializer, Text
from runs import services
from runs.models import Checkpoint, Dataset, Run, RunEvent
from training.config import RECIPES


class DatasetSerializer(ModelSerializer):
    file = serializers.FileField(write_only=True, required=False, help_text="A .txt or .jsonl file.")
    path = Text(
        required=False, help_text="Administrators only: a .txt or .jsonl file on the server, instead of an upload."
    )
    name = Text(required=False, allow_blank=True, max_length=200)

    class Meta:
        model = Dataset
        fields = ["id", "name", "format", "file", "path", "size_bytes", "records", "sha256", "created_at"]
        read_only_fields = ["format", "size_bytes", "records", "sha256", "created_at"]

    def create(self, validated: dict[str, Any]) -> Dataset:
        user = self.context["request"].user
        return services.do_create_dataset(
            user,
            validated.get("name", ""),
            upload=validated.get("file"),
            path=validated.get("path", ""),
            by_administrator=user.is_staff,
        )


class RunSerializer(ModelSerializer):
    recipe = serializers.ChoiceField(
        choices=list(RECIPES),
        default="tiny",
        write_only=True,
        help_text="Defaults the spec starts from.",
        error_messages={"invalid_choice": f"must be one of {', '.join(RECIPES)}; got \"{{input}}\""},
    )
    spec = serializers.DictField(
        default=dict, help_text="Overrides of the recipe: sections model, layout, train, data, nodes, faults."
    )
    dataset = serializers.PrimaryKeyRelatedField(
        queryset=Dataset.objects.none(),
        required=False,
        allow_null=True,
        help_text="One of your datasets (its id); empty: the built-in demo corpus.",
    )
    tokenizer_run = serializers.PrimaryKeyRelatedField(
        queryset=Run.objects.none(),
        required=False,
        allow_null=True,
        help_text="One of your earlier runs (its id) whose tokenizer this run reuses; empty: trained on the dataset.",
    )
    validation_dataset = serializers.PrimaryKeyRelatedField(
        queryset=Dataset.objects.none(),
        required=False,
        allow_null=True,
        help_text="One of your datasets (its id) held out for evaluation; empty: spec.data.validation_fraction "
        "of the dataset, or none.",
    )
    slurm = serializers.DictField(
        required=False,
        help_text="Under the Slurm executor: overrides of the install's Slurm options (partition, account, qos, "
        "time_limit, gpus_per_node); the run shows them resolved.",
    )
    layout = serializers.CharField(source="layout_label", read_only=True)
    total_steps = serializers.IntegerField(read_only=True)

    class Meta:
        model = Run
        fields = [
            "id", "name", "recipe", "spec", "dataset", "tokenizer_run", "validation_dataset", "priority", "status", "status_reason", "layout", "step",
            "total_steps", "last_loss", "tokens_per_s", "restarts", "last_seq", "cancel_requested",
            "created_at", "started_at", "finished_at", "slurm", "slurm_job_id",
        ]
        read_only_fields = [
            "status", "status_reason", "step", "last_loss", "tokens_per_s", "restarts", "last_seq",
            "cancel_requested", "created_at", "started_at", "finished_at", "slurm_job_id",
        ]
        extra_kwargs = {"name": {"required": False}}

    def get_fields(self) -> dict[str, Any]:
        fields = super().get_fields()
        request = self.context.get("request")
        if request is not None and request.user.is_authenticated:
            # Only the caller's own datasets and runs can be chosen; another user's id reads as unknown.
            fields["dataset"].queryset = Dataset.objects.filter(owner=request.user)  # type: ignore[attr-defined]
            fields["validation_dataset"].queryset = Dataset.objects.filter(owner=request.user)  # type: ignore[attr-defined]
            fields["tokenizer_run"].queryset = Run.objects.filter(owner=request.user)  # type: ignore[attr-defined]
        return fields

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        attrs["run_spec"] = services.check_spec(
            attrs.get("spec", {}), attrs.pop("recipe", "tiny"), attrs.get("validation_dataset")
        )
        attrs["slurm_options"] = services.check_slurm_options(attrs.pop("slurm", None))
        return attrs

    def create(self, validated: dict[str, Any]) -> Run:
        name = validated.get("name") or "run"
        return services.do_create_run(
            self.context["request"].user,
            name,
            validated["run_spec"],
            validated.get("dataset"),
            validated.get("tokenizer_run"),
            priority=validated.get("priority", 0),
            validation_dataset=validated.get("validation_dataset"),
            slurm_options=validated["slurm_options"],
        )


class CloneSerializer(serializers.Serializer):
    """What a clone changes of its source run; anything left out is the source's."""

    name = Text(required=False, allow_blank=True, max_length=200)
    spec = serializers.DictField(required=False, help_text="Merged over the source's spec, section by section.")
    dataset = serializers.IntegerField(required=False, allow_null=True, help_text="One of your datasets (its id).")
    tokenizer_run = serializers.IntegerField(
        required=False, allow_null=True, help_text="One of your runs (its id) whose tokenizer the clone reuses."
    )
    validation_dataset = serializers.IntegerField(
        required=False, allow_null=True, help_text="One of your datasets (its id) held out for evaluation."
    )


class RunEventSerializer(ModelSerializer):
    class Meta:
        model = RunEvent
        fields = ["seq", "source", "source_seq", "kind", "time", "data"]


class CheckpointSerializer(ModelSerializer):
    class Meta:
        model = Checkpoint
        fields = ["id", "run", "step", "path", "export_path", "eval_loss", "created_at", "pruned_at"]


class IngestEventSerializer(serializers.Serializer):
    seq = serializers.IntegerField(min_value=1)
    kind = Text(max_length=32)
    time = serializers.FloatField(required=False)
    # Declared fields leave the class body, so this does not replace Serializer.data at run time.
    data = serializers.DictField(required=False, default=dict)  # type: ignore[assignment]


class IngestSerializer(serializers.Serializer):
    source = serializers.RegexField(r"^[A-Za-z0-9_.:-]{1,64}$", help_text="The sender, e.g. node-0.")  # type: ignore[assignment]
    events = IngestEventSerializer(many=True, allow_empty=True, max_length=10000)  # type: ignore[call-arg]
