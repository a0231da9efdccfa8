"""Every private PyTorch name gpukit uses, in one place, checked against the torch it runs with.

gpukit counts memory from inside PyTorch's dispatcher, predicts with fake tensors and tags memory by role
with MemTracker: none of that has a public API. This module is the only one that imports a private name
(``torch._C``, ``torch._subclasses``, ``torch.utils._python_dispatch``, ``torch.utils._pytree``,
``torch.distributed._tools``) or patches torch (``UntypedStorage.resize_``). Each was read in the source of
the versions in ``CHECKED`` and the unit tests pass on them (README, "Which torch"). On a torch outside that
range gpukit refuses to start with an error that says so, rather than give a wrong number; set
``GPUKIT_UNCHECKED_TORCH=1`` to try anyway. A name that has gone or changed shape raises
``UnsupportedTorch`` naming it, at import, not a wrong figure later.
"""

from __future__ import annotations

import inspect
import os

import torch

CHECKED = ((2, 11), (2, 15))   # the oldest and newest minor versions the suite passed on (both included)


class UnsupportedTorch(RuntimeError):
    """This torch lacks (or changed) a private name gpukit depends on, or lies outside the checked range."""


def torch_version(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``torch.__version__`` (or of ``version``): '2.11.0+cu130' -> (2, 11)."""
    text = version or torch.__version__
    try:
        major, minor = (int(part) for part in text.split("+")[0].split(".")[:2])
    except ValueError:
        raise UnsupportedTorch(f"cannot read torch's version from {text!r}") from None
    return major, minor


def check_version(version: str | None = None, allow_unchecked: bool | None = None) -> None:
    """Raise ``UnsupportedTorch`` when torch (or ``version``) is outside ``CHECKED``, unless allowed."""
    if allow_unchecked is None:
        allow_unchecked = os.environ.get("GPUKIT_UNCHECKED_TORCH", "") not in ("", "0")
    low, high = CHECKED
    if not low <= torch_version(version) <= high and not allow_unchecked:
        raise UnsupportedTorch(
            f"gpukit reads PyTorch internals that were checked on torch {low[0]}.{low[1]} to {high[0]}.{high[1]}; "
            f"this is torch {version or torch.__version__}. Install a torch in that range (pip install "
            f"'torch>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}'), or set GPUKIT_UNCHECKED_TORCH=1 to try "
            "anyway: its figures are then unverified.")


def _require(owner, name: str, where: str):
    value = getattr(owner, name, None)
    if value is None:
        raise UnsupportedTorch(f"torch {torch.__version__} has no {where}.{name}, which gpukit needs; "
                               f"gpukit was checked on torch {CHECKED[0][0]}.{CHECKED[0][1]} to "
                               f"{CHECKED[1][0]}.{CHECKED[1][1]}")
    return value


check_version()

# --- the dispatcher: counting modes, fake tensors, pytrees ------------------------------------------------
try:
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _ModState
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, is_traceable_wrapper_subclass
    from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten
except ImportError as err:  # a module moved or a name went away
    raise UnsupportedTorch(f"torch {torch.__version__}: {err}; gpukit was checked on torch "
                           f"{CHECKED[0][0]}.{CHECKED[0][1]} to {CHECKED[1][0]}.{CHECKED[1][1]}") from err

# The default __torch_dispatch__ of tensor subclasses that do not dispatch (nn.Parameter and the like).
disabled_torch_dispatch_impl = _require(torch._C, "_disabled_torch_dispatch_impl", "torch._C")
_current_graph_task_id = _require(torch._C, "_current_graph_task_id", "torch._C")
# The autograd node running on this thread (None outside backward): CUDA backward runs on the engine's
# device threads, each with its own cuBLAS handle and workspace (gpukit.cudarules).
current_autograd_node = _require(torch._C, "_current_autograd_node", "torch._C")


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread (a graph task is current)."""
    return _current_graph_task_id() != -1


# MemTracker's hooks that gpukit's role tracker (gpukit.roles) overrides or calls: their signatures are part
# of what was checked.
for _name, _params in (("_pre_fw_hook", ("self", "module", "inputs")), ("_update_peak_stats", ("self", "peak_state")),
                       ("_track", ("self", "reftype", "t")), ("reset_mod_stats", ("self",))):
    _found = tuple(inspect.signature(_require(MemTracker, _name, "MemTracker")).parameters)
    if _found != _params:
        raise UnsupportedTorch(f"torch {torch.__version__}: MemTracker.{_name}{_found} is not the "
                               f"MemTracker.{_name}{_params} gpukit was checked with")
del _name, _params, _found


# --- a GradScaler for fake tensors -------------------------------------------------------------------------
_require(torch.amp.GradScaler, "_maybe_opt_step", "torch.amp.GradScaler")


class ScalerThatAlwaysSteps(torch.amp.GradScaler):
    """A GradScaler for fake tensors: the real one reads ``found_inf`` (``.item()``) to skip the optimizer step
    after an overflow (torch/amp/grad_scaler.py ``_maybe_opt_step``), which a fake tensor cannot answer; the
    memory of a training step is that of the step taken, so this one always takes it."""

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)


# --- storages that grow in place ---------------------------------------------------------------------------
# UntypedStorage.resize_ changes a storage's size without passing through the dispatcher (FSDP frees and
# regrows its parameters' storages with it), so the counter wraps it while a measured block is open.
def storage_resize():
    """The ``torch.UntypedStorage.resize_`` in place now (the original, or a wrapper installed here)."""
    return torch.UntypedStorage.resize_


def set_storage_resize(function) -> None:
    """Install ``function`` as ``torch.UntypedStorage.resize_`` (put the original back with it too)."""
    torch.UntypedStorage.resize_ = function


__all__ = ["CHECKED", "UnsupportedTorch", "torch_version", "check_version", "DataDependentOutputException",
           "FakeTensor", "FakeTensorMode", "MemTracker", "_TOTAL_KEY", "_MemRefType", "_ModState",
           "TorchDispatchMode", "_disable_current_modes", "is_traceable_wrapper_subclass", "tree_flatten",
           "tree_map_only", "tree_unflatten", "disabled_torch_dispatch_impl", "in_backward", "current_autograd_node", "storage_resize",
           "set_storage_resize", "ScalerThatAlwaysSteps"]
