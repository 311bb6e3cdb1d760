"""Slurm, as the control plane uses it: the run's batch script, and sbatch, squeue, sacct,
scancel and sinfo run as commands (the clients every Slurm site has; they find their cluster
through /etc/slurm or SLURM_CONF).

A run is one job of `nodes.max` nodes, one task per node: the batch script runs on the job's
first node, picks the rendezvous endpoint there (that node's address as Slurm knows it, a free
port of settings.RENDEZVOUS_PORTS: training/ports.py), starts the rendezvous store of a multi-node run beside itself, and `srun` starts
`slurm-agent.sh` once per node: that node's agent under its lock, told its node rank
(SLURM_NODEID). Devices are Slurm's: the job asks for `--gpus-per-node` and the agents see the
CUDA_VISIBLE_DEVICES Slurm sets. The job carries the run's name and launch number
(`job_name`), which is how a launch whose worker died before it saved the job id finds it.
Ahead of the time limit (`--signal`), the script asks the ranks to checkpoint and stop (the run
folder's stop request) and, once they have, requeues its job if the run is unfinished.

Nothing here records events or changes a run's status: `launch.executors` and `runs.tasks` do.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from hosts.capacity import need_of
from launch import run_agents
from launch.slurm_options import SlurmOptions
from runs.models import Run

# The job id a run holds between the claim of its launch and sbatch's answer.
SUBMITTING = "submitting"
# sbatch retries an unreachable controller for a while itself (MessageTimeout, 10 s by default,
# a few times); past this the launch fails and is sent again.
SBATCH_TIMEOUT_S = 60.0
# squeue, sacct, scancel and sinfo answer in milliseconds from a healthy controller.
QUERY_TIMEOUT_S = 20.0
# What Slurm sends the batch shell before the time limit (`--signal`); how long before is
# settings.SLURM_SIGNAL_LEAD_SECONDS.
TIME_LIMIT_SIGNAL = "USR1"
# The agents' exit status when they stopped for the scheduler: training.agent.node_agent.ExitCode.STOPPED.
AGENT_STOPPED = 4
# The variables of the Celery worker's environment a job gets (`--export`): what the agents
# and ranks read (storage credentials, caches, where Slurm is), never the control plane's own
# secrets (DATABASE_URL, SECRET_KEY, …), which sbatch would keep in slurmctld's state.
EXPORTED = (
    "PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "XDG_CACHE_HOME", "SLURM_CONF",
    "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
    "HF_HOME", "HF_HUB_OFFLINE", "FATHOM_SNAPSHOT_ROOT",
)  # fmt: skip
# A job in any other state has ended (squeue --states=all keeps it for MinJobAge, then sacct).
ALIVE_STATES = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_FED",
     "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}
)  # fmt: skip


class SlurmError(RuntimeError):
    """A Slurm command refused or failed; the message is what it said."""


class SlurmUnreachable(SlurmError):
    """A Slurm command did not answer in time: the controller may be down; try again later."""


@dataclass(frozen=True)
class Job:
    id: str
    name: str
    state: str  # PENDING, RUNNING, COMPLETED, … (squeue's %T)
    reason: str  # why it pends, or why it ended (squeue's %r); "None" when there is nothing to say
    partition: str = ""
    priority: int = 0

    @property
    def alive(self) -> bool:
        return self.state in ALIVE_STATES

    @property
    def pending(self) -> bool:
        return self.state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")


def _run(command: list[str], timeout: float = QUERY_TIMEOUT_S) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmError(f"{command[0]} is not installed on the control plane's machine") from None
    except subprocess.TimeoutExpired:
        raise SlurmUnreachable(f"{command[0]} did not answer within {timeout:.0f} s") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise SlurmError(f"{command[0]} failed: {said[-1] if said else f'exit status {done.returncode}'}")
    return done.stdout


# --- The job ------------------------------------------------------------------------------


def job_name(run: Run, launch: int) -> str:
    """Unique per run (its folder's name holds its id and creation time) and launch."""
    return f"fathom-{run.folder.name}-L{launch}"


def _shell(args: Iterable[str], expanded: frozenset[str] = frozenset()) -> str:
    """Words for a shell line: each quoted, except the variables in `expanded`, which the shell
    expands (double-quoted)."""
    return " ".join(f'"{a}"' if a in expanded else shlex.quote(a) for a in args)


def agent_script(run: Run, launch: run_agents.Launch) -> str:
    """What srun starts on each node: that node's agent with its node's token, under its lock. A
    new launch's agent waits for the lock of a previous launch's agent still stopping (`-w`), as
    on hosts. The script holds every node's token: the job's nodes share this folder anyway."""
    run_dir = run.run_dir
    node, rdzv, token = "$SLURM_NODEID", "$FATHOM_RDZV", "${FATHOM_NODE_TOKENS[$SLURM_NODEID]}"
    args = run_agents.agent_arguments(run, run_dir.path, node, rdzv, token)
    if run.node_count > 1:
        args += ["--host-store", "no"]  # the batch script runs the store
    # Slurm's SIGTERM (requeue, preemption, time limit) ends the job, not the run; Fathom's
    # cancel is the marker.
    args += ["--sigterm", "stop"]
    lock = shlex.quote(str(run_dir.path)) + '/agent-node"$SLURM_NODEID".lock'
    command = _shell([settings.TRAINING_PYTHON, "-m", "training.agent", *args], frozenset({node, rdzv, f"--run-token={token}"}))
    tokens = " ".join(launch.token(n) for n in range(run.node_count))
    return (
        "#!/bin/bash\n"
        f"# Node $SLURM_NODEID's agent of Fathom run {run.pk}, started by srun in the run's Slurm job.\n"
        f"FATHOM_NODE_TOKENS=({tokens})\n"
        f"exec flock -w 90 -E 75 {lock} {command}\n"
    )


def batch_script(run: Run, options: SlurmOptions) -> str:
    """The run's sbatch script (see the module's docstring for what it does)."""
    run_dir = run.run_dir
    need = need_of(run.spec)
    python = shlex.quote(settings.TRAINING_PYTHON)
    lead = settings.SLURM_SIGNAL_LEAD_SECONDS
    sbatch = {
        "job-name": job_name(run, run.launch_attempts),
        "nodes": str(need.nodes),
        "ntasks-per-node": "1",
        # A CPU rank needs a core of its own; a GPU job's cores are the site's to give.
        "cpus-per-task": str(need.per_node),
        "partition": options.partition,
        "account": options.account,
        "qos": options.qos,
        "time": options.time_limit,
        "gpus-per-node": str(options.gpus_per_node) if options.gpus_per_node else "",
        "signal": f"B:{TIME_LIMIT_SIGNAL}@{settings.SLURM_SIGNAL_LEAD_SECONDS}",
        "output": str(run_dir.slurm_log("%j")),
        "open-mode": "append",
        "chdir": str(settings.REPO_DIR),
        "export": ",".join(name for name in EXPORTED if name in os.environ) or "NONE",
    }
    lines = ["#!/bin/bash", *(f"#SBATCH --{key}={value}" for key, value in sbatch.items() if value)]
    lines += ["#SBATCH --requeue", f"# Fathom run {run.pk} ({run.name}), launch {run.launch_attempts}.", ""]
    store = ""
    if run.node_count > 1:
        store_command = _shell(
            [settings.TRAINING_PYTHON, "-m", "training.agent.rendezvous_store", "--endpoint", "$FATHOM_RDZV",
             "--run-dir", str(run_dir.path)], frozenset({"$FATHOM_RDZV"}),
        )  # fmt: skip
        store = (
            "# The job's rendezvous store, here on its first node; it leaves once no agent holds a lock.\n"
            f"{store_command} >> {shlex.quote(str(run_dir.rendezvous_store_log))} 2>&1 &\n"
        )
    body = f"""set -u
echo "fathom: job $SLURM_JOB_ID started at $(date +%s.%N)"
export PYTHONPATH={shlex.quote(str(settings.REPO_DIR))} OMP_NUM_THREADS=1 FATHOM_DATA_DIR={shlex.quote(str(settings.DATA_DIR))}
# srun passes on this shell's environment (FATHOM_RDZV below included), not only --export's list.
export SLURM_EXPORT_ENV=ALL
# The rendezvous is on the job's first node (this one), at its address as Slurm knows it.
first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
address=$(scontrol show node "$first" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
port=$({python} -m training.ports {settings.RENDEZVOUS_PORTS.start} {settings.RENDEZVOUS_PORTS.stop - 1})
export FATHOM_RDZV="${{address:-$first}}:$port"
echo "fathom: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, rendezvous at $FATHOM_RDZV"
{store}# Slurm signals the time limit {lead} s ahead of the kill (or up to a minute earlier). The ranks
# are asked to checkpoint at their next step and stop (the stop request, which they look for at
# every step's end); once the agents have stopped so, the job requeues itself, and its next start
# resumes from that checkpoint. Only if the run is unfinished (the agents stopped rather than
# succeeded) and the job committed a newer checkpoint than it started from: a run that cannot
# checkpoint within its time limit would otherwise be requeued forever.
committed() {{
    {python} -c 'import sys; from pathlib import Path; from training.checkpoint_storage import latest_committed_step as step; print(step(Path(sys.argv[1]), sys.argv[2]))' \
        {shlex.quote(str(run_dir.path))} {shlex.quote(str(run.spec.get("data", {}).get("storage", "")))}
}}
stop_request={shlex.quote(str(run_dir.stop_request))}
rm -f "$stop_request"  # the request of this job's previous start, if it was requeued
started_from=$(committed)
on_time_limit() {{
    echo "fathom: time-limit signal at $(date +%s.%N): asking the ranks to checkpoint and stop"
    echo "the time limit of Slurm job $SLURM_JOB_ID is {lead} s away" > "$stop_request.tmp"
    mv "$stop_request.tmp" "$stop_request"
}}
trap on_time_limit {TIME_LIMIT_SIGNAL}
srun --nodes={need.nodes} --ntasks-per-node=1 --kill-on-bad-exit=0 \\
    --output={shlex.quote(str(run_dir.logs_dir))}/agent-node%n.log --open-mode=append \\
    bash {shlex.quote(str(run_dir.slurm_agent_script))} &
step=$!
# `wait` returns early when a trapped signal arrives; wait again while the step runs.
while true; do
    wait "$step"
    status=$?
    kill -0 "$step" 2>/dev/null || break
done
if [ -e "$stop_request" ] && [ "$status" -eq {AGENT_STOPPED} ]; then
    now=$(committed)
    if [ "$now" -gt "$started_from" ]; then
        echo "fathom: the ranks checkpointed step $now for the time limit (the job started from step $started_from); requeueing"
        scontrol requeue "$SLURM_JOB_ID" && exit 0
        echo "fathom: scontrol requeue failed: the run ends with this job"
    fi
    echo "fathom: no checkpoint since the job started (step $started_from): not requeued"
fi
exit "$status"
"""
    return "\n".join(lines) + body


def write_scripts(run: Run, options: SlurmOptions, launch: run_agents.Launch) -> Path:
    """Writes the batch and agent scripts into the run's folder (readable by the owner only:
    they hold the node tokens); returns the batch script."""
    run_dir = run.run_dir
    for path, text in ((run_dir.slurm_agent_script, agent_script(run, launch)), (run_dir.slurm_job_script, batch_script(run, options))):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.chmod(0o600)
        tmp.replace(path)
    return run_dir.slurm_job_script


def submit(script: Path) -> str:
    """sbatch the script; returns the job id."""
    out = _run(["sbatch", "--parsable", str(script)], timeout=SBATCH_TIMEOUT_S).strip()
    job_id = out.split(";", 1)[0]  # "<id>;<cluster>" on a federation
    if not job_id.isdigit():
        raise SlurmError(f"sbatch answered {out!r}, not a job id")
    return job_id


def cancel(job_id: str) -> None:
    """scancel the job (SIGTERM to its steps, SIGKILL after the cluster's KillWait); a job that
    already ended is no error."""
    try:
        _run(["scancel", job_id])
    except SlurmError as exc:
        if "Invalid job id" not in str(exc) and "already completing or completed" not in str(exc):
            raise


# --- What Slurm says of the jobs -------------------------------------------------------------

_SQUEUE_FORMAT = "%i|%j|%T|%r|%P|%Q"


def jobs() -> dict[str, Job]:
    """Every job the controller still holds (pending, running, and those that ended less than
    MinJobAge ago), by id: one squeue."""
    found: dict[str, Job] = {}
    for line in _run(["squeue", "--states=all", "--noheader", f"--format={_SQUEUE_FORMAT}"]).splitlines():
        parts = line.split("|")
        if len(parts) != 6:
            continue
        job_id, name, state, reason, partition, priority = (p.strip() for p in parts)
        found[job_id] = Job(job_id, name, state, reason, partition, int(priority) if priority.isdigit() else 0)
    return found


def accounting(job_id: str) -> Job | None:
    """The job as sacct remembers it, once squeue no longer has it; None where the site keeps
    no accounting or it has no record."""
    try:
        out = _run(["sacct", "--noheader", "--parsable2", "--allocations", "--jobs", job_id, "--format=JobID,JobName,State,Reason"])
    except SlurmError:
        return None  # accounting disabled ("Slurm accounting storage is disabled") or unreachable
    for line in out.splitlines():
        parts = line.split("|")
        if len(parts) == 4 and parts[0] == job_id:
            # sacct says "CANCELLED by 0": the state is the first word.
            return Job(job_id, parts[1], parts[2].split()[0] if parts[2] else "UNKNOWN", parts[3] or "None")
    return None


def queue_position(job: Job, all_jobs: dict[str, Job]) -> int:
    """1 + the pending jobs of its partition that Slurm would start first (higher priority,
    then the older id)."""
    ahead = [
        other for other in all_jobs.values()
        if other.pending and other.partition == job.partition and other.id != job.id
        and (other.priority, -int(other.id)) > (job.priority, -int(job.id))
    ]  # fmt: skip
    return 1 + len(ahead)


def partitions() -> list[str]:
    """The cluster's partitions (sinfo), without the default's mark."""
    return sorted({p.strip().rstrip("*") for p in _run(["sinfo", "--noheader", "--format=%P"]).split() if p.strip()})


def reason_words(reason: str) -> str:
    """Slurm's reason code, with the common ones spelled out (Slurm's code kept in brackets by
    the caller); the rest as Slurm writes them."""
    return {
        "Resources": "waiting for resources (the nodes it needs are busy)",
        "Priority": "waiting behind jobs of higher priority",
        "Dependency": "waiting for a job it depends on",
        "QOSMaxJobsPerUserLimit": "its QoS allows no more running jobs for this user",
        "AssocMaxJobsLimit": "its account allows no more running jobs",
        "PartitionTimeLimit": "its time limit is above the partition's",
        "ReqNodeNotAvail": "a node it needs is not available",
        "BeginTime": "waiting for its start time",
        "JobHeldAdmin": "held by an administrator",
        "JobHeldUser": "held",
    }.get(reason, reason)
