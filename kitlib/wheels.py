"""A lent GPU machine that reaches no package index: the wheels it lacks, downloaded here (`kit.py gpu-wheels`,
gpu-wheels.txt), and .venv set up there from them alone, linked to the machine's own torch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from . import venv

# -- a lent GPU machine that reaches no package index ---------------------------------------------------------
# Such a machine gets the working tree and the folders named to go with it, 64 MiB in all; its Python has a CUDA torch
# and most of what the lessons import, not the kernel, nbclient or nbval. `kit.py gpu-wheels` downloads those wheels
# here (gpu-wheels.txt), and `kit.py gpu-check` there installs them offline into .venv, linked to the machine's torch.
WHEELS = venv.ROOT / ".gpu-wheels"
WHEEL_LIST = venv.ROOT / "gpu-wheels.txt"
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
        if not venv.in_range(python_version, found.group(1) + found.group(2)):
            return False
    return True


def wheel_requirements(python_version: str, listing: Path | None = None, lock: Path | None = None) -> list[str]:
    """gpu-wheels.txt's packages, each as ``name==version``: its own pin, or constraints.txt's for that Python."""
    pins = {}
    for line in (lock or venv.LOCK).read_text().splitlines():
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
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=venv.ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return sum((venv.ROOT / p).stat().st_size for p in listed if p and (venv.ROOT / p).is_file())


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
    venv.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-qq", "--only-binary=:all:",
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
    if not venv.VENV_PY.exists():
        try:
            venv.run([sys.executable, "-m", "venv", venv.VENV])
        except subprocess.CalledProcessError:     # a Python without ensurepip: pip comes from the carried wheel
            venv.run([sys.executable, "-m", "venv", "--clear", "--without-pip", venv.VENV])
    linked = venv.link_torch(venv.VENV_PY, venv.venv_site_packages())
    if linked is None:
        return False
    names = carried(wheels)
    key = venv.fingerprint(f"linked={linked} offline={','.join(names)}")
    if venv.STAMP.exists() and venv.STAMP.read_text() == key:
        return True
    has_pip = subprocess.run([str(venv.VENV_PY), "-c", "import pip"], capture_output=True).returncode == 0
    pip_wheel = next(iter(sorted(wheels.glob("pip-*.whl"))), None)
    if not has_pip and pip_wheel is None:
        sys.exit(f"kit.py: .venv has no pip and {wheels} no pip wheel: run python3 kit.py gpu-wheels again")
    pip = [venv.VENV_PY, "-m", "pip"] if has_pip else [venv.VENV_PY, f"{pip_wheel}/pip"]
    # gpukit's own dependencies (torch, numpy, pandas, ...) are the machine's where it has them: pip keeps what the
    # linked site-packages already satisfy and takes the rest from the wheels.
    try:
        venv.run([*pip, "install", "--disable-pip-version-check", "-q", "--no-compile", "--no-index", "--find-links",
              wheels, "-e", venv.ROOT, *names], env=offline_pip_environment())
    except subprocess.CalledProcessError:
        sys.exit(f"kit.py: the wheels in {wheels} do not install into .venv on {sys.executable} (pip says why above): "
                 f"they are made for one Python (python3 kit.py gpu-wheels --python-version X.Y); where this machine "
                 f"reaches a package index, remove {wheels.name}/ and .venv is set up from the index")
    venv.STAMP.write_text(key)
    return True

