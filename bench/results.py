"""Where the benchmarks write: one CSV per benchmark in bench/out/, every row naming its machine."""

from __future__ import annotations

import csv
import functools
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


@functools.cache
def machine() -> dict:
    """The machine's columns (gpukit.runs.MACHINE_COLUMNS: device, driver, CPU, cores, torch, date)."""
    from gpukit.runs import machine as describe

    return describe()


def write_csv(name: str, rows: list[dict]) -> Path:
    """Write ``rows`` (dicts with the same keys) to bench/out/``name``, each with the machine's columns
    (a row's own value wins where it has the same key); returns the path."""
    OUT.mkdir(exist_ok=True)
    path = OUT / name
    rows = [{**row, **{k: v for k, v in machine().items() if k not in row}} for row in rows]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path
