"""Recorded runs: which machine a measurement came from, and the technique matrices kept in data/runs/
(written by ``bench/techniques.py`` with ``bench/results.py``; read here for notebook 10).

    from gpukit.lessons.runs import machine, load_runs
    machine()          # {'device_type': 'cpu', 'device_name': 'AMD EPYC', 'torch': '2.13.0+cpu', ...}
    load_runs()        # every data/runs/*.csv, checked, as one pandas DataFrame

A number without its machine means little, so every row a benchmark writes carries the
machine's columns (``MACHINE_COLUMNS``). A recorded run is a technique matrix
(``gpukit.techniques``) written with them; the loader refuses a file that does not say
which device it ran on and with which torch.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch

_CHECKOUT = Path(__file__).resolve().parent.parent.parent
# data/runs/ in a checkout of gpukit; in an installed gpukit, the same files, which the build ships as the
# package gpukit.lessons.recorded (pyproject.toml maps it onto data/runs/).
RUNS_DIR = (_CHECKOUT / "data" / "runs" if (_CHECKOUT / "pyproject.toml").is_file()
            else Path(__file__).resolve().parent / "recorded")
MACHINE_COLUMNS = ("device_type", "device_name", "driver", "cpu", "cores", "threads", "torch", "cuda", "date")
REQUIRED = ("device_type", "device_name", "torch", "date")


def cpu_model() -> str:
    """The processor's model name as /proc/cpuinfo gives it (the platform's name elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _driver() -> str:
    """The NVIDIA driver's version, read through NVML; '' where there is none."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVML library, no driver, or no GPU
        return ""


def machine(device: str | torch.device | None = None) -> dict[str, str | int]:
    """The machine a measurement runs on, as the ``MACHINE_COLUMNS`` of a row.

    Args:
        device: the device measured (default: the GPU if there is one, else the CPU).

    Returns:
        ``device_type`` ('cuda' or 'cpu'), ``device_name`` (the GPU's name, or the CPU's model),
        ``driver`` (NVIDIA driver, '' without one), ``cpu``, ``cores``, ``threads`` (torch's
        intra-op threads), ``torch``, ``cuda`` (the CUDA version torch was built with, '' for a
        CPU build) and ``date`` (UTC, ISO 8601).
    """
    from ..meter import resolve_device

    dev = resolve_device(device)
    is_cuda = dev.type == "cuda"
    return {"device_type": dev.type, "device_name": torch.cuda.get_device_name(dev) if is_cuda else cpu_model(),
            "driver": _driver() if is_cuda else "", "cpu": cpu_model(), "cores": os.cpu_count() or 0,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "cuda": torch.version.cuda or "",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}


def read_run(path: str | Path):
    """One recorded run as a pandas DataFrame, with a ``file`` column.

    Raises:
        ValueError: when a column of ``REQUIRED`` (device type and name, torch version, date)
            is missing or empty in any row: a run that does not say where it ran is not kept.
    """
    import pandas as pd

    path = Path(path)
    df = pd.read_csv(path, keep_default_na=False)
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise ValueError(f"{path.name}: no {', '.join(missing)} column; a recorded run names its machine "
                         f"({', '.join(REQUIRED)}): record it with `python3 kit.py bench techniques --record`")
    empty = [c for c in REQUIRED if (df[c].astype(str).str.strip() == "").any()]
    if empty or df.empty:
        raise ValueError(f"{path.name}: {', '.join(empty) or 'every column'} empty; a recorded run names "
                         f"its machine in every row")
    return df.assign(file=path.name)


def load_runs(folder: str | Path = RUNS_DIR):
    """Every ``*.csv`` in ``folder`` (default data/runs/, or the copy installed with gpukit), read with
    ``read_run``, as one DataFrame (empty, with no rows, when there are none).

    Raises:
        FileNotFoundError: ``folder`` is not a folder.
    """
    import pandas as pd

    if not Path(folder).is_dir():
        raise FileNotFoundError(f"no folder {str(folder)!r} of recorded runs (gpukit's own are in {RUNS_DIR})")
    frames = [read_run(p) for p in sorted(Path(folder).glob("*.csv"))]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=[*MACHINE_COLUMNS, "file"])


__all__ = ["machine", "cpu_model", "read_run", "load_runs", "RUNS_DIR", "MACHINE_COLUMNS"]
