"""Memory and speed of a LoRA fine-tune against a full fine-tune of the same model and layout.

    python -m bench.lora [--steps 6] [--layers 8] [--dim 1024]

A random Llama-shaped base (≈90M parameters at the defaults: layers big beside a 512-token
vocabulary, as in real models, where the blocks hold most parameters) is saved by transformers
as a pretrained folder. Two runs start from it, one after the other, each through the product's
own path (`python -m training.train`, one process, OMP_NUM_THREADS=1, fp32, the spec's defaults
otherwise): a full fine-tune, and a LoRA fine-tune of rank 16 on every projection of every block
(attention and MLP). Peak memory per rank is the rank's own `memory_mb` (its resident high-water
mark: weights, gradients, optimizer state, activations and the runtime together), the largest
any step reports; throughput is the median `tokens_per_s` after two warm-up steps. Checkpoints
are saved only after the last step, so their copies count in neither figure.

Targets (issue 37): `lora_peak_over_full` ≤ 0.5, `lora_tok_s_over_full` ≥ 1.0. Ends with one
`key=value` line.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from tools.check_parity import launch, step_values
from training.config import LORA_TARGETS, DataConfig, LoraConfig, RunSpec, tiny
from training.data import TOKENIZER_FILES, prepare_data
from training.pretrained import resolve

SEQ = 128
GLOBAL_BATCH = 4
RANK = 16
WARMUP_STEPS = 2  # the first steps allocate and fault in pages: not what a long run sees


def save_base(folder: Path, tokenizer_dir: Path, layers: int, dim: int) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=512, hidden_size=dim, intermediate_size=64 * -(-(8 * dim // 3) // 64), num_hidden_layers=layers,
        num_attention_heads=dim // 64, num_key_value_heads=max(1, dim // 256), max_position_embeddings=SEQ,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, folder / name)


def run_spec(folder: Path, steps: int, lora: LoraConfig | None) -> RunSpec:
    spec = tiny()
    spec.model.seq_len = SEQ
    spec.data = DataConfig(pretrained=str(folder))
    spec.train.steps = steps
    spec.train.warmup_steps = 1
    spec.train.global_batch = GLOBAL_BATCH
    spec.train.checkpoint_interval = steps  # one save, after every measured step
    if lora is not None:
        spec.lora = lora
    return RunSpec.from_dict(resolve(spec).to_dict())


def measure(events: list[dict[str, Any]]) -> tuple[float, float]:
    """(peak memory MB over every step, median tokens/s after warm-up) of a run's metrics."""
    peaks = step_values(events, "memory_mb")
    speeds = step_values(events, "tokens_per_s")
    measured = [speeds[s] for s in sorted(speeds) if s > WARMUP_STEPS]
    return max(peaks.values()), statistics.median(measured)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fathom-bench-lora-") as tmp:
        work = Path(tmp)
        tokenizer_dir = prepare_data(DataConfig(), 512, SEQ, work / "shared").tokenizer_dir
        folder = work / "base"
        save_base(folder, tokenizer_dir, args.layers, args.dim)
        full_spec = run_spec(folder, args.steps, None)
        lora_spec = run_spec(folder, args.steps, LoraConfig(rank=RANK, alpha=2.0 * RANK, targets=list(LORA_TARGETS)))
        full_peak, full_tok_s = measure(launch(full_spec, work / "full", 1200))
        lora_peak, lora_tok_s = measure(launch(lora_spec, work / "lora", 1200))
    params = full_spec.model.num_params()
    print(f"model: {params / 1e6:.1f}M parameters, batch {GLOBAL_BATCH} × seq {SEQ}, one rank, fp32")
    print(f"full fine-tune: peak {full_peak:.0f} MiB, {full_tok_s:.0f} tokens/s")
    print(f"LoRA rank {RANK} on {', '.join(LORA_TARGETS)}: peak {lora_peak:.0f} MiB, {lora_tok_s:.0f} tokens/s")
    print(
        f"lora_peak_over_full={lora_peak / full_peak:.3f} lora_tok_s_over_full={lora_tok_s / full_tok_s:.3f} "
        f"full_peak_mb={full_peak:.0f} lora_peak_mb={lora_peak:.0f} full_tok_s={full_tok_s:.0f} "
        f"lora_tok_s={lora_tok_s:.0f} params_m={params / 1e6:.1f} rank={RANK}"
    )


if __name__ == "__main__":
    main()
