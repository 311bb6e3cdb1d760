"""The node's event reporter: spool every event to disk, then ship it to the control plane.

Two kinds of events enter: the agent's own lifecycle events (`emit`) and the JSON lines rank 0
appends to the events file(s) (tailed). Each gets the next `seq` of this source ("node-K") and is
appended to the node's spool file and fsync'd *before* anything is sent, so an event exists on disk from
the moment it is known. A thread ships what the control plane has not acknowledged, in batches:

    POST {events_url}   Authorization: Bearer {run_token}
    {"source": "node-0", "events": [{"seq": 1, "kind": "metrics", "time": 1732870000.1, "data": {...}}]}
    -> 200 {"last_seq": n}      (the highest seq the server holds from this source)

and remembers `last_seq`. The thread sleeps until a rank writes to an events file or the agent
emits (`training.agent.wakeup`: inotify and a pipe), so a point leaves within milliseconds of its birth;
while lines keep coming, the time one POST takes gathers the next batch. While the control plane is down, requests fail and are retried with
exponential backoff; nothing is dropped because everything is in the spool. Nothing is delivered
twice because only seq > last_seq is sent, and the server dedupes on (run, source, seq) anyway,
which covers the one unavoidable race: a request the server committed whose answer was lost.

An agent started again on the same run folder reads the spool back: the seq counter continues,
unacknowledged events are sent, and each tailed file is read on from where the spool says it was.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.agent.wakeup import FileWaker
from training.run_dir import NodeDir

# (kind, time, data, where it was read: (events file, offset after the line) or None)
ACKED_WRITE_INTERVAL = 1.0  # seconds between writes of the spool's `acked` file
Incoming = tuple[str, float, dict[str, Any], tuple[str, int] | None]


@dataclass(kw_only=True, frozen=True)
class ReporterConfig:
    source: str  # "node-K": seq is counted per source
    spool: NodeDir  # the node folder whose spool and acked files this reporter keeps
    events_url: str | None  # None: spool only (a run with no control plane)
    run_token: str | None
    tail_files: tuple[Path, ...] = ()
    # Writes to the events files and emit() wake the thread at once; this is the backstop for
    # writes no notification reports (inotify missing, or a file on a network file system).
    poll_interval: float = 0.2
    batch_size: int = 500  # events per POST; bounds a request's size after a long outage
    request_timeout: float = 5.0  # a control plane that takes longer is treated as down
    backoff_initial: float = 0.25  # first retry delay after a failed POST; doubles per failure
    backoff_max: float = 4.0  # cap, so a control plane that comes back is reached within seconds
    # With nothing to send for this long, an empty batch is posted: the control plane shows an
    # agent that posts nothing for three of these as "silent" (a stopped or cut-off host).
    idle_post_interval: float = 5.0


class EventSpool:
    """Append-only JSON lines, fsync'd per append; recovers its counters from its own content."""

    def __init__(self, node: NodeDir, *, track_unacked: bool = True) -> None:
        # Without a control plane nothing is ever acknowledged; keeping every event of a long
        # run in memory for nobody would only grow the agent.
        self._track_unacked = track_unacked
        node.path.mkdir(parents=True, exist_ok=True)
        self.path = node.spool_file
        self._acked_path = node.acked_file
        self.last_seq = 0
        self.tail_offsets: dict[str, int] = {}
        self.acked = int(self._acked_path.read_text()) if self._acked_path.exists() else 0
        self._acked_on_disk = self.acked
        self._acked_written_at = 0.0
        self.unacked: list[dict[str, Any]] = []
        for entry in self._read_all():
            self._note(entry)
        self._file = open(self.path, "ab")  # held open for the reporter's lifetime

    def append(self, entries: list[Incoming]) -> None:
        """Spools (kind, time, data, tail position) tuples; returns once they are on disk."""
        if not entries:
            return
        lines = []
        for kind, when, data, tail in entries:
            entry: dict[str, Any] = {"seq": self.last_seq + 1, "kind": kind, "time": when, "data": data}
            if tail is not None:
                entry["tail"] = list(tail)
            lines.append(json.dumps(entry, separators=(",", ":")) + "\n")
            self._note(entry)
        self._file.write("".join(lines).encode())
        self._file.flush()
        os.fsync(self._file.fileno())

    def acknowledge(self, last_seq: int) -> None:
        """Records the server's `last_seq`; a lower value than before means it lost events: resend."""
        if last_seq < self.acked:
            self.unacked = [e for e in self._read_all() if e["seq"] > last_seq]
        else:
            self.unacked = [e for e in self.unacked if e["seq"] > last_seq]
        self.acked = last_seq
        # Written at most once a second (two file operations per POST were a fifth of the
        # uplink's time at 1,000 points/s): losing it only causes a resend, which dedupes.
        if time.monotonic() - self._acked_written_at >= ACKED_WRITE_INTERVAL:
            self._write_acked()

    def _write_acked(self) -> None:
        tmp = self._acked_path.with_suffix(".tmp")
        tmp.write_text(str(self.acked))
        os.replace(tmp, self._acked_path)
        self._acked_on_disk = self.acked
        self._acked_written_at = time.monotonic()

    def close(self) -> None:
        if self.acked != self._acked_on_disk:
            self._write_acked()
        self._file.close()

    def _note(self, entry: dict[str, Any]) -> None:
        self.last_seq = entry["seq"]
        if "tail" in entry:
            name, offset = entry["tail"]
            self.tail_offsets[name] = offset
        if self._track_unacked and entry["seq"] > self.acked:
            self.unacked.append(entry)

    def _read_all(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        raw = self.path.read_bytes()
        complete = raw[: raw.rfind(b"\n") + 1]
        if len(complete) != len(raw):
            # A crash in the middle of an append left a partial last line; it was never
            # acknowledged to anyone, so it is cut off and its source line is read again.
            with open(self.path, "r+b") as f:
                f.truncate(len(complete))
        return [json.loads(line) for line in complete.splitlines() if line.strip()]


def wire(entry: dict[str, Any]) -> dict[str, Any]:
    return {"seq": entry["seq"], "kind": entry["kind"], "time": entry["time"], "data": entry["data"]}


class Reporter:
    def __init__(self, config: ReporterConfig) -> None:
        self.config = config
        self.spool = EventSpool(config.spool, track_unacked=config.events_url is not None)
        # emit() runs on the agent's thread, tailing on ours; re-entrant because emit tails first.
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fathom-reporter", daemon=True)
        self._waker = FileWaker(config.tail_files)
        self._backoff = 0.0
        self._retry_at = 0.0  # time.monotonic() before which a failed control plane is not asked again
        # One kept-alive connection: a new TCP connection per POST cost as much as the request.
        self._connection: http.client.HTTPConnection | None = None
        self._last_post = time.monotonic()
        self.last_error: str | None = None

    def start(self) -> None:
        self._thread.start()

    def emit(self, kind: str, data: dict[str, Any], when: float | None = None) -> None:
        with self._lock:
            # Rank 0's lines written before this moment come first, so the seq order follows
            # cause and effect (the metrics of step 7, then "rank 1 failed").
            self._tail()
            self.spool.append([(kind, time.time() if when is None else when, data, None)])
        self._waker.wake()

    def close(self, flush_timeout: float) -> bool:
        """Stops the thread, then keeps shipping until all is acknowledged or the time is up.

        Returns whether everything was delivered; what was not stays in the spool for the next
        agent on this run folder.
        """
        self._stop.set()
        self._waker.wake()
        if self._thread.is_alive():
            self._thread.join()
        deadline = time.monotonic() + flush_timeout
        self._tail()
        delivered = self._ship_all(deadline)
        if self._connection is not None:
            self._connection.close()
        self.spool.close()
        self._waker.close()
        return delivered

    @property
    def undelivered(self) -> int:
        return len(self.spool.unacked)

    # --- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._tail()  # also while the control plane is down: an event is safe once spooled
            if self.config.events_url and self.spool.unacked:
                if time.monotonic() >= self._retry_at:  # not while backing off after a failed POST
                    self._ship_all(deadline=time.monotonic() + self.config.poll_interval)
            elif self.config.events_url and time.monotonic() - self._last_post >= self.config.idle_post_interval:
                self._post_batch()  # empty: says this agent is alive
            timeout = self.config.poll_interval
            if self.spool.unacked and self._retry_at > time.monotonic():
                timeout = min(timeout, self._retry_at - time.monotonic())
            self._waker.wait(timeout)

    def _ship_all(self, deadline: float) -> bool:
        """Ships batch after batch until done, a failure (then backs off) or the deadline."""
        if not self.config.events_url:
            return True  # a run without a control plane: the spool is the record
        while self.spool.unacked:
            if not self._post_batch():
                if time.monotonic() + self._backoff > deadline:
                    return False
                time.sleep(self._backoff)
            elif time.monotonic() > deadline and self.spool.unacked:
                return False
        return True

    def _post_batch(self) -> bool:
        with self._lock:
            batch = [wire(e) for e in self.spool.unacked[: self.config.batch_size]]
        body = json.dumps({"source": self.config.source, "events": batch}).encode()
        headers = {"Content-Type": "application/json"}
        if self.config.run_token:
            headers["Authorization"] = f"Bearer {self.config.run_token}"
        try:
            last_seq = self._post(body, headers)
        except (OSError, ValueError, KeyError, TypeError, http.client.HTTPException) as exc:
            if self._connection is not None:
                self._connection.close()  # whatever state it is in, the next POST starts afresh
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._backoff = min(self.config.backoff_max, max(self.config.backoff_initial, 2 * self._backoff))
            self._retry_at = time.monotonic() + self._backoff
            return False
        with self._lock:
            self.spool.acknowledge(last_seq)
        self._backoff = 0.0
        self._last_post = time.monotonic()
        self.last_error = None
        return True

    def _post(self, body: bytes, headers: dict[str, str]) -> int:
        """POSTs one batch on the kept-alive connection; returns the server's `last_seq`."""
        url = urllib.parse.urlsplit(self.config.events_url or "")
        if self._connection is None:
            kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
            self._connection = kind(url.netloc, timeout=self.config.request_timeout)
        path = url.path + (f"?{url.query}" if url.query else "")
        self._connection.request("POST", path or "/", body=body, headers=headers)
        response = self._connection.getresponse()
        payload = response.read()
        if response.status != 200:
            raise ValueError(f"HTTP {response.status}: {payload[:200].decode(errors='replace')}")
        return int(json.loads(payload)["last_seq"])

    def _tail(self) -> None:
        with self._lock:
            self._tail_locked()

    def _tail_locked(self) -> None:
        for path in self.config.tail_files:
            offset = self.spool.tail_offsets.get(str(path), 0)
            try:
                with open(path, "rb") as f:
                    f.seek(0, os.SEEK_END)
                    if f.tell() < offset:
                        offset = 0  # the file was replaced by a new, shorter one
                    f.seek(offset)
                    chunk = f.read()
            except FileNotFoundError:
                continue
            entries: list[Incoming] = []
            for line in chunk[: chunk.rfind(b"\n") + 1].splitlines(keepends=True):
                offset += len(line)  # only complete lines: the writer may be mid-line
                if line.strip():
                    kind, when, data = _parse_event_line(line)
                    entries.append((kind, when, data, (str(path), offset)))
            self.spool.append(entries)


def _parse_event_line(line: bytes) -> tuple[str, float, dict[str, Any]]:
    """A rank-0 line `{"kind": ..., "time": ..., fields...}` (or with a "data" object)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return "log", time.time(), {"stream": "events", "line": line.decode(errors="replace").rstrip("\n")}
    kind = str(record.pop("kind", "log"))
    when = float(record.pop("time", time.time()))
    data = record.pop("data") if isinstance(record.get("data"), dict) and len(record) == 1 else record
    return kind, when, data
