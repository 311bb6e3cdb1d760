"""The Hugging Face `LlamaForCausalLM` config that an export of a Fathom model carries.

Torch-free, so the control plane can tell what an export will say before it exists: a
deployment's options are checked against it when the deployment is created
(`platform/deployments/options.py`), and `training.export` writes it.
"""

from __future__ import annotations

from typing import Any

from training.config import ModelConfig

# The dtype `python -m training.export` writes unless told otherwise (what the control plane exports).
EXPORT_DTYPE = "float32"


def hf_config(cfg: ModelConfig, dtype: str, bos: int, eos: int, max_positions: int | None = None) -> dict[str, Any]:
    """config.json of the export of a model with `cfg`, its weights in `dtype`, its tokenizer's
    begin- and end-of-text tokens `bos` and `eos`, and the context it serves (`max_positions`;
    default: the context it trained at)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "dtype": dtype,
        "torch_dtype": dtype,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": eos,
        "use_cache": True,
    }
