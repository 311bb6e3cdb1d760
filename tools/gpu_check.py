"""One prepared check of Fathom's training on a lent GPU: `python -m tools.gpu_check --out DIR`.

Five parts, each time-boxed and each in processes of its own, so a part that fails (a crash, a
hang, GPU memory run out, a compiler error) records why and the others still run:

- parity: the `tiny` recipe on cuda:0 against the same run on the CPU, fp32 and bf16, per-step loss;
- layouts: the multi-rank layouts one GPU allows. NCCL refuses two ranks on one GPU, so the
  layouts run as a control on CPU ranks over gloo, against the single-process CPU run;
- throughput: a Llama-shaped model of 1-3 B parameters, bf16 under FSDP2 at world size 1 (a
  `cpu:gloo,cuda:nccl` group, as a rank on a GPU host joins it), eager and torch.compile, with
  and without activation recomputation, against the bf16 matmul peak measured in this check;
- checkpoint: the step time right after an async checkpoint save against the steps without one;
- resume: `kill -9` of the training process mid-run, then a resume whose next 10 losses must
  equal, bit for bit, those of a run nobody touched (`train.deterministic`).

Parity, checkpoint and resume launch `python -m training.train` as a run would; throughput builds
its model with training/'s own pieces (`build_meta`, `apply_recompute`, `apply_fsdp`,
`materialize`, `build_optimizer`), because a spec's FSDP needs dp > 1 and a spec cannot ask
for torch.compile. The closing line is `key=value ...` (docs/gpu.md names each key and its
target); each part's figures (JSON), any traceback and the runs' logs go under --out, the runs
themselves (checkpoints) under --work.

`--rehearse` runs the same parts on the CPU (gloo, tiny sizes, a few steps, torch.compile with
the aot_eager backend, since Inductor's CPU and GPU code generators differ anyway) and prints
`rehearsal=ok` after the summary when every part ran: tests/training/test_gpu_check.py runs it,
so the script is known to work before device time is spent on it.

Imports only the standard library, torch, numpy and training/ (tools.check_parity is
training-only): a GPU host may have no Django.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from tools.check_parity import REPO_ROOT, parity_spec, rank_environment, reference_spec, shared_data, step_values
from training.config import DataConfig, FaultSpec, LayoutConfig, ModelConfig, RunSpec, TrainConfig, llama_1b, tiny
from training.metrics import mfu
from training.ports import listen_port
from training.run_dir import RunDir

Events = list[dict[str, Any]]

# The targets docs/gpu.md states; the summary's `targets=` names the keys that missed them.
FP32_LOSS_TOLERANCE = 1e-4
BF16_LOSS_TOLERANCE = 2e-2
MFU_TARGET = 0.40
STALL_TARGET_MS = 50.0
RESUME_STEPS_COMPARED = 10
# A rank's collectives give up after this long instead of hanging the check; the parts' own boxes
# are the real bound.
WORKER_COLLECTIVE_TIMEOUT = timedelta(seconds=120)
# First steps of a run excluded from its baseline step time: CUDA/cuBLAS handles, the caching
# allocator and the CPU's thread pool warm up there.
WARM_STEPS = 3
KILL_POLL_S = 0.02
# CUDA's and NCCL's start, then the peak probe's few seconds of matmuls.
PROBE_S = 120.0
# Less time than this left in a box: a process is not started (importing torch alone takes seconds).
MIN_START_S = 5.0
ONE_GPU_NOTE = (
    "one GPU: NCCL refuses two ranks on one GPU (duplicate GPU), and a rank on cuda:0 beside a CPU "
    "rank would have process groups of two backends; so the multi-rank layouts run on CPU ranks "
    "over gloo as a control against the single-process CPU run, and the GPU's collectives are "
    "exercised at world size 1 by the throughput part (cpu:gloo,cuda:nccl, FSDP2)"
)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What each part runs and how long it may take: one plan for the GPU, one for the rehearsal."""

    on_gpu: bool
    budget_s: float  # the whole check: parts that start late get what is left
    part_s: dict[str, float]  # each part's own box
    parity_steps: int
    layouts: tuple[dict[str, Any], ...]
    peak_n: int  # matmul size of the bf16 peak probe
    peak_seconds: float
    throughput_model: ModelConfig
    throughput_batch: int
    throughput_warmup: int  # untimed steps; a compiled variant compiles in the first
    throughput_steps: int
    compile_backend: str
    checkpoint_model: ModelConfig
    checkpoint_batch: int
    checkpoint_steps: int
    checkpoint_interval: int
    resume_model: ModelConfig
    resume_batch: int
    resume_precision: str
    # (torch.compile, recompute), in the order they run: a variant the part's box cuts off is the
    # last, and compile with full recompute is the slowest to compile and the least likely fastest.
    variants: tuple[tuple[bool, str], ...] = ((False, "none"), (True, "none"), (False, "full"), (True, "full"))


TINY_MODEL = tiny().model

GPU_PLAN = Plan(
    on_gpu=True,
    budget_s=450.0,  # 8 minutes on one H200, with 30 s to spare for start and copying --out back
    part_s={"parity": 90, "layouts": 60, "throughput": 240, "checkpoint": 60, "resume": 90},
    parity_steps=20,
    layouts=({"dp": 2}, {"dp": 2, "zero": 3}),
    peak_n=8192,
    peak_seconds=3.0,
    # Llama 3.2 1B's shape (1.50 B parameters, untied head) at a 2k context: 4 × 2048 tokens a step
    # keep fp32 master weights, gradients, AdamW state (24 GB), activations without recompute and
    # the fp32 logits under an H100's 78 GiB.
    throughput_model=dataclasses.replace(llama_1b().model, seq_len=2048),
    throughput_batch=4,
    throughput_warmup=3,
    throughput_steps=10,
    compile_backend="inductor",
    # ~100 M parameters: a 1.2 GB checkpoint (weights and AdamW state in fp32), saved every 60
    # steps so that one save's write is normally committed before the next begins.
    checkpoint_model=ModelConfig(n_layers=8, dim=1024, n_heads=16, n_kv_heads=8, vocab_size=2048, seq_len=1024),
    checkpoint_batch=8,
    checkpoint_steps=200,
    checkpoint_interval=60,
    resume_model=ModelConfig(n_layers=4, dim=512, n_heads=8, n_kv_heads=4, vocab_size=2048, seq_len=512),
    resume_batch=8,
    resume_precision="bf16",
)

REHEARSAL_PLAN = Plan(
    on_gpu=False,
    budget_s=240.0,
    part_s={"parity": 60, "layouts": 45, "throughput": 90, "checkpoint": 45, "resume": 60},
    parity_steps=5,
    layouts=({"dp": 2},),
    peak_n=512,
    peak_seconds=0.5,
    throughput_model=TINY_MODEL,
    throughput_batch=4,
    throughput_warmup=1,
    throughput_steps=2,
    compile_backend="aot_eager",
    checkpoint_model=TINY_MODEL,
    checkpoint_batch=8,
    checkpoint_steps=16,
    checkpoint_interval=4,
    resume_model=TINY_MODEL,
    resume_batch=8,
    resume_precision="fp32",
)

PARTS = ("parity", "layouts", "throughput", "checkpoint", "resume")
# The parts that need the GPU; layouts' control runs on CPU ranks wherever it is.
GPU_PARTS = ("parity", "throughput", "checkpoint", "resume")
# The summary's value keys, by part: "na" when the part failed before it measured them.
PART_KEYS = {
    "parity": ("parity_fp32_max_dloss", "parity_bf16_max_dloss"),
    "layouts": ("layouts_run", "layouts_max_dloss"),
    "throughput": ("peak_bf16_tflops", "gpu_tok_s", "gpu_mfu", "gpu_mfu_variant"),
    "checkpoint": ("gpu_ckpt_stall_ms", "gpu_ckpt_first_stall_ms"),
    "resume": ("gpu_resume_bitwise",),
}


class PartError(Exception):
    """A part that could not finish: `reason` goes into the summary (one token), `detail` (a log's
    last lines) into the part's traceback file."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}\n{detail}" if detail else reason)
        self.reason = reason


# --- Processes ----------------------------------------------------------------------------------


@dataclass
class Launched:
    """A process this check started, in a session of its own so a time-out ends all of it."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path
    events_file: Path | None = None

    def events(self) -> Events:
        """The events written so far; a line being written is skipped."""
        if self.events_file is None or not self.events_file.exists():
            return []
        found = []
        for line in self.events_file.read_text(encoding="utf-8").splitlines():
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return found

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def log_tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# --- The check ------------------------------------------------------------------------------------


@dataclass
class Check:
    plan: Plan
    out: Path
    work: Path
    started: float = field(default_factory=time.monotonic)
    launched: list[Launched] = field(default_factory=list)
    data: DataConfig | None = None
    device: dict[str, Any] = field(default_factory=dict)  # what the probe found
    cpu_reference: tuple[RunSpec, Events] | None = None  # parity's CPU fp32 run, layouts' reference

    @property
    def end(self) -> float:
        return self.started + self.plan.budget_s

    def environment(self, on_gpu: bool, events_file: Path | None = None) -> dict[str, str]:
        env = rank_environment(events_file or self.work / "unused-events.jsonl")
        if not on_gpu:
            env["CUDA_VISIBLE_DEVICES"] = ""  # torch then sees no GPU: CPU and gloo (training.device)
        return env

    def start(self, name: str, command: list[str], env: dict[str, str], events_file: Path | None = None) -> Launched:
        log = self.work / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            process = subprocess.Popen(
                command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        launched = Launched(name, process, log, events_file)
        self.launched.append(launched)
        return launched

    def start_training(
        self, name: str, spec: RunSpec, run_dir: Path, *, on_gpu: bool, events_file: Path | None = None
    ) -> Launched:
        """`python -m training.train` on `spec` (under torchrun when it has several ranks)."""
        folder = RunDir(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        folder.spec_file.write_text(spec.to_json())
        nproc = spec.layout.world_size
        prefix = [sys.executable]
        if nproc > 1:
            prefix += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        command = [*prefix, "-m", "training.train", "--spec", str(folder.spec_file), "--run-dir", str(run_dir)]
        events = events_file or folder.events_file
        return self.start(name, command, self.environment(on_gpu, events), events)

    def wait(self, run: Launched, deadline: float) -> Events:
        """Waits for `run` to exit 0 by `deadline`; returns its events. Ends it on time-out."""
        try:
            run.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            run.kill()
            raise PartError(f"timeout:{run.name}") from None
        if run.process.returncode != 0:
            raise PartError(f"{run.name}_exit_{run.process.returncode}", log_tail(run.log))
        return run.events()

    def with_data(self, spec: RunSpec) -> RunSpec:
        """`spec` on the check's one corpus and tokenizer, prepared once."""
        if self.data is None:
            self.data = shared_data(self.work, tiny())
        return RunSpec.from_dict({**spec.to_dict(), "data": vars(self.data)})

    def worker(self, name: str, job: dict[str, Any], deadline: float, *, on_gpu: bool) -> dict[str, Any]:
        """Runs `python -m tools.gpu_check --worker JOB` (a rank of world size 1); returns its result."""
        if deadline - time.monotonic() < MIN_START_S:
            raise PartError(f"no_time_left_for_{name}")
        job_file = self.work / "jobs" / f"{name}.json"
        job_file.parent.mkdir(parents=True, exist_ok=True)
        result_file = job_file.with_suffix(".result.json")
        job_file.write_text(json.dumps({**job, "result": str(result_file)}))
        env = self.environment(on_gpu)
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        env["MASTER_PORT"] = str(listen_port())
        # Blocks of other sizes freed by one step are reused by the next instead of fragmenting
        # the 1-3 B model's memory (torchtitan sets the same).
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        run = self.start(name, [sys.executable, "-m", "tools.gpu_check", "--worker", str(job_file)], env)
        self.wait(run, deadline)
        if not result_file.exists():
            raise PartError(f"{name}_no_result", log_tail(run.log))
        result: dict[str, Any] = json.loads(result_file.read_text())
        return result

    def keep_logs(self) -> None:
        """The runs' logs (their last lines) beside the figures: --work may be on a machine given back."""
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for run in self.launched:
            (logs / run.log.name).write_text(log_tail(run.log, 400) + "\n")


# --- Part (a): GPU against CPU ----------------------------------------------------------------------


def ran_on(run_dir: Path) -> str:
    """The device a training run computed on, read off the name of the peak it measured
    (`training.device.peak_flops`: `<host>-<device>-<precision>.json`)."""
    host = socket.gethostname() + "-"
    for path in RunDir(run_dir).peak_flops_dir.glob(f"{host}*.json"):
        return path.stem.removeprefix(host).rsplit("-", 1)[0]
    return "unknown"


def max_delta(reference: Events, other: Events, key: str = "loss") -> tuple[float, dict[int, float]]:
    ref, got = step_values(reference, key), step_values(other, key)
    if not ref or ref.keys() != got.keys():
        raise PartError("steps_differ", f"{sorted(ref)} vs {sorted(got)}")
    deltas = {s: abs(ref[s] - got[s]) for s in ref}
    return max(deltas.values()), deltas


def part_parity(check: Check, deadline: float) -> dict[str, Any]:
    plan = check.plan
    runs: dict[tuple[str, str], Launched] = {}
    specs = {p: check.with_data(parity_spec(plan.parity_steps, precision=p)) for p in ("fp32", "bf16")}
    for precision, spec in specs.items():
        for where in ("device", "cpu"):
            run_dir = check.work / "parity" / f"{where}-{precision}"
            on_gpu = plan.on_gpu and where == "device"
            runs[where, precision] = check.start_training(f"parity-{where}-{precision}", spec, run_dir, on_gpu=on_gpu)
    events = {key: check.wait(run, deadline) for key, run in runs.items()}
    devices = {f"{w}_{p}": ran_on(check.work / "parity" / f"{w}-{p}") for w, p in runs}
    if plan.on_gpu and any(devices[f"device_{p}"].startswith("cpu") for p in specs):
        raise PartError("device_run_on_cpu", str(devices))
    check.cpu_reference = (specs["fp32"], events["cpu", "fp32"])
    result: dict[str, Any] = {"steps": plan.parity_steps, "ran_on": devices}
    for precision in specs:
        worst, deltas = max_delta(events["cpu", precision], events["device", precision])
        cpu, device = step_values(events["cpu", precision]), step_values(events["device", precision])
        result[f"parity_{precision}_max_dloss"] = worst
        result[f"{precision}_per_step"] = {s: {"cpu": cpu[s], "device": device[s], "dloss": deltas[s]} for s in cpu}
    result["tolerance"] = {"fp32": FP32_LOSS_TOLERANCE, "bf16": BF16_LOSS_TOLERANCE}
    return result


# --- Part (b): multi-rank layouts ---------------------------------------------------------------------


def layout_name(layout: dict[str, Any]) -> str:
    return "".join(f"{k}{v}" if k != "zero" else f"z{v}" for k, v in layout.items())


def part_layouts(check: Check, deadline: float) -> dict[str, Any]:
    plan = check.plan
    specs = {layout_name(lay): check.with_data(parity_spec(plan.parity_steps, **lay)) for lay in plan.layouts}
    reference_of = reference_spec(next(iter(specs.values())))
    runs = {
        name: check.start_training(f"layouts-{name}", spec, check.work / "layouts" / name, on_gpu=False)
        for name, spec in specs.items()
    }
    if check.cpu_reference is not None and check.cpu_reference[0].to_dict() == reference_of.to_dict():
        reference = check.cpu_reference[1]  # parity's CPU fp32 run is this very spec
    else:
        run = check.start_training(
            "layouts-reference", reference_of, check.work / "layouts" / "reference", on_gpu=False
        )
        reference = check.wait(run, deadline)
    per_layout = {}
    for name, run in runs.items():
        worst, _ = max_delta(reference, check.wait(run, deadline))
        grad_worst, _ = max_delta(reference, run.events(), "grad_norm")
        per_layout[name] = {"max_dloss": worst, "max_dgrad_norm": grad_worst, "ranks": specs[name].layout.world_size}
    return {
        "layouts_run": ",".join(per_layout),
        "layouts_max_dloss": max(v["max_dloss"] for v in per_layout.values()),
        "per_layout": per_layout,
        "backend": "gloo on CPU ranks",
        "note": ONE_GPU_NOTE if plan.on_gpu else "rehearsal: CPU ranks over gloo, as on a GPU host",
        "tolerance": FP32_LOSS_TOLERANCE,
    }


# --- Part (c): throughput and MFU -----------------------------------------------------------------------


def variant_name(compiled: bool, recompute: str) -> str:
    return f"{'compile' if compiled else 'eager'}+recompute_{recompute}"


def part_throughput(check: Check, deadline: float) -> dict[str, Any]:
    plan = check.plan
    if "peak_bf16_flops" not in check.device:
        raise PartError("no_peak", "the probe did not measure the bf16 matmul peak")
    peak = float(check.device["peak_bf16_flops"])
    model = dataclasses.asdict(plan.throughput_model)
    variants: dict[str, Any] = {}
    failed: list[str] = []
    for compiled, recompute in plan.variants:
        name = variant_name(compiled, recompute)
        job = {
            "kind": "throughput", "model": model, "batch": plan.throughput_batch, "warmup": plan.throughput_warmup,
            "steps": plan.throughput_steps, "compile": compiled, "backend": plan.compile_backend,
            "recompute": recompute, "peak_flops": peak, "expect_cuda": plan.on_gpu,
        }  # fmt: skip
        try:
            variants[name] = check.worker(f"throughput-{name}", job, deadline, on_gpu=plan.on_gpu)
        except PartError as exc:
            variants[name] = {"error": exc.reason, "log": str(exc)}
            failed.append(f"{name}:{exc.reason}")
    ran = {name: v for name, v in variants.items() if "error" not in v}
    if not ran:
        raise PartError(f"every_variant_failed:{','.join(failed)}")
    best = max(ran, key=lambda name: ran[name]["tok_s"])
    datasheet = check.device.get("datasheet_bf16_tflops")
    result = {
        "peak_bf16_tflops": peak / 1e12,
        "gpu_tok_s": ran[best]["tok_s"],
        "gpu_mfu": ran[best]["mfu"],
        "gpu_mfu_variant": best,
        "variants": variants,
        "model": model,
        "params": plan.throughput_model.num_params(),
        "tokens_per_step": plan.throughput_batch * plan.throughput_model.seq_len,
        "datasheet_bf16_tflops": datasheet,
        # What the run logs' MFU would say: they divide by the data sheet's peak on a known GPU.
        "best_mfu_vs_datasheet": mfu(ran[best]["tok_s"], plan.throughput_model, datasheet * 1e12)
        if datasheet
        else None,
        "layout": "FSDP2 (zero 3, bf16 params, fp32 reduce) over a world of 1, cpu:gloo,cuda:nccl on a GPU",
    }
    if failed:
        result["partial_error"] = ",".join(failed)
    return result


# --- Part (d): async checkpoint stall --------------------------------------------------------------------


def run_spec(model: ModelConfig, *, precision: str, steps: int, batch: int, interval: int, **train: Any) -> RunSpec:
    return RunSpec(
        model=model,
        layout=LayoutConfig(precision=precision),  # type: ignore[arg-type]
        train=TrainConfig(
            steps=steps, global_batch=batch, lr=3e-4, min_lr=3e-5, warmup_steps=min(5, steps),
            checkpoint_interval=interval, keep_checkpoints=2, **train,
        ),
    )  # fmt: skip


def folder_gb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e9


def part_checkpoint(check: Check, deadline: float) -> dict[str, Any]:
    plan = check.plan
    precision = "bf16" if plan.on_gpu else "fp32"
    spec = check.with_data(
        run_spec(
            plan.checkpoint_model, precision=precision, steps=plan.checkpoint_steps, batch=plan.checkpoint_batch,
            interval=plan.checkpoint_interval, async_checkpoint=True,
        )
    )  # fmt: skip
    run_dir = check.work / "checkpoint"
    events = check.wait(check.start_training("checkpoint", spec, run_dir, on_gpu=plan.on_gpu), deadline)
    metrics = {e["step"]: e for e in events if e["kind"] == "metrics"}
    commits = {e["step"]: e["time"] for e in events if e["kind"] == "checkpoint"}
    saves = sorted(s for s in commits if s < plan.checkpoint_steps)
    if not saves:
        raise PartError("no_save_committed_before_the_last_step", str(sorted(commits)))
    tokens = spec.train.global_batch * spec.model.seq_len
    # A step's wall time since the previous step ended: a save made between them counts in it.
    wall = {s: tokens / m["tokens_per_s"] for s, m in metrics.items()}
    after_save = {s + 1 for s in saves}
    quiet = [w for s, w in wall.items() if s > WARM_STEPS and s not in after_save]
    baseline = statistics.median(quiet)
    stalls = []
    for i, s in enumerate(saves):
        later = saves[i + 1] if i + 1 < len(saves) else None
        stalls.append({
            "save_step": s,
            "stall_ms": 1e3 * (wall[s + 1] - baseline),
            # The next save waits for this one's commit: then that save's stall includes the write.
            "committed_before_next_save": later is None or commits[s] <= metrics[later]["time"],
        })  # fmt: skip
    steady = [x["stall_ms"] for x in stalls[1:]] or [stalls[0]["stall_ms"]]
    committed = RunDir(run_dir).committed_checkpoints()
    return {
        "gpu_ckpt_stall_ms": statistics.median(steady),
        # The first save also allocates the stager's pinned buffers, which later saves reuse.
        "gpu_ckpt_first_stall_ms": stalls[0]["stall_ms"],
        "baseline_step_ms": 1e3 * baseline,
        "saves": stalls,
        "checkpoint_gb": folder_gb(committed[-1]) if committed else None,
        "params": spec.model.num_params(),
        "precision": precision,
        "ran_on": ran_on(run_dir),
        "target_ms": STALL_TARGET_MS,
    }


# --- Part (e): kill -9 and a bitwise resume ---------------------------------------------------------------


def part_resume(check: Check, deadline: float) -> dict[str, Any]:
    plan = check.plan
    steps, interval = 2 * RESUME_STEPS_COMPARED, RESUME_STEPS_COMPARED
    spec = check.with_data(
        run_spec(
            plan.resume_model, precision=plan.resume_precision, steps=steps, batch=plan.resume_batch,
            interval=interval, deterministic=True,
        )
    )  # fmt: skip
    # The run to be killed waits 0.2 s before each step after its first checkpoint: however fast
    # the GPU, the kill then lands between that checkpoint and the next. The wait changes no value.
    slowed = dataclasses.replace(spec, faults=[FaultSpec(kind="slow_steps", rank=0, step=interval + 1, once=False)])
    root = check.work / "resume"
    untouched = check.start_training("resume-untouched", spec, root / "untouched", on_gpu=plan.on_gpu)
    victim = check.start_training("resume-killed", slowed, root / "killed", on_gpu=plan.on_gpu)
    while True:
        seen = victim.events()
        committed = any(e["kind"] == "checkpoint" and e["step"] == interval for e in seen)
        last = max((e["step"] for e in seen if e["kind"] == "metrics"), default=0)
        if committed and last >= interval + 2:
            os.kill(victim.process.pid, signal.SIGKILL)  # kill -9 of the training process itself
            break
        if victim.process.poll() is not None:
            raise PartError(f"ended_before_the_kill_exit_{victim.process.returncode}", log_tail(victim.log))
        if time.monotonic() > deadline:
            victim.kill()
            raise PartError("timeout:resume-killed")
        time.sleep(KILL_POLL_S)
    victim.process.wait()
    killed_at = last
    resumed_events = root / "killed" / "events-resumed.jsonl"
    resumed = check.wait(
        check.start_training("resume-resumed", slowed, root / "killed", on_gpu=plan.on_gpu, events_file=resumed_events),
        deadline,
    )
    reference = check.wait(untouched, deadline)
    start = next((e["step"] for e in resumed if e["kind"] == "resumed"), None)
    if start is None:
        raise PartError("no_resume", "the second attempt started from scratch")
    compared = list(range(start + 1, min(start + RESUME_STEPS_COMPARED, steps) + 1))
    ref_loss, got_loss = step_values(reference), step_values(resumed)
    ref_norm, got_norm = step_values(reference, "grad_norm"), step_values(resumed, "grad_norm")
    equal = len(compared) == RESUME_STEPS_COMPARED and all(
        s in got_loss and got_loss[s] == ref_loss[s] and got_norm[s] == ref_norm[s] for s in compared
    )
    return {
        "gpu_resume_bitwise": int(equal),
        "killed_after_step": killed_at,
        "killed_exit": victim.process.returncode,
        "resumed_from_step": start,
        "steps_compared": compared,
        "per_step": {s: {"untouched": ref_loss[s], "resumed": got_loss.get(s)} for s in compared},
        "max_dloss": max(abs(ref_loss[s] - got_loss.get(s, float("inf"))) for s in compared),
        "precision": plan.resume_precision,
        "deterministic": True,
        "ran_on": ran_on(root / "killed"),
    }


# --- The workers: one process of world size 1 ----------------------------------------------------------


def probe(job: dict[str, Any]) -> dict[str, Any]:
    """The device this check runs on, and its bf16 matmul peak measured now."""
    import torch

    from training.device import activate, device_from_environment, table_peak_flops
    from training.metrics import measure_matmul_peak

    device = device_from_environment()
    if job["expect_cuda"] and device.type != "cuda":
        raise RuntimeError("torch sees no GPU (torch.cuda.is_available() is False)")
    activate(device)
    found: dict[str, Any] = {"torch": torch.__version__, "device_type": device.type, "name": "cpu"}
    if device.type == "cuda":
        found["name"] = torch.cuda.get_device_name(device.torch_device)
        try:  # the rest only describes the GPU: none of it may cost the check its peak
            props = torch.cuda.get_device_properties(device.torch_device)
            nccl = torch.cuda.nccl.version()
            found.update(
                memory_gb=props.total_memory / 1e9, capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
            )  # fmt: skip
        except Exception as exc:
            found["description_error"] = repr(exc)
        listed = table_peak_flops(found["name"])
        found["datasheet_bf16_tflops"] = listed / 1e12 if listed else None
    else:
        found["threads"] = torch.get_num_threads()
    found["peak_bf16_flops"] = measure_matmul_peak(
        n=job["peak_n"], seconds=job["peak_seconds"], device=device.torch_device, dtype=torch.bfloat16
    )
    return found


class RandomInit:
    """Weights drawn on the device with the model's own standard deviations: a throughput figure
    does not need the seeded CPU replay that makes every layout start alike (`SeededInit`), which
    takes tens of seconds at 1.5 B parameters."""

    def __init__(self, std_of: Callable[[str, int], float | None], seed: int) -> None:
        self.std_of = std_of
        self.seed = seed

    def fill(self, shards: dict[str, Any]) -> None:
        import torch

        torch.manual_seed(self.seed)
        for name, shard in shards.items():
            std = self.std_of(name, len(shard.full_shape))
            if std is None:
                shard.local.fill_(1.0)
            else:
                shard.local.normal_(0.0, std)


def throughput(job: dict[str, Any]) -> dict[str, Any]:
    """Steps of the job's model in bf16 under FSDP2 over a world of one, timed after `warmup`."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from training.collectives import init_default_group
    from training.device import device_from_environment, device_peak_memory_mb
    from training.initial_weights import build_meta, materialize
    from training.model import cross_entropy_loss
    from training.parallel import clip_grad_norm_
    from training.parallel.fsdp import apply_fsdp
    from training.parallel.recompute import apply_recompute
    from training.trainer import build_optimizer

    device = device_from_environment()
    if job["expect_cuda"] and device.type != "cuda":
        raise RuntimeError("torch sees no GPU (torch.cuda.is_available() is False)")
    init_default_group(device, WORKER_COLLECTIVE_TIMEOUT)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp",))
    cfg = ModelConfig(**job["model"])
    model = build_meta(cfg)
    # torchtitan's order (STYLE.md 9): recompute, then compile each block, then FSDP.
    apply_recompute(model, job["recompute"])
    if job["compile"]:
        for name, block in list(model.layers.items()):
            model.layers[name] = torch.compile(block, backend=job["backend"])  # type: ignore[assignment]
    apply_fsdp(model, mesh, zero=3, precision="bf16")
    materialize([model], device.torch_device, RandomInit(model.init_std, seed=1234))
    optimizer = build_optimizer(model, TrainConfig(lr=3e-4, min_lr=3e-5))
    params = list(model.parameters())
    generator = torch.Generator(device=device.torch_device).manual_seed(0)
    tokens = torch.randint(
        0, cfg.vocab_size, (job["batch"], cfg.seq_len + 1), device=device.torch_device, generator=generator
    )
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def wait() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device.torch_device)

    def step() -> torch.Tensor:
        loss = cross_entropy_loss(model(inputs), targets)
        loss.backward()
        clip_grad_norm_(params, 1.0, None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    losses = []
    began = time.perf_counter()
    for _ in range(job["warmup"]):
        losses.append(step())
    wait()
    timed_from = time.perf_counter()
    for _ in range(job["steps"]):
        losses.append(step())
    wait()
    elapsed = time.perf_counter() - timed_from
    values = [float(v) for v in torch.stack(losses).tolist()]
    if not all(v == v and abs(v) < float("inf") for v in values):
        raise RuntimeError(f"a loss is not finite: {values}")
    tok_s = job["steps"] * job["batch"] * cfg.seq_len / elapsed
    result = {
        "tok_s": tok_s,
        "mfu": mfu(tok_s, cfg, job["peak_flops"]),
        "step_ms": 1e3 * elapsed / job["steps"],
        "warmup_s": timed_from - began,
        "memory_gb": device_peak_memory_mb(device) / 1024,
        "first_loss": values[0],
        "last_loss": values[-1],
        "device": str(device.torch_device),
    }
    dist.destroy_process_group()
    return result


WORKERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"probe": probe, "throughput": throughput}


def run_worker(job_file: Path) -> None:
    job = json.loads(job_file.read_text())
    result = WORKERS[job["kind"]](job)
    Path(job["result"]).write_text(json.dumps(result, indent=2))
    sys.stdout.flush()
    sys.stderr.flush()
    # As training.train's shutdown: no interpreter teardown racing the process group's threads.
    os._exit(0)


# --- Summary --------------------------------------------------------------------------------------------


def short_reason(exc: BaseException) -> str:
    """A reason fit for one `key=value` token: no spaces, at most 80 characters."""
    if isinstance(exc, PartError):
        text = exc.reason
    else:
        lines = str(exc).strip().splitlines()
        text = f"{type(exc).__name__}:{lines[0]}" if lines else type(exc).__name__
    return re.sub(r"[^A-Za-z0-9_.:/+,-]+", "_", text)[:80]


def formatted(value: Any) -> str:
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:.0f}"
        return f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return re.sub(r"\s+", "_", str(value))


def missed_targets(results: dict[str, dict[str, Any]]) -> list[str]:
    checks = {
        "parity_fp32_max_dloss": lambda v: v <= FP32_LOSS_TOLERANCE,
        "parity_bf16_max_dloss": lambda v: v <= BF16_LOSS_TOLERANCE,
        "layouts_max_dloss": lambda v: v <= FP32_LOSS_TOLERANCE,
        "gpu_mfu": lambda v: v >= MFU_TARGET,
        "gpu_ckpt_stall_ms": lambda v: v <= STALL_TARGET_MS,
        "gpu_resume_bitwise": lambda v: v == 1,
    }
    values = {k: v for result in results.values() for k, v in result.items()}
    return [key for key, ok in checks.items() if key not in values or not ok(values[key])]


def summary_line(check: Check, status: dict[str, str], results: dict[str, dict[str, Any]], rehearse: bool) -> str:
    pairs = {
        "device": check.device.get("name", "unknown"),
        "torch": check.device.get("torch", "unknown"),
        "mode": "rehearsal" if rehearse else "gpu",
    }
    for part in PARTS:
        pairs[part] = status[part]
        for key in PART_KEYS[part]:
            pairs[key] = results.get(part, {}).get(key, "na")
    if not rehearse:
        missed = missed_targets(results)
        pairs["targets"] = "missed:" + ",".join(missed) if missed else "met"
    pairs["wall_s"] = time.monotonic() - check.started
    return " ".join(f"{key}={formatted(value)}" for key, value in pairs.items())


# --- Main -----------------------------------------------------------------------------------------------

PART_FUNCTIONS: dict[str, Callable[[Check, float], dict[str, Any]]] = {
    "parity": part_parity,
    "layouts": part_layouts,
    "throughput": part_throughput,
    "checkpoint": part_checkpoint,
    "resume": part_resume,
}


def say(line: str) -> None:
    """Progress, on stderr: stdout holds the summary alone."""
    print(f"gpu_check: {line}", file=sys.stderr, flush=True)


def run_part(check: Check, part: str) -> tuple[str, dict[str, Any]]:
    """Runs one part in its box; returns its status (ok, or error:<reason>) and its figures."""
    began = time.monotonic()
    deadline = min(began + check.plan.part_s[part], check.end)
    result: dict[str, Any] = {}
    if deadline - began < MIN_START_S:
        status = "error:no_time_left"
    elif check.plan.on_gpu and part in GPU_PARTS and check.device.get("device_type") != "cuda":
        status = f"error:no_gpu:{check.device.get('error', 'the_probe_found_none')}"[:100]
    else:
        try:
            result = PART_FUNCTIONS[part](check, deadline)
            status = "ok" if "partial_error" not in result else f"error:{result['partial_error']}"[:100]
        except Exception as exc:
            status = f"error:{short_reason(exc)}"
            (check.out / f"{part}.traceback.txt").write_text(traceback.format_exc())
        finally:
            for run in check.launched:  # nothing of a failed part runs on into the next one
                if run.process.poll() is None:
                    run.kill()
    result["seconds"] = time.monotonic() - began
    (check.out / f"{part}.json").write_text(json.dumps(result, indent=2, sort_keys=True, default=str))
    say(f"{part}: {status} in {result['seconds']:.1f} s")
    return status, result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="details go here (default: a new temporary folder)")
    parser.add_argument(
        "--work", type=Path, help="the runs and their checkpoints (default: a temporary folder, removed)"
    )
    parser.add_argument("--rehearse", action="store_true", help="the same parts on the CPU with small sizes")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"a comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # a job file: this process is a worker
    args = parser.parse_args(argv)
    if args.worker is not None:
        run_worker(args.worker)
    plan = REHEARSAL_PLAN if args.rehearse else GPU_PLAN
    out = args.out or Path(tempfile.mkdtemp(prefix="fathom-gpu-check-out-"))
    out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="fathom-gpu-check-work-"))
    check = Check(plan=plan, out=out, work=work)
    wanted = [p for p in args.parts.split(",") if p]
    unknown = set(wanted) - set(PARTS)
    if unknown:
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    say(f"details in {out}, runs in {work}")
    status = dict.fromkeys(PARTS, "skipped")
    results: dict[str, dict[str, Any]] = {}
    try:
        job = {"kind": "probe", "peak_n": plan.peak_n, "peak_seconds": plan.peak_seconds, "expect_cuda": plan.on_gpu}
        check.device = check.worker("probe", job, time.monotonic() + PROBE_S, on_gpu=plan.on_gpu)
    except Exception as exc:
        check.device = {"error": short_reason(exc)}
        (out / "probe.traceback.txt").write_text(traceback.format_exc())
    (out / "device.json").write_text(json.dumps(check.device, indent=2))
    say(f"device: {check.device}")
    for part in wanted:
        status[part], results[part] = run_part(check, part)
    check.keep_logs()
    line = summary_line(check, status, results, args.rehearse)
    (out / "summary.txt").write_text(line + "\n")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    print(line, flush=True)
    all_ran = all(status[p] == "ok" for p in wanted)
    if args.rehearse:
        print("rehearsal=ok" if all_ran else "rehearsal=failed", flush=True)
    sys.exit(0 if all_ran else 1)


if __name__ == "__main__":
    main()
