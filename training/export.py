"""A committed checkpoint → a Hugging Face folder of the run's architecture (Llama, Qwen2, Qwen3,
Mistral) that vLLM serves.

    python -m training.export RUN_DIR/checkpoints/step_00000050 OUT_DIR [--dtype bfloat16]
    python -m training.export s3://bucket/prefix/runs/RUN/checkpoints/step_00000050 OUT_DIR
    python -m training.export LORA_RUN_DIR OUT_DIR [--merged]

A checkpoint on object storage (`training.checkpoint_storage`) is read through fsspec where it
is; the export is written to the local OUT_DIR.

Runs in one process (no torchrun): DCP reads the model's tensors from every shard into a whole
model, whatever layout wrote them. Fathom's parameter names are HF's minus the `model.` prefix
and its rotary layout is HF's, so the weights are renamed, never permuted; a tied output head is
the embedding, stored once (no lm_head.weight, as transformers saves it). Writes config.json,
generation_config.json, model.safetensors and the tokenizer files saved with the checkpoint.

A LoRA run's checkpoint (adapters only) exports as a PEFT adapter folder: adapter_config.json,
naming the pretrained folder it adapts as `base_model_name_or_path`, and adapter_model.safetensors
under PEFT's names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), plus the
tokenizer. With `--merged` it exports instead the whole model of the base's architecture, each
target weight W replaced by W + (alpha / rank)·B·A, as a full fine-tune's export is written.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from training.config import RunSpec
from training.data import TOKENIZER_FILES, copy_tokenizer, end_tokens
from training.hf_format import EXPORT_DTYPE, hf_config
from training.initial_weights import build_meta, initial_weights, materialize
from training.model import ADAPTERS, LoraAdapter, Transformer, is_adapter
from training.pretrained import hf_name
from training.run_dir import CHECKPOINT_SPEC, CHECKPOINT_TOKENIZER, COMMITTED_MARKER, CheckpointDir, RunDir
from training.storage import Storage, local_root

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _on_object_storage(checkpoint: Path | str) -> bool:
    return isinstance(checkpoint, str) and local_root(checkpoint) is None


def load_model(checkpoint: Path | str) -> tuple[RunSpec, Transformer]:
    """The whole fp32 model stored in a committed checkpoint (a folder, or a URL on object
    storage), in this process."""
    reader: dict[str, Any]
    if _on_object_storage(checkpoint):
        assert isinstance(checkpoint, str)
        remote = Storage.open(checkpoint)
        if not remote.fs.exists(remote.path(COMMITTED_MARKER)):
            raise ValueError(f"{checkpoint} is not a committed checkpoint (no {COMMITTED_MARKER} marker)")
        spec = RunSpec.from_json(remote.fs.cat_file(remote.path(CHECKPOINT_SPEC)).decode())
        reader = {"storage_reader": FsspecReader(checkpoint)}
    else:
        stored = CheckpointDir(Path(checkpoint))
        if not stored.is_committed:
            raise ValueError(f"{checkpoint} is not a committed checkpoint (no {stored.committed_marker.name} marker)")
        spec = RunSpec.from_json(stored.spec_file.read_text())
        reader = {"checkpoint_id": Path(checkpoint)}
    if spec.lora.enabled:
        # The checkpoint holds the adapters; the base is its pretrained folder's, read as at a start.
        model = build_meta(spec.model, spec.lora)
        materialize([model], torch.device("cpu"), initial_weights(spec))
        state = {"model": {k: v for k, v in model.state_dict().items() if is_adapter(k)}}
    else:
        model = Transformer(spec.model)
        state = {"model": model.state_dict()}
        for name in model.tied_names():  # stored once, as the embedding
            del state["model"][name]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, no_dist=True, **reader)  # fills the tensors in place
    model.load_state_dict(state["model"], strict=not model.tied_names() and not spec.lora.enabled)
    return spec, model.eval()


def peft_name(name: str) -> str:
    """An adapter parameter's name → PEFT's for a causal LM
    (`layers.0.self_attn.adapters.q_proj.lora_A.weight` → `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`)."""
    return "base_model.model." + hf_name(name.replace(f".{ADAPTERS}.", "."))


@torch.no_grad()
def merged_parameters(model: Transformer) -> dict[str, torch.Tensor]:
    """The base's parameters by name, each adapted weight W as W + scale·B·A (fp32)."""
    merged = {k: v.detach() for k, v in model.named_parameters() if not is_adapter(k)}
    for name, module in model.named_modules():
        if isinstance(module, LoraAdapter):
            weight = name.replace(f".{ADAPTERS}.", ".") + ".weight"
            merged[weight] = merged[weight] + module.scale * (module.lora_B.weight @ module.lora_A.weight)
    return merged


def adapter_config(spec: RunSpec) -> dict[str, Any]:
    """PEFT's adapter_config.json for a LoRA run's adapters."""
    lora = spec.lora
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": spec.data.pretrained,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def export_adapter(checkpoint: Path | str, out_dir: Path, dtype: str = EXPORT_DTYPE) -> Path:
    """A LoRA checkpoint → a PEFT adapter folder (module docstring)."""
    spec, model = load_model(checkpoint)
    if not spec.lora.enabled:
        raise ValueError(f"{checkpoint} is a full fine-tune's checkpoint: it has no adapters to export")
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        peft_name(k): v.detach().to(DTYPES[dtype]).contiguous() for k, v in model.named_parameters() if is_adapter(k)
    }
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config(spec), indent=2) + "\n")
    _copy_tokenizer(checkpoint, out_dir)
    return out_dir


def is_lora_checkpoint(checkpoint: Path | str) -> bool:
    """Whether a committed checkpoint is a LoRA run's (holds adapters, not a whole model)."""
    if _on_object_storage(checkpoint):
        assert isinstance(checkpoint, str)
        remote = Storage.open(checkpoint)
        text = remote.fs.cat_file(remote.path(CHECKPOINT_SPEC)).decode()
    else:
        text = CheckpointDir(Path(checkpoint)).spec_file.read_text()
    return RunSpec.from_json(text).lora.enabled


def _copy_tokenizer(checkpoint: Path | str, out_dir: Path) -> None:
    if _on_object_storage(checkpoint):
        assert isinstance(checkpoint, str)
        remote = Storage.open(checkpoint)
        for name in TOKENIZER_FILES:
            if name == "tokenizer.json" or remote.fs.exists(remote.path(CHECKPOINT_TOKENIZER, name)):
                remote.fs.get_file(remote.path(CHECKPOINT_TOKENIZER, name), str(out_dir / name))
    else:
        copy_tokenizer(CheckpointDir(Path(checkpoint)).tokenizer_dir, out_dir)


def _served_context(spec: RunSpec) -> int:
    """The context the export serves: the run's, or its pretrained model's where that is longer
    (continued pretraining at a shorter context keeps what the model could do). Where the
    pretrained folder is not on this machine, the run's."""
    if not spec.data.pretrained:
        return spec.model.seq_len
    try:
        original = json.loads((Path(spec.data.pretrained) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return spec.model.seq_len
    return max(spec.model.seq_len, original) if isinstance(original, int) else spec.model.seq_len


def export(checkpoint: Path | str, out_dir: Path, dtype: str = EXPORT_DTYPE) -> Path:
    """The whole model of a checkpoint as a Hugging Face folder; a LoRA run's merged into its base."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    spec, model = load_model(checkpoint)
    out_dir.mkdir(parents=True, exist_ok=True)
    # named_parameters names a tied head's weight once, as the embedding's.
    tensors = {hf_name(k): v.to(DTYPES[dtype]).contiguous() for k, v in merged_parameters(model).items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _copy_tokenizer(checkpoint, out_dir)
    ends = end_tokens(out_dir)
    config = hf_config(spec.model, dtype, ends.bos, ends.eos, max_positions=_served_context(spec))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "bos_token_id": ends.bos,
        # A chat turn ends with <|im_end|>, a document with the end-of-text token: stop on either.
        "eos_token_id": list(ends.stops),
        "pad_token_id": ends.eos,
        "max_length": spec.model.seq_len,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training.export", description=__doc__.splitlines()[0])
    parser.add_argument(
        "checkpoint", help="a committed checkpoint folder or URL on object storage, or a run folder (its newest)"
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument(
        "--merged",
        action="store_true",
        help="for a LoRA run's checkpoint: the whole model with the adapters merged, not a PEFT adapter folder",
    )
    args = parser.parse_args(argv)
    checkpoint: Path | str = args.checkpoint
    if not _on_object_storage(args.checkpoint):
        checkpoint = Path(args.checkpoint)
    if isinstance(checkpoint, Path) and not CheckpointDir(checkpoint).is_committed:
        newest = RunDir(checkpoint).latest_checkpoint()
        if newest is None:
            raise SystemExit(f"{checkpoint} is neither a committed checkpoint nor a run folder with one")
        checkpoint = newest
    if not args.merged and is_lora_checkpoint(checkpoint):
        print(export_adapter(checkpoint, args.out_dir, args.dtype))
    else:
        print(export(checkpoint, args.out_dir, args.dtype))


if __name__ == "__main__":
    main()
