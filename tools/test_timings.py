"""Group the timings `pytest --timings=FILE` wrote (tests/timings.py): wall time by file and by
what the tests start, slowest first, as the Markdown tables docs/testing.md keeps.

    python -m tools.test_timings FILE [--top 25]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def table(rows: dict[str, list[float]], title: str, total: float, top: int | None = None) -> str:
    ordered = sorted(rows.items(), key=lambda kv: -sum(kv[1]))
    shown = ordered[:top] if top else ordered
    lines = [f"| {title} | tests | seconds | share |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {len(ts)} | {sum(ts):.0f} | {sum(ts) / total:.1%} |" for name, ts in shown]
    if len(shown) < len(ordered):
        rest = [t for _, ts in ordered[len(shown) :] for t in ts]
        lines.append(f"| {len(ordered) - len(shown)} more | {len(rest)} | {sum(rest):.0f} | {sum(rest) / total:.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--top", type=int, default=25, help="files shown (the rest summed in one line)")
    args = parser.parse_args()
    tests = [json.loads(line) for line in args.file.read_text().splitlines() if line.strip()]
    total = sum(t["seconds"] for t in tests) or 1.0
    by_starts: dict[str, list[float]] = defaultdict(list)
    by_file: dict[str, list[float]] = defaultdict(list)
    for test in tests:
        by_starts[test["starts"]].append(test["seconds"])
        by_file[test["file"]].append(test["seconds"])
    print(f"{len(tests)} tests, {total:.0f} s of test time\n")
    print(table(by_starts, "what the tests start", total) + "\n")
    print(table(by_file, "file", total, args.top))


if __name__ == "__main__":
    main()
