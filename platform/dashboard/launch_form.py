"""The inputs of the launch form, grouped as the form shows them.

Each input is named by its dotted path in the API's run body (`spec.layout.tp`), which is also
the path of the API's error for it, so the page puts every error next to its own input. An
input left empty is not sent and the recipe's value applies; the recipe's values are shown as
placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from training.config import FaultKind, Precision, Recompute, Schedule

InputKind = Literal["int", "float", "choice", "text"]


@dataclass(frozen=True, kw_only=True)
class Input:
    path: str  # dotted path in the API body, e.g. "spec.layout.tp"
    label: str
    kind: InputKind = "int"
    choices: tuple[Any, ...] = ()
    hint: str = ""

    @property
    def id(self) -> str:
        return "f-" + self.path.replace(".", "-")

    @property
    def recipe_key(self) -> str:
        """The path inside a recipe's spec (`layout.tp`), empty for inputs no recipe sets."""
        return self.path.removeprefix("spec.") if self.path.startswith("spec.") and "faults" not in self.path else ""


@dataclass(frozen=True, kw_only=True)
class Group:
    legend: str
    inputs: list[Input] = field(default_factory=list)
    collapsed: bool = False  # shown inside a <details> the user opens
    hint: str = ""


GROUPS = [
    Group(
        legend="Layout",
        hint="dp × tp × pp ranks in all, spread evenly over Max nodes: the product must be a multiple of it.",
        inputs=[
            Input(path="spec.layout.dp", label="Data parallel (dp)"),
            Input(path="spec.layout.tp", label="Tensor parallel (tp)"),
            Input(path="spec.layout.pp", label="Pipeline stages (pp)"),
            Input(path="spec.layout.zero", label="ZeRO stage", kind="choice", choices=(0, 1, 2, 3)),
            Input(
                path="spec.layout.recompute", label="Activation recompute", kind="choice", choices=get_args(Recompute)
            ),
            Input(path="spec.layout.schedule", label="Pipeline schedule", kind="choice", choices=get_args(Schedule)),
            Input(path="spec.layout.microbatches", label="Micro-batches"),
            Input(path="spec.layout.stages_per_rank", label="Stages per rank (interleaved)"),
            Input(path="spec.layout.precision", label="Precision", kind="choice", choices=get_args(Precision)),
        ],
    ),
    Group(
        legend="Training",
        inputs=[
            Input(path="spec.train.steps", label="Steps"),
            Input(path="spec.train.global_batch", label="Global batch (sequences)"),
            Input(path="spec.train.lr", label="Learning rate", kind="float"),
            Input(path="spec.train.checkpoint_interval", label="Checkpoint every (steps)"),
        ],
    ),
    Group(
        legend="Evaluation",
        hint="Hold out a share of the dataset (or choose a validation dataset above); the run measures its "
        "loss on it every interval and at its last step, and each checkpoint keeps that loss.",
        inputs=[
            Input(path="spec.data.validation_fraction", label="Validation split (share of the data)", kind="float"),
            Input(path="spec.train.eval_interval", label="Evaluate every (steps)", hint="0: never"),
            Input(path="spec.train.eval_batches", label="Evaluation batches"),
        ],
    ),
    Group(
        legend="Nodes",
        hint="The run continues on as few as min nodes after losing some.",
        inputs=[
            Input(path="spec.nodes.min", label="Min nodes"),
            Input(path="spec.nodes.max", label="Max nodes"),
        ],
    ),
    Group(
        legend="Custom model sizes",
        collapsed=True,
        hint="Override the recipe's model; empty inputs keep the recipe's values.",
        inputs=[
            Input(path="spec.model.n_layers", label="Layers"),
            Input(path="spec.model.dim", label="Hidden size (dim)"),
            Input(path="spec.model.n_heads", label="Attention heads"),
            Input(path="spec.model.n_kv_heads", label="KV heads"),
            Input(path="spec.model.vocab_size", label="Vocabulary size"),
            Input(path="spec.model.seq_len", label="Sequence length"),
        ],
    ),
    Group(
        legend="Inject a fault",
        collapsed=True,
        hint="For demos and drills: the run should survive it by restarting from its last checkpoint.",
        inputs=[
            Input(path="spec.faults.0.kind", label="Fault", kind="choice", choices=get_args(FaultKind)),
            Input(path="spec.faults.0.rank", label="On rank"),
            Input(path="spec.faults.0.step", label="At step"),
        ],
    ),
]


# Shown only where runs go to Slurm (FATHOM_EXECUTOR=slurm): the run's overrides of the
# install's Slurm options; an empty input takes the install's default (FATHOM_SLURM_*).
SLURM_GROUP = Group(
    legend="Slurm",
    collapsed=True,
    hint="Runs here are Slurm jobs. Empty: the install's default. Time limit: minutes, HH:MM:SS or D-HH:MM.",
    inputs=[
        Input(path="slurm.partition", label="Partition", kind="text"),
        Input(path="slurm.account", label="Account", kind="text"),
        Input(path="slurm.qos", label="QoS", kind="text"),
        Input(path="slurm.time_limit", label="Time limit", kind="text"),
        Input(path="slurm.gpus_per_node", label="GPUs per node"),
    ],
)


def groups_for(executor: str) -> list[Group]:
    """The form's groups under the install's executor."""
    return [*GROUPS, SLURM_GROUP] if executor == "slurm" else GROUPS
