"""`python3 kit.py gpu-check`: without a GPU it says what to do; with one, its report says what differed."""

import importlib.util
import json
import sys
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
    monkeypatch.setattr(kit, "VENV_PY", Path(sys.executable))   # this environment stands in for .venv
    monkeypatch.setattr(kit, "test", lambda args: ran.append("test"))
    monkeypatch.setattr(kit, "bench", lambda args: ran.append("bench"))
    assert kit.gpu_check([]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err and ran == []


def test_the_report_lists_what_differed_from_the_cpu_expectations(tmp_path, monkeypatch):
    # A GPU machine stood in: the probe's answer, a test record with a failure and a skip, an exactness row off.
    kit = load_kit()
    info = {"cuda": True, "torch": "2.11.0+cu130", "cuda_version": "13.0", "name": "NVIDIA H100 80GB HBM3",
            "capability": [9, 0], "devices": 1, "workspace": 32 * 2**20, "first_warm_up": 65 * 2**20,
            "second_warm_up": 0}
    monkeypatch.setattr(kit, "ROOT", tmp_path)
    monkeypatch.setattr(kit, "VENV_PY", Path(sys.executable))
    monkeypatch.setattr(kit, "GPU_PROBE", f"print({json.dumps(json.dumps(info))})")

    def fake_test(args):
        junit = next(a for a in args if a.startswith("--junitxml=")).split("=", 1)[1]
        Path(junit).write_text(
            '<testsuites><testsuite><testcase classname="a" name="ok"/>'
            '<testcase classname="notebooks/04.ipynb" name="Cell 6"><failure message="AssertionError: linear"/>'
            '</testcase><testcase classname="b" name="gpu"><skipped message="needs two GPUs"/></testcase>'
            '</testsuite></testsuites>')
        return 1

    def fake_bench(args):
        (tmp_path / "bench" / "out" / "exactness.csv").write_text(
            "setup,device,meter_bytes,reference,reference_bytes,within_0.1%\n"
            "mlp + sgd,cuda:0,1000,CUDA allocator trace,1000,True\n"
            "convnet + adam,cuda:0,2000,CUDA allocator trace,1000,False\n")
        return 0

    monkeypatch.setattr(kit, "test", fake_test)
    monkeypatch.setattr(kit, "bench", fake_bench)
    assert kit.gpu_check([]) == 1
    report = (tmp_path / "data" / "runs" / "nvidia-h100-80gb-hbm3-gpu-check.txt").read_text()
    assert "NVIDIA H100 80GB HBM3 (sm_90, 1 GPU(s)), torch 2.11.0+cu130" in report
    assert "1 passed, 1 failed, 1 skipped" in report
    assert "failure: notebooks/04.ipynb::Cell 6: AssertionError: linear" in report
    assert "skipped: b::gpu: needs two GPUs" in report
    assert "2.03 x the 33,554,432 B cuBLAS workspace (as expected)" in report
    assert "exactness off: convnet + adam on cuda:0: 2000 B against 1000 B" in report
    assert "mlp + sgd" not in report
