"""Notebook 08's fragmentation runs (gpukit.lessons.fragmentation): each in an allocator that starts empty."""

import base64
import json
import pickle
import subprocess

import pytest
import torch

from gpukit.allocator import cpu_device
from gpukit.lessons import fragmentation
from gpukit.lessons.fragmentation import in_fresh_allocator

RUNS = [("", False), ("", True), ("max_split_size_mb:40", False), ("expandable_segments:True", False)]


def test_each_fix_fits_where_the_defaults_run_out_of_memory_on_the_cpu():
    """Device: cpu (the simulated allocator). The rows an H200 gave, one new process per run (torch 2.11):
    defaults out of memory with 60 MiB reserved, each fix fits with 100 MiB reserved at the end."""
    rows = [in_fresh_allocator(s, "cpu", empty_cache_after_del=e) for s, e in RUNS]
    got = [(r["60 MiB again"], r["in use (MiB)"], r["reserved before (MiB)"], r["reserved at the end (MiB)"])
           for r in rows]
    assert got == [("out of memory", 16, 60.0, 60.0)] + [("fits", 16, 60.0, 100.0)] * 3
    assert "is reserved by PyTorch but unallocated" in rows[0]["message"]
    assert [r["settings"] for r in rows] == ["(defaults)", "(defaults)", "max_split_size_mb:40",
                                             "expandable_segments:True"]
    assert cpu_device().allocator.config.text == ""  # the simulated GPU is left with the default settings


def test_a_tensor_made_outside_any_block_before_a_run_is_not_counted_in_it():
    """Device: cpu (the simulated allocator). A tensor the process made outside any measured block (an earlier
    test's, in a pytest-xdist worker: seen on an H200 with torch 2.11) is placed on the fresh allocator before the
    run reads its first figure, not inside the run's budget, where it took a small segment (2 MiB) of its own."""
    def figures(row):
        return row["60 MiB again"], row["reserved before (MiB)"], row["reserved at the end (MiB)"]

    alone = figures(in_fresh_allocator("", "cpu"))
    held = torch.empty(1024)  # 4 KiB, made here: no block has found it yet
    assert figures(in_fresh_allocator("", "cpu")) == alone
    del held


def test_a_lessons_simulated_card_sizes_the_runs_and_follows_its_tensors_again_after_them():
    """Device: cpu (a simulated T4, as notebook 08 makes it). Each run's allocator is the card's size and says it is
    a simulated T4 in its message; after the runs the card is the CPU's simulated device again, and counts a new
    tensor."""
    import gpukit

    cuda = gpukit.SimulatedCuda("t4")
    try:
        kept = torch.empty(2**20)  # 4 MiB on the card before the runs
        row = in_fresh_allocator("", "cpu")
        assert row["60 MiB again"] == "out of memory"
        assert row["message"].startswith("[a simulated NVIDIA T4") and "total capacity of 14.58 GiB" in row["message"]
        assert cpu_device() is cuda._device and cuda.memory_allocated() == 4 * 2**20
        more = torch.empty(2**20)
        assert cuda.memory_allocated() == 8 * 2**20
        del kept, more
        assert cuda.memory_allocated() == 0
    finally:
        cuda.close()


def test_on_cuda_each_run_is_a_new_process_started_with_its_settings(monkeypatch):
    """Device: cpu (the process start stood in). The settings travel as PYTORCH_CUDA_ALLOC_CONF, set before
    the child's CUDA starts; the row comes back whole."""
    seen = {}

    def fake_run(cmd, env, **kwargs):
        seen.update(cmd=cmd, conf=env["PYTORCH_CUDA_ALLOC_CONF"])
        row = {"empty_cache() after del": json.loads(cmd[-1])["empty_cache_after_del"], "60 MiB again": "fits"}
        return subprocess.CompletedProcess(cmd, 0, stdout="noise\n" + base64.b64encode(pickle.dumps(row)).decode(),
                                           stderr="")

    monkeypatch.setattr(fragmentation.subprocess, "run", fake_run)
    row = in_fresh_allocator("max_split_size_mb:40", "cuda:1", empty_cache_after_del=True, big=30)
    assert seen["conf"] == "max_split_size_mb:40" and seen["cmd"][1:3] == ["-m", "gpukit.lessons.fragmentation"]
    assert json.loads(seen["cmd"][-1]) == {"settings": "max_split_size_mb:40", "empty_cache_after_del": True,
                                          "sizes": {"big": 30}, "index": 1}
    assert row == {"settings": "max_split_size_mb:40", "empty_cache() after del": True, "60 MiB again": "fits"}


def test_a_failed_run_on_cuda_says_which_settings_failed(monkeypatch):
    """Device: cpu (the process start stood in)."""
    monkeypatch.setattr(fragmentation.subprocess, "run",
                        lambda cmd, env, **kw: subprocess.CompletedProcess(cmd, 1, stdout="", stderr="boom"))
    with pytest.raises(RuntimeError, match="PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True' failed:\nboom"):
        in_fresh_allocator("expandable_segments:True", torch.device("cuda"))
