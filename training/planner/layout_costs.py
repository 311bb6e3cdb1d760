"""What one training layout costs: memory per device, traffic per mesh dimension, step time.

`estimate()` takes a Llama-style `ModelConfig`, a `Cluster`, a global batch and one `Candidate`
layout (dp × tp × pp, ZeRO stage, recompute, micro-batch size, pipeline schedule) and returns an
`Estimate`, or a `Rejected` carrying the reason `RunSpec`'s own rules refuse it, so the planner
never proposes a layout the trainer would not run.

The model follows what Fathom's trainer does (training/model.py, training/parallel/):

* Mesh order (pp, dp, tp), tp innermost: a tp group is `tp` consecutive ranks, so it stays on one
  node while tp ≤ devices per node; a dp group spans tp·dp consecutive ranks, a pp group all of them.
* Tensor parallelism is Megatron's with sequence parallelism, written with DTensor: norms run on
  sequence slices, attention and the MLP all-gather the sequence at their input and reduce-scatter
  their output. Unlike Megatron, the gathered input is what the projections save for backward, so
  those two tensors per layer do not shrink with tp. The output head gathers full-vocabulary logits.
* Pipeline stages own contiguous layers, the first stages one extra when uneven; pp rank r runs
  stages r, r+pp, … (interleaved). The first stage holds the embedding, the last the output head.
* Precision "bf16" is autocast over fp32 parameters: weights, gradients and AdamW's moments stay
  fp32 (the weights are their own master copy), matmuls and attention run in bf16, and the
  residual stream and norms stay fp32. Autocast's bf16 copies of the weights are saved for
  backward, so they live from forward to backward whatever the ZeRO stage.
* ZeRO 1-3 are FSDP2 (training/parallel/fsdp.py): parameters, gradients and optimizer state are
  sharded over dp between steps at every stage; 1 and 2 keep each pass's gathered weights until
  backward (FSDP2 has no optimizer-only mode, so 1 runs as 2), 3 frees them after each block's
  forward and gathers again for backward. Gathers and reductions move fp32.

Everything here is arithmetic on plain numbers, with no torch at import. Sizes are bytes and
seconds unless a name says otherwise. The search over layouts is in training/planner/search.py; the hardware is described in
training/planner/hardware.py, the model's parts and the activations they save in
training/planner/model_shapes.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from training.config import (
    LayoutConfig,
    ModelConfig,
    NodesConfig,
    Precision,
    Recompute,
    RunSpec,
    Schedule,
    SpecError,
    TrainConfig,
)
from training.planner.hardware import Cluster, GiB
from training.planner.model_shapes import (
    TOKEN_IDS_BYTES,
    Shape,
    layer_saved,
    layer_saved_for,
    model_flops_per_token,
    output_saved,
    saved_per_token,
)

# --- Layouts --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One point of the search: the layout knobs plus how the local batch is cut into micro-batches."""

    dp: int
    tp: int
    pp: int
    zero: int
    recompute: Recompute
    micro_batch: int  # sequences per forward/backward pass
    schedule: Schedule = "1f1b"
    stages_per_rank: int = 1

    def label(self) -> str:
        sched = (
            ""
            if self.pp == 1
            else f" {self.schedule}" + (f"×{self.stages_per_rank}" if self.stages_per_rank > 1 else "")
        )
        return f"dp{self.dp} tp{self.tp} pp{self.pp} zero{self.zero} {self.recompute} mb{self.micro_batch}{sched}"

    def spec(self, model: ModelConfig, cluster: Cluster, global_batch: int, precision: Precision) -> RunSpec:
        """The run spec the trainer would get; raises `SpecError` where its rules refuse the layout.

        Without a pipeline the micro-batches are gradient-accumulation passes; with one, they are
        the schedule's micro-batches of a single pass (grad_accum = 1)."""
        local = global_batch // self.dp if global_batch % self.dp == 0 else 0
        if local == 0:
            raise SpecError(
                "train.global_batch",
                f"must be divisible by layout.dp; got global_batch={global_batch}, dp={self.dp}",
            )
        if local % self.micro_batch:
            raise SpecError(
                "micro_batch",
                f"must divide the per-replica batch global_batch/dp = {local}; got {self.micro_batch}",
            )
        n_micro = local // self.micro_batch
        pipelined = self.pp > 1
        layout = LayoutConfig(
            dp=self.dp,
            tp=self.tp,
            pp=self.pp,
            zero=self.zero,
            schedule=self.schedule,
            microbatches=n_micro if pipelined else 1,
            stages_per_rank=self.stages_per_rank,
            recompute=self.recompute,
            precision=precision,
        )
        return RunSpec(
            model=model,
            layout=layout,
            train=TrainConfig(global_batch=global_batch, grad_accum=1 if pipelined else n_micro),
            nodes=NodesConfig(min=cluster.nodes, max=cluster.nodes, nproc_per_node=cluster.devices_per_node),
        )


@dataclass(frozen=True, kw_only=True)
class Memory:
    """Bytes one device holds at its peak, by what they are for."""

    weights: float  # fp32 weights (also the master copy under bf16 autocast), sharded by FSDP
    grads: float
    optimizer: float  # AdamW's two fp32 moments
    activations: float  # saved for backward, summed over the micro-batches in flight
    logits: float  # the head's full-vocabulary logits, alive beside the log-probabilities while the loss runs
    working_weights: float  # FSDP-gathered weights and autocast's bf16 copies (see `working_weights`)
    recompute: float  # one block's activations, rebuilt in backward under recompute
    reserved: float  # runtime context, communicator buffers, fragmentation

    @property
    def transient(self) -> float:
        """Working buffers on top of what is held between steps and saved for backward."""
        return self.logits + self.working_weights + self.recompute

    @property
    def total(self) -> float:
        return self.states + self.activations + self.transient + self.reserved

    @property
    def states(self) -> float:
        """Weights, gradients and optimizer states: what the trainer's tensors hold between steps."""
        return self.weights + self.grads + self.optimizer


@dataclass(frozen=True, kw_only=True)
class Traffic:
    """Bytes one device sends per step along one mesh dimension, and the time it takes."""

    bytes: float
    seconds: float  # on the wire
    exposed_seconds: float  # what compute does not hide
    collectives: list[str]

    @classmethod
    def none(cls) -> Traffic:
        return cls(bytes=0.0, seconds=0.0, exposed_seconds=0.0, collectives=[])


@dataclass(frozen=True, kw_only=True)
class Estimate:
    candidate: Candidate
    memory: Memory  # the pipeline rank that needs most
    stage_memory: dict[str, Memory]  # "first" and "last" pipeline rank (the same rank without PP)
    dp: Traffic
    tp: Traffic
    pp: Traffic
    compute_seconds: float  # matmul time of one step on the busiest device, recompute included
    bubble_fraction: float  # pipeline idle time relative to compute: (pp-1)/(micro-batches·stages_per_rank)
    step_seconds: float
    mfu: float
    tokens_per_second: float
    fits: bool
    capacity: float  # device memory, bytes

    @property
    def label(self) -> str:
        return self.candidate.label()

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["label"] = self.label
        out["memory"]["total"] = self.memory.total
        for name, mem in self.stage_memory.items():
            out["stage_memory"][name]["total"] = mem.total
        return out


@dataclass(frozen=True, kw_only=True)
class Rejected:
    candidate: Candidate
    reason: str
    field: str  # "memory" or the spec field that refused it (layout.tp, train.global_batch, …)

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.candidate.label(),
            "field": self.field,
            "reason": self.reason,
            "candidate": dataclasses.asdict(self.candidate),
        }


# --- The estimate ---------------------------------------------------------------------------------


def ring(n: int) -> float:
    """Share of a tensor each rank sends in a ring all-gather or reduce-scatter over n ranks."""
    return (n - 1) / n


@dataclass(frozen=True)
class RankShare:
    """What pipeline rank r owns."""

    layers: int  # over all its virtual stages
    chunks: int  # virtual stages
    embedding: bool
    head: bool


def rank_shares(s: Shape, pp: int, stages_per_rank: int) -> dict[str, RankShare]:
    """The first and last pipeline ranks, which bound memory (most in flight / the head) and time.

    The split is `training.parallel.dims.stage_layers`' (contiguous, extras to the first stages),
    written again because importing `training.parallel` loads torch; a test keeps the two equal."""
    n_stages = pp * stages_per_rank
    base, extra = divmod(s.L, n_stages)

    def layers_of(r: int) -> int:
        return sum(base + (1 if stage < extra else 0) for stage in range(r, n_stages, pp))

    first = RankShare(layers_of(0), stages_per_rank, True, pp == 1)
    last = RankShare(layers_of(pp - 1), stages_per_rank, pp == 1, True)
    return {"first": first, "last": last}


# Every parameter stays fp32 in Fathom's trainer (bf16 is autocast), so each costs 4 bytes of
# weight, 4 of gradient and 8 of AdamW moments; the weight is its own fp32 master copy.
WEIGHT_BYTES, GRAD_BYTES, MOMENT_BYTES = 4.0, 4.0, 8.0
RESIDUAL_BYTES = 4  # the residual stream (and what is gathered or sent of it) stays fp32 under autocast


def state_bytes(params: float, dp: int, zero: int) -> tuple[float, float, float]:
    """(weights, grads, optimizer) bytes held between steps for `params` parameters.

    16 bytes per parameter replicated (zero 0); FSDP2 shards all three over dp at zero 1-3."""
    n = float(dp) if zero >= 1 else 1.0
    return params * WEIGHT_BYTES / n, params * GRAD_BYTES / n, params * MOMENT_BYTES / n


@dataclass(frozen=True, kw_only=True)
class Implementation:
    """Trainer behaviours that change the cost of a layout without changing the layout.

    The defaults are Fathom's trainer as it is (measured by tests/planner/calibration.py).
    `BEFORE_FIXES` is the trainer as first measured, before three changes the planner pointed to:
    `schedule.step(..., return_outputs=False)`, FSDP2's `MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32)` in place of autocast over FSDP, and the embedding's gradient kept
    vocabulary-split under tensor parallelism."""

    # True: the last pipeline stage keeps every micro-batch's logits until the step ends.
    pipeline_keeps_outputs: bool = False
    # bf16 under FSDP: False = autocast over fp32 gathered weights (fp32 gathers, bf16 copies saved
    # for backward); True = FSDP gathers bf16 weights and computes on them (no copies).
    fsdp_bf16_params: bool = True
    # True: the vocabulary-split embedding's gradient comes back replicated (DTensor's default).
    replicated_embedding_grad: bool = False

    def gathered_weight_bytes(self, precision: Precision) -> float:
        return 2.0 if (self.fsdp_bf16_params and precision == "bf16") else WEIGHT_BYTES


FATHOM = Implementation()
BEFORE_FIXES = Implementation(pipeline_keeps_outputs=True, fsdp_bf16_params=False, replicated_embedding_grad=True)
IMPLEMENTATIONS = {"fathom": FATHOM, "before-fixes": BEFORE_FIXES}


def working_weights(
    params: float, unit: float, pp: int, zero: int, precision: Precision, impl: Implementation = FATHOM
) -> float:
    """Weight copies alive at the peak, beyond the at-rest shards.

    zero 1/2 keep the whole gathered stage from forward to backward; zero 3 holds the block
    running and the one prefetched, plus the unsharded gradient of one; under a pipeline, FSDP does
    not reshard after backward until the last micro-batch, so the whole stage is gathered again.
    Under bf16 autocast, the bf16 copies of every weight the rank computes with are saved for
    backward (unless FSDP gathers bf16 weights itself)."""
    w = impl.gathered_weight_bytes(precision)
    gathered = 0.0
    if zero in (1, 2) or (zero == 3 and pp > 1):
        gathered = params * w
    elif zero == 3:
        gathered = unit * (2 * w + GRAD_BYTES)
    copies = precision == "bf16" and not (impl.fsdp_bf16_params and zero >= 1)
    return gathered + (params * 2.0 if copies else 0.0)


def estimate(
    model: ModelConfig,
    cluster: Cluster,
    global_batch: int,
    cand: Candidate,
    precision: Precision = "bf16",
    impl: Implementation = FATHOM,
) -> Estimate | Rejected:
    """The estimate of one candidate, or why the trainer's rules refuse it."""
    try:
        spec = cand.spec(model, cluster, global_batch, precision)
    except SpecError as exc:
        return Rejected(candidate=cand, reason=f"{exc.field}: {exc.message}", field=exc.field)
    return _estimate(spec, cluster, cand, impl)


def _estimate(spec: RunSpec, cluster: Cluster, cand: Candidate, impl: Implementation) -> Estimate:
    m, lay = spec.model, spec.layout
    s = Shape.of(m)
    dev = cluster.device
    tp, pp, dp, v = lay.tp, lay.pp, lay.dp, lay.stages_per_rank
    act_b = 2 if lay.precision == "bf16" else 4
    b = cand.micro_batch
    tokens_mb = b * s.s  # tokens per micro-batch
    n_mb = spec.train.global_batch // dp // b  # micro-batches per step on one replica
    m_pipe = lay.microbatches  # micro-batches per pipeline flush (= n_mb when pp > 1)
    shares = rank_shares(s, pp, v)

    layer_act = tokens_mb * saved_per_token(layer_saved_for(lay.recompute, s), tp, act_b)
    layer_act_none = tokens_mb * saved_per_token(layer_saved(s), tp, act_b)
    out_act = tokens_mb * saved_per_token(output_saved(s), tp, act_b)
    layer_params = s.layer_split_params() / tp + s.layer_norm_params()
    emb_params = s.V * s.h / tp

    def in_flight(rank: int) -> float:
        """Micro-batches (in whole-rank units) whose activations pp rank `rank` holds at its peak."""
        if pp == 1:
            return 1.0
        if lay.schedule == "gpipe":
            return float(m_pipe)
        if lay.schedule == "interleaved_1f1b":
            # Warm-up of the interleaved schedule: (v-1)·pp + 2·(pp-1-r) chunk forwards, plus the one
            # in progress; a chunk is 1/v of the rank's layers. Rank 0 holds 1 + (pp-1)/(pp·v) ranks'
            # worth of a micro-batch per layer, as Korthikanti et al. give.
            return min(m_pipe * v, (v - 1) * pp + 2 * (pp - 1 - rank) + 1) / v
        return float(min(m_pipe, pp - rank))

    stage_memory: dict[str, Memory] = {}
    for name, share in shares.items():
        rank = 0 if name == "first" else pp - 1
        params = stage_params(s, share, tp)
        weights, grads, optimizer = state_bytes(params, dp, lay.zero)
        if share.embedding and tp > 1 and lay.zero == 0 and impl.replicated_embedding_grad:
            # DTensor's embedding backward returns the vocabulary-split weight's gradient replicated:
            # every tp rank holds it whole (measured; see tests/planner).
            grads += s.V * s.h * GRAD_BYTES * (1 - 1 / tp)
        act = in_flight(rank) * share.layers * layer_act
        if share.embedding:
            act += in_flight(rank) * tokens_mb * TOKEN_IDS_BYTES
        if pp > 1:
            # The schedule keeps each in-flight chunk's output until its backward: an fp32 sequence
            # slice per chunk, except the model's last, whose output is the logits (below).
            chunks = in_flight(rank) * v - (1 if share.head else 0)
            act += chunks * tokens_mb * s.h * RESIDUAL_BYTES / tp
        if share.head:
            # gpipe keeps every micro-batch's log-probabilities; 1F1B runs each loss's backward at once.
            act += (m_pipe if (pp > 1 and lay.schedule == "gpipe") else 1) * out_act
            if pp > 1 and impl.pipeline_keeps_outputs:
                # torch's schedules keep every micro-batch's logits on the last stage to return them
                # merged from step() (Fathom does not pass return_outputs=False).
                act += (m_pipe - 1) * tokens_mb * s.V * act_b
        stage_memory[name] = Memory(
            weights=weights,
            grads=grads,
            optimizer=optimizer,
            activations=act,
            logits=_loss_logits(tokens_mb, s.V, tp, act_b) if share.head else 0.0,
            working_weights=working_weights(params, max(layer_params, emb_params), pp, lay.zero, lay.precision, impl),
            recompute=0.0 if lay.recompute == "none" else layer_act_none,
            reserved=dev.reserved_gib * GiB,
        )
    memory = max(stage_memory.values(), key=lambda mem: mem.total)

    # Compute: hardware FLOPs of the busiest rank per micro-batch (forward + backward, plus the
    # forward again for fully recomputed blocks), at the sustained matmul rate.
    layer_flops = 6.0 * s.layer_matmul_params() + 12.0 * s.a * s.head_size * s.s  # per token
    if lay.recompute == "full":
        layer_flops += layer_flops / 3
    rate = dev.peak_flops(lay.precision) * dev.matmul_efficiency
    mb_flops = max(
        tokens_mb * (sh.layers * layer_flops + (6.0 * s.V * s.h if sh.head else 0)) / tp for sh in shares.values()
    )
    mb_compute = mb_flops / rate

    tp_traffic, tp_mb_seconds = _tp_traffic(cluster, s, shares, lay.recompute, tp, tokens_mb, act_b, n_mb)

    # Pipeline: each chunk sends its output forward (unless it is the model's last) and its input
    # gradient back (unless it is the first): the fp32 residual stream's sequence slice under tp.
    # With two ranks each sends 2v-1 per micro-batch, a middle rank 2v. Sends sit on the critical path.
    pp_bw, pp_lat = cluster.link(tp * dp * pp)
    hop_bytes = tokens_mb * s.h * RESIDUAL_BYTES / tp
    sends = (2 * v - 1 if pp == 2 else 2 * v) if pp > 1 else 0
    pp_mb_seconds = sends * (hop_bytes / pp_bw + pp_lat)
    pp_traffic = Traffic(
        bytes=n_mb * sends * hop_bytes,
        seconds=n_mb * pp_mb_seconds,
        exposed_seconds=n_mb * pp_mb_seconds,
        collectives=[f"{sends} sends per micro-batch"] if pp > 1 else [],
    )

    mb_seconds = mb_compute + tp_mb_seconds + pp_mb_seconds
    bubble = (pp - 1) / (m_pipe * v) if pp > 1 else 0.0
    busiest_share = max(shares.values(), key=lambda sh: stage_params(s, sh, tp))
    head_params = emb_params + s.h if busiest_share.head else 0.0
    dp_traffic = _dp_traffic(
        lay,
        cluster,
        stage_params(s, busiest_share, tp),
        head_params,
        n_mb,
        mb_compute,
        impl.gathered_weight_bytes(lay.precision),
    )
    step = n_mb * mb_seconds * (1 + bubble) + dp_traffic.exposed_seconds
    tokens = spec.train.global_batch * s.s
    mfu = model_flops_per_token(m) * tokens / (step * cluster.world_size * dev.peak_flops(lay.precision))
    capacity = dev.memory_gib * GiB
    return Estimate(
        candidate=cand,
        memory=memory,
        stage_memory=stage_memory,
        dp=dp_traffic,
        tp=tp_traffic,
        pp=pp_traffic,
        compute_seconds=n_mb * mb_compute,
        bubble_fraction=bubble,
        step_seconds=step,
        mfu=mfu,
        tokens_per_second=tokens / step,
        fits=memory.total <= capacity,
        capacity=capacity,
    )


def _loss_logits(tokens: int, vocab: int, tp: int, act_b: int) -> float:
    """Logits alive beside the saved log-probabilities while the loss runs: the gathered logits,
    each tp rank's vocabulary slice they were gathered from, and their fp32 copy under bf16."""
    gathered = tokens * vocab * act_b
    shard = gathered / tp if tp > 1 else 0.0
    upcast = tokens * vocab * 4 if act_b != 4 else 0.0
    return gathered + shard + upcast


def stage_params(s: Shape, share: RankShare, tp: int) -> float:
    """Parameters one tp rank of a pipeline rank holds (before FSDP sharding)."""
    layer = s.layer_split_params() / tp + s.layer_norm_params()
    emb = s.V * s.h / tp
    shared = emb if (s.tied and share.embedding and share.head) else 0  # a tied head is the embedding
    return share.layers * layer + (emb if share.embedding else 0) + (emb + s.h if share.head else 0) - shared


def _tp_traffic(
    cluster: Cluster,
    s: Shape,
    shares: Mapping[str, RankShare],
    recompute: Recompute,
    tp: int,
    tokens_mb: int,
    act_b: int,
    n_mb: int,
) -> tuple[Traffic, float]:
    """Tensor-parallel traffic per step of the busiest rank, and its seconds per micro-batch.

    Per block and micro-batch, forward all-gathers the fp32 sequence slices twice (attention and MLP
    inputs) and reduce-scatters the matmul outputs twice; backward reduce-scatters the gathered
    inputs' fp32 gradients and all-gathers the outputs' gradients. Recompute replays the forward's
    gathers (selective: the reduce-scatter outputs are kept), and full recompute the first
    reduce-scatter too. The embedding and
    the head add a reduce-scatter/all-gather pair each, and the head all-gathers its logits."""
    if tp == 1:
        return Traffic.none(), 0.0
    hidden = float(tokens_mb * s.h)  # elements of one micro-batch's hidden states, whole sequence
    per_layer = hidden * (4 * RESIDUAL_BYTES + 4 * act_b)
    colls = 8
    if recompute == "selective":
        per_layer += hidden * 2 * RESIDUAL_BYTES
        colls += 2
    elif recompute == "full":
        # The checkpoint stops recomputing once it has rebuilt what backward needs (the down_proj
        # input), so the block's last reduce-scatter is not replayed.
        per_layer += hidden * (2 * RESIDUAL_BYTES + act_b)
        colls += 3
    busiest = max(shares.values(), key=lambda sh: sh.layers + (1 if sh.head else 0))
    ends = int(busiest.embedding) + int(busiest.head)
    mb_bytes = ring(tp) * (
        per_layer * busiest.layers
        + ends * 2 * hidden * RESIDUAL_BYTES
        + (tokens_mb * s.V * act_b if busiest.head else 0)
    )
    n_colls = colls * busiest.layers + 2 * ends + int(busiest.head)
    bw, lat = cluster.link(tp)
    mb_seconds = mb_bytes / bw + n_colls * lat
    traffic = Traffic(
        bytes=n_mb * mb_bytes,
        seconds=n_mb * mb_seconds,
        exposed_seconds=n_mb * mb_seconds,  # on the critical path: the next matmul waits for it
        collectives=[f"{colls} all-gather/reduce-scatter per block per micro-batch"],
    )
    return traffic, mb_seconds


def _dp_traffic(
    lay: LayoutConfig,
    cluster: Cluster,
    params: float,
    head_params: float,
    n_mb: int,
    mb_compute: float,
    weight_bytes: float = WEIGHT_BYTES,
) -> Traffic:
    """Data-parallel traffic of the rank with most parameters, and what of it compute does not hide.

    zero 0 all-reduces fp32 gradients once per step (each rank sends 2·(n-1)/n of them), overlapped
    with the last micro-batch's backward when `overlap_grad_reduce` is on. FSDP (zero 1-3)
    reduce-scatters gradients once per step, likewise overlapped, and all-gathers fp32 weights: once
    per accumulation pass (zero 1/2; once per step under a pipeline, whose stage stays gathered) or
    twice per micro-batch (zero 3: forward, then again for backward; the final norm and head, which
    FSDP keeps whole from forward to backward, once). Gathers are prefetched block by block, so they
    hide under their pass's compute when the link keeps up."""
    dp = lay.dp
    if dp == 1:
        return Traffic.none()
    grad_bytes = params * GRAD_BYTES
    bw, lat = cluster.link(lay.tp * dp)
    backward_window = mb_compute * 2 / 3 if lay.overlap_grad_reduce else 0.0
    if lay.zero == 0:
        reduce_s = 2 * ring(dp) * grad_bytes / bw + lat
        return Traffic(
            bytes=2 * ring(dp) * grad_bytes,
            seconds=reduce_s,
            exposed_seconds=max(0.0, reduce_s - backward_window),
            collectives=["all-reduce gradients"],
        )
    reduce_s = ring(dp) * grad_bytes / bw + lat
    if lay.zero == 3:
        passes, per_pass = n_mb, 2 * params - head_params
    elif lay.pp > 1:
        passes, per_pass = 1, params
    else:
        passes, per_pass = n_mb, params
    gather_bytes = ring(dp) * per_pass * weight_bytes
    gather_s = gather_bytes / bw + lat
    exposed = max(0.0, reduce_s - backward_window) + passes * max(0.0, gather_s - mb_compute)
    return Traffic(
        bytes=ring(dp) * grad_bytes + passes * gather_bytes,
        seconds=reduce_s + passes * gather_s,
        exposed_seconds=exposed,
        collectives=["reduce-scatter gradients", f"all-gather weights on {passes} passes"],
    )


def rank_memory(spec: RunSpec, device: str) -> Memory:
    """What the busiest rank of `spec` holds at its peak on a `device` of `DEVICES` ("cpu" for a
    CPU slot, any GPU preset for a GPU: only the runtime's reserve differs), by the same model the
    planner ranks layouts with; the scheduler checks it against a host's device memory."""
    from training.planner.hardware import DEVICES

    lay = spec.layout
    local = spec.train.global_batch // lay.dp
    micro = local // (lay.microbatches if lay.pp > 1 else spec.train.grad_accum)
    candidate = Candidate(
        dp=lay.dp, tp=lay.tp, pp=lay.pp, zero=lay.zero, recompute=lay.recompute, micro_batch=max(micro, 1),
        schedule=lay.schedule, stages_per_rank=lay.stages_per_rank,
    )  # fmt: skip
    cluster = Cluster(device=DEVICES[device], nodes=spec.nodes.max, devices_per_node=spec.nproc_per_node)
    return _estimate(spec, cluster, candidate, FATHOM).memory
