"""How fast the node agent recovers, and how much training time survives a crash every 60 s, with
the spec a user gets by default.

    python -m bench.recovery [--period 60] [--crashes 10]

One agent, two real trainer ranks (gloo), one run of the `tiny` recipe as the control plane
resolves it (`layout.dp=2`, a long `train.steps`; checkpoint policy, restart budget and heartbeat
timeout are the product's defaults). After the first step, a rank is SIGKILLed in the middle of
every `period` seconds (`crashes` times), and one rank is SIGSTOPped half-way through the window,
between two crashes; the run is cancelled at the window's end. From the agent's events and the
fault times it prints:

* crash detection: kill → the agent's `rank_failed` (target ≤ 0.2 s);
* hang detection: SIGSTOP → `rank_failed` reason "hung" (target ≤ heartbeat timeout + 1 s);
* recovery: fault → the first step completed by the restarted ranks (target ≤ 5 s; for the hang,
  counted from its detection);
* effective training time: Σ step_time of the distinct steps the run kept ÷ wall time over the
  whole window, both faults inside it (target ≥ 95%); beside it the same ratio before the first
  crash, so the cost of failures is told apart from the cost of checkpoints;
* the checkpoint policy against Young's rule: the interval that loses least is √(2·C·M) for a
  save that costs the training loop C seconds and a failure every M seconds. C is measured in this
  run (wall time between steps beyond Σ step_time, per checkpoint, before the first crash), M is
  `period`.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
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
from training.run_dir import RunDir

ROOT = Path(__file__).resolve().parent.parent


def _spec() -> RunSpec:
    """What `POST /api/runs/` with recipe "tiny" and `{"layout": {"dp": 2}, "train": {"steps": N}}`
    gives: every other field is the product's default."""
    data = tiny(dp=2).to_dict()
    data["train"]["steps"] = 1_000_000
    return RunSpec.from_dict(data)


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = RunDir(run_dir).node(0).spool_file
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
    beat = _wait_for(lambda: read_beat(RunDir(run_dir).node(0).heartbeat_file(rank)), 120, f"rank {rank}")
    return int(beat.pid)


def _resumed_step_after(events: list[dict[str, Any]], moment: float) -> float | None:
    """Time of the first step completed by ranks that resumed after `moment` (None: not yet)."""
    resumed = next((e for e in events if e["kind"] == "resumed" and e["time"] > moment), None)
    if resumed is None:
        return None
    return next((e["time"] for e in events if e["kind"] == "metrics" and e["seq"] > resumed["seq"]), None)


def _trained_time(events: list[dict[str, Any]], faults: list[float], typical: float) -> list[dict[str, Any]]:
    """The events with each step that a fault fell inside counted for `typical` seconds (the run's
    median step), its start moved to match: a step that a hung rank finished once the agent continued
    it for its stack dump took the whole hang, and that time is the fault's, not training's."""
    out = []
    for e in events:
        if e["kind"] == "metrics" and any(e["time"] - e["data"]["step_time"] < f < e["time"] for f in faults):
            e = {**e, "data": {**e["data"], "step_time": min(e["data"]["step_time"], typical)}}
        out.append(e)
    return out


def _kept(events: list[dict[str, Any]], start: float, end: float) -> dict[int, float]:
    """step → step_time of the distinct steps finished in [start, end] (a replayed step counts once)."""
    kept: dict[int, float] = {}
    for e in events:
        if e["kind"] == "metrics" and start <= e["time"] - e["data"]["step_time"] and e["time"] <= end:
            kept[e["data"]["step"]] = e["data"]["step_time"]
    return kept


def _effective(events: list[dict[str, Any]], start: float, end: float) -> float:
    return sum(_kept(events, start, end).values()) / (end - start)


def _time_lost(events: list[dict[str, Any]], start: float, end: float, faults: list[float]) -> dict[str, float]:
    """Where the wall time in [start, end] that no kept step used went, in seconds:

    * `down`: from the end of the last step before each failure to the start of the first step
      after it (detection, the hang's timeout, restart, resume), or to the (typical) start of a
      step that a fault fell inside and that finished after it;
    * `replay`: steps trained again after a restart (the work since the state resumed from);
    * `between_steps`: gaps between consecutive steps of one attempt (event writes, in-memory
      snapshots, a checkpoint's time on the training thread).

    kept + the three = end - start, up to the partial steps at the window's edges.
    """
    steps = [e for e in events if e["kind"] == "metrics" and start <= e["time"] - e["data"]["step_time"] and e["time"] <= end]
    trained = sum(e["data"]["step_time"] for e in steps)
    interruptions = sorted([e["time"] for e in events if e["kind"] == "restarting"] + faults)
    down = between = 0.0
    for before, after in zip(steps, steps[1:], strict=False):
        gap = after["time"] - after["data"]["step_time"] - before["time"]
        if bisect.bisect_left(interruptions, before["time"]) < bisect.bisect_right(interruptions, after["time"]):
            down += gap
        else:
            between += gap
    return {
        "down": down,
        "replay": trained - sum(_kept(events, start, end).values()),
        "between_steps": between,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.recovery")
    parser.add_argument("--period", type=float, default=60.0, help="seconds between injected crashes")
    parser.add_argument("--crashes", type=int, default=10, help="crashes in the window (≥ 2; the hang goes between two)")
    parser.add_argument("--keep", action="store_true", help="keep the run folder and print where it is")
    args = parser.parse_args()
    if args.crashes < 2:
        parser.error("--crashes must be at least 2: the hang goes between two crashes")

    tmp = tempfile.mkdtemp(prefix="fathom-recovery-")
    try:
        if args.keep:
            print(f"run folder: {tmp}", flush=True)
        run_dir = Path(tmp) / "run"
        spec = _spec()
        run_dir.mkdir()
        spec_path = RunDir(run_dir).spec_file  # where the control plane's launcher puts it
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
            end = start + args.period * args.crashes
            hang_at = start + args.period * (args.crashes // 2)  # half a period from the crashes either side
            kills: list[float] = []
            stopped = 0.0
            plan = sorted([(start + args.period * (i + 0.5), "crash", i) for i in range(args.crashes)] + [(hang_at, "hang", 0)])
            for moment, kind, i in plan:
                _wait_until(moment)
                rank = i % 2 if kind == "crash" else 1
                pid = _rank_pid(run_dir, rank)
                os.kill(pid, signal.SIGKILL if kind == "crash" else signal.SIGSTOP)
                if kind == "crash":
                    kills.append(time.time())
                    print(f"crash {i + 1}: SIGKILL rank {rank} (pid {pid}) at +{kills[-1] - start:.1f} s", flush=True)
                else:
                    stopped = time.time()
                    print(f"hang: SIGSTOP rank {rank} (pid {pid}) at +{stopped - start:.1f} s", flush=True)
            _wait_until(end)
        finally:
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=120)

        events = _events(run_dir)
        step_time = statistics.median(e["data"]["step_time"] for e in events if e["kind"] == "metrics")
        events = _trained_time(events, [*kills, stopped], step_time)
        failures = [e for e in events if e["kind"] == "rank_failed"]

        def detected(after: float, reason: str) -> float:
            return next(e["time"] for e in failures if e["time"] > after and e["data"]["reason"] == reason)

        crash_detect = [detected(k, "killed by signal") - k for k in kills]
        hang_detected = detected(stopped, "hung")
        hang_detect = hang_detected - stopped
        recovery = [(_resumed_step_after(events, k) or float("nan")) - k for k in kills]
        hang_recovery = (_resumed_step_after(events, hang_detected) or float("nan")) - hang_detected
        effective = _effective(events, start, end)
        lost = _time_lost(events, start, end, [*kills, stopped])
        baseline_end = kills[0]
        baseline = _effective(events, start, baseline_end)
        # Young's rule from this run's own figures: what a save cost the loop before any failure.
        saves = [e for e in events if e["kind"] == "checkpoint" and start <= e["time"] <= baseline_end]
        kept = _kept(events, start, baseline_end)
        lost_between_steps = (baseline_end - start) - sum(kept.values())
        save_cost = lost_between_steps / max(1, len(saves))
        young_s = math.sqrt(2 * save_cost * args.period)
        checkpoint_steps = sorted({e["data"]["step"] for e in events if e["kind"] == "checkpoint"})
        gaps = [b - a for a, b in zip(checkpoint_steps, checkpoint_steps[1:], strict=False) if b > a]
        interval_s = statistics.median(gaps) * step_time if gaps else float("nan")
        restarts = sum(1 for e in events if e["kind"] == "restarting")
        from_memory = sum(1 for e in events if e["kind"] == "resumed" and e["data"].get("source") == "memory")
        at_failure = sum(1 for e in events if e["kind"] == "resumed" and e["data"].get("at_failure"))
        failed = any(e["kind"] == "failed" for e in events)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    timeout = spec.nodes.heartbeat_timeout
    print(
        f"spec: tiny recipe, dp=2, product defaults: checkpoint_interval={spec.train.checkpoint_interval} "
        f"async_checkpoint={spec.train.async_checkpoint} memory_snapshots={spec.train.memory_snapshots} "
        f"max_restarts={spec.nodes.max_restarts} "
        f"heartbeat_timeout={timeout:.0f} s"
    )
    print(
        f"step time (median): {step_time * 1000:.0f} ms; {restarts} restarts ({from_memory} resumed from in-memory "
        f"snapshots, {at_failure} of them taken at the failure), run {'FAILED' if failed else 'alive'}"
    )
    print(
        f"checkpoints: every {interval_s:.2f} s (median); a save cost the loop {save_cost * 1000:.0f} ms, so Young's "
        f"√(2·C·M) with M = {args.period:.0f} s is {young_s:.2f} s"
    )
    print(f"crash detection: {', '.join(f'{d * 1000:.0f} ms' for d in crash_detect)}   (target ≤ 200 ms)")
    print(
        f"hang detection: {hang_detect:.2f} s with heartbeat_timeout {timeout:.0f} s   (target ≤ {timeout + 1:.0f} s)"
    )
    print(
        f"failure → first resumed step: {', '.join(f'{r:.2f} s' for r in recovery)}; "
        f"hang detected → {hang_recovery:.2f} s   (target ≤ 5 s)"
    )
    print(
        f"effective training time: {effective:.1%} over {args.period * args.crashes:.0f} s with a crash every "
        f"{args.period:.0f} s and one hang; {baseline:.1%} before the first crash   (target ≥ 95%)"
    )
    print(
        f"time no kept step used: {lost['down']:.1f} s down (failure → first resumed step), {lost['replay']:.1f} s "
        f"replaying steps, {lost['between_steps']:.1f} s between steps (events, snapshots, saves)"
    )
    print(
        f"clock=wall crash_detect_ms={max(crash_detect) * 1000:.0f} hang_detect_s={hang_detect:.2f} "
        f"hang_timeout_s={timeout:.0f} recovery_s={max([*recovery, hang_recovery]):.2f} "
        f"effective_pct={effective * 100:.1f} baseline_pct={baseline * 100:.1f} "
        f"checkpoint_interval_s={interval_s:.2f} young_interval_s={young_s:.2f} restarts={restarts} "
        f"resumed_from_memory={from_memory} resumed_at_failure={at_failure} lost_down_s={lost['down']:.1f} lost_replay_s={lost['replay']:.1f} "
        f"lost_between_steps_s={lost['between_steps']:.1f} "
        f"defaults=product"
    )


if __name__ == "__main__":
    main()
