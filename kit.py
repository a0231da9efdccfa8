#!/usr/bin/env python3
"""Set up gpukit's environment in .venv/ and run it.

    python3 kit.py lab      create/update .venv, then open JupyterLab on notebooks/
    python3 kit.py test     create/update .venv, then run every test (pytest + nbval)
    python3 kit.py bench    create/update .venv, then run the benchmarks in bench/
    python3 kit.py setup    only create/update .venv
    python3 kit.py outputs  run the notebooks on the CPU and store them with their outputs (all, or those named)
    python3 kit.py gpu-check   on a GPU machine, within a time budget (--budget, 470 s): the exactness benchmark,
                               the technique matrix recorded in data/runs/, every notebook run on the card and
                               stored in data/runs/<gpu>/, the tests on CUDA, a report of what differed, and with
                               --out DIR all of it packed into DIR/gpu-check.tar.gz
    python3 kit.py gpu-wheels  download into .gpu-wheels/ the wheels (gpu-wheels.txt) that a lent GPU machine
                               without a package index lacks; gpu-check there installs them offline
    python3 kit.py rehearse --card t4 [NOTEBOOK...]   run the notebooks on this CPU with the sizes a card gets,
                            on the simulated CUDA allocator of its memory, every assertion counted; writes
                            data/rehearsals/CARD.csv (bench/rehearse.py)
    python3 kit.py links    write each notebook's install cell and the README's "Open in Colab" links from
                            the repository URL in pyproject.toml (then `kit.py outputs` re-stores them)

Extra arguments after the command go to JupyterLab, pytest or the benchmark.

.venv gets the exact versions in constraints.txt (gpukit itself declares ranges,
in pyproject.toml). If the python3 that runs this script can already import a
torch within gpukit's range (a GPU machine's own CUDA build, say, from its
site-packages or its user site), .venv is linked to that torch and keeps it
instead of installing the pinned one. The tests run with pytest's plugin
autoloading off (a linked environment brings its own pytest plugins); the
plugins the suite needs are named in pyproject.toml's addopts.
Needs only the Python standard library, so it runs on a fresh machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # kitlib/ is beside this file, wherever kit.py is run from (or loaded by a test)
    sys.path.insert(0, HERE)

from kitlib import colab, gpucheck, venv, wheels  # noqa: E402  (each module's first line says its job)


def lab(args: list[str]) -> None:
    cmd = [venv.VENV / "bin" / "jupyter", "lab", f"--notebook-dir={venv.ROOT / 'notebooks'}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")  # JupyterLab refuses to run as root without it
    os.execv(str(cmd[0]), [str(c) for c in cmd + args])


def test_workers(args: list[str]) -> list[str]:
    """pytest-xdist's options for a run of the whole suite: one worker per core, at most two, each test
    handed to the next free worker, so the notebooks in the browser share the machine with the unit tests
    (each worker starts its own JupyterLab). A run with arguments of its own (``-k magic``, one file) runs
    in one process, as pytest does."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if args or cores < 2:
        return ["-p", "xdist"]
    # One test at a time to each worker: xdist's load scheduling otherwise hands each worker a first chunk
    # of a quarter of its share, in collection order, which put all thirteen notebooks on one worker.
    # The slowest tests are named at the end of every whole run: where the suite's time goes, run by run.
    return ["-p", "xdist", "-n", str(min(2, cores)), "--dist", "load", "--maxschedchunk", "1", "--durations", "25"]


def test(args: list[str]) -> int:
    return subprocess.run([str(venv.VENV_PY), "-m", "pytest", *test_workers(args), *args], cwd=venv.ROOT,
                          env=venv.test_environment()).returncode


def script(path: str, args: list[str]) -> int:
    """Run a script of the repository (its path from the root) with .venv's python."""
    return subprocess.run([str(venv.VENV_PY), str(venv.ROOT / path), *args], cwd=venv.ROOT).returncode


def outputs(args: list[str]) -> int:
    return script("tests/notebook_outputs.py", args)


def rehearse(args: list[str]) -> int:
    return script("bench/rehearse.py", args)


def bench(args: list[str]) -> int:
    return script("bench/run.py", args)


def main(argv: list[str]) -> int:
    commands = ("lab", "test", "bench", "setup", "gpu-check", "gpu-wheels", "outputs", "links", "rehearse")
    if not argv or argv[0] not in commands:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "links":          # files only: no .venv needed
        return colab.links(rest)
    if command == "gpu-wheels":     # this python3's pip only
        return wheels.gpu_wheels(rest)
    if command == "gpu-check" and wheels.WHEELS.is_dir() and wheels.carried(wheels.WHEELS):
        # Carried to a machine without a package index: .venv from the wheels, on the machine's own torch.
        if not wheels.setup_offline():
            print(f"kit.py: {sys.executable} has no torch within gpukit's range to link, and {wheels.WHEELS.name}/ "
                  "carries none: setting .venv up from the package index instead", flush=True)
            venv.setup()
    else:
        venv.setup()
    if command == "lab":
        lab(rest)
    if command == "test":
        return test(rest)
    if command == "bench":
        return bench(rest)
    if command == "gpu-check":
        return gpucheck.gpu_check(rest)
    if command == "outputs":
        return outputs(rest)
    if command == "rehearse":
        return rehearse(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
