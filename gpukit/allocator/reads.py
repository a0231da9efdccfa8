"""What ``torch.cuda``'s calls read from a ``SimulatedDevice`` that follows a prediction: the step's peak as
``torch.cuda.max_memory_allocated()`` counts it, each block whole (``WholeBlocks``: the predictions' CUDA figures),
and the step's own memory reads, answered as the card would answer them at that moment (``CardMemory``)."""

from __future__ import annotations

from typing import Callable

from .caching import CachingAllocator
from .device import SimulatedDevice


class WholeBlocks:
    """What ``torch.cuda.memory_allocated()`` counts from here on, read from a ``SimulatedDevice`` that follows a
    counter: each block whole. A large block is split only where more than 1 MiB would remain
    (c10/cuda/CUDACachingAllocator.cpp ``should_split``), so a tensor may hold up to 1 MiB more than its size, and
    ``allocated_bytes`` adds ``block->size``. ``before_slack``: the blocks now over their storages' 512-byte sizes;
    ``step_peak()``: the most allocated since, over now. Made where a prediction's step starts (gpukit.estimate,
    gpukit.offload); it resets the allocator's peaks, keeping what they had reached for the step's own reads
    (``SimulatedDevice.reset_peaks``; the ``watch`` cells follow reserved memory)."""

    def __init__(self, device: SimulatedDevice) -> None:
        from ..counter import round_up  # (the counter's 512-byte rule; imported late, as LEDGER is below)

        self.device, alloc = device, device.allocator  # up to date: every event applied
        self.attached = device.ledger is not None  # (a device no counter feeds knows no storage's size)
        sizes = device.ledger.sizes if self.attached else {}
        self.start = alloc.memory_allocated()
        self.before_slack = self.start - sum(round_up(sizes[k]) for k in device.addr if k in sizes)
        device.reset_peaks(for_reads=False)

    def known(self) -> bool:
        """Whether the device followed a counter's every event (an interrupted update detaches it:
        ``SimulatedDevice.failed``)."""
        return self.attached and not self.device.failed

    def step_peak(self) -> int:
        """The most allocated since the step started, over its start (a ``reset_peak_memory_stats()`` in the step
        does not lower it)."""
        return max(self.device.step_floor, self.device.allocator.max_memory_allocated()) - self.start


def workspace_segments(sizes: list[int]) -> tuple[int, int]:
    """What workspaces of ``sizes`` bytes (cuBLAS's and cuBLASLt's: ``CudaRules.workspace_blocks()``) add to
    ``torch.cuda.memory_allocated()`` and to ``memory_reserved()``: each a cudaMalloc'd block of its own, rounded as
    the caching allocator rounds it, in a segment of its own (aten/src/ATen/cuda/CublasHandlePool.cpp)."""
    from ..counter import round_up  # (imported late, as in WholeBlocks)

    blocks = [round_up(n) for n in sizes if n]
    return sum(blocks), sum(CachingAllocator.get_allocation_size(n) for n in blocks)


class CardMemory:
    """``torch.cuda``'s memory reads in a step predicted for a card, answered as the card's caching allocator would
    answer them at that moment (``read``): ``device``'s simulated allocator, each block counted whole, plus the
    workspaces made by then (``workspaces()``: the sizes of cuBLAS's and cuBLASLt's, a cudaMalloc'd block each:
    aten/src/ATen/cuda/CublasHandlePool.cpp). The peaks run from the prediction's first tensor (the process's start,
    for a step run in a fresh process) or from the step's own ``reset_peak_memory_stats()``, which leaves the
    prediction's own step peak as it was."""

    READS = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
             "reset_peak_memory_stats")

    def __init__(self, device: SimulatedDevice, workspaces: Callable[[], list[int]]) -> None:
        self.device, self.workspaces = device, workspaces

    def read(self, name: str) -> int | None:
        """``torch.cuda.<name>()``, ``name`` one of ``READS``."""
        if name not in self.READS:
            raise ValueError(f"torch.cuda.{name}() is not answered by the simulated card; it answers {self.READS}")
        device = self.device
        if name == "reset_peak_memory_stats":
            device.reset_peaks(for_reads=True)
            return None
        alloc = device.allocator
        blocks, segments = workspace_segments(self.workspaces())
        if name == "memory_allocated":
            return alloc.memory_allocated() + blocks
        if name == "max_memory_allocated":
            return max(device.read_floors[0], alloc.max_memory_allocated()) + blocks
        if name == "memory_reserved":
            return alloc.memory_reserved() + segments
        return max(device.read_floors[1], alloc.max_memory_reserved()) + segments


__all__ = ["WholeBlocks", "CardMemory", "workspace_segments"]
