"""`python3 kit.py gpu-check`: on a machine without a GPU it says so and what to do, and runs nothing."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: gpu-check would run for real")
def test_without_a_gpu_gpu_check_says_what_to_do_and_runs_nothing(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("kit", ROOT / "kit.py")
    kit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kit)
    ran = []
    monkeypatch.setattr(kit, "VENV_PY", Path(sys.executable))   # this environment stands in for .venv
    monkeypatch.setattr(kit, "test", lambda args: ran.append("test"))
    monkeypatch.setattr(kit, "bench", lambda args: ran.append("bench"))
    assert kit.gpu_check([]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err and ran == []
