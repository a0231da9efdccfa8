"""Where the benchmarks write: one CSV per benchmark in bench/out/, every row naming its machine."""

from __future__ import annotations

import functools
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"


@functools.cache
def machine() -> dict:
    """The machine's columns (gpukit.lessons.runs.MACHINE_COLUMNS: device, driver, CPU, cores, torch, date)."""
    from gpukit.lessons.runs import machine as describe

    return describe()


def write_csv(name: str, rows: list[dict]) -> Path:
    """Write ``rows`` (dicts with the same keys) to bench/out/``name``, each with the machine's columns
    (a row's own value wins where it has the same key); returns the path."""
    from gpukit.lessons.runs import write_rows

    return write_rows(OUT / name, rows, machine())
