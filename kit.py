#!/usr/bin/env python3
"""Set up gpukit's environment in .venv/ and run it.

    python3 kit.py lab      create/update .venv, then open JupyterLab on notebooks/
    python3 kit.py test     create/update .venv, then run every test (pytest + nbval)
    python3 kit.py bench    create/update .venv, then run the benchmarks in bench/
    python3 kit.py setup    only create/update .venv

Extra arguments after the command go to JupyterLab, pytest or the benchmark.

torch is pinned (requirements.txt). If the python3 that runs this script can
already import torch (a GPU machine's own CUDA build, say), .venv is linked to
that torch and keeps it instead of installing the pinned CPU version.
Needs only the Python standard library, so it runs on a fresh machine.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
VENV_PY = VENV / "bin" / "python"
STAMP = VENV / ".gpukit-installed"
LINK_PTH = "_gpukit_outer_torch.pth"
REQUIREMENT_FILES = ("requirements.txt", "requirements-test.txt", "pyproject.toml")


def _run(cmd: list[str], **kwargs) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kwargs)


def _outer_torch_paths() -> list[str]:
    """Site-packages folders of this interpreter, if it can import torch (else [])."""
    probe = "import torch, site, sys; print('\\n'.join(site.getsitepackages()))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return []
    return [line for line in done.stdout.splitlines() if line.strip()]


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


def setup() -> None:
    """Create .venv if needed and install gpukit with its pinned dependencies."""
    if Path(sys.prefix).resolve() == VENV.resolve() and STAMP.exists():
        return  # run by .venv's own python: already set up, and it cannot see an outer torch
    if not VENV_PY.exists():
        try:
            _run([sys.executable, "-m", "venv", VENV])
        except subprocess.CalledProcessError:
            sys.exit("kit.py: `python3 -m venv` failed. On Debian/Ubuntu install the "
                     "venv module first: apt-get install python3-venv")

    # Link a torch this interpreter already has (same Python version only).
    outer = _outer_torch_paths()
    site_dir = _venv_site_packages()
    pth = site_dir / LINK_PTH
    linked = bool(outer) and f"python{sys.version_info.major}.{sys.version_info.minor}" in str(site_dir)
    if linked:
        pth.write_text("\n".join(outer) + "\n")
    elif pth.exists():
        pth.unlink()

    key = _fingerprint(f"linked={outer if linked else None}")
    if STAMP.exists() and STAMP.read_text() == key:
        return

    pip = [VENV_PY, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    reqs = (ROOT / "requirements.txt").read_text().splitlines()
    if linked:
        # Keep the torch that is there; install everything else.
        reqs = [r for r in reqs if not r.strip().startswith("torch")]
    kept = VENV / ".requirements-resolved.txt"
    kept.write_text("\n".join(reqs) + "\n")
    _run(pip + ["-r", kept, "-r", ROOT / "requirements-test.txt"])
    _run(pip + ["--no-deps", "-e", ROOT])
    STAMP.write_text(key)


def lab(args: list[str]) -> None:
    cmd = [VENV / "bin" / "jupyter", "lab", f"--notebook-dir={ROOT / 'notebooks'}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")  # JupyterLab refuses to run as root without it
    os.execv(str(cmd[0]), [str(c) for c in cmd + args])


def test(args: list[str]) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    return subprocess.run([str(VENV_PY), "-m", "pytest", *args], cwd=ROOT, env=env).returncode


def bench(args: list[str]) -> int:
    return subprocess.run([str(VENV_PY), str(ROOT / "bench" / "run.py"), *args], cwd=ROOT).returncode


def main(argv: list[str]) -> int:
    commands = ("lab", "test", "bench", "setup")
    if not argv or argv[0] not in commands:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    setup()
    if command == "lab":
        lab(rest)
    if command == "test":
        return test(rest)
    if command == "bench":
        return bench(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
