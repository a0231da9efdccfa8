"""The environment kit.py makes and runs in: where the repository and .venv are, .venv set up from the package
index with the locked versions (linked to a torch the running python3 already has, where it is within gpukit's
range), and the environment variables the tests run with. Standard library only: it runs on a fresh machine."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
VENV_PY = VENV / "bin" / "python"
STAMP = VENV / ".gpukit-installed"
LINK_PTH = "_gpukit_outer_torch.pth"
LOCK = ROOT / "constraints.txt"
REQUIREMENT_FILES = ("constraints.txt", "pyproject.toml")


def run(cmd: list[str], **kwargs) -> None:
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


def venv_site_packages() -> Path:
    out = subprocess.run(
        [str(VENV_PY), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    return Path(out)


def fingerprint(extra: str) -> str:
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
            run([sys.executable, "-m", "venv", VENV])
        except subprocess.CalledProcessError:
            sys.exit("kit.py: `python3 -m venv` failed. On Debian/Ubuntu install the "
                     "venv module first: apt-get install python3-venv")

    linked = link_torch(VENV_PY, venv_site_packages())
    key = fingerprint(f"linked={linked}")
    if STAMP.exists() and STAMP.read_text() == key:
        return

    kept = VENV / ".constraints-resolved.txt"
    kept.write_text(constraints(linked))
    # --no-compile: pip would byte-compile every module of every package (torch's thousands among them), more
    # than half of a fresh set-up's time (115 s with, 51 s without, on two cores); Python compiles the
    # modules a run imports, once, when it first imports them.
    run([VENV_PY, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-compile",
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

