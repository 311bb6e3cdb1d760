"""The node agent: one process per host that runs the host's ranks and keeps the run alive.

`python -m training.agent` (started by the control plane's launcher). What only the agent runs:

- `node_agent`: torch's elastic agent with Fathom's restart budget, resize and cancel;
- `rank_processes`: ranks started so they die with the agent, logged, stopped as a group;
- `standby` (`python -m training.agent.standby`): warm spare ranks that have imported the trainer;
- `watchdog`: ranks judged running, done, or failed (exited or hung) from exits and heartbeats;
- `uplink`: every event spooled to disk and shipped to the control plane;
- `wakeup`: wakes the uplink when a rank writes an event;
- `rendezvous_store` (`python -m training.agent.rendezvous_store`): a multi-node run's store.

What the ranks share with it (the run folder, the rank environment, heartbeats, faults, hooks)
stays at training/'s root with the rank-side code.
"""
