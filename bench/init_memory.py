"""Peak resident memory per rank while a layout builds its share of a model, over the full model's size.

    python -m bench.init_memory [--recipe 1b]

For each layout (dp1×tp2, pp2) two fresh ranks (torchrun, gloo, one thread each) build the
recipe's model as the trainer does (`training.parallel.parallelize` with the seeded init: built on
the meta device, sharded, then only the local shards allocated and filled) and report their peak
resident set size (`ru_maxrss`: everything the process ever held, the Python interpreter, torch
and gloo included). The ratio is that peak over the full model's fp32 size; a rank that held the
whole model, as every rank did before the model was built on meta, would be above 1.

Ends with one `key=value` line: `peak_over_full_model_<layout>` per layout and the largest as
`worst_peak_over_full_model`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"tp2": {"tp": 2}, "pp2": {"pp": 2, "microbatches": 2}}


def rss_mib() -> float:
    """This process's current resident set, from /proc (Linux)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(recipe: str, layout: str) -> None:
    import torch
    import torch.distributed as dist

    from training.config import RECIPES
    from training.initial_weights import SeededInit
    from training.model import cross_entropy_loss
    from training.parallel import parallelize
    from training.parallel.dims import ParallelDims

    torch.set_num_threads(1)
    spec = RECIPES[recipe](**LAYOUTS[layout])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dims = ParallelDims.from_layout(spec.layout, dist.get_world_size())
    mesh = dims.build_mesh("cpu")
    before = rss_mib()
    started = time.perf_counter()
    model = parallelize(SeededInit(spec.model, spec.train.seed), spec, dims, mesh, rank, cross_entropy_loss)
    seconds = time.perf_counter() - started
    held = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel() for part in model.parts for p in part.parameters()
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    result = {"rank": rank, "peak_mib": peak, "before_mib": before, "held_params": held, "seconds": seconds}
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def measure(recipe: str, layout: str, env: dict[str, str], timeout: float) -> list[dict[str, float]]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += ["-m", "bench.init_memory", "--worker", recipe, layout]
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line.removeprefix("RESULT ") for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or len(lines) != 2:
        raise SystemExit(f"the ranks ({layout}) failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return sorted((json.loads(line) for line in lines), key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.init_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="1b", help="a training.config recipe (default: 1b)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per layout before giving up")
    parser.add_argument("--worker", nargs=2, metavar=("RECIPE", "LAYOUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return

    from training.config import RECIPES

    model = RECIPES[args.recipe]().model
    full_mib = model.num_params() * 4 / 2**20
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    print(f"recipe {args.recipe}: {model.num_params() / 1e9:.3f}B parameters, {full_mib:.0f} MiB in fp32")
    ratios: dict[str, float] = {}
    for layout in LAYOUTS:
        ranks = measure(args.recipe, layout, env, args.timeout)
        for r in ranks:
            print(
                f"{layout} rank {r['rank']}: peak {r['peak_mib']:.0f} MiB (before building {r['before_mib']:.0f} MiB), "
                f"holds {r['held_params'] / 1e6:.0f}M parameters, built in {r['seconds']:.1f} s"
            )
        ratios[layout] = max(r["peak_mib"] for r in ranks) / full_mib
    figures = " ".join(f"peak_over_full_model_{layout}={ratio:.3f}" for layout, ratio in ratios.items())
    print(
        f"recipe={args.recipe} full_model_mib={full_mib:.0f} {figures} worst_peak_over_full_model={max(ratios.values()):.3f}"
    )


if __name__ == "__main__":
    main()
