"""warm_up(): make a device's one-time allocations before anything is measured.

    gpukit.warm_up("cuda")      # the bytes it left allocated: cuBLAS's workspaces (0 on the CPU)

On a GPU the first matrix multiply makes cuBLAS take a workspace from PyTorch's caching allocator
(aten/src/ATen/cuda/CublasHandlePool.cpp: ``getCurrentCUDABlasHandle`` -> ``setWorkspaceForHandle`` ->
``CUDACachingAllocator::get()->allocate(getChosenWorkspaceSize())``). It is counted in
``torch.cuda.memory_allocated()``, kept for the life of the process (``empty_cache()`` does not free it) and
is no tensor, so a role breakdown never sees it. There is one per (cuBLAS handle, stream), and handles are
per thread: autograd runs backward on a thread of its own, so backward's first matmul takes a second one.
Its size is ``CUBLAS_WORKSPACE_CONFIG``'s (``:SIZE_KIB:COUNT`` pairs), by default 32 MiB on sm90 (Hopper)
and ``:4096:2:16:8`` (8 MiB + 128 KiB) on other GPUs. cuBLASLt matmuls (``addmm`` with a bias, as
``nn.Linear`` runs) take a workspace of ``CUBLASLT_WORKSPACE_SIZE`` KiB (default 1 MiB) from the same
allocator (``getCUDABlasLtWorkspace``). A measurement that contains the first matmul of its thread counts
these workspaces as if the measured code needed them (pytorch/pytorch#95668).
"""

from __future__ import annotations

import os
import re

import torch

from .meter import resolve_device


def warm_up(device: str | torch.device | int | None = None) -> int:
    """Run a small forward and backward of a ``Linear`` (with and without a bias, recomputed under
    checkpointing so that backward's thread runs a forward too) and a ``Conv2d`` on ``device``, so that
    cuBLAS, cuBLASLt and cuDNN have made their one-time allocations before anything is measured.

    Args:
        device: ``'cuda'``, ``'cuda:N'``, ``'cpu'`` or ``'meta'``; default the GPU if there is one, else the CPU.

    Returns:
        The bytes it left allocated on the device (the workspaces it made). 0 on the CPU and on
        ``meta``, which have no such workspaces, and 0 on a GPU that was already warm.
    """
    from torch.utils.checkpoint import checkpoint

    dev = resolve_device(device)
    if dev.type != "cuda":
        return 0
    with torch.cuda.device(dev):
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        linear = torch.nn.Linear(64, 64, device=dev)
        conv = torch.nn.Conv2d(3, 8, 3, device=dev)
        x = torch.randn(32, 64, device=dev, requires_grad=True)
        out = checkpoint(linear, x, use_reentrant=False) @ linear.weight
        out.sum().backward()
        conv(torch.randn(2, 3, 16, 16, device=dev)).sum().backward()
        del linear, conv, x, out
        torch.cuda.synchronize(dev)
        return torch.cuda.memory_allocated(dev) - before


def cublas_workspace_bytes(device: str | torch.device | int | None = None) -> int:
    """The size of one cuBLAS workspace on ``device``, as CublasHandlePool.cpp chooses it: the sum of
    ``CUBLAS_WORKSPACE_CONFIG``'s ``:SIZE_KIB:COUNT`` pairs, else 32 MiB on sm90 and 8 MiB + 128 KiB elsewhere."""
    from .cudarules import cublas_workspace_bytes as workspace_for

    if re.search(r":([0-9]+):([0-9]+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG") or ""):
        return workspace_for()  # the configured size, whatever the GPU
    dev = resolve_device(device)
    if dev.type != "cuda":
        raise ValueError(f"cuBLAS workspaces exist on CUDA devices only, not on {dev}")
    return workspace_for(sm90=torch.cuda.get_device_capability(dev) == (9, 0))
