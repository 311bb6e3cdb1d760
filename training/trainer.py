"""The training loop: one optimizer step at a time, with checkpoints, metrics and hooks.

`forward_backward` is the only code that differs between a pipelined and an unpipelined model;
`train_step` is the same for every layout: learning rate, batch, accumulation passes, gradient
reduction, clipping by the global norm, optimizer step, metrics. `fit` resumes from the newest
committed checkpoint (if any), runs the remaining steps and saves on schedule.

The guard (`spec.guard`): a step whose loss or global gradient norm is not finite on any rank is
skipped on every rank alike. Each rank's verdict rides the loss's all-reduce (no collective of
its own), so the ranks cannot disagree; the skipped step's batch still counts as read, so a
resume replays the same data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from training.checkpoint import Checkpointer, rng_state, set_rng_state
from training.checkpoint_policy import CheckpointPolicy, SnapshotPolicy
from training.collectives import agreed
from training.config import RunSpec, TrainConfig
from training.data import PreparedData, ShardedSampler, TokenWindows
from training.device import CPU, ComputeDevice, device_peak_memory_mb, host_cache, peak_flops
from training.guard import LossGuard, StragglerWatch
from training.hooks import TrainHook
from training.initial_weights import initial_weights
from training.memory_snapshot import MemorySnapshots
from training.metrics import mfu, step_line
from training.model import IGNORE_INDEX, cross_entropy_loss, token_loss_sum
from training.parallel import ParallelModel, clip_grad_norm_, parallelize
from training.parallel.dims import ParallelDims, batch_shape
from training.rank_environment import NonRetryable, RankEnvironment
from training.rank_events import EventLog
from training.run_dir import RunDir


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay to `min_lr` at the last step (1-based)."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (norm gains are not decayed, as in GPT-2 and Llama)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    # A LoRA run trains matrices only; DCP cannot load the state of an optimizer with an empty group.
    groups = [g for g in groups if g["params"]]
    # fused: one kernel over all parameters. torch's default on CPU is a Python loop over them,
    # three times slower here (87 → 28 ms a step on `small`, ~1% of its step; more on smaller models).
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)


def _finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def say(line: str) -> None:
    """One line to stdout, flushed at once: the node agent streams rank 0's stdout to users as the log."""
    print(line, flush=True)


def _micro_batch_loss(logits: torch.Tensor, targets: torch.Tensor, scale: float) -> torch.Tensor:
    return cross_entropy_loss(logits, targets) * scale


def training_and_held_out(data: PreparedData, spec: RunSpec) -> tuple[TokenWindows, TokenWindows | None]:
    """The windows training samples from and the held-out windows evaluation reads (None: no
    held-out data): a second dataset's, or the last `data.validation_fraction` of the dataset's."""
    windows = data.windows(spec.model.seq_len)
    if data.validation_tokens_path is not None:
        return windows, data.windows(spec.model.seq_len, validation=True)
    if spec.data.validation_fraction > 0:
        return windows.split(spec.data.validation_fraction)
    return windows, None


class RollBack(Exception):
    """Raised by `train_step` when the guard wants every rank rolled back (all raise it alike)."""

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(reason)
        self.step = step
        self.reason = reason


class Trainer:
    def __init__(
        self,
        *,
        spec: RunSpec,
        run_dir: Path,
        data: PreparedData,
        rank: int = 0,
        world_size: int = 1,
        hooks: list[TrainHook] | None = None,
        events: EventLog | None = None,
        device: ComputeDevice = CPU,
    ) -> None:
        self.spec = spec
        self.device = device
        self.run_dir = run_dir
        self.rank = rank
        self.world_size = world_size
        self.hooks = hooks or []
        self.events = events
        self.distributed = world_size > 1
        self.dims = ParallelDims.from_layout(spec.layout, world_size)
        self.mesh = self.dims.build_mesh(device.type) if self.distributed else None
        coords = self.dims.coordinates(rank)
        self.reports_loss = coords["tp"] == 0  # tp ranks hold the same loss; count it once
        self.shape = batch_shape(spec)

        # Each backward pass sees its loss divided by the passes of a step (accumulation × pipeline
        # micro-batches), so the accumulated gradient is that of the step's mean loss.
        self.loss_scale = 1.0 / self.shape.backward_passes
        self.model: ParallelModel = parallelize(
            initial_weights(spec),  # the same values on every layout and in the one-process reference
            spec,
            self.dims,
            self.mesh,
            rank,
            partial(_micro_batch_loss, scale=self.loss_scale),
            device.torch_device,
        )
        self.params = [p for part in self.model.parts for p in part.parameters()]
        self.optimizers = [build_optimizer(part, spec.train) for part in self.model.parts]
        self.pp_group = self.mesh["pp"].get_group() if self.mesh is not None and self.dims.pp > 1 else None

        self.dp_rank = coords["dp"]
        self.windows, self.eval_windows = training_and_held_out(data, spec)
        self.sampler = ShardedSampler(
            self.windows.num_samples, spec.train.global_batch, coords["dp"], self.dims.dp, spec.train.seed
        )
        self.checkpointer = Checkpointer(
            run_dir=run_dir,
            parts=list(self.model.parts),
            optimizers=list(self.optimizers),
            spec=spec,
            tokenizer_dir=data.tokenizer_dir,
            rank=rank,
            hooks=self.hooks,
            on_commit=self._on_commit,
            storage=spec.data.storage,
        )
        # In-memory snapshots only under a node agent, which removes them when it exits.
        self.snapshots = (
            MemorySnapshots(
                RunDir(run_dir),
                rank=rank,
                identity={"layout": dataclasses.asdict(spec.layout), "world_size": world_size},
                parts=list(self.model.parts),
                optimizers=list(self.optimizers),
                replicas=self.dims.replicas(rank),
            )
            if spec.train.memory_snapshots and RankEnvironment.from_environ() is not None
            else None
        )
        self.tokens_per_step = spec.train.global_batch * spec.model.seq_len
        # Every rank's peak in the run's precision and thread count, as rank 0 measures it on its host.
        self.peak_flops = (
            peak_flops(device, spec.layout.precision, RunDir(run_dir).peak_flops_dir, host_cache()) if rank == 0 else 0.0
        )
        # The checkpoint policy's plan as an in-memory snapshot kept it, when resume() used one.
        self._resumed_policy: dict[str, Any] | None = None
        # Restarts of the run that its in-memory snapshots did not cover (a restart that resumed
        # from a periodic snapshot or from disk): the failure rate the snapshot interval plans for.
        self._uncovered_failures = 0
        # (step, the sampler's state then) whose state the parameters and optimizer hold; None
        # while the optimizer writes them. What a failing rank snapshots (`_snapshot_at_failure`).
        self._held: tuple[int, dict[str, int]] | None = None
        self._memory_mb = (0.0, -math.inf)  # (peak MB, perf_counter when read)
        self._last_step_end: tuple[int, float] | None = None  # (step, perf_counter) of the last step's end
        self._eval_losses: dict[int, float] = {}  # rank 0: eval loss by step, for the checkpoint events
        # Where a scheduler may ask the ranks to checkpoint and stop (its time limit is near);
        # each step's end agrees on it over every rank (`train_step`), so all save the same step.
        rank_env = RankEnvironment.from_environ()
        self.stop_request = rank_env.stop_request_file if rank_env is not None else None
        self.stop_agreed = False  # at the last step's end some rank had found the stop request
        self.nonfinite_skipped = 0  # steps this process skipped (spec.guard)
        self.guard = LossGuard(spec.guard)
        stages = [[r for r in range(world_size) if self.dims.coordinates(r)["pp"] == stage] for stage in range(self.dims.pp)]
        self.stragglers = StragglerWatch(spec.guard, peers=stages)
        self._nonfinite_in_a_row = 0
        self.stopped_at: int | None = None  # the step `fit` checkpointed and stopped at, when asked to

    # --- One step -----------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """bf16 by autocast only where FSDP is not applied: under FSDP its mixed-precision policy
        gathers bf16 weights itself (parallel/fsdp.py)."""
        if self.spec.layout.precision == "bf16" and not self.dims.fsdp_enabled:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, last_pass: bool) -> torch.Tensor:
        """One accumulation pass over (inputs, targets); returns this pass's share of the step's mean
        loss on ranks that hold the last stage, zero on the others."""
        m = self.model
        if m.schedule is None:
            for part in m.parts:
                if isinstance(part, FSDPModule):
                    part.set_requires_gradient_sync(last_pass)  # reduce-scatter once per step
            with self._autocast():
                loss = _micro_batch_loss(m.parts[0](inputs), targets, self.loss_scale)
            loss.backward()
            return loss.detach()
        losses = self._through_stages(m.schedule.step, inputs, targets)
        if not m.has_last_stage:
            return torch.zeros((), device=self.device.torch_device)
        return torch.stack(losses).sum().detach()  # each already scaled by loss_scale

    def _through_stages(self, run: Callable[..., Any], inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        """One pass of the pipeline schedule (`run`: its `step` or `eval`) on this rank's stages:
        the inputs enter at the first stage, the targets at the last; returns the last stage's
        per-micro-batch losses (empty elsewhere)."""
        m = self.model
        losses: list[torch.Tensor] = []
        # return_outputs=False: otherwise the last stage keeps every micro-batch's logits (batch ×
        # seq × vocab each) until the pass ends, to hand them back merged; only the losses are used.
        with self._autocast():
            if m.has_first_stage:
                run(inputs, target=targets if m.has_last_stage else None, losses=losses, return_outputs=False)
            elif m.has_last_stage:
                run(target=targets, losses=losses, return_outputs=False)
            else:
                run(return_outputs=False)
        return losses

    # --- Evaluation ----------------------------------------------------------------------------

    def eval_due(self, step: int) -> bool:
        interval = self.spec.train.eval_interval
        return self.eval_windows is not None and interval > 0 and (step % interval == 0 or step == self.spec.train.steps)

    def _eval_pass(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """(summed loss, counted targets) of one pass over (inputs, targets) on ranks that hold the
        last stage; zeros on the others."""
        m = self.model
        counted = (targets != IGNORE_INDEX).sum().double()
        if m.schedule is None:
            with self._autocast():
                loss_sum = token_loss_sum(m.parts[0](inputs), targets)
            return torch.stack([loss_sum.double(), counted])
        losses = self._through_stages(m.schedule.eval, inputs, targets)
        if not m.has_last_stage:
            return torch.zeros(2, dtype=torch.float64, device=self.device.torch_device)
        # The schedule's loss function gives each micro-batch's mean over its counted targets
        # times loss_scale; undo both to sum over tokens, so every layout weighs tokens alike.
        counts = [(t != IGNORE_INDEX).sum().clamp(min=1) for t in targets.tensor_split(self.spec.layout.microbatches)]
        loss_sum = torch.stack([loss.double() / self.loss_scale * c for loss, c in zip(losses, counts, strict=True)]).sum()
        return torch.stack([loss_sum, counted])

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, Any]:
        """Validation loss and perplexity over `train.eval_batches` fixed global batches of held-out
        sequences: the same sequences at every evaluation, split over dp like a training batch.

        Every rank takes part (the pipeline and the collectives need all of them); the loss is
        a sum over tokens divided by their count, so no layout weighs them differently."""
        assert self.eval_windows is not None
        cfg = self.spec.train
        local = cfg.global_batch // self.dims.dp
        micro = self.shape.micro_batch
        device = self.device.torch_device
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # (summed loss, counted targets)
        for batch in range(cfg.eval_batches):
            first = batch * cfg.global_batch + self.dp_rank * local
            # A held-out part smaller than the evaluation wraps around: still a fixed set.
            indices = np.arange(first, first + local) % self.eval_windows.num_samples
            inputs, targets = self.eval_windows.batch(indices)
            inputs, targets = inputs.to(device), targets.to(device)
            for i in range(cfg.grad_accum):
                chunk = slice(i * micro, (i + 1) * micro)
                totals += self._eval_pass(inputs[chunk], targets[chunk])
        if self.distributed:
            holds_loss = self.model.has_last_stage and self.reports_loss
            if not holds_loss:
                totals.zero_()  # tp ranks hold the same sums: count them once
            dist.all_reduce(totals)
        loss = (totals[0] / totals[1].clamp(min=1)).item()
        result = {
            "step": step,
            "eval_loss": loss,
            "eval_perplexity": math.exp(min(loss, 80.0)),  # capped: an untrained model's exp overflows floats
            "eval_tokens": int(totals[1].item()),
        }
        if self.rank == 0:
            self._eval_losses[step] = loss
            if self.events is not None:
                self.events.emit("eval", **result)
            say(f"eval step {step}: loss {loss:.4f}, perplexity {result['eval_perplexity']:.2f}")
        return result

    # --- Training ---------------------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, Any]:
        entered = time.perf_counter()
        for hook in self.hooks:
            hook.on_step_start(step, self.params)
        start = time.perf_counter()
        lr = lr_at(step, self.spec.train)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
        inputs, targets = self.windows.batch(self.sampler.next_indices())
        inputs, targets = inputs.to(self.device.torch_device), targets.to(self.device.torch_device)
        micro = self.shape.micro_batch
        loss = torch.zeros((), device=self.device.torch_device)
        for i in range(self.spec.train.grad_accum):
            chunk = slice(i * micro, (i + 1) * micro)
            loss += self.forward_backward(inputs[chunk], targets[chunk], last_pass=i == self.spec.train.grad_accum - 1)
        # This rank's own time in the step: from entering it (its hooks included) to the end of
        # its backward pass, before it waits for the others' gradients; not what every rank does
        # alike between steps (a checkpoint's save, an evaluation). Under tp or FSDP the
        # collectives inside forward and backward count too (their waits cannot be told apart there).
        own_time = time.perf_counter() - entered
        if self.model.grad_sync is not None:
            self.model.grad_sync.finish()
        for hook in self.hooks:
            hook.after_backward(step, self.params)
        asked = self.stop_request is not None and self.stop_request.exists()
        # Every collective of the step comes before its optimizer step, so a rank whose collective
        # fails (a peer died) still holds the previous step's state whole (`_snapshot_at_failure`).
        grad_norm = clip_grad_norm_(self.params, self.spec.train.grad_clip, self.pp_group)
        guarding = self.spec.guard.nonfinite == "skip"
        watching = self.guard.watches_spikes
        skipped = False
        loss_value: float | None = None  # the step's loss on every rank, read where the guard judges it
        # 1 where this rank's loss or gradient norm is NaN or infinite; kept on the device.
        spoiled = (~(torch.isfinite(loss) & torch.isfinite(grad_norm))).to(loss.dtype) if guarding else None
        if not self.distributed and (guarding or watching):
            loss_value, norm_value = torch.stack([loss, grad_norm.to(loss.dtype)]).tolist()  # one read
            skipped = guarding and not (math.isfinite(loss_value) and math.isfinite(norm_value))
        elif self.distributed:
            # Rank 0 may not hold the loss (pipeline) and each dp rank holds only its share: sum
            # every last-stage, first-tp rank's mean / dp over the world.
            holds_loss = self.model.has_last_stage and self.reports_loss
            share = loss / self.dims.dp if holds_loss else torch.zeros((), device=self.device.torch_device)
            if self.stop_request is None and not guarding and not watching and not self.stragglers.enabled:
                dist.all_reduce(share)
                loss = share
            else:
                # The stop request and the guard's verdict ride on the loss's all-reduce: every
                # rank learns in the same step whether any rank found the request (only one need
                # see the file: the batch script's node sees it at once, a shared file system's
                # other clients maybe later) or a non-finite value, and the loss the guard judges.
                # Each rank's own time rides in its own slot, so rank 0 learns every rank's.
                riders = torch.stack([
                    share, torch.full_like(share, float(asked)), spoiled if spoiled is not None else torch.zeros_like(share),
                ])  # fmt: skip
                if self.stragglers.enabled:
                    times = torch.zeros(self.world_size, dtype=share.dtype, device=share.device)
                    times[self.rank] = own_time
                    riders = torch.cat([riders, times])
                dist.all_reduce(riders)
                loss_value, found, spoiled_anywhere, *own_times = riders.tolist()  # one read from the device for all
                loss, asked, skipped = riders[0], found > 0, guarding and spoiled_anywhere > 0
                if own_times and self.rank == 0:
                    self._watch_stragglers(step, own_times)
        self.stop_agreed = asked
        trouble = self._trouble(step, loss, grad_norm) if skipped else None
        if trouble is None and not skipped and loss_value is not None:
            spike = self.guard.judge(step, loss_value)
            trouble = spike.describe() if spike is not None else None
        self.checkpointer.wait_for_staging()  # a background save may still be copying the weights
        self._held = None
        for opt in self.optimizers:
            if not skipped and trouble is None:
                opt.step()
            opt.zero_grad(set_to_none=True)
        self._held = (step, self.sampler.state_dict())
        if trouble is not None:
            self._held = None  # its state is not the step's, and a rollback replaces it
            raise RollBack(step, trouble)
        if not skipped:
            self._nonfinite_in_a_row = 0
        end = time.perf_counter()
        step_time = end - start
        # Throughput as a user gets it: wall time since the previous step ended, so a checkpoint
        # save or a hook between steps lowers it; the step's own time for an attempt's first step.
        since = self._last_step_end[1] if self._last_step_end and self._last_step_end[0] == step - 1 else start
        self._last_step_end = (step, end)
        metrics: dict[str, Any] = {}
        if self.rank == 0:
            tokens_per_s = self.tokens_per_step / (end - since)
            metrics = {
                "step": step,
                "loss": loss.item(),
                "lr": lr,
                "grad_norm": grad_norm.item(),
                **({"skipped": True} if skipped else {}),
                "tokens_per_s": tokens_per_s,
                "mfu": mfu(tokens_per_s, self.spec.model, self.peak_flops * self.world_size),
                "step_time": step_time,
                "memory_mb": self._peak_memory_mb(end),
            }
            if self.events is not None:
                # JSON has no NaN: a skipped step's loss or norm is reported as null.
                self.events.emit("metrics", **{k: _finite_or_none(v) for k, v in metrics.items()})
            say(step_line(metrics, self.spec.train.steps))
        for hook in self.hooks:
            hook.on_step_end(step, metrics)
        return metrics

    def _trouble(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> str | None:
        """Counts a step the guard skipped and reports it (rank 0); once too many came in a row,
        the reason to roll back: the model is diverging, which skipping more batches would not cure."""
        self.nonfinite_skipped += 1
        self._nonfinite_in_a_row += 1
        what = f"loss {loss.item():.4g}, gradient norm {grad_norm.item():.4g}"
        # This rank's own figures may be finite: the verdict is any rank's.
        mine = math.isfinite(loss.item()) and math.isfinite(grad_norm.item())
        reason = f"not finite on another rank (rank {self.rank} saw {what})" if mine else f"{what}: not finite"
        if self.rank == 0:
            say(f"step {step}: {reason}; its optimizer step was skipped on every rank")
            if self.events is not None:
                self.events.emit(
                    "step_skipped", step=step, reason=reason, skipped=self.nonfinite_skipped,
                    in_a_row=self._nonfinite_in_a_row,
                )  # fmt: skip
        limit = self.spec.guard.max_nonfinite_in_a_row
        if self._nonfinite_in_a_row >= limit:
            return f"the loss or gradient norm was not finite at {limit} steps in a row (the last, step {step}: {what})"
        return None

    def _watch_stragglers(self, step: int, own_times: list[float]) -> None:
        """Rank 0 reports each rank that became a straggler, or is back in line, at this step."""
        for change in self.stragglers.observe(own_times):
            figures = change.as_event()
            if change.slow:
                say(
                    f"step {step}: rank {change.rank} straggles: {change.own_s * 1000:.0f} ms of its own a step against "
                    f"the others' {change.others_s * 1000:.0f} ms, {change.steps} steps in a row"
                )
            if self.events is not None:
                self.events.emit("straggler" if change.slow else "straggler_cleared", step=step, **figures)

    def _peak_memory_mb(self, now: float) -> float:
        """The rank's peak memory, read at most once a second: reading it costs ~80 µs on CPU
        (the kernel writes out /proc/self/status), 0.2% of a 44 ms `tiny` step, and a peak moves
        only in a run's first steps."""
        value, read_at = self._memory_mb
        if now - read_at >= 1.0:
            value = device_peak_memory_mb(self.device)
            self._memory_mb = (value, now)
        return value

    # --- The run --------------------------------------------------------------------------------

    def _on_commit(self, step: int, location: str) -> None:
        say(f"checkpoint step {step} committed at {location}")
        if self.events is not None:
            # The checkpoint's own evaluation, when one ran at its step: sorts checkpoints by it.
            evaluated = {"eval_loss": self._eval_losses[step]} if step in self._eval_losses else {}
            self.events.emit("checkpoint", step=step, path=location, **evaluated)

    def trainer_state(self) -> dict[str, Any]:
        """What a checkpoint's fathom.json keeps beside the tensors (the checkpointer adds the spec)."""
        return {"sampler": self.sampler.state_dict(), "guard": self.guard.state_dict()}

    def _memory_step(self, newer_than: int, before: int | None = None) -> tuple[int, int] | None:
        """(step, the rank whose snapshot this rank restores) for the newest step (before `before`,
        if given) every rank can restore from memory (its own snapshot or a replica's on its
        host), if newer than `newer_than`."""
        if self.snapshots is None:
            return None
        held = {step: source for step, source in self.snapshots.available().items() if before is None or step < before}
        common = max(held, default=-1)
        if self.distributed:
            (newest,) = agreed([common], dist.ReduceOp.MIN, device=self.device.torch_device)
            common = int(newest)
        everyone = common in held
        if self.distributed:
            everyone = agreed([everyone], dist.ReduceOp.MIN, device=self.device.torch_device) == [1.0]
        return (common, held[common]) if everyone and common > newer_than else None

    def resume(self) -> int:
        """Loads the newest state there is, if any: the ranks' in-memory snapshots when every rank
        holds one newer than the newest committed checkpoint, else that checkpoint. Returns the
        step it holds (or 0)."""
        if self.rank == 0:
            self.checkpointer.remove_uncommitted()  # torn saves of an earlier attempt
        if self.distributed:
            dist.barrier()  # every rank sees the same checkpoints folder from here on
        env = RankEnvironment.from_environ()
        self._uncovered_failures = env.attempt if env is not None else 0  # unless a snapshot tells better
        restored = self._restore()
        if restored is None:
            return 0
        step, source, extra = restored
        self.guard.load_state_dict(extra.get("guard"))
        if source == "memory":
            # A snapshot taken as the last attempt failed covered that failure; a periodic one did not.
            self._uncovered_failures = extra["uncovered_failures"] + (0 if extra["at_failure"] else 1)
            kind = "taken at the failure" if extra["at_failure"] else "in-memory snapshot"
            if self.rank == 0:
                say(f"resumed from the {kind} of step {step}")
            if self.events is not None:
                self.events.emit("resumed", step=step, source="memory", at_failure=extra["at_failure"])
        else:
            if self.rank == 0:
                say(f"resumed from step {step} ({source})")
            if self.events is not None:
                self.events.emit("resumed", step=step, path=source)
        return step

    def _restore(self, before: int | None = None) -> tuple[int, str, dict[str, Any]] | None:
        """Loads the newest saved state (before step `before`, if given): every rank's in-memory
        snapshot where one is newer than the newest committed checkpoint, else that checkpoint.
        Returns (its step, "memory" or the checkpoint's location, what was saved beside the
        tensors), or None where there is none."""
        checkpoint = self.checkpointer.latest_step(before=before)
        in_memory = self._memory_step(0 if checkpoint is None else checkpoint, before=before)
        if in_memory is not None:
            assert self.snapshots is not None
            memory_step, source = in_memory
            extra = self.snapshots.restore(memory_step, source)
            self.sampler.load_state_dict(extra["sampler"])
            set_rng_state(extra["rng"])
            self._resumed_policy = extra["checkpoint_policy"]
            return memory_step, "memory", extra
        if checkpoint is None:
            return None
        state = self.checkpointer.load(checkpoint)
        self.sampler.load_state_dict(state["sampler"])
        return int(state["step"]), self.checkpointer.location(checkpoint), state

    def _roll_back(self, trouble: RollBack) -> int:
        """Every rank, alike: back to the newest state saved before the trouble, the batches from
        there to it (and at least `guard.rollback_skip_batches`) skipped, the newer saves of the
        abandoned steps removed. Returns the step rolled back to."""
        guard = self.spec.guard
        self.guard.rollbacks += 1
        if self.guard.rollbacks > guard.max_rollbacks:
            raise NonRetryable(
                "training",
                f"{trouble.reason}, after {guard.max_rollbacks} rollback{'s' if guard.max_rollbacks > 1 else ''} "
                "(guard.max_rollbacks): the run keeps diverging; lower train.lr or train.grad_clip, raise "
                "train.warmup_steps, or check the data",
            )
        self.checkpointer.wait()  # a background save commits first: it may be the newest state
        before = self.guard.rollback_before(trouble.step)
        restored = self._restore(before=before)
        if restored is None:
            raise NonRetryable(
                "training", f"{trouble.reason}, and no checkpoint or snapshot from before step {before} to roll back to"
            )
        target, source, extra = restored
        self.guard.rolled_back(target, extra.get("guard"))
        skipped = self.guard.skipped_batches(trouble.step, target)
        self.sampler.skip(skipped)
        # A crash from here on must not resume the abandoned steps' state.
        if self.rank == 0:
            self.checkpointer.remove_newer_than(target)
        if self.snapshots is not None:
            self.snapshots.discard_newer_than(target)
        if self.distributed:
            dist.barrier()
        self._held = (target, self.sampler.state_dict())
        self._nonfinite_in_a_row = 0
        self._last_step_end = None
        what = f"rolled back to step {target} ({source}) and skipped {skipped} batches"
        if self.rank == 0:
            say(f"{trouble.reason}: {what} (rollback {self.guard.rollbacks} of {guard.max_rollbacks})")
        if self.events is not None:
            self.events.emit(
                "rolled_back", step=trouble.step, to_step=target, source="memory" if source == "memory" else "checkpoint",
                skipped_batches=skipped, reason=trouble.reason, rollbacks=self.guard.rollbacks,
            )  # fmt: skip
        return target

    def _snapshot_extra(self, sampler: dict[str, int], policy: CheckpointPolicy, *, at_failure: bool) -> dict[str, Any]:
        """What an in-memory snapshot keeps beside the tensors."""
        return {
            "sampler": sampler,
            "guard": self.guard.state_dict(),
            # Only LoRA's dropout draws (in forward): a periodic snapshot is taken between steps,
            # so the generators' state now is the held step's. One taken at a failure mid-step
            # keeps draws that step made, so a LoRA run with dropout resumed from it draws other
            # masks than the uninterrupted run; without dropout nothing draws.
            "rng": rng_state(),
            "checkpoint_policy": policy.state_dict(),
            "at_failure": at_failure,
            "uncovered_failures": self._uncovered_failures,
        }

    def _snapshot_at_failure(self, policy: CheckpointPolicy) -> None:
        """This rank is failing (a collective broke: a peer died, or its agent killed a hung one):
        it copies the state it still holds into memory before it exits, unless the failure came
        while the optimizer wrote that state or it holds a snapshot of that step already. A
        restart then resumes at the last step every rank finished (`MemorySnapshots`)."""
        if self.snapshots is None or self._held is None:
            return
        step, sampler = self._held
        if step == 0 or step in self.snapshots.steps():
            return
        try:
            self.snapshots.take(step, self._snapshot_extra(sampler, policy, at_failure=True))
            self.snapshots.settle()  # the process exits next: its copies from the GPU must be done
        except Exception as exc:  # the failure is what matters; the periodic snapshots remain
            print(f"fathom: no snapshot at the failure: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return
        print(f"fathom: failing; took an in-memory snapshot of step {step}", file=sys.stderr, flush=True)

    def _checkpoint_and_stop(self, step: int) -> int:
        """A scheduler asked the ranks to stop (its job's time limit is near): every rank saves
        `step` (the same step, agreed in `train_step`) and waits for its commit, so the job that
        resumes the run starts exactly here."""
        try:
            reason = self.stop_request.read_text(errors="replace").strip() if self.stop_request else ""
        except OSError:  # another node's file system may not show it yet: a peer saw it
            reason = ""
        if self.rank == 0:
            say(f"stop requested ({reason or 'no reason given'}): checkpointing step {step}")
        if self.events is not None:
            self.events.emit("stop_requested", step=step, reason=reason)
        self.checkpointer.save(step, self.trainer_state())
        self.checkpointer.close()  # waits for a background save's commit
        for hook in self.hooks:
            hook.close()
        self.stopped_at = step
        return step

    def fit(self) -> int:
        """Trains from the newest checkpoint to `train.steps`, or until a stop request (then
        `stopped_at` is set); returns the last step."""
        cfg = self.spec.train
        self._resumed_policy = None
        done = self.resume()
        snapshots = self.snapshots
        policy = CheckpointPolicy.for_run(
            self.spec, first_step=done, distributed=self.distributed, memory_snapshots=snapshots is not None,
            device=self.device.torch_device,
        )  # fmt: skip
        if self._resumed_policy is not None:
            policy.load_state_dict(self._resumed_policy)  # the disk plan goes on where the snapshot left it
        snapshot_policy = SnapshotPolicy(
            first_step=done, failures=self._uncovered_failures, distributed=self.distributed,
            device=self.device.torch_device,
        )  # fmt: skip
        self._held = (done, self.sampler.state_dict())
        step = done + 1
        while step <= cfg.steps:
            try:
                try:
                    self.train_step(step)
                except RollBack as trouble:
                    step = self._roll_back(trouble) + 1
                    policy.restart_clock()
                    snapshot_policy.restart_clock()
                    continue
                if self.eval_due(step):
                    self.evaluate(step)  # before the save, so its checkpoint event carries the eval loss
                self.checkpointer.poll()
                if snapshots is not None:
                    snapshots.settle(wait=False)  # a snapshot queued on the GPU counts once copied
                if snapshots is not None and snapshot_policy.due(step):
                    started = time.perf_counter()
                    snapshots.take(step, self._snapshot_extra(self.sampler.state_dict(), policy, at_failure=False))
                    snapshot_policy.taken(step, time.perf_counter() - started)
                if self.stop_agreed and step < cfg.steps:
                    return self._checkpoint_and_stop(step)
                if policy.due(step):
                    self.checkpointer.save(step, self.trainer_state())
                step += 1
            except Exception:
                self._snapshot_at_failure(policy)
                raise
        self.checkpointer.close()
        if self.rank == 0:
            say(f"finished step {cfg.steps}")
        if self.events is not None:
            self.events.emit("finished", step=cfg.steps)
        for hook in self.hooks:
            hook.close()
        return cfg.steps
