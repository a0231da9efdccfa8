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

``torch.cuda``'s own calls in such a step (``synchronize()``, ``empty_cache()``) are ``gpukit.amp``'s.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CudaDevices", "DEVICE_METHODS", "names_cuda"]

_TO = torch.Tensor.to
_CUDA = torch.Tensor.cuda
_PIN = torch.Tensor.pin_memory
# The methods that name a device without a keyword (a call with ``device=`` or ``pin_memory=`` may name one too)
DEVICE_METHODS = frozenset({_TO, _CUDA, _PIN})


def names_cuda(device) -> bool:
    """Whether ``device`` names a CUDA device: ``"cuda"``, ``"cuda:N"``, a ``torch.device`` of type cuda, or a bare
    index (torch takes an int as a CUDA device's); anything else (a dtype, a tensor, None) does not."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0].strip() == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


class CudaDevices(TorchFunctionMode):
    """While open on this thread, every CUDA device the code names is ``stand`` (module docstring).

    Args:
        stand: "cpu" or "meta", the device whose fake tensors stand for the card; None: a prediction for the CPU on
            a machine without CUDA, where a CUDA device named raises a RuntimeError that says what to do.
    """

    def __init__(self, stand: str | None = "cpu") -> None:
        super().__init__()
        if stand not in (None, "cpu", "meta"):
            raise ValueError(f"stand={stand!r}: 'cpu' or 'meta', the device whose fake tensors stand for the card, "
                             "or None")
        self.stand = None if stand is None else torch.device(stand)

    def _stand_in(self, named, call: str) -> torch.device:
        if self.stand is None:
            raise RuntimeError(
                f"predict() for the CPU met {call} naming {named!r}: the step is written for a GPU, which this "
                "machine does not have. Predict it for one: device='cuda', or card='t4' (or another card's name: "
                "gpukit.cards), and the CUDA devices it names stand for that card")
        return self.stand

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in DEVICE_METHODS:
            return self._method(func, args, kwargs or {})
        if kwargs and ("device" in kwargs or "pin_memory" in kwargs):  # (most calls name neither: returned at once)
            kwargs = dict(kwargs)
            device = kwargs.get("device")
            if names_cuda(device):
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
        if len(args) > 1 and names_cuda(args[1]):
            args = (tensor, self._stand_in(args[1], "Tensor.to()"), *args[2:])
        if names_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": self._stand_in(kwargs["device"], "Tensor.to()")}
        return func(*args, **kwargs)
