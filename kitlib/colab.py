"""Colab and Kaggle: each notebook's install cell and the README's "Open in Colab" links, built from
pyproject.toml's repository URL (`kit.py links`)."""

from __future__ import annotations

import re

from . import venv

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
                      (venv.ROOT / "pyproject.toml").read_text(), re.M)
    if not found:
        raise SystemExit('pyproject.toml: no [project.urls] Repository = "https://github.com/OWNER/NAME"')
    return found.group(1)


def install_cell(url: str) -> str:
    return INSTALL_CELL.format(url=url)


def colab_url(url: str, notebook: str) -> str:
    """The address that opens ``notebooks/<notebook>`` of the repository's main branch in Colab."""
    return f"https://colab.research.google.com/github/{url.removeprefix('https://github.com/')}/blob/main/" \
           f"notebooks/{notebook}"


def cell_source(text: str) -> list[str]:
    lines = text.split("\n")
    return [line + "\n" for line in lines[:-1]] + [lines[-1]]


def links(args: list[str]) -> int:
    """Write (or insert) each notebook's install cell and the README's Colab links; say what changed."""
    import json

    url = repository_url()
    changed = []
    for path in sorted((venv.ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(path.read_text())
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        want = cell_source(install_cell(url))
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
    readme = (venv.ROOT / "README.md").read_text()
    rows = re.sub(r"^\| `(\d\d_\w+)` \| [^|]* \|",
                  lambda m: f"| `{m.group(1)}` | [Colab]({colab_url(url, m.group(1) + '.ipynb')}) |", readme,
                  flags=re.M)
    if rows != readme:
        (venv.ROOT / "README.md").write_text(rows)
        changed.append("README.md")
    print("\n".join(f"wrote {name}" for name in changed) or "nothing to change")
    if any(name.endswith(".ipynb") for name in changed):
        print("their code changed: re-store their outputs with `python3 kit.py outputs`")
    return 0

