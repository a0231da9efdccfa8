"""`python3 kit.py gpu-check`: without a GPU it says what to do; with one, its report says what differed, each stage
stops at its deadline, every notebook is stored per card, and everything written comes back as one archive.
`python3 kit.py gpu-wheels` and the offline set-up: the wheels a lent GPU machine without a package index lacks, and
an install from them alone. A GPU machine is stood in by the probe's answer and by stand-in stages; nothing here needs
a GPU or the network."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def load_kit():
    spec = importlib.util.spec_from_file_location("kit", ROOT / "kit.py")
    kit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kit)
    return kit


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: gpu-check would run for real")
def test_without_a_gpu_gpu_check_says_what_to_do_and_runs_nothing(monkeypatch, capsys):
    kit = load_kit()
    ran = []
    monkeypatch.setattr(kit.venv, "VENV_PY", Path(sys.executable))   # this environment stands in for .venv
    monkeypatch.setattr(kit.gpucheck, "run_until", lambda cmd, *a, **k: ran.append(cmd))
    monkeypatch.setattr(kit.gpucheck, "run_notebooks", lambda *a, **k: ran.append("notebooks"))
    assert kit.gpucheck.gpu_check([]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err and ran == []


H100 = {"cuda": True, "torch": "2.11.0+cu130", "cuda_version": "13.0", "name": "NVIDIA H100 80GB HBM3",
        "capability": [9, 0], "devices": 1, "workspace": 32 * 2**20, "first_warm_up": 65 * 2**20, "second_warm_up": 0,
        "checkpointed_linear_left": 2**20}


def on_a_stand_in_gpu(kit, tmp_path, monkeypatch):
    """kit with the repository at ``tmp_path`` and a probe that answers as an H100 would."""
    monkeypatch.setattr(kit.venv, "ROOT", tmp_path)
    monkeypatch.setattr(kit.venv, "VENV_PY", Path(sys.executable))
    monkeypatch.setattr(kit.gpucheck, "GPU_PROBE", f"print({json.dumps(json.dumps(H100))})")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_cuda_thing.py").write_text("if torch.cuda.is_available(): pass\n")
    (tmp_path / "tests" / "test_cpu_thing.py").write_text("\n")


def test_the_report_lists_what_differed_from_the_cpu_expectations(tmp_path, monkeypatch):
    # The stages stood in: a test record with a failure and a skip, an exactness row off, a recorded matrix with its
    # predictions.
    kit = load_kit()
    on_a_stand_in_gpu(kit, tmp_path, monkeypatch)
    ran = []

    def fake_run_until(cmd, deadline, log, env=None, grace=15.0):
        cmd = [str(c) for c in cmd]
        ran.append(cmd)
        if cmd[1].endswith("run.py"):
            (tmp_path / "bench" / "out" / "exactness.csv").write_text(
                "setup,device,meter_bytes,reference,reference_bytes,within_0.1%\n"
                "mlp + sgd,cuda:0,1000,CUDA allocator trace,1000,True\n"
                "convnet + adam,cuda:0,2000,CUDA allocator trace,1000,False\n")
            (tmp_path / "data" / "runs").mkdir(parents=True, exist_ok=True)
            (tmp_path / "data" / "runs" / "nvidia-h100-80gb-hbm3.csv").write_text("model,technique,peak_bytes\n")
            return 0
        junit = next(a for a in cmd if a.startswith("--junitxml=")).split("=", 1)[1]
        if "tests/test_cuda_thing.py" in cmd:
            Path(junit).write_text(
                '<testsuites><testsuite><testcase classname="a" name="ok"/>'
                '<testcase classname="tests/test_cuda_thing.py" name="test_peak"><failure message="AssertionError: '
                'linear"/></testcase><testcase classname="b" name="gpu"><skipped message="needs two GPUs"/>'
                '</testcase></testsuite></testsuites>')
            return 1
        Path(junit).write_text('<testsuites><testsuite><testcase classname="c" name="ok"/></testsuite></testsuites>')
        return 0

    # The replay of the recorded runs (bench recorded_runs): one row of this card's run off, one of an older run,
    # whose file (first by name) was written before the check: the report is about the run the check recorded.
    older = tmp_path / "data" / "runs" / "a-older.csv"
    older.parent.mkdir(parents=True)
    older.write_text("model,technique,peak_bytes\n")
    os.utime(older, (time.time() - 3600, time.time() - 3600))
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "run.py").write_text(
        "import sys\nassert sys.argv[1:] == ['recorded_runs', '--record']\n"
        "open('bench/out/recorded_runs.csv', 'w').write("
        "'run,model,technique,peak_error_pct,state_error_pct,reserved_error_pct,status,trace_same_order,'\n"
        "'trace_difference,trace_replay_reserved_bytes\\n'\n"
        "'nvidia-h100-80gb-hbm3.csv,deep mlp,baseline,-0.1,0.0,0.2,ok\\n'\n"
        "'nvidia-h100-80gb-hbm3.csv,deep mlp,checkpointing,-5.4,0.2,-0.1,ok,\"1500/1510 GPU, 1500/1505 predicted\",'\n"
        "'\"#12: GPU [512] (1), predicted [] (0)\",2097152\\n'\n"
        "'nvidia-h100-80gb-hbm3.csv,deep mlp,AMP bf16,0.0,0.0,-1.5,ok\\n'\n"
        "'nvidia-h100-80gb-hbm3.csv,tiny gpt,AMP fp16,,,,not predicted: RuntimeError: no\\n'\n"
        "'a-older.csv,deep mlp,AMP fp16,-3.0,0.0,,ok\\n')\n")
    monkeypatch.setattr(kit.gpucheck, "run_until", fake_run_until)
    assert kit.gpucheck.gpu_check(["--skip", "notebooks", "--budget", "600"]) == 1
    report = (tmp_path / "data" / "runs" / "nvidia-h100-80gb-hbm3-gpu-check.txt").read_text()
    assert "NVIDIA H100 80GB HBM3 (sm_90, 1 GPU(s)), torch 2.11.0+cu130" in report
    assert "tests (CUDA): 1 passed, 1 failed, 1 skipped (pytest exit 1" in report
    assert "tests (other): 1 passed, 0 failed, 0 skipped (pytest exit 0" in report
    assert "failure: tests/test_cuda_thing.py::test_peak: AssertionError: linear" in report
    assert "skipped: b::gpu: needs two GPUs" in report
    assert "2.03 x the 33,554,432 B cuBLAS workspace (as expected)" in report
    assert ("a checkpointed Linear(1024, 1024) with a bias left 1,048,576 B allocated (NOT 0: a workspace the "
            "warm-up did not make)") in report
    assert "exactness off: convnet + adam on cuda:0: 2000 B against 1000 B" in report
    assert "mlp + sgd" not in report
    assert "predictions: 1 of 4 rows of nvidia-h100-80gb-hbm3.csv predicted within 0.5% of the measured peak, " \
        "state and reserved memory (bench/out/recorded_runs.csv); 2 on peak and state alone" in report
    assert "prediction off: deep mlp, checkpointing: peak -5.40%, state +0.20%, reserved -0.10%" in report
    # with the row's allocator trace: where the GPU's allocations and the prediction's first part
    assert "    its trace: 1500/1510 GPU, 1500/1505 predicted allocations in the same order; first apart #12: GPU " \
        "[512] (1), predicted [] (0); the GPU's events replayed reserve 2,097,152 B" in report
    assert "prediction off: deep mlp, AMP bf16: peak +0.00%, state +0.00%, reserved -1.50%" in report
    assert "prediction off: tiny gpt, AMP fp16: not predicted: RuntimeError: no" in report
    assert "a-older.csv" not in report and "deep mlp, AMP fp16" not in report
    # The CUDA tests first, then the others without them, each with xdist.
    cuda, other = (c for c in ran if "pytest" in c)
    assert cuda[-1] == "tests/test_cuda_thing.py" and "--ignore=tests/test_cuda_thing.py" in other
    assert ["-p", "xdist"] == cuda[3:5] and "not notebook" in cuda


def test_a_stage_past_its_deadline_is_cut_and_reported(tmp_path, monkeypatch):
    # A benchmark that would run for a minute, in a check of 3 s: it is stopped at its deadline, the report says so,
    # and the check goes on to its report instead of hanging.
    kit = load_kit()
    on_a_stand_in_gpu(kit, tmp_path, monkeypatch)
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "run.py").write_text("import time\ntime.sleep(60)\n")
    began = time.monotonic()
    assert kit.gpucheck.gpu_check(["--skip", "notebooks", "--skip", "tests", "--budget",
                          f"{time.monotonic() - kit.gpucheck.STARTED + 3:.1f}"]) == 1
    assert time.monotonic() - began < 30           # the benchmark would take 60 s
    report = (tmp_path / "data" / "runs" / "nvidia-h100-80gb-hbm3-gpu-check.txt").read_text()
    # (how long the stop took depends on the machine's load: the cut and its reason are what is checked)
    assert re.search(r"benchmarks: CUT after \d+ s, their deadline", report), report


def test_run_until_stops_the_whole_process_group_at_the_deadline(tmp_path):
    kit = load_kit()
    child = tmp_path / "child.pid"
    script = (f"import subprocess, sys, time\n"
              f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              f"open({str(child)!r}, 'w').write(str(p.pid))\ntime.sleep(60)\n")
    began = time.monotonic()
    run_until = kit.gpucheck.run_until
    assert run_until([sys.executable, "-c", script], time.monotonic() + 1.5, tmp_path / "log", grace=1) is None
    assert time.monotonic() - began < 30           # the child would take 60 s
    pid = int(child.read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert run_until([sys.executable, "-c", "raise SystemExit(3)"], time.monotonic() + 30, tmp_path / "log") == 3


FAKE_RUNNER = """
import json, sys, time
from pathlib import Path
args = sys.argv[1:]
nb, to, seconds, card = Path(args[0]), Path(args[args.index("--to") + 1]), float(args[args.index("--seconds") + 1]), \
    args[args.index("--card") + 1]
to.mkdir(parents=True, exist_ok=True)
with open(to.parent / "order.txt", "a") as f:
    f.write(f"start {nb.stem} {time.monotonic()}\\n")
(to / nb.name).write_text(json.dumps({"card": card, "outputs": "executed"}))
if "hangs" in nb.stem:
    time.sleep(180)
time.sleep(0.3)
failed = [[4, "AssertionError: only on the card"]] if "fails" in nb.stem else []
with open(to.parent / "order.txt", "a") as f:
    f.write(f"end {nb.stem} {time.monotonic()}\\n")
print(json.dumps({"notebook": nb.stem, "cells": 5, "ran": 5, "failed": failed, "cut": None, "seconds": 0.3}))
"""


def notebook(path: Path, code: str) -> Path:
    path.write_text(json.dumps({"cells": [{"cell_type": "code", "source": [code], "metadata": {}, "outputs": []}],
                                "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def test_every_notebook_is_stored_per_card_and_the_timed_ones_and_the_card_fillers_run_alone(tmp_path, monkeypatch):
    # The notebook runner stood in (tests/notebooks_on_card.py runs a real kernel): each notebook is stored in
    # data/runs/<card>/, the failed cells are listed, a notebook that reads the clock or runs out of the card's
    # memory on purpose runs after the others, alone, and one that hangs past the deadline is killed and reported,
    # never waited for.
    kit = load_kit()
    on_a_stand_in_gpu(kit, tmp_path, monkeypatch)
    (tmp_path / "tests" / "notebooks_on_card.py").write_text(FAKE_RUNNER)
    books = tmp_path / "notebooks"
    books.mkdir()
    notebook(books / "00_quick.ipynb", "x = 1")
    notebook(books / "01_fails.ipynb", "assert x")
    notebook(books / "02_timed.ipynb", "t0 = time.perf_counter()")
    notebook(books / "03_hangs.ipynb", "while True: pass")
    notebook(books / "04_fills.ipynb", "try:\n    step()\nexcept torch.OutOfMemoryError:\n    pass")
    monkeypatch.setattr(kit.venv, "test_environment", lambda: dict(os.environ))
    monkeypatch.setattr(kit.gpucheck, "NOTEBOOK_GRACE_S", 0.5)
    monkeypatch.setattr(kit.gpucheck, "NOTEBOOK_MIN_S", 0.5)
    began = time.monotonic()
    # 20 s: room for four runners' Pythons to start on a loaded machine (6 s was too little at a load of 2)
    assert kit.gpucheck.gpu_check(["--skip", "bench", "--skip", "tests", "--workers", "3", "--budget",
                          f"{time.monotonic() - kit.gpucheck.STARTED + 20:.1f}"]) == 1
    assert time.monotonic() - began < 60           # the hanging notebook would take 180 s
    stored = tmp_path / "data" / "runs" / "nvidia-h100-80gb-hbm3"
    assert sorted(p.name for p in stored.glob("*.ipynb")) == ["00_quick.ipynb", "01_fails.ipynb", "02_timed.ipynb",
                                                              "03_hangs.ipynb", "04_fills.ipynb"]
    assert json.loads((stored / "00_quick.ipynb").read_text())["card"] == "NVIDIA H100 80GB HBM3"
    events = [line.split() for line in (stored.parent / "order.txt").read_text().splitlines()]
    alone = {"02_timed", "04_fills"}
    starts = {nb: float(t) for what, nb, t in events if what == "start"}
    ends = {nb: float(t) for what, nb, t in events if what == "end"}
    beside = [(one, nb) for one in alone for nb in starts if nb != one   # a killed one has no end: it ended first
              and not (ends.get(nb, starts[one]) <= starts[one] or starts[nb] >= ends[one])]
    assert beside == [] and starts["02_timed"] > starts["03_hangs"]
    report = (tmp_path / "data" / "runs" / "nvidia-h100-80gb-hbm3-gpu-check.txt").read_text()
    assert "notebooks: 3 of 5 ran to the end with no failing cell" in report
    assert "(04_fills alone: they fill the card; 02_timed alone: they time steps)" in report
    assert "failure: 01_fails: cell 4: AssertionError: only on the card" in report
    assert "cut: 03_hangs: killed past the deadline" in report
    assert [r["notebook"] for r in json.loads((stored / "notebooks.json").read_text())] == \
        ["00_quick", "01_fails", "03_hangs", "02_timed", "04_fills"]


def test_a_notebook_that_cannot_start_in_time_is_reported_not_run(tmp_path, monkeypatch):
    kit = load_kit()
    monkeypatch.setattr(kit.venv, "ROOT", tmp_path)
    nb = notebook(tmp_path / "05_late.ipynb", "x = 1")
    check = kit.gpucheck
    results = check.run_notebooks([nb], 1, time.monotonic() + check.NOTEBOOK_MIN_S - 1, tmp_path / "card", tmp_path,
                                 "card", "2.11")
    assert results == [{"notebook": "05_late", "cut": "not started: no time left", "failed": [], "ran": 0}]


def test_the_archive_holds_what_was_written_and_stays_under_its_limit(tmp_path, monkeypatch):
    kit = load_kit()
    monkeypatch.setattr(kit.venv, "ROOT", tmp_path)
    runs = tmp_path / "data" / "runs" / "card"
    runs.mkdir(parents=True)
    small = runs / "00_small.ipynb"
    small.write_text('{"cells": []}')
    big = runs / "01_big.ipynb"
    big.write_bytes(os.urandom(300_000))            # incompressible
    report = tmp_path / "data" / "runs" / "card-gpu-check.txt"
    report.write_text("report")
    files = kit.gpucheck.written_since(time.time() - 60, [tmp_path / "data" / "runs"])
    assert sorted(files) == sorted([report, small, big])

    lines = kit.gpucheck.pack(tmp_path / "out" / "gpu-check.tar.gz", files)
    with tarfile.open(tmp_path / "out" / "gpu-check.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["data/runs/card-gpu-check.txt", "data/runs/card/00_small.ipynb",
                                          "data/runs/card/01_big.ipynb"]
    assert lines[0].startswith("packed: 3 files into") and len(lines) == 1

    lines = kit.gpucheck.pack(tmp_path / "out" / "gpu-check.tar.gz", files, limit=100_000)
    assert (tmp_path / "out" / "gpu-check.tar.gz").stat().st_size <= 100_000
    with tarfile.open(tmp_path / "out" / "gpu-check.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["data/runs/card-gpu-check.txt", "data/runs/card/00_small.ipynb"]
    assert "left out of the archive, over its 0 MiB: data/runs/card/01_big.ipynb (0.3 MiB)" in lines[1]


# -- the wheels a lent machine without a package index lacks -------------------------------------------------------


def test_each_carried_wheel_is_pinned_in_one_place():
    kit = load_kit()
    lock = {kit.wheels.canonical(line.split("==")[0].strip())
            for line in (ROOT / "constraints.txt").read_text().splitlines()
            if "==" in line and not line.lstrip().startswith("#")}
    for line in (ROOT / "gpu-wheels.txt").read_text().splitlines():
        req = line.split("#", 1)[0].strip()
        if req:
            name, _, version = req.partition("==")
            assert (kit.wheels.canonical(name) in lock) != bool(version), \
                f"gpu-wheels.txt: {name}: pin it either here or in constraints.txt, not both or neither"
    wanted = kit.wheels.wheel_requirements("3.12")
    assert "ipython==9.18.1" in wanted and "ipykernel==7.4.0" in wanted and "nbval==0.11.0" in wanted
    assert "ipython==8.39.0" in kit.wheels.wheel_requirements("3.10")


def fake_wheel(folder: Path, name: str, files: dict[str, bytes], version: str = "1.0") -> Path:
    """A wheel of ``files`` (plus its dist-info), as pip builds them."""
    dist = f"{name}-{version}.dist-info"
    files = dict(files, **{f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
                           f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\n"
                                            b"Tag: py3-none-any\n"})
    record = "".join(f"{path},,\n" for path in files) + f"{dist}/RECORD,,\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
        z.writestr(f"{dist}/RECORD", record)
    return wheel


def test_bitsandbytes_keeps_only_the_libraries_of_the_cuda_named(tmp_path):
    kit = load_kit()
    wheel = fake_wheel(tmp_path, "bitsandbytes", {
        "bitsandbytes/__init__.py": b"", "bitsandbytes/libbitsandbytes_cpu.so": b"c" * 1000,
        "bitsandbytes/libbitsandbytes_cuda118.so": os.urandom(50_000),
        "bitsandbytes/libbitsandbytes_cuda130.so": b"1" * 1000,
        "bitsandbytes/libbitsandbytes_rocm72.so": os.urandom(50_000)})
    before, after = kit.wheels.slim_bitsandbytes(wheel, ["130"])
    assert after < before - 90_000
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        record = z.read("bitsandbytes-1.0.dist-info/RECORD").decode()
    kept = ["bitsandbytes/__init__.py", "bitsandbytes/libbitsandbytes_cpu.so",
            "bitsandbytes/libbitsandbytes_cuda130.so"]
    assert [n for n in names if n.startswith("bitsandbytes/")] == kept
    assert [line.split(",")[0] for line in record.splitlines() if line.startswith("bitsandbytes/")] == kept


def test_the_offline_install_takes_only_the_carried_wheels(tmp_path):
    # pip as set-up runs it offline: --no-index, the carried folder, and none of this machine's pip configuration
    # (here a find-links folder with a newer release, and an index), which would otherwise win.
    kit = load_kit()
    wheels, elsewhere = tmp_path / "wheels", tmp_path / "elsewhere"
    wheels.mkdir()
    elsewhere.mkdir()
    fake_wheel(wheels, "gpukit_carried", {"gpukit_carried/__init__.py": b"WHERE = 'carried'\n"})
    fake_wheel(elsewhere, "gpukit_carried", {"gpukit_carried/__init__.py": b"WHERE = 'elsewhere'\n"}, "2.0")
    env = kit.wheels.offline_pip_environment(dict(os.environ, PIP_FIND_LINKS=str(elsewhere),
                                           PIP_INDEX_URL="http://127.0.0.1:9/simple"))
    assert env["PIP_CONFIG_FILE"] == os.devnull
    assert not any(k.startswith("PIP_") and k != "PIP_CONFIG_FILE" for k in env)
    assert kit.wheels.carried(wheels) == ["gpukit-carried"]
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-index",
                           "--find-links", str(wheels), "--target", str(target), *kit.wheels.carried(wheels)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (target / "gpukit_carried" / "__init__.py").read_text() == "WHERE = 'carried'\n"


def test_set_up_without_an_index_links_the_machines_torch_and_installs_from_the_wheels(tmp_path, monkeypatch):
    # The steps, with the venv and pip stood in: a venv linked to the outer torch, then one pip run, offline, of
    # gpukit and every carried distribution; a second run with nothing changed does nothing.
    kit = load_kit()
    venv = tmp_path / ".venv"
    monkeypatch.setattr(kit.venv, "VENV", venv)
    monkeypatch.setattr(kit.venv, "VENV_PY", Path(sys.executable))
    monkeypatch.setattr(kit.venv, "STAMP", tmp_path / "stamp")
    monkeypatch.setattr(kit.venv, "link_torch", lambda venv_python, site: "2.11.0+cu130")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fake_wheel(wheels, "nbval", {})
    fake_wheel(wheels, "ipykernel", {})
    ran = []
    monkeypatch.setattr(kit.venv, "run", lambda cmd, **kw: ran.append(([str(c) for c in cmd], kw.get("env"))))
    assert kit.wheels.setup_offline(wheels)
    (cmd, env), = ran
    assert cmd[1:4] == ["-m", "pip", "install"] and "--no-index" in cmd
    assert cmd[cmd.index("--find-links") + 1] == str(wheels)
    assert cmd[-4:] == ["-e", str(kit.venv.ROOT), "ipykernel", "nbval"]
    assert env["PIP_CONFIG_FILE"] == os.devnull
    assert kit.wheels.setup_offline(wheels) and len(ran) == 1
    monkeypatch.setattr(kit.venv, "link_torch", lambda venv_python, site: None)
    assert not kit.wheels.setup_offline(wheels) and len(ran) == 1
    # Wheels made for another Python: pip fails, and set-up says what to do instead of a traceback.
    monkeypatch.setattr(kit.venv, "link_torch", lambda venv_python, site: "2.13.0")

    def pip_fails(cmd, **kw):
        raise subprocess.CalledProcessError(1, cmd)

    monkeypatch.setattr(kit.venv, "run", pip_fails)
    with pytest.raises(SystemExit, match="they are made for one Python"):
        kit.wheels.setup_offline(wheels)
