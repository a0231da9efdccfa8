"""The optimizer state a CUDA run keeps in host memory, not on the GPU: the step counters of torch.optim's
built-in optimizers.

``_init_group`` makes each parameter's ``state["step"]`` with ``torch.tensor(0.0, dtype=_get_scalar_dtype())``,
on the CPU, unless the group is capturable or fused ("Deliberately host `step` on CPU if both capturable and fused
are off. This is because kernel launches are costly on CUDA and XLA": torch/optim/adam.py, which AdamW inherits;
adamax.py, adadelta.py, nadam.py (its ``mu_product`` too), radam.py, rmsprop.py and rprop.py alike; adagrad.py
unless fused; _adafactor.py always). ASGD keeps its counters on the parameter's device (asgd.py), and SGD has none.

A prediction for CUDA runs on fake CPU tensors that stand for the GPU, so these counters would count as GPU
memory there: 512 B a parameter, which the CUDA allocator never sees (18 of them on the deep MLP that an H100
measured). ``host_state_tensors`` names them. While the CUDA rules apply (``cuda_rules_apply``), the optimizer
step that makes them hands them to the host (``host_steps_hook``: out of the fake counter's books and the
simulated card), and the state a step starts with leaves out what the counter holds as the host's
(``gpu_state_only``). The step that makes them still counts them until its end (a prediction's warm-up step,
as a rule).
"""

from __future__ import annotations

import threading
import weakref

import torch

from .counter import FAKE_LEDGER

# optimizer class -> the keys of its per-parameter state it makes on the CPU unless capturable or fused
_HOSTED = {"Adam": ("step",), "AdamW": ("step",), "Adamax": ("step",), "Adadelta": ("step",), "Adagrad": ("step",),
           "NAdam": ("step", "mu_product"), "RAdam": ("step",), "RMSprop": ("step",), "Rprop": ("step",),
           "Adafactor": ("step",)}


def _hosted_keys(optimizer) -> tuple[str, ...]:
    # (AdamW is an Adam in torch 2.13, and its own class with the same _init_group before; a user's subclass keeps
    # its parent's _init_group)
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim") and cls.__name__ in _HOSTED:
            return _HOSTED[cls.__name__]
    return ()


# optimizer -> ids of its groups made capturable by the user, run with capturable off (``run_capturable_off``)
_CAPTURABLE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _inner(optimizer) -> list | None:
    """The per-parameter optimizers of a ``gpukit.OptimizerInBackward`` (None for any other optimizer)."""
    inner = getattr(optimizer, "optimizers", None)
    return list(inner.values()) if isinstance(inner, dict) else None


def run_capturable_off(optimizer) -> bool:
    """Turn ``capturable`` off in the groups of a built-in optimizer that have it on, noting them; returns whether
    any had. A capturable step runs only with its tensors on a GPU (``_get_capturable_supported_devices``:
    torch/optim/adam.py asserts it), and a prediction's fake CPU tensors stand for the GPU: the group runs the
    step without it, and its step counters stay on the GPU, as capturable keeps them (``host_state_tensors``).
    What capturable's step makes besides (its bias corrections as GPU tensors) is not counted: say so."""
    groups = [g for g in getattr(optimizer, "param_groups", ()) if g.get("capturable")]
    if not groups or not _hosted_keys(optimizer):
        return False
    for g in groups:
        g["capturable"] = False
    _CAPTURABLE.setdefault(optimizer, set()).update(id(g) for g in groups)
    return True


def ran_capturable_off(optimizer) -> bool:
    """Whether ``run_capturable_off`` turned capturable off in any group of ``optimizer`` (or of its inner ones)."""
    inner = _inner(optimizer)
    if inner is not None:
        return any(ran_capturable_off(opt) for opt in inner)
    return bool(_CAPTURABLE.get(optimizer))


def host_state_tensors(optimizer) -> list[torch.Tensor]:
    """The state tensors of ``optimizer`` that a CUDA run keeps on the host: the step counters (0-dim) of a
    built-in torch.optim optimizer, in groups neither capturable nor fused; those of each inner optimizer of a
    ``gpukit.OptimizerInBackward``. Empty for any other optimizer."""
    inner = _inner(optimizer)
    if inner is not None:
        return [t for opt in inner for t in host_state_tensors(opt)]
    keys = _hosted_keys(optimizer)
    if not keys:
        return []
    found, on_gpu = [], _CAPTURABLE.get(optimizer, ())
    for group in optimizer.param_groups:
        if group.get("capturable") or group.get("fused") or id(group) in on_gpu:
            continue
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            found += [state[k] for k in keys if isinstance(state.get(k), torch.Tensor) and state[k].dim() == 0]
    return found


_THREAD = threading.local()  # .rules: CUDA rules open on this thread with every fake tensor the GPU's


def cuda_rules_apply() -> bool:
    """Whether this thread predicts for CUDA with fake CPU tensors standing for the GPU (a ``CudaRules`` of every
    tensor is open on it: ``host_steps_hook``), so that a host tensor among them is not the GPU's."""
    return getattr(_THREAD, "rules", 0) > 0


def gpu_state_only(tensors) -> list[torch.Tensor]:
    """``tensors`` less those whose storage the fake counter holds as host memory (``host_steps_hook`` handed
    them over when the optimizer step that made them ended)."""
    if not FAKE_LEDGER.host:
        return list(tensors)
    return [t for t in tensors if t.layout is not torch.strided or not FAKE_LEDGER.hosted(t.untyped_storage())]


class _Hosting:
    """What ``host_steps_hook`` returns: ``remove()`` takes the hook off and ends this thread's CUDA rules."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
            _THREAD.rules -= 1


def host_steps_hook() -> _Hosting:
    """For a ``CudaRules`` of every tensor, entered on this thread: register an optimizer step post hook that hands
    each optimizer's host state (``host_state_tensors``) to the host in the fake tensors' counter
    (``Ledger.to_host``) on the threads where such rules are open, and count this thread as one of them until
    ``remove()``."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def hook(optimizer, args, kwargs):
        if cuda_rules_apply():
            for t in host_state_tensors(optimizer):
                FAKE_LEDGER.to_host(t.untyped_storage())

    hosting = _Hosting(register_optimizer_step_post_hook(hook))
    _THREAD.rules = getattr(_THREAD, "rules", 0) + 1
    return hosting


__all__ = ["host_state_tensors", "cuda_rules_apply", "gpu_state_only", "host_steps_hook", "run_capturable_off",
           "ran_capturable_off"]
