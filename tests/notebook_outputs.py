"""The notebooks' stored outputs: made by one command, checked by tests/test_stored_outputs.py.

Each notebook is stored with the outputs of a run on this repository's CPU path, so a reader browsing the
repository sees the numbers and plots. The run is recorded in the notebook's metadata (``gpukit.outputs``):
the device, the torch version, and a digest of the code cells it ran, so a test can tell outputs made by
older code from current ones.

    python3 kit.py outputs                      # every notebook, two at a time
    python3 kit.py outputs notebooks/05_*.ipynb # some of them

Outputs are cleaned before they are stored: this machine's paths (the repository, the Python installation,
the home directory) are replaced by placeholders, and memory addresses by ``0xADDRESS``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
MAX_BYTES = 1024 * 1024          # each stored notebook: at most 1 MiB
DEVICE = "cpu"                   # the device the stored run used (no GPU is assumed to be at hand)
TIMEOUT_S = 900                  # one cell
# Longest first (seconds each, two workers, 2026-11-28: 14 56, 01 39, 00 18 in the browser, 09 17, 13 15, 06 11, 11 11,
# 08 10, 10 9, 05 9, 03 8, the rest less): conftest runs the notebooks before the unit tests, each on the next free
# worker, so the two workers end together instead of one running every notebook.
LONGEST_FIRST = ["14", "01", "00", "09", "13", "06", "11", "08", "10", "05", "03", "12", "07", "04", "02"]
README_NOTEBOOK = "00_where_memory_goes"   # its explorer (toggles, role bars and table) is the README's picture
# What only a browser can show to fail: a widget's view ("Error displaying widget") and a script's error in the page.
FRONT_END = ("application/vnd.jupyter.widget-view+json", "application/javascript")


def longest_first(paths) -> list[Path]:
    return sorted(paths, key=lambda p: (LONGEST_FIRST.index(p.name[:2]) if p.name[:2] in LONGEST_FIRST else -1,
                                        p.name))


def front_end_outputs(nb: dict) -> list[str]:
    """The front-end outputs of a notebook (a widget's view, JavaScript), as ``cell N: mime type``."""
    return [f"cell {i}: {mime}" for i, cell in enumerate(nb["cells"]) if cell["cell_type"] == "code"
            for out in cell.get("outputs", []) for mime in out.get("data", {}) if mime in FRONT_END]


def in_the_browser(path: Path) -> bool:
    """Whether tests/test_browser.py runs this notebook: its stored outputs hold a widget or JavaScript, which only
    a browser shows to fail, or it is the README's picture. The others run in a kernel alone
    (tests/test_notebooks.py), which fails if their run makes such an output after all."""
    return path.stem == README_NOTEBOOK or bool(front_end_outputs(json.loads(path.read_text())))


def copy_repository(dest: Path) -> Path:
    """A copy of notebooks/ beside links to the rest of the repository (paths such as ../data work as in the
    repository, while what a run writes lands in the copy). The notebooks lose their outputs and execution counts,
    so every count seen later is from this run. Returns the copy of notebooks/."""
    import shutil

    dest.mkdir()
    for entry in ROOT.iterdir():
        if entry.name != "notebooks" and not entry.name.startswith("."):
            (dest / entry.name).symlink_to(entry)
    notebooks = dest / "notebooks"
    shutil.copytree(NOTEBOOKS, notebooks, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    for path in notebooks.glob("*.ipynb"):
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                cell["outputs"], cell["execution_count"] = [], None
        path.write_text(json.dumps(nb, indent=1))
    return notebooks


def code_digest(nb: dict) -> str:
    """A digest of the notebook's code cells, in order (their sources only: outputs and metadata aside)."""
    h = hashlib.sha256()
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            h.update(source.encode())
            h.update(b"\0")
    return h.hexdigest()[:16]


def machine_paths() -> list[tuple[str, str]]:
    """(path, placeholder) pairs for the paths of this machine that outputs can show, longest first."""
    import site
    import sysconfig

    pairs = {str(ROOT): "<repository>", str(Path.home()): "<home>"}
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix}:
        pairs[prefix] = "<python>"
    for key in ("purelib", "platlib", "stdlib"):
        pairs[sysconfig.get_paths()[key]] = f"<{key}>"
    for path in site.getsitepackages():
        pairs[path] = "<site-packages>"
    return sorted(((p, r) for p, r in pairs.items() if len(p) > 1), key=lambda pr: -len(pr[0]))


def _clean_text(text: str, pairs) -> str:
    for path, placeholder in pairs:
        text = text.replace(path, placeholder)
    return re.sub(r"0x[0-9a-fA-F]{6,}", "0xADDRESS", text)


def clean(nb: dict) -> dict:
    """Outputs without this machine's paths or addresses, and without per-run metadata."""
    pairs = machine_paths()

    def fix(value):
        if isinstance(value, str):
            return _clean_text(value, pairs)
        if isinstance(value, list):
            return [fix(v) for v in value]
        return value

    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        cell["metadata"].pop("execution", None)
        for out in cell["outputs"]:
            if "text" in out:
                out["text"] = fix(out["text"])
            if "traceback" in out:
                out["traceback"] = fix(out["traceback"])
            if "evalue" in out:
                out["evalue"] = fix(out["evalue"])
            for mime, value in out.get("data", {}).items():
                if mime.startswith("text/"):
                    out["data"][mime] = fix(value)
    nb["metadata"].pop("widgets", None)
    return nb


def problems(path: Path) -> list[str]:
    """What is wrong with a notebook's stored outputs (empty when they are current and clean)."""
    text = path.read_text()
    nb = json.loads(text)
    found = []
    record = nb["metadata"].get("gpukit", {}).get("outputs")
    fix = f"refresh them: python3 kit.py outputs notebooks/{path.name}"
    if record is None:
        return [f"{path.name}: no stored outputs; {fix}"]
    if record.get("code") != code_digest(nb):
        found.append(f"{path.name}: the stored outputs were made by older code than the notebook's cells; {fix}")
    for i, cell in enumerate(nb["cells"]):
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] == "code" and source.strip() and cell.get("execution_count") is None:
            found.append(f"{path.name}: code cell {i} has not run; {fix}")
            break
    if len(text.encode()) > MAX_BYTES:
        found.append(f"{path.name}: {len(text.encode()):,} bytes stored, more than {MAX_BYTES:,}")
    outputs = json.dumps([c.get("outputs", []) for c in nb["cells"] if c["cell_type"] == "code"])
    leaked = [p for p, _ in machine_paths() if p in outputs]
    leaked += [m.group(0) for m in re.finditer(r"(/home/|/root/|/tmp/|/Users/|[A-Z]:\\\\Users)[^\s\"']*", outputs)]
    if leaked:
        found.append(f"{path.name}: machine paths in the outputs: {sorted(set(leaked))[:3]}")
    # The run's device, or the one a notebook simulates on it (notebook 07: a fake-tensor GPU on "meta").
    if not re.search(rf"\b({re.escape(record.get('device', DEVICE))}|cuda|meta)\b", outputs):
        found.append(f"{path.name}: no output names the device ({record.get('device')})")
    return found


def refresh(path: Path) -> tuple[str, float]:
    """Run the notebook in a fresh kernel (from notebooks/, as JupyterLab does) and store its outputs."""
    import nbclient
    import nbformat
    import torch

    start = time.perf_counter()
    nb = nbformat.read(path, as_version=4)
    env_backend = os.environ.pop("MPLBACKEND", None)  # plots inline, as a reader sees them
    try:
        client = nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3", record_timing=False,
                                         store_widget_state=True,  # needed to follow Output widgets; dropped below
                                         resources={"metadata": {"path": str(path.parent)}})
        client.execute()
    finally:
        if env_backend is not None:
            os.environ["MPLBACKEND"] = env_backend
    data = clean(json.loads(nbformat.writes(nb)))
    data["metadata"]["gpukit"] = {"outputs": {"device": DEVICE, "torch": torch.__version__.split("+")[0],
                                              "code": code_digest(data)}}
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return path.name, time.perf_counter() - start


def main(args: list[str]) -> int:
    paths = [Path(a).resolve() for a in args] or sorted(NOTEBOOKS.glob("*.ipynb"))
    missing = [p for p in paths if p.suffix != ".ipynb" or not p.is_file()]
    if missing:
        print(f"not a notebook: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # two kernels share the cores
    failed = 0
    with ProcessPoolExecutor(max_workers=min(2, len(paths))) as pool:
        futures = {pool.submit(refresh, p): p for p in paths}
        for future, p in futures.items():
            try:
                name, seconds = future.result()
                print(f"{name}: outputs stored ({seconds:.0f} s)", flush=True)
            except Exception as err:  # the notebook failed: keep the file as it was
                failed += 1
                print(f"{p.name}: FAILED, outputs not stored: {type(err).__name__}: {str(err)[-2000:]}",
                      file=sys.stderr, flush=True)
    for p in paths:
        for problem in problems(p):
            print(problem, file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
