"""kit.py: `python3 kit.py lab` starts JupyterLab on notebooks/; the set-up links a torch that python3 already
has (from its site-packages or its user site) only when .venv can use it; the test run loads only the pytest
plugins the suite names; the browser test finds a Chromium in its order or says what to run."""

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import find_chromium

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kit_lab_starts_jupyterlab_on_the_notebooks(tmp_path):
    # The lessons' extra installs it; gpu-check's environment has the kernel and nbclient alone (gpu-wheels.txt).
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed in this environment")
    port, token = free_port(), "gpukit-test"
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "kit.py"), "lab", "--no-browser", f"--port={port}",
         "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env=dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime")))
    try:
        deadline, listing = time.monotonic() + 90, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                url = f"http://127.0.0.1:{port}/api/contents/?token={token}"
                listing = json.load(urllib.request.urlopen(url, timeout=5))
                break
            except OSError:
                time.sleep(0.5)
        assert listing is not None, (tmp_path / "lab.log").read_text()[-3000:]
        names = {item["name"] for item in listing["content"]}
        assert "00_where_memory_goes.ipynb" in names
        lab = urllib.request.urlopen(f"http://127.0.0.1:{port}/lab?token={token}", timeout=10)
        assert lab.status == 200 and b"JupyterLab" in lab.read()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass  # it ended already (the assertion above says why): its group is gone, the log holds its last words
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_kit_without_a_command_prints_its_usage():
    done = subprocess.run([sys.executable, str(ROOT / "kit.py")], capture_output=True, text=True)
    assert done.returncode == 2
    assert "python3 kit.py test" in done.stderr and "python3 kit.py lab" in done.stderr


def test_kit_and_its_parts_import_only_the_standard_library_and_each_other():
    """A fresh machine has only Python: kit.py and kitlib/ run there before anything is installed. Run from another
    folder by a python3 outside any venv, kit.py finds kitlib/ beside itself."""
    import ast

    files = [ROOT / "kit.py", *sorted((ROOT / "kitlib").glob("*.py"))]
    assert {f.name for f in files} >= {"kit.py", "venv.py", "wheels.py", "colab.py", "gpucheck.py"}
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top in ("__future__", "kitlib"), f"{f.name} imports {name}"
    python = getattr(sys, "_base_executable", sys.executable)
    done = subprocess.run([python, "-I", str(ROOT / "kit.py")], capture_output=True, text=True, cwd="/")
    assert done.returncode == 2 and "python3 kit.py gpu-check" in done.stderr, done.stderr


# -- set-up on a machine whose python3 already has a torch ---------------------------------------------------


def load_kit():
    spec = importlib.util.spec_from_file_location("kit", ROOT / "kit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kit = load_kit()
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)  # a python3 outside any venv


@pytest.fixture
def user_site_torch(tmp_path, monkeypatch):
    """A stand-in torch (a module with a version, no tensors) installed only in the base python's user site,
    as `pip install --user torch` leaves it. Returns a function that writes it with a version and a body."""
    monkeypatch.setenv("PYTHONUSERBASE", str(tmp_path / "userbase"))
    monkeypatch.delenv("PYTHONNOUSERSITE", raising=False)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    user_site = subprocess.run([BASE_PYTHON, "-c", "import site; print(site.getusersitepackages())"],
                               capture_output=True, text=True, check=True).stdout.strip()

    def install(version: str, body: str = "") -> Path:
        package = Path(user_site) / "torch"
        package.mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text(f"__version__ = {version!r}\n{body}")
        return Path(user_site)
    return install


@pytest.fixture
def venv(tmp_path):
    """An empty venv (no pip: the linking needs none): its python and its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", tmp_path / "venv"], check=True)
    python = tmp_path / "venv" / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    return python, Path(purelib)


def imported_torch(python: Path) -> list[str]:
    done = subprocess.run([python, "-c", "import torch; print(torch.__version__); print(torch.__file__)"],
                          capture_output=True, text=True)
    return done.stdout.split() if done.returncode == 0 else []


def test_a_torch_in_the_user_site_only_is_linked_and_kept(user_site_torch, venv):
    user_site = user_site_torch("2.11.0+cu130")
    python, site_dir = venv
    assert imported_torch(python) == []
    assert kit.venv.link_torch(python, site_dir, python=BASE_PYTHON) == "2.11.0+cu130"
    version, where = imported_torch(python)
    assert version == "2.11.0+cu130" and Path(where).is_relative_to(user_site)
    lock = kit.venv.constraints("2.11.0+cu130")
    assert "torch==2.11.0+cu130" in lock.split()
    assert not [line for line in lock.splitlines() if line.startswith("torch==") and "2.11.0+cu130" not in line]


def test_a_torch_outside_the_range_is_not_linked_and_the_pin_stays(user_site_torch, venv, capsys):
    user_site_torch("2.3.1")
    python, site_dir = venv
    assert kit.venv.link_torch(python, site_dir, python=BASE_PYTHON) is None
    assert "outside gpukit's range" in capsys.readouterr().out
    assert imported_torch(python) == [] and not (site_dir / kit.venv.LINK_PTH).exists()
    assert kit.venv.constraints(None) == kit.venv.LOCK.read_text().rstrip("\n") + "\n"
    assert re.search(r"^torch==\d", kit.venv.constraints(None), re.M)


def test_a_torch_the_venv_cannot_import_is_not_linked_and_the_pin_stays(user_site_torch, venv, capsys):
    # importable by python3 itself, not from a venv (a library found only through python3's own environment)
    user_site_torch("2.11.0", "import sys\nif sys.prefix != sys.base_prefix:\n"
                              "    raise ImportError('libcudart.so.13: cannot open shared object file')\n")
    python, site_dir = venv
    assert kit.venv.link_torch(python, site_dir, python=BASE_PYTHON) is None
    assert "libcudart.so.13" in capsys.readouterr().out
    assert not (site_dir / kit.venv.LINK_PTH).exists()


def test_no_torch_links_nothing(tmp_path, venv, monkeypatch):
    monkeypatch.setenv("PYTHONUSERBASE", str(tmp_path / "empty"))
    python, site_dir = venv
    if kit.venv.outer_torch(BASE_PYTHON) is not None:
        pytest.skip("the base python3 of this environment has a torch of its own")
    assert kit.venv.link_torch(python, site_dir, python=BASE_PYTHON) is None


@pytest.mark.parametrize("version, spec, ok", [
    ("2.11.0+cu130", ">=2.11,<2.16", True), ("2.15.0", ">=2.11,<2.16", True), ("2.16.0", ">=2.11,<2.16", False),
    ("2.10.1", ">=2.11,<2.16", False), ("2.13.0a0+git1234", ">=2.11,<2.16", True), ("2.11.0", "==2.11", True),
    ("2.11.0", "!=2.11.0", False)])
def test_the_range_check(version, spec, ok):
    assert kit.venv.in_range(version, spec) is ok


def test_the_torch_range_is_read_from_pyproject():
    spec = kit.venv.torch_range()
    assert spec.startswith(">=") and kit.venv.in_range(torch.__version__, spec)


def test_the_test_run_loads_only_the_plugins_the_suite_names(tmp_path):
    """A linked environment's pytest plugins (found through entry points) must not load into the run."""
    plugins = tmp_path / "site"
    (plugins / "clash_plugin-1.0.dist-info").mkdir(parents=True)
    (plugins / "clash_plugin-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: clash-plugin\nVersion: 1.0\n")
    (plugins / "clash_plugin-1.0.dist-info" / "entry_points.txt").write_text("[pytest11]\nclash = clash_plugin\n")
    (plugins / "clash_plugin.py").write_text("raise ImportError('clash-plugin needs pytest<8')\n")
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    cmd = [sys.executable, "-m", "pytest", "-c", ROOT / "pyproject.toml", "--rootdir", ROOT, "-q",
           tmp_path / "test_one.py"]
    base = dict(os.environ, PYTHONPATH=str(plugins))
    base.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    # pytest would autoload it: its entry point is there for any python run with this path
    seen = subprocess.run([sys.executable, "-c", "from importlib.metadata import entry_points; "
                           "print([e.value for e in entry_points(group='pytest11')])"],
                          env=base, capture_output=True, text=True, check=True)
    assert "clash_plugin" in seen.stdout
    # kit.py's test environment leaves it out, and nbval is loaded by name (addopts carry --nbval-lax,
    # which pytest would refuse otherwise)
    done = subprocess.run(cmd, cwd=ROOT, env=kit.venv.test_environment(base), capture_output=True, text=True)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr


def test_the_test_run_has_one_torch_thread_per_worker_unless_asked_otherwise():
    assert kit.venv.test_environment({})["OMP_NUM_THREADS"] == "1"
    assert kit.venv.test_environment({"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"


def test_the_test_run_writes_bytecode_so_that_each_process_does_not_compile_torch_again():
    """Device: none. Set-up installs without compiling; the run's first import writes each .pyc for the rest."""
    assert "PYTHONDONTWRITEBYTECODE" not in kit.venv.test_environment({"PYTHONDONTWRITEBYTECODE": "1"})


def test_the_whole_suite_runs_on_two_workers_and_a_chosen_test_in_one_process(monkeypatch):
    monkeypatch.setattr(kit.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert kit.test_workers([]) == ["-p", "xdist", "-n", "2", "--dist", "load", "--maxschedchunk", "1",
                                    "--durations", "25"]  # at most two; the slowest named
    assert kit.test_workers(["-k", "magic"]) == ["-p", "xdist"]  # loaded, so that -n may be given by hand
    monkeypatch.setattr(kit.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert kit.test_workers([]) == ["-p", "xdist"]


# -- a browser for the browser test --------------------------------------------------------------------------


def fake_program(path: Path, output: str, status: int = 0) -> str:
    path.write_text(f"#!/bin/sh\necho '{output}'\nexit {status}\n")
    path.chmod(0o755)
    return str(path)


def refuse(name):
    def step():
        raise AssertionError(f"{name} was tried after a browser was found")
    return step


def test_an_installed_chromium_comes_first(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUKIT_CHROMIUM", raising=False)
    chrome = fake_program(tmp_path / "google-chrome", "Google Chrome 141.0.7390.54")
    which = {"google-chrome": chrome}.get
    assert find_chromium.find_chromium(which, apt=refuse("apt"), playwright=refuse("playwright")) == chrome


def test_ubuntus_snap_pointer_is_passed_over_for_debians_package(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUKIT_CHROMIUM", raising=False)
    snap = fake_program(tmp_path / "chromium-browser",
                        "Command '/usr/bin/chromium-browser' requires the chromium snap to be installed.", 1)
    debian = fake_program(tmp_path / "chromium", "Chromium 141.0.7390.54 built on Debian GNU/Linux 12")
    which = {"chromium-browser": snap}.get
    assert find_chromium.find_chromium(which, apt=lambda: (debian, ""), playwright=refuse("playwright")) == debian


def test_playwrights_chromium_when_apt_has_none(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUKIT_CHROMIUM", raising=False)
    own = fake_program(tmp_path / "chrome", "Chromium 141.0.7390.37")
    found = find_chromium.find_chromium(lambda name: None, apt=lambda: (None, "no apt-get"),
                                        playwright=lambda: (own, ""))
    assert found == own


def test_no_browser_at_all_is_one_line_that_says_what_to_run(monkeypatch):
    monkeypatch.delenv("GPUKIT_CHROMIUM", raising=False)
    with pytest.raises(find_chromium.NoChromium) as missing:
        find_chromium.find_chromium(
            lambda name: None, apt=lambda: (None, "`install -y chromium`: E: Package 'chromium' has no "
                                                  "installation candidate"),
            playwright=lambda: (None, "`playwright install chromium`: Error: getaddrinfo EAI_AGAIN"))
    message = str(missing.value)
    assert "\n" not in message
    assert "apt-get install -y chromium" in message and "playwright install chromium" in message
    assert "no installation candidate" in message and "EAI_AGAIN" in message


def test_apt_is_not_tried_without_apt_get_or_root(monkeypatch):
    assert find_chromium.apt_chromium(lambda name: None) == (None, "no apt-get")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert find_chromium.apt_chromium(lambda name: "/usr/bin/apt-get") == (None, "apt-get needs root")


def test_gpukit_chromium_names_a_browser_outside_path(tmp_path, monkeypatch):
    chrome = fake_program(tmp_path / "chrome", "Chromium 141.0.7390.54")
    monkeypatch.setenv("GPUKIT_CHROMIUM", chrome)
    assert find_chromium.installed(lambda name: None) == chrome
