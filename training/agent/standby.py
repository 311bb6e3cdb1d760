"""A warm spare rank: imports the trainer ahead of time, then becomes a rank when told to.

    python -m training.agent.standby training.train      (started by the node agent, never by hand)

Most of a restart on a CPU host is Python importing torch and the trainer (3-5 s on a loaded
2-core machine), time in which the whole job stands still. The agent therefore keeps one standby
per local rank: a process that has done those imports and waits on stdin. On a (re)start the
agent writes one JSON line, `{"env": {...}, "argv": [...], "log": "..."}`; the standby points its
stdout and stderr at the rank's log, takes the environment (rank, world size, master address are
only known after the rendezvous) and runs the entry point as `__main__`, exactly as
`python -m ENTRYPOINT ARGV...` would. End of input without a line means "not needed": it exits.

What torch reads from the environment at import time (OMP_NUM_THREADS) is the same for every rank
and is set when the standby starts.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys


def main() -> None:
    entrypoint = sys.argv[1]
    importlib.import_module(entrypoint)  # the expensive part (torch, the trainer), done while nobody waits
    # runpy runs the entry point afresh as __main__; left in sys.modules it would warn that the
    # module was imported before it ran. What it imported stays loaded.
    del sys.modules[entrypoint]
    line = sys.stdin.readline()
    if not line:
        os._exit(0)
    order = json.loads(line)
    log = os.open(order["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(order["env"])
    sys.argv = [entrypoint, *order["argv"]]
    runpy.run_module(entrypoint, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
