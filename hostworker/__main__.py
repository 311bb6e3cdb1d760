"""`python -m hostworker [--name N] [--address A] [--labels k=v,...] [--cpu-slots N]`

Joins the control plane at FATHOM_PUBLIC_URL with FATHOM_JOIN_TOKEN (from the environment only,
so it never shows in a process list), heartbeats from a thread, and consumes `host.<name>`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

FLAGS = {
    "name": "FATHOM_HOST_NAME",
    "address": "FATHOM_HOST_ADDRESS",
    "labels": "FATHOM_HOST_LABELS",
    "cpu_slots": "FATHOM_HOST_CPU_SLOTS",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hostworker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", help="default: the host name; the queue is host.<name>")
    parser.add_argument("--address", help="where other hosts reach this one; default: the route to the control plane")
    parser.add_argument("--labels", help="k=v,k=v")
    parser.add_argument("--cpu-slots", help="slots a CPU host offers; default: its cores")
    args = parser.parse_args(argv)
    for flag, variable in FLAGS.items():
        if getattr(args, flag) is not None:
            os.environ[variable] = str(getattr(args, flag))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    # Read after the flags are in the environment: the app and its tasks configure from it.
    from hostworker.app import app, config
    from hostworker.heartbeat import Heartbeat, JoinRefused
    from hostworker.tasks import processes

    if not config.join_token:
        logging.error("FATHOM_JOIN_TOKEN is not set: a host joins only with the cluster's join token")
        return 2
    heartbeat = Heartbeat(config, processes)
    while True:
        try:
            heartbeat.register()
            break
        except JoinRefused as exc:
            logging.error("%s", exc)
            return 2
        except OSError as exc:
            # The control plane may be starting, or restarting: a host keeps asking to join.
            logging.warning(
                "cannot reach %s yet (%s); trying again in %.0f s", config.control_url, exc, config.heartbeat_s
            )
            time.sleep(config.heartbeat_s)
    heartbeat.start()
    try:
        app.worker_main(
            ["worker", "-Q", config.queue, "--pool=solo", "--loglevel=INFO", "-n", f"{config.name}@%h",
             "--without-gossip", "--without-mingle", "--without-heartbeat"]
        )  # fmt: skip
    finally:
        heartbeat.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
