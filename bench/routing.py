"""Prefix-aware routing against least-loaded routing, side by side on two real replicas.

    python -m bench.routing [--systems 4] [--conversations 24] [--turns 3] [--tokens 16] [--rounds 2]

One deployment of two vLLM replicas of a small Llama (bench.serving's, CPU, float32, eager, the
product's default `max_num_seqs`, vLLM's prefix caching on as by default), each pinned to a core
of its own. Two standalone routers (`serving.app`) stand in front of the same replicas, one
routing by prefix (Fathom's default), one least loaded.

The workload, as the issue asks, is many conversations that share a few long system prompts and
grow turn by turn: `conversations` clients, each holding one conversation with one of `systems`
system prompts (~2,400 characters, ~600 tokens of the model's own sentences), and each asking
`turns` questions one after another. Each question's prompt is the system prompt, every earlier
turn (its question and a fixed short answer) and the new question; the answer is `tokens`
streamed tokens. All conversations run at once, which saturates both replicas. Each round runs
the workload through each router in turn, with fresh system prompts each time (neither policy
finds the other's blocks in the caches); the router that goes first alternates.

Measured on the wall clock for each policy: TTFT (mean and p50 over every request), output
tokens/s over the whole workload, and the replicas' prefix-cache hit rate from vLLM's own
counters (`vllm:prefix_cache_hits_total` ÷ `vllm:prefix_cache_queries_total`, in tokens).

Targets (issue 38): `prefix_over_least_loaded_ttft_mean` ≤ 0.6 and
`prefix_over_least_loaded_tok_s` ≥ 1.0. Ends with one `key=value` line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.serving import ROOT, SPEC, _vllm_python, _wait
from bench.stream_client import Stream, request_bytes, stream
from bench.waiting import free_port
from serving.deployment_config import DeploymentConfig
from serving.replica_metrics import parse_prometheus
from serving.state import DeploymentDir, read_state
from serving.supervisor import launch_detached, request_stop
from serving.vllm import ReplicaOptions
from tools.tiny_checkpoint import build_tiny_llama, generated_text

POLICIES = ("prefix", "least_loaded")
ANSWER = "Noted, thank you."


@dataclass
class Measured:
    ttft_s: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    hits: float = 0.0
    queries: float = 0.0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def system_prompts(count: int, seed: int) -> list[str]:
    sentences = generated_text(60 * count, seed)
    return [" ".join(sentences[60 * i : 60 * (i + 1)])[:2400] for i in range(count)]


def prefix_cache(urls: list[str]) -> tuple[float, float]:
    """vLLM's prefix-cache (hits, queries), in tokens, summed over the replicas."""
    hits = queries = 0.0
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as page:
            samples = parse_prometheus(page.read().decode())
        hits += sum(v for (name, _), v in samples.items() if name == "vllm:prefix_cache_hits_total")
        queries += sum(v for (name, _), v in samples.items() if name == "vllm:prefix_cache_queries_total")
    return hits, queries


async def workload(router: str, systems: list[str], args: argparse.Namespace, seed: int) -> Measured:
    rng = random.Random(seed)
    measured = Measured()

    async def conversation(system: str) -> None:
        turns = ""
        for turn in range(args.turns):
            question = f"Question {rng.randint(1, 10_000)} about the sentence {turn}?"
            body = {
                "model": "bench", "prompt": f"{system}{turns}\nUser: {question}\nAssistant:", "max_tokens": args.tokens,
                "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            }  # fmt: skip
            answer: Stream = await stream(router, request_bytes(f"{router}/v1/completions", body), chat=False)
            measured.ttft_s.append(answer.ttft_s)
            measured.tokens += answer.tokens
            turns += f"\nUser: {question}\nAssistant: {ANSWER}"

    start = time.perf_counter()
    await asyncio.gather(*(conversation(systems[i % len(systems)]) for i in range(args.conversations)))
    measured.seconds = time.perf_counter() - start
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.routing", description=__doc__.splitlines()[0])
    parser.add_argument("--systems", type=int, default=4, help="distinct system prompts")
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per answer")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    cache = Path(os.environ.get("FATHOM_TEST_CACHE", Path.home() / ".cache" / "fathom" / "test-checkpoints"))
    checkpoint = build_tiny_llama(cache / "bench-llama", SPEC)
    cores = sorted(os.sched_getaffinity(0))
    tmp = Path(tempfile.mkdtemp(prefix="fathom-bench-routing-"))
    config = DeploymentConfig(
        name="bench", export=str(checkpoint), state_dir=str(tmp / "deployment"), python=_vllm_python(), replicas=2,
        options=ReplicaOptions(max_model_len=1024, kv_cache_gib=1, dtype="float32", enforce_eager=True),
        cpu_binds=(str(cores[0]), str(cores[-1])) if len(cores) >= 2 else (),
    )  # fmt: skip
    supervisor = launch_detached(config)
    routers: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
    try:
        for policy in POLICIES:  # each router reads its policy from the config file as it starts
            config_file = DeploymentDir(Path(config.state_dir)).config_file
            config_file.write_text(json.dumps({**config.to_dict(), "routing": policy}))
            port = free_port()
            app = subprocess.Popen(
                [sys.executable, "-m", "serving.app", "--state-dir", config.state_dir, "--port", str(port)],
                cwd=ROOT, stdout=(tmp / f"router-{policy}.log").open("wb"), stderr=subprocess.STDOUT,
            )  # fmt: skip
            routers[policy] = (f"http://127.0.0.1:{port}", app)
            _wait(lambda port=port: _answers(f"http://127.0.0.1:{port}/v1/models"), 60, f"the {policy} router")

        def ready() -> bool:
            state = read_state(config.state_dir)
            return state is not None and all(r.phase == "ready" for r in state.replicas)

        _wait(ready, 900, "two replicas")
        state = read_state(config.state_dir)
        assert state is not None
        urls = [r.url for r in state.replicas if r.url]
        results: dict[str, list[Measured]] = {policy: [] for policy in POLICIES}
        for round_ in range(args.rounds):
            order = POLICIES if round_ % 2 == 0 else tuple(reversed(POLICIES))
            for policy in order:
                systems = system_prompts(args.systems, seed=1000 * round_ + POLICIES.index(policy))
                before = prefix_cache(urls)
                measured = asyncio.run(workload(routers[policy][0], systems, args, seed=round_))
                after = prefix_cache(urls)
                measured.hits, measured.queries = after[0] - before[0], after[1] - before[1]
                results[policy].append(measured)
                print(
                    f"round {round_ + 1} {policy}: TTFT mean {statistics.mean(measured.ttft_s) * 1000:.0f} ms, "
                    f"p50 {statistics.median(measured.ttft_s) * 1000:.0f} ms; {measured.tok_s:.1f} tokens/s; "
                    f"prefix-cache hit rate {measured.hit_rate:.3f}",
                    flush=True,
                )
    finally:
        for _, app in routers.values():
            app.send_signal(signal.SIGTERM)
        request_stop(config.state_dir)
        for _, app in routers.values():
            app.wait(30)
        _wait(lambda: _gone(supervisor), 120, "the supervisor's stop")

    def pooled(policy: str) -> tuple[float, float, float, float]:
        runs = results[policy]
        ttfts = [t for m in runs for t in m.ttft_s]
        tok_s = sum(m.tokens for m in runs) / sum(m.seconds for m in runs)
        hit_rate = sum(m.hits for m in runs) / max(1.0, sum(m.queries for m in runs))
        return statistics.mean(ttfts), statistics.median(ttfts), tok_s, hit_rate

    prefix, least = pooled("prefix"), pooled("least_loaded")
    print(
        f"prefix_over_least_loaded_ttft_mean={prefix[0] / least[0]:.3f} "
        f"prefix_over_least_loaded_ttft_p50={prefix[1] / least[1]:.3f} "
        f"prefix_over_least_loaded_tok_s={prefix[2] / least[2]:.3f} "
        f"prefix_cache_hit_rate={prefix[3]:.3f} least_loaded_cache_hit_rate={least[3]:.3f} "
        f"prefix_ttft_mean_ms={prefix[0] * 1000:.0f} least_loaded_ttft_mean_ms={least[0] * 1000:.0f} "
        f"systems={args.systems} conversations={args.conversations} turns={args.turns}"
    )


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5):
            return True
    except OSError:
        return False


def _gone(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return True


if __name__ == "__main__":
    main()
