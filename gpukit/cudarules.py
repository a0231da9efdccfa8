"""What a CUDA run allocates differently from the CPU run a prediction simulates: ``predict(..., device="cuda")``.

Fake CUDA tensors cannot be made on a CPU-only installation, so a CUDA prediction still runs the
step on fake CPU tensors and applies the rules by which CUDA differs. They follow PyTorch 2.11's
source (what the GPU machines carry; the same in 2.13), for a Hopper GPU (H100/H200, sm90):

* Optimizers (torch/optim/optimizer.py ``_default_to_fused_or_foreach``, torch/optim/adam.py and the
  others): with ``foreach`` and ``fused`` left unset, CUDA parameters get the foreach implementation,
  whose ``step()`` makes parameter-sized temporaries; CPU parameters get the for-loop one. The rule
  sets ``foreach=True`` where the user left it unset, and the CPU then runs the same foreach code.
  ``fused`` is never a default.
* cuBLAS workspace (aten/src/ATen/cuda/CublasHandlePool.cpp ``getChosenWorkspaceSize``,
  ``setWorkspaceForHandle``): the first matrix product of a (cuBLAS handle, stream) allocates, through
  the caching allocator, a workspace kept for the life of the process: 4096 KiB x 8 = 32 MiB on sm90,
  or what ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE:COUNT`` KiB, summed) says. cuBLASLt, used for a
  matrix product with a bias (``addmm``), has its own (``getCUDABlasLtWorkspace``: keyed by the Lt
  handle, which on CUDA is the thread's cuBLAS handle, and the stream; ``CUBLASLT_WORKSPACE_SIZE`` KiB,
  default 1024, at most the cuBLAS one). Handles are per thread (``getCurrentCUDABlasHandle``: a
  ``thread_local`` PoolWindow), and autograd runs the backward of CUDA tensors on a device thread of its
  own (torch/csrc/autograd/engine.cpp: ``Engine::ready_queue`` sends non-CPU work to
  ``device_ready_queues_``, served by the threads ``start_device_threads`` starts): a step whose forward
  and backward both multiply matrices holds two cuBLAS workspaces (and two cuBLASLt ones where both
  threads run ``addmm``). The rule counts them per thread: the caller's, and backward's.
* Scaled dot-product attention (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp): flash
  attention for float16/bfloat16 without an attention mask, head dimension the same for q, k, v and
  at most 256; otherwise memory-efficient attention (float32 too) when head dimensions are multiples
  of 128 bits / element bits (8 for half, 4 for float32 on sm80+); otherwise the math fallback.
  Flash saves a float32 logsumexp of (batch, heads, queries), as the CPU kernel does; memory-efficient
  pads it to a multiple of 32 queries (attention.cu, ``kAlignLSE``). The math fallback saves the
  attention matrix, which this rule does not model: the prediction is then flagged a lower bound.

* cuDNN's workspaces cannot be predicted from source: a convolution's is the one of the algorithm cuDNN
  picks at run time (aten/src/ATen/native/cudnn/Conv_v8.cpp, ``benchmark`` or heuristics, limited by
  the free memory), and the RNN kernels' workspace and reserve replace the CPU kernel's
  (aten/src/ATen/native/cudnn/RNN.cpp). Convolutions and recurrent layers are therefore named in
  ``unmodelled`` and the prediction is a lower bound.

Not modelled: autocast's weight cache for ``torch.autocast("cuda")`` (fake CPU tensors are not
cast by a CUDA autocast), and NCCL buffers.
"""

from __future__ import annotations

import os
import re

import torch

from ._torch import TorchDispatchMode, current_autograd_node, tree_flatten, tree_unflatten

TORCH_RULES_VERSION = "2.11"
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "addr", "_addmm_activation"}
_SDPA_CPU = "_scaled_dot_product_flash_attention_for_cpu"
_CUDNN_WORKSPACE = {  # CPU op of the step -> what cuDNN adds on CUDA, decided at run time
    "convolution": "on CUDA cuDNN's convolution takes the workspace of the algorithm it picks at run time "
                   "(Conv_v8.cpp); not predictable from source",
    "convolution_backward": "on CUDA cuDNN's convolution backward takes the workspaces of the algorithms it "
                            "picks at run time (Conv_v8.cpp); not predictable from source",
    "mkldnn_rnn_layer": "on CUDA the recurrent layer runs cuDNN's kernel (RNN.cpp), whose workspace and "
                        "reserve differ from this CPU kernel's; not modelled",
}


def cublas_workspace_bytes(sm90: bool = True) -> int:
    """The cuBLAS workspace CublasHandlePool.cpp allocates per handle and stream."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    default = 4096 * 8 * 1024 if sm90 else 4096 * 1024 * 2 + 16 * 1024 * 8
    if not config:
        return default
    sizes = re.findall(r":([0-9]+):([0-9]+)", config)
    return sum(int(size) * 1024 * int(count) for size, count in sizes) if sizes else default


def cublaslt_workspace_bytes(sm90: bool = True) -> int:
    """The cuBLASLt workspace: CUBLASLT_WORKSPACE_SIZE KiB (default 1024), at most the cuBLAS one."""
    try:
        kib = int(os.environ.get("CUBLASLT_WORKSPACE_SIZE", "1024"))
    except ValueError:
        kib = 1024
    return min(kib * 1024, cublas_workspace_bytes(sm90))


def use_cuda_optimizer_defaults(optimizer: torch.optim.Optimizer) -> bool:
    """Set ``foreach=True`` in every parameter group that left both ``foreach`` and ``fused`` unset (and is not
    differentiable), as CUDA parameters get by default; returns whether any group changed."""
    changed = False
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused") \
                and not group.get("differentiable", False):
            group["foreach"] = True
            changed = True
    return changed


def sdpa_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, has_mask: bool) -> str:
    """The kernel CUDA picks for these inputs on sm90: "flash", "efficient" or "math" (sdp_utils.cpp)."""
    same_dim = query.shape[-1] == key.shape[-1] == value.shape[-1]
    half = query.dtype in (torch.float16, torch.bfloat16)
    if half and not has_mask and same_dim and query.shape[-1] <= 256:
        return "flash"
    alignment = 8 if half else 4
    if (query.dtype in (torch.float16, torch.bfloat16, torch.float32) and query.shape[-1] == key.shape[-1]
            and query.shape[-1] % alignment == 0 and value.shape[-1] % alignment == 0):
        return "efficient"
    return "math"


class CudaRules(TorchDispatchMode):
    """Applies the CUDA rules above to a fake CPU step; enter it inside the fake mode (above the kernel check)."""

    def __init__(self) -> None:
        super().__init__()
        self.gemm: set[str] = set()     # threads ("forward", "backward") whose matrix products took a cuBLAS handle
        self.gemm_lt: set[str] = set()  # and those that ran a cuBLASLt one (addmm)
        self.sdpa: dict[str, int] = {}  # backend -> calls
        self.unmodelled: dict[str, str] = {}
        self.notes: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::", 1)[-1]
        if name in _GEMMS:
            # Backward (also a checkpoint's recomputed forward) runs on autograd's device thread on CUDA.
            thread = "backward" if current_autograd_node() is not None else "forward"
            self.gemm.add(thread)
            if name in ("addmm", "_addmm_activation"):
                self.gemm_lt.add(thread)
        elif name == _SDPA_CPU:
            out = self._attention(func, args, kwargs, out)
        elif name in _CUDNN_WORKSPACE:
            self.unmodelled[str(func)] = _CUDNN_WORKSPACE[name]
        return out

    def _attention(self, func, args, kwargs, out):
        query, key, value = args[:3]
        has_mask = kwargs.get("attn_mask") is not None  # keyword-only in the op's schema
        backend = sdpa_backend(query, key, value, has_mask)
        self.sdpa[backend] = self.sdpa.get(backend, 0) + 1
        if backend == "math":
            self.unmodelled[str(func)] = ("on CUDA these inputs take the math attention, which saves the "
                                          "(batch, heads, queries, keys) attention matrix; not modelled")
        if backend != "efficient" or not torch.is_grad_enabled():
            return out
        flat, spec = tree_flatten(out)
        lse = flat[1]  # (batch, heads, queries) float32, padded to 32 queries by the memory-efficient kernel
        padded = -(-lse.shape[-1] // 32) * 32
        if padded != lse.shape[-1]:
            flat[1] = torch.empty(*lse.shape[:-1], padded, dtype=lse.dtype, device=lse.device)[..., :lse.shape[-1]]
        return tree_unflatten(flat, spec)

    def workspace_blocks(self) -> list[int]:
        """The sizes of the cuBLAS and cuBLASLt workspaces the step's matrix products allocate, one block each:
        per thread that multiplied matrices (the caller's for forward, autograd's device thread for backward)."""
        return ([cublas_workspace_bytes() for _ in sorted(self.gemm)]
                + [cublaslt_workspace_bytes() for _ in sorted(self.gemm_lt)])

    def workspaces(self) -> int:
        """Bytes of the cuBLAS and cuBLASLt workspaces the step's matrix products allocate."""
        return sum(self.workspace_blocks())


__all__ = ["CudaRules", "TORCH_RULES_VERSION", "cublas_workspace_bytes", "cublaslt_workspace_bytes",
           "use_cuda_optimizer_defaults", "sdpa_backend"]
