"""What a model is made of, as the layout costs count it: the presets beyond the recipes (Llama 3
70B and 405B), a model's shape for one layout (`Shape`), its parameters and FLOPs per token, and
the tensors a layer saves for backward under each recompute setting (`Saved`). Plain numbers, no
torch."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from training.config import (
    RECIPES,
    ModelConfig,
    Recompute,
    SpecError,
)
from training.metrics import flops_per_token


def llama3_70b() -> ModelConfig:
    return ModelConfig(
        n_layers=80,
        dim=8192,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        seq_len=8192,
        ffn_dim=28672,
        rope_theta=500000.0,
    )


def llama3_405b() -> ModelConfig:
    return ModelConfig(
        n_layers=126,
        dim=16384,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        seq_len=8192,
        ffn_dim=53248,
        rope_theta=500000.0,
    )


def model_preset(name: str) -> ModelConfig:
    """A recipe's model (tiny, small, 1b, 8b) or one of the planner's larger shapes (70b, 405b)."""
    if name in RECIPES:
        return RECIPES[name]().model
    extra = {"70b": llama3_70b, "405b": llama3_405b}
    if name in extra:
        return extra[name]()
    raise SpecError("model", f"must be one of {', '.join([*RECIPES, *extra])}; got {name!r}")


MODEL_NAMES = (*RECIPES, "70b", "405b")


@dataclass(frozen=True)
class Shape:
    """The model's sizes under the planner's usual letters."""

    L: int  # layers
    h: int  # hidden size
    a: int  # query heads
    k: int  # key/value heads
    f: int  # SwiGLU inner size
    V: int  # vocabulary
    s: int  # sequence length
    d: int = 0  # head size; 0: h / a
    qkv_bias: bool = False  # biases on q, k, v (Qwen2), split by tp with their columns
    qk_norm: bool = False  # a head_dim gain on q and on k (Qwen3), replicated on every tp rank
    tied: bool = False  # the output head is the embedding: one V·h matrix

    @classmethod
    def of(cls, m: ModelConfig) -> Shape:
        return cls(
            m.n_layers, m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size, m.seq_len,
            m.head_dim, m.qkv_bias, m.qk_norm, m.tie_embeddings,
        )  # fmt: skip

    @property
    def head_size(self) -> int:
        return self.d or self.h // self.a

    @property
    def kv(self) -> float:
        """Width of k (or v) relative to q: grouped-query attention's k/a."""
        return self.k / self.a

    def layer_matmul_params(self) -> int:
        """q, o: h·a·d each (h·h where a·d = h); k, v: h·k·d each; gate, up, down: h·f each. All split by tp."""
        d = self.head_size
        return 2 * self.h * self.a * d + 2 * self.h * self.k * d + 3 * self.h * self.f

    def layer_split_params(self) -> int:
        """What tp splits of a layer: its matmul weights and the q, k, v biases split with their columns."""
        return self.layer_matmul_params() + (self.a + 2 * self.k) * self.head_size * int(self.qkv_bias)

    def layer_norm_params(self) -> int:
        """Two RMSNorm weights (and the per-head q and k gains), replicated on every tp rank."""
        return 2 * self.h + 2 * self.head_size * int(self.qk_norm)

    @property
    def vocab_matrices(self) -> int:
        """Distinct V·h matrices: the embedding and the head, or the one they share."""
        return 1 if self.tied else 2


def num_params(m: ModelConfig) -> int:
    """Matches `ModelConfig.num_params()`: layers, embedding and head (once when tied), final norm."""
    s = Shape.of(m)
    return s.L * (s.layer_split_params() + s.layer_norm_params()) + s.vocab_matrices * s.V * s.h + s.h


def model_flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs per token used for MFU: `training.metrics.flops_per_token` itself (6 per matmul
    weight, causal attention's score and value matmuls at half their unmasked 12·L·h·s), so the
    planner's MFU is the one the trainer reports."""
    return flops_per_token(m)


# --- Activations ----------------------------------------------------------------------------------

Split = Literal["sequence", "heads", "gathered"]
Kind = Literal["act", "fp32"]


@dataclass(frozen=True)
class Saved:
    """A tensor autograd keeps from forward to backward, per token of a micro-batch.

    split: how tensor parallelism divides it — "sequence" (sequence-parallel slice, /tp),
    "heads" (heads or MLP columns, /tp), "gathered" (every tp rank holds it whole).
    kind: "act" is a matmul or attention output, in the compute precision (2 bytes under bf16
    autocast, 4 in fp32); "fp32" is the residual stream, the norms and softmax statistics.
    with_tp: exists only when tp > 1 (a reduce-scatter's output).
    autocast_copies: how many bf16 copies autocast makes of it under bf16 (it casts an fp32 input
    once per matmul that reads it, and caches casts of weights only).
    """

    name: str
    split: Split
    kind: Kind
    per_token: float  # elements
    with_tp: bool = False
    autocast_copies: int = 1

    def bytes_per_token(self, tp: int, act_bytes: int) -> float:
        if self.with_tp and tp == 1:
            return 0.0
        width = 4 if self.kind == "fp32" else act_bytes
        copies = self.autocast_copies if act_bytes == 2 else 1
        return copies * self.per_token * width / (1 if self.split == "gathered" else tp)


def layer_saved(s: Shape) -> list[Saved]:
    """What one decoder block saves without recompute; measured on training/model.py with
    saved-tensor hooks (tests/planner). Korthikanti et al. (2022) count the same way for GPT; here
    the block is RMSNorm + GQA + SwiGLU, attention is fused (no s² score matrix is kept: the output
    and its log-sum-exp are), the o_proj input is the attention output itself (same storage), and
    RMSNorm saves its fp32 input and normalised tensor. Per token, tp = t:
    (2·4h + 2·4h)/t bytes of norms, 2h·β gathered projection inputs (5h·β under bf16 autocast, which
    casts the fp32 norm output once for each of q, k, v, gate and up), (2h + 2h·k/a + 4f)·β/t. Under
    bf16, autocast's casts of the rotary tables (4·seq·head_dim per block) are left out: < 1 %.
    """
    h, f, a = s.h, s.f, s.a
    return [
        Saved("attention norm input", "sequence", "fp32", h),
        Saved("attention norm 1/rms", "sequence", "fp32", 1),
        Saved("attention norm normalised", "sequence", "fp32", h),
        Saved("q/k/v projection input (gathered sequence)", "gathered", "act", h, autocast_copies=3),
        Saved("q after rotary", "heads", "act", h),
        Saved("k and v", "heads", "act", 2 * h * s.kv),
        Saved("attention output = o_proj input", "heads", "act", h),
        Saved("attention log-sum-exp", "heads", "fp32", a),
        Saved("MLP norm input", "sequence", "fp32", h),
        Saved("MLP norm 1/rms", "sequence", "fp32", 1),
        Saved("MLP norm normalised", "sequence", "fp32", h),
        Saved("gate/up projection input (gathered sequence)", "gathered", "act", h, autocast_copies=2),
        Saved("gate output, silu(gate), up output, down input", "heads", "act", 4 * f),
    ]


def layer_saved_selective(s: Shape) -> list[Saved]:
    """Selective recompute (training/parallel/recompute.py) keeps the outputs of matmuls, attention
    and tensor-parallel reduce-scatters, and recomputes norms, rotary, SiLU and products. o_proj and
    down_proj outputs are each tp rank's partial sums, whole before their reduce-scatter."""
    h, f, a = s.h, s.f, s.a
    return [
        Saved("block input", "sequence", "fp32", h),
        Saved("q, k, v projection outputs", "heads", "act", h + 2 * h * s.kv),
        Saved("attention output", "heads", "act", h),
        Saved("attention log-sum-exp", "heads", "fp32", a),
        Saved("o_proj and down_proj outputs (partial sums)", "gathered", "act", 2 * h),
        Saved("their reduce-scatter outputs", "sequence", "act", 2 * h, with_tp=True),
        Saved("gate and up outputs", "heads", "act", 2 * f),
    ]


def layer_saved_full(s: Shape) -> list[Saved]:
    """Full recompute keeps only each block's input, a sequence slice under tp."""
    return [Saved("block input", "sequence", "fp32", s.h)]


def output_saved(s: Shape) -> list[Saved]:
    """The last stage's final norm, head input and fp32 log-probabilities of the full vocabulary
    (the head gathers its logits, so they do not shrink with tp)."""
    return [
        Saved("final norm input", "sequence", "fp32", s.h),
        Saved("final norm 1/rms", "sequence", "fp32", 1),
        Saved("final norm normalised", "sequence", "fp32", s.h),
        Saved("head input (gathered sequence)", "gathered", "act", s.h),
        Saved("log-probabilities", "gathered", "fp32", s.V),
    ]


TOKEN_IDS_BYTES = 8  # int64 ids the embedding keeps on the first stage


def saved_per_token(entries: Iterable[Saved], tp: int, act_bytes: int) -> float:
    return sum(e.bytes_per_token(tp, act_bytes) for e in entries)


def layer_saved_for(recompute: Recompute, s: Shape) -> list[Saved]:
    return {"none": layer_saved, "selective": layer_saved_selective, "full": layer_saved_full}[recompute](s)


