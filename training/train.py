"""Rank entry point: `torchrun … -m training.train --spec SPEC_FILE --run-dir DIR`.

Each rank computes on its GPU (`LOCAL_RANK`, NCCL) when torch sees one, else on the CPU with gloo
(training/device.py). Also runs as a single process without torchrun (world size 1). On every start
it resumes from the newest committed checkpoint in DIR, so torchrun's restarts after a crash need
nothing else.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import threading
import traceback
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import NoReturn

import numpy as np
import torch.distributed as dist
from tokenizers import Tokenizer

from training.collectives import init_default_group
from training.config import RunSpec, SpecError
from training.data import PreparedData, prepare_data
from training.device import activate, device_from_environment, make_deterministic
from training.hooks import build_hooks
from training.pretrained import resolve as resolve_pretrained
from training.rank_environment import (
    EVENTS_FILE,
    NON_RETRYABLE_EXIT,
    SAVED_AND_STOPPED_EXIT,
    NonRetryable,
    RankEnvironment,
    RankError,
)
from training.rank_events import EventLog
from training.run_dir import RunDir
from training.storage import StorageError
from training.trainer import Trainer

# Gloo's default is 30 minutes: a rank stuck in a collective would hold the whole job that long
# with no error. Two minutes bounds that while leaving room for the slowest legitimate wait on a
# loaded CPU host (a checkpoint written by every rank, the first pipeline step's shape exchange).
# The node agent's heartbeat watchdog catches hangs sooner; this is the backstop inside the ranks.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


# What reading a corpus raises when the file itself is wrong: missing, unreadable, not a
# .txt/.jsonl, not UTF-8, a JSON line without text (ValueError covers the decode errors).
# Other OSErrors (a full disk, a network file system that hiccups) may pass on a restart.
# A dataset object storage refuses or that does not match its checksum (StorageError names the
# object and why) fails the run at once: botocore has already retried what was transient.
_DATA_ERRORS = (ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, StorageError)


def check_tokenizer(spec: RunSpec) -> None:
    """Loads the spec's tokenizer, if it names one, as `prepare_data` will: a file that does not
    load, or has more tokens than the model's vocabulary, fails the same way on every attempt."""
    if not spec.data.tokenizer:
        return
    given = Path(spec.data.tokenizer)
    path = given if given.is_file() else given / "tokenizer.json"
    try:
        size = Tokenizer.from_file(str(path)).get_vocab_size()
    except Exception as exc:  # tokenizers raises a bare Exception for unreadable or invalid files
        raise NonRetryable("tokenizer", f"data.tokenizer {spec.data.tokenizer}: cannot be loaded: {exc}") from exc
    if size > spec.model.vocab_size:
        raise NonRetryable(
            "tokenizer",
            f"data.tokenizer {spec.data.tokenizer}: has {size} tokens, more than model.vocab_size={spec.model.vocab_size}",
        )


def prepare_checked(spec: RunSpec, run_dir: Path) -> PreparedData:
    """`prepare_data`, with the errors of a bad corpus reported as non-retryable."""
    check_tokenizer(spec)
    name = spec.data.dataset or "the demo corpus"
    try:
        rank_env = RankEnvironment.from_environ()
        download_cache = rank_env.download_cache if rank_env is not None else None
        data = prepare_data(spec.data, spec.model.vocab_size, spec.model.seq_len, RunDir(run_dir).data_dir, download_cache)
    except _DATA_ERRORS as exc:
        raise NonRetryable("data", f"data.dataset {name}: {exc}") from exc
    tokens = data.tokens_path.stat().st_size // np.dtype(data.dtype).itemsize
    if tokens < spec.model.seq_len + 1:
        raise NonRetryable(
            "data",
            f"data.dataset {name}: holds {tokens} tokens, fewer than one sequence of model.seq_len + 1 = "
            f"{spec.model.seq_len + 1}",
        )
    if spec.data.validation_fraction > 0:
        try:
            data.windows(spec.model.seq_len).split(spec.data.validation_fraction)
        except ValueError as exc:
            raise NonRetryable("data", f"data.validation_fraction: {exc}") from exc
    return data


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m training.train", description=__doc__)
    parser.add_argument("--spec", type=Path, required=True, help="RunSpec JSON")
    parser.add_argument("--run-dir", type=Path, required=True, help="checkpoints, events, data cache")
    return parser.parse_args(argv)


def run(spec: RunSpec, run_dir: Path) -> int:
    """Trains this rank; returns its exit status: 0, or SAVED_AND_STOPPED_EXIT when a stop
    request ended the run's job early (`Trainer.fit`)."""
    # torchrun's contract: RANK and WORLD_SIZE name this process; absent, it is a single process.
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != spec.layout.world_size and "GROUP_WORLD_SIZE" in os.environ:
        # The rendezvous formed a smaller world than planned (a node was lost and nodes.min
        # allows going on): every rank derives the same spec for it, with fewer dp replicas.
        try:
            spec = spec.resized(
                world_size=world_size,
                nodes=int(os.environ["GROUP_WORLD_SIZE"]),
                nproc=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
            )
        except SpecError as exc:
            raise NonRetryable("spec", str(exc)) from exc
    if world_size != spec.layout.world_size:
        raise NonRetryable(
            "spec", f"layout: dp·tp·pp = {spec.layout.world_size} ranks needed; torchrun started {world_size}"
        )
    # Before the process group: tokenizing a large corpus may take longer than any collective timeout.
    data = prepare_checked(spec, run_dir)
    device = device_from_environment()  # GPU LOCAL_RANK when there is one, else the CPU
    if spec.train.deterministic:
        make_deterministic()
    activate(device)
    if world_size > 1:
        init_default_group(device, COLLECTIVE_TIMEOUT)
    events = None
    if rank == 0:
        events = EventLog(Path(os.environ.get(EVENTS_FILE, RunDir(run_dir).events_file)))
    trainer = Trainer(
        spec=spec,
        run_dir=run_dir,
        data=data,
        rank=rank,
        world_size=world_size,
        hooks=build_hooks(spec, rank, world_size),
        events=events,
        device=device,
    )
    stop_after_saving(trainer)
    trainer.fit()
    if events is not None:
        events.close()
    return 0 if trainer.stopped_at is None else SAVED_AND_STOPPED_EXIT


def shutdown(exit_code: int) -> None:
    """Leaves without the interpreter's teardown: gloo's threads freeing tensors during it abort the
    process now and then ("terminate called without an active exception"), which torchrun would
    report as a failed job. The barrier makes sure no rank leaves while another still needs it
    (after a stop, while rank 0 may still be committing the checkpoint)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        if exit_code in (0, SAVED_AND_STOPPED_EXIT):
            dist.barrier()
        dist.destroy_process_group()
    os._exit(exit_code)


# Set by SIGTERM (the agent cancelling the run); the stop thread then ends the process.
_stopping = threading.Event()


def stop_after_saving(trainer: Trainer) -> None:
    """On SIGTERM the rank leaves once the checkpoint it is writing is committed, instead of
    tearing it: a cancelled run keeps the newest checkpoint it began.

    The wait runs on its own thread while training goes on, so the collectives of a save under way
    keep meeting their peers, which the same signal reaches. A peer that leaves first breaks the
    training thread's next collective; `main` then parks that thread instead of exiting. The
    agent's cancel grace bounds the wait: what still runs then gets SIGKILL. (Restarts stop ranks
    with SIGKILL and never wait.)"""

    def finish_then_exit() -> None:
        trainer.checkpointer.finish_writing()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signal.SIGTERM)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if not _stopping.is_set():
            _stopping.set()
            threading.Thread(target=finish_then_exit, name="fathom-stop", daemon=True).start()

    signal.signal(signal.SIGTERM, on_sigterm)


def fail_for_good(error: NonRetryable) -> NoReturn:
    """Reports `error` to the agent (when there is one) and exits with NON_RETRYABLE_EXIT."""
    print(f"fathom: {error.error_class} error, not retryable: {error}", file=sys.stderr)
    sys.stderr.flush()
    env = RankEnvironment.from_environ()
    if env is not None and env.error_file is not None:
        RankError(error_class=error.error_class, message=str(error)).write(env.error_file)
    os._exit(NON_RETRYABLE_EXIT)  # like any failed rank: no teardown waiting on peers


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # A crash in native code (torch, gloo, a storage client's thread) prints every thread's stack
    # into the rank's log before the rank dies of it; the agent only sees the signal.
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` prints a stuck rank's stacks
    try:
        # A run from a pretrained folder takes its model and tokenizer from there (idempotent).
        spec = resolve_pretrained(RunSpec.from_json(args.spec.read_text()))
    except (OSError, ValueError) as exc:  # SpecError is a ValueError
        fail_for_good(NonRetryable("spec", f"{args.spec}: {exc}"))
    args.run_dir.mkdir(parents=True, exist_ok=True)
    try:
        exit_code = run(spec, args.run_dir)
    except NonRetryable as exc:
        fail_for_good(exc)
    except BaseException as exc:
        if _stopping.is_set():  # a peer stopped first; the stop thread exits once the save is committed
            print(f"fathom: stopping ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
            threading.Event().wait()
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # a failed rank must not wait on peers in teardown; torchrun restarts the job
    shutdown(exit_code)


if __name__ == "__main__":
    main()
