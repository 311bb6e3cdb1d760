"""The run folder contract: every path in a run's folder is named here, and nowhere else.

    RUN_DIR/
        spec.json                       the run's resolved spec, written once by the control plane
        cancel                          marker: the control plane asks the node agents to stop
        agent-node<K>.lock              held (flock) by node K's agent for as long as it lives
        shipped-logs.json               the control plane's: how much of each host's log file its copy holds
        events.jsonl                    rank 0's events when no agent started it (plain training.train)
        log.txt                         the ranks' output when a tool ran them without an agent
        logs/rank<R>.log                stdout and stderr of rank R, appended across restarts (on a
                                        host of its own, the control plane keeps a shipped copy)
        logs/agent-node<K>.log          node K's agent
        logs/standby-node<K>.log        node K's warm standbys, until they become ranks
        logs/rendezvous-store.log       the rendezvous store of a multi-node run
        logs/slurm-<job>.log            the batch script's output of Slurm job <job> (Slurm executor)
        slurm-job.sh, slurm-agent.sh    the run's Slurm batch script and what its srun starts per node
        node<K>/                        node K's agent's own files (the folder may be shared by hosts)
            log-probe                   a token of the agent's log shipper: whoever reads it shares the folder
            events.jsonl                rank 0's events, tailed by the agent's uplink
            spool.jsonl, acked          the uplink's spool and what the control plane acknowledged
            heartbeat/rank<R>.json      rank R's last beat
            errors/rank<R>.json         an error of rank R that no restart cures
        faults/<kind>-rank<R>-node<K>-step<S>.fired    `once` faults that fired
        data/                           the tokenized corpus (training.data.prepare_data's work dir)
            tokenizer/                  the tokenizer the ranks trained or were given
        peak_flops/                     rank 0's measured peak FLOPs, per host
        checkpoints/step_<NNNNNNNN>/    committed: renamed into place, then COMMITTED written
            COMMITTED, fathom.json, spec.json, rng/rank<RRRRR>.pt, tokenizer/, DCP shards
        checkpoints/step_<NNNNNNNN>.tmp/    being written (or torn by a crash): never counts
        exports/step_<NNNNNNNN>/        a checkpoint in Hugging Face format (config.json last)
        exports/step_<NNNNNNNN>.tmp/    an export being written

    <storage URL>/runs/<run folder name>/checkpoints/step_<NNNNNNNN>/
                                    the checkpoints, when the run's `data.storage` names object
                                    storage (`training.checkpoint_storage`): the same files, written
                                    in place (object storage has no rename), COMMITTED last
    <storage URL>/runs/<run folder name>/exports/step_<NNNNNNNN>/
                                    the export of a checkpoint on object storage
                                    (`serving.export_store`): its files, fathom-export.json last

    /dev/shm/fathom-<hash of RUN_DIR>/  (or $FATHOM_SNAPSHOT_ROOT) each rank's in-memory snapshots
        rank<R>-slot<S>.bin             on this host (training.memory_snapshot), for as long as the agent lives
        rank<R>-slot<S>-step<N>.meta    what a slot holds, once it is whole

Plain file-system logic with no torch, so the node agent, the control plane and the tools all
read it; `training.checkpoint` writes checkpoints under the same names.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePath

# Where in-memory snapshots live: a tmpfs (shared memory) that outlives a rank's process.
SNAPSHOT_ROOT = "FATHOM_SNAPSHOT_ROOT"

# The files of a run's `logs/` that a host ships to the control plane (`training.agent.log_shipper`).
LOG_NAME = re.compile(r"(rank\d{1,6}|agent-node\d{1,4}|standby-node\d{1,4}|rendezvous-store)\.log")

_STEP_PREFIX = "step_"
_STAGING_SUFFIX = ".tmp"


def _step_folder(step: int) -> str:
    return f"{_STEP_PREFIX}{step:08d}"


# The names inside a checkpoint, for a local folder (`CheckpointDir`) and on object storage alike.
COMMITTED_MARKER = "COMMITTED"
CHECKPOINT_METADATA = "fathom.json"
CHECKPOINT_SPEC = "spec.json"
CHECKPOINT_TOKENIZER = "tokenizer"
CHECKPOINT_RNG = "rng"


def checkpoint_name(step: int) -> str:
    """The folder (or object prefix) name of the checkpoint of `step`."""
    return _step_folder(step)


def rng_name(rank: int) -> str:
    """Rank `rank`'s RNG states, relative to its checkpoint."""
    return f"{CHECKPOINT_RNG}/rank{rank:05d}.pt"


def storage_checkpoints_url(storage: str, run_folder_name: str) -> str:
    """Where a run keeps its checkpoints on storage `storage` (a URL): the same layout under the
    storage root as under FATHOM_DATA_DIR, so the default `file://$FATHOM_DATA_DIR` names the run
    folder's own checkpoints folder."""
    return "/".join([storage.rstrip("/"), "runs", run_folder_name, "checkpoints"])


def storage_export_url(storage: str, run_folder_name: str, step: int) -> str:
    """Where the export of a run's checkpoint of `step` is kept on object storage
    (`serving.export_store`: the Hugging Face files, its manifest last)."""
    return "/".join([storage.rstrip("/"), "runs", run_folder_name, "exports", _step_folder(step)])


def step_of(path: PurePath) -> int | None:
    """The step a checkpoint's (or an export's) folder name says, or None for any other name."""
    name = path.name
    if not name.startswith(_STEP_PREFIX) or not name[len(_STEP_PREFIX) :].isdigit():
        return None
    return int(name[len(_STEP_PREFIX) :])


@dataclass(frozen=True)
class CheckpointDir:
    """One checkpoint folder: everything a checkpoint holds, so it stands alone (export reads it)."""

    path: Path

    @property
    def committed_marker(self) -> Path:
        """Written (and fsync'd) last: a folder without it never counts."""
        return self.path / COMMITTED_MARKER

    @property
    def is_committed(self) -> bool:
        return self.committed_marker.is_file()

    @property
    def metadata_file(self) -> Path:
        """Step, sampler position and the layout it was written with (`training.checkpoint`)."""
        return self.path / CHECKPOINT_METADATA

    @property
    def spec_file(self) -> Path:
        return self.path / CHECKPOINT_SPEC

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / CHECKPOINT_TOKENIZER

    def rng_file(self, rank: int) -> Path:
        return self.path / rng_name(rank)

    @property
    def rng_dir(self) -> Path:
        return self.path / CHECKPOINT_RNG


@dataclass(frozen=True)
class NodeDir:
    """The files of one node's agent and its ranks."""

    path: Path

    @property
    def events_file(self) -> Path:
        """Where rank 0 appends its JSON-lines events; the agent's uplink tails it."""
        return self.path / "events.jsonl"

    @property
    def spool_file(self) -> Path:
        """Every event of this node, numbered, fsync'd before it is sent (`training.agent.uplink`)."""
        return self.path / "spool.jsonl"

    @property
    def acked_file(self) -> Path:
        """The highest seq the control plane acknowledged."""
        return self.path / "acked"

    @property
    def log_probe_file(self) -> Path:
        """The log shipper's token: a control plane that reads it here shares this folder."""
        return self.path / "log-probe"

    @property
    def heartbeat_dir(self) -> Path:
        return self.path / "heartbeat"

    def heartbeat_file(self, rank: int) -> Path:
        return self.heartbeat_dir / f"rank{rank}.json"

    def error_file(self, rank: int) -> Path:
        return self.path / "errors" / f"rank{rank}.json"


@dataclass(frozen=True)
class RunDir:
    """A run's folder. `RunDir(path)` names; it creates nothing until a caller writes."""

    path: Path

    # --- what the control plane writes ------------------------------------------------------

    @property
    def spec_file(self) -> Path:
        return self.path / "spec.json"

    @property
    def memory_snapshot_dir(self) -> Path:
        """Where this host's ranks keep their in-memory snapshots (`training.memory_snapshot`): shared
        memory, outside the run folder, named after it. It outlives a rank, not the host; the node
        agent removes it when it exits."""
        digest = hashlib.sha256(str(self.path.resolve()).encode()).hexdigest()[:16]
        return Path(os.environ.get(SNAPSHOT_ROOT, "/dev/shm")) / f"fathom-{digest}"

    def memory_snapshot_data(self, rank: int, slot: int) -> Path:
        return self.memory_snapshot_dir / f"rank{rank}-slot{slot}.bin"

    def memory_snapshot_meta(self, rank: int, slot: int, step: int) -> Path:
        """What a slot holds; its name says the step, so the agent can tell progress without reading it."""
        return self.memory_snapshot_dir / f"rank{rank}-slot{slot}-step{step:08d}.meta"

    def memory_snapshot_metas(self, rank: int, slot: int | None = None) -> dict[Path, int]:
        """Rank `rank`'s whole snapshots on this host (of one slot, or all): meta file → step."""
        pattern = f"rank{rank}-slot{'*' if slot is None else slot}-step*.meta"
        return {p: int(p.stem.rsplit("-step", 1)[1]) for p in self.memory_snapshot_dir.glob(pattern)}

    @property
    def cancel_marker(self) -> Path:
        """Touched by the control plane to cancel; the agents poll it, a resume removes it."""
        return self.path / "cancel"

    @property
    def stop_request(self) -> Path:
        """Written by a scheduler's job (the Slurm batch script, on the signal that its time
        limit is near) to ask the ranks to checkpoint at their next step and stop; its text says
        why. The job's next start removes it."""
        return self.path / "stop-request"

    def agent_lock(self, node: int) -> Path:
        """Node `node`'s agent runs under `flock -n` on this file: held means the agent lives."""
        return self.path / f"agent-node{node}.lock"

    def agent_locks(self) -> list[Path]:
        """The lock files of every node agent ever started for the run on this file system."""
        return sorted(self.path.glob("agent-node*.lock"))

    # --- logs -----------------------------------------------------------------------------

    @property
    def logs_dir(self) -> Path:
        return self.path / "logs"

    def rank_log(self, rank: int) -> Path:
        return self.logs_dir / f"rank{rank}.log"

    def agent_log(self, node: int) -> Path:
        return self.logs_dir / f"agent-node{node}.log"

    def standby_log(self, node: int) -> Path:
        return self.logs_dir / f"standby-node{node}.log"

    @property
    def rendezvous_store_log(self) -> Path:
        return self.logs_dir / "rendezvous-store.log"

    def rendezvous_store_lock(self, launch: int) -> Path:
        """Held by a launch's rendezvous store on the control plane (`run_agents.start_store_here`):
        one a launch, as a resumed run's new store may start while the last one's still idles."""
        return self.path / f"rendezvous-store-L{launch}.lock"

    @property
    def shipped_logs_file(self) -> Path:
        """The control plane's: how many bytes of each host's log file its copy holds."""
        return self.path / "shipped-logs.json"

    def slurm_log(self, job: str) -> Path:
        """The output of the run's Slurm job `job` (sbatch's `%j` names every job's own)."""
        return self.logs_dir / f"slurm-{job}.log"

    @property
    def slurm_job_script(self) -> Path:
        """The batch script the control plane submits with sbatch (the Slurm executor)."""
        return self.path / "slurm-job.sh"

    @property
    def slurm_agent_script(self) -> Path:
        """What the job's srun runs on each node: that node's agent, under its lock."""
        return self.path / "slurm-agent.sh"

    @property
    def standalone_log(self) -> Path:
        """Output of ranks a tool started without an agent (`tools.check_parity`)."""
        return self.path / "log.txt"

    # --- the node agents' and the ranks' files ---------------------------------------------

    def node(self, node: int) -> NodeDir:
        return NodeDir(self.path / f"node{node}")

    @property
    def events_file(self) -> Path:
        """Rank 0's events when no agent gave it a node's events file."""
        return self.path / "events.jsonl"

    @property
    def faults_dir(self) -> Path:
        """Markers of `once` faults that fired, shared by every node that sees the run folder."""
        return self.path / "faults"

    def fault_marker(self, kind: str, *, rank: int, node: int, step: int) -> Path:
        # Named by the fault's content, not its position in the spec, so a spec resized for a
        # smaller world keeps its markers.
        return self.faults_dir / f"{kind}-rank{rank}-node{node}-step{step}.fired"

    @property
    def data_dir(self) -> Path:
        """The ranks' data cache: `training.data.prepare_data` works in it."""
        return self.path / "data"

    @property
    def tokenizer_dir(self) -> Path:
        """The tokenizer the ranks trained or were given; another run may reuse it."""
        return self.data_dir / "tokenizer"

    @property
    def peak_flops_dir(self) -> Path:
        return self.path / "peak_flops"

    # --- checkpoints ------------------------------------------------------------------------

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        """The committed checkpoint of `step`; `CheckpointDir(path)` names what it holds."""
        return self.checkpoints_dir / _step_folder(step)

    def checkpoint_staging(self, step: int) -> Path:
        """Where the checkpoint of `step` is written before the rename that commits it."""
        return self.checkpoints_dir / (_step_folder(step) + _STAGING_SUFFIX)

    def committed_checkpoints(self) -> list[Path]:
        """Committed checkpoints, oldest first."""
        root = self.checkpoints_dir
        if not root.is_dir():
            return []
        found = [
            (step, p) for p in root.iterdir() if (step := step_of(p)) is not None and CheckpointDir(p).is_committed
        ]
        return [p for _, p in sorted(found)]

    def latest_checkpoint(self) -> Path | None:
        committed = self.committed_checkpoints()
        return committed[-1] if committed else None

    def latest_committed_step(self) -> int:
        """The step of the newest committed checkpoint, 0 when there is none."""
        latest = self.latest_checkpoint()
        return 0 if latest is None else int(step_of(latest) or 0)

    # --- exports ---------------------------------------------------------------------------

    @property
    def exports_dir(self) -> Path:
        return self.path / "exports"

    def export(self, step: int) -> Path:
        return self.exports_dir / _step_folder(step)

    def export_staging(self, step: int) -> Path:
        """Where an export is written before the rename that makes it whole."""
        return self.exports_dir / (_step_folder(step) + _STAGING_SUFFIX)
