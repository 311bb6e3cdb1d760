"""The embedded default's Celery broker: kombu's filesystem transport, with atomic writes.

kombu writes a message file in place while a worker may already be moving it away to read it;
a worker that reads it half written dies with a JSON error (seen with beat sending every
second). Writing under a name no queue matches and renaming into place closes that window.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        # Readers take files whose name after the first dot is "<queue>.msg"; this one's is not.
        staging = os.path.join(self.data_folder_out, f".{name}.tmp")
        with open(staging, "wb") as f:
            f.write(str_to_bytes(dumps(payload)))
        os.replace(staging, os.path.join(self.data_folder_out, name))


class Transport(filesystem.Transport):
    Channel = Channel
