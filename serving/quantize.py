"""A Hugging Face export → an int8 (W8A8) or int4 (W4A16) compressed-tensors folder that vLLM loads.

    python -m serving.quantize EXPORT_DIR OUT_DIR --scheme int8|int4 --calibration DATASET [--samples N]

Runs in the quantizer's own env (`tools/quantize_env.sh`: llmcompressor, which pins its own
transformers, beside the CPU torch), as `training.export` runs in a subprocess. The calibration
documents are drawn from a Fathom dataset file (`.txt`, blank-line separated, or `.jsonl` rows
with "text" or "messages"; chats rendered with the export's chat template, as training and
`/v1/chat/completions` render them): a seeded uniform sample of N documents, each cut to
`--max-seq-len` tokens.

The schemes are the ones vLLM's CPU backend runs (see `serving.vllm`), made by llmcompressor's
recipes (its examples `quantization_w8a8_int8` and `quantization_w4a16`):

- int8: SmoothQuant (strength 0.8) then GPTQ to the `W8A8` preset: int8 weights, symmetric, one
  scale per output channel; int8 activations quantized per token at run time (oneDNN on CPU).
- int4: GPTQ to `W4A16`: 4-bit symmetric weights, one scale per group of input channels
  (128, or the largest of 64/32 that divides every linear input), activations in float
  (vLLM's CPUWNA16 kernel on CPU, Marlin on CUDA).

`lm_head` stays in float in both (a small model's head is a large share of its weights, and it is
where a rounding error decides the token). The embeddings are never quantized by these schemes.

Writes OUT_DIR atomically (a sibling temporary folder renamed at the end) with the export's
tokenizer files and `fathom-quantization.json` (scheme, the `ReplicaOptions.quantization` it is
served with, sizes, calibration figures); stdout gets one JSON line per stage, the last one that
summary. torch, transformers and llmcompressor are imported only inside `quantize`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, get_args

Scheme = Literal["int8", "int4"]
# What a replica serving the folder sets as `ReplicaOptions.quantization`.
SERVED_AS: dict[str, str] = {"int8": "int8_w8a8", "int4": "int4"}
SUMMARY_FILE = "fathom-quantization.json"
# Files of an export that travel unchanged (llmcompressor writes config.json and the weights).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
# GPTQ's default (llmcompressor's examples) is 512 samples of 2048 tokens; a run's own small
# dataset and this CPU call for less. More samples steady the Hessian estimate GPTQ inverts.
DEFAULT_SAMPLES = 128
DEFAULT_MAX_SEQ_LEN = 512
_INT4_GROUP_SIZES = (128, 64, 32)  # vLLM's CPU int4 kernel needs linear sizes that are multiples of 32


class QuantizeError(ValueError):
    """The export or the calibration data cannot be quantized; the message says why."""


def calibration_documents(
    path: Path, samples: int, seed: int, chat: Any = None, piece_chars: int | None = None
) -> list[str]:
    """`samples` documents of a dataset file drawn uniformly without replacement (reservoir
    sampling with `seed`: one pass, memory for the sample only), in file order. `chat` renders a
    `messages` row to text; without it a chat row is its contents joined by newlines. With
    `piece_chars`, a longer document is first cut at line ends into pieces of at most that many
    characters, each drawn on its own: a dataset that is one long text (a .txt without blank
    lines is one document to training too) still gives `samples` different windows."""
    if samples < 1:
        raise QuantizeError(f"--samples must be at least 1; got {samples}")
    rng = random.Random(seed)
    kept: list[tuple[int, str]] = []
    count = 0
    pieces = (piece for doc in _documents(path, chat) for piece in _pieces(doc, piece_chars))
    for index, text in enumerate(pieces):
        count += 1
        if len(kept) < samples:
            kept.append((index, text))
        else:
            slot = rng.randrange(count)
            if slot < samples:
                kept[slot] = (index, text)
    if not kept:
        raise QuantizeError(f"{path} holds no documents to calibrate on")
    return [text for _, text in sorted(kept)]


def _pieces(text: str, limit: int | None) -> Iterator[str]:
    """`text` in pieces of at most `limit` characters, cut after a newline where a line allows."""
    if limit is None or len(text) <= limit:
        yield text
        return
    piece = ""
    for line in text.splitlines(keepends=True):
        while len(line) > limit:  # a line longer than a piece is cut where it must be
            if piece.strip():
                yield piece
            piece = ""
            if line[:limit].strip():
                yield line[:limit]
            line = line[limit:]
        if len(piece) + len(line) > limit and piece.strip():
            yield piece
            piece = ""
        piece += line
    if piece.strip():
        yield piece


def _documents(path: Path, chat: Any) -> Iterator[str]:
    """The non-empty documents of a Fathom dataset file, as `training.data.iter_rows` reads them."""
    if path.suffix == ".txt":
        yield from (doc for doc in path.read_text(encoding="utf-8").split("\n\n") if doc.strip())
    elif path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if "text" in row:
                    text = str(row["text"])
                elif isinstance(row.get("messages"), list):
                    messages = row["messages"]
                    text = chat(messages) if chat else "\n".join(str(m.get("content", "")) for m in messages)
                else:
                    raise QuantizeError(f"{path}:{number}: a row needs a 'text' or 'messages' field; got {sorted(row)}")
                if text.strip():
                    yield text
    else:
        raise QuantizeError(f"{path}: the calibration dataset must be a .txt or .jsonl file")


def folder_size(path: Path) -> int:
    """Bytes of the weight files in a checkpoint folder (what serving it loads)."""
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix == ".safetensors")


def int4_group_size(linear_inputs: list[int]) -> int:
    """The largest of 128/64/32 dividing every linear layer's input size."""
    for size in _INT4_GROUP_SIZES:
        if all(n % size == 0 for n in linear_inputs):
            return size
    raise QuantizeError(
        f"int4 needs every linear layer's input size to be a multiple of 32 (vLLM's CPU kernel); "
        f"this model's are {sorted(set(linear_inputs))}"
    )


def _recipe(scheme: Scheme, linear_inputs: list[int]) -> tuple[list[Any], dict[str, Any]]:
    from llmcompressor.modifiers.quantization import GPTQModifier

    if scheme == "int8":
        from llmcompressor.modifiers.transform import SmoothQuantModifier

        # Strength 0.8: the value llmcompressor's W8A8 examples use; it moves activation outliers
        # into the weights, which per-channel int8 weights absorb better than per-token activations.
        return [
            SmoothQuantModifier(smoothing_strength=0.8),
            GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]),
        ], {"smoothquant": 0.8, "gptq": "W8A8"}
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    group = int4_group_size(linear_inputs)
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    scheme_w4 = QuantizationScheme(targets=["Linear"], weights=weights)
    return [GPTQModifier(config_groups={"group_0": scheme_w4}, ignore=["lm_head"])], {
        "gptq": "W4A16",
        "group_size": group,
    }


def _emit(stage: str, **fields: Any) -> None:
    print(json.dumps({"stage": stage, **fields}), flush=True)


def quantize(
    export_dir: Path,
    out_dir: Path,
    *,
    scheme: Scheme,
    calibration: Path,
    samples: int = DEFAULT_SAMPLES,
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
    seed: int = 0,
) -> dict[str, Any]:
    """Quantize the export at `export_dir` into `out_dir` and return the summary written there."""
    if scheme not in get_args(Scheme):
        raise QuantizeError(f"--scheme must be one of {', '.join(get_args(Scheme))}; got {scheme!r}")
    if not (export_dir / "config.json").is_file():
        raise QuantizeError(f"{export_dir} is not a Hugging Face export (no config.json)")
    config = json.loads((export_dir / "config.json").read_text())
    if config.get("quantization_config"):
        raise QuantizeError(f"{export_dir} is already quantized ({config['quantization_config'].get('quant_method')})")
    started = time.monotonic()

    import torch
    import transformers
    from llmcompressor import __version__ as llmcompressor_version
    from llmcompressor import oneshot

    torch.manual_seed(seed)
    _emit("loading", export=str(export_dir))
    tokenizer = transformers.AutoTokenizer.from_pretrained(export_dir)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    except (ValueError, KeyError, OSError) as exc:
        raise QuantizeError(f"transformers cannot load {export_dir}: {exc}") from exc

    def chat(messages: list[dict[str, str]]) -> str:
        return str(tokenizer.apply_chat_template(messages, tokenize=False))

    max_len = min(max_seq_len, int(getattr(model.config, "max_position_embeddings", max_seq_len)))
    # Byte-level BPE on English averages about 4 characters a token: a piece of 4 * max_len
    # characters fills about one window, and the tokenizer's truncation cuts what is over.
    documents = calibration_documents(
        calibration, samples, seed, chat if tokenizer.chat_template else None, piece_chars=4 * max_len
    )
    rows = [tokenizer(text, truncation=True, max_length=max_len, add_special_tokens=False) for text in documents]
    rows = [r for r in rows if len(r["input_ids"]) >= 2]
    if not rows:
        raise QuantizeError(f"{calibration}: the sampled documents tokenize to fewer than 2 tokens each")
    tokens = sum(len(r["input_ids"]) for r in rows)
    from datasets import Dataset

    dataset = Dataset.from_dict(
        {"input_ids": [r["input_ids"] for r in rows], "attention_mask": [r["attention_mask"] for r in rows]}
    )
    linear_inputs = [
        m.in_features for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
    ]
    recipe, recipe_summary = _recipe(scheme, linear_inputs)

    _emit("calibrating", scheme=scheme, samples=len(rows), tokens=tokens)
    try:
        oneshot(
            model=model,
            tokenizer=tokenizer,
            dataset=dataset,
            recipe=recipe,
            max_seq_length=max_len,
            num_calibration_samples=len(rows),
            shuffle_calibration_samples=False,
        )
    except (ValueError, RuntimeError, NotImplementedError) as exc:
        raise QuantizeError(f"llmcompressor could not quantize {export_dir} to {scheme}: {exc}") from exc

    _emit("saving", out=str(out_dir))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        model.save_pretrained(work, save_compressed=True)
        for name in _TOKENIZER_FILES:
            if (export_dir / name).is_file():
                shutil.copy2(export_dir / name, work / name)
        source_bytes, quantized_bytes = folder_size(export_dir), folder_size(work)
        summary = {
            "scheme": scheme,
            "served_as": SERVED_AS[scheme],
            "source": str(export_dir),
            "source_bytes": source_bytes,
            "bytes": quantized_bytes,
            "size_ratio": round(quantized_bytes / source_bytes, 4),
            "calibration": str(calibration),
            "samples": len(rows),
            "tokens": tokens,
            "max_seq_len": max_len,
            "seed": seed,
            "recipe": recipe_summary,
            "llmcompressor": llmcompressor_version,
            "seconds": round(time.monotonic() - started, 1),
        }
        (work / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        # mkdtemp and safetensors make them private; a replica may run as another user
        work.chmod(0o755)
        for f in work.iterdir():
            f.chmod(0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(work, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.quantize", description=__doc__.split("\n\n")[0])
    parser.add_argument("export_dir", type=Path, help="a Hugging Face export (training.export's output)")
    parser.add_argument("out_dir", type=Path, help="where the quantized folder goes (replaced if it exists)")
    parser.add_argument("--scheme", required=True, choices=get_args(Scheme))
    parser.add_argument("--calibration", required=True, type=Path, help="a Fathom dataset file (.txt or .jsonl)")
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="documents to calibrate on")
    parser.add_argument("--max-seq-len", type=int, default=DEFAULT_MAX_SEQ_LEN, help="tokens kept of each document")
    parser.add_argument("--seed", type=int, default=0, help="seeds the sample and GPTQ")
    args = parser.parse_args(argv)
    try:
        summary = quantize(
            args.export_dir,
            args.out_dir,
            scheme=args.scheme,
            calibration=args.calibration,
            samples=args.samples,
            max_seq_len=args.max_seq_len,
            seed=args.seed,
        )
    except QuantizeError as exc:
        _emit("failed", error=str(exc))
        print(f"quantize: {exc}", file=sys.stderr)
        return 2
    _emit("done", **summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
