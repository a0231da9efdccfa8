#!/usr/bin/env python3
"""Set up gpukit's environment in .venv/ and run it.

    python3 kit.py lab      create/update .venv, then open JupyterLab on notebooks/
    python3 kit.py test     create/update .venv, then run every test (pytest + nbval)
    python3 kit.py bench    create/update .venv, then run the benchmarks in bench/
    python3 kit.py setup    only create/update .venv
    python3 kit.py outputs  run the notebooks on the CPU and store them with their outputs (all, or those named)
    python3 kit.py gpu-check   on a GPU machine, within a time budget (--budget, 540 s): the exactness benchmark,
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

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
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


# -- a lent GPU machine that reaches no package index ---------------------------------------------------------
# Such a machine gets the working tree and the folders named to go with it, 64 MiB in all; its Python has a CUDA torch
# and most of what the lessons import, not the kernel, nbclient or nbval. `kit.py gpu-wheels` downloads those wheels
# here (gpu-wheels.txt), and `kit.py gpu-check` there installs them offline into .venv, linked to the machine's torch.
WHEELS = ROOT / ".gpu-wheels"
WHEEL_LIST = ROOT / "gpu-wheels.txt"
TRAVEL_BYTES = 64 * 2**20


def canonical(name: str) -> str:
    """A distribution's name as pip compares names (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def marker_holds(marker: str | None, python_version: str) -> bool:
    """Whether a marker of ``python_version`` comparisons (constraints.txt's only kind) holds for that Python."""
    for clause in filter(None, (marker or "").split(" and ")):
        found = re.fullmatch(r'\s*python_version\s*(>=|<=|==|!=|>|<)\s*"([\d.]+)"\s*', clause)
        if not found:
            raise ValueError(f"marker {marker!r}: only python_version comparisons are understood")
        if not in_range(python_version, found.group(1) + found.group(2)):
            return False
    return True


def wheel_requirements(python_version: str, listing: Path | None = None, lock: Path | None = None) -> list[str]:
    """gpu-wheels.txt's packages, each as ``name==version``: its own pin, or constraints.txt's for that Python."""
    pins = {}
    for line in (lock or LOCK).read_text().splitlines():
        found = re.match(r"\s*([A-Za-z0-9_.-]+)==([^;#\s]+)\s*(?:;([^#]*))?", line)
        if found and marker_holds(found.group(3), python_version):
            pins[canonical(found.group(1))] = found.group(2)
    wanted = []
    for line in (listing or WHEEL_LIST).read_text().splitlines():
        req = line.split("#", 1)[0].strip()
        if not req:
            continue
        name, _, version = req.partition("==")
        version = version or pins.get(canonical(name))
        if not version:
            raise SystemExit(f"gpu-wheels.txt: {name} has no version here and none in constraints.txt")
        wanted.append(f"{name}=={version}")
    return wanted


def slim_bitsandbytes(wheel: Path, cuda: list[str]) -> tuple[int, int]:
    """Keep in bitsandbytes' wheel only its CPU library and those of the CUDA releases named (its wheel carries one
    per CUDA and ROCm release, 43 MB in all); RECORD loses the dropped files' lines. Returns (bytes before, after)."""
    import zipfile

    keep = {f"libbitsandbytes_cpu.so"} | {f"libbitsandbytes_cuda{c}.so" for c in cuda}
    dropped = lambda name: re.fullmatch(r"bitsandbytes/libbitsandbytes_\w+\.so", name) and \
        name.split("/")[-1] not in keep  # noqa: E731
    before = wheel.stat().st_size
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if dropped(item.filename):
                continue
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = "".join(line for line in data.decode().splitlines(keepends=True)
                               if not dropped(line.split(",", 1)[0])).encode()
            dst.writestr(item, data)
    slim.replace(wheel)
    return before, wheel.stat().st_size


def travel_bytes() -> int:
    """The bytes of the files that go to a lent machine without being named: tracked and untracked, not ignored."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return sum((ROOT / p).stat().st_size for p in listed if p and (ROOT / p).is_file())


def gpu_wheels(args: list[str]) -> int:
    """Download gpu-wheels.txt's wheels for the lent machine's Python into .gpu-wheels/; say what travels."""
    import argparse
    import shutil

    parser = argparse.ArgumentParser(prog="python3 kit.py gpu-wheels", description=gpu_wheels.__doc__)
    parser.add_argument("--python-version", default="3.12", help="the lent machine's Python (default 3.12)")
    parser.add_argument("--cuda", default="130", help="CUDA releases of bitsandbytes' libraries to keep, as its "
                        "library names spell them: 130 for a torch built with CUDA 13.0 (default), or 128,130")
    parser.add_argument("--dest", type=Path, default=WHEELS)
    opts = parser.parse_args(args)
    wanted = wheel_requirements(opts.python_version)
    if opts.dest.exists():
        shutil.rmtree(opts.dest)
    opts.dest.mkdir(parents=True)
    # pip matches each --platform tag as named, not the older glibc's it implies: bitsandbytes is tagged 2_24 only.
    platforms = [f"--platform=manylinux_2_{v}_x86_64" for v in (17, 24, 26, 27, 28)] + \
        ["--platform=manylinux2014_x86_64", "--platform=manylinux2010_x86_64", "--platform=manylinux1_x86_64"]
    _run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-qq", "--only-binary=:all:",
          "--no-deps", "--python-version", opts.python_version, *platforms, "-d", opts.dest, *wanted])
    for wheel in opts.dest.glob("bitsandbytes-*.whl"):
        before, after = slim_bitsandbytes(wheel, opts.cuda.split(","))
        print(f"bitsandbytes: kept the CPU library and CUDA {opts.cuda}'s: {before / 2**20:.1f} MiB -> "
              f"{after / 2**20:.1f} MiB")
    wheels = sorted(opts.dest.glob("*.whl"), key=lambda w: -w.stat().st_size)
    total, tree = sum(w.stat().st_size for w in wheels), travel_bytes()
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:8.2f} MiB  {w.name}")
    fits = total + tree <= TRAVEL_BYTES
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB; with the working tree's {tree / 2**20:.1f} MiB, "
          f"{(total + tree) / 2**20:.1f} MiB of the {TRAVEL_BYTES / 2**20:.0f} MiB a lent machine receives"
          + ("" if fits else ": TOO MUCH"))
    return 0 if fits else 1


def carried(wheels: Path) -> list[str]:
    """The distributions whose wheels are in ``wheels``."""
    return sorted({canonical(w.name.split("-", 1)[0]) for w in wheels.glob("*.whl")})


def offline_pip_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """pip with no configuration of this machine (files or PIP_* variables): only the wheels named on its command
    line, so that what installs here installs on a machine that has nothing else."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("PIP_")}
    return dict(env, PIP_CONFIG_FILE=os.devnull)


def setup_offline(wheels: Path = WHEELS) -> bool:
    """Create .venv on this python3's own torch with the carried wheels, without a package index. False (nothing
    done) where python3 has no torch within gpukit's range to link: the wheels carry no torch."""
    if not VENV_PY.exists():
        try:
            _run([sys.executable, "-m", "venv", VENV])
        except subprocess.CalledProcessError:     # a Python without ensurepip: pip comes from the carried wheel
            _run([sys.executable, "-m", "venv", "--clear", "--without-pip", VENV])
    linked = link_torch(VENV_PY, _venv_site_packages())
    if linked is None:
        return False
    names = carried(wheels)
    key = _fingerprint(f"linked={linked} offline={','.join(names)}")
    if STAMP.exists() and STAMP.read_text() == key:
        return True
    has_pip = subprocess.run([str(VENV_PY), "-c", "import pip"], capture_output=True).returncode == 0
    pip_wheel = next(iter(sorted(wheels.glob("pip-*.whl"))), None)
    if not has_pip and pip_wheel is None:
        sys.exit(f"kit.py: .venv has no pip and {wheels} no pip wheel: run python3 kit.py gpu-wheels again")
    pip = [VENV_PY, "-m", "pip"] if has_pip else [VENV_PY, f"{pip_wheel}/pip"]
    # gpukit's own dependencies (torch, numpy, pandas, ...) are the machine's where it has them: pip keeps what the
    # linked site-packages already satisfy and takes the rest from the wheels.
    try:
        _run([*pip, "install", "--disable-pip-version-check", "-q", "--no-compile", "--no-index", "--find-links",
              wheels, "-e", ROOT, *names], env=offline_pip_environment())
    except subprocess.CalledProcessError:
        sys.exit(f"kit.py: the wheels in {wheels} do not install into .venv on {sys.executable} (pip says why above): "
                 f"they are made for one Python (python3 kit.py gpu-wheels --python-version X.Y); where this machine "
                 f"reaches a package index, remove {wheels.name}/ and .venv is set up from the index")
    STAMP.write_text(key)
    return True


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
# A lent GPU machine runs one command for at most 10 minutes, and a task has 15 minutes of it, its start included: the
# check fits in BUDGET_S from kit.py's start, set-up included, every stage with a deadline of its own. What comes back
# from it is at most 8 files of 16 MiB each: the check packs everything it wrote into one.
BUDGET_S = 540
PACK_BYTES = 16 * 2**20
STARTED, STARTED_WALL = time.monotonic(), time.time()
NOTEBOOK_WORKERS = 8      # as in the notebooks' first GPU run (data/runs/notebooks-on-gpus.txt)
NOTEBOOK_GRACE_S = 10     # a notebook's runner stops it at the deadline; one still running this much later is killed
NOTEBOOK_MIN_S = 10       # no notebook is started with less time left than this


class TimeUp(Exception):
    """The check was told to end (SIGTERM) before its stages were done."""


def stop(proc: subprocess.Popen, grace: float) -> None:
    """Interrupt a process started in a session of its own (SIGINT to its group, as Ctrl-C: pytest still writes its
    record), and kill the group if it has not ended ``grace`` seconds later."""
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def start(cmd: list, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` from the repository in a session of its own, its output into ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        return subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_until(proc: subprocess.Popen, deadline: float, grace: float = 15.0) -> int | None:
    """Wait for ``proc`` until ``deadline`` (time.monotonic()), then stop it. Its exit status, or None if it was cut."""
    try:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        stop(proc, grace)
        return None
    except BaseException:
        stop(proc, 0.0)
        raise


def run_until(cmd: list, deadline: float, log: Path, env: dict[str, str] | None = None,
              grace: float = 15.0) -> int | None:
    """Run ``cmd`` from the repository, its output into ``log``, until ``deadline``; then stop it. Returns its exit
    status, or None when it was cut."""
    return wait_until(start(cmd, log, env), deadline, grace)


def _code(notebook: Path) -> str:
    import json

    cells = json.loads(notebook.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def reads_the_clock(notebook: Path) -> bool:
    """Whether a notebook times something on this machine: it then runs alone, so that no other notebook's work
    shares the GPU and the cores while it measures."""
    return bool(re.search(r"\bperf_counter\b|\btime\.time\(|\bmonotonic\(|\btimeit\b", _code(notebook)))


def fills_the_card(notebook: Path) -> bool:
    """Whether a notebook runs out of the card's memory on purpose (it catches ``OutOfMemoryError``): it then runs
    alone. Beside it, the others' requests fail instead (on an H200, 2026-11-27, notebook 08's step too big for the
    card left 85 MiB free, and notebooks 00, 02 and 07 ran out of memory)."""
    return "OutOfMemoryError" in _code(notebook)


def why_alone(notebook: Path) -> str | None:
    """Why a notebook runs alone on the card, or None when it can share it."""
    return "they time steps" if reads_the_clock(notebook) else "they fill the card" if fills_the_card(notebook) \
        else None


def run_notebooks(notebooks: list[Path], workers: int, deadline: float, to: Path, logs: Path, card: str,
                  torch_version: str) -> list[dict]:
    """Run the notebooks, ``workers`` at a time, each stored in ``to`` with its outputs by tests/notebooks_on_card.py
    (which stops its notebook at the deadline); one still running NOTEBOOK_GRACE_S past it is killed. Returns each
    notebook's summary, in the order given (not the order they ended in, which the machine's load decides); a
    notebook never started has ``cut`` set and no file."""
    pending, running, results = list(notebooks), {}, []
    order = {nb.stem: i for i, nb in enumerate(notebooks)}
    try:
        results = _run_notebooks(pending, running, results, workers, deadline, to, logs, card, torch_version)
        return sorted(results, key=lambda r: order.get(r["notebook"], len(order)))
    except BaseException:             # told to end (SIGTERM): no kernel outlives the check
        for proc, out in running.values():
            stop(proc, 0.0)
            out.close()
        raise


def _run_notebooks(pending: list[Path], running: dict, results: list[dict], workers: int, deadline: float, to: Path,
                   logs: Path, card: str, torch_version: str) -> list[dict]:
    import json

    while pending or running:
        while pending and len(running) < workers:
            left = deadline - time.monotonic()
            if left < NOTEBOOK_MIN_S:
                results += [{"notebook": nb.stem, "cut": "not started: no time left", "failed": [], "ran": 0}
                            for nb in pending]
                pending.clear()
                break
            nb = pending.pop(0)
            out = open(logs / f"{nb.stem}.log", "w")
            proc = subprocess.Popen(
                [str(VENV_PY), str(ROOT / "tests" / "notebooks_on_card.py"), str(nb), "--to", str(to),
                 "--seconds", f"{left:.0f}", "--card", card, "--torch", torch_version],
                cwd=ROOT, env=test_environment(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            running[nb] = (proc, out)
        time.sleep(0.2)
        for nb, (proc, out) in list(running.items()):
            late = time.monotonic() > deadline + NOTEBOOK_GRACE_S
            if proc.poll() is None and not late:
                continue
            if late:
                stop(proc, 5.0)
            out.close()
            del running[nb]
            last = ((logs / f"{nb.stem}.log").read_text().strip().splitlines() or [""])[-1]
            try:
                results.append(json.loads(last))
            except ValueError:
                results.append({"notebook": nb.stem, "failed": [], "ran": None,
                                "cut": "killed past the deadline" if late else f"the runner failed (exit "
                                       f"{proc.returncode}): {last[:300]}"})
    return results


def notebook_lines(results: list[dict], alone: dict[str, str], stored: Path) -> list[str]:
    """The report's lines on the notebooks; ``alone`` maps those that ran alone to why (``why_alone``)."""
    done = [r for r in results if not r["failed"] and not r["cut"]]
    reasons = sorted(set(alone.values()))
    lines = [f"notebooks: {len(done)} of {len(results)} ran to the end with no failing cell, stored with their outputs "
             f"in {stored.relative_to(ROOT)}/"
             + (" (" + "; ".join(f"{', '.join(sorted(n for n, w in alone.items() if w == why))} alone: {why}"
                                 for why in reasons) + ")" if alone else "")]
    for r in sorted(results, key=lambda r: r["notebook"]):
        took = f" ({r['seconds']:.0f} s)" if r.get("seconds") is not None else ""
        if r["cut"]:
            ran = "" if r["ran"] is None else f"; {r['ran']} code cells ran"
            lines.append(f"  cut: {r['notebook']}: {r['cut']}{ran}{took}")
        for index, why in r["failed"]:
            lines.append(f"  failure: {r['notebook']}: cell {index}: {why}")
    return lines


def cuda_test_files() -> list[str]:
    """The test files with tests that run only with CUDA (they skip on the CPU), from the repository."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "cuda.is_available()" in p.read_text())


def read_junit(junit: Path) -> tuple[int, list[str], list[str]]:
    """(tests, failures and errors, skips) of a pytest record, each as a report line."""
    import xml.etree.ElementTree as ET

    failed, skipped, total = [], [], 0
    for case in (ET.parse(junit).getroot().iter("testcase") if junit.exists() else ()):
        total += 1
        name = f"{case.get('classname')}::{case.get('name')}"
        for kind, into in (("failure", failed), ("error", failed), ("skipped", skipped)):
            found = case.find(kind)
            if found is not None:
                why = ((found.get("message") or kind).splitlines() or [kind])[0][:200]
                into.append(f"  {kind}: {name}: {why}")
    return total, failed, skipped


def written_since(start: float, folders: list[Path]) -> list[Path]:
    return sorted(p for folder in folders if folder.exists() for p in folder.rglob("*")
                  if p.is_file() and p.stat().st_mtime >= start - 1)


def pack(tarball: Path, files: list[Path], limit: int = PACK_BYTES) -> list[str]:
    """Pack ``files`` (paths in the repository) into one tar.gz of at most ``limit`` bytes, leaving out the largest
    files until it fits; returns the report's lines about it."""
    import tarfile

    files, left_out = sorted(files), []
    while True:
        tarball.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tarball, "w:gz") as tar:
            for f in files:
                tar.add(f, arcname=str(f.relative_to(ROOT)))
        size = tarball.stat().st_size
        if size <= limit or not files:
            break
        biggest = max(files, key=lambda f: f.stat().st_size)
        files.remove(biggest)
        left_out.append(f"  left out of the archive, over its {limit / 2**20:.0f} MiB: "
                        f"{biggest.relative_to(ROOT)} ({biggest.stat().st_size / 2**20:.1f} MiB)")
    return [f"packed: {len(files)} files into {tarball} ({size / 2**20:.2f} MiB)"] + left_out


def gpu_check(args: list[str]) -> int:
    """Prove the kit on this machine's GPU within a time budget: the exactness benchmark and the technique matrix
    recorded in data/runs/, every notebook run on the card and stored with its outputs in data/runs/<gpu>/, the tests
    that need CUDA (then the others, in the time left), and a short report of everything that differed from what the
    CPU runs expect, in data/runs/<gpu>-gpu-check.txt. With --out, everything it wrote is packed into
    OUT/gpu-check.tar.gz. Other arguments go to pytest."""
    import argparse
    import csv
    import json

    parser = argparse.ArgumentParser(prog="python3 kit.py gpu-check", description=gpu_check.__doc__)
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help=f"seconds for the whole check from kit.py's start, set-up included (default {BUDGET_S})")
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT") or None,
                        help="folder for gpu-check.tar.gz (default: $OUT where set)")
    parser.add_argument("--notebooks", default="", help="comma-separated name prefixes (03,05_gr): only those")
    parser.add_argument("--workers", type=int, default=NOTEBOOK_WORKERS, help="notebooks run at once")
    parser.add_argument("--skip", action="append", default=[], choices=["bench", "notebooks", "tests"])
    parser.add_argument("--tests", choices=["cuda", "all"], default="all", help="the test files with CUDA-only tests, "
                        "or those and then all the others in the time left (default)")
    parser.add_argument("--cpu", action="store_true", help="run the stages where torch sees no GPU (a rehearsal of "
                        "the command: its card is 'cpu'); without it, no GPU means nothing runs")
    opts, pytest_args = parser.parse_known_args(args)
    end = STARTED + opts.budget
    left = lambda: end - time.monotonic()  # noqa: E731

    probe = subprocess.run([str(VENV_PY), "-c", GPU_PROBE], cwd=ROOT, capture_output=True, text=True)
    if probe.returncode != 0:
        print(probe.stderr[-2000:], file=sys.stderr)
        return probe.returncode
    info = json.loads(probe.stdout.strip().splitlines()[-1])
    if not info["cuda"] and not opts.cpu:
        print(f"kit.py gpu-check: .venv's torch {info['torch']} sees no CUDA GPU. Run kit.py with the python3 "
              "that has this machine's CUDA torch (python3 -c 'import torch; print(torch.cuda.is_available())' "
              "says True), or install a CUDA build of torch into .venv.", file=sys.stderr)
        return 2
    card = info.get("name", "cpu")
    slug = re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-")
    where = (f"{card} (sm_{''.join(map(str, info['capability']))}, {info['devices']} GPU(s))" if info["cuda"] else
             "no GPU: the stages rehearsed on the CPU")
    out = ROOT / "bench" / "out"
    logs = out / "gpu-check"
    logs.mkdir(parents=True, exist_ok=True)
    stored = ROOT / "data" / "runs" / slug
    lines = [f"gpukit gpu-check: {where}, torch {info['torch']}, CUDA {info['cuda_version']}",
             f"budget: {opts.budget:.0f} s from kit.py's start; set-up and probe took "
             f"{time.monotonic() - STARTED:.0f} s"]
    if info["cuda"]:
        # cuBLAS's workspaces (gpukit.warm_up): expected at least one per thread that multiplied.
        first, size = info["first_warm_up"], info["workspace"]
        note = "as expected" if size <= first <= 2 * size + 4 * 2**20 else \
            "NOT between 1 and 2 workspaces (+ cuBLASLt's)"
        lines.append(f"warm-up: the first matmuls left {first:,} B allocated = {first / size:.2f} x the {size:,} B "
                     f"cuBLAS workspace ({note}); the second warm-up {info['second_warm_up']:,} B (expected 0)")
    problems = []

    def ended(signum, frame):
        raise TimeUp()

    previous = signal.signal(signal.SIGTERM, ended)
    stage, compare, recorded = "bench", None, []

    def compared(deadline: float) -> list[str]:
        """The replay's lines, once it has ended or been stopped at ``deadline``."""
        code = wait_until(compare, deadline)
        table = out / "recorded_runs.csv"
        if code is None:
            problems.append("predictions")
            return ["predictions: CUT at their deadline (bench/out/gpu-check/recorded_runs.log); "
                    "`python3 kit.py bench recorded_runs` replays the recorded matrix on any machine"]
        if code != 0 or not table.exists() or table.stat().st_mtime < compare_began - 1:
            problems.append("predictions")
            return [f"predictions: bench recorded_runs failed (exit {code}; bench/out/gpu-check/recorded_runs.log)"]
        found = comparison_lines(table, recorded[0])
        problems.extend(["predictions"] if len(found) > 1 else [])
        return found
    try:
        # 1. The exactness benchmark (CUDA: the meter against the allocator's own trace) and the technique matrix,
        # alone on the machine: the matrix times steps.
        if "bench" not in opts.skip:
            began, began_wall = time.monotonic(), time.time()   # files' times are the wall clock's
            print(f"== benchmarks: exactness, techniques --record ({min(150.0, 0.35 * left()):.0f} s at most)",
                  flush=True)
            code = run_until([VENV_PY, ROOT / "bench" / "run.py", "exactness", "techniques", "--record"],
                             began + min(150.0, 0.35 * left()), logs / "bench.log")
            took = time.monotonic() - began
            if code is None:
                problems.append("bench")
                lines.append(f"benchmarks: CUT after {took:.0f} s, their deadline (bench/out/gpu-check/bench.log)")
            else:
                lines.append(f"benchmarks: exactness and techniques (exit {code}, {took:.0f} s); the technique "
                             "matrix is in data/runs/")
                problems += ["bench"] if code != 0 else []
            exact = out / "exactness.csv"
            if exact.exists() and exact.stat().st_mtime >= began_wall - 1:
                with open(exact) as f:
                    for row in csv.DictReader(f):
                        if row.get("within_0.1%") != "True":
                            lines.append(f"  exactness off: {row['setup']} on {row['device']}: {row['meter_bytes']} "
                                         f"B against {row['reference_bytes']} B ({row['reference']})")
            recorded = [p.name for p in written_since(began_wall, [ROOT / "data" / "runs"]) if p.suffix == ".csv"]
            if code == 0 and recorded:
                # The run just recorded, replayed: each row predicted for this card beside its measurement (CPU work
                # on fake tensors, so it runs beside the notebooks that do not time anything).
                compare = start([VENV_PY, ROOT / "bench" / "run.py", "recorded_runs"], logs / "recorded_runs.log")
                compare_began = time.time()

        # 2. Every notebook on the card, stored with its outputs. Those that time steps or fill the card run alone,
        # one at a time, after the others; the others get a share of the time that leaves the lone ones theirs.
        stage = "notebooks"
        if "notebooks" not in opts.skip:
            wanted = [p.strip() for p in opts.notebooks.split(",") if p.strip()]
            notebooks = [nb for nb in sorted((ROOT / "notebooks").glob("*.ipynb"))
                         if not wanted or any(nb.name.startswith(w) for w in wanted)]
            alone = [nb for nb in notebooks if why_alone(nb)]
            together = [nb for nb in notebooks if nb not in alone]
            stored.mkdir(parents=True, exist_ok=True)
            began = time.monotonic()
            deadline = began + min(420.0, 0.85 * left())
            share = (deadline - began) * (0.4 if alone else 1.0) - (NOTEBOOK_GRACE_S if alone else 0)
            print(f"== notebooks: {len(together)}, {opts.workers} at a time ({share:.0f} s at most), then "
                  f"{len(alone)} alone (until {deadline - began:.0f} s)", flush=True)
            results = run_notebooks(together, opts.workers, began + share, stored, logs, card, info["torch"])
            if compare:                     # before the notebooks that time steps: nothing else runs beside them
                lines += compared(began + share)
                compare = None
            results += run_notebooks(alone, 1, deadline, stored, logs, card, info["torch"])
            summary = notebook_lines(results, {nb.stem: why_alone(nb) for nb in alone}, stored)
            summary[0] += f"; {time.monotonic() - began:.0f} s"
            lines += summary
            (stored / "notebooks.json").write_text(json.dumps(results, indent=1) + "\n")
            problems += ["notebooks"] if any(r["failed"] or r["cut"] for r in results) else []

        if compare:
            lines += compared(time.monotonic() + min(120.0, 0.5 * left()))
            compare = None

        # 3. The tests: first those that need CUDA, then the others, in the time left.
        stage = "tests"
        if "tests" not in opts.skip:
            lines += run_tests(end, logs, pytest_args, problems, others=opts.tests == "all")
    except TimeUp:
        problems.append(stage)
        lines.append(f"ENDED from outside (SIGTERM) during the {stage} stage: the stages after it did not run")
    finally:
        signal.signal(signal.SIGTERM, previous)
        if compare:
            stop(compare, 0.0)
        report = ROOT / "data" / "runs" / f"{slug}-gpu-check.txt"
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text("\n".join(lines) + "\n")
        if opts.out:
            written = written_since(STARTED_WALL, [ROOT / "data" / "runs", out])
            lines += pack(Path(opts.out) / "gpu-check.tar.gz", written)
            report.write_text("\n".join(lines) + "\n")
            pack(Path(opts.out) / "gpu-check.tar.gz", written)      # with the report's last lines
        print("\n".join(lines) + f"\nreport written to {report.relative_to(ROOT)}")
    return 1 if problems else 0


def comparison_lines(table: Path, run: str, tolerance_pct: float = 0.5) -> list[str]:
    """The recorded run ``run`` (a data/runs/ CSV's name) replayed by bench/recorded_runs.py: how many of its rows
    were predicted within ``tolerance_pct`` of the measured peak and state, and each row that was not."""
    import csv

    with open(table) as f:
        rows = [r for r in csv.DictReader(f) if r.get("run") == run]
    off = [r for r in rows if r.get("status") != "ok" or abs(float(r["peak_error_pct"])) > tolerance_pct
           or abs(float(r["state_error_pct"])) > tolerance_pct]
    lines = [f"predictions: {len(rows) - len(off)} of {len(rows)} rows of {run} predicted within {tolerance_pct:g}% "
             f"of the measured peak and state ({table.relative_to(ROOT)})"]
    for r in off:
        why = r["status"] if r.get("status") != "ok" else \
            f"peak {float(r['peak_error_pct']):+.2f}%, state {float(r['state_error_pct']):+.2f}%"
        lines.append(f"  prediction off: {r['model']}, {r['technique']}: {why}")
    return lines


def run_tests(end: float, logs: Path, pytest_args: list[str], problems: list[str], others: bool = True) -> list[str]:
    """pytest with xdist, first over the test files with CUDA-only tests, then over the rest, each session stopped at
    the budget's end less the packing's time; every test limited by pytest-timeout where .venv has it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    timeout = subprocess.run([str(VENV_PY), "-c", "import pytest_timeout"], capture_output=True).returncode == 0
    cuda_files = cuda_test_files()
    lines = []
    for name, selection in (("CUDA", cuda_files), ("other", [f"--ignore={f}" for f in cuda_files] + ["tests"])):
        if not selection or (name == "other" and not others):
            continue
        deadline = end - 20
        if deadline - time.monotonic() < 30:
            problems.append("tests")
            lines.append(f"tests ({name}): not run, no time left")
            continue
        junit = logs / f"junit-{name.lower()}.xml"
        junit.unlink(missing_ok=True)  # never read a record left by an earlier run
        per_test = ["-p", "timeout", f"--timeout={max(10, int((deadline - time.monotonic()) / 2))}"] if timeout else []
        began = time.monotonic()
        print(f"== tests ({name}): {deadline - began:.0f} s at most", flush=True)
        code = run_until([VENV_PY, "-m", "pytest", "-p", "xdist", "-n", str(min(16, cores)), "-m", "not notebook",
                          "-p", "no:cacheprovider", f"--junitxml={junit}", *per_test, *pytest_args, *selection],
                         deadline, logs / f"tests-{name.lower()}.log", env=test_environment())
        total, failed, skipped = read_junit(junit)
        status = "CUT at the budget's end" if code is None else f"pytest exit {code}"
        lines.append(f"tests ({name}): {total - len(failed) - len(skipped)} passed, {len(failed)} failed, "
                     f"{len(skipped)} skipped ({status}, {time.monotonic() - began:.0f} s)"
                     + ("" if junit.exists() else "; pytest wrote no record, see bench/out/gpu-check/"
                        f"tests-{name.lower()}.log"))
        lines += failed + skipped
        if failed or code not in (0, 5):
            problems.append("tests")
    return lines


def main(argv: list[str]) -> int:
    commands = ("lab", "test", "bench", "setup", "gpu-check", "gpu-wheels", "outputs", "links", "rehearse")
    if not argv or argv[0] not in commands:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "links":          # files only: no .venv needed
        return links(rest)
    if command == "gpu-wheels":     # this python3's pip only
        return gpu_wheels(rest)
    if command == "gpu-check" and WHEELS.is_dir() and carried(WHEELS):
        # Carried to a machine without a package index: .venv from the wheels, on the machine's own torch.
        if not setup_offline():
            print(f"kit.py: {sys.executable} has no torch within gpukit's range to link, and {WHEELS.name}/ carries "
                  "none: setting .venv up from the package index instead", flush=True)
            setup()
    else:
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
