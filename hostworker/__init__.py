"""The host worker: one per machine that trains or serves (`python -m hostworker`).

A small Celery worker of its own, with no Django (a GPU host has no database and no settings),
consuming the queue `host.<name>`. It joins the control plane with the cluster's join token and
heartbeats its address, devices, labels and what it runs; its tasks start and stop a run's node
agent, a rendezvous store, or a replica supervisor, each by module (`python -m training.agent`,
`python -m serving.supervisor`): it imports neither training/ nor serving/.
"""
