"""Which layout to train with: `python -m training.planner` (`python -m training.plan` also works).

    python -m training.planner --model 70b --nodes 128 --gpus-per-node 8 --gpu h100 --global-batch 1024
    python -m training.planner --model tiny --nodes 1 --gpus-per-node 2 --gpu cpu --global-batch 8 --json
    python -m training.planner report --write docs/planning.md

The first form prints the ranked layouts that fit, the top choice in words and the most common
reasons others were turned down; `--json` prints the same as the control plane's /api/plan.
`report` writes the paper-scale comparison (training/planner/paper_report.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from training.config import Precision, SpecError
from training.planner.hardware import DEVICES, Cluster, Device, GiB
from training.planner.layout_costs import FATHOM, IMPLEMENTATIONS
from training.planner.model_shapes import MODEL_NAMES, model_preset
from training.planner.search import PlanResult, plan, result_to_dict


def format_table(result: PlanResult, top: int) -> str:
    """The ranked layouts, one per line: memory per device, step time and where the time goes."""
    header = (
        f"{'#':>3}  {'layout':46} {'GiB/dev':>8} {'step s':>7} {'tokens/s':>11} {'MFU':>5} "
        f"{'bubble':>6} {'tp s':>6} {'pp s':>6} {'dp s':>6}"
    )
    lines = [header]
    for i, e in enumerate(result.ranked[:top], 1):
        lines.append(
            f"{i:>3}  {e.label:46} {e.memory.total / GiB:8.1f} {e.step_seconds:7.2f} {e.tokens_per_second:11,.0f} "
            f"{e.mfu:5.1%} {e.bubble_fraction:6.1%} {e.tp.exposed_seconds:6.2f} {e.pp.exposed_seconds:6.2f} "
            f"{e.dp.exposed_seconds:6.2f}"
        )
    return "\n".join(lines)


def format_result(result: PlanResult, top: int, rejected: int) -> str:
    m, c = result.model, result.cluster
    out = [
        f"{m.num_params() / 1e9:.2f}B parameters ({m.n_layers} layers, dim {m.dim}, {m.n_heads} heads, "
        f"{m.n_kv_heads} kv heads, ffn {m.ffn_dim}, vocab {m.vocab_size}, seq {m.seq_len}); "
        f"{c.nodes} nodes × {c.devices_per_node} {c.device.name}; global batch {result.global_batch} sequences; "
        f"{result.precision}; trainer {'as it is' if result.impl == FATHOM else 'with fixes: ' + str(result.impl)}.",
        f"{len(result.ranked)} layouts fit, {len(result.too_big)} do not fit in memory, "
        f"{len(result.refused)} are refused by the run spec's rules.",
        "",
    ]
    if result.ranked:
        out += [format_table(result, top), ""]
    out.append(result.explain())
    if rejected:
        out += ["", "Turned down (most frequent reasons):"]
        out += [f"  {g['count']:6}× {g['reason']}  (e.g. {g['example']})" for g in result.rejected_summary()[:rejected]]
    return "\n".join(out)


def load_device(path: Path) -> Device:
    """A device preset from JSON (the fields of `Device`), e.g. as `python -m training.planner.calibrate` writes."""
    data = json.loads(path.read_text())
    names = {f.name for f in dataclasses.fields(Device)}
    unknown = set(data) - names
    if unknown:
        raise SpecError("device-file", f"unknown fields {sorted(unknown)}; allowed: {', '.join(sorted(names))}")
    return Device(**data)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m training.planner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODEL_NAMES, default="8b")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu", choices=sorted(DEVICES), default="h100")
    parser.add_argument("--device-file", type=Path, help="a Device as JSON; overrides --gpu")
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, help="override the model's sequence length")
    parser.add_argument("--precision", choices=("bf16", "fp32"), help="default: fp32 on cpu, bf16 otherwise")
    parser.add_argument(
        "--trainer",
        choices=sorted(IMPLEMENTATIONS),
        default="fathom",
        help="fathom: the trainer as it is; before-fixes: before the changes layout_costs.Implementation names",
    )
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--rejected", type=int, default=5, help="how many rejection reasons to list")
    parser.add_argument("--json", action="store_true", help="print what /api/plan returns")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        from training.planner.paper_report import main as report_main

        return report_main(argv[1:])
    args = parse_args(argv)
    try:
        model = model_preset(args.model)
        if args.seq_len:
            model = dataclasses.replace(model, seq_len=args.seq_len)
        device = load_device(args.device_file) if args.device_file else DEVICES[args.gpu]
        cluster = Cluster(device=device, nodes=args.nodes, devices_per_node=args.gpus_per_node)
        precision: Precision = args.precision or ("fp32" if args.gpu == "cpu" and not args.device_file else "bf16")
        result = plan(model, cluster, args.global_batch, precision=precision, impl=IMPLEMENTATIONS[args.trainer])
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result_to_dict(result, top=args.top), indent=2))
    else:
        print(format_result(result, args.top, args.rejected))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
