#!/usr/bin/env python3
"""Set up gpukit's environment in .venv/ and run it.

    python3 kit.py lab      create/update .venv, then open JupyterLab on notebooks/
    python3 kit.py test     create/update .venv, then run every test (pytest + nbval)
    python3 kit.py bench    create/update .venv, then run the benchmarks in bench/
    python3 kit.py setup    only create/update .venv
    python3 kit.py outputs  run the notebooks on the CPU and store them with their outputs (all, or those named)
    python3 kit.py gpu-check   on a GPU machine: the whole suite on CUDA, the exactness benchmark, the
                               technique matrix recorded in data/runs/, and a report of what differed
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

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
VENV_PY = VENV / "bin" / "python"
STAMP = VENV / ".gpukit-installed"
LINK_PTH = "_gpukit_outer_torch.pth"
LOCK = ROOT / "constraints.txt"
REQUIREMENT_FILES = ("constraints.txt", "pyproject.toml")


def _run(cmd: list[str], **kwargs) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kwargs)


# Run by the outer python: its torch's version, then the folders that make it importable, in its own order
# (the user site and site-packages as on its sys.path, and the folder torch itself was imported from).
_PROBE = """import os, site, sys, torch
sites = set(site.getsitepackages()) | {site.getusersitepackages()}
dirs = [p for p in sys.path if p in sites] + [os.path.dirname(os.path.dirname(torch.__file__))]
print(torch.__version__)
print("\\n".join(dict.fromkeys(d for d in dirs if os.path.isdir(d))))"""


def outer_torch(python: str = sys.executable) -> tuple[str, list[str]] | None:
    """(torch's version, the folders to link) if ``python`` can import torch, else None."""
    done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True)
    if done.returncode != 0:
        return None
    version, *dirs = done.stdout.split("\n")
    return version.strip(), [d for d in dirs if d.strip()]


def _release(version: str) -> tuple[int, ...]:
    parts = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(x) for x in parts.group(0).split(".")) if parts else ()


def torch_range() -> str:
    """gpukit's torch requirement in pyproject.toml, such as '>=2.11,<2.16'."""
    found = re.search(r'"torch\s*([<>=!~][^";]*)"', (ROOT / "pyproject.toml").read_text())
    return found.group(1).replace(" ", "") if found else ""


def in_range(version: str, spec: str) -> bool:
    """Whether a version meets a specifier of comparisons on release numbers ('>=2.11,<2.16')."""
    ops = {">=": tuple.__ge__, "<=": tuple.__le__, ">": tuple.__gt__, "<": tuple.__lt__,
           "==": tuple.__eq__, "!=": tuple.__ne__}
    have = _release(version)
    for clause in filter(None, spec.split(",")):
        op, bound = re.match(r"(>=|<=|==|!=|>|<)(.+)", clause).groups()
        want = _release(bound)
        if not ops[op](have[:len(want)] if op in ("==", "!=") else have, want):
            return False
    return True


def link_torch(venv_python: Path, site_dir: Path, python: str = sys.executable) -> str | None:
    """Make ``python``'s torch importable from the venv; returns its version, or None (nothing linked).

    Links only a torch within gpukit's range that the venv really imports afterwards (same version), so
    that the pinned torch is left out only when another one is there to use."""
    pth = site_dir / LINK_PTH
    if pth.exists():
        pth.unlink()
    found = outer_torch(python)
    if found is None:
        return None
    version, dirs = found
    spec = torch_range()
    if not in_range(version, spec):
        print(f"kit.py: {python}'s torch {version} is outside gpukit's range torch{spec}; "
              "installing the pinned torch into .venv instead", flush=True)
        return None
    pth.write_text("\n".join(dirs) + "\n")
    seen = subprocess.run([str(venv_python), "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True)
    if seen.returncode != 0 or seen.stdout.strip() != version:
        pth.unlink()
        print(f"kit.py: {python}'s torch {version} cannot be imported from .venv "
              f"({(seen.stderr.strip().splitlines() or [seen.stdout.strip()])[-1]}); "
              "installing the pinned torch instead", flush=True)
        return None
    return version


def _venv_site_packages() -> Path:
    out = subprocess.run(
        [str(VENV_PY), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    return Path(out)


def _fingerprint(extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    for name in REQUIREMENT_FILES:
        h.update((ROOT / name).read_bytes())
    return h.hexdigest()


def constraints(linked: str | None) -> str:
    """The lock for .venv: constraints.txt, with its torch line replaced by the linked torch's version."""
    lines = LOCK.read_text().splitlines()
    if linked:
        lines = [line for line in lines if not re.match(r"\s*torch\s*[=<>!~;]", line)]
        lines.append(f"torch=={linked}   # the linked torch, kept")
    return "\n".join(lines) + "\n"


def setup() -> None:
    """Create .venv if needed and install gpukit with the locked versions of its dependencies."""
    if Path(sys.prefix).resolve() == VENV.resolve() and STAMP.exists():
        return  # run by .venv's own python: already set up, and it cannot see an outer torch
    if not VENV_PY.exists():
        try:
            _run([sys.executable, "-m", "venv", VENV])
        except subprocess.CalledProcessError:
            sys.exit("kit.py: `python3 -m venv` failed. On Debian/Ubuntu install the "
                     "venv module first: apt-get install python3-venv")

    linked = link_torch(VENV_PY, _venv_site_packages())
    key = _fingerprint(f"linked={linked}")
    if STAMP.exists() and STAMP.read_text() == key:
        return

    kept = VENV / ".constraints-resolved.txt"
    kept.write_text(constraints(linked))
    # --no-compile: pip would byte-compile every module of every package (torch's thousands among them), more
    # than half of a fresh set-up's time (115 s with, 51 s without, on two cores); Python compiles the
    # modules a run imports, once, when it first imports them.
    _run([VENV_PY, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-compile",
          "-c", kept, "-e", f"{ROOT}[lessons,lab,test]"])
    STAMP.write_text(key)


def test_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the test run: no pytest plugin autoloading (pyproject's addopts load nbval by
    name), so that plugins of a linked environment cannot clash with the pinned pytest; one torch thread per
    process unless the caller chose (the workers already use every core: two workers of two threads each on two
    cores wait on each other, and the unit tests took 63 s instead of 46 s)."""
    env = dict(os.environ if base is None else base, PYTHONUNBUFFERED="1", MPLBACKEND="Agg",
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    # Bytecode is written: set-up installs with --no-compile, so the first import of each module compiles it and
    # every later process (the workers, each notebook's kernel, each rank) reads the .pyc. With
    # PYTHONDONTWRITEBYTECODE set, every one of them compiled torch, transformers and gpukit again: importing them
    # took 10.7 s instead of 4.4 s, in each of the suite's dozens of processes.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def lab(args: list[str]) -> None:
    cmd = [VENV / "bin" / "jupyter", "lab", f"--notebook-dir={ROOT / 'notebooks'}"]
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
    return subprocess.run([str(VENV_PY), "-m", "pytest", *test_workers(args), *args], cwd=ROOT,
                          env=test_environment()).returncode


def outputs(args: list[str]) -> int:
    return subprocess.run([str(VENV_PY), str(ROOT / "tests" / "notebook_outputs.py"), *args], cwd=ROOT).returncode


def rehearse(args: list[str]) -> int:
    return subprocess.run([str(VENV_PY), str(ROOT / "bench" / "rehearse.py"), *args], cwd=ROOT).returncode


def bench(args: list[str]) -> int:
    return subprocess.run([str(VENV_PY), str(ROOT / "bench" / "run.py"), *args], cwd=ROOT).returncode


# Colab and Kaggle: every notebook starts with this cell, built from pyproject.toml's repository URL (the one
# place it is set). It installs gpukit where it cannot be imported and does nothing where it can, so the
# notebooks' runs here stay offline. pip keeps what Colab has (tests/test_colab.py): no restart is needed.
INSTALL_CELL = """\
# On Colab or Kaggle: install gpukit with the lessons' extra. Where gpukit is importable, this does nothing.
import importlib, importlib.util, subprocess, sys
if importlib.util.find_spec("gpukit") is None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "gpukit[lessons] @ git+{url}"], check=True)
    importlib.invalidate_caches()"""
INSTALL_CELL_FIRST_LINE = INSTALL_CELL.splitlines()[0]


def repository_url() -> str:
    """The repository's URL: pyproject.toml's [project.urls] Repository."""
    found = re.search(r'^Repository\s*=\s*"(https://github\.com/[\w.-]+/[\w.-]+)"\s*$',
                      (ROOT / "pyproject.toml").read_text(), re.M)
    if not found:
        raise SystemExit('pyproject.toml: no [project.urls] Repository = "https://github.com/OWNER/NAME"')
    return found.group(1)


def install_cell(url: str) -> str:
    return INSTALL_CELL.format(url=url)


def colab_url(url: str, notebook: str) -> str:
    """The address that opens ``notebooks/<notebook>`` of the repository's main branch in Colab."""
    return f"https://colab.research.google.com/github/{url.removeprefix('https://github.com/')}/blob/main/" \
           f"notebooks/{notebook}"


def _cell_source(text: str) -> list[str]:
    lines = text.split("\n")
    return [line + "\n" for line in lines[:-1]] + [lines[-1]]


def links(args: list[str]) -> int:
    """Write (or insert) each notebook's install cell and the README's Colab links; say what changed."""
    import json

    url = repository_url()
    changed = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(path.read_text())
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        want = _cell_source(install_cell(url))
        if code and "".join(code[0]["source"]).startswith(INSTALL_CELL_FIRST_LINE):
            if code[0]["source"] == want:
                continue
            code[0]["source"] = want
        else:
            at = next((i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"), len(nb["cells"]))
            nb["cells"].insert(at, {"cell_type": "code", "execution_count": None, "id": "install-gpukit",
                                    "metadata": {}, "outputs": [], "source": want})
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        changed.append(path.name)
    readme = (ROOT / "README.md").read_text()
    rows = re.sub(r"^\| `(\d\d_\w+)` \| [^|]* \|",
                  lambda m: f"| `{m.group(1)}` | [Colab]({colab_url(url, m.group(1) + '.ipynb')}) |", readme,
                  flags=re.M)
    if rows != readme:
        (ROOT / "README.md").write_text(rows)
        changed.append("README.md")
    print("\n".join(f"wrote {name}" for name in changed) or "nothing to change")
    if any(name.endswith(".ipynb") for name in changed):
        print("their code changed: re-store their outputs with `python3 kit.py outputs`")
    return 0


GPU_PROBE = """
import json, torch
ok = torch.cuda.is_available()
info = {"cuda": ok, "torch": torch.__version__, "cuda_version": torch.version.cuda}
if ok:
    import gpukit
    from gpukit.warmup import cublas_workspace_bytes
    info.update(name=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                devices=torch.cuda.device_count(), workspace=cublas_workspace_bytes("cuda"),
                first_warm_up=gpukit.warm_up("cuda"), second_warm_up=gpukit.warm_up("cuda"))
print(json.dumps(info))
"""


def gpu_check(args: list[str]) -> int:
    """Prove the kit on this machine's GPU: the whole suite (notebooks on CUDA), the exactness benchmark, the
    technique matrix recorded in data/runs/, and a short report of everything that differed from what the CPU
    runs expect, in data/runs/<gpu>-gpu-check.txt (commit it with the recorded run)."""
    import csv
    import json
    import re
    import xml.etree.ElementTree as ET

    probe = subprocess.run([str(VENV_PY), "-c", GPU_PROBE], cwd=ROOT, capture_output=True, text=True)
    if probe.returncode != 0:
        print(probe.stderr[-2000:], file=sys.stderr)
        return probe.returncode
    info = json.loads(probe.stdout.strip().splitlines()[-1])
    if not info["cuda"]:
        print(f"kit.py gpu-check: .venv's torch {info['torch']} sees no CUDA GPU. Run kit.py with the python3 "
              "that has this machine's CUDA torch (python3 -c 'import torch; print(torch.cuda.is_available())' "
              "says True), or install a CUDA build of torch into .venv.", file=sys.stderr)
        return 2
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    junit = out / "gpu-check-junit.xml"
    lines = [f"gpukit gpu-check: {info['name']} (sm_{''.join(map(str, info['capability']))}, "
             f"{info['devices']} GPU(s)), torch {info['torch']}, CUDA {info['cuda_version']}"]

    # 1. The whole suite, the notebooks on CUDA.
    junit.unlink(missing_ok=True)  # never read a record left by an earlier run
    tests = test(["-m", "not browser", "-p", "no:cacheprovider", f"--junitxml={junit}", *args])
    failed, skipped, total = [], [], 0
    if not junit.exists():
        failed.append(f"  pytest wrote no record (exit {tests}): run python3 kit.py test to see why")
    for case in (ET.parse(junit).getroot().iter("testcase") if junit.exists() else ()):
        total += 1
        name = f"{case.get('classname')}::{case.get('name')}"
        for kind, into in (("failure", failed), ("error", failed), ("skipped", skipped)):
            found = case.find(kind)
            if found is not None:
                why = ((found.get("message") or kind).splitlines() or [kind])[0][:200]
                into.append(f"  {kind}: {name}: {why}")
    lines.append(f"tests: {total - len(failed) - len(skipped)} passed, {len(failed)} failed, {len(skipped)} skipped"
                 f" (pytest exit {tests}); on the CPU every test passes and only the CUDA tests skip")
    lines += failed + skipped

    # 2. cuBLAS's workspaces (gpukit.warm_up): expected at least one per thread that multiplied.
    first, size = info["first_warm_up"], info["workspace"]
    note = "as expected" if size <= first <= 2 * size + 4 * 2**20 else "NOT between 1 and 2 workspaces (+ cuBLASLt's)"
    lines.append(f"warm-up: the first matmuls left {first:,} B allocated = {first / size:.2f} x the {size:,} B "
                 f"cuBLAS workspace ({note}); the second warm-up {info['second_warm_up']:,} B (expected 0)")

    # 3. The exactness benchmark (CUDA: the meter against the allocator's own trace) and the technique matrix.
    code = bench(["exactness", "techniques", "--record"])
    lines.append(f"benchmarks: exactness and techniques (exit {code}); the technique matrix is in data/runs/")
    exact = out / "exactness.csv"
    if exact.exists():
        with open(exact) as f:
            for row in csv.DictReader(f):
                if row.get("within_0.1%") != "True":
                    lines.append(f"  exactness off: {row['setup']} on {row['device']}: {row['meter_bytes']} B "
                                 f"against {row['reference_bytes']} B ({row['reference']})")
    slug = re.sub(r"[^a-z0-9]+", "-", info["name"].lower()).strip("-")
    report = ROOT / "data" / "runs" / f"{slug}-gpu-check.txt"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(lines) + "\n")
    print("\n".join(lines) + f"\nreport written to {report.relative_to(ROOT)}")
    return 1 if failed or tests not in (0, 5) or code != 0 else 0


def main(argv: list[str]) -> int:
    commands = ("lab", "test", "bench", "setup", "gpu-check", "outputs", "links", "rehearse")
    if not argv or argv[0] not in commands:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "links":          # files only: no .venv needed
        return links(rest)
    setup()
    if command == "lab":
        lab(rest)
    if command == "test":
        return test(rest)
    if command == "bench":
        return bench(rest)
    if command == "gpu-check":
        return gpu_check(rest)
    if command == "outputs":
        return outputs(rest)
    if command == "rehearse":
        return rehearse(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
