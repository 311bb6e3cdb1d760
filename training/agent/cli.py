"""`python -m training.agent`'s command line: parse it, build the node agent with its reporter
and log shipper (`training.agent.node_agent`), run it, report how it ended; the exit status is
its `ExitCode`."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import sys
from pathlib import Path
from types import FrameType

from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from training.agent import node_agent
from training.agent.log_shipper import LogShipper, ShipperConfig
from training.agent.node_agent import AgentConfig, CancelRequested, ExitCode, NodeAgent, interrupted
from training.agent.uplink import Reporter, ReporterConfig
from training.checkpoint_storage import latest_committed_step
from training.config import NodePlan
from training.ports import listen_port

logger = logging.getLogger("fathom.agent")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m training.agent", description=node_agent.__doc__.split("\n\n")[0] if node_agent.__doc__ else None)
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT; default: a free local port (one node)")
    parser.add_argument("--host-store", choices=("auto", "yes", "no"), default="auto", help="auto: node 0 hosts it")
    parser.add_argument("--local-addr", default=None, help="address other nodes reach this one at")
    parser.add_argument(
        "--run-id", default=None, help="rendezvous id shared by the run's agents; default: run folder name"
    )
    parser.add_argument("--events-url", default=None)
    parser.add_argument("--run-token", default=None)
    parser.add_argument(
        "--logs-url", default=None,
        help="where to ship the logs of this host's run folder (a host the control plane cannot read)",
    )  # fmt: skip
    parser.add_argument("--entrypoint", default="training.train", help="module each rank runs with --spec/--run-dir")
    parser.add_argument("--no-standby", action="store_true", help="start every rank cold (no warm standbys)")
    parser.add_argument("--rdzv-last-call", type=float, default=AgentConfig.rdzv_last_call_timeout)
    parser.add_argument("--rdzv-join-timeout", type=float, default=AgentConfig.rdzv_join_timeout)
    parser.add_argument(
        "--sigterm", choices=("cancel", "stop"), default="cancel",
        help="stop: SIGTERM without the cancel marker ends this job, not the run (a scheduler such as Slurm sent it)",
    )  # fmt: skip
    parser.add_argument(
        "--stop-requests", action="store_true",
        help="the ranks look for the run folder's stop request at every step (a scheduler that preempts asks there); "
        "implied by --sigterm stop",
    )  # fmt: skip
    return parser.parse_args(argv)


def _is_loopback(endpoint: str) -> bool:
    host = endpoint.rsplit(":", 1)[0]
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


def _build(args: argparse.Namespace, plan: NodePlan) -> tuple[AgentConfig, Reporter, NodeAgent]:
    run_dir = args.run_dir.resolve()
    single = args.rdzv_endpoint is None
    config = AgentConfig(
        run_dir=run_dir,
        spec_file=args.spec.resolve(),
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint or f"127.0.0.1:{listen_port()}",
        host_store=args.host_store == "yes" or (args.host_store == "auto" and (single or args.node_rank == 0)),
        # All agents of a run on one machine (a loopback endpoint) reach each other on loopback;
        # elsewhere the host's FQDN is what torch advertises unless --local-addr says otherwise.
        local_addr=args.local_addr or ("127.0.0.1" if single or _is_loopback(args.rdzv_endpoint) else None),
        run_id=args.run_id or run_dir.name,
        entrypoint=args.entrypoint,
        warm_standby=not args.no_standby,
        rdzv_last_call_timeout=args.rdzv_last_call,
        rdzv_join_timeout=args.rdzv_join_timeout,
        sigterm_stops=args.sigterm == "stop",
        stop_requests=args.stop_requests or args.sigterm == "stop",
    )
    config.node_dir.path.mkdir(parents=True, exist_ok=True)
    if config.stop_requests and not config.sigterm_stops:
        # A stop request older than this start was the last launch's (a preempted run resumes in
        # its folder); a Slurm job's batch script removes its own before it starts the agents.
        config.folder.stop_request.unlink(missing_ok=True)
    reporter = Reporter(
        ReporterConfig(
            source=f"node-{config.node_rank}",
            spool=config.node_dir,
            events_url=args.events_url,
            run_token=args.run_token,
            tail_files=(config.node_dir.events_file,),
        )
    )
    rdzv = get_rendezvous_handler(
        RendezvousParameters(
            backend="c10d",
            endpoint=config.rdzv_endpoint,
            run_id=config.run_id,
            min_nodes=plan.nodes.min,
            max_nodes=plan.nodes.max,
            local_addr=config.local_addr,
            is_host=config.host_store,
            join_timeout=config.rdzv_join_timeout,
            last_call_timeout=config.rdzv_last_call_timeout,
            keep_alive_interval=config.rdzv_keep_alive_interval,
            keep_alive_max_attempt=config.rdzv_keep_alive_max_attempt,
        )
    )
    worker_spec = WorkerSpec(
        role="trainer",
        local_world_size=plan.nproc_per_node,
        rdzv_handler=rdzv,
        entrypoint=sys.executable,
        args=("-m", config.entrypoint),
        max_restarts=plan.nodes.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
    )
    return config, reporter, NodeAgent(config, plan, reporter, worker_spec)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = _parse_args(argv)
    try:
        plan = NodePlan.from_json(args.spec.read_text())
    except (OSError, ValueError) as exc:  # SpecError is a ValueError
        print(f"fathom agent: {args.spec}: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    # Without this, restarted ranks meet stale keys in the shared rendezvous store (seen: gloo
    # connectFullMesh failures and hangs in 6 of 17 restarts); with it, rank 0 runs its own store.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"

    cancelling = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal cancelling
        if not cancelling:  # the first one cancels; repeats must not interrupt the clean-up
            cancelling = True
            raise CancelRequested

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    try:
        config, reporter, agent = _build(args, plan)
    except CancelRequested:
        return ExitCode.CANCELLED
    reporter.start()
    shipper = None
    if args.logs_url and args.run_token:
        shipper = LogShipper(
            ShipperConfig(
                logs_url=args.logs_url, run_token=args.run_token, logs_dir=config.folder.logs_dir,
                node=config.node_dir, node_rank=config.node_rank, address=config.local_addr or socket.gethostname(),
            )
        )  # fmt: skip
        shipper.start()
    reporter.emit(
        "agent_started",
        {
            "node": config.node_rank,
            "host": config.started.host_name,  # as in rendezvous
            "pid": os.getpid(),
            "nproc": plan.nproc_per_node,
            "nodes": {"min": plan.nodes.min, "max": plan.nodes.max},
            "max_restarts": plan.nodes.max_restarts,
            "rdzv_endpoint": config.rdzv_endpoint,
        },
    )
    try:
        outcome = agent.execute()
    except CancelRequested:  # arrived during the clean-up of another outcome
        outcome = interrupted(config, latest_committed_step(config.run_dir, plan.storage))
    # The ranks' in-memory snapshots on this host are of no use once its agent is gone.
    shutil.rmtree(config.folder.memory_snapshot_dir, ignore_errors=True)
    reporter.emit(outcome.kind, outcome.data)
    if not reporter.close(flush_timeout=config.report_flush_timeout):
        logger.warning(
            "%d events not delivered (%s); they stay in %s",
            reporter.undelivered,
            reporter.last_error,
            reporter.spool.path,
        )
    logger.info("run %s: %s %s", config.run_id, outcome.kind, outcome.data)
    if shipper is not None and not shipper.close(timeout=config.report_flush_timeout):
        logger.warning("the last log lines were not shipped (%s); they stay in %s", shipper.last_error, config.folder.logs_dir)
    return outcome.code


if __name__ == "__main__":
    sys.exit(main())
