"""Every private PyTorch name gpukit uses, in one place, checked against the torch it runs with.

gpukit counts memory from inside PyTorch's dispatcher, predicts with fake tensors and tags memory by role
with MemTracker: none of that has a public API. This module is the only one that imports a private name
(``torch._C``, ``torch._subclasses``, ``torch.utils._python_dispatch``, ``torch.utils._pytree``,
``torch.distributed._tools``) or patches torch (``UntypedStorage.resize_``). Each was read in the source of
the versions in ``CHECKED`` and the unit tests pass on them (CONTRIBUTING.md, "Which torch"). On a torch outside that
range gpukit refuses to start with an error that says so, rather than give a wrong number; set
``GPUKIT_UNCHECKED_TORCH=1`` to try anyway. A name that has gone or changed shape raises
``UnsupportedTorch`` naming it, at import (MemTracker's and ModTracker's, which take 1.5 s to import, when
gpukit first tags memory by role), not a wrong figure later.
"""

from __future__ import annotations

import collections
import inspect
import os
import threading
from functools import partial
from typing import Any

import torch
from torch import library as _operator_registration

CHECKED = ((2, 10), (2, 15))   # the oldest and newest minor versions the suite passed on (both included)


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
    from torch.utils._python_dispatch import (TorchDispatchMode, _disable_current_modes,
                                              _get_current_dispatch_mode_stack, is_traceable_wrapper_subclass)
    from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_map_only, tree_unflatten
except ImportError as err:  # a module moved or a name went away
    raise UnsupportedTorch(f"torch {torch.__version__}: {err}; gpukit was checked on torch "
                           f"{CHECKED[0][0]}.{CHECKED[0][1]} to {CHECKED[1][0]}.{CHECKED[1][1]}") from err

# The default __torch_dispatch__ of tensor subclasses that do not dispatch (nn.Parameter and the like).
disabled_torch_dispatch_impl = _require(torch._C, "_disabled_torch_dispatch_impl", "torch._C")
_current_graph_task_id = _require(torch._C, "_current_graph_task_id", "torch._C")
# The autograd node running on this thread (None outside backward): CUDA backward runs on the engine's
# device threads, each with its own cuBLAS handle and workspace (gpukit.cudarules).
current_autograd_node = _require(torch._C, "_current_autograd_node", "torch._C")
# FakeTensorMode is entered into a slot of the dispatcher's own (its ``_mode_key``, torch/_subclasses/fake_tensor.py),
# read here to find the mode a factory is called under, whatever modes sit above it.
_get_dispatch_mode = _require(torch._C, "_get_dispatch_mode", "torch._C")
_FAKE_MODE_KEY = _require(_require(torch._C, "_TorchDispatchModeKey", "torch._C"), "FAKE",
                          "torch._C._TorchDispatchModeKey")


def active_fake_mode() -> FakeTensorMode | None:
    """The ``FakeTensorMode`` this thread runs under, or None."""
    return _get_dispatch_mode(_FAKE_MODE_KEY)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread (a graph task is current)."""
    return _current_graph_task_id() != -1


def _load_trackers() -> None:
    """Import MemTracker and ModTracker (torch.distributed._tools, which imports DTensor and dynamo: about
    1.5 s), check the names gpukit relies on, and define the trackers below; on first use of one of them.

    Raises:
        UnsupportedTorch: a name that has gone or changed shape.
    """
    global _TOTAL_KEY, MemTracker, _MemRefType, _ModState, ModTracker, _mod_tracker_module
    global _registering, _register_multi_grad_hook, ModTrackerThatLetsGo, MemTrackerThatLetsGo, StepTracker
    try:
        from torch.distributed._tools import mod_tracker as _mod_tracker_module
        from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _ModState
        from torch.distributed._tools.mod_tracker import ModTracker
    except ImportError as err:
        raise UnsupportedTorch(f"torch {torch.__version__}: {err}; gpukit was checked on torch "
                               f"{CHECKED[0][0]}.{CHECKED[0][1]} to {CHECKED[1][0]}.{CHECKED[1][1]}") from err

    # MemTracker's and ModTracker's methods that the trackers below override or call, and the module global that
    # ModTracker registers its autograd hooks through: their signatures are part of what was checked.
    for _owner, _name, _params in (
            (MemTracker, "_pre_fw_hook", ("self", "module", "inputs")),
            (MemTracker, "_update_peak_stats", ("self", "peak_state")),
            (MemTracker, "_track", ("self", "reftype", "t")),
            (MemTracker, "reset_mod_stats", ("self",)),
            (ModTracker, "_fw_pre_hook", ("self", "mod", "input")),
            (ModTracker, "_fw_post_hook", ("self", "mod", "input", "output")),
            (_mod_tracker_module, "register_multi_grad_hook", ("tensors", "fn", "mode"))):
        _found = tuple(inspect.signature(_require(_owner, _name, _owner.__name__)).parameters)
        if _found != _params:
            raise UnsupportedTorch(f"torch {torch.__version__}: {_owner.__name__}.{_name}{_found} is not the "
                                   f"{_owner.__name__}.{_name}{_params} gpukit was checked with")
    del _owner, _name, _params, _found

    # --- module trackers that let go of what they tracked --------------------------------------------------------
    # ModTracker (torch/distributed/_tools/mod_tracker.py) registers an autograd hook on every module's inputs in
    # its forward pre-hook, to see the module's backward end, and drops the handle. In register_multi_grad_hook's
    # "all" mode (torch/autograd/graph.py) the hook's closure keeps the inputs' grad_fns, and the hook is stored
    # on those same grad_fns: a cycle through C++ that Python's garbage collector cannot see. The graph node of
    # every module input (a hidden layer's activation) then outlives the step, and with it every tensor the node
    # reaches: the parameters and gradients of the layers before it, run after run. The trackers below keep the
    # handles of the hooks they register and remove them all on exit, which breaks the cycle.
    _registering = threading.local()
    _register_multi_grad_hook = _mod_tracker_module.register_multi_grad_hook

    def _register_multi_grad_hook_kept(tensors, fn, *, mode="all"):
        handle = _register_multi_grad_hook(tensors, fn, mode=mode)
        kept = getattr(_registering, "kept", None)
        if kept is not None:
            kept.append(handle)
        return handle

    # Only ModTracker's module reads this name; its hooks keep the handle only on the thread of a tracker below.
    _mod_tracker_module.register_multi_grad_hook = _register_multi_grad_hook_kept

    class ModTrackerThatLetsGo(ModTracker):
        """PyTorch's ModTracker, whose autograd hooks (and the graph nodes they hold) go when it exits."""

        def __init__(self) -> None:
            super().__init__()
            self._hook_handles: list = []

        def _keeping(self, hook, *args) -> None:
            outer = getattr(_registering, "kept", None)
            _registering.kept = self._hook_handles
            try:
                hook(*args)
            finally:
                _registering.kept = outer

        def _fw_pre_hook(self, mod, input):
            self._keeping(super()._fw_pre_hook, mod, input)

        def _fw_post_hook(self, mod, input, output):
            self._keeping(super()._fw_post_hook, mod, input, output)

        def __exit__(self, *args):
            try:
                return super().__exit__(*args)
            finally:
                self.remove_hooks()

        def remove_hooks(self) -> None:
            handles, self._hook_handles[:] = list(self._hook_handles), []
            for handle in handles:
                handle.remove()

    class _NoHook:
        def remove(self) -> None:
            pass

    class MemTrackerThatLetsGo(MemTracker):
        """PyTorch's MemTracker with a ModTracker that lets go (above), and that tracks frozen parameters and
        parameters stepped in backward.

        MemTracker registers gradient hooks on every parameter of a module it enters
        (``_track_module_params_and_buffers``); ``register_hook`` raises on a parameter that does not require a
        gradient, the base weights of a LoRA model say. Such a parameter is marked as hooked already (with
        handles that remove nothing), so it is still counted as a parameter and gets no gradient hook.
        """

        def __init__(self) -> None:
            super().__init__()
            self._mod_tracker = ModTrackerThatLetsGo()

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            for param in module.parameters():
                if not param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _update_and_maybe_create_winfos(self, t, reftype, update_existing: bool = False):
            # A gradient hook of its own that runs after one which stepped the parameter and freed its
            # gradient (the optimizer step in backward, gpukit.bigmodel) is handed None: nothing to track.
            if t is None:
                return set()
            return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

    class StepTracker(MemTrackerThatLetsGo):
        """MemTracker that accepts the model being run several times in one block (gpukit.roles).

        MemTracker refuses a second forward of the root module (it keeps per-module
        statistics for one iteration); gradient accumulation does exactly that. gpukit
        reads only the totals by role, so the per-module statistics are reset instead.
        """

        def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)
            stats = self.memory_tracking.get(module)
            if stats is not None:
                by_fqn = self.__dict__.setdefault("_stats_by_fqn", {})
                entries = by_fqn.setdefault(stats.mod_fqn, [])
                if all(s is not stats for s in entries):
                    entries.append(stats)

        # Set by predictions, whose steps hold no DTensor and no nested fake mode: after every op MemTracker
        # then needs neither its search for the active fake mode nor a pytree walk of the outputs (a third of
        # a 6.7-billion-parameter GPT's prediction went there).
        plain_tensors_only = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.plain_tensors_only or not hasattr(self, "_fake_mode_on_entry"):
                return super().__torch_dispatch__(func, types, args, kwargs)
            res = func(*args, **(kwargs or {}))
            if self._in_opt:
                reftype = _MemRefType.OPT
            elif self._mod_tracker.is_bw and not self._in_ac:
                reftype = _MemRefType.TEMP
            else:
                reftype = _MemRefType.ACT
            if isinstance(res, torch.Tensor):
                self._track(reftype, res)
            elif isinstance(res, (tuple, list)):
                for r in res:
                    if isinstance(r, torch.Tensor):
                        self._track(reftype, r)
                    elif isinstance(r, (tuple, list)):
                        tree_map_only(torch.Tensor, partial(self._track, reftype), r)
            self._update_peak_stats(_ModState.PEAK_BW if self._mod_tracker.is_bw else _ModState.PEAK_FW)
            return res

        def reset_mod_stats(self) -> None:
            super().reset_mod_stats()
            self._stats_by_fqn = {}

        def _update_peak_stats(self, peak_state) -> None:
            """MemTracker's own update, visiting only the modules now running.

            MemTracker walks the statistics of every module it has seen after every op, which
            made a 6.7-billion-parameter GPT's prediction spend 28 of its 42 s here; only the
            modules in ``parents`` can change, so the result is the same. A snapshot maps names
            to integers, so a dict copy is the deep copy MemTracker makes.
            """
            curr_snap = self._curr_mem_snap
            by_fqn = self.__dict__.get("_stats_by_fqn", {})
            for fqn in self._mod_tracker.parents:
                for mod_stats in by_fqn.get(fqn, ()):
                    if peak_state in mod_stats.snapshots:
                        for dev, dev_snap in curr_snap.items():
                            if mod_stats.local_peak.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                                mod_stats.local_peak[dev] = dev_snap[_TOTAL_KEY]
                                mod_stats.snapshots[peak_state][-1][dev] = dict(dev_snap)
            for dev, dev_snap in curr_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(dev_snap)


_TRACKERS = ("MemTracker", "ModTracker", "ModTrackerThatLetsGo", "MemTrackerThatLetsGo", "StepTracker")
_tracker_lock = threading.Lock()


def __getattr__(name: str):
    """The trackers are loaded when first asked for (``from gpukit._torch import StepTracker``)."""
    if name in _TRACKERS:
        with _tracker_lock:
            if name not in globals():
                _load_trackers()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- a GradScaler for fake tensors -------------------------------------------------------------------------
_require(torch.amp.GradScaler, "_maybe_opt_step", "torch.amp.GradScaler")


class ScalerThatAlwaysSteps(torch.amp.GradScaler):
    """A GradScaler for fake tensors: the real one reads ``found_inf`` (``.item()``) to skip the optimizer step
    after an overflow (torch/amp/grad_scaler.py ``_maybe_opt_step``), which a fake tensor cannot answer; the
    memory of a training step is that of the step taken, so this one always takes it."""

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)


# --- the user's own GradScaler under a prediction (gpukit.amp) ------------------------------------------------
# torch/amp/grad_scaler.py: an enabled scaler keeps ``_scale`` (float32) and ``_growth_tracker`` (int32),
# 0-dimensional tensors made on the loss's device by the first ``scale()`` (``_lazy_init_scale_growth_tracker``), and
# per optimizer a ``found_inf`` per device in ``_per_optimizer_states`` (a defaultdict of
# ``_refresh_per_optimizer_state``) from its ``unscale_`` to the next ``update()``. A disabled one (``enabled=False``,
# or ``GradScaler("cuda")`` made where ``torch.cuda.amp.common.amp_definitely_not_available()``) keeps only
# ``_device`` and ``_enabled``. The attributes a new enabled scaler has are checked here, on one made on the CPU.
_grad_scaler_module = _require(torch.amp, "grad_scaler", "torch.amp")
_refresh_per_optimizer_state = _require(_grad_scaler_module, "_refresh_per_optimizer_state", "torch.amp.grad_scaler")
_SCALER_ATTRIBUTES = {"_device", "_enabled", "_init_scale", "_scale", "_growth_factor", "_backoff_factor",
                      "_growth_interval", "_init_growth_tracker", "_growth_tracker", "_per_optimizer_states"}
if not _SCALER_ATTRIBUTES <= set(vars(torch.amp.GradScaler("cpu"))):
    raise UnsupportedTorch(f"torch {torch.__version__}: torch.amp.GradScaler keeps other attributes than the "
                           f"{sorted(_SCALER_ATTRIBUTES)} gpukit was checked with")
_SCALER_DEFAULTS = {name: p.default for name, p in inspect.signature(torch.amp.GradScaler.__init__).parameters.items()
                    if name in ("init_scale", "growth_factor", "backoff_factor", "growth_interval")}


def scaler_state(scaler: torch.amp.GradScaler) -> dict:
    """What ``restore_scaler`` needs to put ``scaler`` back as it is now: its attributes, and each optimizer's
    stage and found_inf tensors (which ``step()`` changes in place)."""
    state = dict(vars(scaler))
    per_optimizer = state.get("_per_optimizer_states")
    if per_optimizer is not None:
        copied = type(per_optimizer)(per_optimizer.default_factory) if hasattr(per_optimizer, "default_factory") \
            else type(per_optimizer)()
        copied.update({k: {**v, "found_inf_per_device": dict(v.get("found_inf_per_device", {}))}
                       for k, v in per_optimizer.items()})
        state["_per_optimizer_states"] = copied
    return state


def restore_scaler(scaler: torch.amp.GradScaler, state: dict) -> None:
    """Put ``scaler`` back as ``scaler_state`` found it (attributes added since are removed)."""
    vars(scaler).clear()
    vars(scaler).update(state)
    per_optimizer = state.get("_per_optimizer_states")
    if per_optimizer is not None:  # a copy again: the state kept can restore more than once
        scaler._per_optimizer_states = scaler_state(scaler)["_per_optimizer_states"]


def scaler_enabled(scaler: torch.amp.GradScaler) -> bool:
    return bool(getattr(scaler, "_enabled", False))


def scaler_device(scaler: torch.amp.GradScaler) -> str:
    """The device type the scaler was made for (``GradScaler("cuda")``: "cuda")."""
    return str(getattr(scaler, "_device", "cuda"))


def start_scaler_afresh(scaler: torch.amp.GradScaler, enable: bool = False) -> None:
    """Make ``scaler`` as a new one is before its first ``scale()``: no scale tensor yet (the next ``scale()`` makes
    it on the loss's device, fake in a prediction), no optimizer's found_inf. ``enable``: a disabled scaler is
    enabled with ``GradScaler``'s default settings."""
    if enable and not scaler_enabled(scaler):
        d = _SCALER_DEFAULTS
        scaler._enabled = True
        scaler._init_scale, scaler._growth_factor = d["init_scale"], d["growth_factor"]
        scaler._backoff_factor, scaler._growth_interval = d["backoff_factor"], d["growth_interval"]
        scaler._init_growth_tracker = 0
    if scaler_enabled(scaler):
        scaler._scale = None
        scaler._growth_tracker = None
        scaler._per_optimizer_states = collections.defaultdict(_refresh_per_optimizer_state)


def scaler_tensors(scaler: torch.amp.GradScaler) -> list[torch.Tensor]:
    """The tensors ``scaler`` keeps from one step to the next: its scale, its growth tracker, and any found_inf not
    yet consumed by ``update()``."""
    kept = [t for t in (getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None))
            if isinstance(t, torch.Tensor)]
    for state in (getattr(scaler, "_per_optimizer_states", None) or {}).values():
        kept += [t for t in state.get("found_inf_per_device", {}).values() if isinstance(t, torch.Tensor)]
    return kept


def scaler_init_scale(scaler: torch.amp.GradScaler) -> float:
    return float(getattr(scaler, "_init_scale", _SCALER_DEFAULTS["init_scale"]))


def scaler_step_rule():
    """``GradScaler._maybe_opt_step`` in place now: the step after ``unscale_``, taken unless a found_inf reads
    non-zero (``.item()``)."""
    return torch.amp.GradScaler._maybe_opt_step


def set_scaler_step_rule(function) -> None:
    """Install ``function`` as ``GradScaler._maybe_opt_step`` (put the original back with it too)."""
    torch.amp.GradScaler._maybe_opt_step = function


def autocast_enabled(region: torch.autocast) -> bool:
    """Whether a ``torch.autocast`` object casts when entered (torch/amp/autocast_mode.py keeps it in ``_enabled``,
    set False in ``__init__`` where the device cannot autocast)."""
    return bool(getattr(region, "_enabled", False))


# --- autocast's kernels (gpukit.cuda_autocast) --------------------------------------------------------------
_registrations_for = _require(torch._C, "_dispatch_get_registrations_for_dispatch_key", "torch._C")
_ExcludeDispatchKeyGuard = _require(torch._C, "_ExcludeDispatchKeyGuard", "torch._C")
_AUTOCAST_CPU = torch._C.DispatchKeySet(_require(torch._C.DispatchKey, "AutocastCPU", "torch._C.DispatchKey"))


def ops_with_kernel_for(key: str) -> set[str]:
    """The ops (``aten::softmax.int``) holding a kernel of their own for dispatch key ``key`` ("AutocastCPU",
    "AutocastCUDA"); the others fall through it."""
    return set(_registrations_for(key))


def kernel_registry():
    """A registry of kernels for ATen's existing ops (PyTorch's operator registration API, ``Library("aten",
    "IMPL")``); ``drop_kernels`` removes what it registered."""
    return _operator_registration.Library("aten", "IMPL")


# The kernel that passes an op on to the next dispatch key, as a key without a kernel of its own does.
FALLTHROUGH_KERNEL = _operator_registration.fallthrough_kernel


def drop_kernels(registry) -> None:
    """Remove every kernel ``registry`` registered (``Library._destroy``): the dispatcher's earlier ones are in place
    again."""
    registry._destroy()


def is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` views another tensor's storage (``Tensor._is_view``)."""
    return t._is_view()


def below_cpu_autocast():
    """A guard under which ops skip CPU autocast's kernels, as an autocast wrapper runs its op
    (aten/src/ATen/autocast_mode.h: ``ExcludeDispatchKeyGuard no_autocast``)."""
    return _ExcludeDispatchKeyGuard(_AUTOCAST_CPU)


# --- storages that grow in place ---------------------------------------------------------------------------
# UntypedStorage.resize_ changes a storage's size without passing through the dispatcher (FSDP frees and
# regrows its parameters' storages with it), so the counter wraps it while a measured block is open.
def storage_resize():
    """The ``torch.UntypedStorage.resize_`` in place now (the original, or a wrapper installed here)."""
    return torch.UntypedStorage.resize_


def set_storage_resize(function) -> None:
    """Install ``function`` as ``torch.UntypedStorage.resize_`` (put the original back with it too)."""
    torch.UntypedStorage.resize_ = function


# --- calling an op from a dispatch mode -----------------------------------------------------------------------
# ``OpOverload.__call__`` (torch/_ops.py) is a Python frame that only forwards to the op's C++ entry point, its
# ``_op``: ``return self._op(*args, **kwargs)``. The counting mode runs every op of a measured block, and calls
# that entry point itself where the frame does nothing else (checked here against the torch in use, from the
# method's bytecode); a torch whose ``__call__`` does more, and any other kind of op, is called as itself.
def _forwarding_call(self, /, *args, **kwargs):
    return self._op(*args, **kwargs)


try:
    from torch._ops import OpOverload as _OpOverload

    _OP_CALL_ONLY_FORWARDS = (_OpOverload.__call__.__code__.co_code == _forwarding_call.__code__.co_code
                              and _OpOverload.__call__.__code__.co_names == _forwarding_call.__code__.co_names)
except (ImportError, AttributeError):  # no such class or method: every op is called as itself
    _OpOverload, _OP_CALL_ONLY_FORWARDS = None, False


def op_entry_point(func):
    """What runs ``func(*args, **kwargs)``, with the same result and effects: the op's C++ entry point for a
    plain ``OpOverload`` whose ``__call__`` only forwards to it, else ``func`` itself."""
    if _OP_CALL_ONLY_FORWARDS and type(func) is _OpOverload:
        entry = getattr(func, "_op", None)
        if callable(entry):
            return entry
    return func


# --- torch.compile (dynamo) and the counting mode ------------------------------------------------------------
# TorchDispatchMode.__init_subclass__ (torch/utils/_python_dispatch.py) wraps a mode's __torch_dispatch__ in
# torch._disable_dynamo, so that dynamo never traces it: two wrapper frames (torch/_compile.py ``inner``,
# torch/_dynamo/eval_frame.py ``_fn``) on every op, and in the traceback of every error the mode raises. A mode
# that opts out (``_should_skip_dynamo``; a torch without that hook has no wrapper to opt out of) instead marks
# its code here as dynamo's ``torch._dynamo.disable`` would without a wrapper: a frame of that code, and every
# frame it calls, runs without dynamo (FrameAction.SKIP for the frame and recursively; torch/_dynamo/types.py,
# torch/csrc/dynamo/eval_frame_cpp.cpp).
try:
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
except ImportError as err:
    raise UnsupportedTorch(f"torch {torch.__version__}: {err}; gpukit was checked on torch "
                           f"{CHECKED[0][0]}.{CHECKED[0][1]} to {CHECKED[1][0]}.{CHECKED[1][1]}") from err


def never_traced(code) -> None:
    """Make dynamo run frames of ``code``, and all they call, as plain Python (no wrapper frame)."""
    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))


def dynamo_code_in_question(depth: int):
    """The code whose frame dynamo is deciding whether to trace, read from the frame ``depth`` levels up: a
    ``CatchErrorsWrapper.__call__(self, frame, ...)`` (torch/_dynamo/convert_frame.py); None elsewhere."""
    import sys

    try:
        return sys._getframe(depth + 1).f_locals["frame"].f_code
    except (KeyError, AttributeError, ValueError):
        return None


def let_dynamo_trace_again(code) -> None:
    """Undo the skip dynamo files on ``code`` when it declines a frame (a ``ConvertFrameReturn`` defaults to
    FrameExecStrategy(SKIP, DEFAULT) with ``apply_to_code``, torch/_dynamo/types.py): every later call of that
    code, in any module, runs eagerly until ``torch._dynamo.reset()``. DEFAULT is what such a code had, since
    dynamo's callback never sees code with another strategy (torch/csrc/dynamo/eval_frame_cpp.cpp)."""
    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.DEFAULT, _FrameAction.DEFAULT))


_python_dispatch = torch.utils._python_dispatch  # (imported above; a counting mode's last block asks it on exit)


def reset_dispatch_mode_flags() -> None:
    """Set torch 2.10's process-wide "a dispatch mode is on" flags from this thread's mode stack.

    In torch 2.10 dynamo skips every frame while ``_is_in_any_mode_without_ignore_compile_internals`` is set
    (``should_skip_due_to_torch_dispatch_mode``, torch/_dynamo/convert_frame.py): a flag of the process, set by
    ``TorchDispatchMode.__enter__`` and put back by ``__exit__`` to what that mode saw on entering
    (torch/utils/_python_dispatch.py). Counting modes entered and left on several threads in overlapping order,
    or left pushed on a thread that ended, leave it set, and every later ``torch.compile`` in the process runs
    eagerly without a word. From torch 2.11 dynamo asks the thread's own stack instead
    (``any_torch_dispatch_mode_on_stack``), and this does nothing. Called once no counting mode is left on any
    thread."""
    dispatch = _python_dispatch
    if hasattr(dispatch, "any_torch_dispatch_mode_on_stack"):
        return
    stack = dispatch._get_current_dispatch_mode_stack()
    compile_blocked = any(not m.ignore_compile_internals() for m in stack)
    dispatch._is_in_torch_dispatch_mode = bool(stack)
    dispatch._is_in_non_infra_torch_dispatch_mode = any(not m.is_infra_mode() for m in stack)
    dispatch._is_in_any_mode_without_ignore_compile_internals = compile_blocked
    dispatch.set_is_in_mode_without_ignore_compile_internals(compile_blocked)


__all__ = ["CHECKED", "UnsupportedTorch", "torch_version", "check_version", "DataDependentOutputException",
           "FakeTensor", "FakeTensorMode", "MemTracker", "MemTrackerThatLetsGo", "ModTrackerThatLetsGo", "StepTracker", "_TOTAL_KEY", "_MemRefType", "_ModState",
           "TorchDispatchMode", "_disable_current_modes", "_get_current_dispatch_mode_stack",
           "is_traceable_wrapper_subclass", "tree_flatten",
           "tree_map_only", "tree_unflatten", "SUPPORTED_NODES", "disabled_torch_dispatch_impl", "in_backward", "current_autograd_node", "storage_resize",
           "set_storage_resize", "ScalerThatAlwaysSteps", "scaler_state", "restore_scaler", "scaler_enabled",
           "scaler_device", "start_scaler_afresh", "scaler_tensors", "scaler_init_scale", "autocast_enabled",
           "scaler_step_rule", "set_scaler_step_rule",
           "never_traced",
           "dynamo_code_in_question", "let_dynamo_trace_again", "active_fake_mode", "reset_dispatch_mode_flags",
           "ops_with_kernel_for", "below_cpu_autocast", "kernel_registry", "FALLTHROUGH_KERNEL", "drop_kernels",
           "is_view"]
