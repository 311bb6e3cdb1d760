"""`/ws/runs/<id>/`: a run's events (history after the client's last seq, then live), and new
lines of rank 0's log."""

from __future__ import annotations

import asyncio
from typing import Any

from controlplane.streams import EventStreamConsumer
from runs import access, services
from runs.models import Run

# How often rank 0's log file is checked for new lines to stream.
LOG_POLL_SECONDS = 1.0


class RunConsumer(EventStreamConsumer):
    url_kwarg = "run_id"
    model = Run

    def load_owned(self, user: Any, object_id: int) -> Run | None:
        """The run, if the user owns it or is a member of its project (runs.access)."""
        return access.visible_runs(user).filter(pk=object_id).first()

    def group_for(self, object_id: int) -> str:
        return services.run_group(object_id)

    async def on_started(self) -> None:
        self.tasks.append(asyncio.create_task(self._stream_log()))

    async def _stream_log(self) -> None:
        """New lines of rank 0's log, from where the file ended at connect (the API serves the rest)."""
        path = self.subject.run_dir.rank_log(0)
        offset = path.stat().st_size if path.exists() else 0
        while True:
            await asyncio.sleep(LOG_POLL_SECONDS)
            size = path.stat().st_size if path.exists() else 0
            if size < offset:
                offset = 0  # the file was replaced
            if size <= offset:
                continue
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read(256 * 1024)
            complete = chunk[: chunk.rfind(b"\n") + 1]  # only whole lines; the rest comes next time
            if complete:
                offset += len(complete)
                lines = complete.decode(errors="replace").splitlines()
                await self.send_json({"type": "logs", "rank": 0, "lines": lines})
