"""Run gpukit's benchmarks: `python3 kit.py bench [NAME ...]` (default: all). CSVs go to bench/out/."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
BENCHMARKS = ["meter_overhead", "estimate_accuracy", "batch_size"]


def main(names: list[str]) -> int:
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {BENCHMARKS}", file=sys.stderr)
        return 2
    for name in names or BENCHMARKS:
        print(f"== {name}", flush=True)
        importlib.import_module(name).main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
