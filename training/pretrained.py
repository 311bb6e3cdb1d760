"""A Hugging Face Llama folder to start a run from: its config becomes the run's model, its
tokenizer the run's tokenizer, and its safetensors the first weights (training/initial_weights.py
reads each rank's shard of each tensor from them, never a whole model).

The folder is what `LlamaForCausalLM.save_pretrained` writes plus the tokenizer: config.json,
model.safetensors or model-0000N-of-0000M.safetensors with model.safetensors.index.json, and
tokenizer.json. Only what Fathom's decoder computes is accepted: no biases, SiLU, rotary without
scaling, head size hidden_size / num_attention_heads. A folder with tied embeddings starts both
the embedding and the output head from the embedding; they train apart from then on.

Torch-free: the control plane resolves a spec against a folder without loading torch.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

from training.config import ModelConfig, RunSpec, SpecError

FIELD = "data.pretrained"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(FIELD, f"{folder}/config.json cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise SpecError(FIELD, f"{folder}/config.json is not a JSON object")
    return config


def _unsupported(config: dict[str, Any]) -> str | None:
    """Why Fathom's decoder cannot compute the model `config` describes, or None."""
    if config.get("model_type") != "llama":
        return f"model_type must be llama; got {config.get('model_type')!r}"
    if config.get("hidden_act", "silu") != "silu":
        return f"hidden_act must be silu; got {config.get('hidden_act')!r}"
    for name in ("attention_bias", "mlp_bias"):
        if config.get(name):
            return f"{name} must be false (the decoder has no biases)"
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"rotary scaling {rope.get('rope_type', rope.get('type'))!r} is not supported; only the default"
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    if isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
        head_dim = config.get("head_dim") or hidden // heads
        if head_dim * heads != hidden:
            return f"head_dim × num_attention_heads must be hidden_size; got {head_dim} × {heads} ≠ {hidden}"
    return None


def model_config(folder: Path, seq_len: int) -> ModelConfig:
    """The model of the Llama in `folder`, trained on sequences of `seq_len` tokens."""
    config = _config(folder)
    reason = _unsupported(config)
    if reason is not None:
        raise SpecError(FIELD, f"{folder}: {reason}")
    rope = config.get("rope_parameters") or {}
    try:
        return ModelConfig(
            n_layers=config["num_hidden_layers"],
            dim=config["hidden_size"],
            n_heads=config["num_attention_heads"],
            n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            vocab_size=config["vocab_size"],
            seq_len=seq_len,
            ffn_dim=config["intermediate_size"],
            rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        )
    except KeyError as exc:
        raise SpecError(FIELD, f"{folder}/config.json lacks {exc.args[0]}") from None
    except SpecError as exc:
        raise SpecError(FIELD, f"{folder}/config.json gives {exc}") from None


def resolve(spec: RunSpec) -> RunSpec:
    """`spec` with the model and tokenizer of its pretrained folder, if it names one (else itself).

    The spec's own `model.seq_len` stays: the training context is the run's choice. Idempotent,
    so both the control plane at submit and every rank at start may call it.
    """
    if not spec.data.pretrained:
        return spec
    return RunSpec.from_dict(resolved_dict(spec.to_dict()))


def resolved_dict(data: dict[str, Any]) -> dict[str, Any]:
    """`resolve` on a spec as plain data (`RunSpec.to_dict`'s), before it is checked as a RunSpec:
    the control plane checks a user's layout against the folder's model, not the recipe's."""
    folder = Path(data["data"]["pretrained"])
    tokenizer = folder / "tokenizer.json"
    if not tokenizer.is_file():
        raise SpecError(FIELD, f"{folder} has no tokenizer.json")
    given = data["data"].get("tokenizer")
    if given and Path(given) not in (tokenizer, folder):
        raise SpecError("data.tokenizer", f"a run from {FIELD} uses the folder's tokenizer; got {given}")
    resolved = copy.deepcopy(data)
    resolved["model"] = dataclasses.asdict(model_config(folder, data["model"]["seq_len"]))
    resolved["data"]["tokenizer"] = str(tokenizer)
    return resolved


def check_folder(folder: Path) -> ModelConfig:
    """The model of a folder being registered, once its files are known to be there: config,
    tokenizer and every weights file its index names. Torch-free (the control plane calls it)."""
    if not (folder / "tokenizer.json").is_file():
        raise SpecError(FIELD, f"{folder} has no tokenizer.json")
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            files = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SpecError(FIELD, f"{index} is not a safetensors index: {exc}") from None
        missing = sorted(name for name in files if not (folder / name).is_file())
        if missing:
            raise SpecError(FIELD, f"{folder} lacks {', '.join(missing)}, which {INDEX_FILE} names")
    elif not (folder / SINGLE_FILE).is_file():
        raise SpecError(FIELD, f"{folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    config = _config(folder)
    return model_config(folder, int(config.get("max_position_embeddings") or 2048))


def tensor_files(folder: Path) -> dict[str, Path]:
    """Each tensor's name (Hugging Face's) → the safetensors file that holds it."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise SpecError(FIELD, f"{folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    from safetensors import safe_open  # only the ranks read weights

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def hf_name(name: str) -> str:
    """Fathom's parameter name → LlamaForCausalLM's (Fathom's lack the leading `model.`)."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def tied_embeddings(folder: Path) -> bool:
    return bool(_config(folder).get("tie_word_embeddings", False))
