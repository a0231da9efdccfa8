"""Run one notebook on this machine's GPU and store it with its outputs, for `python3 kit.py gpu-check`.

    python tests/notebooks_on_card.py notebooks/05_gradient_checkpointing.ipynb --to data/runs/nvidia-h100-80gb-hbm3 \\
        --seconds 200 --card "NVIDIA H100 80GB HBM3"

The notebook runs in a fresh kernel of this Python (from notebooks/, as JupyterLab runs it), every cell to the end even
after one fails (as nbval runs them), so that one failure does not hide the cells after it. It is stored after every
cell, cleaned as tests/notebook_outputs.py cleans the CPU's stored outputs, so a run stopped from outside still leaves
the cells that ran. Past ``--seconds`` the running cell is stopped and the cells after it are left unrun. The last line
printed is the run's summary as JSON: how many code cells ran, the cells that failed (their index among all cells, as
nbval names them), whether the time ran out, the seconds it took.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from notebook_outputs import clean, code_digest  # noqa: E402


def write_kernelspec(folder: Path) -> str:
    """A kernelspec in ``folder`` naming this Python, so that the kernel is the Python that runs this script (a
    machine's own ``python3`` kernelspec may name another one); returns its name."""
    spec = folder / "kernels" / "gpukit-card"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "gpukit on this card", "language": "python"}))
    return spec.name


def failures(nb) -> list[list]:
    """[index, "Name: message"] for each cell whose outputs hold an error."""
    found = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.get("output_type") == "error":
                found.append([i, f"{out.get('ename')}: {str(out.get('evalue', '')).splitlines()[0][:300]}"
                              if str(out.get("evalue", "")).strip() else out.get("ename")])
                break
    return found


def run(path: Path, to: Path, seconds: float, card: str, torch_version: str) -> dict:
    import nbclient
    import nbformat

    started = time.monotonic()
    deadline = started + seconds
    nb = nbformat.read(path, as_version=4)
    to.mkdir(parents=True, exist_ok=True)
    stored = to / path.name
    summary = {"notebook": path.stem, "cells": sum(c.cell_type == "code" for c in nb.cells), "ran": 0, "failed": [],
               "cut": None, "seconds": 0.0}
    current = [0]

    def store(**_):
        data = clean(json.loads(nbformat.writes(nb)))
        data["metadata"]["gpukit"] = {"outputs": {
            "device": "cpu" if card == "cpu" else "cuda", "card": card, "torch": torch_version,
            "code": code_digest(data), "cut": summary["cut"]}}
        stored.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")

    def starts(cell, cell_index, **_):
        current[0] = cell_index

    def executed(cell, cell_index, **_):
        summary["ran"] += 1
        store()

    os.environ.pop("MPLBACKEND", None)              # plots inline, as a reader sees them
    with tempfile.TemporaryDirectory(prefix="gpukit-kernel-") as kernels:
        os.environ["JUPYTER_PATH"] = kernels
        client = nbclient.NotebookClient(
            nb, kernel_name=write_kernelspec(Path(kernels)), allow_errors=True, record_timing=False,
            store_widget_state=True, timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
            interrupt_on_timeout=False, shutdown_kernel="immediate", on_cell_start=starts, on_cell_executed=executed,
            resources={"metadata": {"path": str(path.parent)}})
        try:
            client.execute()
        except nbclient.exceptions.CellTimeoutError:
            summary["cut"] = f"stopped in cell {current[0]}: {seconds:.0f} s were up"
        except nbclient.exceptions.DeadKernelError as err:
            summary["cut"] = f"the kernel died in cell {current[0]}: {(str(err).splitlines() or [''])[0][:300]}"
        except Exception as err:         # the kernel did not start, say: the cells that ran are kept all the same
            summary["cut"] = f"{type(err).__name__} in cell {current[0]}: {(str(err).splitlines() or [''])[0][:300]}"
    summary["failed"] = [f for f in failures(nb) if not (summary["cut"] and f[0] == current[0])]  # the cut one
    summary["seconds"] = round(time.monotonic() - started, 1)
    store()
    return summary


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--to", type=Path, required=True, help="folder the executed notebook is stored in")
    parser.add_argument("--seconds", type=float, default=600.0, help="time the notebook may take")
    parser.add_argument("--card", default="cpu", help="the GPU's name (or cpu), kept in the notebook's metadata")
    parser.add_argument("--torch", default="", help="torch's version, kept in the notebook's metadata")
    opts = parser.parse_args(argv)
    summary = run(opts.notebook.resolve(), opts.to, opts.seconds, opts.card, opts.torch)
    print(json.dumps(summary), flush=True)
    return 1 if summary["failed"] or summary["cut"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
