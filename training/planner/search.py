"""Which parallel layout to train a model with: every candidate estimated, the ones that fit ranked.

`plan()` walks every layout of the cluster's world size (dp × tp × pp, ZeRO stage 0-3, recompute
none/selective/full, micro-batch size, 1F1B or interleaved schedule), estimates each with
training/planner/layout_costs.py, ranks those that fit by step time and keeps the others with the reason
they were turned down. `explain()` puts the winner in words: where its memory and time go, and what
each alternative setting would have cost. `plan_query()` is the control plane's entry point.

No torch at import: the control plane calls this inside a request (≈ 0.2 s for 1,024 devices).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from training.config import ModelConfig, Precision, Schedule, SpecError
from training.planner.hardware import DEVICES, Cluster, GiB
from training.planner.layout_costs import (
    FATHOM,
    IMPLEMENTATIONS,
    Candidate,
    Estimate,
    Implementation,
    Rejected,
    estimate,
)
from training.planner.model_shapes import MODEL_NAMES, model_preset, num_params

# --- The search -----------------------------------------------------------------------------------

Knob = Literal["tp", "pp", "zero", "recompute", "micro_batch", "schedule"]
KNOBS: tuple[Knob, ...] = ("tp", "pp", "zero", "recompute", "micro_batch", "schedule")
MICRO_BATCHES = (1, 2, 4, 8)
MAX_STAGES_PER_RANK = 8


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# Fathom's trainer runs zero=1 as zero=2 (FSDP2 has no optimizer-only sharding; parallel/fsdp.py),
# so searching both would list every such layout twice.
ZERO_STAGES = (0, 2, 3)


def candidates(model: ModelConfig, cluster: Cluster, global_batch: int) -> Iterator[Candidate]:
    """Every layout of the world size. ZeRO > 0 without dp and micro-batch sizes that do not divide
    the local batch are not layouts at all and are skipped rather than reported."""
    world = cluster.world_size
    for tp in divisors(world):
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            local = global_batch // dp if global_batch % dp == 0 else 0
            schedules: list[tuple[Schedule, int]] = [("1f1b", 1)]
            if pp > 1:
                # Uneven splits are allowed: the first stages take one layer more (parallel/dims.py).
                schedules += [
                    ("interleaved_1f1b", v) for v in range(2, MAX_STAGES_PER_RANK + 1) if pp * v <= model.n_layers
                ]
            for zero in ZERO_STAGES if dp > 1 else (0,):
                for recompute in ("none", "selective", "full"):
                    for mb in MICRO_BATCHES if local else (1,):
                        if local and local % mb:
                            continue
                        for schedule, v in schedules:
                            yield Candidate(
                                dp=dp,
                                tp=tp,
                                pp=pp,
                                zero=zero,
                                recompute=recompute,  # type: ignore[arg-type]
                                micro_batch=mb,
                                schedule=schedule,
                                stages_per_rank=v,
                            )


def fit_reason(e: Estimate) -> str:
    need, have = e.memory.total / GiB, e.capacity / GiB
    return f"does not fit: needs {need:.1f} GiB per device, has {have:.0f} GiB ({need - have:.1f} GiB over)"


@dataclass(kw_only=True)
class PlanResult:
    model: ModelConfig
    cluster: Cluster
    global_batch: int
    precision: Precision
    impl: Implementation
    ranked: list[Estimate]  # layouts that fit, fastest first
    too_big: list[Estimate]  # estimated but over the device's memory
    refused: list[Rejected]  # refused by the run spec's rules

    @property
    def rejected(self) -> list[Rejected]:
        """Every layout turned down, with its reason."""
        return self.refused + [
            Rejected(candidate=e.candidate, reason=fit_reason(e), field="memory") for e in self.too_big
        ]

    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None

    def rejected_summary(self) -> list[dict[str, Any]]:
        """Rejections grouped by reason, most frequent first, with one example layout each."""
        groups: dict[str, list[Rejected]] = {}
        for r in self.refused:
            groups.setdefault(r.reason, []).append(r)
        out = [
            {"field": rs[0].field, "reason": reason, "count": len(rs), "example": rs[0].candidate.label()}
            for reason, rs in groups.items()
        ]
        if self.too_big:
            smallest = min(self.too_big, key=lambda e: e.memory.total)
            out.append(
                {
                    "field": "memory",
                    "reason": fit_reason(smallest) + " (the smallest of them)",
                    "count": len(self.too_big),
                    "example": smallest.label,
                }
            )
        return sorted(out, key=lambda g: -g["count"])

    def explain(self) -> str:
        return explain(self)


def plan(
    model: ModelConfig,
    cluster: Cluster,
    global_batch: int,
    *,
    precision: Precision = "bf16",
    impl: Implementation = FATHOM,
    only: Iterable[Candidate] | None = None,
) -> PlanResult:
    """Estimates every candidate (or `only` these) and ranks those that fit by step time."""
    ranked: list[Estimate] = []
    too_big: list[Estimate] = []
    refused: list[Rejected] = []
    for cand in only if only is not None else candidates(model, cluster, global_batch):
        result = estimate(model, cluster, global_batch, cand, precision, impl)
        if isinstance(result, Rejected):
            refused.append(result)
        elif result.fits:
            ranked.append(result)
        else:
            too_big.append(result)
    # Ties (equal time) go to less memory, then to the simpler layout.
    ranked.sort(key=lambda e: (round(e.step_seconds, 9), e.memory.total, e.candidate.pp, e.candidate.zero))
    return PlanResult(
        model=model,
        cluster=cluster,
        global_batch=global_batch,
        precision=precision,
        impl=impl,
        ranked=ranked,
        too_big=too_big,
        refused=refused,
    )


# --- Explanation ----------------------------------------------------------------------------------


def _knob_value(c: Candidate, knob: Knob) -> Any:
    if knob == "schedule":
        return (c.schedule, c.stages_per_rank)
    return getattr(c, knob)


def _same_except(c: Candidate, best: Candidate, knob: Knob) -> bool:
    free = {"dp", knob}
    if knob in ("schedule", "pp"):
        free |= {"schedule", "stages_per_rank"}
    return all(getattr(c, f.name) == getattr(best, f.name) for f in dataclasses.fields(Candidate) if f.name not in free)


def _value_text(knob: Knob, value: Any) -> str:
    if knob == "schedule":
        name, v = value
        return f"{name}×{v}" if v > 1 else name
    return f"{knob}={value}"


def alternatives(result: PlanResult, knob: Knob) -> list[tuple[str, str]]:
    """For each other value of `knob`, the best layout otherwise like the winner, in words. Of the
    values the run spec refuses, only the nearest on either side are named: they bound the choice."""
    best = result.best()
    if best is None:
        return []
    chosen = _knob_value(best.candidate, knob)
    options: dict[Any, tuple[float, str]] = {}
    for e in result.ranked[1:] + result.too_big:
        value = _knob_value(e.candidate, knob)
        if value == chosen or not _same_except(e.candidate, best.candidate, knob):
            continue
        if e.fits:
            text, order = f"{e.step_seconds / best.step_seconds - 1:+.0%} step time ({e.label})", e.step_seconds
        else:
            text, order = fit_reason(e), float("inf")
        if value not in options or order < options[value][0]:
            options[value] = (order, text)
    refused: dict[Any, str] = {}
    for r in result.refused:
        value = _knob_value(r.candidate, knob)
        if value != chosen and value not in options and _same_except(r.candidate, best.candidate, knob):
            refused.setdefault(value, f"refused: {r.reason}")
    below = [v for v in refused if v < chosen]
    above = [v for v in refused if v > chosen]
    for v in ([max(below)] if below else []) + ([min(above)] if above else []):
        options[v] = (float("inf"), refused[v])
    return [(_value_text(knob, v), text) for v, (_, text) in sorted(options.items(), key=lambda kv: kv[0])]


def explain(result: PlanResult) -> str:
    """The top choice in words: what it costs, where the time goes, and why each knob is set so."""
    best = result.best()
    if best is None:
        groups = result.rejected_summary()
        why = "; ".join(f"{g['count']}× {g['reason']}" for g in groups[:3])
        return f"No layout fits. Most common reasons: {why}."
    c, mem = best.candidate, best.memory
    world = result.cluster.world_size
    lines = [
        f"Best of {len(result.ranked)} layouts that fit (of {len(result.ranked) + len(result.too_big) + len(result.refused)}): "
        f"{best.label} on {world} devices.",
        f"Step {best.step_seconds:.2f} s, {best.tokens_per_second:,.0f} tokens/s, MFU {best.mfu:.0%}.",
        f"Memory per device {mem.total / GiB:.1f} of {best.capacity / GiB:.0f} GiB: weights {mem.weights / GiB:.1f}, "
        f"gradients {mem.grads / GiB:.1f}, optimizer {mem.optimizer / GiB:.1f}, activations {mem.activations / GiB:.1f}, "
        f"logits {mem.logits / GiB:.1f}, gathered and bf16 weight copies {mem.working_weights / GiB:.1f}, "
        f"recompute {mem.recompute / GiB:.1f}, runtime reserve {mem.reserved / GiB:.1f} GiB.",
        f"Time: compute {best.compute_seconds:.2f} s; tensor-parallel traffic {best.tp.exposed_seconds:.2f} s "
        f"({'within a node' if c.tp <= result.cluster.devices_per_node else 'across nodes'}); "
        f"pipeline bubble {best.bubble_fraction:.1%} and sends {best.pp.exposed_seconds:.2f} s; "
        f"data-parallel traffic {best.dp.seconds:.2f} s of which {best.dp.exposed_seconds:.2f} s is not hidden by compute.",
        "Why each setting:",
    ]
    for knob in KNOBS:
        alts = alternatives(result, knob)
        if alts:
            chosen = _value_text(knob, _knob_value(c, knob))
            lines.append(f"- {chosen}; instead " + "; ".join(f"{v}: {t}" for v, t in alts) + ".")
    return "\n".join(lines)


# --- The control plane's entry point --------------------------------------------------------------


# What `plan_query` takes, which the API schema states (runs/plan.py): a parameter left out takes
# its default; an empty one is refused like any other value it does not allow. The search walks every
# (tp, pp) pair of divisors of the world size, so a cluster past these bounds would hold a request
# for minutes (1,024 nodes × 64 devices at worst ≈ 10 s); a sequence length or batch past them
# overflows the float arithmetic of the estimates.
PRECISIONS: tuple[Precision, ...] = ("bf16", "fp32")
QUERY_MAXIMUMS: dict[str, int | None] = {"nodes": 1024, "gpus_per_node": 64, "global_batch": 1 << 20, "seq_len": 1 << 20, "top": None}


def _int(query: Mapping[str, str], name: str, default: int | None) -> int:
    raw = query.get(name)
    if raw is None:
        if default is None:
            raise SpecError(name, "is required")
        return default
    high = QUERY_MAXIMUMS[name]
    allowed = f"a positive integer up to {high:,}" if high is not None else "a positive integer"
    # Digits only: int() would also take " 8", "+8" and "8_0", which the schema's integer is not.
    if not (raw.isascii() and raw.isdigit()):
        raise SpecError(name, f"must be {allowed}; got {raw!r}")
    try:
        value = int(raw)
    except ValueError:  # more digits than int() reads (sys.get_int_max_str_digits)
        raise SpecError(name, f"must be {allowed}; got {raw[:20]}… ({len(raw)} digits)") from None
    if value < 1 or (high is not None and value > high):
        raise SpecError(name, f"must be {allowed}; got {value}")
    return value


def _choice(query: Mapping[str, str], name: str, allowed: Iterable[str], default: str) -> str:
    value = query.get(name, default)
    allowed = tuple(allowed)
    if value not in allowed:
        raise SpecError(name, f"must be one of {', '.join(allowed)}; got {value!r}")
    return value


def plan_query(query: Mapping[str, str]) -> dict[str, Any]:
    """`GET /api/plan?model=70b&nodes=128&gpus_per_node=8&gpu=h100&global_batch=1024[&seq_len=8192]
    [&precision=bf16][&trainer=fathom|before-fixes][&top=10]`: plain query strings in, a JSON-ready dict out.

    Raises `SpecError` (with `.field` naming the query parameter) for a bad value."""
    model = model_preset(_choice(query, "model", MODEL_NAMES, "8b"))
    gpu = _choice(query, "gpu", DEVICES, "h100")
    seq_len = _int(query, "seq_len", model.seq_len)
    if seq_len != model.seq_len:
        model = dataclasses.replace(model, seq_len=seq_len)
    cluster = Cluster(
        device=DEVICES[gpu], nodes=_int(query, "nodes", 1), devices_per_node=_int(query, "gpus_per_node", 8)
    )
    precision: Precision = _choice(query, "precision", PRECISIONS, "fp32" if gpu == "cpu" else "bf16")  # type: ignore[assignment]
    impl = IMPLEMENTATIONS[_choice(query, "trainer", IMPLEMENTATIONS, "fathom")]
    result = plan(model, cluster, _int(query, "global_batch", None), precision=precision, impl=impl)
    return result_to_dict(result, top=_int(query, "top", 10))


def result_to_dict(result: PlanResult, top: int = 10) -> dict[str, Any]:
    m, c = result.model, result.cluster
    return {
        "model": {**dataclasses.asdict(m), "num_params": num_params(m)},
        "cluster": {**dataclasses.asdict(c), "world_size": c.world_size},
        "global_batch": result.global_batch,
        "precision": result.precision,
        "trainer": dataclasses.asdict(result.impl),
        "counts": {"fit": len(result.ranked), "too_big": len(result.too_big), "refused": len(result.refused)},
        "ranked": [e.to_dict() for e in result.ranked[:top]],
        "rejected": result.rejected_summary(),
        "explanation": result.explain(),
    }
