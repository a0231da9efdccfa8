"""What the simulated allocator's tests share: sizes, the recorded traces' folder, a ported test run with
expandable segments off and on, and a simulated device to run on."""

from __future__ import annotations

import inspect
from pathlib import Path

from gpukit.allocator import CachingAllocator

MB = 1024 * 1024
GPU = 80 * 1024**3  # an 80 GiB device (no real GPU's capacity is assumed by any assert below)
TRACES = Path(__file__).resolve().parent.parent / "data" / "traces"


def EXPANDABLE(test):
    """Run a ported test twice, as PyTorch's CI does: test_cuda.py with expandable segments off, and
    test_cuda_expandable_segments.py with them on (one pytest item: each item pays conftest's gc)."""
    sig = inspect.signature(test)
    params = [p for name, p in sig.parameters.items() if name != "expandable"]

    def both(*args, **kwargs):
        for expandable in (False, True):
            try:
                test(*args, expandable=expandable, **kwargs)
            except BaseException as err:
                err.add_note(f"with expandable_segments:{expandable}")
                raise

    both.__name__, both.__doc__, both.__module__ = test.__name__, test.__doc__, test.__module__
    both.__signature__ = sig.replace(parameters=params)
    return both



def sim(expandable: bool = False, total=GPU, **kw) -> CachingAllocator:
    return CachingAllocator(total, "expandable_segments:True" if expandable else "", **kw)


def float32(n: int) -> int:
    return 4 * n
