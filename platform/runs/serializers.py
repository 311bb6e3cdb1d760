from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from drf_spectacular.utils import extend_schema_field, inline_serializer
from rest_framework import serializers

from controlplane.api import ModelSerializer, Text
from hosts import scheduling
from runs import access, compare, datasets, organise, services, specs
from runs.goodput import BUCKETS as GOODPUT_BUCKETS
from runs.models import Checkpoint, Dataset, PretrainedModel, Project, ProjectMember, QuantizedExport, Run, RunEvent
from serving.quantize import folder_size
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
        return datasets.do_create_dataset(
            user,
            validated.get("name", ""),
            upload=validated.get("file"),
            path=validated.get("path", ""),
            by_administrator=user.is_staff,
        )


class DatasetPathSerializer(serializers.Serializer):
    """`POST /api/datasets/` as JSON, which only names a server file (administrators only); a file
    is uploaded as multipart/form-data."""

    name = Text(required=False, allow_blank=True, max_length=200)
    path = Text(help_text="Administrators only: a .txt or .jsonl file on the server.")


class PretrainedModelPathSerializer(serializers.Serializer):
    """`POST /api/pretrained-models/` as JSON, which only names a server folder (administrators
    only); a folder's files are uploaded as multipart/form-data."""

    name = Text(required=False, allow_blank=True, max_length=200)
    path = Text(help_text="Administrators only: a Hugging Face Llama folder on the server.")


class PretrainedModelSerializer(ModelSerializer):
    files = serializers.ListField(
        child=serializers.FileField(),
        write_only=True,
        required=False,
        help_text="The files of a Hugging Face Llama folder: config.json, tokenizer.json (with its configs) and "
        "model.safetensors, or model.safetensors.index.json with the files it names.",
    )
    path = Text(
        required=False, help_text="Administrators only: a Hugging Face Llama folder on the server, instead of uploads."
    )
    name = Text(required=False, allow_blank=True, max_length=200)

    class Meta:
        model = PretrainedModel
        fields = ["id", "name", "files", "path", "size_bytes", "model", "created_at"]
        read_only_fields = ["size_bytes", "model", "created_at"]

    def create(self, validated: dict[str, Any]) -> PretrainedModel:
        user = self.context["request"].user
        return datasets.do_register_pretrained(
            user,
            validated.get("name", ""),
            uploads=validated.get("files"),
            path=validated.get("path", ""),
            by_administrator=user.is_staff,
        )


class RecipeField(serializers.ChoiceField):
    """A recipe name; a run made before recipes were kept reads as null."""

    def to_representation(self, value: Any) -> Any:
        return value or None


class RunSerializer(ModelSerializer):
    recipe = RecipeField(
        choices=list(RECIPES),
        default="tiny",
        allow_null=True,
        help_text="Defaults the spec starts from (null or left out: tiny). Reads as null for a run made "
        "before recipes were kept.",
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
    pretrained = serializers.PrimaryKeyRelatedField(
        queryset=PretrainedModel.objects.none(),
        required=False,
        allow_null=True,
        help_text="One of your pretrained models (its id) the run starts from: its model, tokenizer and weights; "
        "empty: a model initialised from spec.train.seed.",
    )
    slurm = serializers.DictField(
        required=False,
        help_text="Under the Slurm executor: overrides of the install's Slurm options (partition, account, qos, "
        "time_limit, gpus_per_node); the run shows them resolved.",
    )
    layout = serializers.CharField(source="layout_label", read_only=True)
    total_steps = serializers.IntegerField(read_only=True)
    tags = serializers.ListField(
        child=serializers.CharField(), source="tag_names", read_only=True, help_text="Set with PATCH."
    )
    project = serializers.PrimaryKeyRelatedField(
        queryset=Project.objects.none(),
        required=False,
        allow_null=True,
        help_text="A project you own or may write to (its id): its members see the run; empty: yours alone.",
    )
    owner = serializers.CharField(source="owner.username", read_only=True, help_text="Who launched the run.")

    class Meta:
        model = Run
        fields = [
            "id", "name", "recipe", "spec", "dataset", "tokenizer_run", "validation_dataset", "pretrained", "priority", "status", "status_reason", "layout", "step",
            "total_steps", "last_loss", "tokens_per_s", "restarts", "last_seq", "cancel_requested",
            "tags", "note", "project", "owner", "created_at", "started_at", "finished_at", "slurm", "slurm_job_id",
            "reservation",
        ]
        read_only_fields = [
            "status", "status_reason", "reservation", "step", "last_loss", "tokens_per_s", "restarts", "last_seq",
            "cancel_requested", "note", "created_at", "started_at", "finished_at", "slurm_job_id",
        ]
        extra_kwargs = {
            "name": {"required": False},
            "priority": {"help_text": "Higher goes first in the queue; at most your ceiling (staff set it, /api/quota/)."},
            "reservation": {"help_text": "At the head of the queue: the devices held for it, the runs whose end it waits for, and when."},
        }

    def to_representation(self, instance: Run) -> dict[str, Any]:
        data = super().to_representation(instance)
        if data.get("status") == Run.Status.QUEUED and not data.get("status_reason"):
            # Behind the head of the queue: not stored (hosts.scheduling.shown_reason); the head
            # is read once for a list.
            shared = cast(dict[str, Any], self.context)  # the list's serializers share it
            if "queue_head" not in shared:
                shared["queue_head"] = scheduling.queue_head()
            data["status_reason"] = scheduling.shown_reason(data["status"], "", shared["queue_head"])
        return data

    def get_fields(self) -> dict[str, Any]:
        fields = super().get_fields()
        request = self.context.get("request")
        if request is not None and request.user.is_authenticated:
            # Only the caller's own datasets and runs can be chosen; another user's id reads as unknown.
            fields["dataset"].queryset = Dataset.objects.filter(owner=request.user)  # type: ignore[attr-defined]
            fields["validation_dataset"].queryset = Dataset.objects.filter(owner=request.user)  # type: ignore[attr-defined]
            fields["tokenizer_run"].queryset = Run.objects.filter(owner=request.user)  # type: ignore[attr-defined]
            fields["pretrained"].queryset = PretrainedModel.objects.filter(owner=request.user)  # type: ignore[attr-defined]
            fields["project"].queryset = access.writable_projects(request.user)  # type: ignore[attr-defined]
        return fields

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        attrs["recipe"] = attrs.get("recipe") or "tiny"
        attrs["run_spec"] = specs.resolve_spec(
            attrs.get("spec", {}), attrs["recipe"], attrs.get("validation_dataset"), attrs.get("pretrained")
        )
        attrs["slurm_options"] = specs.check_slurm_options(attrs.pop("slurm", None))
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
            pretrained=validated.get("pretrained"),
            recipe=validated["recipe"],
            project=validated.get("project"),
            slurm_options=validated["slurm_options"],
        )


@extend_schema_field({"type": "string", "pattern": organise.TAG_SCHEMA_PATTERN})
class TagText(Text):
    """A tag as PATCH takes it, which `organise.check_tag` holds to TAG_PATTERN: taken as it is, not
    trimmed, so the pattern the schema states is the whole rule."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(trim_whitespace=False, **kwargs)


class OrganiseSerializer(serializers.Serializer):
    """`PATCH /api/runs/<id>/`: what the owner may change on a run after launch. Left out: unchanged."""

    tags = serializers.ListField(
        child=TagText(max_length=organise.MAX_TAG_LENGTH, error_messages={"max_length": f"a tag is {organise.TAG_RULE}"}),
        max_length=organise.MAX_TAGS,
        required=False,
        help_text=f"Replaces the run's tags; each is {organise.TAG_RULE}; at most {organise.MAX_TAGS}.",
    )
    note = Text(required=False, allow_blank=True, max_length=organise.MAX_NOTE, help_text="Free text about the run.")
    project = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=1,
        help_text="The run's owner only: a project they own or may write to (its id), or null for none.",
    )


class MemberSerializer(serializers.Serializer):
    username = Text(max_length=150, help_text="The user to add, or whose role to change.")
    role = serializers.ChoiceField(choices=ProjectMember.Role.choices, default=ProjectMember.Role.READ)


class ProjectSerializer(ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)
    role = serializers.SerializerMethodField(help_text="The caller's: owner, write or read.")
    members = serializers.SerializerMethodField()

    class Meta:
        model = Project
        fields = ["id", "name", "owner", "role", "members", "created_at"]
        read_only_fields = ["created_at"]

    def get_role(self, project: Project) -> str:
        return access.role_in(self.context["request"].user, project)

    @extend_schema_field(MemberSerializer(many=True))
    def get_members(self, project: Project) -> list[dict[str, str]]:
        return [{"username": m.user.username, "role": m.role} for m in project.members.select_related("user")]


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
    pretrained = serializers.IntegerField(
        required=False, allow_null=True, help_text="One of your pretrained models (its id) the clone starts from."
    )


class RunEventSerializer(ModelSerializer):
    class Meta:
        model = RunEvent
        fields = ["seq", "source", "source_seq", "kind", "time", "data"]


class QuantizedExportSerializer(ModelSerializer):
    """An int8/int4 export of the checkpoint: its size beside the float export's, and, once
    measured, its top-1 next-token agreement with the float export and both perplexities on
    the run's held-out prompts."""

    class Meta:
        model = QuantizedExport
        fields = [
            "id", "scheme", "status", "reason", "path", "size_bytes", "source_size_bytes", "samples", "top1",
            "top1_positions", "perplexity", "source_perplexity", "created_at", "finished_at",
        ]  # fmt: skip


class CheckpointSerializer(ModelSerializer):
    quantized_exports = QuantizedExportSerializer(many=True, read_only=True)
    export_size_bytes = serializers.SerializerMethodField(
        help_text="Weight files of the export, where it is a local folder; null otherwise or before it is made."
    )

    class Meta:
        model = Checkpoint
        fields = [
            "id", "run", "step", "path", "export_path", "export_size_bytes", "eval_loss", "created_at", "pruned_at",
            "quantized_exports",
        ]  # fmt: skip

    def get_export_size_bytes(self, checkpoint: Checkpoint) -> int | None:
        if not checkpoint.export_path or "://" in checkpoint.export_path:
            return None
        try:
            return folder_size(Path(checkpoint.export_path))
        except OSError:  # not made yet, or gone
            return None


class IngestEventSerializer(serializers.Serializer):
    seq = serializers.IntegerField(min_value=1)
    kind = Text(max_length=32)
    time = serializers.FloatField(required=False)
    # Declared fields leave the class body, so this does not replace Serializer.data at run time.
    data = serializers.DictField(required=False, default=dict)  # type: ignore[assignment]


class IngestSerializer(serializers.Serializer):
    source = serializers.RegexField(r"^node-[0-9]{1,6}$", help_text="The sending agent's node, e.g. node-0: the bearer token must be that node's.")  # type: ignore[assignment]
    events = IngestEventSerializer(many=True, allow_empty=True, max_length=10000)  # type: ignore[call-arg]


class ShippedLogSerializer(serializers.Serializer):
    """A piece of a log file of a host's run folder, from its agent's log shipper."""

    address = serializers.CharField(max_length=255, help_text="The shipping host's address.")
    node = serializers.IntegerField(min_value=0, help_text="The shipping agent's node.")
    probe = serializers.CharField(max_length=64, help_text="The token the shipper wrote into its node folder.")
    file = serializers.RegexField(r"^[A-Za-z0-9_-]{1,40}\.log$", help_text="rank<R>.log, agent-node<K>.log, …")  # type: ignore[assignment]
    offset = serializers.IntegerField(min_value=0, help_text="Where in the host's file `chunk` starts.")
    chunk = serializers.CharField(allow_blank=True, max_length=2 * 1024 * 1024, help_text="Base64 bytes, at most 1 MiB.")


class CompareQuerySerializer(serializers.Serializer):
    """The query of `GET /api/runs/compare/`, for the schema; `runs.compare.check_ids` checks it."""

    ids = serializers.RegexField(r"^\d{1,18}(,\d{1,18}){1,7}$", help_text=f"{compare.IDS_RULE}; each one of your runs.")  # type: ignore[assignment]
    all = serializers.BooleanField(required=False, default=False, help_text="Every spec field, not only those that differ.")


class FigureSerializer(serializers.Serializer):
    step = serializers.IntegerField()
    value = serializers.FloatField()


def _per_metric(name: str, field: Any) -> Any:
    return inline_serializer(name, {metric: field() for metric in compare.METRICS})


class GoodputSerializer(serializers.Serializer):
    """A run's goodput ledger (runs/goodput.py)."""

    wall_s = serializers.FloatField(help_text="From the run's first event to its last.")
    goodput = serializers.FloatField(allow_null=True, help_text="The share of it spent on productive steps.")
    seconds = serializers.DictField(
        child=serializers.FloatField(), help_text=f"Seconds by bucket: {', '.join(GOODPUT_BUCKETS)}."
    )


class ComparedRunSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    status = serializers.CharField(help_text="The run's status, as in the runs list.")
    layout = serializers.CharField(help_text="dp×tp×pp")
    recipe = serializers.CharField(allow_null=True)
    tags = serializers.ListField(child=serializers.CharField())
    step = serializers.IntegerField()
    total_steps = serializers.IntegerField()
    last_seq = serializers.IntegerField(help_text="The series hold events up to this seq; open /ws/runs/<id>/?after= it.")
    series = _per_metric(
        "ComparedSeries",
        # Each point is [step, value], in step order.
        lambda: serializers.ListField(child=serializers.ListField(child=serializers.FloatField(), min_length=2, max_length=2)),
    )
    final = _per_metric("FinalFigures", lambda: FigureSerializer(allow_null=True))
    best = _per_metric("BestFigures", lambda: FigureSerializer(allow_null=True))
    goodput = GoodputSerializer(help_text="Where the run's wall time went.")


class SpecFieldSerializer(serializers.Serializer):
    field = serializers.CharField(help_text="Dotted path in the spec, e.g. train.lr.")
    values = serializers.ListField(child=serializers.JSONField(allow_null=True), help_text="One per run, in the runs' order.")
    differs = serializers.BooleanField()


class ComparisonSerializer(serializers.Serializer):
    runs = ComparedRunSerializer(many=True)
    spec = SpecFieldSerializer(many=True, help_text="Only the fields that differ across the runs, unless all_fields.")
    all_fields = serializers.BooleanField()
