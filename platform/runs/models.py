"""Datasets, training runs, their ordered event history, and their checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import models

from controlplane.events import Event
from training.run_dir import RunDir


class Dataset(models.Model):
    class Format(models.TextChoices):
        TEXT = "text", "plain text"
        JSONL = "jsonl", "JSON lines"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="datasets")
    name = models.CharField(max_length=200)
    format = models.CharField(max_length=10, choices=Format.choices)
    path = models.CharField(max_length=1000, help_text="Absolute path of the file under FATHOM_DATA_DIR.")
    size_bytes = models.BigIntegerField(default=0)
    records = models.IntegerField(default=0, help_text="Lines of text, or JSON objects.")
    sha256 = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.name


class PretrainedModel(models.Model):
    """A Hugging Face Llama folder (config.json, safetensors, tokenizer) a run may start from,
    owned like a dataset: uploaded by its owner, or a server folder an administrator registered."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="pretrained_models")
    name = models.CharField(max_length=200)
    path = models.CharField(max_length=1000, help_text="Absolute path of the folder on the server.")
    size_bytes = models.BigIntegerField(default=0)
    # The model section a run from it gets (training.config.ModelConfig, seq_len left out).
    model = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.name


class Project(models.Model):
    """Runs shared with members. Its runs stay their owners'; members read them (role `read`) or
    also change them (role `write`: tags, note, cancel, resume, launch into the project).
    `runs.access` is the one place that decides who sees and changes what."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="owned_projects")
    name = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name", "id"]

    def __str__(self) -> str:
        return self.name


class ProjectMember(models.Model):
    class Role(models.TextChoices):
        READ = "read"
        WRITE = "write"

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="members")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="project_memberships")
    role = models.CharField(max_length=5, choices=Role.choices, default=Role.READ)

    class Meta:
        ordering = ["project", "id"]
        constraints = [models.UniqueConstraint(fields=["project", "user"], name="project_member_unique")]


class Run(models.Model):
    class Status(models.TextChoices):
        QUEUED = "queued"
        STARTING = "starting"
        RUNNING = "running"
        RESTARTING = "restarting"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        CANCELLED = "cancelled"

    ACTIVE = (Status.QUEUED, Status.STARTING, Status.RUNNING, Status.RESTARTING)
    FINISHED = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="runs")
    name = models.CharField(max_length=200)
    dataset = models.ForeignKey(Dataset, null=True, blank=True, on_delete=models.PROTECT, related_name="runs")
    # A run names its data only through objects its owner may use: its dataset, and the run whose
    # tokenizer it reuses. The launcher turns these into paths; a spec never carries one from a user.
    tokenizer_run = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="tokenizer_reusers",
        help_text="An earlier run of the same owner whose tokenizer this run reuses; empty: trained on the dataset.",
    )  # fmt: skip
    validation_dataset = models.ForeignKey(
        Dataset, null=True, blank=True, on_delete=models.PROTECT, related_name="validated_runs",
        help_text="One of the owner's datasets held out for evaluation (train.eval_interval); "
        "empty: data.validation_fraction of the dataset, or none.",
    )  # fmt: skip
    pretrained = models.ForeignKey(
        PretrainedModel, null=True, blank=True, on_delete=models.PROTECT, related_name="runs",
        help_text="One of the owner's pretrained models the run starts from (its model, tokenizer and "
        "weights); empty: a model initialised from train.seed.",
    )  # fmt: skip
    spec = models.JSONField(
        help_text="The run's training.config.RunSpec as plain data, checked and resolved at submit "
        "(data paths filled in from its dataset and tokenizer run)."
    )
    status = models.CharField(max_length=12, choices=Status.choices, default=Status.QUEUED, db_index=True)
    status_reason = models.TextField(blank=True)
    cancel_requested = models.BooleanField(default=False)
    resume = models.BooleanField(default=False, help_text="Start from the latest checkpoint of this run.")
    # Progress, denormalised from events so lists need no event scan.
    step = models.IntegerField(default=0)
    last_loss = models.FloatField(null=True, blank=True)
    tokens_per_s = models.FloatField(null=True, blank=True)
    restarts = models.IntegerField(default=0)
    # Events: the run-wide sequence number last handed out (see services.do_ingest_events).
    last_seq = models.BigIntegerField(default=0)
    # The node agents' credentials and whereabouts: the launch whose node tokens are accepted
    # (`run_agents.node_token`; none before the first launch).
    token_launch = models.IntegerField(null=True, blank=True)
    agent_pids = models.JSONField(default=list, blank=True)
    last_report_at = models.DateTimeField(null=True, blank=True)
    # Each node agent's last post ({"node-0": epoch seconds}) and the ones judged silent: the run
    # page says "node-1 silent" from events, and these let the control plane decide them.
    node_reports = models.JSONField(default=dict, blank=True)
    silent_nodes = models.JSONField(default=list, blank=True)
    launch_attempts = models.IntegerField(default=0)
    # Placement on registered hosts (hosts.scheduling): higher goes first, then the older run; the
    # rendezvous endpoint (on the control plane, or a one-node run's host) is kept so a re-sent
    # launch reuses it.
    priority = models.IntegerField(default=0)
    rendezvous = models.CharField(max_length=300, blank=True)
    # The devices a queued run at the head of the queue holds in reserve (hosts.scheduling's
    # backfill gives them to no other run): {"devices": ["host:index", ...], "until": [run ids],
    # "expected_at": ISO time or null}; empty for every other run.
    reservation = models.JSONField(default=dict, blank=True)
    # The higher-priority run this one was asked to make room for (hosts.scheduling): its ranks
    # checkpoint the step they agree on and stop, and it goes back to the queue to resume there.
    preempted_by = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    # What its busiest rank holds at its peak, in MB, on a GPU and on a CPU slot (the planner's
    # estimate, `training.planner.layout_costs.rank_memory`, made at submit): placement puts it
    # only on devices that hold that much. Empty: not estimated (a run from before).
    rank_memory_mb = models.JSONField(default=dict, blank=True)
    # Organising (issue 18): the recipe the spec started from (empty: a run from before it was
    # kept), and the owner's free-text note. Tags are RunTag rows, so a filter is a join.
    recipe = models.CharField(max_length=32, blank=True, db_index=True)
    note = models.TextField(blank=True)
    project = models.ForeignKey(
        Project, null=True, blank=True, on_delete=models.SET_NULL, related_name="runs",
        help_text="Shared with the project's members; empty: the owner's alone.",
    )  # fmt: skip
    # Under the Slurm executor (launch/slurm.py): the options the run's job is submitted with
    # (the install's defaults with the run's overrides, checked at submit), and the job that
    # holds its current launch ("submitting" between the claim and sbatch's answer; empty before).
    slurm = models.JSONField(default=dict, blank=True)
    slurm_job_id = models.CharField(max_length=32, blank=True, db_index=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.status})"

    @property
    def folder(self) -> Path:
        # The creation time keeps folders apart even where ids are reused (a database reset).
        return settings.RUNS_DIR / f"{self.pk}-{self.created_at:%Y%m%d-%H%M%S-%f}"

    @property
    def run_dir(self) -> RunDir:
        """What the run's folder holds, named by the run folder contract."""
        return RunDir(self.folder)

    @property
    def tokenizer_dir(self) -> Path:
        """Where this run's ranks keep the tokenizer they trained or were given."""
        return self.run_dir.tokenizer_dir

    @property
    def layout_label(self) -> str:
        layout = self.spec.get("layout", {})
        return f"{layout.get('dp', 1)}×{layout.get('tp', 1)}×{layout.get('pp', 1)}"

    @property
    def tag_names(self) -> list[str]:
        return [tag.name for tag in self.tags.all()]

    @property
    def node_count(self) -> int:
        """How many node agents the run starts: its spec's nodes.max."""
        return int(self.spec.get("nodes", {}).get("max", 1))

    @property
    def lora_rank(self) -> int:
        """The rank of the run's LoRA adapters; 0 for a full fine-tune."""
        lora = self.spec.get("lora") or {}
        return int(lora.get("rank") or 0)

    @property
    def total_steps(self) -> int:
        return int(self.spec.get("train", {}).get("steps", 0))

    @property
    def is_active(self) -> bool:
        return self.status in self.ACTIVE


class RunTag(models.Model):
    """A short label on a run (`baseline`, `lr-sweep`); `runs.organise.check_tags` says what one may be."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="tags")
    name = models.CharField(max_length=32, db_index=True)

    class Meta:
        ordering = ["run", "id"]  # the order the owner gave them
        constraints = [models.UniqueConstraint(fields=["run", "name"], name="run_tag_unique")]

    def __str__(self) -> str:
        return self.name


class RunEvent(Event):
    """One thing that happened to a run. `seq` orders a run's history without gaps.

    Node agents number their own events per `source` (`node-0`, `control`, …); `(run, source,
    source_seq)` is unique, so a batch delivered twice is stored once.
    """

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events")
    source = models.CharField(max_length=64)
    source_seq = models.BigIntegerField()

    class Meta:
        ordering = ["run", "seq"]
        constraints = [
            models.UniqueConstraint(fields=["run", "seq"], name="run_event_seq_unique"),
            models.UniqueConstraint(fields=["run", "source", "source_seq"], name="run_event_source_seq_unique"),
        ]

    def message_fields(self) -> dict[str, Any]:
        return {"source": self.source}


class Checkpoint(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="checkpoints")
    step = models.IntegerField()
    path = models.CharField(max_length=1000)
    export_path = models.CharField(max_length=1000, blank=True, help_text="Hugging Face export, once made.")
    created_at = models.DateTimeField(auto_now_add=True)
    # Set once the trainer pruned the folder (train.keep_checkpoints): the row stays as history,
    # and only its export, if one was made, can still be deployed.
    pruned_at = models.DateTimeField(null=True, blank=True)
    # The run's held-out loss at this checkpoint's step (train.eval_interval); null: not evaluated.
    eval_loss = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["run", "step"]
        constraints = [models.UniqueConstraint(fields=["run", "step"], name="checkpoint_step_unique")]

    def __str__(self) -> str:
        return f"{self.run.name} step {self.step}"


class QuantizedExport(models.Model):
    """An int8 or int4 copy of a checkpoint's Hugging Face export, made by `serving.quantize`
    (llmcompressor) and kept for every later deploy of that checkpoint in that scheme.

    The source export is the checkpoint's (`Checkpoint.export_path`); one row per checkpoint and
    scheme. `status` moves pending → running → ready or failed, each move a conditional UPDATE
    (`runs.quantized`); a failed row is queued again when a deploy asks for it.
    """

    class Scheme(models.TextChoices):
        INT8 = "int8"  # W8A8: served as ReplicaOptions.quantization "int8_w8a8"
        INT4 = "int4"  # W4A16: served as "int4"

    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        READY = "ready"
        FAILED = "failed"

    checkpoint = models.ForeignKey(Checkpoint, on_delete=models.CASCADE, related_name="quantized_exports")
    scheme = models.CharField(max_length=8, choices=Scheme.choices)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    reason = models.TextField(blank=True, help_text="Why quantizing failed.")
    path = models.CharField(max_length=1000, blank=True, help_text="The compressed-tensors folder, once made.")
    size_bytes = models.BigIntegerField(null=True, blank=True, help_text="Weight files of the quantized export.")
    source_size_bytes = models.BigIntegerField(null=True, blank=True, help_text="Weight files of the float export.")
    calibration = models.CharField(max_length=1000, blank=True, help_text="The dataset file calibrated on.")
    samples = models.PositiveIntegerField(null=True, blank=True, help_text="Calibration documents used.")
    # Top-1 next-token agreement with the float export over serving.quality's fixed prompts,
    # once measured: the share of `top1_positions` where both served models chose the same token.
    top1 = models.FloatField(null=True, blank=True)
    top1_positions = models.PositiveIntegerField(null=True, blank=True)
    # Perplexity of this export and of the float one over the same prompts' own tokens (the
    # run's held-out text), measured with the agreement.
    perplexity = models.FloatField(null=True, blank=True)
    source_perplexity = models.FloatField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["checkpoint", "scheme"]
        constraints = [
            models.UniqueConstraint(fields=["checkpoint", "scheme"], name="quantized_export_scheme_unique")
        ]

    def __str__(self) -> str:
        return f"{self.checkpoint} {self.scheme}"
