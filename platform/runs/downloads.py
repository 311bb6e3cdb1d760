"""Downloading a run's logs and a checkpoint's Hugging Face export as tar archives, streamed.

The archive is written as it is sent (`tar_stream`): headers are made from each file's size when
its turn comes, its bytes follow in chunks, so neither the server's memory nor the time to the
first byte grows with the export (a 7B export is ~14 GB).
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import Path

from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.exceptions import NotFound
from rest_framework.generics import get_object_or_404
from rest_framework.request import Request
from rest_framework.views import APIView

from controlplane.api import Conflict
from runs.models import Checkpoint, Run

# Bytes read from a file per chunk sent: large enough to keep syscalls few, small enough that a
# few hundred concurrent downloads stay in tens of MB.
CHUNK_BYTES = 256 * 1024
BLOCK = tarfile.BLOCKSIZE


def tar_stream(folder: Path, root: str) -> Iterator[bytes]:
    """A tar (POSIX pax) of `folder`'s files under `root/`, yielded a chunk at a time.

    A file still being written (a live run's log) is sent as long as it was when its header was
    made: it is cut there, or padded with zeros if it shrank meanwhile, so the archive stays valid.
    """
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()):
        try:
            stat = path.stat()
        except FileNotFoundError:  # deleted since the listing (a pruned checkpoint's file)
            continue
        info = tarfile.TarInfo(f"{root}/{path.relative_to(folder).as_posix()}")
        info.size, info.mtime, info.mode = stat.st_size, int(stat.st_mtime), 0o644
        yield info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
        left = info.size
        with path.open("rb") as f:
            while left > 0:
                chunk = f.read(min(CHUNK_BYTES, left))
                if not chunk:
                    break
                left -= len(chunk)
                yield chunk
        yield b"\0" * (left + (-info.size % BLOCK))
    yield b"\0" * (2 * BLOCK)  # end of archive


def tar_response(folder: Path, root: str) -> StreamingHttpResponse:
    response = StreamingHttpResponse(tar_stream(folder, root), content_type="application/x-tar")
    response["Content-Disposition"] = f'attachment; filename="{root}.tar"'
    return response


class RunLogsDownload(APIView):
    """`GET /api/runs/<id>/logs.tar`: the run folder's `logs/` (every rank's and agent's log)."""

    @extend_schema(responses={(200, "application/x-tar"): OpenApiTypes.BINARY})
    def get(self, request: Request, run_id: int) -> StreamingHttpResponse:
        run = get_object_or_404(Run.objects.filter(owner_id=request.user.pk), pk=run_id)
        logs_dir = run.run_dir.logs_dir
        if not logs_dir.is_dir():
            raise NotFound("this run has written no logs yet")
        return tar_response(logs_dir, f"run-{run.pk}-logs")


class CheckpointExportDownload(APIView):
    """`GET /api/runs/<id>/checkpoints/<checkpoint_id>/export.tar`: the checkpoint's Hugging Face
    export folder (config, tokenizer, safetensors). 409 when it has no export here."""

    @extend_schema(
        responses={
            (200, "application/x-tar"): OpenApiTypes.BINARY,
            409: OpenApiResponse(OpenApiTypes.OBJECT, description="No export to send; `export_path` says why."),
        }
    )
    def get(self, request: Request, run_id: int, checkpoint_id: int) -> StreamingHttpResponse:
        # run__pk, not run_id: Django answers an id past SQLite's 64-bit integers as no row for a
        # primary key, but binds a foreign key column's value as it is (OverflowError, a 500).
        checkpoint = get_object_or_404(
            Checkpoint.objects.filter(run__owner_id=request.user.pk, run__pk=run_id), pk=checkpoint_id
        )
        export = checkpoint.export_path
        if not export:
            raise Conflict("export_path", f"step {checkpoint.step} has not been exported to Hugging Face format")
        if "://" in export:
            # Exports on object storage are served from there, not through the control plane.
            raise Conflict("export_path", f"step {checkpoint.step}'s export is on object storage, at {export}")
        if not Path(export).is_dir():
            raise Conflict("export_path", f"step {checkpoint.step}'s export folder is gone ({export})")
        return tar_response(Path(export), f"run-{checkpoint.run_id}-step-{checkpoint.step}-export")
