"""Starting work on machines: the one home of how a run's node agents and a deployment's replica
supervisors reach a machine.

- `run_agents`: a launch's folder, tokens and spec; its agents started as detached local
  processes or as start tasks on the queues of the hosts placement chose (`send_to_host`, the
  transport to host workers), its rendezvous store on the control plane's machine, cancel and
  stop;
- `supervisors`: a deployment's supervisors, one here or one on each host placement gave some of
  its replicas, and their stop;
- `executors`: the one `Executor` interface (a run's submit, cancel, state; a deployment's
  start_supervisors, stop_supervisors, replicas_placed, replica_hosts) with its local, hosts and
  Slurm implementations, chosen by FATHOM_EXECUTOR;
- `slurm`, `slurm_options`: a launch as one sbatch job, and the options it is submitted with
  (checked as Django starts: `apps.py`).

Nothing here records a run's or a deployment's events or changes their status: `runs` and
`deployments` do.
"""
