"""What a CUDA run allocates differently from the CPU run a prediction simulates: ``predict(..., device="cuda")``.

A CPU-only PyTorch makes fake CUDA tensors, but autograd aborts the process on the first backward
through one (its input metadata asks for a CUDA device guard), so a CUDA prediction runs the step on
fake CPU tensors and applies the rules by which CUDA differs (``gpukit.offload`` applies the same rules
to its simulated GPU, ``meta``). They follow PyTorch 2.11's
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
* Scaled dot-product attention (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp), for the card's
  compute capability (sm90 unless a card is named, gpukit.cards): flash attention from sm80, for
  float16/bfloat16 without an attention mask, head dimension the same for q, k, v and at most 256;
  otherwise memory-efficient attention from sm50, for float16 and float32 (bfloat16 too from sm80), when
  head dimensions are multiples of ``minimum_gemm_alignment`` (8 for half; 4 for float32 on sm80+, 1
  below, where float32 takes no tensor cores); otherwise the math fallback. Flash saves a float32
  logsumexp of (batch, heads, queries), as the CPU kernel does; memory-efficient pads it to a multiple of
  32 queries (attention.cu, ``kAlignLSE``). The math fallback is ``_scaled_dot_product_attention_math``
  (aten/src/ATen/native/transformers/attention.cpp), composite code the same on every device but MPS: it
  copies float16/bfloat16 inputs to float32 (``allowFP16BF16ReductionMathSDP`` is off by default) and
  keeps the (batch, heads, queries, keys) attention matrix for backward. Where CUDA takes it, the rule
  runs the step's attention as that same composite on the CPU (``sdpa_kernel(SDPBackend.MATH)``), so
  the matrix and the float32 copies are counted as CUDA holds them: a T4 in bfloat16 (no fused kernel
  takes bfloat16 below sm80), or any card with an attention mask whose head dimension misses the
  alignment.

* Dropout (aten/src/ATen/native/Dropout.cpp): ``at::dropout`` in training takes the fused kernel,
  ``native_dropout``, where ``is_fused_kernel_acceptable`` holds: a CUDA input, ``0 < p < 1``, at least one element.
  Its CUDA kernel (aten/src/ATen/native/cuda/Dropout.cu, ``native_dropout_cuda``, ``dropout_cuda<bool>``) makes the
  output and a bool mask, and backward keeps the mask alone, the scale 1 / (1 - p) being a number
  (tools/autograd/derivatives.yaml: ``native_dropout_backward(grad, result1, scale)``). On a CPU tensor the same call
  draws a noise tensor of the input's dtype, scales it and multiplies, and the product keeps the noise: 4 bytes an
  element in float32 where CUDA keeps 1. The rule runs ``F.dropout`` and ``torch.dropout`` of the tensors that
  stand for the GPU as ``native_dropout`` (whose CPU kernel and fake one also make a bool mask; the same values:
  the kept elements scaled by 1 / (1 - p)). In-place dropout (``dropout_``), feature dropout (``dropout1d/2d/3d``)
  and alpha dropout never take the fused kernel and run as they are; so does the dropout inside the math attention
  composite (called from C++, out of a torch-function mode's reach): there CUDA keeps a bool mask and the
  prediction the noise tensor, in the attention's dtype.

* cuDNN's workspaces cannot be predicted from source: a convolution's is the one of the algorithm cuDNN
  picks at run time (aten/src/ATen/native/cudnn/Conv_v8.cpp, ``benchmark`` or heuristics, limited by
  the free memory), and the RNN kernels' workspace and reserve replace the CPU kernel's
  (aten/src/ATen/native/cudnn/RNN.cpp). Convolutions and recurrent layers are therefore named in
  ``unmodelled`` and the prediction is a lower bound. The workspaces come from the caching allocator
  (``run_conv_plan``) and stay cached, so reserved memory is the figure most under: on an H200 the technique
  matrix's convnet 128 reserved 21-45% more than predicted, its six workspaces a step 130-393 MiB each
  (data/runs/nvidia-h200-cudnn-workspaces.txt).

* Autocast: the step's ``torch.autocast`` runs on the fake CPU tensors as CPU autocast (``torch.autocast("cuda")``
  too, with its dtype: ``gpukit.amp``, which also runs the step's GradScaler as the card does), with CUDA's op
  policy in place of CPU autocast's (``gpukit.cuda_autocast``, read from the installed
  ``include/ATen/autocast_mode.h``): layer and group norm, softmax and log-softmax, the losses, exp, log, pow and
  sum in float32; ``mv``, ``addr`` and the RNN cells in the lower precision; a float16 softmax to float32 without
  a copy of its input (SoftMax.cpp). Its weight cache is CUDA's: ``cached_cast`` (aten/src/ATen/autocast_mode.cpp)
  keeps the lower-precision copy of a float32 leaf that requires grad for the whole autocast region, so each
  weight is cast once per forward. Where torch's headers are not installed, CPU autocast's lists run and are
  named in ``unmodelled``.

* Reductions' staging buffer (aten/src/ATen/native/cuda/Reduce.cuh): ``sum`` and ``mean`` split across thread
  blocks allocate a buffer and semaphores for the kernel's duration; their sizes: ``gpukit.cudareduce``.

* CUDA as the user's code names it (``.cuda()``, ``.to("cuda")``, ``device="cuda"``): the tensors that stand for
  the GPU (``gpukit.cudadevice``), so that the step a user runs on a GPU runs as written.

* Optimizers' step counters: a for-loop or foreach optimizer keeps ``state['step']`` on the host (torch/optim/adam.py
  ``_init_group``: on the parameter's device only when capturable or fused); the rules register the hook that
  marks them the host's (``gpukit.hoststate``), so they count in no device figure.

Not modelled: NCCL buffers.
"""

from __future__ import annotations

import functools

import os
import re
import threading
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from ._torch import TorchDispatchMode, current_autograd_node, tree_flatten, tree_unflatten
from .counter import FAKE_LEDGER
from .cuda_autocast import CudaAutocast
from .cudadevice import DEVICE_METHODS, CudaDevices
from .cudareduce import REDUCTION_MULTIPROCESSORS, REDUCTION_OPS, SM90, reduction_staging_blocks
from .hoststate import host_steps_hook, run_capturable_off

TORCH_RULES_VERSION = "2.11"
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "addr", "_addmm_activation"}
_SDPA_CPU = "_scaled_dot_product_flash_attention_for_cpu"
_CUDNN_WORKSPACE = {  # CPU op of the step -> what cuDNN adds on CUDA, decided at run time
    "convolution": "on CUDA cuDNN's convolution takes the workspace of the algorithm it picks at run time "
                   "(Conv_v8.cpp: run_conv_plan, from the caching allocator, so it stays reserved); not "
                   "predictable from source: the peak and, most, the reserved figure are lower bounds",
    "convolution_backward": "on CUDA cuDNN's convolution backward takes the workspaces of the algorithms it "
                            "picks at run time (Conv_v8.cpp: run_conv_plan, from the caching allocator, so they "
                            "stay reserved); not predictable from source: the peak and, most, the reserved "
                            "figure are lower bounds",
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
    differentiable), as CUDA parameters get by default, and run a capturable group without capturable, its step
    counters on the GPU (``gpukit.hoststate.run_capturable_off``); returns whether any group changed."""
    from .bigmodel import OptimizerInBackward

    if isinstance(optimizer, OptimizerInBackward):  # the per-parameter optimizers do the steps
        return any([use_cuda_optimizer_defaults(inner) for inner in optimizer.optimizers.values()])
    changed = run_capturable_off(optimizer)
    for group in optimizer.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused") \
                and not group.get("differentiable", False):
            group["foreach"] = True
            changed = True
    return changed


def sdpa_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, has_mask: bool,
                 capability: tuple[int, int] = SM90) -> str:
    """The kernel CUDA picks for these inputs on a card of this compute capability: "flash", "efficient" or
    "math" (sdp_utils.cpp: ``check_flash_attention_hardware_support``, ``check_dtypes_flash_attention``,
    ``check_mem_efficient_hardware_support``, ``check_head_dim_size_mem_efficient``)."""
    from .cards import FLASH_SM, MEM_EFFICIENT_SM

    capability = tuple(capability)
    same_dim = query.shape[-1] == key.shape[-1] == value.shape[-1]
    half = query.dtype in (torch.float16, torch.bfloat16)
    if (half and FLASH_SM[0] <= capability <= FLASH_SM[1] and not has_mask and same_dim
            and query.shape[-1] <= 256):
        return "flash"
    dtypes = (torch.float16, torch.float32) + ((torch.bfloat16,) if capability >= (8, 0) else ())
    if MEM_EFFICIENT_SM[0] <= capability <= MEM_EFFICIENT_SM[1] and query.dtype in dtypes:
        # minimum_gemm_alignment: 4 from sm80, else 1; 128 bits' worth where tensor cores run (sm80+, or sm70+
        # for half): 8 half values, 4 float32 ones.
        tensor_cores = capability >= (8, 0) or (capability >= (7, 0) and half)
        alignment = max(4 if capability >= (8, 0) else 1, (128 // (16 if half else 32)) if tensor_cores else 1)
        if (query.shape[-1] == key.shape[-1] and query.shape[-1] % alignment == 0
                and value.shape[-1] % alignment == 0):
            return "efficient"
    return "math"


_LOWER = (torch.float16, torch.bfloat16)


class CudaRules(TorchDispatchMode):
    """Applies the CUDA rules above to a fake CPU step; enter it inside the fake mode (above the kernel check)."""

    def __init__(self, capability: tuple[int, int] = SM90, gpu: str | None = None) -> None:
        super().__init__()
        self.capability = tuple(capability)  # the card's compute capability: the attention kernels it has
        self.gpu = gpu  # the device type of the tensors that stand for the GPU; None: every tensor of the step
        self.gemm: set[str] = set()     # threads ("forward", "backward") whose matrix products took a cuBLAS handle
        self.gemm_lt: set[str] = set()  # and those that ran a cuBLASLt one (addmm)
        self.sdpa: dict[str, int] = {}  # backend -> calls
        self.unmodelled: dict[str, str] = {}
        self._autocast: list[bool] = []  # the step's autocast regions on the (fake) CPU, innermost last
        self._hosting = None  # the optimizer step hook that hands step counters to the host (gpukit.hoststate)

    # Inside a dispatch mode torch.is_autocast_enabled() reads False (the autocast keys are excluded while a
    # mode runs), so the rules follow the step's autocast regions themselves, from torch.autocast's enter/exit.
    def __enter__(self):
        cls = torch.amp.autocast_mode.autocast
        self._saved = cls.__enter__, cls.__exit__
        enter, exit_, regions, here = self._saved[0], self._saved[1], self._autocast, threading.get_ident()

        def entered(ac):
            out = enter(ac)
            if threading.get_ident() == here:  # the step's thread; another thread's autocast is not the step's
                regions.append(torch.is_autocast_enabled("cpu"))  # read here, outside any dispatch
                if regions[-1] and policy is not None and policy.policy is None:
                    self.unmodelled["autocast"] = (
                        "torch.autocast('cuda') ran CPU autocast's op lists: CUDA's (torch's include/ATen/autocast_mode.h) "
                        "could not be read. CUDA runs softmax, layer norm and the losses in float32")
            return out

        def exited(ac, *exc):
            if regions and threading.get_ident() == here:
                regions.pop()
            try:
                return exit_(ac, *exc)
            finally:
                if not regions and policy is not None:
                    policy.clear_cache()  # torch clears its own cast cache as the outermost region exits

        # The fake CPU tensors stand for the GPU: CPU autocast runs CUDA's op policy (gpukit.cuda_autocast).
        # (gpukit.offload's GPU, meta, has no autocast: its regions run in float32, named there.)
        policy = self._policy = CudaAutocast() if self.gpu is None else None
        cls.__enter__, cls.__exit__ = entered, exited
        self._math = _MathAttention(self.capability, self.sdpa)  # no cycle back: the rules die with the step
        self._dropout = _FusedDropout(self.gpu)
        # The CUDA devices the user's code names (.cuda(), device="cuda") are the tensors that stand for the GPU.
        self._functions = _CardFunctions(CudaDevices(self.gpu or "cpu"), self._math, self._dropout)
        self._math.__enter__()
        self._dropout.__enter__()
        try:
            self._functions.__enter__()
            try:
                if policy is not None:
                    policy.__enter__()
            except BaseException:
                self._functions.__exit__(None, None, None)
                raise
        except BaseException:
            self._dropout.__exit__(None, None, None)
            self._math.__exit__(None, None, None)
            cls.__enter__, cls.__exit__ = self._saved
            raise
        entered = super().__enter__()
        # CUDA keeps the optimizers' step counters on the host (gpukit.hoststate), where every fake tensor is the GPU's
        self._hosting = host_steps_hook() if self.gpu is None else None
        return entered

    def __exit__(self, *exc):
        if self._hosting is not None:
            self._hosting.remove()
        cls = torch.amp.autocast_mode.autocast
        cls.__enter__, cls.__exit__ = self._saved
        try:
            return super().__exit__(*exc)
        finally:
            try:
                if self._policy is not None:
                    self._policy.__exit__(*exc)
            finally:
                try:
                    self._functions.__exit__(*exc)
                finally:
                    self._dropout.__exit__(*exc)
                    self._math.__exit__(*exc)

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
        if str(func) in REDUCTION_OPS:
            self._reduction_staging(func, args, kwargs, out)
        return out

    def _attention(self, func, args, kwargs, out):
        query, key, value = args[:3]
        has_mask = kwargs.get("attn_mask") is not None  # keyword-only in the op's schema
        backend = sdpa_backend(query, key, value, has_mask, self.capability)
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

    def _reduction_staging(self, func, args, kwargs, out):
        """The staging buffer and semaphores of a reduction split across thread blocks (``reduction_staging_blocks``),
        allocated after its output and freed when it returns, as ``gpu_reduce_kernel`` holds them."""
        input = args[0]
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        dtype = kwargs.get("dtype")  # keyword-only in both schemas
        if not isinstance(input, torch.Tensor) or (self.gpu is not None and input.device.type != self.gpu):
            return
        if dtype is not None and dtype != input.dtype and not (dtype == torch.float32 and input.dtype in _LOWER):
            return  # make_reduction casts the input first (a copy this rule does not add)
        blocks = reduction_staging_blocks(input, dims, self.capability)
        if blocks is None:
            self.unmodelled[str(func)] = (
                f"on CUDA a long {func._schema.name.split('::')[-1]} stages partial results in a buffer sized by the "
                "card's multiprocessor count (Reduce.cuh, global_memory_size), not known here for compute capability "
                f"{self.capability[0]}.{self.capability[1]}")
            return
        # Made here, below the counting mode, which sees only what an op returns: booked by hand, after the output
        # (which the kernel writes, so it exists first; the counting mode then finds it booked).
        FAKE_LEDGER.see(out)
        staged = []
        for n in blocks:
            staged.append(torch.empty(n, dtype=torch.uint8, device=input.device))
            FAKE_LEDGER.see(staged[-1])
        del staged

    def workspace_blocks(self) -> list[int]:
        """The sizes of the cuBLAS and cuBLASLt workspaces the step's matrix products allocate, one block each:
        per thread that multiplied matrices (the caller's for forward, autograd's device thread for backward)."""
        sm90 = self.capability == SM90
        return ([cublas_workspace_bytes(sm90) for _ in sorted(self.gemm)]
                + [cublaslt_workspace_bytes(sm90) for _ in sorted(self.gemm_lt)])

    def workspaces(self) -> int:
        """Bytes of the cuBLAS and cuBLASLt workspaces the step's matrix products allocate."""
        return sum(self.workspace_blocks())


# The function as torch defines it (torch._C._nn's), which a torch-function mode is handed: while
# gpukit.offload's simulated GPU is open, torch.nn.functional's name for it is a stand-in that calls it.
SDPA = torch.nn.functional.scaled_dot_product_attention


class _MathAttention:
    """Runs ``scaled_dot_product_attention`` as the math composite where CUDA would, on this card, for the dtype
    the call computes in (autocast's where a region casts it: torch.autocast lists the op as lower precision),
    so its attention matrix and float32 copies are counted; other calls go on to the CPU's fused kernel. Entered,
    it stands in for torch.nn.functional's name; ``_CardFunctions``, the rules' torch-function mode, hands it the
    calls that reach torch's own function."""

    def __init__(self, capability: tuple[int, int], counts: dict[str, int]) -> None:
        self.capability, self.counts = capability, counts
        self._applying = threading.local()  # set while a call runs under the rule (not decided twice)

    # A torch-function mode is off while it handles a call, and so through all of ``loss.backward()``: a checkpoint
    # recomputes its forward inside backward, where the mode would not see the attention, and the CPU would pick
    # another kernel than the forward did (torch.utils.checkpoint then refuses the recomputed tensors). So
    # torch.nn.functional's name for the call also goes through the rule while the mode is open, as models call it
    # (transformers' sdpa_attention_forward, nn.MultiheadAttention's functional path).
    def __enter__(self):
        self._named = F.scaled_dot_product_attention
        named = self._named
        F.scaled_dot_product_attention = functools.wraps(SDPA)(lambda *args, **kwargs: self.apply(named, args, kwargs))
        return self

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self._named
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not SDPA or getattr(self._applying, "on", False):
            return func(*args, **kwargs)
        return self.apply(func, args, kwargs)

    def apply(self, func, args, kwargs):
        """Run the attention ``func(*args, **kwargs)`` as the card's kernel would: see the class."""
        if getattr(self._applying, "on", False):
            return func(*args, **kwargs)
        self._applying.on = True
        try:
            return self._apply(func, args, dict(kwargs))
        finally:
            self._applying.on = False

    def _apply(self, func, args, kwargs):
        names = ("query", "key", "value", "attn_mask")
        given = dict(zip(names, args)) | {n: kwargs[n] for n in names if n in kwargs}
        query = given["query"]
        dtype = query.dtype
        if torch.is_autocast_enabled("cpu") and dtype in (torch.float32, *_LOWER):
            dtype = torch.get_autocast_dtype("cpu")
        shapes = [SimpleNamespace(shape=given[n].shape, dtype=dtype) for n in names[:3]]
        if sdpa_backend(*shapes, given.get("attn_mask") is not None, self.capability) != "math":
            dropout = kwargs["dropout_p"] if "dropout_p" in kwargs else (args[4] if len(args) > 4 else 0.0)
            if dropout:
                # CUDA's flash and memory-efficient kernels take dropout (sdp_utils.cpp: no dropout check among their
                # constraints) and keep no mask: the kernel draws it again in backward from a philox seed and
                # offset (attention.cu, _efficient_attention_forward: CPU scalars outside graph capture). The CPU's
                # flash kernel refuses dropout (sdp_utils_cpp.cpp, check_for_dropout), so torch would decompose the
                # call into the math path and its (batch, heads, queries, keys) matrices, which the card never
                # makes. The call runs without dropout: the same outputs and saved tensors as the card's kernel.
                if "dropout_p" in kwargs:
                    kwargs = {**kwargs, "dropout_p": 0.0}
                else:
                    args = (*args[:4], 0.0, *args[5:])
            return func(*args, **kwargs)
        self.counts["math"] = self.counts.get("math", 0) + 1
        with sdpa_kernel(SDPBackend.MATH):
            return func(*args, **kwargs)


# The functions as torch defines them, which a torch-function mode is handed (F.dropout hands on the name its module
# has for it at the call: the stand-in below while the rule is open).
DROPOUT = torch.nn.functional.dropout
TORCH_DROPOUT = torch.dropout


def takes_fused_dropout(input: torch.Tensor, p: float, training: bool, inplace: bool = False) -> bool:
    """Whether ``F.dropout(input, p, training, inplace)`` on a CUDA tensor runs the fused ``native_dropout``:
    ``at::dropout`` in training with ``is_fused_kernel_acceptable`` (0 < p < 1, at least one element; Dropout.cpp),
    not in place (``at::dropout_`` never takes it), of a floating-point input (the CUDA kernel's dtypes, Dropout.cu:
    floating types, half and bfloat16; others fail on either path, and are left to fail as the CPU's)."""
    return (bool(training) and not inplace and isinstance(input, torch.Tensor) and input.is_floating_point()
            and isinstance(p, (int, float)) and 0 < p < 1 and input.numel() > 0)


class _FusedDropout:
    """Runs ``F.dropout`` and ``torch.dropout`` in training as CUDA's fused kernel, ``native_dropout``, where CUDA
    takes it (``takes_fused_dropout``) for a tensor that stands for the GPU (of device type ``gpu``; any, for None):
    its mask, kept for backward, is a bool tensor, where the CPU's composite keeps a noise tensor of the input's
    dtype. Other calls go on unchanged."""

    def __init__(self, gpu: str | None = None) -> None:
        self.gpu = gpu

    # As for attention (_MathAttention): a checkpoint recomputes its forward inside backward, where the mode is off;
    # torch.nn.functional's and torch's names for dropout go through the rule while it is open, so the recomputed
    # forward keeps the mask the first one kept (torch.utils.checkpoint refuses saved tensors of another dtype).
    def __enter__(self):
        self._named = F.dropout, torch.dropout
        named_f, named_torch = self._named

        @functools.wraps(DROPOUT)
        def dropout(input, p=0.5, training=True, inplace=False):
            return self.apply(named_f, input, p, training, inplace)

        @functools.wraps(TORCH_DROPOUT)
        def torch_dropout(input, p, train):
            return self.apply(lambda x, q, t, _: named_torch(x, q, t), input, p, train, False)

        self._stand_ins = dropout, torch_dropout
        F.dropout, torch.dropout = dropout, torch_dropout
        return self

    def __exit__(self, *exc):
        F.dropout, torch.dropout = self._named
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is DROPOUT or func is self._stand_ins[0]:
            given = dict(zip(("input", "p", "training", "inplace"), args)) | kwargs
            return self.apply(self._named[0], given["input"], given.get("p", 0.5), given.get("training", True),
                              given.get("inplace", False))
        if func is TORCH_DROPOUT or func is self._stand_ins[1]:
            given = dict(zip(("input", "p", "train"), args)) | kwargs
            return self.apply(lambda x, q, t, _: self._named[1](x, q, t), given["input"], given["p"], given["train"],
                              False)
        return func(*args, **kwargs)

    def apply(self, otherwise, input, p, training, inplace):
        """Dropout of ``input`` as the card runs it: ``native_dropout``'s output where CUDA takes the fused kernel,
        else ``otherwise(input, p, training, inplace)``."""
        if takes_fused_dropout(input, p, training, inplace) and (self.gpu is None or input.device.type == self.gpu):
            return torch.ops.aten.native_dropout(input, float(p), True)[0]
        return otherwise(input, p, training, inplace)


class _CardFunctions(TorchFunctionMode):
    """The rules that act on torch's functions, as one torch-function mode: each mode open costs every call of the
    step a Python frame (three modes, one a rule, made a 1.24B Llama's prediction 3.30 s where this one makes it
    3.0 s: 3 warm predictions each, bench/plan_search.py's step). It hands a call to the rule
    whose it is: a CUDA device named (``CudaDevices``), attention (``_MathAttention``), dropout (``_FusedDropout``);
    any other goes on as it is. A mode is off while it handles a call, so what a rule runs is not handed back to it."""

    def __init__(self, devices: CudaDevices, attention: _MathAttention, dropout: _FusedDropout) -> None:
        super().__init__()
        self.devices, self.attention, self.dropout = devices, attention, dropout

    def __enter__(self):  # (after the dropout rule's: its stand-ins for torch's names are dropout's calls too)
        self._dropouts = frozenset({DROPOUT, TORCH_DROPOUT, *self.dropout._stand_ins})
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # (every call of the step comes here: the common case, none of the rules', is decided first and cheaply)
        if kwargs and ("device" in kwargs or "pin_memory" in kwargs) or func in DEVICE_METHODS:
            return self.devices.__torch_function__(func, types, args, kwargs)
        if func is SDPA:
            return self.attention.__torch_function__(func, types, args, kwargs)
        if func in self._dropouts:
            return self.dropout.__torch_function__(func, types, args, kwargs)
        return func(*args, **(kwargs or {}))


__all__ = ["CudaRules", "TORCH_RULES_VERSION", "cublas_workspace_bytes", "cublaslt_workspace_bytes",
           "use_cuda_optimizer_defaults", "sdpa_backend", "takes_fused_dropout", "reduction_staging_blocks",
           "REDUCTION_MULTIPROCESSORS"]
