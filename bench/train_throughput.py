"""Training throughput as a user gets it: a real run with Fathom's default bookkeeping against a plain loop.

    python -m bench.train_throughput [--steps 20] [--warmup 2] [--no-dp2] [--recipe small]

The `small` recipe (`--recipe tiny` for a quick check of the bench itself) as a user submits it (≈16M parameters, batch 16 × seq 256, fp32, the spec's
defaults), every figure on the wall clock:

1. One process. Fathom: the product's launch path, `python -m training.agent` with the control
   plane's arguments (platform/launch/run_agents.py: `--rdzv-endpoint`, `--events-url`, `--run-token`,
   OMP_NUM_THREADS=1). So the rank runs with its heartbeat thread and its events file; the node
   agent watches it (watchdog, warm standby) and its reporter tails the events, spools them
   (fsync) and POSTs them to an ingest endpoint on loopback that answers like the control plane's
   `POST /api/runs/<id>/events/`; checkpoints follow the spec (interval, sync or async). A step of
   the run takes the wall interval between two consecutive `metrics` events (their `time`, stamped
   by the rank), so everything between two steps counts. The plain loop: model, batches and AdamW
   written by hand in this process on the same number of threads, each step timed with
   `time.perf_counter`. Half of its steps run before the Fathom run and half after, so load from
   other processes that drifts over the minutes falls on both alike. Medians after warm-up.

   Checkpoints are what the spec's defaults make them (policy, interval, background or not): a
   save's cost is the excess over the median of the two steps after it, spread over the measured
   steps (`save_cost`), and added to Fathom's step. Target: `wall_ratio` ≥ 0.95.
2. MFU: training.metrics.mfu, the function the rank's own (dashboard) MFU comes from: wall
   tokens/s × flops_per_token (causal attention counted at half the unmasked score and value
   matmuls) ÷ the best wall-clock matmul of the run's dtype on as many threads as the rank has,
   measured here before and after the runs (the best of both). The bf16 peak is printed beside it.
   Target ≥ 0.5.
3. dp2: the same spec with layout.dp=2, two ranks of one thread each, through the same agent,
   against the plain loop on two threads doing the same global batch (the same cores).

The host may be shared; the figures then say what a user of this host gets at that moment.
With `--recompute-memory`, also the peak resident memory of two trainer steps, recompute none vs full.

Ends with one `key=value` line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from training.config import RECIPES, RunSpec
from training.data import PreparedData, TokenWindows, prepare_data
from training.metrics import flops_per_token, measure_matmul_peak, mfu, peak_memory_mb
from training.model import Transformer
from training.run_dir import RunDir
from training.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
RUN_TOKEN = "bench-train-throughput"


def bench_spec(*, steps: int = 1000, dp: int = 1, recompute: str = "none", recipe: str = "small") -> RunSpec:
    """The recipe with its defaults; `steps` only shortens the run (and its LR schedule)."""
    data = RECIPES[recipe](dp=dp, recompute=recompute).to_dict()
    data["train"]["steps"] = steps
    data["train"]["warmup_steps"] = min(steps, data["train"]["warmup_steps"])
    return RunSpec.from_dict(data)


def prepare(work_dir: Path, spec: RunSpec) -> PreparedData:
    return prepare_data(spec.data, spec.model.vocab_size, spec.model.seq_len, work_dir / "data")


class PlainLoop:
    """What one would write by hand: the same model, batch and AdamW, nothing else."""

    def __init__(self, spec: RunSpec, data: PreparedData) -> None:
        torch.manual_seed(spec.train.seed)
        self.model = Transformer(spec.model)
        t = spec.train
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=(0.9, 0.95), weight_decay=t.weight_decay)
        self.windows = TokenWindows(data.tokens(), spec.model.seq_len)
        self.batch = t.global_batch
        self.clip = t.grad_clip
        self.generator = torch.Generator().manual_seed(t.seed)

    def step(self) -> float:
        """One optimizer step; returns its wall time in seconds."""
        start = time.perf_counter()
        indices = torch.randint(0, self.windows.num_samples, (self.batch,), generator=self.generator).numpy()
        x, y = self.windows.batch(indices)
        logits = self.model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss.item()
        return time.perf_counter() - start


# --- The control plane's ingest endpoint, as far as a node agent sees it ------------------------


class IngestServer:
    """`POST /api/runs/<id>/events/` with the run's bearer token → `{"last_seq": n}`, per source.

    Keeps every event it accepted, once per (run, source, seq), like the control plane.
    """

    def __init__(self) -> None:
        self.events: dict[int, dict[tuple[str, int], dict[str, Any]]] = {}
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                parts = self.path.strip("/").split("/")
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if len(parts) != 4 or parts[:2] != ["api", "runs"] or parts[3] != "events" or not parts[2].isdigit():
                    return self._answer(404, {"detail": f"no endpoint {self.path}"})
                if self.headers.get("Authorization") != f"Bearer {RUN_TOKEN}":
                    return self._answer(403, {"detail": "Authorization: wrong run token"})
                payload = json.loads(body)
                source = payload["source"]
                with outer.lock:
                    held = outer.events.setdefault(int(parts[2]), {})
                    for event in payload["events"]:
                        held.setdefault((source, int(event["seq"])), event)
                    last = max((seq for src, seq in held if src == source), default=0)
                self._answer(200, {"last_seq": last})

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="ingest", daemon=True)
        self.thread.start()

    def url(self, run_id: int) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/api/runs/{run_id}/events/"

    def run_events(self, run_id: int) -> list[dict[str, Any]]:
        with self.lock:
            held = self.events.get(run_id, {})
            return [held[key] for key in sorted(held)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --- One Fathom run through the product's launch path -------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RunTimes:
    step_s: float  # median wall interval between consecutive metrics events after warm-up
    save_s_per_step: float  # what checkpoints added per step on average (see `save_cost`)
    saves: int  # checkpoints whose cost was seen inside the measured steps
    dashboard_mfu: float  # median of the rank's own `mfu` over the measured steps
    steps: int  # intervals measured

    @property
    def user_step_s(self) -> float:
        return self.step_s + self.save_s_per_step


def save_cost(
    intervals: dict[int, float], saved: dict[int, float], metrics_time: dict[int, float], spec: RunSpec
) -> tuple[float, int]:
    """Seconds per step that checkpoints cost the run, and how many saves that was seen on.

    A save made after step s delays step s+1 (a synchronous save, or the optimizer step waiting
    for a background copy) and may slow s+2 (background writer threads take CPU): their excess
    over the median interval is its cost, spread over the measured steps, so saves count at the
    frequency the spec's policy made them. Excess from other load on the host is counted too,
    which errs against Fathom. When no save fell inside the window (an interval longer than the
    run), the run's last save (always made) is timed from its step's metrics event to its commit
    and spread over `train.checkpoint_interval`.
    """
    median = statistics.median(intervals.values())
    inside = [s for s in saved if s + 1 in intervals]
    if inside:
        excess = sum(max(0.0, intervals[k] - median) for s in inside for k in (s + 1, s + 2) if k in intervals)
        return excess / len(intervals), len(inside)
    last = spec.train.steps
    interval = spec.train.checkpoint_interval or last
    return (saved[last] - metrics_time[last]) / interval, 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fathom_run(
    spec: RunSpec, run_dir: Path, data: PreparedData, ingest: IngestServer, run_id: int, warmup: int
) -> RunTimes:
    """Runs `spec` to its end under a node agent started as the control plane starts it."""
    # The run's data folder, already prepared (the ranks would only tokenize the same corpus again).
    folder = RunDir(run_dir)
    shutil.copytree(data.tokens_path.parent, folder.data_dir)
    spec_path = folder.spec_file
    spec_path.write_text(spec.to_json())
    command = [
        sys.executable, "-m", "training.agent",
        "--spec", str(spec_path),
        "--run-dir", str(run_dir),
        "--node-rank", "0",
        "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
        "--events-url", ingest.url(run_id),
        f"--run-token={RUN_TOKEN}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = folder.agent_log(0)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        code = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=3600).returncode
    events = ingest.run_events(run_id)
    kinds = [e["kind"] for e in events]
    if code != 0 or "succeeded" not in kinds:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"bench.train_throughput: the run in {run_dir} failed (agent exit {code}):\n{tail}")
    metrics = {e["data"]["step"]: e for e in events if e["kind"] == "metrics"}
    last = spec.train.steps
    if sorted(metrics) != list(range(1, last + 1)) or any(e["kind"] == "restarting" for e in events):
        raise SystemExit(f"bench.train_throughput: the run in {run_dir} did not train steps 1..{last} in one attempt")
    measured = range(warmup + 1, last + 1)
    times = {step: e["time"] for step, e in metrics.items()}
    intervals = {s: times[s] - times[s - 1] for s in measured}
    saved = {e["data"]["step"]: e["time"] for e in events if e["kind"] == "checkpoint"}
    per_step, saves = save_cost(intervals, saved, times, spec)
    return RunTimes(
        step_s=statistics.median(intervals.values()),
        save_s_per_step=per_step,
        saves=saves,
        dashboard_mfu=statistics.median(metrics[s]["data"]["mfu"] for s in measured),
        steps=len(intervals),
    )


def compare(
    name: str,
    spec: RunSpec,
    threads: int,
    work: Path,
    data: PreparedData,
    ingest: IngestServer,
    run_id: int,
    args: argparse.Namespace,
) -> tuple[RunTimes, float]:
    """A Fathom run of `spec` between two halves of the plain loop's steps on `threads` threads."""
    torch.set_num_threads(threads)
    plain = PlainLoop(spec, data)
    plain.step()  # warm-up: allocator, thread pool
    before = [plain.step() for _ in range(args.steps // 2)]
    print(f"{name}: plain loop ({threads} thread(s)) {statistics.median(before):.2f} s/step before the run", flush=True)
    run = fathom_run(spec, work / name, data, ingest, run_id, args.warmup)
    print(f"{name}: fathom {run.step_s:.2f} s/step, +{run.save_s_per_step:.3f} s/step for saves", flush=True)
    after = [plain.step() for _ in range(args.steps - args.steps // 2)]
    print(f"{name}: plain loop {statistics.median(after):.2f} s/step after the run", flush=True)
    del plain
    return run, statistics.median(before + after)


def probe_memory(recompute: str, work_dir: Path) -> None:
    """Runs in a fresh process: two trainer steps, then prints the peak resident memory as JSON."""
    torch.set_num_threads(1)
    spec = bench_spec(recompute=recompute)
    trainer = Trainer(spec=spec, run_dir=work_dir / f"mem-{recompute}", data=prepare(work_dir, spec))
    for step in (1, 2):
        trainer.train_step(step)
    print(json.dumps({"recompute": recompute, "peak_mb": peak_memory_mb()}))


def measure_memory(recompute: str, work_dir: Path) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "bench.train_throughput", "--probe-memory", recompute, "--work-dir", str(work_dir)],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"])


def peaks(threads: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    return {
        "fp32": measure_matmul_peak(seconds=2.0, dtype=torch.float32),
        "bf16": measure_matmul_peak(n=512, seconds=1.0, dtype=torch.bfloat16),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.train_throughput", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="measured steps of each loop, after warm-up (≥ 20)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each Fathom run left out")
    parser.add_argument("--no-dp2", action="store_true", help="skip the two-rank comparison")
    parser.add_argument("--recipe", choices=("small", "tiny"), default="small", help="tiny: a quick check of the bench")
    parser.add_argument("--recompute-memory", action="store_true", help="also measure recompute's memory saving")
    parser.add_argument("--probe-memory", choices=("none", "selective", "full"), help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe_memory:
        probe_memory(args.probe_memory, args.work_dir)
        return
    started = time.perf_counter()
    ingest = IngestServer()
    with tempfile.TemporaryDirectory(prefix="fathom-bench-") as tmp:
        work = Path(tmp)
        spec = bench_spec(steps=args.warmup + args.steps, recipe=args.recipe)
        data = prepare(work, spec)
        first = {1: peaks(1), 2: peaks(2)}
        one, plain_s = compare("one process", spec, 1, work, data, ingest, 1, args)
        dp2 = dp2_plain_s = None
        if not args.no_dp2:
            spec2 = bench_spec(steps=args.warmup + args.steps, dp=2, recipe=args.recipe)
            dp2, dp2_plain_s = compare("dp2", spec2, 2, work, data, ingest, 2, args)
        last = {1: peaks(1), 2: peaks(2)}
        peak = {t: {k: max(first[t][k], last[t][k]) for k in first[t]} for t in first}
        memory = {m: measure_memory(m, work) for m in ("none", "full")} if args.recompute_memory else {}
    ingest.close()

    tokens = spec.train.global_batch * spec.model.seq_len
    fathom_tps = tokens / one.user_step_s
    plain_tps = tokens / plain_s
    wall_ratio = fathom_tps / plain_tps
    model_mfu = mfu(fathom_tps, spec.model, peak[1]["fp32"])
    print(
        f"model: {args.recipe} recipe, {spec.model.num_params() / 1e6:.1f}M parameters, batch {spec.train.global_batch} × "
        f"seq {spec.model.seq_len}, {spec.layout.precision}, checkpoints "
        f"{f'every {spec.train.checkpoint_interval} steps' if spec.train.checkpoint_interval else 'by the automatic policy'} "
        f"({'async' if spec.train.async_checkpoint else 'sync'}); {flops_per_token(spec.model) / 1e6:.1f} MFLOP/token"
    )
    print(
        f"peak matmul (wall clock): 1 thread fp32 {peak[1]['fp32'] / 1e9:.1f} GFLOP/s, bf16 {peak[1]['bf16'] / 1e9:.2f}; "
        f"2 threads fp32 {peak[2]['fp32'] / 1e9:.1f}, bf16 {peak[2]['bf16'] / 1e9:.2f}"
    )
    print(
        f"one process: fathom {fathom_tps:,.0f} tok/s ({one.step_s:.3f} s/step median of {one.steps}, "
        f"+{one.save_s_per_step * 1000:.1f} ms/step for {one.saves} save(s)), plain loop {plain_tps:,.0f} tok/s "
        f"({plain_s:.3f} s/step); wall_ratio {wall_ratio:.3f} (target ≥ 0.95)"
    )
    print(
        f"MFU {model_mfu:.1%} (target ≥ 50%; the dashboard showed {one.dashboard_mfu:.1%} median); "
        f"plain loop {mfu(plain_tps, spec.model, peak[1]['fp32']):.1%}"
    )
    keys = (
        f"clock=wall steps={args.steps} fathom_tok_s={fathom_tps:.0f} plain_tok_s={plain_tps:.0f} "
        f"wall_ratio={wall_ratio:.3f} mfu={model_mfu:.3f} dashboard_mfu={one.dashboard_mfu:.3f} "
        f"peak_fp32_gflops={peak[1]['fp32'] / 1e9:.1f} peak_bf16_gflops={peak[1]['bf16'] / 1e9:.2f} "
        f"save_ms_per_step={one.save_s_per_step * 1000:.1f} saves={one.saves}"
    )
    if dp2 is not None and dp2_plain_s is not None:
        dp2_tps = tokens / dp2.user_step_s
        dp2_plain_tps = tokens / dp2_plain_s
        dp2_mfu = mfu(dp2_tps, spec.model, 2 * peak[1]["fp32"])
        print(
            f"dp2: fathom {dp2_tps:,.0f} tok/s (2 ranks × 1 thread, {dp2.step_s:.3f} s/step), plain loop on 2 threads "
            f"{dp2_plain_tps:,.0f} tok/s; dp2_wall_ratio {dp2_tps / dp2_plain_tps:.3f}; MFU {dp2_mfu:.1%} "
            f"(dashboard {dp2.dashboard_mfu:.1%})"
        )
        keys += (
            f" dp2_tok_s={dp2_tps:.0f} dp2_plain_tok_s={dp2_plain_tps:.0f} "
            f"dp2_wall_ratio={dp2_tps / dp2_plain_tps:.3f} dp2_mfu={dp2_mfu:.3f}"
        )
    if memory:
        print(f"peak memory: recompute none {memory['none']:.0f} MiB, full {memory['full']:.0f} MiB")
        keys += f" mem_none_mb={memory['none']:.0f} mem_full_mb={memory['full']:.0f}"
    print(f"bench took {time.perf_counter() - started:.0f} s", flush=True)
    print(keys)


if __name__ == "__main__":
    main()
