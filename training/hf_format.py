"""The Hugging Face config that an export of a Fathom model carries: `LlamaForCausalLM`,
`Qwen2ForCausalLM`, `Qwen3ForCausalLM` or `MistralForCausalLM`, the architecture it was imported as.

Torch-free, so the control plane can tell what an export will say before it exists: a
deployment's options are checked against it when the deployment is created
(`platform/deployments/options.py`), and `training.export` writes it.
"""

from __future__ import annotations

from typing import Any

from training.config import ModelConfig

# The dtype `python -m training.export` writes unless told otherwise (what the control plane exports).
EXPORT_DTYPE = "float32"

CAUSAL_LM_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = cfg.rope_scaling
    return {
        "rope_type": scaling.rope_type,
        "rope_theta": cfg.rope_theta,
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }


def _family_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The fields only some families' configs have, as each family's config class names them."""
    if cfg.architecture == "llama":
        # Llama's attention_bias puts a bias on o_proj too: the decoder has none there.
        return {"attention_bias": False, "mlp_bias": False}
    if cfg.architecture == "mistral":
        return {"sliding_window": cfg.sliding_window or None}
    # Qwen: full attention in every layer. Qwen2's q, k, v biases are its architecture's (no
    # field says so); Qwen3's attention_bias would put one on all four projections.
    window = {"use_sliding_window": False, "sliding_window": None}
    return {**window, "attention_bias": False} if cfg.architecture == "qwen3" else window


def hf_config(cfg: ModelConfig, dtype: str, bos: int, eos: int, max_positions: int | None = None) -> dict[str, Any]:
    """config.json of the export of a model with `cfg`, its weights in `dtype`, its tokenizer's
    begin- and end-of-text tokens `bos` and `eos`, and the context it serves (`max_positions`;
    default: the context it trained at)."""
    return {
        "architectures": [CAUSAL_LM_CLASSES[cfg.architecture]],
        "model_type": cfg.architecture,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": max_positions or cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # transformers ≥ 5 reads rope_parameters and dtype; older readers (and some of vLLM's
        # paths) read rope_theta and torch_dtype. Both spellings say the same thing.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": _rope_parameters(cfg),
        "rope_scaling": None if cfg.rope_scaling is None else _rope_parameters(cfg),
        "dtype": dtype,
        "torch_dtype": dtype,
        "hidden_act": "silu",
        **_family_fields(cfg),
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "use_cache": True,
    }
