"""A Hugging Face folder to start a run from: its config becomes the run's model, its tokenizer
the run's tokenizer, and its safetensors the first weights (training/initial_weights.py reads
each rank's shard of each tensor from them, never a whole model).

The folder is what `save_pretrained` of a Llama, Qwen2, Qwen3 or Mistral causal LM writes plus the
tokenizer: config.json, model.safetensors or model-0000N-of-0000M.safetensors with
model.safetensors.index.json, and tokenizer.json. Only what Fathom's decoder computes is
accepted (`_unsupported` says why not, naming the config field and its value):

- model_type llama, qwen2, qwen3 or mistral; hidden_act silu;
- rotary embeddings plain or with Llama 3's scaling (`rope_type: llama3`), over the whole head;
- no biases beyond Qwen2's own on q, k and v (`attention_bias`, `mlp_bias` false);
- no sliding-window attention (Qwen's `use_sliding_window` false); Mistral's `sliding_window`
  is kept, and a run's `model.seq_len` must not exceed it (training/config.py);
- any head size (`head_dim`), tied or untied embeddings (`tie_word_embeddings`: one parameter).

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


ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")  # Hugging Face model_type = ModelConfig.architecture
LLAMA3_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    """The rotary parameters, as transformers ≥ 5 (`rope_parameters`) or older ones
    (`rope_scaling` beside `rope_theta`) write them."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return rope if isinstance(rope, dict) else {}


def _unsupported(config: dict[str, Any]) -> str | None:
    """Why Fathom's decoder cannot compute the model `config` describes, naming the config field
    and its value, or None."""
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        return f"model_type must be one of {', '.join(ARCHITECTURES)}; got {model_type!r}"
    if config.get("hidden_act", "silu") != "silu":
        return f"hidden_act must be silu; got {config.get('hidden_act')!r}"
    # Qwen2's q, k, v biases are its architecture's, not a flag; Llama's attention_bias puts a
    # bias on o_proj too, and mlp_bias on the MLP, which the decoder does not compute.
    for name in ("attention_bias", "mlp_bias"):
        if config.get(name):
            return f"{name} must be false (the decoder has no such biases); got {config.get(name)!r}"
    if model_type in ("qwen2", "qwen3"):
        if config.get("use_sliding_window"):
            return "use_sliding_window must be false (the decoder computes full attention); got true"
        sliding = [t for t in config.get("layer_types") or [] if t != "full_attention"]
        if sliding:
            return f"layer_types must all be full_attention (no sliding window); got {sliding[0]!r}"
    rope = _rope(config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        return f"rope_type must be default or llama3; got {rope_type!r}"
    if rope_type == "llama3":
        missing = [name for name in LLAMA3_SCALING if not isinstance(rope.get(name), (int, float))]
        if missing:
            return f"rope_scaling of rope_type llama3 lacks {', '.join(missing)}"
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        return f"partial_rotary_factor must be 1.0 (rotary over the whole head); got {partial!r}"
    return None


def model_config(folder: Path, seq_len: int) -> ModelConfig:
    """The model in `folder`, trained on sequences of `seq_len` tokens."""
    config = _config(folder)
    reason = _unsupported(config)
    if reason is not None:
        raise SpecError(FIELD, f"{folder}: {reason}")
    rope = _rope(config)
    scaling = None
    if rope.get("rope_type", rope.get("type", "default")) == "llama3":
        scaling = {"rope_type": "llama3", **{name: rope[name] for name in LLAMA3_SCALING}}
    sliding_window = config.get("sliding_window") if config["model_type"] == "mistral" else None
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
            architecture=config["model_type"],
            head_dim=config.get("head_dim") or 0,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_scaling=scaling,  # type: ignore[arg-type]  # ModelConfig builds it from the dict
            sliding_window=sliding_window or 0,
        )
    except KeyError as exc:
        raise SpecError(FIELD, f"{folder}/config.json lacks {exc.args[0]}") from None
    except SpecError as exc:
        if exc.field == "model.seq_len":  # the run's own choice (Mistral's window): the user's to change
            raise
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
    context = int(config.get("max_position_embeddings") or 2048)
    if config.get("model_type") == "mistral" and isinstance(config.get("sliding_window"), int):
        # A Mistral registers whatever its window; runs then train within the window.
        context = min(context, config["sliding_window"])
    return model_config(folder, context)


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
    """Fathom's parameter name → Hugging Face's (Fathom's lack the leading `model.`)."""
    return name if name.startswith("lm_head.") else f"model.{name}"

