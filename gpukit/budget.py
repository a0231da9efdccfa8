"""budget(): run a block as if the device had only so much memory.

    with gpukit.budget("4 GiB"):
        train_step()          # raises torch.OutOfMemoryError past 4 GiB

On CUDA this is PyTorch's own cap, ``torch.cuda.set_per_process_memory_fraction``:
the caching allocator refuses to reserve more than the fraction of the GPU, so
the cap applies to reserved memory (live tensors, the allocator's cache and its
fragmentation). The cache is emptied on entry so that the cap applies to what the
block needs, and the previous fraction is restored on exit.

On CPU the exact live-tensor counter (gpukit.counter) raises a real
``torch.OutOfMemoryError`` when an allocation would take the live bytes of all
CPU tensors past the cap: the same error, at the same place, as a GPU of that
size with no fragmentation. With ``reserved=True`` the cap applies instead to the
reserved memory of the simulated caching allocator that follows the CPU tensors
(gpukit.allocator), as ``set_per_process_memory_fraction`` does on CUDA: fragmentation
and the cache count, and the error carries CUDA's message.
"""

from __future__ import annotations

import torch

from .counter import LEDGER
from .meter import resolve_device
from .report import format_bytes, parse_bytes


class budget:
    """A memory cap for a ``with`` block; blocks nest (the smallest cap applies).

    Args:
        limit: bytes, or a size such as ``"4GB"``, ``"512 MiB"``.
        device: ``'cpu'``, ``'cuda'``, ``'cuda:N'``; default the GPU if there is one, else the CPU.

    Raises:
        ValueError: for a size or device that is not one.
    """

    def __init__(self, limit: int | float | str, device: str | torch.device | None = None, *,
                 reserved: bool = False) -> None:
        self.limit = parse_bytes(limit)
        self.device = resolve_device(device)
        self.reserved = reserved  # CPU: cap the simulated allocator's reserved memory (gpukit.allocator)
        if reserved and self.device.type != "cpu":
            raise ValueError("reserved=True caps the simulated allocator behind the CPU counter; on CUDA "
                             "budget() always caps reserved memory (set_per_process_memory_fraction)")
        self._entered = False

    def __repr__(self) -> str:
        return f"budget({format_bytes(self.limit)} on {self.device})"

    def __enter__(self) -> "budget":
        if self._entered:
            raise RuntimeError("a budget() object is used once; make a new one for each block")
        self._entered = True
        if self.device.type == "cpu" and self.reserved:
            from .allocator import cpu_device

            sim = cpu_device()
            if sim is None:
                raise RuntimeError("the simulated allocator is off: gpukit.allocator.set_cpu_simulation(True)")
            self._tally = LEDGER.start()
            self._sim, self._previous = sim.allocator, sim.allocator.allowed_memory_maximum
            sim.allocator.empty_cache()  # as on CUDA: the cap applies to what the block needs
            sim.allocator.allowed_memory_maximum = min(self.limit, self._previous or self.limit)
        elif self.device.type == "cpu":
            self._tally = LEDGER.start()
            LEDGER.limits.append(self.limit)
        else:
            index = self.device.index
            total = torch.cuda.get_device_properties(index).total_memory
            self._previous = torch.cuda.get_per_process_memory_fraction(index)
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(min(self._previous, self.limit / total), index)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.device.type == "cpu" and self.reserved:
            self._sim.allowed_memory_maximum = self._previous
            LEDGER.stop(self._tally)
        elif self.device.type == "cpu":
            LEDGER.limits.remove(self.limit)
            LEDGER.stop(self._tally)
        else:
            torch.cuda.set_per_process_memory_fraction(self._previous, self.device.index)
        return False
