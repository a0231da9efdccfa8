"""Where the benchmarks write: one CSV per benchmark in bench/out/."""

from __future__ import annotations

import csv
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


def write_csv(name: str, rows: list[dict]) -> Path:
    """Write ``rows`` (dicts with the same keys) to bench/out/``name``; returns the path."""
    OUT.mkdir(exist_ok=True)
    path = OUT / name
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path
