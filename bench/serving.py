"""What Fathom's router costs, and what vLLM buys over plain `transformers.generate`.

    python -m bench.serving [--concurrency 32] [--tokens 64] [--rounds 3]

One deployment (one vLLM replica of a small Llama, CPU, float32) behind the standalone router
app (`serving.app`, the same `Gateway` the Django view calls). The same load, `concurrency`
streamed completions of `tokens` tokens each, is sent alternately straight to the replica and
through the router, `rounds` times each; from the medians it prints output tokens/s and TTFT p50
for both, their ratios, and the router process's CPU time per 1000 tokens (the figure that
does not depend on what else a shared machine runs). Then `transformers.generate` (OMP_NUM_THREADS=1, one batch of
`concurrency` left-padded prompts, greedy) on the same checkpoint gives the vLLM ÷ transformers
throughput ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from serving.supervisor import DeploymentConfig, free_port, launch_detached, read_state, request_stop
from serving.tiny_checkpoint import TinyLlamaSpec, build_tiny_llama
from serving.vllm import ReplicaOptions

ROOT = Path(__file__).resolve().parent.parent
# hidden 256 x 4 layers (~4M parameters): the model TORCH-ON-CPU.md measured vLLM on.
SPEC = TinyLlamaSpec(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=768,
    train_steps=150,
)
PROMPTS = [
    "the cat sees",
    "a dog follows",
    "my friend draws",
    "the robot carries",
    "12 13 14",
    "the teacher finds",
    "a child counts",
    "the bird likes",
]


def _vllm_python() -> str:
    given = os.environ.get("FATHOM_VLLM_PYTHON")
    if given and Path(given).exists():
        return given
    out = subprocess.run(["bash", str(ROOT / "tools" / "vllm_env.sh")], check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def _wait(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout_s} s")
        time.sleep(0.5)


async def _one(client: httpx.AsyncClient, url: str, prompt: str, tokens: int) -> tuple[float, int]:
    """Stream one completion; return (time to first token, output tokens)."""
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = float("nan")
    produced = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text") and ttft != ttft:
                ttft = time.perf_counter() - start
            if event.get("usage"):
                produced = event["usage"]["completion_tokens"]
    return ttft, produced


async def _load(url: str, concurrency: int, tokens: int) -> tuple[float, float]:
    """`concurrency` streams at once; return (output tokens/s, TTFT p50 in s). No keep-alive:
    httpcore 1.0.9 would run concurrent requests over one reused connection one at a time."""
    async with httpx.AsyncClient(
        timeout=600, limits=httpx.Limits(max_connections=None, max_keepalive_connections=0), trust_env=False
    ) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(_one(client, url, PROMPTS[i % len(PROMPTS)], tokens) for i in range(concurrency))
        )
        elapsed = time.perf_counter() - start
    return sum(n for _, n in results) / elapsed, statistics.median(t for t, _ in results)


def _transformers_tokens_per_s(checkpoint: Path, concurrency: int, tokens: int) -> float:
    import torch
    import transformers

    torch.set_num_threads(1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint, padding_side="left")
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    batch = tokenizer([PROMPTS[i % len(PROMPTS)] for i in range(concurrency)], return_tensors="pt", padding=True)
    with torch.no_grad():
        model.generate(**batch, max_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        out = model.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        elapsed = time.perf_counter() - start
    return (out.shape[1] - batch.input_ids.shape[1]) * concurrency / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the deployment's logs and state")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"

    cache = Path(os.environ.get("FATHOM_TEST_CACHE", Path.home() / ".cache" / "fathom" / "test-checkpoints"))
    checkpoint = build_tiny_llama(cache / "bench-llama", SPEC)
    tmp = Path(tempfile.mkdtemp(prefix="fathom-bench-serving-"))
    config = DeploymentConfig(
        name="bench",
        checkpoint=str(checkpoint),
        state_dir=str(tmp / "deployment"),
        python=_vllm_python(),
        replicas=1,
        options=ReplicaOptions(
            max_model_len=1024, max_num_seqs=args.concurrency, kv_cache_gib=1, dtype="float32", enforce_eager=True
        ),
    )
    supervisor = launch_detached(config)
    port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "serving.app", "--state-dir", config.state_dir, "--port", str(port)],
        cwd=ROOT, stdout=(tmp / "router.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:

        def ready() -> bool:
            state = read_state(config.state_dir)
            return state is not None and state.replicas[0].phase == "ready"

        _wait(ready, 600, "replica")
        state = read_state(config.state_dir)
        assert state is not None and state.replicas[0].url
        direct_url, router_url = state.replicas[0].url, f"http://127.0.0.1:{port}"
        _wait(lambda: _up(router_url), 60, "router")

        asyncio.run(_load(direct_url, args.concurrency, 8))  # warm-up: vLLM's first batches are slow
        direct, routed = [], []
        router_cpu_s = 0.0
        for _ in range(args.rounds):  # alternate, so drift on a shared machine hits both sides
            direct.append(asyncio.run(_load(direct_url, args.concurrency, args.tokens)))
            cpu_before = _cpu_seconds(router.pid)
            routed.append(asyncio.run(_load(router_url, args.concurrency, args.tokens)))
            router_cpu_s += _cpu_seconds(router.pid) - cpu_before
    finally:
        request_stop(config.state_dir)
        os.killpg(router.pid, signal.SIGTERM)
        router.wait(timeout=30)
        _wait(lambda: not Path(f"/proc/{supervisor}").exists() or _zombie(supervisor), 120, "supervisor exit")
        if args.keep:
            print(f"logs and state kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    # Ratios per round (each routed round runs right after its direct round), then the median:
    # steadier than a ratio of medians when the machine's other load drifts.
    tps_ratio = statistics.median(r[0] / d[0] for d, r in zip(direct, routed, strict=True))
    ttft_ratio = statistics.median(r[1] / d[1] for d, r in zip(direct, routed, strict=True))
    direct_tps = statistics.median(t for t, _ in direct)
    routed_tps = statistics.median(t for t, _ in routed)
    direct_ttft = statistics.median(f for _, f in direct)
    routed_ttft = statistics.median(f for _, f in routed)
    hf_tps = _transformers_tokens_per_s(checkpoint, args.concurrency, args.tokens)

    print(f"load: {args.concurrency} concurrent streams x {args.tokens} tokens, {args.rounds} rounds each, medians")
    print(f"direct to replica: {direct_tps:,.0f} tok/s, TTFT p50 {direct_ttft * 1000:.0f} ms")
    print(f"through router:    {routed_tps:,.0f} tok/s, TTFT p50 {routed_ttft * 1000:.0f} ms")
    print(f"router / direct, median of per-round ratios: tok/s {tps_ratio:.3f}, TTFT {ttft_ratio:.3f}")
    print(f"load average at the end (shared machine): {os.getloadavg()[0]:.1f}")
    # CPU the router process spent per 1000 relayed tokens: unlike tokens/s, it does not move
    # with what else the machine runs.
    router_cpu_ms = router_cpu_s * 1000 / (args.rounds * args.concurrency * args.tokens / 1000)
    print(f"router process CPU: {router_cpu_ms:.0f} ms per 1000 relayed tokens")
    print(f"transformers.generate (batch {args.concurrency}, OMP_NUM_THREADS=1): {hf_tps:,.0f} tok/s")
    print(
        f"router_tok_s={routed_tps:.0f} direct_tok_s={direct_tps:.0f} router_over_direct_tok_s={tps_ratio:.3f} "
        f"router_ttft_p50_ms={routed_ttft * 1000:.0f} direct_ttft_p50_ms={direct_ttft * 1000:.0f} "
        f"router_over_direct_ttft={ttft_ratio:.3f} router_cpu_ms_per_1k_tok={router_cpu_ms:.0f} transformers_tok_s={hf_tps:.0f} "
        f"vllm_over_transformers={direct_tps / hf_tps:.2f} loadavg={os.getloadavg()[0]:.1f}"
    )


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


if __name__ == "__main__":
    main()
