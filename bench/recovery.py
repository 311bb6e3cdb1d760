"""How fast the node agent recovers, and how much training time survives a crash every 60 s.

    python -m bench.recovery [--period 60] [--crashes 3]

One agent, two real trainer ranks (gloo), one run. After the first step, a rank is SIGKILLed in
the middle of every `period` seconds (`crashes` times), then one rank is SIGSTOPped; the run is
then cancelled. From the agent's events and the kill times it prints:

* crash detection: kill → the agent's `rank_failed` (target ≤ 0.2 s);
* hang detection: SIGSTOP → `rank_failed` reason "hung" (target ≤ heartbeat timeout + 1 s);
* recovery: kill → the first step completed by the restarted ranks (target ≤ 5 s);
* effective training time: Σ step_time of the distinct steps the run kept ÷ wall time, over the
  crash window (target ≥ 95%), beside the same ratio before the first crash (no failures), so
  the cost of failures is told apart from the cost of checkpoints.
"""

from __future__ import annotations

import argparse
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
from typing import Any

from training.config import RunSpec, tiny
from training.heartbeat import read_beat

ROOT = Path(__file__).resolve().parent.parent


def _spec(checkpoint_interval: int, async_checkpoint: bool) -> RunSpec:
    data = tiny(dp=2).to_dict()
    data["train"].update(
        steps=100_000, checkpoint_interval=checkpoint_interval, warmup_steps=10, async_checkpoint=async_checkpoint
    )
    data["nodes"].update(max_restarts=100)  # heartbeat_timeout stays at the production default
    return RunSpec.from_dict(data)


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "node0" / "spool.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.time()))


def _wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise SystemExit(f"bench.recovery: timed out waiting for {what}")


def _rank_pid(run_dir: Path, rank: int) -> int:
    beat = _wait_for(lambda: read_beat(run_dir / "node0" / "heartbeat" / f"rank{rank}.json"), 120, f"rank {rank}")
    return int(beat.pid)


def _resumed_step_after(events: list[dict[str, Any]], moment: float) -> float | None:
    """Time of the first step completed by ranks that resumed after `moment` (None: not yet)."""
    resumed = next((e for e in events if e["kind"] == "resumed" and e["time"] > moment), None)
    if resumed is None:
        return None
    return next((e["time"] for e in events if e["kind"] == "metrics" and e["seq"] > resumed["seq"]), None)


def _effective(events: list[dict[str, Any]], start: float, end: float) -> float:
    """Σ step_time of the distinct steps finished in [start, end] (a replayed step counts once) ÷ wall."""
    kept: dict[int, float] = {}
    for e in events:
        if e["kind"] == "metrics" and start <= e["time"] - e["data"]["step_time"] and e["time"] <= end:
            kept[e["data"]["step"]] = e["data"]["step_time"]
    return sum(kept.values()) / (end - start)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.recovery")
    parser.add_argument("--period", type=float, default=60.0, help="seconds between injected crashes")
    parser.add_argument("--crashes", type=int, default=3)
    parser.add_argument(
        "--checkpoint-interval",
        type=int,
        default=20,
        # Young's rule: the interval that loses least is √(2 · save cost · time between failures);
        # with ~5 ms of training-thread time per background save and a crash a minute that is
        # √(2 · 0.005 · 60) ≈ 0.8 s, about 20 steps of ~35 ms here.
        help="steps between checkpoints (20 ≈ every 0.7 s here)",
    )
    parser.add_argument("--sync-checkpoint", action="store_true", help="block training while a checkpoint is written")
    parser.add_argument("--keep", action="store_true", help="keep the run folder and print where it is")
    args = parser.parse_args()

    tmp = tempfile.mkdtemp(prefix="fathom-recovery-")
    try:
        if args.keep:
            print(f"run folder: {tmp}", flush=True)
        run_dir = Path(tmp) / "run"
        spec = _spec(args.checkpoint_interval, async_checkpoint=not args.sync_checkpoint)
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(spec.to_json())
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        with open(Path(tmp) / "agent.out", "wb") as out:
            agent = subprocess.Popen(
                [sys.executable, "-m", "training.agent", "--spec", str(spec_path), "--run-dir", str(run_dir)],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            first = _wait_for(
                lambda: next((e for e in _events(run_dir) if e["kind"] == "metrics"), None), 180, "the first step"
            )
            start = first["time"] - first["data"]["step_time"]
            kills: list[float] = []
            for i in range(args.crashes):
                _wait_until(start + args.period * (i + 0.5))
                pid = _rank_pid(run_dir, i % 2)
                os.kill(pid, signal.SIGKILL)
                kills.append(time.time())
                print(f"crash {i + 1}: SIGKILL rank {i % 2} (pid {pid}) at +{kills[-1] - start:.1f} s", flush=True)
            end = start + args.period * args.crashes
            _wait_until(end)

            # The hang comes after the crash window, so its timeout does not count against the ratio.
            _wait_for(lambda: _resumed_step_after(_events(run_dir), kills[-1]), 120, "recovery from the last crash")
            pid = _rank_pid(run_dir, 1)
            os.kill(pid, signal.SIGSTOP)
            stopped = time.time()
            print(f"hang: SIGSTOP rank 1 (pid {pid}) at +{stopped - start:.1f} s", flush=True)
            timeout = spec.nodes.heartbeat_timeout
            _wait_for(lambda: _resumed_step_after(_events(run_dir), stopped), timeout + 120, "recovery from the hang")
        finally:
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=120)

        events = _events(run_dir)
        failures = [e for e in events if e["kind"] == "rank_failed"]

        def detected(after: float, reason: str) -> float:
            return next(e["time"] for e in failures if e["time"] > after and e["data"]["reason"] == reason)

        crash_detect = [detected(k, "killed by signal") - k for k in kills]
        hang_detect = detected(stopped, "hung") - stopped
        recovery = [(_resumed_step_after(events, k) or float("nan")) - k for k in kills]
        effective = _effective(events, start, end)
        baseline = _effective(events, start, kills[0])
        step_time = statistics.median(e["data"]["step_time"] for e in events if e["kind"] == "metrics")
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    print(f"step time (median): {step_time * 1000:.0f} ms, checkpoint every {args.checkpoint_interval} steps")
    print(f"crash detection: {', '.join(f'{d * 1000:.0f} ms' for d in crash_detect)}   (target ≤ 200 ms)")
    print(
        f"hang detection: {hang_detect:.2f} s with heartbeat_timeout {timeout:.0f} s   (target ≤ {timeout + 1:.0f} s)"
    )
    print(f"failure → first resumed step: {', '.join(f'{r:.2f} s' for r in recovery)}   (target ≤ 5 s)")
    print(
        f"effective training time: {effective:.1%} with a crash every {args.period:.0f} s; "
        f"{baseline:.1%} before the first crash   (target ≥ 95%)"
    )
    print(
        f"crash_detect_ms={max(crash_detect) * 1000:.0f} hang_detect_s={hang_detect:.2f} "
        f"hang_timeout_s={timeout:.0f} recovery_s={max(recovery):.2f} "
        f"effective_pct={effective * 100:.1f} baseline_pct={baseline * 100:.1f}"
    )


if __name__ == "__main__":
    main()
