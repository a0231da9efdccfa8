"""gpukit installs into Google Colab's GPU runtime as Google publishes it, replacing nothing there; and the library
asks for exactly what it imports (offline, no device).

pip keeps an installed distribution whose version meets every requirement on it, so when each requirement of
`gpukit[lessons]` that applies on Colab's Python is met by the version Colab has, `pip install gpukit[lessons]`
there installs gpukit and, beside it, only what the images lack (ADDED), whose own requirements Colab meets.
Replacing Colab's ipython or ipykernel would break its runtime."""

import ast
import re
import sys
from importlib.metadata import packages_distributions, requires
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
COLAB = ROOT / "constraints-colab.txt"


def project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def colab(path=COLAB):
    """(Python version, {canonical name: version}) of Colab's GPU runtime, from constraints-colab.txt (or of the
    image another such file describes)."""
    text = path.read_text()
    python = re.search(r"Python (\d+\.\d+\.\d+)", text)
    assert python, f"{path.name} names the Python of the image it was taken from"
    pins = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = Version(version)
    return python.group(1), pins


def applying(requirements, python, extras=()):
    """The requirements whose markers hold on Linux x86_64 with this Python and these extras."""
    out = []
    for req in map(Requirement, requirements):
        envs = [dict(default_environment(), python_version=".".join(python.split(".")[:2]),
                     python_full_version=python, sys_platform="linux", platform_system="Linux",
                     platform_machine="x86_64", extra=e) for e in (extras or ("",))]
        if req.marker is None or any(req.marker.evaluate(env) for env in envs):
            out.append(req)
    return out


def unmet(requirements, pins):
    """'name spec (has X)' for each requirement the pinned versions do not meet."""
    bad = []
    for req in requirements:
        have = pins.get(canonicalize_name(req.name))
        if have is None or not req.specifier.contains(have, prereleases=True):
            bad.append(f"{req.name}{req.specifier} (the image has {have or 'nothing'})")
    return bad


# What gpukit[lessons] asks for that neither image has any version of (bitsandbytes: AdamW8bit, on a CPU from 0.50):
# pip installs it beside what is there, which replaces nothing while the image meets its own requirements. Once an
# image has it, it is checked as any other: its floor must then be at most the image's version.
ADDED = {"bitsandbytes"}


def replaced(requirements, pins, python, requires_of=requires):
    """What `pip install` of these requirements would replace in an image with these pins: unmet() for what the
    image has, and for what it lacks and ADDED names, unmet() of that distribution's own requirements (the
    locked version's, installed here: `requires_of`). What the image lacks and ADDED does not name is refused."""
    bad = []
    for req in requirements:
        name = canonicalize_name(req.name)
        if name in pins or name not in ADDED:
            bad += unmet([req], pins)
        else:
            bad += [f"{req.name}: {b}" for b in unmet(applying(requires_of(req.name) or [], python), pins)]
    return bad


def test_the_colab_constraints_name_their_source_and_pin_a_python_gpukit_allows():
    text = COLAB.read_text()
    assert "github.com/googlecolab/backend-info" in text and re.search(r"\d{4}-\d{2}-\d{2}", text)
    python, pins = colab()
    assert SpecifierSet(project()["requires-python"]).contains(python)
    assert {"torch", "ipython", "ipykernel", "ipywidgets"} <= set(pins)


def test_gpukit_with_the_lessons_extra_installs_into_colab_and_replaces_nothing():
    python, pins = colab()
    meta = project()
    wanted = applying(meta["dependencies"] + meta["optional-dependencies"]["lessons"], python)
    assert wanted
    assert replaced(wanted, pins, python) == []
    assert ADDED <= {canonicalize_name(r.name) for r in wanted}, "ADDED names only what gpukit[lessons] asks for"


def test_the_check_itself_sees_a_floor_above_colab():
    """The same check refuses what gpukit asked for before it was made to fit Colab."""
    python, pins = colab()
    old = ["ipython>=8.39,<10", "ipykernel>=6.31,<8", "numpy>=2.2,<3", "jupyterlab>=4.6,<5",
           "tqdm>=4.67.3,<5", "torch>=2.11; python_version < '3.13'"]
    assert unmet(applying(old, python), pins) == [
        "ipython<10,>=8.39 (the image has 7.34.0)", "ipykernel<8,>=6.31 (the image has 6.17.1)",
        "numpy<3,>=2.2 (the image has 2.1.3)", "jupyterlab<5,>=4.6 (the image has nothing)"]


def test_the_check_itself_sees_an_added_package_that_would_replace_what_the_image_has():
    """An ADDED package is looked into: its own requirements must hold on the image's versions, as a floor would;
    and a package the image lacks and ADDED does not name is refused."""
    python, pins = colab()
    own = {"bitsandbytes": ["torch>=2.12", "numpy>=1.17", "pytest; extra == 'test'"]}.get
    assert replaced(applying(["bitsandbytes>=0.50", "peft>=0.30", "trl>=0.1"], python), pins, python, own) == [
        "bitsandbytes: torch>=2.12 (the image has 2.11.0)", "peft>=0.30 (the image has 0.20.0)",
        "trl>=0.1 (the image has nothing)"]


def test_gpukit_with_the_lessons_extra_installs_into_kaggle_and_replaces_nothing():
    """Kaggle's GPU image (constraints-kaggle.txt, derived from its build files) is a Colab image of May 2026:
    Python 3.12, torch 2.10, numpy 2.0.2, pandas 2.2.2, transformers 5.0. Those are gpukit's floors (its unit
    tests and notebooks passed with them, CONTRIBUTING.md): pip installs gpukit there too, and ADDED beside it."""
    kaggle = ROOT / "constraints-kaggle.txt"
    python, pins = colab(kaggle)
    assert python.startswith("3.12.") and "github.com/Kaggle/docker-python" in kaggle.read_text()
    meta = project()
    wanted = applying(meta["dependencies"] + meta["optional-dependencies"]["lessons"], python)
    assert replaced(wanted, pins, python) == []


def imported_modules():
    """Top-level names of the modules gpukit's own code imports, relative imports left out."""
    names = set()
    for path in (ROOT / "gpukit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"gpukit", "_signal"}


def test_the_library_declares_exactly_the_distributions_it_imports():
    """Each third-party module gpukit imports comes from a declared dependency, and each dependency is
    imported: what only the notebooks or the tests need lives in an extra."""
    dists = packages_distributions()
    imported = {canonicalize_name(dists[m][0]) for m in imported_modules() if m in dists}
    unknown = {m for m in imported_modules() if m not in dists}
    assert unknown == set(), f"imported but installed by no distribution here: {unknown}"
    declared = {canonicalize_name(Requirement(r).name) for r in project()["dependencies"]}
    assert imported - OPTIONAL == declared
    lessons = {canonicalize_name(Requirement(r).name) for r in project()["optional-dependencies"]["lessons"]}
    assert OPTIONAL <= imported & lessons  # each imported, and installed with the lessons


# Imported only where installed (importlib.util.find_spec first), for what plan() tries with them: LoRA adapters
# (gpukit/plan/steps.py), 8-bit optimizer state (gpukit/plan/facts.py) and optimizer state on the host
# (gpukit/plan/host.py), and QLoRA's 4-bit model as transformers' from_pretrained makes it (gpukit/plan/steps.py,
# gpukit/plan/facts.py). The lessons' extra installs them.
OPTIONAL = {"peft", "bitsandbytes", "torchao", "transformers"}


from test_kit import kit  # noqa: E402  (kit.py, loaded as a module)
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def first_code_cell(path):
    import json

    cells = json.loads(path.read_text())["cells"]
    return "".join(next(c for c in cells if c["cell_type"] == "code")["source"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_notebook_opens_with_the_install_cell_and_the_readme_opens_it_in_colab(path):
    url = kit.colab.repository_url()
    assert first_code_cell(path) == kit.colab.install_cell(url), "run `python3 kit.py links`"
    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(f"| `{path.stem}` |"))
    assert f"[Colab]({kit.colab.colab_url(url, path.name)})" in row
    assert kit.colab.colab_url(url, path.name) == \
        f"https://colab.research.google.com/github/{url.split('github.com/')[1]}/blob/main/notebooks/{path.name}"


def run_install_cell(monkeypatch, gpukit_found):
    """Run the install cell here (no device), with pip replaced by a recorder; what it would have run."""
    import importlib.util
    import subprocess

    calls = []
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: find_spec(name, *a) if gpukit_found or name != "gpukit" else None)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append((cmd, kw)))
    exec(kit.colab.install_cell(kit.colab.repository_url()), {})
    return calls


def test_the_install_cell_does_nothing_where_gpukit_is_importable(monkeypatch):
    assert run_install_cell(monkeypatch, gpukit_found=True) == []


def test_the_install_cell_installs_gpukit_with_the_lessons_extra_from_the_repository(monkeypatch):
    (cmd, kw), = run_install_cell(monkeypatch, gpukit_found=False)
    assert cmd[:5] == [sys.executable, "-m", "pip", "install", "-q"] and kw == {"check": True}
    req = Requirement(cmd[5])
    assert (req.name, req.extras, req.url) == ("gpukit", {"lessons"}, "git+" + kit.colab.repository_url())
    assert "lessons" in project()["optional-dependencies"]


def test_kit_links_rewrites_a_stale_cell_and_link_and_leaves_current_ones(tmp_path, monkeypatch, capsys):
    """On a copy (files only): nothing to change as the repository stands; after the URL changes, each
    notebook's first cell and README row follow it, and the other cells are kept."""
    import json
    import shutil

    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "notebooks", tmp_path / "notebooks", ignore=shutil.ignore_patterns("ranks", "*.cfg"))
    url = kit.colab.repository_url()
    monkeypatch.setattr(kit.venv, "ROOT", tmp_path)
    assert kit.colab.links([]) == 0 and capsys.readouterr().out.strip() == "nothing to change"

    other = "https://github.com/someone/fork"
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace(url, other))
    assert kit.colab.links([]) == 0
    out = capsys.readouterr().out
    assert out.count("wrote ") == len(NOTEBOOKS) + 1 and "kit.py outputs" in out
    for path in NOTEBOOKS:
        copy = tmp_path / "notebooks" / path.name
        assert first_code_cell(copy) == kit.colab.install_cell(other)
        cells, before = (json.loads(p.read_text())["cells"] for p in (copy, path))
        assert len(cells) == len(before) and cells[2:] == before[2:]
    assert kit.colab.colab_url(other, NOTEBOOKS[0].name) in (tmp_path / "README.md").read_text()


@pytest.mark.parametrize("urls", ['', '\n[project.urls]\nRepository = "git@github.com:someone/gpukit"\n'])
def test_kit_links_refuses_a_missing_or_unusable_repository_url_and_writes_nothing(tmp_path, monkeypatch, urls):
    """Files only: without an https://github.com/OWNER/NAME address there is nothing to build links from."""
    import shutil

    text = (ROOT / "pyproject.toml").read_text()
    start = text.index("[project.urls]")
    end = text.index("\n[", start + 1)
    (tmp_path / "pyproject.toml").write_text(text[:start] + urls + text[end:])
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "notebooks", tmp_path / "notebooks", ignore=shutil.ignore_patterns("*.cfg"))
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    monkeypatch.setattr(kit.venv, "ROOT", tmp_path)
    with pytest.raises(SystemExit, match=r"no \[project.urls\] Repository = \"https://github.com/OWNER/NAME\""):
        kit.colab.links([])
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
