"""CUDA autocast's op policy, run by CPU autocast on the fake CPU tensors of a prediction for a GPU.

``torch.autocast("cuda")`` inside a predicted step runs as CPU autocast on the fake CPU tensors (``gpukit.amp``), and
CPU autocast has op lists of its own (aten/src/ATen/autocast_mode.cpp, ``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)``):
it leaves softmax, layer norm, exp, log, pow and sum in the lower precision where CUDA runs them in float32, and
runs ``mv``, ``addr`` and the RNN cells in float32 where CUDA runs them in the lower precision. While
``CudaAutocast`` is entered, the AutocastCPU kernels are CUDA's, read from the torch in use:

* the policy of each op, from the header torch installs, ``include/ATen/autocast_mode.h``: its lists
  ``AT_FORALL_LOWER_PRECISION_FP`` (cast float32 to the autocast dtype), ``AT_FORALL_FP32`` (cast to float32),
  ``AT_FORALL_FP32_SET_OPT_DTYPE`` (``dtype=float32`` where the call names none),
  ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`` (``norm``: the overload with a dtype, float32) and
  ``AT_FORALL_PROMOTE`` (the widest floating type of the inputs);
  ``binary_cross_entropy`` raises CUDA's error (autocast_mode.cpp, ``binary_cross_entropy_banned``);
* each policy as ``autocast_mode.h`` writes it: ``cached_cast`` casts a floating tensor other than float64
  (``is_autocast_eligible``), and keeps the lower-precision copy of a float32 leaf that requires grad until the
  outermost autocast region exits (``clear_autocast_cache``); the op then runs with autocast off below it;
* the ops CPU autocast lists and CUDA's does not (``cross_entropy_loss``, ``cat``, ``stack``, ``grid_sampler_2d``...)
  fall through, as on CUDA: their composite's own ops meet autocast;
* ``softmax`` and ``log_softmax`` of a float16 input to float32 take CUDA's kernel that reads half and writes
  float (aten/src/ATen/native/SoftMax.cpp: ``_softmax(input, dim, half_to_float=true)`` where ``input.is_cuda()``),
  without the float32 copy of the input that the CPU's path makes; bfloat16 makes the copy on CUDA too.

The kernels are registered through PyTorch's operator registration API for the region of the prediction and
removed after it (also when it raises or is interrupted), which puts CPU autocast's own kernels back. The
dispatcher's kernels are the process's: while a prediction for a GPU runs, CPU autocast in another thread of the
process follows CUDA's lists too. ``cuda_policy()`` is None where the header is missing (an install without torch's
headers) or unreadable; the caller then names CPU autocast's lists in what it could not model.
"""

from __future__ import annotations

import functools
import re
import threading
import warnings
import weakref
from pathlib import Path

import torch

from ._torch import (FALLTHROUGH_KERNEL, FakeTensor, below_cpu_autocast, drop_kernels, is_view, kernel_registry,
                     ops_with_kernel_for)

HEADER = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
LISTS = {  # the header's list -> the cast policy autocast_mode.cpp registers it with for CUDA
    "AT_FORALL_LOWER_PRECISION_FP": "lower_precision_fp",
    "AT_FORALL_FP32": "fp32",
    "AT_FORALL_FP32_SET_OPT_DTYPE": "fp32_set_opt_dtype",
    "AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE": "fp32_append_dtype",
    "AT_FORALL_PROMOTE": "promote",
}
# Registered for CUDA in autocast_mode.cpp itself, not from the header's lists.
CPP_ONLY = {"aten::binary_cross_entropy": "banned", "aten::cudnn_convolution": "lower_precision_fp",
            "aten::cudnn_convolution_transpose": "lower_precision_fp"}
BANNED_MESSAGE = (  # autocast_mode.cpp, binary_cross_entropy_banned
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast.")


def parse_header(text: str) -> dict[str, str]:
    """``{"aten::softmax.int": "fp32_set_opt_dtype", ...}``: the op lists of autocast_mode.h's text, each op by its
    qualified name and overload (none for the default one)."""
    policy: dict[str, str] = {}
    for macro, cast in LISTS.items():
        found = re.search(rf"#define {macro}\(_\)((?:[^\n]*\\\n)*[^\n]*)", text)
        if found is None:
            raise ValueError(f"autocast_mode.h has no list {macro}")
        body = found.group(1)
        if cast == "fp32_append_dtype":  # _(ADD_NS(norm), "norm.Scalar", <signatures>, fp32_append_dtype)
            names = re.findall(r'"([A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)?)"', body)
        else:  # _(op) or _(op, overload)
            names = [name + (f".{overload}" if overload else "")
                     for name, overload in re.findall(r"\b_\((\w+)(?:,\s*(\w+))?\)", body)]
        if not names:
            raise ValueError(f"autocast_mode.h: the list {macro} names no op")
        for name in names:
            policy[f"aten::{name}"] = cast
    return policy


@functools.cache
def cuda_policy() -> dict[str, str] | None:
    """CUDA autocast's policy of each op it registers a kernel for, for the torch in use; None where the header is
    missing or its lists are not the ones this module reads (a torch of another layout)."""
    try:
        return {**parse_header(HEADER.read_text()), **CPP_ONLY}
    except (OSError, ValueError):
        return None


def cpu_autocast_ops() -> set[str]:
    """The ops CPU autocast registers a kernel of its own for (the others fall through)."""
    return ops_with_kernel_for("AutocastCPU")


def _overload(qualname: str):
    name = qualname.split("::", 1)[1]
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op), overload or "default")


def _eligible(t) -> bool:
    """``is_autocast_eligible``: a floating tensor other than float64 (every fake tensor stands for the GPU)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


class CudaAutocast:
    """While entered, CPU autocast runs CUDA autocast's policy (module docstring). Enter it on the prediction's
    thread around the fake step; ``clear_cache()`` where the outermost autocast region exits."""

    def __init__(self) -> None:
        self.policy = cuda_policy()
        self._cache: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # id(float32 leaf) -> its cached copy
        self._lock = threading.Lock()
        self._lib = None

    def __enter__(self):
        if self.policy is None:
            return self
        lib = kernel_registry()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": the point here
                for qualname in cpu_autocast_ops() - set(self.policy):
                    lib.impl(qualname.split("::", 1)[1], FALLTHROUGH_KERNEL, "AutocastCPU")
                for qualname, cast in self.policy.items():
                    try:
                        op = _overload(qualname)
                    except AttributeError:
                        continue  # an op this build does not have
                    lib.impl(qualname.split("::", 1)[1], self._kernel(op, cast), "AutocastCPU")
        except BaseException:
            drop_kernels(lib)
            raise
        self._lib = lib
        return self

    def __exit__(self, *exc) -> None:
        self.clear_cache()
        if self._lib is not None:
            drop_kernels(self._lib)  # CPU autocast's own kernels are in place again
            self._lib = None

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    # -- cached_cast ---------------------------------------------------------------------------------------------

    def _cast(self, value, dtype: torch.dtype):
        if isinstance(value, (list, tuple)):
            return type(value)(self._cast(v, dtype) for v in value)
        if not _eligible(value) or value.dtype == dtype:
            return value
        if (dtype != torch.float32 and value.dtype == torch.float32 and value.requires_grad and value.is_leaf
                and not is_view(value) and torch.is_autocast_cache_enabled()):
            with self._lock:
                kept = self._cache.get(id(value))
                if kept is not None and kept[0]() is value:
                    return kept[1]
                cast = value.to(dtype)
                self._cache[id(value)] = (weakref.ref(value), cast)
                return cast
        return value.to(dtype)

    def _kernel(self, op, cast: str):
        name = op._schema.name.split("::", 1)[1]

        if cast == "banned":
            def banned(*args, **kwargs):
                raise RuntimeError(BANNED_MESSAGE)
            return banned

        if cast == "fp32_set_opt_dtype":
            at = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dtype")
            keyword = op._schema.arguments[at].kwarg_only

            def set_opt_dtype(*args, **kwargs):
                args = list(args)
                if _eligible(args[0]):  # firstarg_is_eligible
                    if keyword:
                        kwargs["dtype"] = kwargs.get("dtype") or torch.float32
                    elif len(args) > at:
                        args[at] = args[at] or torch.float32
                    else:
                        args.extend(op._schema.arguments[i].default_value for i in range(len(args), at))
                        args.append(torch.float32)
                with below_cpu_autocast():
                    if (name in ("softmax", "log_softmax") and isinstance(args[0], FakeTensor)
                            and args[0].dtype == torch.float16 and len(args) > 2 and args[2] == torch.float32):
                        # SoftMax.cpp: CUDA reads half and writes float (a real CPU tensor has no such kernel)
                        inner = torch.ops.aten._softmax if name == "softmax" else torch.ops.aten._log_softmax
                        return inner.default(args[0], args[1], True)
                    return op(*args, **kwargs)
            return set_opt_dtype

        if cast == "fp32_append_dtype":
            names = [a.name for a in op._schema.arguments]
            with_dtype = next(getattr(op.overloadpacket, o) for o in op.overloadpacket.overloads()
                              if [a.name for a in getattr(op.overloadpacket, o)._schema.arguments] == names + ["dtype"])

            def append_dtype(*args, **kwargs):
                with below_cpu_autocast():
                    if not _eligible(args[0]):
                        return op(*args, **kwargs)
                    full = list(args) + [op._schema.arguments[i].default_value for i in range(len(args), len(names))]
                    return with_dtype(*full, dtype=torch.float32)  # keyword-only there
            return append_dtype

        def cast_policy(*args, **kwargs):
            if cast == "fp32":
                dtype = torch.float32
            else:
                dtype = torch.get_autocast_dtype("cpu")  # the region's dtype: the card's, set by gpukit.amp
                if cast == "promote":
                    dtype = _promote_type(dtype, list(args) + list(kwargs.values()))
            args = self._cast(args, dtype)
            kwargs = {k: self._cast(v, dtype) for k, v in kwargs.items()}
            with below_cpu_autocast():
                return op(*args, **kwargs)
        return cast_policy


def _promote_type(lower: torch.dtype, values) -> torch.dtype:
    """``promote_type``/``prioritize``: float32 where any eligible input is float32, else the lower precision."""
    current = lower
    for value in values:
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if not _eligible(t):
                continue
            if current == torch.float32 or t.dtype == torch.float32:
                current = torch.float32
            elif t.dtype != lower:
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current
