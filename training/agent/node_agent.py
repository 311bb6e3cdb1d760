"""The node agent: one per host, runs that host's ranks and keeps the run alive.

    python -m training.agent --spec SPEC_FILE --run-dir DIR --node-rank K \\
        [--rdzv-endpoint HOST:PORT] [--events-url URL --run-token T] [--logs-url URL]

It is torch's elastic agent (`SimpleElasticAgent`: c10d rendezvous, rank assignment, restart
budget, scale-up when a node waits to join, exit barrier) with Fathom's own parts where torch's
`LocalElasticAgent` falls short:

* ranks are started so they die with the agent and log to their rank log (`training.run_dir`)
  (`training.agent.rank_processes`), and are watched for hangs as well as exits (`training.agent.watchdog`);
* the restart budget (`nodes.max_restarts`) counts failures in a row without progress: an attempt
  that left a newer checkpoint or in-memory snapshot than it could resume from gives the budget
  back, so a long run that fails now and then is not ended by it, while a crash loop still is;
* restarts after a failure that made no progress back off exponentially;
* a rank that reports an error no restart can cure (bad data, a spec it refuses, a broken
  tokenizer: `training.rank_environment.RankError`) fails the run at once with that reason;
* every lifecycle event, and rank 0's events, go through the spooling reporter
  (`training.agent.uplink`) to the control plane; with `--logs-url` (a host whose run folder
  the control plane cannot read) the logs of this host's run folder follow them
  (`training.agent.log_shipper`);
* when the rendezvous ends with fewer nodes than `nodes.max` (a node was lost and `nodes.min`
  allows going on), the ranks fit the spec's `layout.dp` to the new world size themselves
  (`RunSpec.resized`); the agent reads only the spec's `nodes` and its world size (`NodePlan`);
* SIGTERM (or the run folder's cancel marker) cancels: ranks get SIGTERM, the newest committed
  checkpoint stays. Under a scheduler that ends jobs itself (`--sigterm stop`: Slurm's scancel,
  requeue, preemption, time limit), only the marker cancels: SIGTERM without it stops the node
  the same way but reports `stopped`, not `cancelled`, since the job may come back. There the
  scheduler may also ask, ahead of its time limit, for a checkpoint first (`RunDir.stop_request`,
  which the ranks look for at every step's end): the ranks save the step they agree on, exit
  with SAVED_AND_STOPPED_EXIT once it is committed, and the agent reports `stopped` with it.
  Fathom's own scheduler asks the same of a run it preempts (`--stop-requests`, on hosts).

The exit status says the outcome (`ExitCode`).
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from torch.distributed import Store
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    SimpleElasticAgent,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.rendezvous import RendezvousError

from hostworker.started_environment import StartedEnvironment
from training.agent.rank_processes import (
    RankProcess,
    RankSlot,
    Standby,
    activate_standby,
    spawn_rank,
    spawn_standby,
    stop_ranks,
    wait_for_exit,
)
from training.agent.uplink import Reporter
from training.agent.watchdog import RankFailure, Watchdog, WatchdogConfig
from training.checkpoint_storage import latest_committed_step
from training.config import NodePlan
from training.heartbeat import STACK_DUMP_SIGNAL, read_beat
from training.ports import RANK_STORE_PORTS, listen_port
from training.rank_environment import RankEnvironment, RankError
from training.run_dir import NodeDir, RunDir

logger = logging.getLogger("fathom.agent")

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class ExitCode(enum.IntEnum):
    SUCCEEDED = 0
    FAILED = 1  # restarts exhausted, or the rendezvous could not be formed
    USAGE = 2  # bad arguments or an invalid spec
    CANCELLED = 3
    STOPPED = 4  # SIGTERM under `--sigterm stop`: the scheduler ended the job, the run goes on


@dataclass(kw_only=True, frozen=True)
class AgentConfig:
    run_dir: Path
    spec_file: Path  # the run's spec as the control plane wrote it; the ranks parse it
    node_rank: int  # this host's identity in events ("node-K"); ranks are assigned by the rendezvous
    rdzv_endpoint: str  # HOST:PORT of the c10d store every agent of the run meets at
    host_store: bool  # this agent runs that store (a single point of failure: keep it on node 0)
    local_addr: str | None  # address other nodes reach this one at; None: the host's FQDN
    run_id: str
    # What the host worker (or the control plane's worker) told this agent: its host's name,
    # the cores of its CPU slots, its machine's data folder.
    started: StartedEnvironment = field(default_factory=StartedEnvironment.from_environ)
    entrypoint: str = "training.train"  # the module every rank runs
    # Keep one process per local rank that has already imported the entry point, so a restart
    # skips the imports (most of a restart on CPU hosts); they are started once the ranks have
    # finished a step, not while they start up, so they never slow a recovery down.
    warm_standby: bool = True
    # How often ranks are checked: bounds how late a hang is noticed past its timeout. Exits wake
    # the agent at once (pidfd); where pidfds are missing this bounds exit detection too.
    monitor_interval: float = 0.25
    heartbeat_interval: float = 0.25  # how often ranks beat; 40× finer than the default timeout
    # Looking for nodes waiting to join costs a store round trip; once a second is plenty.
    membership_check_interval: float = 1.0
    # A failure that made no progress (crash loop) waits 1, 2, 4 … 30 s before the next try;
    # one after progress restarts at once, because the time lost is what the target counts.
    restart_backoff_initial: float = 1.0
    restart_backoff_max: float = 30.0
    stack_dump_grace: float = 0.5  # time a hung rank gets to print its stacks before SIGKILL
    # After a rank fails, the others' collectives break within milliseconds; each copies the state
    # it holds into shared memory and exits (`Trainer._snapshot_at_failure`, ~5 ms on `tiny`).
    # What has not exited by then is killed.
    survivor_grace: float = 1.0
    cancel_grace: float = 30.0  # time ranks get to exit on SIGTERM when the run is cancelled
    # SIGTERM without the cancel marker means the scheduler is ending this job (Slurm), not that
    # the run is cancelled: report `stopped` so the control plane waits for the job to come back.
    sigterm_stops: bool = False
    # The ranks look for the run folder's stop request at every step's end (a rendezvous of the
    # step's loss all-reduce: nothing more): a scheduler's job ending, or a preemption, asks there.
    stop_requests: bool = False
    rdzv_join_timeout: float = 600.0  # a rendezvous that has not formed by then fails the run
    # Once `nodes.min` agents have joined, how long to wait for the rest before starting without
    # them; a late node then joins through a scale-up restart.
    rdzv_last_call_timeout: float = 10.0
    # Agents refresh their rendezvous entry every second; three missed refreshes (3 s) mark a node
    # dead so survivors can form a smaller rendezvous without it.
    rdzv_keep_alive_interval: int = 1
    rdzv_keep_alive_max_attempt: int = 3
    # After its ranks succeed, an agent waits this long for the other nodes' ranks to finish.
    exit_barrier_timeout: float = 120.0
    report_flush_timeout: float = 30.0  # at exit, how long to keep trying to deliver events

    @property
    def folder(self) -> RunDir:
        return RunDir(self.run_dir)

    @property
    def node_dir(self) -> NodeDir:
        """This node's own files in the (possibly shared) run folder."""
        return self.folder.node(self.node_rank)


class CancelRequested(BaseException):
    """Raised in the agent's main thread by SIGTERM/SIGINT; BaseException so no handler eats it."""


@dataclass(kw_only=True, frozen=True)
class Outcome:
    code: ExitCode
    kind: str  # the final event: succeeded, failed, cancelled, stopped
    data: dict[str, Any]


def interrupted(config: AgentConfig, step: int | None) -> Outcome:
    """The outcome of a CancelRequested (the cancel marker, or SIGTERM/SIGINT): `cancelled`,
    unless the agent was told SIGTERM means its job is being ended and no cancel was asked for."""
    if config.sigterm_stops and not config.folder.cancel_marker.exists():
        return Outcome(code=ExitCode.STOPPED, kind="stopped", data={"step": step, "reason": "SIGTERM: the scheduler ended the job"})
    return Outcome(code=ExitCode.CANCELLED, kind="cancelled", data={"step": step})


class NodeAgent(SimpleElasticAgent):
    def __init__(self, config: AgentConfig, plan: NodePlan, reporter: Reporter, worker_spec: WorkerSpec) -> None:
        super().__init__(worker_spec, exit_barrier_timeout=config.exit_barrier_timeout)
        self.config = config
        self.plan = plan
        self.reporter = reporter
        self._ranks: list[RankProcess] = []
        self._watchdog = Watchdog(WatchdogConfig(heartbeat_timeout=plan.nodes.heartbeat_timeout))
        self._nodes: int | None = None  # nodes in the last rendezvous
        self._attempt = 0
        self._from_step = 0  # the newest state the current ranks could resume from when they started
        self._failures_without_progress = 0
        self._restarts = 0
        # Restarts since the run last committed a checkpoint newer than the one its ranks resumed
        # from; `nodes.max_restarts` bounds this count, not the run's total.
        self._restarts_in_a_row = 0
        self._standbys: list[Standby] = []
        self._standbys_due = False  # replenish once the current ranks have finished a step
        # On a CPU host each local rank runs on its own slot's cores.
        self._slot_cores = list(self.config.started.slot_cores)

    # --- SimpleElasticAgent's abstract methods ------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        worker_group.master_port = _agreed_master_port(worker_group)  # type: ignore[assignment]  # torch: None until set
        self._attempt = _rendezvous_round(worker_group.spec, fallback=self._restarts)
        nodes = int(worker_group.group_world_size or 0)
        if self._nodes is not None and nodes < self._nodes:
            self.reporter.emit("node_lost", {"nodes_before": self._nodes, "nodes": nodes})
        self._nodes = nodes
        self.reporter.emit(
            "rendezvous",
            {
                "round": self._attempt,  # the job-wide restart count; ranks see it as FATHOM_ATTEMPT
                "node": self.config.node_rank,
                # The Fathom host's name, which the pages know it by; a Slurm node's hostname.
                "host": self.config.started.host_name,
                "group_rank": worker_group.group_rank,
                "nodes": nodes,
                "world_size": worker_group.workers[0].world_size,
                "ranks": [w.global_rank for w in worker_group.workers],
                "master": f"{worker_group.master_addr}:{worker_group.master_port}",
            },
        )

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._from_step = self._recoverable_step()
        # The run's spec as the control plane wrote it: each rank fits it to the world it finds
        # (WORLD_SIZE, GROUP_WORLD_SIZE, LOCAL_WORLD_SIZE) when the rendezvous formed a smaller one.
        argv = ["--spec", str(self.config.spec_file), "--run-dir", str(self.config.run_dir)]
        self._ranks = []
        for worker in worker_group.workers:
            rank_env = RankEnvironment(
                run_dir=self.config.run_dir,
                node_rank=self.config.node_rank,
                attempt=self._attempt,
                heartbeat_file=self.config.node_dir.heartbeat_file(worker.global_rank),
                heartbeat_interval=self.config.heartbeat_interval,
                events_file=self.config.node_dir.events_file,
                error_file=self.config.node_dir.error_file(worker.global_rank),
                # Only a scheduler asks for a checkpoint before it stops the run (see the module's docstring).
                stop_request_file=self.config.folder.stop_request if self.config.stop_requests else None,
                # Datasets on object storage are checked once a machine, in its data folder.
                download_cache=self.config.started.cache_root(RunDir(self.config.run_dir).data_dir / "cache"),
            )
            env = {
                **_process_env(),
                **_torch_worker_env(worker_group, worker.local_rank, self._restarts),
                **rank_env.to_environ(),
            }
            slot = RankSlot(
                global_rank=worker.global_rank,
                local_rank=worker.local_rank,
                env=env,
                log=self.config.folder.rank_log(worker.global_rank),
                heartbeat_file=rank_env.heartbeat_file,
                error_file=self.config.node_dir.error_file(worker.global_rank),
                cores=self._slot_cores[worker.local_rank] if worker.local_rank < len(self._slot_cores) else None,
            )
            rank = activate_standby(self._standbys.pop(0), argv, slot) if self._standbys else None
            if rank is None:
                rank = spawn_rank([sys.executable, "-m", self.config.entrypoint, *argv], slot)
            self._ranks.append(rank)
        self._standbys_due = self.config.warm_standby
        return {r.local_rank: r.pid for r in self._ranks}

    def _replenish_standbys(self) -> None:
        for standby in [s for s in self._standbys if not s.alive()]:
            self._standbys.remove(standby)
        while len(self._standbys) < self._worker_group.spec.local_world_size:
            log = self.config.folder.standby_log(self.config.node_rank)
            self._standbys.append(spawn_standby(self.config.entrypoint, env=_process_env(), log=log))
        self._standbys_due = False

    def _discard_standbys(self) -> None:
        for standby in self._standbys:
            standby.discard()
        self._standbys = []

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        # SIGKILL also ends ranks blocked in a collective or stopped.
        stop_ranks(self._ranks, sig=signal.SIGKILL, grace=0.0)

    def _let_survivors_exit(self) -> None:
        """A rank failed: the others exit on their own once they have snapshotted the state they
        hold (their collectives with it broke); what is still running after the grace is killed."""
        stop_ranks(self._ranks, sig=None, grace=self.config.survivor_grace)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        state = self._watchdog.check(self._ranks)
        if state.failures:
            return RunResult(state=WorkerState.FAILED)
        return RunResult(state=WorkerState.SUCCEEDED if state.succeeded else WorkerState.HEALTHY)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        stop_ranks(self._ranks, sig=death_sig, grace=float(timeout))

    # --- the run loop -------------------------------------------------------------------

    def execute(self) -> Outcome:
        """Runs until the ranks succeed, the restart budget is spent, or the run is cancelled."""
        handler = self._worker_group.spec.rdzv_handler
        try:
            if self.config.warm_standby:
                self._replenish_standbys()  # they import while the rendezvous waits for the other nodes
            outcome = self._invoke_run()
        except CancelRequested:
            logger.info("cancel requested: stopping ranks (grace %.0f s)", self.config.cancel_grace)
            stop_ranks(self._ranks, sig=signal.SIGTERM, grace=self.config.cancel_grace)
            outcome = interrupted(self.config, self._latest_committed_step())
        except RendezvousError as exc:
            cancelled = self.config.folder.cancel_marker.exists()
            outcome = Outcome(
                code=ExitCode.CANCELLED if cancelled else ExitCode.FAILED,
                kind="cancelled" if cancelled else "failed",
                data={"reason": f"rendezvous: {type(exc).__name__}: {exc}"},
            )
        except Exception as exc:  # e.g. the store's host vanished mid-run: report it, don't just die
            logger.exception("agent failed")
            outcome = Outcome(code=ExitCode.FAILED, kind="failed", data={"reason": f"{type(exc).__name__}: {exc}"})
        finally:
            stop_ranks(self._ranks, sig=signal.SIGKILL, grace=0.0)
            self._discard_standbys()
        try:
            # Closing the rendezvous tells the other agents the run is over (they stop waiting).
            handler.shutdown()
        except Exception as exc:  # the store's host may already be gone; nothing left to tell
            logger.info("rendezvous shutdown: %s", exc)
        return outcome

    def _invoke_run(self, role: str = "") -> Outcome:  # type: ignore[override]
        group = self._worker_group
        self._initialize_workers(group)
        next_membership_check = time.monotonic() + self.config.membership_check_interval
        cancel_file = self.config.folder.cancel_marker
        while True:
            wait_for_exit(self._ranks, self.config.monitor_interval)
            if cancel_file.exists():
                raise CancelRequested
            state = self._watchdog.check(self._ranks)
            if self._standbys_due and not state.failures and self._progressed():
                self._replenish_standbys()
            if state.saved_and_stopped:
                step = self._latest_committed_step()
                try:
                    asked = self.config.folder.stop_request.read_text(errors="replace").strip()
                except OSError:  # the next job's start removed it already
                    asked = "no reason given"
                return Outcome(
                    code=ExitCode.STOPPED,
                    kind="stopped",
                    data={"step": step, "reason": f"checkpointed step {step} as the scheduler asked: {asked}"},
                )
            if state.succeeded:
                self._exit_barrier()
                return Outcome(
                    code=ExitCode.SUCCEEDED, kind="succeeded", data={"step": self._latest_committed_step()}
                )
            if state.failures:
                failures = self._root_causes(state.failures)
                self._handle_failures(failures)
                fatal = self._non_retryable(failures)
                if fatal is not None:
                    self._stop_workers(group)
                    return fatal
                if self._recoverable_step() > self._from_step:
                    self._restarts_in_a_row = 0  # the attempt saved progress: the budget is whole again
                if self._restarts_in_a_row >= self.plan.nodes.max_restarts:
                    self._stop_workers(group)
                    first = failures[0]
                    return Outcome(
                        code=ExitCode.FAILED,
                        kind="failed",
                        data={
                            "reason": f"rank {first.rank} {first.reason}; {self._restarts_in_a_row} restarts in a row "
                            f"without a new checkpoint (nodes.max_restarts={self.plan.nodes.max_restarts})",
                            "restarts": self._restarts,
                        },
                    )
                self._restarts_in_a_row += 1
                self._remaining_restarts = self.plan.nodes.max_restarts - self._restarts_in_a_row
                self._restarts += 1
                self._let_survivors_exit()
                self._restart("rank failed", self._backoff(progressed=self._progressed()))
            elif time.monotonic() >= next_membership_check:
                next_membership_check = time.monotonic() + self.config.membership_check_interval
                waiting = group.spec.rdzv_handler.num_nodes_waiting()
                if waiting:
                    # A node (re)joined: re-form the group with it; not a failure, costs no restart.
                    self._restart(f"{waiting} node(s) waiting to join", backoff=0.0)

    def _root_causes(self, failures: list[RankFailure]) -> list[RankFailure]:
        """The failures to act on and report, root causes first. A rank that died or hung takes
        its peers' collectives down with it, and they exit with an error in the same instant
        (after copying the state they hold); such an exit, seen beside a death or a hang, is its
        consequence, not a failure of its own, unless the rank reported an error of its own."""
        order = ("hung", "killed by signal", "exited")
        failures = sorted(failures, key=lambda f: order.index(f.reason))
        if all(f.reason == "exited" for f in failures):
            return failures
        return [f for f in failures if f.reason != "exited" or self._rank_error(f) is not None]

    def _rank_error(self, failure: RankFailure) -> RankError | None:
        rank = next(r for r in self._ranks if r.global_rank == failure.rank)
        return RankError.read(rank.error_file) if failure.reason == "exited" else None

    def _handle_failures(self, failures: list[RankFailure]) -> None:
        hung = {f.rank for f in failures if f.reason == "hung"}
        if hung:
            # Freeze the healthy ranks first: a hung rank continued to print its stacks would
            # otherwise finish its collectives with them, and the run would advance (and even
            # checkpoint) past the hang during the grace. They are killed with the group anyway.
            for rank in self._ranks:
                if rank.global_rank not in hung:
                    rank.signal(signal.SIGSTOP)
        for failure in failures:
            logger.warning("rank %s %s (pid %s, exit %s)", failure.rank, failure.reason, failure.pid, failure.exit_code)
            self.reporter.emit("rank_failed", failure.as_event(), when=failure.detected_at)
            if failure.reason == "hung":
                rank = next(r for r in self._ranks if r.global_rank == failure.rank)
                rank.signal(STACK_DUMP_SIGNAL)
                rank.signal(signal.SIGCONT)  # a stopped process runs its signal handlers only once continued
        if hung:
            time.sleep(self.config.stack_dump_grace)
            # The hung ranks go first; their peers, continued, find their collectives broken,
            # snapshot the state they hold and exit (`_let_survivors_exit`).
            for rank in self._ranks:
                if rank.global_rank in hung:
                    rank.signal(signal.SIGKILL)
            for rank in self._ranks:
                if rank.global_rank not in hung:
                    rank.signal(signal.SIGCONT)

    def _non_retryable(self, failures: list[RankFailure]) -> Outcome | None:
        """The run's end when a failed rank reported an error that every restart would meet again."""
        for failure in failures:
            error = self._rank_error(failure)
            if error is not None:
                return Outcome(
                    code=ExitCode.FAILED,
                    kind="failed",
                    data={
                        "reason": f"{error.error_class} error (not retried): {error.message}",
                        "error_class": error.error_class,
                        "rank": failure.rank,
                        "restarts": self._restarts,
                    },
                )
        return None

    def _latest_committed_step(self) -> int:
        """The run's newest committed checkpoint, in its folder or on object storage."""
        return latest_committed_step(self.config.run_dir, self.plan.storage)

    def _recoverable_step(self) -> int:
        """The newest step a restart of this node's ranks could resume from: the newest committed
        checkpoint, or the newest in-memory snapshot every local rank holds (`training.memory_snapshot`),
        so progress kept only in memory also gives the restart budget back."""
        folder = self.config.folder
        in_memory = [max(folder.memory_snapshot_metas(r.global_rank).values(), default=0) for r in self._ranks]
        return max(self._latest_committed_step(), min(in_memory, default=0))

    def _progressed(self) -> bool:
        """Whether the failed attempt finished at least one step past its checkpoint."""
        for rank in self._ranks:
            beat = read_beat(rank.heartbeat_file)
            if beat is not None:
                done = beat.step if beat.phase != "step" else beat.step - 1
                if done > self._from_step:
                    return True
        return False

    def _backoff(self, *, progressed: bool) -> float:
        if progressed:
            self._failures_without_progress = 0
            return 0.0
        self._failures_without_progress += 1
        n = self._failures_without_progress
        return min(self.config.restart_backoff_max, self.config.restart_backoff_initial * 2 ** (n - 1))

    def _restart(self, reason: str, backoff: float) -> None:
        self._stop_workers(self._worker_group)
        self.reporter.emit(
            "restarting",
            {
                "attempt": self._restarts,
                "from_step": self._latest_committed_step(),
                "reason": reason,
                "backoff": backoff,
                "restarts_left": self._remaining_restarts,
            },
        )
        time.sleep(backoff)
        self._worker_group.state = WorkerState.STOPPED
        self._initialize_workers(self._worker_group)


def _agreed_master_port(group: WorkerGroup) -> int:
    """The port rank 0's store listens on this attempt (MASTER_PORT), the same on every node.

    torch's pick is a port of the kernel's ephemeral range, closed again until rank 0 binds it
    once it has imported torch, seconds later on a busy host; an outgoing connection can take
    it meanwhile, and rank 0 then fails (a loaded CI run restarted an attempt so). Group rank
    0's agent picks one below that range instead (training/ports.py) and puts it in this
    round's store, where the other agents read it.
    """
    key = "fathom/rank_store_port"
    store = cast(Store, group.store)  # the round's store, which the rendezvous just set
    if group.group_rank == 0:
        store.set(key, str(listen_port(RANK_STORE_PORTS, host="")))
    return int(store.get(key))


def _rendezvous_round(worker_spec: WorkerSpec, fallback: int) -> int:
    """The rendezvous round: the same on every node and +1 for each group restart of the job.

    Read from the dynamic handler's state, which torch does not expose publicly; another
    handler falls back to this agent's own restart count.
    """
    holder = getattr(worker_spec.rdzv_handler, "_state_holder", None)
    round_ = getattr(getattr(holder, "state", None), "round", None)
    return round_ if isinstance(round_, int) else fallback


def _process_env() -> dict[str, str]:
    """The environment every rank (and standby) starts with, before it knows which rank it is."""
    return {
        **os.environ,
        # One compute thread per rank unless the operator chose otherwise: ranks share the cores.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONUNBUFFERED": "1",  # so a rank's log is current when it dies
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")])),
    }


def _torch_worker_env(group: WorkerGroup, local_rank: int, restarts: int) -> dict[str, str]:
    """What torchrun gives a worker (`LocalElasticAgent._start_workers`), so `env://` init works."""
    spec = group.spec
    worker = group.workers[local_rank]
    return {
        "RANK": str(worker.global_rank),
        "LOCAL_RANK": str(local_rank),
        "GROUP_RANK": str(group.group_rank),
        "ROLE_RANK": str(worker.role_rank),
        "ROLE_NAME": spec.role,
        "LOCAL_WORLD_SIZE": str(spec.local_world_size),
        "WORLD_SIZE": str(worker.world_size),
        "GROUP_WORLD_SIZE": str(group.group_world_size),
        "ROLE_WORLD_SIZE": str(worker.role_world_size),
        "MASTER_ADDR": str(group.master_addr),
        "MASTER_PORT": str(group.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restarts),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
        "TORCHELASTIC_USE_AGENT_STORE": str(spec.rdzv_handler.use_agent_store),
    }
