"""warm_up: the one-time cuBLAS workspaces, made before anything is measured."""

import pytest
import torch

import gpukit
from gpukit.warmup import cublas_workspace_bytes


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_devices_without_cublas_have_nothing_to_warm_up(device):
    with gpukit.measure(device, record=False) as r:
        assert gpukit.warm_up(device) == 0
    assert r.peak == 0


@pytest.mark.parametrize("config, expected", [(":4096:8", 32 * 2**20), (":4096:2:16:8", 8 * 2**20 + 128 * 1024),
                                              (":16:8", 128 * 1024)])
def test_the_workspace_size_is_read_from_cublas_workspace_config_as_pytorch_reads_it(monkeypatch, config, expected):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", config)
    assert cublas_workspace_bytes("cpu") == expected


def test_without_a_config_the_size_depends_on_the_gpu(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with pytest.raises(ValueError, match="CUDA devices only"):
        cublas_workspace_bytes("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_first_matmul_leaves_workspaces_that_stay_and_the_second_warm_up_adds_nothing():
    first = gpukit.warm_up("cuda")
    size = cublas_workspace_bytes("cuda")
    assert first == 0 or first >= size   # 0 when an earlier test already ran a matmul in this process
    torch.cuda.empty_cache()             # the workspaces are not cached blocks: they stay allocated
    assert torch.cuda.memory_allocated() >= size
    assert gpukit.warm_up("cuda") == 0
