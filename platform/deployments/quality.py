"""What a quantized export cost in quality: its top-1 next-token agreement with the float export
and both exports' perplexity over the run's fixed prompt set of held-out text
(`serving.quality`), measured on real replicas of both.

Each export is served in turn on one replica of its own (a detached supervisor in a folder
under the run's, as a deployment's), asked for `prompt_logprobs` over the prompts, and stopped
before the other starts, so the measurement holds one replica's memory and cores at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from django.conf import settings

from controlplane.processes import is_alive
from deployments.options import device
from runs import quantized
from runs.models import QuantizedExport
from serving.deployment_config import DeploymentConfig
from serving.quality import Agreement, Scores, held_out_prompts, score_prompts, top1_agreement
from serving.state import DeploymentDir, read_events, read_state
from serving.supervisor import launch_detached, request_stop
from serving.vllm import CheckpointInfo, ReplicaOptions, replica_dtype

# vLLM on CPU loads a small model in well under a minute; a replica not ready in this long is
# broken (its supervisor has already given up on it by then: its own ready timeout is shorter).
READY_TIMEOUT_SECONDS = 900
# A stop drains in-flight requests first; the measurement's are done by then, so this is ample.
STOP_TIMEOUT_SECONDS = 120
# The context the measuring replicas serve: prompts are cut to it, and a small KV cache fits it.
MAX_MODEL_LEN = 256


class QualityFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class Quality:
    agreement: Agreement
    perplexity: float  # the quantized export's, over the prompts' own tokens
    source_perplexity: float  # the float export's, over the same tokens


def measure(row: QuantizedExport) -> Quality:
    """Serves the float export, then the quantized one, and compares their scores."""
    checkpoint = row.checkpoint
    prompts = held_out_prompts(quantized.calibration_dataset(checkpoint))
    context = min(MAX_MODEL_LEN, CheckpointInfo.read(checkpoint.export_path).max_position_embeddings)
    base = {
        "device": settings.SERVING_DEVICE, "max_model_len": context, "max_num_seqs": 4, "enforce_eager": True,
        "dtype": "float32",
    }  # fmt: skip
    # The quantized export in the dtype a deployment of it serves in here (int4's CPU kernel and
    # int8's AMX one compute in bfloat16), against the float export as trained.
    quantized_options = ReplicaOptions.from_dict({**base, "dtype": "auto", "quantization": quantized.served_as(row.scheme)})
    quantized_options = dataclasses.replace(quantized_options, dtype=replica_dtype(quantized_options, device()))
    work = Path(row.path).with_name(Path(row.path).name + ".quality")
    reference = _scores(
        checkpoint.export_path, ReplicaOptions.from_dict(base), work / "float", prompts, context
    )
    measured = _scores(row.path, quantized_options, work / row.scheme, prompts, context)
    return Quality(
        agreement=top1_agreement(reference.choices, measured.choices),
        perplexity=measured.perplexity,
        source_perplexity=reference.perplexity,
    )


def _scores(export: str, options: ReplicaOptions, state_dir: Path, prompts: list[str], context: int) -> Scores:
    with _replica(export, options, state_dir) as url:

        async def ask() -> Scores:
            async with httpx.AsyncClient(timeout=120) as client:
                # The prompt's last context - 1 tokens: room for the one generated token.
                return await score_prompts(client, url, "measured", prompts, max_prompt_tokens=context - 1)

        try:
            return asyncio.run(ask())
        except httpx.HTTPError as exc:
            raise QualityFailed(f"the replica of {export} did not answer the prompts: {exc}") from None


@contextlib.contextmanager
def _replica(export: str, options: ReplicaOptions, state_dir: Path) -> Iterator[str]:
    """One replica of `export` under a supervisor of its own; yields its URL; stops it after."""
    config = DeploymentConfig(
        name="measured", export=export, state_dir=str(state_dir), python=settings.VLLM_PYTHON,
        replicas=1, options=options,
        # vLLM's "auto" binding pins a CPU replica to the first core, as a deployment's first
        # replica is: the measuring replica takes the last one instead.
        cpu_binds=(str((os.cpu_count() or 1) - 1),) if options.device == "cpu" and options.cpu_threads_bind == "auto" else (),
        # However this task ends (a worker killed mid-measurement too), its replica goes with it.
        owner_pid=os.getpid(),
    )  # fmt: skip
    pid = launch_detached(config)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while True:
            state = read_state(state_dir)
            ready = [r.url for r in state.replicas if r.phase == "ready" and r.url] if state else []
            if ready:
                yield ready[0]
                return
            failed = [e.message for e in read_events(state_dir)[0] if e.kind == "replica_failed"]
            if failed:
                raise QualityFailed(f"the replica of {export} could not start: {failed[-1]}")
            if not is_alive(pid) or time.monotonic() > deadline:
                log = DeploymentDir(state_dir).supervisor_log
                said = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise QualityFailed(f"no replica of {export} became ready; its supervisor said: {said}")
            time.sleep(1)
    finally:
        request_stop(state_dir)
        deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
        while is_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if is_alive(pid):  # a supervisor that would not stop: its session (replicas too) goes
            os.killpg(pid, signal.SIGKILL)
