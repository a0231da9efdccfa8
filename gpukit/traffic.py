"""copies(): the bytes a block copies between devices, each way.

    with gpukit.copies() as traffic:
        step()
    traffic.host_to_device, traffic.device_to_host   # bytes

A ``TorchDispatchMode`` sees every copy op (``Tensor.to``, ``.cuda()``, ``.cpu()``,
``copy_``) and records those whose source and destination devices differ. It works
on fake tensors too (enter it inside the ``FakeTensorMode``), where the devices are
the ones the tensors pretend to be on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._torch import TorchDispatchMode
from .report import format_bytes

aten = torch.ops.aten


@dataclass
class Traffic:
    host_to_device: int = 0        # bytes
    device_to_host: int = 0
    copies_to_device: int = 0      # number of copies
    copies_to_host: int = 0

    @property
    def total(self) -> int:
        return self.host_to_device + self.device_to_host

    def __repr__(self) -> str:
        return (f"copies: {format_bytes(self.host_to_device)} to the device in {self.copies_to_device}, "
                f"{format_bytes(self.device_to_host)} to the host in {self.copies_to_host}")


class copies(TorchDispatchMode):
    """Count the bytes copied between the host (CPU) and any other device inside a block."""

    def __init__(self) -> None:
        super().__init__()
        self.traffic = Traffic()

    def __enter__(self) -> Traffic:
        super().__enter__()
        return self.traffic

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is aten._to_copy.default:
            self._record(args[0], out)
        elif func is aten.copy_.default:
            self._record(args[1], args[0])
        return out

    def _record(self, src, dst) -> None:
        if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)):
            return
        a, b = src.device.type, dst.device.type
        if a == b:
            return
        nbytes = dst.numel() * dst.element_size()
        if a == "cpu":
            self.traffic.host_to_device += nbytes
            self.traffic.copies_to_device += 1
        elif b == "cpu":
            self.traffic.device_to_host += nbytes
            self.traffic.copies_to_host += 1
