"""Executors: what starts a run's node agents and a deployment's replica supervisors, stops
them, and says what still runs.

One interface (`Executor`: launch, submit, cancel, request_stop, state, relaunchable, follow_start for a run;
start_supervisors, stop_supervisors, replicas_placed, replica_hosts for a deployment) and three
implementations, chosen by FATHOM_EXECUTOR (settings.EXECUTOR):

* `local` — detached processes of the Celery worker's machine (`run_agents.start_agents`,
  `supervisors.start_here`);
* `hosts` — start tasks on the queues of the hosts placement chose (`run_agents.start_on_hosts`,
  `supervisors.start_on_hosts`). `local` and `hosts` are one setting: the hosts executor takes
  over once a host worker has registered, as before executors existed;
* `slurm` — one sbatch job per launch, whose srun starts one agent per node (`launch/slurm.py`);
  Slurm queues and places it, and its state comes from squeue/sacct. Slurm runs training jobs:
  a deployment's supervisors go where they would without it (hosts, else this machine).

Runs and deployments ask `current`, `for_run` or `for_deployment` for theirs and never ask
which it is. Each executor claims a launch its own way (`launch`: here, queued → starting; on
hosts, a placement pass; on Slurm, a submission claim) and records what happens to the run
through the `RunsSide` the launch task hands it (`runs.tasks.RUNS_SIDE`, runs.services): nothing
here imports runs.services, which calls the executors (a cancel).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from django.conf import settings
from django.db.models import F, QuerySet
from django.utils import timezone

from controlplane.queue import enqueue_after
from deployments.models import Deployment
from hosts import capacity
from hosts.models import Host
from launch import run_agents, slurm, slurm_options, supervisors
from launch.slurm_options import SlurmOptions
from launch.supervisors import Started, SupervisorRequest
from runs.models import Run
from serving.deployment_config import request_change
from serving.replica_adapters import request_adapters

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkState:
    """What an executor knows of a run's current launch."""

    alive: bool  # it still holds the run's work: agents that run, or a job pending or running
    waiting: str = ""  # why the work waits in the executor's own queue; empty: it does not
    ended: str = ""  # how the work ended, where the executor can say (a Slurm job's end state)
    lost: bool = False  # it vanished: the executor no longer knows it (`ended` says so)


# A launch that has not started an agent this long after its claim is sent again: its worker
# died (a broker without redelivery, such as the filesystem one, would otherwise lose it).
LAUNCH_GRACE = timedelta(seconds=20)
# How long a launch waits for the run's previous agents to exit (their cancel grace is 30 s).
AGENT_EXIT_WAIT_SECONDS = 60.0


class RunsSide(Protocol):
    """What a launch asks of the runs' side (`runs.tasks.RUNS_SIDE`): every status and event of a
    run is recorded by runs.services, and a placement pass places and starts queued runs."""

    def claim_launch(self, run_id: int) -> bool:
        """The queued run moved to `starting` for a launch here; False if it was not queued."""
        ...

    def set_status(self, run: Run, status: str, reason: str, *, only_from: list[str]) -> bool: ...

    def note_waiting(self, run: Run, reason: str, **data: Any) -> bool: ...

    def place_and_start(self) -> list[int]:
        """One placement pass, then the start tasks of what it placed; returns those runs."""
        ...


class Executor(Protocol):
    name: str

    def launch(self, run_id: int, runs: RunsSide) -> str:
        """Claims the queued run, once however often its launch task is delivered, and starts
        its work (`submit`); returns what happened, for the task's result."""
        ...

    def relaunchable(self, queued: QuerySet[Run]) -> QuerySet[Run]:
        """Of runs queued past LAUNCH_GRACE, those whose launch must be sent again (reconcile):
        none where placement offers them room on its own."""
        ...

    def follow_start(self, run: Run, now: datetime) -> None:
        """A live run still starting: sends again what its start lacks (hosts whose start task
        the broker lost); nothing where there is no such thing."""
        ...

    def submit(self, run: Run) -> str:
        """Starts the claimed launch of `run` (its agents, or a job that will start them);
        returns what it became, for the task's result."""
        ...

    def cancel(self, run: Run, *, started: bool) -> None:
        """Asks the run's agents to stop their ranks cleanly (the newest checkpoint stays).
        `started`: the run had left the queue; a queued run only has executor work to drop."""
        ...

    def request_stop(self, run: Run, reason: str) -> None:
        """Asks the run's ranks to checkpoint the step they agree on and stop (a preemption):
        its agents then report `stopped`, and the run goes back to the queue."""
        ...

    def state(self, run: Run) -> WorkState: ...

    def start_supervisors(self, request: SupervisorRequest) -> Started:
        """Starts the supervisors of the deployment's `request.replicas`; raises
        supervisors.NotPlaced, with why, when they have nowhere to run now."""
        ...

    def stop_supervisors(self, deployment: Deployment, hosts: list[Host] | None = None) -> bool:
        """Asks the deployment's supervisors to drain and stop their replicas; `hosts`: where they
        ran, read before a failure gave their devices back (default: where they run now). False
        when nothing of it runs."""
        ...

    def replicas_placed(self, deployment: Deployment) -> set[int] | None:
        """The replicas that hold the devices placement gave them; None where nothing is placed
        (one supervisor on this machine runs, and restarts, every replica)."""
        ...

    def replica_hosts(self, kind: str) -> list[Host] | None:
        """The ready hosts with devices of `kind` a new deployment's replicas may be placed on;
        None where they run on this machine."""
        ...

    def change_adapters(self, deployment: Deployment, adapters: dict[str, str] | None) -> bool:
        """Has the deployment's running supervisors serve these LoRA adapters (name → PEFT
        folder) without a restart; None only asks whether this executor can. False where it
        cannot (supervisors on hosts, for now), or none runs."""
        ...

    def change_replicas(self, deployment: Deployment, request: SupervisorRequest) -> bool:
        """Has the running deployment run `request.replicas` (0 … n-1, n ≥ 1) from now on: the
        replicas added start, placed as the first ones were; the last ones removed drain and
        stop, the others run on. False where it cannot now (a removal that would stop part of a
        host's supervisor). Raises supervisors.NotPlaced when the added ones have no room."""
        ...


class LocalExecutor:
    """Agents and supervisors as detached processes of this machine (agents under their per-node
    locks)."""

    name = "local"

    def launch(self, run_id: int, runs: RunsSide) -> str:
        """Claimed here (queued → starting), then its agents started."""
        claimed = runs.claim_launch(run_id)
        run = Run.objects.get(pk=run_id)
        if not claimed:
            # Redelivered (or re-sent by reconcile) after a worker died mid-launch: finish that
            # launch unless an agent runs. Agents take a per-node lock, so a race starts none twice.
            if run.status != Run.Status.STARTING or self.state(run).alive:
                return f"run {run_id} is {run.status}; nothing to do"
            Run.objects.filter(pk=run_id).update(launch_attempts=F("launch_attempts") + 1, last_report_at=timezone.now())
        # A resumed run's previous agents may still be on their way out (they report `cancelled`
        # or `failed`, then flush and exit); their lock would turn the new agents away.
        deadline = time.monotonic() + AGENT_EXIT_WAIT_SECONDS
        while self.state(run).alive and time.monotonic() < deadline:
            time.sleep(0.2)
        started = self.submit(run)
        log.info("run %s: %s", run_id, started)
        return f"run {run_id} {started}"

    def relaunchable(self, queued: QuerySet[Run]) -> QuerySet[Run]:
        return queued.filter(slurm_job_id__in=["", slurm.SUBMITTING])

    def follow_start(self, run: Run, now: datetime) -> None:
        return None

    def submit(self, run: Run) -> str:
        launch = run_agents.prepare(run)
        pids = run_agents.start_agents(run, launch)
        Run.objects.filter(pk=run.pk).update(agent_pids=pids)
        return f"started agents {pids}"

    def cancel(self, run: Run, *, started: bool) -> None:
        if started:
            run_agents.request_cancel(run)

    def request_stop(self, run: Run, reason: str) -> None:
        run_agents.request_stop(run, reason)

    def state(self, run: Run) -> WorkState:
        return WorkState(alive=run_agents.agents_alive(run))

    def start_supervisors(self, request: SupervisorRequest) -> Started:
        return supervisors.start_here(request)

    def stop_supervisors(self, deployment: Deployment, hosts: list[Host] | None = None) -> bool:
        return supervisors.stop_here(deployment)

    def replicas_placed(self, deployment: Deployment) -> set[int] | None:
        return None

    def replica_hosts(self, kind: str) -> list[Host] | None:
        return None

    def change_adapters(self, deployment: Deployment, adapters: dict[str, str] | None) -> bool:
        """Rewrites the supervisor's config and signals it (`serving.replica_adapters`)."""
        return True if adapters is None else request_adapters(deployment.folder, adapters)

    def change_replicas(self, deployment: Deployment, request: SupervisorRequest) -> bool:
        """Rewrites the supervisor's config (its count and cores) and signals it."""
        config = request.configure(None)
        return request_change(deployment.folder, replicas=config.replicas, cpu_binds=list(config.cpu_binds))


class HostsExecutor(LocalExecutor):
    """Agents on registered hosts: the scheduler claimed the run and its devices; the start
    tasks, which carry the spec, go to the hosts' queues. Cancel is a stop task to each placed
    host (SIGTERM to its agent: no file of the control plane's reaches a host); state is the
    local one (locks here, or the hosts' reports of what they run)."""

    name = "hosts"

    def launch(self, run_id: int, runs: RunsSide) -> str:
        """A placement pass claims the run, with its devices, when it fits; its agents start on
        its hosts."""
        placed = runs.place_and_start()
        if run_id in placed:
            return f"run {run_id} placed and started"
        run = Run.objects.get(pk=run_id)
        if run.status == Run.Status.QUEUED:
            return f"run {run_id} {run.status_reason or 'waits'}"
        # Redelivered (or re-sent by reconcile): send the start tasks again if its agents never
        # came up. Not sooner than LAUNCH_GRACE after the last send: a new token would lock out
        # agents that are still starting.
        quiet_for = timezone.now() - (run.last_report_at or run.created_at)
        if run.status != Run.Status.STARTING or quiet_for <= LAUNCH_GRACE or self.state(run).alive:
            return f"run {run_id} is {run.status}; nothing to do"
        if not run.device_claims.exists():
            return f"run {run_id} holds no devices; nothing to do"
        if run.cancel_requested:
            runs.set_status(run, Run.Status.CANCELLED, "cancelled before its agents started", only_from=[run.status])
            return f"run {run_id} cancelled"
        Run.objects.filter(pk=run_id).update(launch_attempts=F("launch_attempts") + 1, last_report_at=timezone.now())
        self.submit(run)
        return f"run {run_id}: start tasks sent again"

    def relaunchable(self, queued: QuerySet[Run]) -> QuerySet[Run]:
        return queued.none()  # beat's watch_hosts offers them room every pass

    def follow_start(self, run: Run, now: datetime) -> None:
        """A placed run whose agents came up on some hosts and not on others (the broker lost a
        start task: a restart keeps nothing) would wait at its rendezvous until the join timeout
        fails it. Its start tasks go again, as the same launch with the same token: a host starts
        only what it does not run, and the agents already waiting stay in."""
        placed_at = run.events.filter(kind="placed").order_by("-seq").values_list("time", flat=True).first()
        if placed_at is None or now - placed_at <= LAUNCH_GRACE:
            return
        if missing := run_agents.missing_on_hosts(run):
            log.warning("run %s: no host runs %s; its start tasks are sent again", run.pk, ", ".join(missing))
            self.submit(run)

    def submit(self, run: Run) -> str:
        run_agents.start_on_hosts(run)
        return "start tasks sent to its hosts"

    def cancel(self, run: Run, *, started: bool) -> None:
        if started:
            run_agents.stop_agents(run)

    def start_supervisors(self, request: SupervisorRequest) -> Started:
        return supervisors.start_on_hosts(request)

    def stop_supervisors(self, deployment: Deployment, hosts: list[Host] | None = None) -> bool:
        placed = supervisors.placed_hosts(deployment) if hosts is None else hosts
        if not placed:
            return supervisors.stop_here(deployment)  # started here before any host registered
        supervisors.stop_on_hosts(deployment, placed)
        return True

    def replicas_placed(self, deployment: Deployment) -> set[int] | None:
        return supervisors.replicas_on_hosts(deployment)

    def replica_hosts(self, kind: str) -> list[Host] | None:
        ready = Host.objects.filter(status=Host.Status.READY).order_by("pk")
        return [host for host in ready if host.device_kind == kind]

    def change_adapters(self, deployment: Deployment, adapters: dict[str, str] | None) -> bool:
        return False  # a host's supervisor is signalled by nobody here yet

    def change_replicas(self, deployment: Deployment, request: SupervisorRequest) -> bool:
        """Each host runs one supervisor of a deployment, for a block of its replicas: the added
        ones are placed as a new block, where none of its replicas runs; a removal stops the
        supervisors of hosts that hold only removed replicas, whose devices go back once their
        beats list it no more (`scheduling.release_ended_claims`)."""
        by_host = {host: supervisors.replicas_on_hosts(deployment, host) for host in supervisors.placed_hosts(deployment)}
        held: set[int] = set().union(*by_host.values())
        if not held:
            return super().change_replicas(deployment, request)  # started here before any host registered
        wanted = set(request.replicas)
        removed = held - wanted
        stopping = [host for host, replicas in by_host.items() if replicas <= removed]
        if removed and set().union(*(by_host[host] for host in stopping)) != removed:
            return False
        if added := sorted(wanted - held):
            self.start_supervisors(dataclasses.replace(request, replicas=added))
        supervisors.stop_on_hosts(deployment, stopping)
        return True


class SlurmExecutor:
    """One Slurm job per launch (launch/slurm.py). Deployments' supervisors are not Slurm jobs:
    they run on the hosts, or on this machine, as without Slurm."""

    name = "slurm"

    def launch(self, run_id: int, runs: RunsSide) -> str:
        """Submits the queued run as a Slurm job, once: the claim (a conditional UPDATE that puts
        SUBMITTING in its job id) admits one launch; one whose worker died after sbatch answered
        finds its job by name before it submits again. The run stays queued, with Slurm's
        reason, until the job starts."""
        run = Run.objects.get(pk=run_id)
        if run.status != Run.Status.QUEUED or run.cancel_requested:
            return f"run {run_id} is {run.status}; nothing to do"
        if run.slurm_job_id not in ("", slurm.SUBMITTING):
            return f"run {run_id} is Slurm job {run.slurm_job_id}; nothing to do"
        if run.slurm_job_id == slurm.SUBMITTING:
            if timezone.now() - (run.last_report_at or run.created_at) <= LAUNCH_GRACE:
                return f"run {run_id} is being submitted"
            try:
                if job_id := self._adopt_submitted_job(run, runs):
                    return f"run {run_id}: found its Slurm job {job_id}"
            except slurm.SlurmError as exc:
                return f"run {run_id}: {exc}; its job may be queued, so it is not submitted again yet"
        claimed = Run.objects.filter(
            pk=run_id, status=Run.Status.QUEUED, cancel_requested=False,
            slurm_job_id=run.slurm_job_id, launch_attempts=run.launch_attempts,
        ).update(slurm_job_id=slurm.SUBMITTING, launch_attempts=F("launch_attempts") + 1, last_report_at=timezone.now())  # fmt: skip
        if not claimed:
            return f"run {run_id}: another launch claimed it"
        run.refresh_from_db()
        try:
            job_id = self.submit(run)
        except slurm.SlurmUnreachable as exc:
            # The job may or may not be in Slurm's queue: the next launch (reconcile re-sends it
            # after LAUNCH_GRACE) looks for it by name before it submits again.
            log.warning("run %s: %s; the launch will be sent again", run_id, exc)
            return f"run {run_id}: {exc}"
        except slurm.SlurmError as exc:
            Run.objects.filter(pk=run_id, slurm_job_id=slurm.SUBMITTING).update(slurm_job_id="")
            runs.set_status(run, Run.Status.FAILED, f"Slurm refused the job: {exc}", only_from=[Run.Status.QUEUED])
            return f"run {run_id}: {exc}"
        self._submitted(run, job_id, runs)
        return f"run {run_id} is Slurm job {job_id}"

    def _adopt_submitted_job(self, run: Run, runs: RunsSide) -> str:
        """The job of the run's claimed launch, if sbatch took it before its worker died; "" if
        not. Raises slurm.SlurmError when squeue does not answer: then nobody knows."""
        name = slurm.job_name(run, run.launch_attempts)
        found = [job for job in slurm.jobs().values() if job.name == name and job.alive]
        if not found or not Run.objects.filter(pk=run.pk, slurm_job_id=slurm.SUBMITTING).update(slurm_job_id=found[0].id):
            return ""
        self._submitted(run, found[0].id, runs)
        return found[0].id

    def _submitted(self, run: Run, job_id: str, runs: RunsSide) -> None:
        run.refresh_from_db()
        if run.cancel_requested or run.status != Run.Status.QUEUED:
            slurm.cancel(job_id)  # cancelled while sbatch was answering: nothing started yet
            return
        runs.note_waiting(run, f"waiting: submitted to Slurm as job {job_id}", slurm_job=job_id)

    def relaunchable(self, queued: QuerySet[Run]) -> QuerySet[Run]:
        return queued.filter(slurm_job_id__in=["", slurm.SUBMITTING])  # a run holding a job waits in Slurm's queue

    def follow_start(self, run: Run, now: datetime) -> None:
        return None

    def submit(self, run: Run) -> str:
        """Writes the scripts and sbatches them; the job id replaces the claim's SUBMITTING.
        Raises slurm.SlurmError with what sbatch said."""
        launch = run_agents.prepare(run)
        options = SlurmOptions(**run.slurm) if run.slurm else slurm_options.install_defaults()
        job_id = slurm.submit(slurm.write_scripts(run, options, launch))
        Run.objects.filter(pk=run.pk, slurm_job_id=slurm.SUBMITTING).update(slurm_job_id=job_id)
        return job_id

    def cancel(self, run: Run, *, started: bool) -> None:
        """The cancel marker first: the agents stop their ranks cleanly and report, and the job
        ends by itself. Slurm ends it after the grace in any case (a task, and the watch as a
        backstop). A job that never started is only taken out of the queue."""
        run.folder.mkdir(parents=True, exist_ok=True)
        run.run_dir.cancel_marker.touch()
        job_id = run.slurm_job_id
        if job_id in ("", slurm.SUBMITTING):
            return  # the launch scancels its job when sbatch answers and the run is cancelled
        if started:
            enqueue_after(settings.SLURM_CANCEL_GRACE_SECONDS, "runs.tasks.end_slurm_job", run.pk, job_id)
            return
        try:
            slurm.cancel(job_id)
        except slurm.SlurmError as exc:
            # Should the job start after all, its agents find the cancel marker and stop at once.
            log.warning("run %s: Slurm job %s stays queued: %s", run.pk, job_id, exc)

    def request_stop(self, run: Run, reason: str) -> None:
        """The batch script's own request, written early (Slurm preempts by its own rules; Fathom
        asks only of runs its placement preempts, which a Slurm job never is)."""
        run.folder.mkdir(parents=True, exist_ok=True)
        run.run_dir.stop_request.write_text(reason)

    def state(self, run: Run) -> WorkState:
        return self.states([run])[run.pk]

    def states(self, runs: list[Run]) -> dict[int, WorkState]:
        """Each run's job as Slurm says, from one squeue (and sacct for jobs squeue no longer
        holds). Raises slurm.SlurmError when Slurm does not answer: nothing is known then."""
        listing = slurm.jobs()
        found: dict[int, WorkState] = {}
        for run in runs:
            job_id = run.slurm_job_id
            if job_id in ("", slurm.SUBMITTING):
                found[run.pk] = WorkState(alive=True, waiting="being submitted to Slurm")
                continue
            job = listing.get(job_id) or slurm.accounting(job_id)
            if job is None:
                ended = f"lost: Slurm job {job_id} is gone (neither squeue nor sacct knows it)"
                found[run.pk] = WorkState(alive=False, ended=ended, lost=True)
            elif job.pending:
                position = slurm.queue_position(job, listing)
                words = slurm.reason_words(job.reason)
                waiting = f"Slurm job {job_id} pending, {_ordinal(position)} in partition {job.partition}: {words}"
                if words != job.reason:
                    waiting += f" ({job.reason})"
                found[run.pk] = WorkState(alive=True, waiting=waiting)
            elif job.alive:
                found[run.pk] = WorkState(alive=True)
            else:
                reason = f" ({job.reason})" if job.reason not in ("", "None") else ""
                found[run.pk] = WorkState(alive=False, ended=f"Slurm job {job_id} ended {job.state}{reason}")
        return found

    def start_supervisors(self, request: SupervisorRequest) -> Started:
        return _supervising().start_supervisors(request)

    def stop_supervisors(self, deployment: Deployment, hosts: list[Host] | None = None) -> bool:
        return _supervising().stop_supervisors(deployment, hosts)

    def replicas_placed(self, deployment: Deployment) -> set[int] | None:
        return _supervising().replicas_placed(deployment)

    def replica_hosts(self, kind: str) -> list[Host] | None:
        return _supervising().replica_hosts(kind)

    def change_adapters(self, deployment: Deployment, adapters: dict[str, str] | None) -> bool:
        return _supervising().change_adapters(deployment, adapters)

    def change_replicas(self, deployment: Deployment, request: SupervisorRequest) -> bool:
        return _supervising().change_replicas(deployment, request)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


LOCAL = LocalExecutor()
HOSTS = HostsExecutor()
SLURM = SlurmExecutor()


def _supervising() -> Executor:
    return HOSTS if capacity.cluster_exists() else LOCAL


def current() -> Executor:
    """The executor new launches and deployments go to."""
    if settings.EXECUTOR == "slurm":
        return SLURM
    return _supervising()


def for_run(run: Run) -> Executor:
    """The executor that holds the run's current launch: a run with a Slurm job is Slurm's
    whatever the setting says now."""
    return SLURM if run.slurm_job_id else current()


def for_deployment(deployment: Deployment) -> Executor:
    """The executor that holds the deployment's supervisors: one started on this machine (its
    pid is recorded) stays this machine's whatever registered since."""
    return LOCAL if deployment.supervisor_pid is not None else current()
