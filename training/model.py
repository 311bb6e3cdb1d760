"""Fathom's decoder: a Llama-family transformer that reads top to bottom.

RMSNorm → grouped-query attention with rotary embeddings → RMSNorm → SwiGLU MLP, repeated, then a
final norm and an output head. The families differ only inside attention and in the head:
Qwen2 adds a bias to the q, k and v projections, Qwen3 normalises each head of q and k (RMSNorm
over head_dim, before rotary) and may give heads a size other than dim / n_heads; Llama 3.x
stretches the rotary frequencies (`RopeScaling`) and the small ones tie the output head to the
embedding (one parameter). Mistral computes what Llama does. Three layout choices serve the
parallelism and export code:

- Parameter names are Hugging Face `LlamaForCausalLM`'s (and Qwen2's, Qwen3's, Mistral's) without
  the leading `model.` (`layers.0.self_attn.q_proj.weight`, `layers.0.self_attn.q_norm.weight`,
  `embed_tokens.weight`, `lm_head.weight`), and rotary embeddings use HF's `rotate_half` layout
  (the two halves of each head are the pairs), so export is a renaming, not a permutation of weights.
- Attention reshapes with `.view(b, t, -1, head_dim)`: under tensor parallelism each rank holds
  n_heads / tp heads and the view infers how many.
- Layers live in a `ModuleDict` keyed by their index as a string. A pipeline stage deletes the
  layers it does not own, and sets `embed_tokens` / `norm` / `lm_head` to None where another stage
  owns them; the names of what remains do not change, so checkpoints from any layout line up.

A LoRA run (`LoraConfig`) adds a `LoraAdapter` beside each target projection, under the
attention's or MLP's `adapters` (`layers.0.self_attn.adapters.q_proj.lora_A.weight`), and freezes
every other parameter. B starts at zero, so the adapted model starts as the base model.

The model returns logits; the loss is computed outside it so a pipeline schedule can own it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from training.config import LoraConfig, ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even under bf16 autocast, as HF's LlamaRMSNorm does, so exported logits match.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3's frequency scaling, operation for operation as transformers'
    `_compute_llama3_parameters`, so the tables are bitwise those transformers and vLLM build."""
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by the factor, short ones kept, those between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_tables(
    head_dim: int, seq_len: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency), each (seq_len, head_dim), in HF's layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    positions = torch.arange(seq_len, dtype=torch.int64).float()
    freqs = torch.outer(positions, inv_freq)  # (T, head_dim/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (T, head_dim): both halves share a frequency
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, D); cos, sin: (T, D)."""
    cos = cos[:, None, :].to(x.dtype)  # (T, 1, D) broadcasts over heads
    sin = sin[:, None, :].to(x.dtype)
    return x * cos + rotate_half(x) * sin


# The submodule of an attention or MLP that holds its adapters; a parameter is an adapter's
# exactly when its name has this segment.
ADAPTERS = "adapters"


def is_adapter(name: str) -> bool:
    return f".{ADAPTERS}." in f".{name}"


class LoraAdapter(nn.Module):
    """The low-rank update of one linear layer, B·A·dropout(x); `project` adds it scaled by alpha / rank.

    A (rank × in) starts as PEFT starts it (kaiming-uniform, a=√5, torch's Linear default), B
    (out × rank) at zero. Two Linears, so tensor parallelism splits them with its usual styles.
    """

    def __init__(self, in_features: int, out_features: int, lora: LoraConfig) -> None:
        super().__init__()
        self.lora_A = nn.Linear(in_features, lora.rank, bias=False)
        self.lora_B = nn.Linear(lora.rank, out_features, bias=False)
        self.scale = lora.scale
        self.dropout = lora.dropout

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init_lora_a(self.lora_A.weight)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        return self.lora_B(self.lora_A(x))  # (B, T, out), unscaled (`project` scales it); local under TP


@torch.no_grad()
def init_lora_a(weight: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A's first values (rank × in), PEFT's: kaiming-uniform with a=√5, bound 1/√in."""
    return nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)


def adapters_for(projections: dict[str, nn.Linear], lora: LoraConfig | None) -> nn.ModuleDict | None:
    """An adapter for each of `projections` that `lora` targets; None without LoRA (no submodule,
    so a full fine-tune's modules and names are as they were)."""
    if lora is None or not lora.enabled:
        return None
    return nn.ModuleDict(
        {
            name: LoraAdapter(linear.in_features, linear.out_features, lora)
            for name, linear in projections.items()
            if name in lora.targets
        }
    )


def project(linear: nn.Linear, name: str, adapters: nn.ModuleDict | None, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)`, plus its adapter's update where it has one."""
    y = linear(x)
    if adapters is not None and name in adapters:
        adapter = adapters[name]
        assert isinstance(adapter, LoraAdapter)
        # Scaled within the add: one (B, T, out) temporary fewer, each a block of a CPU rank's
        # heap that its peak memory keeps. Not in place: under TP `y` is a view a custom
        # autograd Function returned, which may not be modified in place.
        y = torch.add(y, adapter(x), alpha=adapter.scale)
    return y


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, lora: LoraConfig | None = None) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # One gain per element of a head, shared by every head (hence replicated under TP).
        self.q_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        projections = {"q_proj": self.q_proj, "k_proj": self.k_proj, "v_proj": self.v_proj, "o_proj": self.o_proj}
        self.adapters = adapters_for(projections, lora)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # (B, T, dim): the whole sequence, even under sequence parallelism
        q = project(self.q_proj, "q_proj", self.adapters, x).view(b, t, -1, self.head_dim)  # (B, T, n_heads, head_dim); local heads under TP
        k = project(self.k_proj, "k_proj", self.adapters, x).view(b, t, -1, self.head_dim)  # (B, T, n_kv_heads, head_dim)
        v = project(self.v_proj, "v_proj", self.adapters, x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over head_dim, each head apart
        q = apply_rotary(q, cos[:t], sin[:t])
        k = apply_rotary(k, cos[:t], sin[:t])
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (B, heads, T, head_dim)
        # enable_gqa: query head h reads kv head h // (n_heads / n_kv_heads), HF's repeat_kv grouping.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y = y.transpose(1, 2).reshape(b, t, -1)  # (B, T, n_heads * head_dim)
        return project(self.o_proj, "o_proj", self.adapters, y)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, lora: LoraConfig | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        projections = {"gate_proj": self.gate_proj, "up_proj": self.up_proj, "down_proj": self.down_proj}
        self.adapters = adapters_for(projections, lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = F.silu(project(self.gate_proj, "gate_proj", self.adapters, x)) * project(
            self.up_proj, "up_proj", self.adapters, x
        )
        return project(self.down_proj, "down_proj", self.adapters, gated)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, lora: LoraConfig | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg, lora)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg, lora)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)  # (B, T, dim)
        return h + self.mlp(self.post_attention_layernorm(h))


class Transformer(nn.Module):
    rope_cos: torch.Tensor  # (seq_len, head_dim) buffers, registered in __init__
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, lora: LoraConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.lora = lora if lora is not None and lora.enabled else None
        self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, self.lora) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        # Not persistent: derived from the config, so checkpoints and exports carry only weights.
        self.register_buffer("rope_cos", torch.empty(cfg.seq_len, cfg.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.seq_len, cfg.head_dim), persistent=False)
        self.reset_buffers()
        self.reset_parameters()
        self.freeze_base()

    def freeze_base(self) -> None:
        """Under LoRA only the adapters train. Tensor parallelism distributes parameters anew
        (trainable again): `parallelize` calls this after it, before FSDP records what trains."""
        if self.lora is None:
            return
        for name, param in self.named_parameters():
            param.requires_grad_(is_adapter(name))

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Fills the rotary tables, computed on the CPU and copied to wherever the buffers are (a
        model built on the meta device and then `to_empty`-ed calls this again)."""
        if self.rope_cos.is_meta:
            return
        cos, sin = rotary_tables(self.cfg.head_dim, self.cfg.seq_len, self.cfg.rope_theta, self.cfg.rope_scaling)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def tie_weights(self) -> None:
        """Makes the output head's weight the embedding's own parameter, where the config ties them
        and this stage holds both. Assigning parameters anew (`to_empty`, tensor parallelism's
        distribution) gives each module its own; they call this again."""
        if self.cfg.tie_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def tied_names(self) -> tuple[str, ...]:
        """State-dict names that are another parameter's (a tied head's weight is the embedding's):
        checkpoints store the tensor once, under the embedding's name."""
        if self.cfg.tie_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            return ("lm_head.weight",)
        return ()

    def init_std(self, name: str, ndim: int) -> float | None:
        """The standard deviation `reset_parameters` draws parameter `name` with; None: a constant
        (`init_constant`).

        GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2·n_layers).
        """
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            return 0.02 / math.sqrt(2 * self.cfg.n_layers)
        return 0.02 if ndim == 2 else None

    @staticmethod
    def init_constant(name: str) -> float:
        """The value of a parameter that is not drawn: biases start at 0, norm gains at 1."""
        return 0.0 if name.endswith(".bias") else 1.0

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draws every parameter from the global generator in `named_parameters()` order.

        training/initial_weights.py replays this draw for draw (and the module constructors' draws
        before it) to fill a model built on the meta device shard by shard with the same values.
        """
        for name, param in self.named_parameters():
            if is_adapter(name):
                continue  # below
            std = self.init_std(name, param.ndim)
            if std is None:
                nn.init.constant_(param, self.init_constant(name))
            else:
                nn.init.normal_(param, mean=0.0, std=std)
        for module in self.modules():
            if isinstance(module, LoraAdapter):
                module.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: token ids (B, T) on the first stage, hidden states (B, T, dim) on later pipeline stages.

        Returns logits (B, T, vocab) on the last stage, hidden states (B, T, dim) on the others.
        """
        h = self.embed_tokens(x) if self.embed_tokens is not None else x  # (B, T, dim)
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)  # (B, T, vocab)
        return h


# A target that does not count in the loss (a chat's prompt tokens); F.cross_entropy's default.
IGNORE_INDEX = -100


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss over the targets that count; fp32 for a stable softmax."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over the targets that count; logits (B, T, vocab), targets (B, T).

    A batch in which no target counts (all prompt) has loss 0, not NaN: it adds no gradient."""
    counted = (targets != IGNORE_INDEX).sum().clamp(min=1)
    return token_loss_sum(logits, targets) / counted
