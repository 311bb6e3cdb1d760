"""Executors: what starts a run's node agents, stops them, and says whether its work still runs.

One small interface (`Executor`: submit, cancel, state) and three implementations, chosen by
FATHOM_EXECUTOR (settings.EXECUTOR):

* `local` — detached processes of the Celery worker's machine (`launcher.start_agents`);
* `hosts` — start tasks on the queues of the hosts the scheduler placed the run on
  (`launcher.start_on_hosts`). `local` and `hosts` are one setting: the hosts executor takes
  over once a host worker has registered, as before executors existed;
* `slurm` — one sbatch job per launch, whose srun starts one agent per node (`runs/slurm.py`);
  Slurm queues and places it, and its state comes from squeue/sacct.

How a launch is claimed and what is recorded stays with the tasks (`runs/tasks.py`) and the
domain operations (`runs/services.py`); executors record nothing, so services can call one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from django.conf import settings

from controlplane.queue import enqueue_after
from hosts import capacity
from runs import launcher, slurm
from runs.models import Run
from runs.slurm_options import SlurmOptions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkState:
    """What an executor knows of a run's current launch."""

    alive: bool  # it still holds the run's work: agents that run, or a job pending or running
    waiting: str = ""  # why the work waits in the executor's own queue; empty: it does not
    ended: str = ""  # how the work ended, where the executor can say (a Slurm job's end state)
    lost: bool = False  # it vanished: the executor no longer knows it (`ended` says so)


class Executor(Protocol):
    name: str

    def submit(self, run: Run) -> str:
        """Starts the claimed launch of `run` (its agents, or a job that will start them);
        returns what it became, for the task's result."""
        ...

    def cancel(self, run: Run, *, started: bool) -> None:
        """Asks the run's agents to stop their ranks cleanly (the newest checkpoint stays).
        `started`: the run had left the queue; a queued run only has executor work to drop."""
        ...

    def state(self, run: Run) -> WorkState: ...


class LocalExecutor:
    """Agents as detached processes of this machine, under their per-node locks."""

    name = "local"

    def submit(self, run: Run) -> str:
        launch = launcher.prepare(run)
        pids = launcher.start_agents(run, launch)
        Run.objects.filter(pk=run.pk).update(agent_pids=pids)
        return f"started agents {pids}"

    def cancel(self, run: Run, *, started: bool) -> None:
        if started:
            launcher.request_cancel(run)

    def state(self, run: Run) -> WorkState:
        return WorkState(alive=launcher.agents_alive(run))


class HostsExecutor(LocalExecutor):
    """Agents on registered hosts: the scheduler claimed the run and its devices; the start
    tasks, which carry the spec, go to the hosts' queues. Cancel is a stop task to each placed
    host (SIGTERM to its agent: no file of the control plane's reaches a host); state is the
    local one (locks here, or the hosts' reports of what they run)."""

    name = "hosts"

    def submit(self, run: Run) -> str:
        launcher.start_on_hosts(run)
        return "start tasks sent to its hosts"

    def cancel(self, run: Run, *, started: bool) -> None:
        if started:
            launcher.stop_agents(run)


class SlurmExecutor:
    """One Slurm job per launch (runs/slurm.py)."""

    name = "slurm"

    def submit(self, run: Run) -> str:
        """Writes the scripts and sbatches them; the job id replaces the claim's SUBMITTING.
        Raises slurm.SlurmError with what sbatch said."""
        launch = launcher.prepare(run)
        options = SlurmOptions(**run.slurm) if run.slurm else settings.SLURM_DEFAULTS
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


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


LOCAL = LocalExecutor()
HOSTS = HostsExecutor()
SLURM = SlurmExecutor()


def current() -> Executor:
    """The executor new launches go to."""
    if settings.EXECUTOR == "slurm":
        return SLURM
    return HOSTS if capacity.cluster_exists() else LOCAL


def for_run(run: Run) -> Executor:
    """The executor that holds the run's current launch: a run with a Slurm job is Slurm's
    whatever the setting says now."""
    return SLURM if run.slurm_job_id else current()
