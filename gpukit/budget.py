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

A CPU budget counts every CPU tensor of the process, so data that a GPU run keeps in
host memory (a dataset loaded as a tensor) would count against it. Name it with
``host=``: its storages are left out of the cap while they live, and what the
block copies out of them (``data[idx].clone()``, the stand-in for ``.to("cuda")``) is
counted as device memory. A budget that is already exceeded when it opens warns
(``BudgetWarning``) before the first allocation fails: with the largest storages, or where reserved
memory is capped (CUDA, ``reserved=True``) with what stays reserved after ``empty_cache()``.
"""

from __future__ import annotations

import collections.abc
import heapq
import warnings
import weakref

import torch

from ._torch import is_traceable_wrapper_subclass
from .counter import INTERRUPTS, LEDGER, round_up, user_stacklevel
from .meter import resolve_device
from .report import format_bytes, parse_bytes


class BudgetWarning(UserWarning):
    """A budget that the memory already in use exceeds when its block opens."""


class _Cap(int):
    """A CPU budget's limit on ``LEDGER.limits``, with the storages it leaves out (``host=``)."""

    def __new__(cls, limit: int, storages: dict[int, weakref.ref]) -> "_Cap":
        cap = super().__new__(cls, limit)
        cap.storages = storages
        return cap

    def host_bytes(self, ledger) -> int:
        """Rounded bytes of the host storages that are alive and counted by ``ledger`` now (a storage that died
        leaves both; one resized counts at its new size; a new storage that took a dead one's id is not one)."""
        total, refs, sizes = 0, ledger._refs, ledger.sizes
        for key, ref in self.storages.items():
            known = refs.get(key)
            if known is not None and known() is ref() is not None:
                total += round_up(sizes[key])
        return total

    def holds(self, storage: torch.UntypedStorage) -> bool:
        ref = self.storages.get(id(storage))
        return ref is not None and ref() is storage


def _host_storages(obj, found: dict[int, weakref.ref]) -> None:
    """The CPU storages of every tensor in ``obj``: a tensor (and its ``.grad``), a module's parameters and
    buffers, an optimizer's state, and dicts, lists, tuples and sets of these; other leaves are ignored."""
    if isinstance(obj, torch.Tensor):
        if is_traceable_wrapper_subclass(obj):
            for name in obj.__tensor_flatten__()[0]:
                _host_storages(getattr(obj, name), found)
        elif obj.layout is torch.strided and obj.device.type == "cpu":
            st = obj.untyped_storage()
            found[id(st)] = weakref.ref(st)
        if obj.is_leaf and obj.grad is not None:
            _host_storages(obj.grad, found)
    elif isinstance(obj, torch.nn.Module):
        for t in (*obj.parameters(), *obj.buffers()):
            _host_storages(t, found)
    elif isinstance(obj, torch.optim.Optimizer):
        _host_storages(list(obj.state.values()), found)
    elif isinstance(obj, collections.abc.Mapping):
        for v in obj.values():
            _host_storages(v, found)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            _host_storages(v, found)


class budget:
    """A memory cap for a ``with`` block; blocks nest (the smallest cap applies).

    Args:
        limit: bytes, or a size such as ``"4GB"``, ``"512 MiB"``.
        device: ``'cpu'``, ``'cuda'``, ``'cuda:N'``; default the GPU if there is one, else the CPU.
        host: CPU only: what a GPU run would keep in host memory, so that it does not count against the cap:
            a tensor, a module, an optimizer, or any dict, list or tuple of these (a dataset's tensors, say).
            The storages are read when the block opens; views of them share them and add nothing, a copy made
            in the block counts, one that dies or is resized in the block leaves or follows the cap's
            figures. Budgets nested inside this one leave the same storages out. On CUDA CPU tensors never
            count, and ``host`` changes nothing.
        reserved: CPU only: cap the reserved memory of the simulated caching allocator (gpukit.allocator).

    Warns:
        BudgetWarning: when the memory in use as the block opens (less ``host``) already exceeds the budget,
            with the largest storages' sizes; where reserved memory is capped (CUDA, ``reserved=True``), when
            what stays reserved after ``empty_cache()`` does, with its segments and their live bytes.

    Raises:
        ValueError: for a size or device that is not one; ``host`` with ``reserved=True``, or holding no tensor.
    """

    def __init__(self, limit: int | float | str, device: str | torch.device | None = None, *,
                 host=None, reserved: bool = False) -> None:
        self.limit = parse_bytes(limit)
        self.device = resolve_device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"a budget caps 'cpu' or 'cuda' memory, not {self.device.type!r} "
                             f"(tensors on 'meta' hold no memory to cap; measure them with device='meta')")
        self.reserved = reserved  # CPU: cap the simulated allocator's reserved memory (gpukit.allocator)
        if reserved and self.device.type != "cpu":
            raise ValueError("reserved=True caps the simulated allocator behind the CPU counter; on CUDA "
                             "budget() always caps reserved memory (set_per_process_memory_fraction)")
        self._host: dict[int, weakref.ref] = {}
        if host is not None:
            if reserved:
                raise ValueError("host= is not available with reserved=True: the simulated allocator reserves "
                                 "segments for the host storages too")
            _host_storages(host, self._host)
            if not self._host and self.device.type == "cpu":
                raise ValueError(f"host= holds no CPU tensor: give a tensor, a module, an optimizer, or a dict, "
                                 f"list or tuple of them (for a TensorDataset, its .tensors), not "
                                 f"{type(host).__name__}")
        self._entered = False

    def __repr__(self) -> str:
        return f"budget({format_bytes(self.limit)} on {self.device})"

    def __enter__(self) -> "budget":
        if self._entered:
            raise RuntimeError("a budget() object is used once; make a new one for each block")
        self._entered = True
        INTERRUPTS.hold()  # from here on, Ctrl-C waits until the cap is fully on, or fully off
        self._tally = self._previous = self._sim = self._cap = None
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
                stats = sim.allocator.memory_stats()
                self._warn_if_reserved_over(stats["reserved_bytes.all.current"], stats["allocated_bytes.all.current"],
                                            stats["segment.all.current"])
            elif self.device.type == "cpu":
                self._tally = LEDGER.start()
                host = dict(self._host)
                for outer in LEDGER.limits:  # what an enclosing budget keeps on the host stays there
                    host.update(getattr(outer, "storages", {}))
                self._cap = _Cap(self.limit, host)
                LEDGER.limits.append(self._cap)
                self._warn_if_already_over()
            else:
                index = self.device.index
                total = torch.cuda.get_device_properties(index).total_memory
                previous = torch.cuda.get_per_process_memory_fraction(index)
                torch.cuda.empty_cache()
                torch.cuda.set_per_process_memory_fraction(min(previous, self.limit / total), index)
                self._previous = previous
                stats = torch.cuda.memory_stats(index)
                self._warn_if_reserved_over(stats.get("reserved_bytes.all.current", 0),
                                            stats.get("allocated_bytes.all.current", 0),
                                            stats.get("segment.all.current", 0))
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
                if not self.reserved:  # this budget's cap, if it was on yet (an equal limit may be another's)
                    LEDGER.limits[:] = [c for c in LEDGER.limits if c is not self._cap]
                LEDGER.stop(tally)
        elif self._previous is not None:
            previous, self._previous = self._previous, None
            torch.cuda.set_per_process_memory_fraction(previous, self.device.index)

    def _warn_if_already_over(self) -> None:
        with LEDGER._lock:
            LEDGER.settle()
            host = self._cap.host_bytes(LEDGER)
            used = LEDGER.live_rounded - host
            if used <= self.limit:
                return
            keep = self._cap.storages
            largest = heapq.nlargest(3, (n for key, n in LEDGER.sizes.items() if key not in keep))
        sizes = ", ".join(format_bytes(round_up(n)) for n in largest)
        on_host = f" (not counting {format_bytes(host)} on the host)" if host else ""
        warnings.warn(
            f"{self!r} is already exceeded as it opens: {format_bytes(used)} of CPU tensors are allocated"
            f"{on_host}, so the block's first allocation will fail. The largest storages: {sizes}. A CPU budget "
            f"counts every CPU tensor of the process; name what a GPU run would keep in host memory (a dataset) "
            f"with budget(..., host=data) (%%gpumem: --host data) to leave it out.", BudgetWarning, stacklevel=user_stacklevel())

    def _warn_if_reserved_over(self, reserved: int, allocated: int, segments: int) -> None:
        """Reserved memory is capped (CUDA, or ``reserved=True``): what stays reserved after ``empty_cache()`` is
        every segment that holds a live block, whole (c10/cuda/CUDACachingAllocator.cpp releases only segments
        whose blocks are all free)."""
        if reserved <= self.limit:
            return
        warnings.warn(
            f"{self!r} is already exceeded as it opens: {format_bytes(reserved)} stays reserved after "
            f"empty_cache(), in {segments} segment{'s' if segments != 1 else ''} holding {format_bytes(allocated)} "
            f"of live blocks, so every allocation that needs a new segment will fail. The cap counts reserved "
            f"memory, and a segment is released only when all its blocks are free: one small live block keeps a "
            f"large segment whole. A block made while a large step's memory was cached is often cut from it (a "
            f"cuBLAS workspace, kept for the process's life, where a thread's first matmul ran inside that step: "
            f"call gpukit.warm_up() before large steps).", BudgetWarning, stacklevel=user_stacklevel())

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self._undo()
        finally:
            INTERRUPTS.release()  # an interrupt held back while leaving is raised here
        return False


INTERRUPTS.protect(budget.__enter__, budget.__exit__, budget._undo, budget._warn_if_already_over,
                   budget._warn_if_reserved_over)
