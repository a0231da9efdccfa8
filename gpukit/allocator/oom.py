"""The out-of-memory path: ``SimulatedOutOfMemoryError``, a ``torch.OutOfMemoryError`` with the text of CUDA's
own message (``format_size`` for its sizes, ``OOM_ADVICE`` at its end)."""

from __future__ import annotations

import torch

OOM_ADVICE = (" If reserved but unallocated memory is large try setting"
              " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid"
              " fragmentation.  See documentation for Memory Management "
              " (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")


def format_size(size: int) -> str:
    """c10::CachingAllocator::format_size (c10/core/Allocator.h): how CUDA's messages print sizes."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024.0:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576.0:.2f} MiB"
    return f"{size / 1073741824.0:.2f} GiB"


class SimulatedOutOfMemoryError(torch.OutOfMemoryError):
    """``torch.OutOfMemoryError`` raised by the simulated allocator: CUDA's message, after a line that says it is
    simulated (a reader must never take it for a real GPU's)."""


def simulated_label(name: str | None) -> str:
    """What a simulated out-of-memory error says before CUDA's own words."""
    card = f"a simulated {name}" if name else "a simulated GPU"
    return f"[{card}: gpukit's model of the CUDA caching allocator; no GPU ran this] "


class OutOfMemoryPart:
    """The allocator's part that words and raises its out-of-memory error."""

    def oom_message(self, alloc_size: int) -> str:
        """The text of CUDA's out-of-memory error for a request of ``alloc_size`` bytes now.

        As DeviceCachingAllocator::malloc builds it (CUDACachingAllocator.cpp); the
        "this process" part is what NVML reports: reserved memory plus the context.
        """
        device_free, device_total = self.mem_get_info()
        allowed = "" if self.allowed_memory_maximum is None else f"{format_size(self.allowed_memory_maximum)} allowed; "
        proc = (f"Including non-PyTorch memory, this process has {format_size(self.nvidia_smi_bytes())} "
                "memory in use. ") if self.nvidia_smi_bytes() else ""  # NVML lists processes that hold memory
        allocated = self.memory_allocated()
        reserved = self.memory_reserved()
        return ("CUDA out of memory. Tried to allocate " + format_size(alloc_size) + ". GPU " + str(self.device)
                + " has a total capacity of " + format_size(device_total) + " of which " + format_size(device_free)
                + " is free. " + proc + allowed + "Of the allocated memory " + format_size(allocated)
                + " is allocated by PyTorch, and " + format_size(reserved - allocated)
                + " is reserved by PyTorch but unallocated." + OOM_ADVICE)

    def _raise_oom(self, size: int, alloc_size: int, stream: int) -> None:
        self.counters["num_ooms"] += 1
        if self.trace is not None:
            self.trace.append(("oom", self._device_free(), size, stream))
        raise SimulatedOutOfMemoryError(simulated_label(self.name) + self.oom_message(alloc_size))

    def _oom_plain(self, message: str) -> None:
        raise SimulatedOutOfMemoryError(simulated_label(self.name) + message)

