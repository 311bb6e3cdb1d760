"""Run a deployment's vLLM replicas: start, probe, restart with backoff, drain and stop.

One `Supervisor` owns the replicas of one deployment. It is asyncio code meant to live in a
process of its own, started detached by the control plane:

    python -m serving.supervisor --config CONFIG_FILE     (DeploymentDir.config_file)

so that replicas outlive web and worker restarts. It publishes what it knows in two files of
the deployment's folder (`serving.state`), which any process can read without talking to it:

- the state file: each replica's url, port, pid, phase and restart count, rewritten atomically
  on every change and at least every `health_interval_s` (`updated_at` doubles as a heartbeat);
  `serving.router.StateFileReplicas` routes from it.
- the events file: one lifecycle event per line (`replica_starting`, `replica_ready`,
  `replica_died`, `replica_restarting`, `replica_stopped`), for the control plane to store as it
  stores run events.

SIGTERM (see `request_stop`) drains every replica, stops it and exits. SIGHUP (see
`serving.deployment_config.request_change`) re-reads the config file's LoRA adapters and replica
count: it loads or unloads adapters on the running replicas, starts the replicas added and
drains and stops the last ones when the count went down (an autoscaler's decision), restarting
none of the others.

A checkpoint on object storage (an export URL) is downloaded into this host's cache, checked,
before any replica starts (`serving.export_store`); replicas serve that local copy.

Each replica is its own session (process group), so stopping it also stops vLLM's engine-core
child; each is started through a small launcher that sets PR_SET_PDEATHSIG, so replicas die with
the supervisor even when it is killed with SIGKILL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from hostworker.started_environment import StartedEnvironment
from serving import export_store
from serving.deployment_config import DeploymentConfig, replica_gpus
from serving.replica_adapters import bring_to
from serving.replica_life import Life, engine_error, read_from, start_failure
from serving.replica_metrics import parse_prometheus
from serving.shipper import shipper_for
from serving.state import (
    DeploymentDir,
    DeploymentState,
    EventKind,
    Phase,
    ReplicaEvent,
    ReplicaState,
    append_event,
    signal_supervisor,
    write_state,
)
from serving.vllm import LaunchSpec, replica_launch
from training.field_error import FieldError
from training.ports import listen_port

# Run the replica's own argv after asking the kernel to SIGTERM it when its parent (this
# supervisor) dies; exit at once if the parent is already gone. execvp keeps the setting.
_PDEATHSIG_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "os.getppid() == int(sys.argv[1]) or os._exit(70)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def _kill_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class Supervisor:
    """Keeps `config.replicas` replicas running until `stop()`.

    `on_event` is called (in the event loop) with every lifecycle event; it must not block.
    """

    def __init__(self, config: DeploymentConfig, on_event: Callable[[ReplicaEvent], None] | None = None) -> None:
        self.config = config
        self._on_event = on_event
        self._state_dir = Path(config.state_dir)
        self._folder = DeploymentDir(self._state_dir)
        self._replicas = [ReplicaState(index=config.first_replica + i) for i in range(config.replicas)]
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        # Replicas being drained and stopped by `set_replicas`, by index: their lives end for good.
        self._retiring: set[int] = set()
        self._changed = asyncio.Event()
        self._client: httpx.AsyncClient | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        # The adapters replicas serve now (config.adapters until `set_adapters`), and one lock a
        # replica so that two changes never load onto it at once.
        self._adapters = dict(config.adapters)
        self._adapter_locks = {r.index: asyncio.Lock() for r in self._replicas}
        # On a CPU host the host worker names the cores of each slot it claimed for this
        # supervisor: replica i's engine threads run on slot i's.
        self._host_slot_binds = (
            tuple(",".join(map(str, sorted(cores))) for cores in StartedEnvironment.from_environ().slot_cores)
            if config.options.device == "cpu" and config.options.cpu_threads_bind == "auto"
            else ()
        )

    @property
    def replicas(self) -> list[ReplicaState]:
        return list(self._replicas)

    async def start(self) -> None:
        """Launch every replica and return; they become ready in the background."""
        for sub in ("logs", "tmp", "vllm-cache"):
            (self._state_dir / sub).mkdir(parents=True, exist_ok=True)
        # trust_env=False: a proxy from the environment must never see loopback probes.
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(5.0), trust_env=False)
        self._tasks = [asyncio.create_task(self._keep_running(r)) for r in self._replicas]
        self._heartbeat = asyncio.create_task(self._write_state_periodically())
        self._write_state()

    async def wait_ready(self, timeout_s: float) -> None:
        """Return once every replica is ready; raise TimeoutError naming the ones that are not."""
        deadline = time.monotonic() + timeout_s
        while not all(r.phase == "ready" for r in self._replicas):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                phases = {r.index: r.phase for r in self._replicas}
                raise TimeoutError(f"replicas not ready after {timeout_s} s: {phases}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    async def stop(self) -> None:
        """Drain every replica (stop routing, let in-flight requests finish up to
        `drain_timeout_s`), terminate it with its children, and return when all are gone."""
        self._stopping = True
        if self._client is None:  # never started: nothing runs, nothing to record
            return
        await asyncio.gather(*(self._stop_replica(r) for r in self._replicas))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._heartbeat:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        self._write_state()
        if self._client:
            await self._client.aclose()

    async def set_replicas(self, count: int, cpu_binds: tuple[str, ...] = ()) -> None:
        """Run `count` replicas from now on: start the ones added (on `cpu_binds`, the config's
        for the new count), or drain and stop the last ones and forget them."""
        self.config = dataclasses.replace(self.config, replicas=count, cpu_binds=cpu_binds or self.config.cpu_binds)
        if self._stopping or self._client is None:
            return
        kept = [r for r in self._replicas if r.index not in self._retiring]
        for index in range(len(kept), count):
            replica = ReplicaState(index=self.config.first_replica + index)
            self._replicas.append(replica)
            self._adapter_locks[replica.index] = asyncio.Lock()
            self._tasks.append(asyncio.create_task(self._keep_running(replica)))
        retiring = kept[count:]
        self._retiring |= {r.index for r in retiring}
        self._write_state()
        await asyncio.gather(*(self._stop_replica(r) for r in retiring))
        for replica in retiring:
            self._replicas.remove(replica)
            self._retiring.discard(replica.index)
        if retiring:
            self._write_state()
            self._changed.set()

    def _ending(self, replica: ReplicaState) -> bool:
        """True once the replica is to stop for good: the supervisor stops, or it was scaled away."""
        return self._stopping or replica.index in self._retiring

    async def set_adapters(self, adapters: dict[str, str]) -> None:
        """Serve these adapters from now on: ready replicas load and unload theirs now, starting
        ones when they are ready, later ones from the start."""
        self._adapters = dict(adapters)
        await asyncio.gather(
            *(self._sync_adapters(r) for r in self._replicas if r.phase in ("ready", "unhealthy") and r.url)
        )

    async def _sync_adapters(self, replica: ReplicaState) -> None:
        assert self._client is not None and replica.url
        async with self._adapter_locks[replica.index]:
            change = await bring_to(self._client, replica.url, replica.adapters, self._adapters)
        if change:
            failed = "; ".join(f"{name}: {why}" for name, why in change.failed.items())
            self._emit(
                "replica_adapters", replica, loaded=change.loaded, unloaded=change.unloaded,
                message=f"could not load or unload {failed}" if failed else "",
            )  # fmt: skip
            self._write_state()

    # -- one replica's life ---------------------------------------------------------------

    async def _keep_running(self, replica: ReplicaState) -> None:
        failures_in_a_row = 0
        # How each start in a row ended: (why it was killed, else its exit status; its error line).
        failed_starts: list[tuple[str | int, str]] = []
        while not self._ending(replica):
            life = await self._one_life(replica)
            if life is None:  # the supervisor is stopping
                return
            if life.stayed_ready:
                failures_in_a_row = 0
            replica.last_exit_code = life.code
            self._emit("replica_died", replica, exit_code=life.code, message=life.message)
            if life.became_ready:
                failed_starts = []
            elif life.code is not None:  # a start that found no free port is no start of vLLM
                failed_starts = [*failed_starts, (life.killed_because or life.code, life.error)]
            last = failed_starts[-self.config.failed_starts_to_give_up :]
            if len(last) == self.config.failed_starts_to_give_up and len(set(last)) == 1:
                # The same death at every start: a restart would only repeat it.
                self._set_phase(
                    replica, "failed", event="replica_failed",
                    event_data={"exit_code": life.code, "message": start_failure(len(last), life)},
                )  # fmt: skip
                return
            delay = min(self.config.restart_backoff_s * 2**failures_in_a_row, self.config.restart_backoff_max_s)
            failures_in_a_row += 1
            replica.restarts += 1
            self._set_phase(replica, "restarting", event="replica_restarting", event_data={"delay_s": delay})
            await asyncio.sleep(delay)

    async def _one_life(self, replica: ReplicaState) -> Life | None:
        """Starts the replica and watches it until it dies; returns how it ended, or None when
        the supervisor stops meanwhile."""
        try:
            port = self._replica_port(replica)
        except OSError as exc:
            return Life(code=None, message=f"not started: {exc}", error=str(exc))
        proc: asyncio.subprocess.Process | None = None
        log_path = self._folder.replica_log(replica.index)
        log_start = log_path.stat().st_size if log_path.exists() else 0
        try:
            proc, launch = await self._spawn(replica, port)
            if self._ending(replica):  # stop() ran while the process was being created
                await self._terminate(proc, grace_s=self.config.stop_grace_s)
                return None
            message, became_ready, stayed_ready = "", False, False
            if await self._wait_healthy(replica, proc, launch):
                # Ready once it has generated: an engine that dies on its first request (a
                # kernel that refuses the dtype, an instruction the CPU may not run) dies here,
                # before any router sends it a user's request.
                if await self._generates(launch.url):
                    became_ready = True
                    await self._sync_adapters(replica)  # changed while it started
                    self._set_phase(replica, "ready", event="replica_ready", ready_at=time.time())
                    message = await self._watch(replica, proc, launch)
                    stayed_ready = bool(replica.ready_at and time.time() - replica.ready_at >= self.config.backoff_reset_s)
                elif proc.returncode is None and not self._ending(replica):
                    message = f"answered /health but generated no token within {self.config.liveness_timeout_s:g} s; killed. "
                    await self._terminate(proc, grace_s=0)
            elif proc.returncode is None and not self._ending(replica):
                message = f"not healthy after {self.config.ready_timeout_s} s; killed. "
                await self._terminate(proc, grace_s=0)
            # While stopping, stop() terminates the process; this only waits for it.
            code = await proc.wait()
            _kill_group(proc.pid, signal.SIGKILL)  # orphans of a replica killed from outside
            if self._ending(replica):
                return None
            return Life(
                code=code, message=f"{message}exit code {code}", killed_because=message, became_ready=became_ready,
                stayed_ready=stayed_ready, error="" if became_ready else engine_error(read_from(log_path, log_start)),
            )  # fmt: skip
        finally:
            # Cancelled or failed mid-way: never leave a replica running without a supervisor.
            if proc is not None and proc.returncode is None:
                _kill_group(proc.pid, signal.SIGKILL)

    def _replica_port(self, replica: ReplicaState) -> int:
        """A port of the configured range that nothing on the host holds now and no other replica
        of this supervisor was given: a replica binds its port only once its model is loaded, so
        two starting together must not be handed the same one. Raises OSError when none is left."""
        first, last = self.config.ports
        given = {r.port for r in self._replicas if r is not replica and r.port}
        candidates = [p for p in range(first, last + 1) if p not in given]
        if not candidates:
            raise OSError(f"every port in {first}-{last} is given to another replica of this supervisor")
        replica.port = listen_port(candidates, self.config.host)
        return replica.port

    async def _spawn(self, replica: ReplicaState, port: int) -> tuple[asyncio.subprocess.Process, LaunchSpec]:
        cfg = self.config
        local = replica.index - cfg.first_replica
        binds = cfg.cpu_binds or self._host_slot_binds
        bind = binds[local % len(binds)] if binds else None
        gpus = (
            replica_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), local, cfg.options.tensor_parallel_size)
            if cfg.options.device == "cuda"
            else None
        )
        launch = replica_launch(
            cfg.options, cfg.export,
            served_model_name=cfg.name, port=port, python=cfg.python,
            state_dir=self._state_dir, host=cfg.host, cpu_threads_bind=bind, gpus=gpus, adapters=self._adapters,
        )  # fmt: skip
        Path(launch.env["TMPDIR"]).mkdir(parents=True, exist_ok=True)  # may lie outside state_dir
        log_path = self._folder.replica_log(replica.index)
        argv = launch.argv
        if sys.platform == "linux":
            argv = [cfg.python, "-c", _PDEATHSIG_LAUNCHER, str(os.getpid()), *argv]
        with log_path.open("ab") as log:
            log.write(f"\n=== fathom: starting replica {replica.index} on port {launch.port}\n".encode())
            log.flush()
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **launch.env}, start_new_session=True,
            )  # fmt: skip
        self._procs[replica.index] = proc
        self._set_phase(
            replica, "starting", event="replica_starting",
            port=launch.port, pid=proc.pid, url=launch.url, log=str(log_path), started_at=time.time(), ready_at=None,
            adapters=sorted(self._adapters),
        )  # fmt: skip
        return proc, launch

    async def _probe(self, url: str) -> bool:
        assert self._client is not None
        try:
            response = await self._client.get(f"{url}/health", timeout=self.config.health_interval_s * 2)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _wait_healthy(self, replica: ReplicaState, proc: asyncio.subprocess.Process, launch: LaunchSpec) -> bool:
        """True once /health answers 200; False if the process exits or `ready_timeout_s` passes."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        while proc.returncode is None and not self._ending(replica) and time.monotonic() < deadline:
            if await self._probe(launch.url):
                return True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 0.5)
        return False

    async def _generates(self, url: str) -> bool:
        """True when the replica produces one token within `liveness_timeout_s`."""
        assert self._client is not None
        body = {"model": self.config.name, "prompt": "ping", "max_tokens": 1, "temperature": 0}
        try:
            response = await self._client.post(
                f"{url}/v1/completions", json=body, timeout=self.config.liveness_timeout_s
            )
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _watch(self, replica: ReplicaState, proc: asyncio.subprocess.Process, launch: LaunchSpec) -> str:
        """Probe a ready replica until its process exits, the supervisor stops, or it has been
        unhealthy for `restart_unhealthy_after_s`; in that last case kill it and say why."""
        failed = 0
        unhealthy_since: float | None = None
        last_liveness = time.monotonic()
        liveness: asyncio.Task[bool] | None = None
        generates = True  # the last liveness answer holds until the next one
        try:
            while proc.returncode is None and not self._ending(replica):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), self.config.health_interval_s)
                if proc.returncode is not None or self._ending(replica):
                    break
                if liveness is None and time.monotonic() - last_liveness >= self.config.liveness_interval_s:
                    liveness = asyncio.create_task(self._generates(launch.url))
                if liveness is not None and liveness.done():
                    generates = liveness.result()
                    liveness, last_liveness = None, time.monotonic()
                healthy = await self._probe(launch.url) and generates
                if healthy:
                    failed, unhealthy_since = 0, None
                    if replica.phase == "unhealthy":
                        self._set_phase(replica, "ready", event="replica_ready", event_data={"message": "healthy again"})
                    continue
                failed += 1
                if failed >= self.config.unhealthy_after and replica.phase == "ready":
                    unhealthy_since = time.monotonic()
                    self._set_phase(
                        replica, "unhealthy", event="replica_unhealthy",
                        event_data={"message": f"{failed} failed probes (/health or one-token generation)"},
                    )  # fmt: skip
                if (
                    unhealthy_since is not None
                    and time.monotonic() - unhealthy_since >= self.config.restart_unhealthy_after_s
                ):
                    await self._terminate(proc, grace_s=0)
                    return f"unhealthy for {self.config.restart_unhealthy_after_s:g} s; killed. "
        finally:
            if liveness is not None:
                liveness.cancel()
        if self._ending(replica):
            # stop() owns the process from here; wait for it so _keep_running returns cleanly.
            await proc.wait()
        return ""

    async def _stop_replica(self, replica: ReplicaState) -> None:
        proc = self._procs.get(replica.index)
        if proc is not None and proc.returncode is None:
            if replica.phase == "ready" and replica.url:
                self._set_phase(replica, "draining")
                await self._drain(replica.url)
            await self._terminate(proc, grace_s=self.config.stop_grace_s)
        self._set_phase(replica, "stopped", event="replica_stopped")

    async def _drain(self, url: str) -> None:
        """Wait until the replica reports no running or waiting request. Routers stop sending new
        requests once state.json says `draining`; this waits out the ones already sent."""
        assert self._client is not None
        deadline = time.monotonic() + self.config.drain_timeout_s
        # Routers re-read state.json when its mtime changes; give them one probe interval to see
        # the draining phase before counting, so a request they pick meanwhile is still counted.
        await asyncio.sleep(min(self.config.health_interval_s, self.config.drain_timeout_s))
        while time.monotonic() < deadline:
            try:
                text = (await self._client.get(f"{url}/metrics")).text
            except httpx.HTTPError:
                return
            samples = parse_prometheus(text)
            busy = sum(
                v
                for (name, _), v in samples.items()
                if name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
            )
            if busy == 0:
                return
            await asyncio.sleep(0.5)

    async def _terminate(self, proc: asyncio.subprocess.Process, grace_s: float) -> None:
        """SIGTERM the replica's process group, SIGKILL it after `grace_s`."""
        _kill_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            pass
        _kill_group(proc.pid, signal.SIGKILL)
        await proc.wait()

    # -- state and events -------------------------------------------------------------------

    def _set_phase(
        self,
        replica: ReplicaState,
        phase: Phase,
        *,
        event: EventKind | None = None,
        event_data: dict[str, Any] | None = None,
        **changes: Any,
    ) -> None:
        """Moves the replica to `phase` (with `changes` to its fields) and announces it with
        `event`. The event is appended before the state file says the phase, so a reader that
        sees the phase finds the event that announced it (a test read the state of two ready
        replicas, then an events file without the second one's `replica_ready`)."""
        replica.phase = phase
        for name, value in changes.items():
            setattr(replica, name, value)
        if event is not None:
            self._emit(event, replica, **(event_data or {}))
        self._write_state()
        self._changed.set()

    def _emit(self, kind: EventKind, replica: ReplicaState, **extra: Any) -> None:
        event = ReplicaEvent(
            kind=kind, deployment=self.config.name, replica=replica.index, at=time.time(),
            port=replica.port, pid=replica.pid, restarts=replica.restarts, **extra,
        )  # fmt: skip
        append_event(self._folder, event)
        if self._on_event is not None:
            self._on_event(event)

    def state(self) -> DeploymentState:
        return DeploymentState(
            deployment=self.config.name,
            supervisor_pid=os.getpid(),
            updated_at=time.time(),
            stopping=self._stopping,
            replicas=[dataclasses.replace(r) for r in self._replicas],
        )

    def _write_state(self) -> None:
        write_state(self._folder, self.state())

    async def _write_state_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            self._write_state()


# -- for the control plane: a detached supervisor per deployment ------------------------------


def launch_detached(config: DeploymentConfig, python: str = sys.executable) -> int:
    """Start `python -m serving.supervisor` for this deployment in its own session and return its
    pid. It keeps running when the caller exits; stop it with `request_stop`."""
    import subprocess

    config_path = config.write()
    log = DeploymentDir(Path(config.state_dir)).supervisor_log.open("ab")
    repo_root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo_root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(
        [python, "-m", "serving.supervisor", "--config", str(config_path)],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
    )  # fmt: skip
    log.close()
    return proc.pid


def request_stop(state_dir: str | Path) -> bool:
    """Ask a detached supervisor to drain and stop its replicas. False if none is running."""
    return signal_supervisor(state_dir, signal.SIGTERM)


async def _serve(config: DeploymentConfig, config_file: Path) -> None:
    supervisor = Supervisor(config, on_event=lambda e: print(json.dumps(e.to_dict()), flush=True))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    changes: set[asyncio.Task[None]] = set()  # held until done: the loop keeps only weak references

    def config_changed() -> None:
        try:
            changed = DeploymentConfig.from_dict(json.loads(config_file.read_text()))
        except (OSError, ValueError, FieldError) as exc:
            print(f"fathom: SIGHUP, but {config_file} could not be read: {exc}", flush=True)
            return
        for change in (
            supervisor.set_adapters(changed.adapters), supervisor.set_replicas(changed.replicas, changed.cpu_binds),
        ):  # fmt: skip
            task = loop.create_task(change)
            changes.add(task)
            task.add_done_callback(changes.discard)

    loop.add_signal_handler(signal.SIGHUP, config_changed)
    await supervisor.start()
    if config.owner_pid is not None:
        await _until_stopped_or_orphaned(stop, config.owner_pid, config.health_interval_s)
    else:
        await stop.wait()
    await supervisor.stop()


async def _until_stopped_or_orphaned(stop: asyncio.Event, owner_pid: int, interval_s: float) -> None:
    """Return when asked to stop or once the owner process is gone (killed, timed out, crashed:
    then nobody would ever ask)."""
    while _process_exists(owner_pid):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
            return
    print(f"fathom: deployment owner {owner_pid} is gone; stopping its replicas", flush=True)


def _process_exists(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, its parent not yet told) counts as gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] != "Z"


def export_cache_root(config: DeploymentConfig) -> Path:
    """Where this host keeps downloaded exports: its own data folder's cache, else the
    deployment's folder's."""
    return StartedEnvironment.from_environ().cache_root(Path(config.state_dir) / "cache")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run one deployment's vLLM replicas until SIGTERM.")
    parser.add_argument("--config", required=True, help="the deployment's config file (DeploymentConfig as JSON)")
    parser.add_argument(
        "--state-dir", default="", help="this supervisor's folder, in place of the config's (its host's own folder)"
    )
    args = parser.parse_args(argv)
    config = DeploymentConfig.from_dict(json.loads(Path(args.config).read_text()))
    if args.state_dir:
        config = dataclasses.replace(config, state_dir=args.state_dir)
    # Started before the export's download, so a failed download's line reaches the control plane.
    shipper = shipper_for(Path(config.state_dir), config.ship_url, config.ship_token, config.ship_host)
    try:
        try:
            served = export_store.local_copy(config.export, export_cache_root(config))
        except export_store.ExportStoreError as exc:
            print(f"fathom: deployment {config.name}: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        asyncio.run(_serve(dataclasses.replace(config, export=served), Path(args.config)))
    finally:
        if shipper is not None:
            # The stopped replicas' state and the last log lines; a control plane away this long
            # finds the deployment's hosts report no supervisor instead.
            sys.stdout.flush()
            sys.stderr.flush()
            shipper.close(timeout=30.0)


if __name__ == "__main__":
    main()
