"""Runs side by side: their per-step curves, final and best figures, and where their specs differ.

The curves come from the events the run page draws (`metrics`: loss, tokens_per_s, mfu by step;
`eval`: eval_loss by step), read up to each run's `last_seq` at the time of reading, so a page
that then opens the run's websocket with `?after=last_seq` misses no point and repeats none.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from controlplane.exceptions import InvalidInput
from runs.goodput import ledger_of
from runs.models import Run, RunEvent

MIN_RUNS = 2
MAX_RUNS = 8
IDS_RULE = f"{MIN_RUNS} to {MAX_RUNS} different run ids, comma-separated (?ids=3,7)"
# Which event kind carries each compared metric, and whether more is better.
METRICS = {"loss": "metrics", "eval_loss": "eval", "tokens_per_s": "metrics", "mfu": "metrics"}
METRIC_KINDS = set(METRICS.values())
HIGHER_IS_BETTER = {"tokens_per_s", "mfu"}
_MISSING = object()


def check_ids(raw: str | None) -> list[int]:
    """`"3,7,7,9"` → [3, 7, 9]; anything else is a 400 naming `ids`."""
    parts = [p.strip() for p in (raw or "").split(",") if p.strip()]
    if not all(p.isdigit() and len(p) <= 18 for p in parts):
        raise InvalidInput("ids", f"must be {IDS_RULE}; got {raw!r}")
    ids = list(dict.fromkeys(int(p) for p in parts))
    if not MIN_RUNS <= len(ids) <= MAX_RUNS:
        raise InvalidInput("ids", f"must be {IDS_RULE}; got {len(ids)}")
    return ids


def flatten(spec: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"train": {"lr": 1e-3}}` → `{"train.lr": 1e-3}`; lists stay whole values."""
    flat: dict[str, Any] = {}
    for key, value in spec.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{path}."))
        else:
            flat[path] = value
    return flat


def spec_diff(runs: list[Run], all_fields: bool = False) -> list[dict[str, Any]]:
    """`[{"field": "train.lr", "values": [per run…], "differs": bool}]`, in spec order: only the
    fields whose values differ across the runs unless `all_fields`. A field one run's spec lacks
    is null there (and so differs from any value)."""
    flats = [flatten(run.spec) for run in runs]
    fields = list(dict.fromkeys(f for flat in flats for f in flat))
    rows = []
    for field in fields:
        held = [flat.get(field, _MISSING) for flat in flats]
        differs = any(v != held[0] for v in held)
        values = [None if v is _MISSING else v for v in held]
        if differs or all_fields:
            rows.append({"field": field, "values": values, "differs": differs})
    return rows


def _read(last_seqs: dict[int, int]) -> tuple[dict[int, dict[str, dict[int, float]]], dict[int, dict[str, Any]]]:
    """Each run's metrics by step (a step repeated after a restart keeps its latest value) and its
    goodput ledger (runs/goodput.py), from one read of its events up to its `last_seq`."""
    series: dict[int, dict[str, dict[int, float]]] = {pk: {m: {} for m in METRICS} for pk in last_seqs}
    events: dict[int, list[tuple[str, datetime, dict[str, Any]]]] = {pk: [] for pk in last_seqs}
    rows = (
        RunEvent.objects.filter(run_id__in=list(last_seqs))
        .order_by("seq")
        .values_list("run_id", "seq", "kind", "time", "data")
    )
    for run_id, seq, kind, time, data in rows.iterator():
        if seq > last_seqs[run_id]:
            continue
        events[run_id].append((kind, time, data))
        step = data.get("step")
        if kind not in METRIC_KINDS or not isinstance(step, int):
            continue
        for metric, metric_kind in METRICS.items():
            value = data.get(metric)
            if metric_kind == kind and isinstance(value, (int, float)) and not isinstance(value, bool):
                series[run_id][metric][step] = float(value)
    return series, {pk: ledger_of(held).as_dict() for pk, held in events.items()}


def _figures(curves: dict[str, dict[int, float]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The value at each metric's last step, and its best value with the step it came at."""
    final: dict[str, Any] = {}
    best: dict[str, Any] = {}
    for metric, points in curves.items():
        if not points:
            final[metric] = best[metric] = None
            continue
        final[metric] = {"step": max(points), "value": points[max(points)]}
        # The first step that reached the best value.
        if metric in HIGHER_IS_BETTER:
            step = max(points, key=lambda s: (points[s], -s))
        else:
            step = min(points, key=lambda s: (points[s], s))
        best[metric] = {"step": step, "value": points[step]}
    return final, best


def comparison(runs: list[Run], all_fields: bool = False) -> dict[str, Any]:
    """What `GET /api/runs/compare/` answers for these runs (in the order asked)."""
    last_seqs = {run.pk: run.last_seq for run in runs}
    series, goodputs = _read(last_seqs)
    compared = []
    for run in runs:
        curves = series[run.pk]
        final, best = _figures(curves)
        compared.append(
            {
                "id": run.pk,
                "name": run.name,
                "status": run.status,
                "layout": run.layout_label,
                "recipe": run.recipe or None,
                "tags": run.tag_names,
                "step": run.step,
                "total_steps": run.total_steps,
                "last_seq": run.last_seq,
                "series": {m: [[s, v] for s, v in sorted(points.items())] for m, points in curves.items()},
                "final": final,
                "best": best,
                "goodput": goodputs[run.pk],
            }
        )
    return {"runs": compared, "spec": spec_diff(runs, all_fields), "all_fields": all_fields}
