"""The reporter loses nothing while the control plane is down and sends nothing twice after."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from tests.faults.harness import IngestServer, read_jsonl, wait_for
from training.agent.uplink import Reporter, ReporterConfig
from training.run_dir import NodeDir

OUTAGE_SECONDS = 10.0


def _reporter(tmp_path: Path, ingest: IngestServer, events_file: Path) -> Reporter:
    return Reporter(
        ReporterConfig(
            source="node-0",
            spool=NodeDir(tmp_path / "node0"),
            events_url=ingest.url,
            run_token=ingest.token,
            tail_files=(events_file,),
        )
    )


def _write_metrics(events_file: Path, stop: threading.Event) -> None:
    """Rank 0's side: a metrics line every 20 ms, sometimes flushed in the middle of a line."""
    step = 0
    with open(events_file, "a") as f:
        while not stop.is_set():
            step += 1
            line = json.dumps({"kind": "metrics", "time": time.time(), "step": step, "loss": 1.0 / step}) + "\n"
            half = len(line) // 2
            f.write(line[:half])
            f.flush()
            f.write(line[half:])
            f.flush()
            time.sleep(0.02)


def test_events_survive_a_ten_second_outage_and_arrive_exactly_once(tmp_path: Path, ingest: IngestServer) -> None:
    events_file = tmp_path / "events.jsonl"
    reporter = _reporter(tmp_path, ingest, events_file)
    reporter.start()
    stop_writing = threading.Event()
    writer = threading.Thread(target=_write_metrics, args=(events_file, stop_writing))
    writer.start()
    try:
        reporter.emit("agent_started", {"node": 0})
        wait_for(lambda: len(ingest.held("node-0")) >= 20, 30, "the first events to arrive")

        ingest.stop()
        reporter.emit("rank_failed", {"rank": 1, "reason": "killed by signal"})
        wait_for(lambda: reporter.last_error is not None, 30, "the reporter to notice the outage")
        time.sleep(OUTAGE_SECONDS)
        reporter.emit("restarting", {"attempt": 1, "from_step": 0})
        ingest.start()  # the same port, an empty connection table: the control plane is back
    finally:
        stop_writing.set()
        writer.join()
    assert reporter.close(flush_timeout=30.0), reporter.last_error

    spooled = read_jsonl(tmp_path / "node0" / "spool.jsonl")
    held = ingest.held("node-0")
    assert ingest.duplicates == 0
    assert [e["seq"] for e in held] == list(range(1, len(spooled) + 1))
    assert held == [{k: e[k] for k in ("seq", "kind", "time", "data")} for e in spooled]
    written = [json.loads(line) for line in events_file.read_text().splitlines()]
    assert [e["data"]["step"] for e in held if e["kind"] == "metrics"] == [w["step"] for w in written]
    assert [e["kind"] for e in held if e["kind"] != "metrics"] == ["agent_started", "rank_failed", "restarting"]


def test_a_new_reporter_on_the_same_spool_continues_the_sequence_without_resending(
    tmp_path: Path, ingest: IngestServer
) -> None:
    events_file = tmp_path / "events.jsonl"
    events_file.write_text("".join(json.dumps({"kind": "metrics", "time": 1.0, "step": s}) + "\n" for s in (1, 2, 3)))
    first = _reporter(tmp_path, ingest, events_file)
    first.start()
    first.emit("agent_started", {"node": 0})
    assert first.close(flush_timeout=30.0)

    with open(events_file, "a") as f:
        f.write(json.dumps({"kind": "metrics", "time": 2.0, "step": 4}) + "\n")
    second = _reporter(tmp_path, ingest, events_file)
    second.start()
    second.emit("agent_started", {"node": 0})
    assert second.close(flush_timeout=30.0)

    held = ingest.held("node-0")
    assert ingest.duplicates == 0
    assert [(e["seq"], e["kind"], e["data"].get("step")) for e in held] == [
        (1, "metrics", 1),
        (2, "metrics", 2),
        (3, "metrics", 3),
        (4, "agent_started", None),
        (5, "metrics", 4),
        (6, "agent_started", None),
    ]


def test_events_stay_in_the_spool_when_the_control_plane_never_answers(tmp_path: Path, ingest: IngestServer) -> None:
    ingest.stop()
    reporter = _reporter(tmp_path, ingest, tmp_path / "events.jsonl")
    reporter.start()
    reporter.emit("agent_started", {"node": 0})
    reporter.emit("failed", {"reason": "test"})
    assert not reporter.close(flush_timeout=1.0)
    assert [e["kind"] for e in read_jsonl(tmp_path / "node0" / "spool.jsonl")] == ["agent_started", "failed"]
    assert reporter.undelivered == 2
