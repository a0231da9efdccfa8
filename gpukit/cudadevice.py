"""CUDA as the user's code names it (``.cuda()``, ``.to("cuda")``, ``device="cuda"``), on the fake tensors of a
prediction for a card: each name goes to the device whose fake tensors stand for the card.

    def make_model():
        return MyNet().cuda()

    def make_batch():
        return x.to("cuda", non_blocking=True), y.cuda()

    predict(make_model, make_optimizer, make_batch, step, card="t4")   # a laptop's answer: the T4's figures

A CPU-only PyTorch refuses each of these ("PyTorch is not linked with support for cuda devices"; ``Tensor.to(0)``:
"Cannot access accelerator device when none is available"), before any op reaches a dispatch mode: the Python
methods set the device up first. Fake CUDA tensors would not do either: autograd aborts the process on the first
backward through one (gpukit.cudarules). So ``CudaDevices``, a torch-function mode (within ``gpukit.cudarules``, part
of the rules' one mode), sees each call before torch's C++ does and puts the stand-in in place of every CUDA device
it names, whatever its index (``"cuda:1"``, ``0``,
``torch.device("cuda", 0)``): the fake CPU tensors of ``predict(device="cuda")``, ``plan()`` and ``on_card()``;
``meta`` in ``predict_offload`` and ``on_card(gpu="meta")``, where the CPU is the host. Then:

* ``Tensor.cuda()`` and ``.to("cuda")`` of a tensor already on the stand-in return it, as torch returns a tensor
  already on the device asked for; ``copy=True`` still copies. On the card the batch a host made is copied once
  and the host's copy is not the card's memory; on the stand-in the tensor made is the one counted, once.
* A factory or module given ``device="cuda"`` (``torch.empty``, ``torch.arange``, ``nn.Linear(..., device=...)``,
  ``Tensor.new_zeros``) makes its tensor on the stand-in.
* ``Tensor.pin_memory()``: pinned host memory is the host's, never the card's. Where every fake tensor is the
  card's (the CPU stands for it), the tensor itself is returned, to be moved to the card by the next line; where
  the CPU is the host (``meta`` stands for the card), a host copy of it is made, as torch makes one.
  ``pin_memory=True`` to a factory (a CPU-only PyTorch has no pinned allocator) makes plain memory of the same size.

What torch answers about the machine is left alone: ``torch.cuda.is_available()`` stays False where there is no GPU
(code that picks its device by it picks the CPU, and a prediction for a card needs nothing more), and the tensors
report the stand-in's device (``x.device.type``).

A prediction for the CPU (``predict()``'s default) on a machine without CUDA uses ``CudaDevices(None)``: the first
CUDA device named raises a RuntimeError that says to predict for a card (``device="cuda"`` or ``card=``), where torch
would say that it has no CUDA.

``torch.cuda``'s own calls in such a step are ``CudaCalls``'s, on a machine without CUDA: ``synchronize()`` does
nothing, ``empty_cache()`` is counted and named (``emptied_cache``), a read of the card's memory raises an error that
says where the prediction's figures are.
"""

from __future__ import annotations

import functools
import threading

import torch
from torch.overrides import TorchFunctionMode

from .counter import INTERRUPTS

__all__ = ["CudaCalls", "CudaDevices", "DEVICE_METHODS", "emptied_cache", "names_cuda"]

_TO = torch.Tensor.to
_CUDA = torch.Tensor.cuda
_PIN = torch.Tensor.pin_memory
# The methods that name a device without a keyword (a call with ``device=`` or ``pin_memory=`` may name one too)
DEVICE_METHODS = frozenset({_TO, _CUDA, _PIN})


def names_cuda(device) -> bool:
    """Whether ``device`` names a CUDA device: ``"cuda"``, ``"cuda:N"``, a ``torch.device`` of type cuda, or a bare
    index (torch takes an int as a CUDA device's)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0].strip() == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def _is_device(value) -> bool:
    return isinstance(value, (str, torch.device)) or (isinstance(value, int) and not isinstance(value, bool))


class CudaDevices(TorchFunctionMode):
    """While open on this thread, every CUDA device the code names is ``stand`` (module docstring).

    Args:
        stand: "cpu" or "meta", the device whose fake tensors stand for the card; None: a prediction for the CPU on
            a machine without CUDA, where a CUDA device named raises a RuntimeError that says what to do.
        what: the call being run, for that error ("predict()", "plan()"...).
    """

    def __init__(self, stand: str | None = "cpu", what: str = "predict()") -> None:
        super().__init__()
        if stand not in (None, "cpu", "meta"):
            raise ValueError(f"stand={stand!r}: 'cpu' or 'meta', the device whose fake tensors stand for the card, "
                             "or None")
        self.stand = None if stand is None else torch.device(stand)
        self.what = what

    def _stand_in(self, named, call: str) -> torch.device:
        if self.stand is None:
            raise RuntimeError(
                f"{self.what} for the CPU met {call} naming {named!r}: the step is written for a GPU, which this "
                "machine does not have. Predict it for one: device='cuda', or card='t4' (or another card's name: "
                "gpukit.cards), and the CUDA devices it names stand for that card")
        return self.stand

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in DEVICE_METHODS:
            return self._method(func, args, kwargs or {})
        if kwargs and ("device" in kwargs or "pin_memory" in kwargs):  # (most calls name neither: returned at once)
            kwargs = dict(kwargs)
            device = kwargs.get("device")
            if device is not None and _is_device(device) and names_cuda(device):
                kwargs["device"] = self._stand_in(device, f"{getattr(func, '__name__', 'a call')}(device=...)")
            if kwargs.get("pin_memory") and self.stand is not None:
                kwargs["pin_memory"] = False
            return func(*args, **kwargs)
        return func(*args, **(kwargs or {}))

    def _method(self, func, args, kwargs):
        """``Tensor.cuda``, ``Tensor.to`` and ``Tensor.pin_memory``."""
        tensor = args[0]
        if func is _CUDA:  # Tensor.cuda(device=None, non_blocking=False, memory_format=torch.preserve_format)
            named = args[1] if len(args) > 1 else kwargs.get("device")
            stand = self._stand_in("cuda" if named is None else named, "Tensor.cuda()")
            moved = {k: v for k, v in kwargs.items() if k in ("non_blocking", "memory_format")}
            if len(args) > 2:
                moved["non_blocking"] = args[2]
            return _TO(tensor, stand, **moved)
        if func is _PIN:
            if self.stand is None:
                return func(*args, **kwargs)
            if self.stand.type == "cpu" or tensor.device.type != "cpu":
                return tensor
            return tensor.clone()  # a host copy, as pinning makes one (meta stands for the card: the CPU is the host)
        # Tensor.to(device, dtype, ...), to(dtype), to(other), to(device=..., ...)
        if len(args) > 1 and _is_device(args[1]) and names_cuda(args[1]):
            args = (tensor, self._stand_in(args[1], "Tensor.to()"), *args[2:])
        device = kwargs.get("device")
        if device is not None and _is_device(device) and names_cuda(device):
            kwargs = {**kwargs, "device": self._stand_in(device, "Tensor.to()")}
        return func(*args, **kwargs)


# -- torch.cuda's own calls in a predicted step, on a machine without a GPU -------------------------------------------

_CALLS = threading.local()   # .stack: the CudaCalls blocks open on this thread, innermost last
_PATCH = threading.Lock()
_SAVED: dict = {}            # torch.cuda's functions replaced, while any CudaCalls block is open in the process
_OPEN = [0]
_READS = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
          "reset_peak_memory_stats", "memory_stats", "memory_summary", "mem_get_info")


class CudaCalls:
    """While open on this thread, on a machine without CUDA: ``torch.cuda``'s own calls in the step of a prediction
    for a card, which torch would refuse ("Torch not compiled with CUDA enabled"). ``synchronize()`` does nothing (the
    simulated card runs everything in order already); ``empty_cache()`` is counted in ``empty_cache_calls`` (the
    prediction runs without it, so its reserved memory may be above the card's, and it says so); a read of the
    card's memory (``memory_allocated()``, ``max_memory_allocated()``...) raises a RuntimeError that says where the
    prediction's figures are. Other threads, and every call outside the block, get torch's own functions."""

    def __init__(self) -> None:
        self.empty_cache_calls = 0

    def __enter__(self) -> "CudaCalls":
        INTERRUPTS.hold()  # Ctrl-C waits until torch.cuda is fully patched, or fully put back
        opened = False
        try:
            with _PATCH:
                if _OPEN[0] == 0:
                    for name in ("synchronize", "empty_cache", *_READS):
                        _SAVED[name] = getattr(torch.cuda, name)
                        setattr(torch.cuda, name, _wrapper(name))
                _OPEN[0] += 1
                opened = True
            _CALLS.__dict__.setdefault("stack", []).append(self)
            INTERRUPTS.deliver()  # one that came while opening: undo, then raise it
        except BaseException:
            try:
                self._close(opened)
            finally:
                INTERRUPTS.release()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        try:
            self._close(True)
        finally:
            INTERRUPTS.release()  # an interrupt held back while closing is raised here
        return False

    def _close(self, opened: bool) -> None:
        stack = getattr(_CALLS, "stack", [])
        if self in stack:
            stack.remove(self)
        if not opened:
            return
        with _PATCH:
            _OPEN[0] -= 1
            if _OPEN[0] == 0:
                for name, function in _SAVED.items():
                    setattr(torch.cuda, name, function)
                _SAVED.clear()


INTERRUPTS.protect(CudaCalls.__enter__, CudaCalls.__exit__, CudaCalls._close)


def _wrapper(name: str):
    original = _SAVED[name]

    @functools.wraps(original)
    def call(*args, **kwargs):
        stack = getattr(_CALLS, "stack", None)
        if not stack:
            return original(*args, **kwargs)
        if name == "synchronize":
            return None
        if name == "empty_cache":
            stack[-1].empty_cache_calls += 1
            return None
        raise RuntimeError(
            f"torch.cuda.{name}() in a step predicted for a card, on a machine without a GPU: the card's figures are "
            "the prediction's (p.peak, p.step_peak, p.reserved_peak). To read torch.cuda's own calls on a simulated "
            "card, run the step in `with gpukit.on_card(gpukit.SimulatedCuda('t4')):` and ask that card")

    return call


def emptied_cache(calls, unfollowed: dict[str, str]) -> None:
    """Name in ``unfollowed`` the ``torch.cuda.empty_cache()`` calls a ``CudaCalls`` block met (anything else: none)."""
    n = getattr(calls, "empty_cache_calls", 0)
    if n:
        unfollowed["torch.cuda.empty_cache()"] = (
            f"called {n} time(s) in the steps predicted, and not run on the simulated card: its cached blocks were "
            "kept, so the reserved memory predicted may be above the card's (allocated memory is the same)")
