"""Wakes the event reporter the moment a rank appends to an events file, or the agent emits.

Polling a file every 200 ms puts 100 ms of latency on the average live point before any network
hop; a lower interval only trades it for CPU. The kernel already knows when a file is written:
inotify reports each `write` to a watched directory, so the reporter sleeps until one of its
files changes, or until `wake()` (the agent's own events, shutdown) writes to a pipe. The rank
needs no change: `EventLog` flushes every line, and each flush is a write.

Where inotify is missing (not Linux, or the per-user watch limit is spent), `wait` returns only
on `wake()` or its timeout, so the caller's timeout remains a correct, if slower, poll.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import struct
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger("fathom.report")

# From <sys/inotify.h>. A rank's flush is IN_MODIFY; a new events file (a rank's first line, or a
# file replaced by rename) is IN_CREATE or IN_MOVED_TO.
_IN_MODIFY = 0x002
_IN_MOVED_TO = 0x080
_IN_CREATE = 0x100
_IN_Q_OVERFLOW = 0x4000  # the kernel dropped notifications: assume a watched file changed
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_EVENT_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name


class FileWaker:
    """`wait(timeout)` returns early when one of `files` is written to, or when `wake()` is called."""

    def __init__(self, files: Iterable[Path]) -> None:
        self._names = {(str(p.parent.resolve()), p.name) for p in files}
        self._dirs: dict[int, str] = {}  # watch descriptor → directory
        self._pipe_r, self._pipe_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._inotify = self._watch()

    @property
    def notified(self) -> bool:
        """Whether file writes wake `wait` (False: only `wake()` and the timeout do)."""
        return self._inotify is not None

    def wake(self) -> None:
        """Makes the current or next `wait` return at once; safe from any thread."""
        try:
            os.write(self._pipe_w, b"!")
        except BlockingIOError:  # the pipe is full of wake-ups already: one is enough
            pass

    def wait(self, timeout: float) -> bool:
        """Sleeps until a watched file is written, `wake()`, or `timeout` seconds; True if woken."""
        fds = [self._pipe_r] if self._inotify is None else [self._pipe_r, self._inotify]
        ready, _, _ = select.select(fds, [], [], max(0.0, timeout))
        woken = False
        if self._pipe_r in ready:
            _drain(self._pipe_r)
            woken = True
        if self._inotify is not None and self._inotify in ready:
            woken = self._read_inotify() or woken
        return woken

    def close(self) -> None:
        for fd in (self._pipe_r, self._pipe_w, self._inotify):
            if fd is not None:
                os.close(fd)
        self._inotify = None

    def _watch(self) -> int | None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = int(libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC))
        except (OSError, AttributeError):  # no libc symbol: not Linux
            return None
        if fd < 0:
            logger.info("inotify unavailable (%s); the reporter polls", os.strerror(ctypes.get_errno()))
            return None
        # Directories, not files: a file that does not exist yet (rank 0 has not started) or is
        # replaced later is still seen.
        for directory in {d for d, _ in self._names}:
            os.makedirs(directory, exist_ok=True)
            wd = int(libc.inotify_add_watch(fd, directory.encode(), _IN_MODIFY | _IN_CREATE | _IN_MOVED_TO))
            if wd < 0:
                logger.info("inotify watch on %s failed (%s); the reporter polls", directory, os.strerror(ctypes.get_errno()))
                os.close(fd)
                return None
            self._dirs[wd] = directory
        return fd

    def _read_inotify(self) -> bool:
        """Drains the queued notifications; True if one concerned a watched file (the reporter's
        own spool lives in the same directory and must not wake it)."""
        assert self._inotify is not None
        relevant = False
        while True:
            try:
                buffer = os.read(self._inotify, 64 * 1024)
            except BlockingIOError:
                return relevant
            offset = 0
            while offset + _EVENT_HEADER.size <= len(buffer):
                wd, mask, _cookie, length = _EVENT_HEADER.unpack_from(buffer, offset)
                start = offset + _EVENT_HEADER.size
                name = buffer[start : start + length].rstrip(b"\0").decode(errors="replace")
                offset = start + length
                if mask & _IN_Q_OVERFLOW or (self._dirs.get(wd), name) in self._names:
                    relevant = True


def _drain(fd: int) -> None:
    while True:
        try:
            if not os.read(fd, 4096):
                return
        except BlockingIOError:
            return
