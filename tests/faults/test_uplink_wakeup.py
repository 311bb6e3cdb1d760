"""The uplink wakes when a rank writes its events file, not on a timer; its own spool does not wake it."""

from __future__ import annotations

import threading
from pathlib import Path

from training.agent.wakeup import FileWaker
from training.rank_events import EventLog

# Long enough that returning by timeout and returning by notification cannot be confused.
NEVER = 30.0


def test_a_line_written_by_a_rank_wakes_the_uplink(tmp_path: Path) -> None:
    events_file = tmp_path / "node0" / "events.jsonl"
    waker = FileWaker([events_file])
    assert waker.notified  # Linux: inotify
    log = EventLog(events_file)  # the file is created after the watch: still seen
    writer = threading.Timer(0.2, lambda: log.emit("metrics", step=1, loss=2.0))
    writer.start()
    assert waker.wait(NEVER) is True
    writer.join()
    log.close()
    waker.close()


def test_writes_to_other_files_of_the_folder_do_not_wake_it(tmp_path: Path) -> None:
    events_file = tmp_path / "events.jsonl"
    waker = FileWaker([events_file])
    (tmp_path / "spool.jsonl").write_text('{"seq": 1}\n')
    assert waker.wait(0.5) is False
    waker.close()


def test_wake_returns_at_once_from_another_thread(tmp_path: Path) -> None:
    waker = FileWaker([tmp_path / "events.jsonl"])
    threading.Timer(0.2, waker.wake).start()
    assert waker.wait(NEVER) is True
    waker.close()
