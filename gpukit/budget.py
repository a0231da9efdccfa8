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

from .counter import INTERRUPTS, LEDGER
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
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"a budget caps 'cpu' or 'cuda' memory, not {self.device.type!r} "
                             f"(tensors on 'meta' hold no memory to cap; measure them with device='meta')")
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
        INTERRUPTS.hold()  # from here on, Ctrl-C waits until the cap is fully on, or fully off
        self._tally = self._previous = self._sim = None
        try:
            if self.device.type == "cpu" and self.reserved:
                from .allocator import cpu_device

                sim = cpu_device()
                if sim is None:
                    raise RuntimeError("the simulated allocator is off: gpukit.allocator.set_cpu_simulation(True)")
                self._tally = LEDGER.start()
                previous = sim.allocator.allowed_memory_maximum
                sim.allocator.empty_cache()  # as on CUDA: the cap applies to what the block needs
                sim.allocator.allowed_memory_maximum = min(self.limit, previous or self.limit)
                self._sim, self._previous = sim.allocator, previous
            elif self.device.type == "cpu":
                self._tally = LEDGER.start()
                LEDGER.limits.append(self.limit)
            else:
                index = self.device.index
                total = torch.cuda.get_device_properties(index).total_memory
                previous = torch.cuda.get_per_process_memory_fraction(index)
                torch.cuda.empty_cache()
                torch.cuda.set_per_process_memory_fraction(min(previous, self.limit / total), index)
                self._previous = previous
            INTERRUPTS.deliver()  # one that came while entering: take the cap off, then raise it
        except BaseException:
            try:
                self._undo()
            finally:
                INTERRUPTS.release()
            raise
        return self

    def _undo(self) -> None:
        if self.device.type == "cpu":
            if self._sim is not None:
                sim, self._sim = self._sim, None
                sim.allowed_memory_maximum = self._previous
            if self._tally is not None:
                tally, self._tally = self._tally, None
                if not self.reserved:
                    try:
                        LEDGER.limits.remove(self.limit)
                    except ValueError:  # the cap was not on yet
                        pass
                LEDGER.stop(tally)
        elif self._previous is not None:
            previous, self._previous = self._previous, None
            torch.cuda.set_per_process_memory_fraction(previous, self.device.index)

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self._undo()
        finally:
            INTERRUPTS.release()  # an interrupt held back while leaving is raised here
        return False


INTERRUPTS.protect(budget.__enter__, budget.__exit__, budget._undo)
