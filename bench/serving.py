"""What Fathom's router costs, and what vLLM buys over plain `transformers.generate`.

    python -m bench.serving [--concurrency 32] [--tokens 64] [--rounds 5] [--burst 100] [--bursts 2]

One deployment (one vLLM replica of a small Llama, CPU, float32, the product's default
`max_num_seqs`), reached three ways in turn, each round: straight at the replica, through the
standalone router (`serving.app`, uvicorn), and through the control plane's `/v1` (its web
process, as `make run` starts it, with an API key). Two loads, each timed on the wall clock:

- closed loop, what vLLM's own serving benchmark calls max concurrency: `concurrency` clients,
  each streaming one completion of `tokens` tokens after another until `4 × concurrency` are done;
- burst: `burst` streamed chats of `tokens` tokens sent at one instant, each on a new connection,
  as many users pressing send together (more than the replica batches at once, so some queue).

It prints output tokens/s and TTFT p50 for each way and load, and the routed ÷ direct ratios
(median of the ratios of bursts or rounds run side by side; each round starts with the next way).
A burst's TTFT p50 swings from one burst to the next, as the replica's first batches form from
whichever requests have arrived (direct alone: 265 to 493 ms in six bursts on one machine, and
single `/v1` ÷ direct ratios of 0.79 to 1.78), so each round runs `bursts` bursts per way (ten
per way by default) and every burst's ratio is printed beside their median. The bursts also go
through a fourth way, `bench.byte_proxy` on the routers' core: a TCP proxy that reads nothing,
the floor any relay there could reach (`burst_floor_over_direct_ttft`). Then
`transformers.generate` (OMP_NUM_THREADS=1, one batch of `concurrency` left-padded prompts,
greedy) on the same checkpoint gives the vLLM ÷ transformers ratio.

The client (`bench.stream_client`) opens one new connection per request and parses every event
it receives, as a chat client does. Its CPU per burst is printed: on the routers' core, that is
CPU the routed ways lose and the direct way does not (a user's client runs on the user's
machine), so the client is as lean as it can be, and the lighter it is, the nearer the ratios
are to what the routers alone cost.

Placement: the replica gets the upper half of the cores, the client and the routers the lower
half, as in a real deployment where the control plane does not run on the accelerator host. On a
shared 2-core machine an unpinned router takes its CPU from the replica, and the ratio then
measures the machine, not the router; the router's own CPU per 1000 relayed tokens is printed
beside it for that reason.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvloop

from bench.stream_client import Stream, request_bytes, stream
from bench.waiting import free_port
from serving.deployment_config import DeploymentConfig
from serving.state import read_state
from serving.supervisor import launch_detached, request_stop
from serving.vllm import ReplicaOptions
from tools.tiny_checkpoint import TinyLlamaSpec, build_tiny_llama

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


def _request(url: str, prompt: str, tokens: int, key: str, chat: bool = False) -> bytes:
    """A streamed completion (a chat completion with `chat`) of `tokens` tokens, as request bytes."""
    body: dict[str, object] = {
        "model": "bench",
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return request_bytes(f"{url}/v1/{'chat/completions' if chat else 'completions'}", body, key)


async def _load(url: str, concurrency: int, tokens: int, requests: int, key: str = "") -> tuple[float, float]:
    """`concurrency` clients, each sending its next streamed completion as soon as the last one
    ends, until `requests` are done; return (output tokens/s, TTFT p50 in s)."""
    prepared = [_request(url, PROMPTS[i % len(PROMPTS)], tokens, key) for i in range(requests)]
    pending = iter(prepared)
    results: list[Stream] = []

    async def one_client() -> None:
        for request in pending:
            results.append(await stream(url, request, chat=False))

    start = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return sum(r.tokens for r in results) / elapsed, statistics.median(r.ttft_s for r in results)


async def _burst(url: str, chats: int, tokens: int, key: str = "") -> tuple[float, float]:
    """`chats` streamed chat completions started together; return (output tokens/s over the
    whole burst, TTFT p50 in s)."""
    prepared = [_request(url, PROMPTS[i % len(PROMPTS)], tokens, key, chat=True) for i in range(chats)]
    start = time.perf_counter()
    results = await asyncio.gather(*(stream(url, request, chat=True) for request in prepared))
    elapsed = time.perf_counter() - start
    return sum(r.tokens for r in results) / elapsed, statistics.median(r.ttft_s for r in results)


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


@dataclass
class Way:
    """One way to reach the deployment, and what each round measured through it."""

    name: str
    url: str
    key: str = ""
    router_pid: int | None = None
    up_path: str = "/health"  # answers 200 once the server serves
    burst_only: bool = False  # the byte proxy: a floor for the bursts' figures
    rounds: list[tuple[float, float]] = field(default_factory=list)  # closed loop: (tokens/s, TTFT p50 s)
    bursts: list[tuple[float, float]] = field(default_factory=list)  # the same, per burst
    router_cpu_s: float = 0.0  # in the closed loop
    client_cpu_s: float = 0.0  # the bench's own, in the bursts: CPU the routers' core lends the client

    def tok_s(self, burst: bool = False) -> float:
        return statistics.median(t for t, _ in (self.bursts if burst else self.rounds))

    def ttft_ms(self, burst: bool = False) -> float:
        return 1000 * statistics.median(f for _, f in (self.bursts if burst else self.rounds))

    def over(self, direct: Way, burst: bool = False) -> tuple[float, float]:
        """Median of the ratios to `direct` (tokens/s, TTFT) of the rounds, or bursts, run side
        by side: steadier than a ratio of medians when the machine's other load drifts."""
        mine, theirs = (self.bursts, direct.bursts) if burst else (self.rounds, direct.rounds)
        pairs = list(zip(mine, theirs, strict=True))
        return statistics.median(r[0] / d[0] for r, d in pairs), statistics.median(r[1] / d[1] for r, d in pairs)


def _control_plane(data_dir: Path, checkpoint: Path) -> tuple[Path, str]:
    """A control-plane database (SQLite under `data_dir`) holding one ready deployment of
    `checkpoint`; returns the folder its supervisor keeps state in and an API key for it."""
    os.environ["FATHOM_DATA_DIR"] = str(data_dir)
    for name in ("DATABASE_URL", "REDIS_URL"):  # the embedded default, whatever the shell says
        os.environ.pop(name, None)
    os.environ["DJANGO_SETTINGS_MODULE"] = "controlplane.settings"
    sys.path.insert(0, str(ROOT / "platform"))
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command

    from deployments.models import ApiKey, Deployment
    from runs.models import Checkpoint, Run

    call_command("migrate", verbosity=0)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Django's logging config let it log each request
    user = get_user_model().objects.create_user("bench")
    run = Run.objects.create(owner=user, name="bench", spec={}, status=Run.Status.SUCCEEDED)
    exported = Checkpoint.objects.create(
        run=run, step=SPEC.train_steps, path=str(checkpoint), export_path=str(checkpoint)
    )
    deployment = Deployment.objects.create(
        owner=user,
        name="bench",
        checkpoint=exported,
        served_model_name="bench",
        options={"max_model_len": 1024},
        status=Deployment.Status.READY,  # no beat runs here to move it there from the supervisor's state
    )
    _, key = ApiKey.issue(deployment)
    return deployment.folder, key


def _placement() -> tuple[set[int], set[int]]:
    """(cores for the client and routers, cores for the replica): halves of this process's cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return set(cores), set(cores)
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


def _start(command: list[str], *, cwd: Path, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--burst", type=int, default=100, help="chats per burst")
    parser.add_argument("--bursts", type=int, default=2, help="bursts per way and round")
    parser.add_argument("--keep", action="store_true", help="keep the deployment's logs and state")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    requests = 4 * args.concurrency

    cache = Path(os.environ.get("FATHOM_TEST_CACHE", Path.home() / ".cache" / "fathom" / "test-checkpoints"))
    checkpoint = build_tiny_llama(cache / "bench-llama", SPEC)
    tmp = Path(tempfile.mkdtemp(prefix="fathom-bench-serving-"))
    state_dir, key = _control_plane(tmp / "control", checkpoint)
    router_cores, replica_cores = _placement()
    config = DeploymentConfig(
        name="bench",
        export=str(checkpoint),
        state_dir=str(state_dir),
        python=_vllm_python(),
        replicas=1,
        options=ReplicaOptions(
            max_model_len=1024,  # max_num_seqs: the product's default, as a new user's replica
            kv_cache_gib=1,
            dtype="float32",
            enforce_eager=True,
            cpu_threads_bind=",".join(map(str, sorted(replica_cores))),
        ),
    )
    os.sched_setaffinity(0, replica_cores)
    supervisor = launch_detached(config)  # it and its replicas inherit the replica cores
    os.sched_setaffinity(0, router_cores)
    app_port, web_port = free_port(), free_port()
    from controlplane.web import web_command  # platform/ is on the path since _control_plane

    routers = [
        _start(
            [sys.executable, "-m", "serving.app", "--state-dir", str(state_dir), "--port", str(app_port)],
            cwd=ROOT,
            log=tmp / "router.log",
        ),
        _start(
            web_command(web_port),
            cwd=ROOT / "platform",
            log=tmp / "web.log",
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "platform")])},
        ),
    ]
    try:

        def ready() -> bool:
            state = read_state(config.state_dir)
            return state is not None and state.replicas[0].phase == "ready"

        _wait(ready, 600, "replica")
        state = read_state(config.state_dir)
        assert state is not None and state.replicas[0].url
        replica_host, replica_port = state.replicas[0].url.removeprefix("http://").rsplit(":", 1)
        proxy_port = free_port()
        routers.append(
            _start(
                [sys.executable, "-m", "bench.byte_proxy", replica_host, replica_port, str(proxy_port)],
                cwd=ROOT,
                log=tmp / "byte-proxy.log",
            )
        )
        ways = [
            Way("direct", state.replicas[0].url),
            Way("router", f"http://127.0.0.1:{app_port}", router_pid=routers[0].pid),
            Way("control plane /v1", f"http://127.0.0.1:{web_port}", key, routers[1].pid, up_path="/login/"),
            Way("byte proxy", f"http://127.0.0.1:{proxy_port}", burst_only=True),
        ]
        for way in ways[1:]:
            _wait(lambda url=way.url + way.up_path: _up(url), 60, way.name)
        for way in ways:  # warm-up: vLLM's first batches are slow, and each server's first request
            uvloop.run(_load(way.url, args.concurrency, 8, args.concurrency, way.key))
            uvloop.run(_burst(way.url, 4, 8, way.key))  # and its first chat (the template compiles)
        for round_index in range(args.rounds):
            # In turn, so drift on a shared machine hits every way alike, and each round starts
            # with the next way, so no way always follows the same one.
            turn = ways[round_index % len(ways) :] + ways[: round_index % len(ways)]
            for way in turn:
                if way.burst_only:
                    continue
                cpu_before = _cpu_seconds(way.router_pid) if way.router_pid else 0.0
                way.rounds.append(uvloop.run(_load(way.url, args.concurrency, args.tokens, requests, way.key)))
                if way.router_pid:
                    way.router_cpu_s += _cpu_seconds(way.router_pid) - cpu_before
            for _ in range(args.bursts):
                for way in turn:
                    cpu_before = time.process_time()
                    way.bursts.append(uvloop.run(_burst(way.url, args.burst, args.tokens, way.key)))
                    way.client_cpu_s += time.process_time() - cpu_before
    finally:
        request_stop(config.state_dir)
        for server in routers:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        _wait(lambda: not Path(f"/proc/{supervisor}").exists() or _zombie(supervisor), 120, "supervisor exit")
        if args.keep:
            print(f"logs and state kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    os.sched_setaffinity(0, router_cores | replica_cores)
    hf_tps = _transformers_tokens_per_s(checkpoint, args.concurrency, args.tokens)
    direct, router, web, floor = ways
    relayed_k = args.rounds * requests * args.tokens / 1000
    burst_tok_s_ratio, burst_ttft_ratio = web.over(direct, burst=True)

    print(
        f"load: {args.concurrency} concurrent clients, {requests} streamed completions of {args.tokens} tokens "
        f"per round, {args.rounds} rounds, medians; replica on cores {sorted(replica_cores)}, "
        f"client and routers on {sorted(router_cores)}"
    )
    for way in [w for w in ways if not w.burst_only]:
        line = f"{way.name:>18}: {way.tok_s():,.0f} tok/s, TTFT p50 {way.ttft_ms():.1f} ms"
        if way.router_pid:
            tps_ratio, ttft_ratio = way.over(direct)
            line += (
                f"; ÷ direct: tok/s {tps_ratio:.3f}, TTFT {ttft_ratio:.3f}; "
                f"its CPU {way.router_cpu_s * 1000 / relayed_k:.0f} ms per 1000 relayed tokens"
            )
        print(line)
    print(
        f"burst: {args.burst} streamed chats of {args.tokens} tokens sent together, "
        f"{args.bursts} bursts per way and round"
    )
    for way in ways:
        line = (
            f"{way.name:>18}: {way.tok_s(burst=True):,.0f} tok/s, TTFT p50 {way.ttft_ms(burst=True):.1f} ms, "
            f"client CPU {way.client_cpu_s * 1000 / len(way.bursts):.0f} ms per burst"
        )
        if way is not direct:
            tps_ratio, ttft_ratio = way.over(direct, burst=True)
            each = ", ".join(f"{mine[1] / theirs[1]:.2f}" for mine, theirs in zip(way.bursts, direct.bursts, strict=True))
            line += f"; ÷ direct: tok/s {tps_ratio:.3f}, TTFT {ttft_ratio:.3f} (each burst's: {each})"
        print(line)
    print(f"transformers.generate (batch {args.concurrency}, OMP_NUM_THREADS=1): {hf_tps:,.0f} tok/s")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    print(
        f"router_over_direct_tok_s={router.over(direct)[0]:.3f} "
        f"router_ttft_p50_ms={router.ttft_ms():.1f} direct_ttft_p50_ms={direct.ttft_ms():.1f} "
        f"controlplane_over_direct_tok_s={web.over(direct)[0]:.3f} controlplane_ttft_p50_ms={web.ttft_ms():.1f} "
        f"router_cpu_ms_per_1k_tok={router.router_cpu_s * 1000 / relayed_k:.0f} "
        f"controlplane_cpu_ms_per_1k_tok={web.router_cpu_s * 1000 / relayed_k:.0f} "
        f"direct_tok_s={direct.tok_s():.0f} transformers_tok_s={hf_tps:.0f} "
        f"vllm_over_transformers={direct.tok_s() / hf_tps:.2f} "
        f"clock=wall burst_v1_over_direct_tok_s={burst_tok_s_ratio:.3f} "
        f"burst_v1_over_direct_ttft={burst_ttft_ratio:.3f} "
        f"burst_v1_ttft_p50_ms={web.ttft_ms(burst=True):.1f} burst_direct_ttft_p50_ms={direct.ttft_ms(burst=True):.1f} "
        f"burst_floor_over_direct_ttft={floor.over(direct, burst=True)[1]:.3f} "
        f"burst_floor_ttft_p50_ms={floor.ttft_ms(burst=True):.1f}"
    )


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
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
