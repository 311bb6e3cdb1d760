"""Fixtures for the serving tests: a tiny Llama checkpoint, the vLLM environment, and running
deployments (a detached supervisor with real vLLM replicas, plus the standalone router app)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from serving.deployment_config import DeploymentConfig
from serving.state import read_state
from serving.supervisor import launch_detached, request_stop
from serving.vllm import ReplicaOptions
from tests.ports import free_port
from tools.tiny_checkpoint import build_tiny_llama

REPO = Path(__file__).resolve().parents[2]
# The checkpoint takes ~20 s to build; it is reused across runs while its spec is unchanged.
CHECKPOINT_CACHE = Path(os.environ.get("FATHOM_TEST_CACHE", Path.home() / ".cache" / "fathom" / "test-checkpoints"))


def process_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(condition, timeout_s: float, what: str, interval_s: float = 0.25):  # type: ignore[no-untyped-def]
    """Poll `condition` until it returns something truthy; fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture(scope="session")
def tiny_checkpoint() -> Path:
    return build_tiny_llama(CHECKPOINT_CACHE / "tiny-llama")


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vLLM environment's interpreter: $FATHOM_VLLM_PYTHON, else what tools/vllm_env.sh
    builds (or finds already built)."""
    given = os.environ.get("FATHOM_VLLM_PYTHON")
    if given and Path(given).exists() and (Path(given).parent.parent / ".fathom-ready").exists():
        return given
    out = subprocess.run(
        ["bash", str(REPO / "tools" / "vllm_env.sh")], check=True, capture_output=True, text=True, timeout=1200
    )
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def quantize_python() -> str:
    """The quantizer environment's interpreter (llmcompressor): $FATHOM_QUANTIZE_PYTHON, else
    what tools/quantize_env.sh builds (or finds already built)."""
    given = os.environ.get("FATHOM_QUANTIZE_PYTHON")
    if given and Path(given).exists() and (Path(given).parent.parent / ".fathom-ready").exists():
        return given
    out = subprocess.run(
        ["bash", str(REPO / "tools" / "quantize_env.sh")], check=True, capture_output=True, text=True, timeout=1200
    )
    return out.stdout.strip().splitlines()[-1]


@dataclass
class RunningDeployment:
    config: DeploymentConfig
    supervisor_pid: int
    router_url: str  # the standalone router app (serving.app) in front of the replicas
    router_pid: int

    @property
    def state_dir(self) -> Path:
        return Path(self.config.state_dir)

    def ready_urls(self) -> list[str]:
        state = read_state(self.state_dir)
        return [r.url for r in state.replicas if r.phase == "ready" and r.url] if state else []


ERROR_MARKS = re.compile(r"ERROR|Error|Fatal|died|Segmentation|core dumped")


def _print_replica_errors(state_dir: Path, lines: int = 60) -> None:
    """Print the last error lines of each replica's log, for pytest to show beside the failure."""
    for log in sorted((state_dir / "logs").glob("replica-*.log")):
        errors = [line for line in log.read_text(errors="replace").splitlines() if ERROR_MARKS.search(line)]
        print(f"--- {log} (last {lines} error lines of {len(errors)})", *errors[-lines:], sep="\n")


def start_deployment(
    tmp: Path,
    checkpoint: Path,
    vllm_python: str,
    *,
    name: str,
    replicas: int,
    options: ReplicaOptions,
    cpu_binds: tuple[str, ...] = (),
) -> Iterator[RunningDeployment]:
    """Start a detached supervisor and a router app; yield once every replica is ready; stop
    both afterwards (and kill whatever is left, so a failed test leaks no replica)."""
    config = DeploymentConfig(
        name=name,
        export=str(checkpoint),
        state_dir=str(tmp / name),
        python=vllm_python,
        replicas=replicas,
        options=options,
        cpu_binds=cpu_binds,
        ready_timeout_s=300,
        health_interval_s=1.0,
        restart_backoff_s=0.5,
        drain_timeout_s=60,
    )
    pid = launch_detached(config, python=sys.executable)
    router_port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "serving.app", "--state-dir", config.state_dir, "--port", str(router_port)],
        cwd=REPO,
        stdout=(tmp / f"{name}-router.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:

        def all_ready() -> bool:
            assert process_alive(pid), f"supervisor exited; see {config.state_dir}/supervisor.log"
            state = read_state(config.state_dir)
            return state is not None and all(r.phase == "ready" for r in state.replicas)

        wait_until(all_ready, 300, f"{replicas} ready replicas")
        router_url = f"http://127.0.0.1:{router_port}"

        def router_up() -> bool:
            try:
                return httpx.get(f"{router_url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(router_up, 60, "the router app")
        yield RunningDeployment(config=config, supervisor_pid=pid, router_url=router_url, router_pid=router.pid)
    except BaseException:
        _print_replica_errors(Path(config.state_dir))  # a replica's root cause is only in its log
        raise
    finally:
        state = read_state(config.state_dir)
        request_stop(config.state_dir)
        deadline = time.monotonic() + 120
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        for replica in state.replicas if state else []:
            if replica.pid and process_alive(replica.pid):
                os.killpg(replica.pid, signal.SIGKILL)
        if process_alive(pid):
            os.killpg(pid, signal.SIGKILL)
        os.killpg(router.pid, signal.SIGTERM)
        router.wait(timeout=30)


def lora_checkpoint_on(base: Path, work: Path, rank: int = 8) -> Path:
    """The checkpoint of a one-process LoRA run of a few steps on the Hugging Face folder `base`,
    at a learning rate that moves its outputs well away from the base's."""
    from tests.training.test_architectures import spec_from
    from tools.check_parity import launch
    from training.config import LORA_TARGETS, LoraConfig, RunSpec
    from training.demo import corpus as demo_corpus
    from training.run_dir import RunDir

    work.mkdir(parents=True, exist_ok=True)
    spec = spec_from(base, dataset=str(demo_corpus.write(work / "corpus.txt", n_documents=300)))
    spec.lora = LoraConfig(rank=rank, alpha=2.0 * rank, targets=list(LORA_TARGETS))
    spec.train.steps, spec.train.warmup_steps, spec.train.checkpoint_interval = 6, 1, 6
    spec.train.lr = spec.train.min_lr = 0.05
    launch(RunSpec.from_dict(spec.to_dict()), work / "run", 600)
    checkpoint = RunDir(work / "run").latest_checkpoint()
    assert checkpoint is not None
    return checkpoint
