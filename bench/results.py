"""Where the benchmarks write: one CSV per benchmark in bench/out/, and recorded technique matrices in
data/runs/ (``write_run``); every row names its machine."""

from __future__ import annotations

import csv
import functools
import os
import re
from pathlib import Path

from gpukit.lessons.runs import RUNS_DIR

OUT = Path(__file__).resolve().parent / "out"
# a recorded run's allocator traces, one file per row: data/traces/<the run's machine slug>/ (bench/techniques.py)
TRACES = RUNS_DIR.parent / "traces"


@functools.cache
def machine() -> dict:
    """The machine's columns (gpukit.lessons.runs.MACHINE_COLUMNS: device, driver, CPU, cores, torch, date)."""
    from gpukit.lessons.runs import machine as describe

    return describe()


def write_csv(name: str, rows: list[dict]) -> Path:
    """Write ``rows`` (dicts with the same keys) to bench/out/``name``, each with the machine's columns
    (a row's own value wins where it has the same key); returns the path."""
    return write_rows(OUT / name, rows, machine())


def slug(info: dict) -> str:
    """A file name for a machine's run: ``'nvidia-h100-80gb-hbm3'``, ``'cpu-amd-epyc-2-cores'``."""
    name = str(info["device_name"])
    if info["device_type"] != "cuda":
        name = f"cpu-{name}-{info['cores']}-cores"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def write_rows(path: str | Path, rows: list[dict], info: dict) -> Path:
    """Write ``rows`` as a CSV at ``path``, each row with the machine's columns ``info`` added (a row's own value wins
    where it has the same key); returns the path. The columns are every row's, in the order first met: a row without
    one (a case that failed before its figures) leaves its cells empty."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys([k for row in rows for k in row] + list(info)))
    rows = [{**row, **{k: v for k, v in info.items() if k not in row}} for row in rows]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


EARLIER = "earlier"  # data/runs/earlier/: runs a later one of the same machine replaced (the lessons read the latest)


def write_run(rows: list[dict], info: dict | None = None, folder: Path = RUNS_DIR) -> Path:
    """Write a technique matrix as ``folder/<machine slug>.csv``, each row with the machine's columns.

    Returns:
        The path written. An earlier run of the same machine recorded on another date is kept, with its gpu-check
        report and its allocator traces, as ``folder/earlier/<slug>-<its date>.csv`` (a recorded run is evidence:
        tests and ``bench/recorded_runs.py`` replay it); one of the same date is replaced.
    """
    info = info or dict(machine())
    path = Path(folder) / f"{slug(info)}.csv"
    keep_earlier(path, str(info.get("date", "")))
    return write_rows(path, rows, info)


def keep_earlier(path: Path, date: str, traces: Path | None = None) -> Path | None:
    """Move the run at ``path`` into ``earlier/`` beside it, dated, where it was recorded on another day than
    ``date``: its CSV, its gpu-check report (``<slug>-gpu-check.txt``) and its traces (``traces/<slug>/``, to
    ``traces/earlier/<slug>-<date>/``; ``traces`` by default beside the runs' folder, as data/traces beside
    data/runs). Returns the CSV's new path, or None where nothing was moved."""
    path = Path(path)
    traces = path.parent.parent / TRACES.name if traces is None else traces
    if not path.exists():
        return None
    with path.open() as f:
        earlier = (next(csv.DictReader(f), None) or {}).get("date") or ""
    if not earlier or earlier == date:
        return None
    dated = f"{path.stem}-{earlier}"
    moves = [(path, path.parent / EARLIER / f"{dated}.csv"),
             (path.with_name(f"{path.stem}-gpu-check.txt"), path.parent / EARLIER / f"{dated}-gpu-check.txt"),
             (traces / path.stem, traces / EARLIER / dated)]
    for old, new in moves:
        if old.exists():
            new.parent.mkdir(parents=True, exist_ok=True)
            old.rename(new)
            for moved in [new, *new.rglob("*")] if new.is_dir() else [new]:
                if moved.is_file():  # touched: kit.py gpu-check brings back what its run wrote, by modification time
                    os.utime(moved)
    return moves[0][1]
