"""Typed configuration of a training run: model, layout, optimisation, data, nodes and faults.

A `RunSpec` is what the control plane stores for a run and what every rank reads from the
run folder's spec file (`training.run_dir`). Each dataclass checks itself in `__post_init__`; cross-field rules that involve
more than one section live in `RunSpec.__post_init__`. Every failure raises `SpecError` whose
`field` is the dotted path a form or an API client shows next to the input
(`layout.tp`, `model.n_heads`), and whose message prints the offending values.

Pure Python: no torch at import, so the control plane validates specs without loading torch.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from training.field_error import FieldError

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
Recompute = Literal["none", "selective", "full"]
Precision = Literal["fp32", "bf16"]
FaultKind = Literal[
    "kill_rank", "crash_rank", "hang_rank", "kill_during_checkpoint", "slow_checkpoint", "slow_steps", "kill_agent",
    "nonfinite_grad", "corrupt_weights",
]  # fmt: skip
NonFinite = Literal["skip", "off"]


class SpecError(FieldError):
    """A spec value that is not allowed; `field` is its dotted path in the spec."""


_require = SpecError.require


def _positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(
            isinstance(value, int) and not isinstance(value, bool) and value >= 1,
            f"{section}.{name}",
            f"must be a positive integer, got {value!r}",
        )


def _choice(section: str, name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    _require(
        value in allowed,
        f"{section}.{name}",
        f"must be one of {', '.join(map(str, allowed))}; got {value!r}",
    )


Architecture = Literal["llama", "qwen2", "qwen3", "mistral"]


@dataclass(kw_only=True)
class RopeScaling:
    """Llama 3's rotary frequency scaling (transformers' `rope_type: llama3`): wavelengths longer
    than original_max_position_embeddings / low_freq_factor are stretched by `factor`, those
    shorter than original_max_position_embeddings / high_freq_factor kept, those between blended."""

    rope_type: Literal["llama3"] = "llama3"
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        _choice("model.rope_scaling", "rope_type", self.rope_type, ("llama3",))
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            _require(
                isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                f"model.rope_scaling.{name}",
                f"must be a number > 0; got {value!r}",
            )
        _require(
            self.low_freq_factor < self.high_freq_factor,
            "model.rope_scaling.high_freq_factor",
            f"must be > low_freq_factor; got high_freq_factor={self.high_freq_factor}, "
            f"low_freq_factor={self.low_freq_factor}",
        )
        _positive("model.rope_scaling", self, "original_max_position_embeddings")


@dataclass(kw_only=True)
class ModelConfig:
    """A Llama-family decoder. Names follow Hugging Face `LlamaConfig` where one exists.

    `architecture` is the Hugging Face family the model imports from and exports to; it fixes
    what the family computes beyond Llama (`qkv_bias`, `qk_norm`), so no spec can ask for a
    combination its family's exporter would not write back.
    """

    n_layers: int = 4
    dim: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: each kv head serves n_heads // n_kv_heads heads
    vocab_size: int = 2048
    seq_len: int = 128  # training context; also the exported max_position_embeddings
    ffn_dim: int = 0  # 0: SwiGLU's 8/3·dim rounded up to a multiple of 64, as Llama does
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # llama (Llama 2/3.x), qwen2 (Qwen2, Qwen2.5: bias on q, k, v), qwen3 (RMSNorm on each head
    # of q and k), mistral (Llama's computation; its attention window, below).
    architecture: Architecture = "llama"
    head_dim: int = 0  # 0: dim // n_heads. Qwen3 gives its own: n_heads · head_dim may differ from dim
    tie_embeddings: bool = False  # the output head is the embedding matrix: one parameter
    rope_scaling: RopeScaling | None = None  # None: plain rotary embeddings
    # Mistral's attention window, as its config names it (0: none). Fathom computes full causal
    # attention, which is the window's only where the window covers the whole training context.
    sliding_window: int = 0

    def __post_init__(self) -> None:
        _positive("model", self, "n_layers", "dim", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
        _choice("model", "architecture", self.architecture, get_args(Architecture))
        _require(
            isinstance(self.head_dim, int) and not isinstance(self.head_dim, bool) and self.head_dim >= 0,
            "model.head_dim",
            f"must be a positive integer (0: dim / n_heads); got {self.head_dim!r}",
        )
        if self.head_dim == 0:
            _require(
                self.dim % self.n_heads == 0,
                "model.dim",
                f"must be divisible by model.n_heads; got dim={self.dim}, n_heads={self.n_heads}",
            )
            _require(
                (self.dim // self.n_heads) % 2 == 0,
                "model.dim",
                f"dim / n_heads (head size) must be even for rotary embeddings; got {self.dim}/{self.n_heads}",
            )
            self.head_dim = self.dim // self.n_heads
        _require(
            self.head_dim % 2 == 0,
            "model.head_dim",
            f"must be even for rotary embeddings; got {self.head_dim}",
        )
        _require(
            self.n_heads % self.n_kv_heads == 0,
            "model.n_kv_heads",
            f"must divide model.n_heads; got n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}",
        )
        _require(self.ffn_dim >= 0, "model.ffn_dim", f"must be ≥ 0 (0 = automatic); got {self.ffn_dim}")
        _require(self.vocab_size >= 256, "model.vocab_size", f"must be ≥ 256 (byte-level BPE); got {self.vocab_size}")
        _require(
            isinstance(self.tie_embeddings, bool),
            "model.tie_embeddings",
            f"must be true or false; got {self.tie_embeddings!r}",
        )
        if isinstance(self.rope_scaling, dict):  # as JSON gives it
            self.rope_scaling = _build("model.rope_scaling", RopeScaling, self.rope_scaling)
        _require(
            self.rope_scaling is None or isinstance(self.rope_scaling, RopeScaling),
            "model.rope_scaling",
            f"must be an object with rope_type llama3, or null; got {self.rope_scaling!r}",
        )
        _require(
            isinstance(self.sliding_window, int) and self.sliding_window >= 0,
            "model.sliding_window",
            f"must be a whole number ≥ 0 (0: none); got {self.sliding_window!r}",
        )
        if self.sliding_window:
            _require(
                self.architecture == "mistral",
                "model.sliding_window",
                f"is Mistral's; must be 0 for architecture {self.architecture}; got {self.sliding_window}",
            )
            _require(
                self.seq_len <= self.sliding_window,
                "model.seq_len",
                f"must be ≤ model.sliding_window={self.sliding_window}: Fathom computes full attention, "
                f"which equals the window's only where the window covers the training context; "
                f"got seq_len={self.seq_len}",
            )
        if self.ffn_dim == 0:
            self.ffn_dim = 64 * -(-(8 * self.dim // 3) // 64)

    @property
    def qkv_bias(self) -> bool:
        """Bias on the q, k and v projections (Qwen2's attention)."""
        return self.architecture == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """RMSNorm over each head of q and k, before rotary (Qwen3's attention)."""
        return self.architecture == "qwen3"

    def num_params(self) -> int:
        """Parameter count; a tied output head counts once, with the embedding."""
        q_and_kv = self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
        attn = self.dim * (q_and_kv + self.n_heads * self.head_dim)
        if self.qkv_bias:
            attn += q_and_kv
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * self.dim * self.ffn_dim
        per_layer = attn + mlp + 2 * self.dim
        embeddings = (1 if self.tie_embeddings else 2) * self.vocab_size * self.dim
        return self.n_layers * per_layer + embeddings + self.dim


@dataclass(kw_only=True)
class LayoutConfig:
    """How the ranks split the work: data × tensor × pipeline parallel, sharding, recompute."""

    dp: int = 1  # data-parallel replicas (sharded by FSDP2 when zero > 0)
    tp: int = 1  # tensor-parallel degree (heads and MLP columns split across ranks)
    pp: int = 1  # pipeline stages across ranks
    zero: int = 0  # 0: replicate (all-reduce); 1/2: shard optimizer (+grads); 3: shard parameters too
    schedule: Schedule = "1f1b"
    microbatches: int = 1  # pipeline micro-batches per local batch
    stages_per_rank: int = 1  # >1 only with the interleaved schedule (virtual stages)
    recompute: Recompute = "none"
    # zero=0: all-reduce gradients during backward (bucket by bucket) instead of after it. FSDP
    # (zero 1-3) always reduce-scatters each unit's gradients during backward.
    overlap_grad_reduce: bool = True
    precision: Precision = "fp32"

    def __post_init__(self) -> None:
        _positive("layout", self, "dp", "tp", "pp", "microbatches", "stages_per_rank")
        _choice("layout", "zero", self.zero, (0, 1, 2, 3))
        _choice("layout", "schedule", self.schedule, get_args(Schedule))
        _choice("layout", "recompute", self.recompute, get_args(Recompute))
        _choice("layout", "precision", self.precision, get_args(Precision))
        if self.schedule != "interleaved_1f1b":
            _require(
                self.stages_per_rank == 1,
                "layout.stages_per_rank",
                f"must be 1 unless layout.schedule is interleaved_1f1b; got {self.stages_per_rank}",
            )
        if self.pp > 1 and self.schedule != "gpipe":
            _require(
                self.microbatches >= self.pp,
                "layout.microbatches",
                f"the {self.schedule} schedule needs at least one micro-batch per stage; "
                f"got microbatches={self.microbatches}, pp={self.pp}",
            )
        _require(
            isinstance(self.overlap_grad_reduce, bool), "layout.overlap_grad_reduce",
            f"must be true or false; got {self.overlap_grad_reduce!r}",
        )  # fmt: skip
        if self.zero > 0:
            _require(self.dp > 1, "layout.zero", f"ZeRO stage {self.zero} shards over dp, which is 1; use zero=0")
            _require(
                self.overlap_grad_reduce, "layout.overlap_grad_reduce",
                f"FSDP (zero {self.zero}) always reduces each unit's gradients during backward; "
                "false applies to zero=0 only",
            )  # fmt: skip

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation and checkpointing."""

    steps: int = 50
    global_batch: int = 8  # sequences per optimizer step, summed over data-parallel ranks
    grad_accum: int = 1  # forward/backward passes per optimizer step on each dp rank
    lr: float = 3e-3
    min_lr: float = 3e-4  # floor of the cosine decay
    warmup_steps: int = 5
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    seed: int = 1234
    # Steps between checkpoints; 0: chosen by Young's rule, √(2 · save cost · time between
    # failures), from what the run measures (training/checkpoint_policy.py). The last step is
    # always saved.
    checkpoint_interval: int = 0
    keep_checkpoints: int = 3  # committed checkpoints kept; older ones are deleted
    # Saves copy the state on a background thread and write it on another, costing the training
    # loop milliseconds instead of the whole write; that is what makes frequent saves affordable.
    async_checkpoint: bool = True
    # Under a node agent, each rank also copies its state into shared memory on a schedule of its
    # own (training/memory_snapshot.py): a rank restarted on a host that survived resumes from
    # there, losing a fraction of a second of work instead of half a checkpoint interval.
    memory_snapshots: bool = True
    # Steps between evaluations on the held-out data (data.validation_fraction or
    # data.validation_dataset); 0: never. The last step is always evaluated when this is set,
    # so the final checkpoint carries an eval loss.
    eval_interval: int = 0
    # Global batches of held-out sequences per evaluation: the same sequences every time, so
    # evaluations compare across steps, restarts and layouts.
    eval_batches: int = 4
    # Bitwise-reproducible kernels (training.device.make_deterministic): a resume then replays the
    # uninterrupted run's losses exactly on GPUs too, where some kernels (an embedding's backward,
    # scatter-adds) sum in a varying order and cuBLAS picks its workspace per call. It costs GPU
    # throughput (slower deterministic kernels, a smaller cuBLAS workspace); CPU kernels are
    # deterministic already, so CPU runs pay nothing.
    deterministic: bool = False

    def __post_init__(self) -> None:
        _positive("train", self, "steps", "global_batch", "grad_accum", "keep_checkpoints", "eval_batches")
        _require(
            isinstance(self.deterministic, bool), "train.deterministic", f"must be true or false; got {self.deterministic!r}"
        )
        _require(
            isinstance(self.eval_interval, int) and not isinstance(self.eval_interval, bool) and self.eval_interval >= 0,
            "train.eval_interval",
            f"must be a whole number of steps ≥ 0 (0: no evaluation); got {self.eval_interval!r}",
        )
        _require(
            isinstance(self.checkpoint_interval, int) and self.checkpoint_interval >= 0,
            "train.checkpoint_interval",
            f"must be a whole number of steps ≥ 0 (0: automatic); got {self.checkpoint_interval!r}",
        )
        _require(self.lr > 0, "train.lr", f"must be > 0; got {self.lr}")
        _require(
            0 <= self.min_lr <= self.lr, "train.min_lr", f"must be between 0 and train.lr={self.lr}; got {self.min_lr}"
        )
        _require(
            0 <= self.warmup_steps <= self.steps,
            "train.warmup_steps",
            f"must be between 0 and train.steps={self.steps}; got {self.warmup_steps}",
        )
        _require(self.weight_decay >= 0, "train.weight_decay", f"must be ≥ 0; got {self.weight_decay}")
        _require(self.grad_clip >= 0, "train.grad_clip", f"must be ≥ 0 (0 disables); got {self.grad_clip}")


@dataclass(kw_only=True)
class NodesConfig:
    """Hosts of the run. `min`..`max` nodes: the run goes on with as few as `min` after losing nodes."""

    min: int = 1
    max: int = 1
    nproc_per_node: int = 0  # ranks per node; 0: world size / max
    # Restarts in a row without progress before the run fails. An attempt that commits a newer
    # checkpoint than it resumed from gives the whole budget back: a long run meets failures now
    # and then (Llama 3 405B: 419 interruptions in 54 days) and must not die of their total, while
    # a crash loop (a fault the checkpoint replays) still ends after this many tries. Chosen over
    # a sliding time window because it needs no notion of how often failures are normal.
    max_restarts: int = 3
    heartbeat_timeout: float = 10.0  # seconds without a heartbeat before a rank is declared hung

    def __post_init__(self) -> None:
        _positive("nodes", self, "min", "max")
        _require(self.min <= self.max, "nodes.min", f"must be ≤ nodes.max; got min={self.min}, max={self.max}")
        _require(self.nproc_per_node >= 0, "nodes.nproc_per_node", f"must be ≥ 0; got {self.nproc_per_node}")
        _require(self.max_restarts >= 0, "nodes.max_restarts", f"must be ≥ 0; got {self.max_restarts}")
        _require(
            self.heartbeat_timeout > 0,
            "nodes.heartbeat_timeout",
            f"must be > 0 seconds; got {self.heartbeat_timeout}",
        )


@dataclass(kw_only=True)
class DataConfig:
    """Where the text comes from; paths are filled in by whoever prepares the run folder."""

    dataset: str = ""  # a .txt or .jsonl file; empty: the built-in demo corpus
    tokenizer: str = ""  # a tokenizer.json; empty: trained on the dataset
    # A Hugging Face Llama folder (config.json, safetensors, tokenizer.json) to start from, filled
    # in by the control plane like the paths above: the model section and the tokenizer then come
    # from it (training.pretrained.resolve). Empty: a model initialised from train.seed.
    pretrained: str = ""
    # The storage URL (FATHOM_STORAGE_URL) the run's checkpoints live under, filled in by the
    # control plane at submit when it is not the run folder's own file system: `s3://bucket/prefix`
    # (training.checkpoint_storage). Empty: the run folder.
    storage: str = ""
    # Held-out data for evaluation (train.eval_interval), one of two kinds: a second .txt or
    # .jsonl file, tokenized with the run's tokenizer (filled in by the control plane from a
    # dataset the owner chose, like `dataset`), or this share of the dataset's sequences, the
    # last ones of the token file, which training then never reads.
    validation_dataset: str = ""
    validation_fraction: float = 0.0

    def __post_init__(self) -> None:
        _require(
            isinstance(self.validation_fraction, (int, float))
            and not isinstance(self.validation_fraction, bool)
            and 0 <= self.validation_fraction <= MAX_VALIDATION_FRACTION,
            "data.validation_fraction",
            f"must be between 0 and {MAX_VALIDATION_FRACTION} (a share of the dataset's sequences); "
            f"got {self.validation_fraction!r}",
        )
        _require(
            not (self.validation_dataset and self.validation_fraction > 0),
            "data.validation_fraction",
            f"must be 0 when data.validation_dataset is given (one held-out source); got {self.validation_fraction}",
        )

    @property
    def has_validation(self) -> bool:
        return bool(self.validation_dataset) or self.validation_fraction > 0


# Holding out more than half the data would leave less to train on than to measure with.
MAX_VALIDATION_FRACTION = 0.5


# The linear layers of a block an adapter may sit on, in the model's (and PEFT's) names.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters (LoRA) on a frozen pretrained base: each target linear W computes
    W·x + (alpha / rank) · B·A·dropout(x), and only A (rank × in) and B (out × rank) train.
    `rank` 0 (the default) is a full fine-tune; the other fields then mean nothing."""

    rank: int = 0
    alpha: float = 16.0  # the update is scaled by alpha / rank, as PEFT's `lora_alpha`
    dropout: float = 0.0  # on the adapter's input only; the base path sees x unchanged
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))  # every projection of a block

    def __post_init__(self) -> None:
        _require(
            isinstance(self.rank, int) and not isinstance(self.rank, bool) and self.rank >= 0,
            "lora.rank",
            f"must be a whole number ≥ 0 (0: no LoRA, a full fine-tune); got {self.rank!r}",
        )
        _require(
            isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool) and self.alpha > 0,
            "lora.alpha",
            f"must be a number > 0; got {self.alpha!r}",
        )
        _require(
            isinstance(self.dropout, (int, float)) and not isinstance(self.dropout, bool) and 0 <= self.dropout < 1,
            "lora.dropout",
            f"must be a number in [0, 1); got {self.dropout!r}",
        )
        _require(
            isinstance(self.targets, list) and all(isinstance(t, str) for t in self.targets),
            "lora.targets",
            f"must be a list of projection names ({', '.join(LORA_TARGETS)}); got {self.targets!r}",
        )
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        _require(
            not unknown,
            "lora.targets",
            f"must name projections the model has: {', '.join(LORA_TARGETS)}; got {', '.join(map(repr, unknown))}",
        )
        _require(
            len(set(self.targets)) == len(self.targets),
            "lora.targets",
            f"names a projection twice: {self.targets}",
        )
        if self.rank:
            _require(bool(self.targets), "lora.targets", "must name at least one projection for a LoRA run")
        # One order whatever order the spec gave: parameter names and PEFT's target_modules follow it.
        self.targets = [t for t in LORA_TARGETS if t in self.targets]

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


DEVICES = ("", "gpu", "cpu", "any")
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


@dataclass(kw_only=True)
class ResourcesConfig:
    """What the run asks of the cluster beyond its device count (the scheduler reads it; the
    ranks do not). `device`: "gpu", "cpu" or "any" (GPU hosts first); empty: GPUs where the
    cluster has GPU hosts, else CPU slots. `labels`: a selector of host labels,
    `zone=a,gpu=h200`: every one must match a host's for the run to be placed there."""

    device: str = ""
    labels: str = ""

    def __post_init__(self) -> None:
        _require(self.device in DEVICES, "resources.device", f"must be gpu, cpu or any (empty: gpu where the cluster has GPUs); got {self.device!r}")
        self.selector()

    def selector(self) -> dict[str, str]:
        """The label selector as {key: value}; a malformed one is a SpecError naming `resources.labels`."""
        wanted: dict[str, str] = {}
        for term in filter(None, (t.strip() for t in self.labels.split(","))):
            key, equals, value = term.partition("=")
            _require(
                bool(equals) and bool(LABEL.fullmatch(key.strip())) and bool(LABEL.fullmatch(value.strip())),
                "resources.labels",
                f"must be key=value terms separated by commas (letters, digits, '_', '.', '-'); got {term!r}",
            )
            wanted[key.strip()] = value.strip()
        return wanted


@dataclass(kw_only=True)
class GuardConfig:
    """What every rank does, alike, when a step goes wrong (training/guard.py, docs/training.md).

    A step whose loss or global gradient norm is not finite (NaN or inf: a corrupt batch, an
    overflow): "skip" leaves the weights and the optimizer's state as they were and moves on to
    the next batch; "off" trains through it, as before the guard existed.

    A loss spike: the step's loss more than `spike_zscore` standard deviations above the mean of
    the `window` steps before it (the deviation floored at 1 % of the mean, so that a flat
    plateau's tiny noise does not make every blip a spike); 0 turns it off. A spike, or
    `max_nonfinite_in_a_row` skipped steps in a row, rolls every rank back to the newest
    checkpoint or in-memory snapshot from before it, skips the batches from there to the spike
    and at least `rollback_skip_batches`, and trains on. The rollback after `max_rollbacks`
    fails the run, naming the spikes."""

    nonfinite: NonFinite = "skip"
    max_nonfinite_in_a_row: int = 5
    spike_zscore: float = 6.0
    window: int = 100  # steps of trailing loss a spike is measured against; none is judged before
    # PaLM skipped 200-500 batches around each spike at 540B parameters; most runs are smaller.
    rollback_skip_batches: int = 50
    max_rollbacks: int = 3
    # A rank whose own time per step (up to the end of its backward pass, so not the time it waits
    # for the others) exceeds the median of the other ranks' by this share for `straggler_steps`
    # steps in a row is reported as a straggler, and again once it is back in line; 0 turns it off.
    straggler_margin: float = 0.25
    straggler_steps: int = 20

    def __post_init__(self) -> None:
        _choice("guard", "nonfinite", self.nonfinite, get_args(NonFinite))
        _positive("guard", self, "straggler_steps")
        _require(
            isinstance(self.straggler_margin, (int, float)) and not isinstance(self.straggler_margin, bool)
            and 0 <= self.straggler_margin <= 10,
            "guard.straggler_margin",
            f"must be a number from 0 (off) to 10 (a share of the other ranks' median step); got {self.straggler_margin!r}",
        )  # fmt: skip
        _positive("guard", self, "max_nonfinite_in_a_row", "max_rollbacks")
        _require(
            isinstance(self.spike_zscore, (int, float)) and not isinstance(self.spike_zscore, bool)
            and (self.spike_zscore == 0 or self.spike_zscore >= 2),
            "guard.spike_zscore",
            f"must be 0 (off) or a number ≥ 2 (standard deviations); got {self.spike_zscore!r}",
        )  # fmt: skip
        _require(
            isinstance(self.window, int) and not isinstance(self.window, bool) and self.window >= 8,
            "guard.window",
            f"must be an integer ≥ 8 (steps); got {self.window!r}",
        )
        _require(
            isinstance(self.rollback_skip_batches, int) and not isinstance(self.rollback_skip_batches, bool)
            and self.rollback_skip_batches >= 0,
            "guard.rollback_skip_batches",
            f"must be an integer ≥ 0; got {self.rollback_skip_batches!r}",
        )  # fmt: skip


@dataclass(kw_only=True)
class FaultSpec:
    """A failure injected on purpose, for tests and demos."""

    kind: FaultKind
    rank: int = 0
    step: int = 1
    node: int = 0
    once: bool = True  # fire only on the first attempt, so the resumed run can finish

    def __post_init__(self) -> None:
        _choice("faults", "kind", self.kind, get_args(FaultKind))
        _require(self.rank >= 0, "faults.rank", f"must be ≥ 0; got {self.rank}")
        _require(self.step >= 1, "faults.step", f"must be ≥ 1; got {self.step}")


@dataclass(kw_only=True)
class RunSpec:
    model: ModelConfig = field(default_factory=ModelConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    nodes: NodesConfig = field(default_factory=NodesConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    faults: list[FaultSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        m, lay, t, n = self.model, self.layout, self.train, self.nodes
        for name, value in (("n_heads", m.n_heads), ("n_kv_heads", m.n_kv_heads)):
            _require(
                value % lay.tp == 0,
                "layout.tp",
                f"must divide model.{name}; got tp={lay.tp}, {name}={value}",
            )
        _require(
            m.ffn_dim % lay.tp == 0, "layout.tp", f"must divide model.ffn_dim; got tp={lay.tp}, ffn_dim={m.ffn_dim}"
        )
        _require(
            m.vocab_size % lay.tp == 0,
            "layout.tp",
            f"must divide model.vocab_size; got tp={lay.tp}, vocab_size={m.vocab_size}",
        )
        _require(
            m.seq_len % lay.tp == 0,
            "layout.tp",
            f"must divide model.seq_len (sequence parallel); got tp={lay.tp}, seq_len={m.seq_len}",
        )
        stages = lay.pp * lay.stages_per_rank
        _require(
            not (m.tie_embeddings and lay.pp > 1),
            "layout.pp",
            f"must be 1 for a model with tied embeddings (model.tie_embeddings): the embedding and the "
            f"output head are one parameter, which pipeline stages cannot share; got pp={lay.pp}",
        )
        _require(
            m.n_layers >= stages,
            "layout.pp",
            f"pp × stages_per_rank = {stages} pipeline stages need at least that many layers; "
            f"got model.n_layers={m.n_layers}",
        )
        _require(
            t.global_batch % lay.dp == 0,
            "train.global_batch",
            f"must be divisible by layout.dp; got global_batch={t.global_batch}, dp={lay.dp}",
        )
        local = t.global_batch // lay.dp
        _require(
            local % t.grad_accum == 0,
            "train.grad_accum",
            f"must divide the per-replica batch global_batch/dp = {local}; got grad_accum={t.grad_accum}",
        )
        micro = local // t.grad_accum
        if lay.pp > 1:
            _require(
                micro % lay.microbatches == 0,
                "layout.microbatches",
                f"must divide the per-replica batch per accumulation step "
                f"(global_batch/dp/grad_accum = {micro}); got microbatches={lay.microbatches}",
            )
        nproc = n.nproc_per_node or lay.world_size // n.max
        _require(
            nproc * n.max == lay.world_size,
            "layout.dp",
            f"dp·tp·pp must equal the world size nodes.max × nproc_per_node; "
            f"got dp·tp·pp={lay.dp}·{lay.tp}·{lay.pp}={lay.world_size}, nodes.max={n.max}, nproc_per_node={nproc}",
        )
        if n.min < n.max:
            _require(
                lay.tp * lay.pp <= nproc * n.min and (nproc * n.min) % (lay.tp * lay.pp) == 0,
                "nodes.min",
                f"the survivors ({n.min} nodes × {nproc} ranks) must still hold whole tp·pp groups "
                f"of {lay.tp * lay.pp} ranks",
            )
        if t.eval_interval > 0:
            _require(
                self.data.has_validation,
                "train.eval_interval",
                f"needs held-out data: set data.validation_fraction (0 < f ≤ {MAX_VALIDATION_FRACTION}) or "
                f"choose a validation dataset; got eval_interval={t.eval_interval} and neither",
            )
            _require(
                t.eval_interval <= t.steps,
                "train.eval_interval",
                f"must be ≤ train.steps={t.steps} (0: no evaluation); got {t.eval_interval}",
            )
        if self.lora.enabled:
            _require(
                bool(self.data.pretrained),
                "data.pretrained",
                "a LoRA run (lora.rank > 0) trains adapters on a pretrained base: choose a pretrained model; "
                "got none",
            )
            _require(
                self.lora.dropout == 0 or lay.tp == 1,
                "lora.dropout",
                f"must be 0 under tensor parallelism (layout.tp={lay.tp}): the ranks of a tp group would "
                f"draw different masks for the one input they share; got {self.lora.dropout}",
            )
        for i, fault in enumerate(self.faults):
            _require(
                fault.rank < lay.world_size,
                f"faults.{i}.rank",
                f"must be < world size {lay.world_size}; got {fault.rank}",
            )
            _require(fault.step <= t.steps, f"faults.{i}.step", f"must be ≤ train.steps={t.steps}; got {fault.step}")

    @property
    def nproc_per_node(self) -> int:
        return self.nodes.nproc_per_node or self.layout.world_size // self.nodes.max

    def resized(self, *, world_size: int, nodes: int, nproc: int) -> RunSpec:
        """This spec for a world the rendezvous formed with another size than planned.

        Only data parallelism shrinks: tp·pp groups stay whole (`nodes.min` was checked to allow
        that), the global batch stays, so every dp replica takes a larger share of it and the
        optimisation continues as planned; the trainer reshards from the checkpoint. Built from
        this spec's values (every section checks itself again), not by parsing it anew.
        """
        if world_size == self.layout.world_size:
            return self
        group = self.layout.tp * self.layout.pp
        if world_size % group:
            raise SpecError("layout", f"world size {world_size} does not hold whole tp·pp groups of {group}")
        spec = copy.deepcopy(self)
        return dataclasses.replace(
            spec,
            layout=dataclasses.replace(spec.layout, dp=world_size // group),
            nodes=dataclasses.replace(spec.nodes, max=nodes, min=min(spec.nodes.min, nodes), nproc_per_node=nproc),
            # Faults aimed at ranks that no longer exist can no longer fire.
            faults=[f for f in spec.faults if f.rank < world_size],
        )

    # --- JSON round trip -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        if not self.lora.enabled:
            del values["lora"]  # a full fine-tune's spec reads as it did before LoRA existed
        if self.guard == GuardConfig():
            del values["guard"]  # and one with the default guard as it did before the guard
        return values

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSpec:
        """Builds a spec from plain data; unknown keys and wrong types raise `SpecError`."""
        if not isinstance(data, dict):
            raise SpecError("spec", f"must be an object; got {type(data).__name__}")
        sections: dict[str, type] = {
            "model": ModelConfig,
            "layout": LayoutConfig,
            "train": TrainConfig,
            "data": DataConfig,
            "nodes": NodesConfig,
            "resources": ResourcesConfig,
            "lora": LoraConfig,
            "guard": GuardConfig,
        }
        unknown = set(data) - set(sections) - {"faults"}
        if unknown:
            name = sorted(unknown)[0]
            raise SpecError(name, f"is not a spec section; allowed: {', '.join([*sections, 'faults'])}")
        kwargs: dict[str, Any] = {name: _build(name, section, data.get(name, {})) for name, section in sections.items()}
        faults = data.get("faults", [])
        if not isinstance(faults, list):
            raise SpecError("faults", f"must be a list; got {type(faults).__name__}")
        kwargs["faults"] = [_build(f"faults.{i}", FaultSpec, f) for i, f in enumerate(faults)]
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True, kw_only=True)
class NodePlan:
    """What a node agent takes from a run's spec: the `nodes` section, the planned world size and
    where the checkpoints are (`data.storage`).

    The agent reads only these of the spec file; the ranks parse the whole spec and
    derive their own from it when the rendezvous formed a smaller world (`RunSpec.resized`), so
    between the API and a rank the spec is parsed twice in all: at submit and in the rank.
    """

    nodes: NodesConfig
    world_size: int
    storage: str = ""  # data.storage: where the run's checkpoints are, so the agent can see its progress

    @property
    def nproc_per_node(self) -> int:
        return self.nodes.nproc_per_node or self.world_size // self.nodes.max

    @classmethod
    def from_json(cls, text: str) -> NodePlan:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise SpecError("spec", f"must be an object; got {type(data).__name__}")
        layout = _build("layout", LayoutConfig, data.get("layout", {}))
        storage = data.get("data", {}).get("storage", "") if isinstance(data.get("data"), dict) else ""
        return cls(
            nodes=_build("nodes", NodesConfig, data.get("nodes", {})),
            world_size=layout.world_size,
            storage=storage if isinstance(storage, str) else "",
        )


def _build(section: str, cls: type, values: Any) -> Any:
    if not isinstance(values, dict):
        raise SpecError(section, f"must be an object; got {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in values.items():
        if key not in fields:
            raise SpecError(f"{section}.{key}", f"is not a known field; allowed: {', '.join(fields)}")
        expected = fields[key].type
        if expected in ("int", "float", "bool", "str") and not _is_type(value, expected):
            raise SpecError(f"{section}.{key}", f"must be {_article(expected)}; got {value!r}")
    try:
        return cls(**values)
    except TypeError as exc:  # a required field is missing
        raise SpecError(section, str(exc)) from None
    except SpecError as exc:
        # A list item (faults.0) checks itself as "faults.kind"; name the item.
        head = section.split(".")[0]
        if section != head and exc.field.startswith(head + ".") and not exc.field.startswith(section + "."):
            raise SpecError(section + exc.field.removeprefix(head), exc.message) from None
        raise


def _is_type(value: Any, name: str) -> bool:
    if name == "bool":
        return isinstance(value, bool)
    if name == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, str)


def _article(name: str) -> str:
    return {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}[name]


# --- Named recipes ----------------------------------------------------------------------------


def tiny(**layout: Any) -> RunSpec:
    """A model that trains in seconds on a laptop CPU: for tests and the demo.

    Head size 32 is the smallest vLLM's CPU attention kernels serve, so its exports deploy.
    """
    return RunSpec(
        model=ModelConfig(n_layers=4, dim=128, n_heads=4, n_kv_heads=2, vocab_size=512, seq_len=64),
        layout=LayoutConfig(**layout),
        train=TrainConfig(steps=30, global_batch=8),
    )


def small(**layout: Any) -> RunSpec:
    """≈ 20M parameters: big enough that matmuls dominate, small enough for a CPU benchmark."""
    return RunSpec(
        model=ModelConfig(n_layers=6, dim=384, n_heads=6, n_kv_heads=2, vocab_size=8192, seq_len=256),
        layout=LayoutConfig(**layout),
        train=TrainConfig(steps=200, global_batch=16),
    )


def llama_1b(**layout: Any) -> RunSpec:
    """Llama 3.2 1B's shape."""
    return RunSpec(
        model=ModelConfig(
            n_layers=16,
            dim=2048,
            n_heads=32,
            n_kv_heads=8,
            vocab_size=128256,
            seq_len=8192,
            ffn_dim=8192,
            rope_theta=500000.0,
        ),
        layout=LayoutConfig(**layout),
        train=TrainConfig(
            steps=10000, global_batch=512, lr=3e-4, min_lr=3e-5, warmup_steps=200
        ),
    )


def llama_8b(**layout: Any) -> RunSpec:
    """Llama 3 8B's shape."""
    return RunSpec(
        model=ModelConfig(
            n_layers=32,
            dim=4096,
            n_heads=32,
            n_kv_heads=8,
            vocab_size=128256,
            seq_len=8192,
            ffn_dim=14336,
            rope_theta=500000.0,
        ),
        layout=LayoutConfig(**layout),
        train=TrainConfig(
            steps=10000, global_batch=1024, lr=3e-4, min_lr=3e-5, warmup_steps=500
        ),
    )


RECIPES = {"tiny": tiny, "small": small, "1b": llama_1b, "8b": llama_8b}
