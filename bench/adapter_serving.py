"""Serving a LoRA adapter on a shared base against serving the same adapter merged into its base.

    python -m bench.adapter_serving [--concurrency 16] [--tokens 64] [--requests 64] [--rank 16]

A small Llama (bench.serving's, ~4M parameters) is the base. A LoRA run of rank `rank` on every
projection (`python -m training.train`, one process, a few steps at a learning rate that moves
its outputs well away from the base's) is exported both ways: as its PEFT adapter folder and
merged into a whole model (`training.export`). Then one vLLM replica at a time, with the same
options (CPU, float32, eager, the product's default `max_num_seqs`), each pinned to the same
cores:

- the base with the adapter loaded (`max_loras` 1, `max_lora_rank` = rank, the adapter given at
  start as a deployment that carries it does), asked for the adapter's model name;
- the merged export, asked for its own name, with LoRA off (what a merged deployment runs).

Each answers the same greedy completions (their token ids must be equal: `adapter_matches_merged`)
and then a closed loop of `concurrency` clients streaming `requests` completions of `tokens`
tokens (ignore_eos), timed on the wall clock, straight at the replica.

Target (issue 37): `adapter_over_merged_tok_s` ≥ 0.8 with `adapter_matches_merged=1`. Ends with
one `key=value` line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.lora import run_spec
from bench.serving import PROMPTS, SPEC, _vllm_python, _wait
from bench.stream_client import Stream, request_bytes, stream
from serving.deployment_config import DeploymentConfig
from serving.state import read_state
from serving.supervisor import launch_detached, request_stop
from serving.vllm import ReplicaOptions
from tools.check_parity import launch
from tools.tiny_checkpoint import build_tiny_llama
from training.config import LORA_TARGETS, LoraConfig
from training.export import export, export_adapter
from training.run_dir import RunDir

GREEDY_TOKENS = 16


def lora_exports(base: Path, work: Path, rank: int) -> tuple[Path, Path]:
    """(the PEFT adapter folder, the merged export) of a short LoRA run on `base`."""
    spec = run_spec(base, 8, LoraConfig(rank=rank, alpha=2.0 * rank, targets=list(LORA_TARGETS)))
    spec.train.lr = spec.train.min_lr = 0.02
    launch(spec, work / "run", 1200)
    checkpoint = RunDir(work / "run").latest_checkpoint()
    assert checkpoint is not None, "the LoRA run saved no checkpoint"
    return export_adapter(checkpoint, work / "adapter"), export(checkpoint, work / "merged")


def greedy(url: str, model: str) -> list[list[int]]:
    """The token ids of a greedy completion of each prompt."""
    answers = []
    for prompt in PROMPTS:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": GREEDY_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        }
        request = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            answers.append(list(json.load(answer)["choices"][0]["token_ids"]))
    return answers


async def closed_loop(url: str, model: str, concurrency: int, tokens: int, requests: int) -> float:
    """Output tokens/s of `concurrency` clients each streaming one completion after another."""
    body = {
        "model": model, "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    pending = iter(
        [request_bytes(f"{url}/v1/completions", {**body, "prompt": PROMPTS[i % len(PROMPTS)]}) for i in range(requests)]
    )
    results: list[Stream] = []

    async def client() -> None:
        for request in pending:
            results.append(await stream(url, request, chat=False))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return sum(r.tokens for r in results) / (time.perf_counter() - start)


def serve(
    config: DeploymentConfig, model: str, args: argparse.Namespace
) -> tuple[list[list[int]], list[list[int]], float]:
    """Starts the replica, measures `model` on it, stops it: (its greedy token ids, the replica's
    own model's, tokens/s)."""
    supervisor = launch_detached(config)
    try:

        def ready() -> bool:
            state = read_state(config.state_dir)
            return state is not None and state.replicas[0].phase == "ready"

        _wait(ready, 600, f"the {model} replica")
        state = read_state(config.state_dir)
        assert state is not None and state.replicas[0].url
        url = state.replicas[0].url
        answers, own = greedy(url, model), greedy(url, config.name)
        asyncio.run(closed_loop(url, model, args.concurrency, args.tokens, args.concurrency))  # warm-up
        tok_s = statistics.median(
            asyncio.run(closed_loop(url, model, args.concurrency, args.tokens, args.requests))
            for _ in range(args.rounds)
        )
        return answers, own, tok_s
    finally:
        request_stop(config.state_dir)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and os.path.exists(f"/proc/{supervisor}"):
            try:
                if os.waitpid(supervisor, os.WNOHANG)[0]:
                    break
            except ChildProcessError:
                break
            time.sleep(0.5)
        else:
            os.killpg(supervisor, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.adapter_serving", description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    cache = Path(os.environ.get("FATHOM_TEST_CACHE", Path.home() / ".cache" / "fathom" / "test-checkpoints"))
    base = build_tiny_llama(cache / "bench-llama", SPEC)
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    options = ReplicaOptions(
        max_model_len=256, kv_cache_gib=1, dtype="float32", enforce_eager=True, cpu_threads_bind=cores
    )
    with tempfile.TemporaryDirectory(prefix="fathom-bench-adapter-") as tmp:
        work = Path(tmp)
        adapter, merged = lora_exports(base, work / "lora", args.rank)
        python = _vllm_python()
        lora_options = ReplicaOptions(**{**options.to_dict(), "max_loras": 1, "max_lora_rank": args.rank})
        on_base = DeploymentConfig(
            name="base", export=str(base), state_dir=str(work / "adapter-replica"), python=python,
            options=lora_options, adapters={"tuned": str(adapter)},
        )  # fmt: skip
        alone = DeploymentConfig(
            name="merged", export=str(merged), state_dir=str(work / "merged-replica"), python=python, options=options
        )
        adapter_answers, base_answers, adapter_tok_s = serve(on_base, "tuned", args)
        merged_answers, _, merged_tok_s = serve(alone, "merged", args)
    matches = adapter_answers == merged_answers
    print(f"base + adapter (rank {args.rank}): {adapter_tok_s:.1f} tokens/s; merged: {merged_tok_s:.1f} tokens/s")
    print(
        f"greedy completions of {len(PROMPTS)} prompts equal: {matches}; the base's differ: {base_answers != adapter_answers}"
    )
    print(
        f"adapter_over_merged_tok_s={adapter_tok_s / merged_tok_s:.3f} adapter_matches_merged={int(matches)} "
        f"adapter_tok_s={adapter_tok_s:.1f} merged_tok_s={merged_tok_s:.1f} rank={args.rank} "
        f"concurrency={args.concurrency} tokens={args.tokens}"
    )


if __name__ == "__main__":
    main()
