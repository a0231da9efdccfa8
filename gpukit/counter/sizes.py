"""The bytes the CUDA caching allocator counts as allocated for a request: rounded up to 512 B, exact up to
1 MiB, within 1 MiB more above (what that reproduces of the allocator, and what not: ``gpukit.counter``)."""

from __future__ import annotations

import operator

ALIGNMENT = 512  # the CUDA caching allocator rounds every block up to this (kMinBlockSize)
SMALL_REQUEST = 1 << 20  # kSmallSize: requests up to this come from the small pool, split exactly
# round_up(n) == (n + ALIGNMENT_LESS_ONE) & ALIGNMENT_MASK for every n >= 0 (ALIGNMENT is a power of two)
ALIGNMENT_LESS_ONE, ALIGNMENT_MASK = ALIGNMENT - 1, -ALIGNMENT


def allocated_size(nbytes: int) -> int:
    """Bytes the CUDA caching allocator counts as allocated for a request of ``nbytes``: rounded up to a
    multiple of 512 (``kMinBlockSize``), exact whenever its block is split to size (always for requests up to
    1 MiB; ``allocated_size_range`` for larger ones). ``gpukit.allocated_size(10) == 512``."""
    try:
        n = operator.index(nbytes)  # ints, numpy and torch integers; not floats or bools
    except TypeError:
        n = None
    if n is None or isinstance(nbytes, bool) or n < 0:
        raise ValueError(f"a request is a whole, non-negative number of bytes, not {nbytes!r}")
    return round_up(n)


def round_up(nbytes: int) -> int:
    """``allocated_size`` without its checks, for the counter's own hot path."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def allocated_size_range(nbytes: int) -> tuple[int, int]:
    """The least and most bytes the CUDA caching allocator can count as allocated for one request of ``nbytes``,
    whatever its cache holds: ``allocated_size(nbytes)`` exactly up to 1 MiB; above, up to 1 MiB more, since a large
    block is not split when 1 MiB or less would remain (``should_split`` in c10/cuda/CUDACachingAllocator.cpp)."""
    rounded = allocated_size(nbytes)
    return (rounded, rounded) if nbytes <= SMALL_REQUEST else (rounded, rounded + SMALL_REQUEST)


cuda_allocated_range = allocated_size_range
