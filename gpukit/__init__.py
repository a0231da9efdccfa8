"""gpukit: learn and measure where GPU memory goes in PyTorch training.

    import gpukit
    with gpukit.measure() as report:      # on a GPU: the CUDA allocator; on CPU: an exact counter
        ...
    gpukit.history()                      # every measurement so far, as a DataFrame

In Jupyter: ``%load_ext gpukit``, then ``%%gpumem`` on any cell.

Without a GPU, torch.cuda's own memory calls answer from a simulated card:

    cuda = torch.cuda if torch.cuda.is_available() else gpukit.SimulatedCuda("t4")
    cuda.reset_peak_memory_stats(); ...; cuda.max_memory_allocated()
"""

from .budget import BudgetWarning, budget
from .counter import CompileRanEagerWarning, allocated_size, allocated_size_range
from .plan import plan
from .meter import measure, resolve_device
from .report import MemoryReport, clear_history, format_bytes, history, keep_history, last, parse_bytes
from .oncard import CardRun, on_card
from .simulated import SimulatedCuda
from .traffic import Traffic, copies
from .warmup import warm_up

__version__ = "0.1.0"
__all__ = ["SimulatedCuda", "on_card", "CardRun", "measure", "budget", "BudgetWarning", "CompileRanEagerWarning", "plan", "allocated_size", "allocated_size_range", "warm_up", "copies", "Traffic",
           "MemoryReport", "history", "last", "keep_history",
           "clear_history", "format_bytes",
           "parse_bytes", "resolve_device", "load_ipython_extension"]


def load_ipython_extension(ipython) -> None:
    """Called by ``%load_ext gpukit``: registers ``%gpumem`` and ``%%gpumem``."""
    from .magic import GpuMemMagics

    ipython.register_magics(GpuMemMagics)
