"""The exact live-tensor counter that stands in for the CUDA allocator on CPU.

PyTorch keeps no statistics for CPU memory, so gpukit counts it itself: every
tensor's memory lives in an *untyped storage*; views share their base's storage
and add nothing, and the memory is freed when the storage's last user dies.

* Allocations: a ``TorchDispatchMode`` sees every ATen op run inside a measured
  block and records each output storage it has not seen before (factory ops,
  results, gradients, optimizer state...). ``Tensor.resize_`` and
  ``UntypedStorage.resize_`` that change a storage's size are seen too.
* Frees: each known storage carries a ``weakref`` whose callback fires when the
  storage dies (PyTorch keeps one Python object per live storage), wherever that
  happens: ``del x``, ``optimizer.zero_grad()``, the end of ``backward()``.
* Storages that existed before the block are found when it starts, by a scan of
  every tensor Python can reach (``gc``), their ``.grad``, and the tensors saved
  by autograd graphs hanging off them, so that freeing them counts.

Every size is kept as requested (the CUDA allocator's ``requested_bytes``) and also
rounded up to a multiple of 512 bytes (its ``allocated_bytes``). What that reproduces of
the CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, default configuration):

* requested bytes: exactly, whatever the allocator's cache holds;
* allocated bytes of requests up to 1 MiB (``kSmallSize``): exactly. They come from the
  small pool, whose blocks are always split to the 512-byte-rounded size (``round_size``,
  ``should_split``: ``remaining >= kMinBlockSize``);
* allocated bytes of larger requests: a lower bound. A large block is split only when more
  than 1 MiB would remain (``should_split``: ``remaining > kSmallSize``), so a request can
  be counted with up to 1 MiB more, the whole block it got; which block depends on what the
  cache holds (new segments are 20 MiB, ``kLargeBuffer``, for requests under 10 MiB,
  ``kMinLargeAlloc``, else the request rounded up to 2 MiB, ``kRoundLarge``).
  ``cuda_allocated_range`` gives the bounds. ``expandable_segments`` splits every block,
  and ``roundup_power2_divisions`` rounds differently; the counter follows neither.
* not at all: reserved memory (segments, the cache, fragmentation), scratch memory inside
  ops, and cuBLAS's workspaces (``gpukit.warm_up``).

What it cannot see: scratch memory a C++ kernel allocates and frees inside one
op, memory of non-strided (sparse) tensors, and storages reachable only from C++
(other than autograd's saved tensors) that exist before a block and die in it.
"""

from __future__ import annotations

import gc
import sys
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

ALIGNMENT = 512  # the CUDA caching allocator rounds every block up to this (kMinBlockSize)
SMALL_REQUEST = 1 << 20  # kSmallSize: requests up to this come from the small pool, split exactly


def round_up(nbytes: int) -> int:
    """Bytes the CUDA caching allocator counts for a request of ``nbytes`` when its block is split to size
    (always for requests up to 1 MiB; see ``cuda_allocated_range`` for larger ones)."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def cuda_allocated_range(nbytes: int) -> tuple[int, int]:
    """The least and most bytes the CUDA caching allocator can count as allocated for one request of ``nbytes``,
    whatever its cache holds: ``round_up(nbytes)`` exactly up to 1 MiB; above, up to 1 MiB more, since a large
    block is not split when 1 MiB or less would remain (``should_split`` in c10/cuda/CUDACachingAllocator.cpp)."""
    rounded = round_up(nbytes)
    return (rounded, rounded) if nbytes <= SMALL_REQUEST else (rounded, rounded + SMALL_REQUEST)


class Tally:
    """Running level and peak of one measured block, relative to its start.

    ``label`` limits it to the storages of one device type (a fake ledger tells
    fake tensors apart by the device they pretend to be on); None counts all.
    """

    __slots__ = ("level", "level_unrounded", "peak", "peak_unrounded", "label", "events", "phase")

    def __init__(self, label: str | None = None) -> None:
        self.level = self.level_unrounded = self.peak = self.peak_unrounded = 0
        self.label = label
        self.events: list | None = None  # (level, phase) after every change, when a timeline is wanted
        self.phase = None  # a callable naming the phase of training (forward, backward, optimizer)


def _dispatches(cls: type) -> bool:
    """Whether a tensor subclass has a ``__torch_dispatch__`` of its own (``nn.Parameter`` and the like do not)."""
    return getattr(cls, "__torch_dispatch__", None) is not torch._C._disabled_torch_dispatch_impl


class _CountingMode(TorchDispatchMode):
    """Sees every op in a measured block and hands its output tensors to the ledger."""

    def __init__(self, ledger: "Ledger") -> None:
        super().__init__()
        self.ledger = ledger
        self.own_types = (torch.Tensor, FakeTensor) if ledger.fake else (torch.Tensor,)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if types and any(t not in self.own_types and _dispatches(t) for t in types):
            if any(issubclass(t, FakeTensor) for t in types):
                return func(*args, **(kwargs or {}))  # fake tensors hold no memory to count here
            # Another tensor subclass (DTensor...): let it unwrap itself; the ops
            # it runs on plain tensors come back through this mode.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        see = self.ledger.see
        if isinstance(out, torch.Tensor):
            see(out)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    see(o)
                elif isinstance(o, (tuple, list)):
                    for oo in o:
                        if isinstance(oo, torch.Tensor):
                            see(oo)
        return out


class Ledger:
    """Every live storage of one kind gpukit knows of, with its size.

    ``Ledger()`` counts real CPU memory (``LEDGER``, one per process);
    ``Ledger(fake=True)`` counts the storages of fake tensors (``FakeTensorMode``),
    which hold no memory at all, to predict what a run would allocate.
    """

    def __init__(self, fake: bool = False) -> None:
        self.fake = fake
        self.storage_device = "meta" if fake else "cpu"  # where the storages it counts live
        self.labels: dict[int, str] = {}  # fake ledger: id(storage) -> the device its tensor shows
        self.live_by_label: dict[str, int] = {}  # fake ledger: rounded live bytes per device shown
        self.sizes: dict[int, int] = {}  # id(storage) -> bytes, unrounded
        self._refs: dict[int, weakref.ref] = {}
        self.tallies: list[Tally] = []
        self.limits: list[int] = []  # active budgets (gpukit.budget), in rounded bytes
        self.live = 0  # bytes of all known storages, unrounded
        self.live_rounded = 0
        self.listener = None  # a gpukit.allocator.SimulatedDevice told of every allocation and free
        self._mode: _CountingMode | None = None
        self._orig_storage_resize = None
        self._tensors: dict[int, weakref.ref] = {}  # every tensor object found by a scan
        # Generational scans rely on CPython <= 3.13's three-generation collector.
        self._incremental = sys.version_info < (3, 14)
        self._gc_dirty = 2  # the first scan is a full one
        gc.callbacks.append(self._on_gc)

    # -- bookkeeping ---------------------------------------------------------

    def _allocated(self, nbytes: int, label: str | None = None) -> None:
        rounded = round_up(nbytes)
        self.live += nbytes
        self.live_rounded += rounded
        if label is not None:
            self.live_by_label[label] = self.live_by_label.get(label, 0) + rounded
        for t in self.tallies:
            if t.label is not None and t.label != label:
                continue
            t.level += rounded
            t.level_unrounded += nbytes
            if t.level > t.peak:
                t.peak = t.level
            if t.level_unrounded > t.peak_unrounded:
                t.peak_unrounded = t.level_unrounded
            if t.events is not None:
                t.events.append((t.level, t.phase()))

    def _freed(self, nbytes: int, label: str | None = None) -> None:
        rounded = round_up(nbytes)
        self.live -= nbytes
        self.live_rounded -= rounded
        if label is not None:
            self.live_by_label[label] -= rounded
        for t in self.tallies:
            if t.label is not None and t.label != label:
                continue
            t.level -= rounded
            t.level_unrounded -= nbytes
            if t.events is not None:
                t.events.append((t.level, t.phase()))

    def _on_death(self, key: int) -> None:
        if self.listener is not None:
            self.listener.on_free(key)
        self._refs.pop(key, None)
        label = self.labels.pop(key, None)
        nbytes = self.sizes.pop(key, None)
        if nbytes:
            self._freed(nbytes, label)

    def _track(self, storage: torch.UntypedStorage, nbytes: int, *, counted: bool, label: str | None = None) -> None:
        key = id(storage)
        if self.listener is not None:  # first: a simulated OOM leaves the storage untracked
            self.listener.on_alloc(key, nbytes, counted)
        self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._on_death(key))
        self.sizes[key] = nbytes
        if label is not None:
            self.labels[key] = label
        if counted:
            self._allocated(nbytes, label)
        else:
            self.live += nbytes
            self.live_rounded += round_up(nbytes)
            if label is not None:
                self.live_by_label[label] = self.live_by_label.get(label, 0) + round_up(nbytes)

    def _storage_of(self, t: torch.Tensor) -> torch.UntypedStorage | None:
        if t.layout is not torch.strided or is_traceable_wrapper_subclass(t):
            return None
        st = t.untyped_storage()
        return st if st.device.type == self.storage_device else None

    def see_storage(self, st: torch.UntypedStorage, label: str | None = None) -> None:
        """Record ``st`` as allocated now if it is new, or its change of size.

        Raises:
            torch.OutOfMemoryError: when the allocation would take the live bytes past
                an active budget; the storage is then left untracked, to die with the op.
        """
        nbytes = st.nbytes()
        known = self.sizes.get(id(st))
        if known is None:
            self._check_budget(nbytes)
            self._track(st, nbytes, counted=True, label=label)
        elif known != nbytes:
            # Like the allocator: the new block exists before the old one is freed.
            self._check_budget(nbytes)
            if self.listener is not None:
                self.listener.on_resize(id(st), nbytes)
            label = self.labels.get(id(st))
            self.sizes[id(st)] = nbytes
            self._allocated(nbytes, label)
            self._freed(known, label)

    def _check_budget(self, nbytes: int) -> None:
        if not self.limits:
            return
        limit, want = min(self.limits), round_up(nbytes)
        if self.live_rounded + want > limit:
            free = max(limit - self.live_rounded, 0)
            raise torch.OutOfMemoryError(
                f"out of memory under a gpukit budget ({'fake tensors' if self.fake else 'CPU, simulated'}). "
                f"Tried to allocate {_fmt(want)}; {_fmt(self.live_rounded)} already allocated; "
                f"budget {_fmt(limit)}, of which {_fmt(free)} free.")

    def see(self, t: torch.Tensor) -> None:
        """Record the storage of an op's output (called for every op: kept lean)."""
        if type(t) is torch.Tensor and not self.fake:  # the common case, checked cheaply
            if not t.is_cpu or t.layout is not torch.strided:
                return
            self.see_storage(t.untyped_storage())
        elif self.fake:  # fake tensors, and plain meta tensors: labelled by the device they show
            st = self._storage_of(t)
            if st is not None:
                self.see_storage(st, t.device.type)
        elif t.is_cpu:
            st = self._storage_of(t)
            if st is not None:
                self.see_storage(st)

    # -- finding what existed before a block -----------------------------------

    def adopt_existing(self) -> None:
        """Learn every CPU storage Python can reach now, without counting it as allocated.

        The first call scans every object the garbage collector tracks; later calls
        scan only the generations that can hold tensors made since the last scan
        (a tensor is born in generation 0 and moves up only when a collection
        runs, which ``gc.callbacks`` reports). Tensors found before are re-read
        every time, since their ``.grad``, graph or storage may have changed.
        """
        dirty, self._gc_dirty = self._gc_dirty, -1
        tensors = self._tensors
        full = dirty >= 1 or not self._incremental
        for gen in (None,) if full else range(dirty + 2):
            # No list may be built around these: one made before the call would be
            # inside it, a cycle that keeps every object listed alive until the next collection.
            for obj in gc.get_objects() if gen is None else gc.get_objects(gen):
                if not issubclass(type(obj), torch.Tensor) or id(obj) in tensors:
                    continue
                if self._keep(obj):
                    tensors[id(obj)] = weakref.ref(obj, lambda _ref, key=id(obj): tensors.pop(key, None))
                else:
                    self._read(obj, [])
        obj = None
        graph_roots: list = []
        for ref in list(tensors.values()):
            obj = ref()
            if obj is not None:
                self._read(obj, graph_roots)
        if graph_roots:
            for t in _saved_tensors(graph_roots):
                self._adopt(t)

    def _keep(self, t: torch.Tensor) -> bool:
        """Whether to keep a weak reference to this tensor object between scans.

        Not to tensor subclasses that PyTorch may swap in place (DTensor: FSDP2;
        fake tensors, for the real counter): ``torch.utils.swap_tensors`` refuses
        tensors with weak references. Their storages are adopted when first found.
        """
        if is_traceable_wrapper_subclass(t):
            return False
        return self.fake or not isinstance(t, FakeTensor)

    def _read(self, t: torch.Tensor, graph_roots: list) -> None:
        """Adopt a tensor's storage, its ``.grad``, and note its autograd graph."""
        try:
            self._adopt(t)
            if t.grad_fn is not None:
                graph_roots.append(t.grad_fn)
            if t.is_leaf or t.retains_grad:
                grad = t.grad
                if grad is not None:
                    self._adopt(grad)
        except Exception:  # an exotic tensor type that has no storage to count
            pass

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "stop":
            self._gc_dirty = max(self._gc_dirty, info.get("generation", 2))

    def _adopt(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._adopt(inner)
            return
        try:
            if t.device.type != "cpu" and not self.fake:
                return
            st = self._storage_of(t)
        except (RuntimeError, NotImplementedError):  # tensors without storage
            return
        if st is not None and id(st) not in self.sizes:
            self._track(st, st.nbytes(), counted=False, label=t.device.type if self.fake else None)

    # -- turning the counter on and off ------------------------------------------

    def start(self, label: str | None = None) -> Tally:
        """Begin a measured block: returns its tally (of one device type, or all), updated until ``stop``."""
        self.adopt_existing()
        tally = Tally(label)
        self.tallies.append(tally)
        if self._mode is None:
            self._patch_storage_resize()
            self._mode = _CountingMode(self)
            self._mode.__enter__()
        return tally

    def stop(self, tally: Tally) -> None:
        """End a measured block (in any order; the counter turns off with the last one)."""
        self.tallies.remove(tally)
        if not self.tallies and self._mode is not None:
            mode, self._mode = self._mode, None
            try:
                mode.__exit__(None, None, None)
            finally:
                torch.UntypedStorage.resize_ = self._orig_storage_resize

    def _patch_storage_resize(self) -> None:
        # UntypedStorage.resize_ does not pass through the dispatcher (FSDP uses it).
        original = self._orig_storage_resize = torch.UntypedStorage.resize_
        ledger = self

        def resize_(storage, size):
            ours = storage.device.type == ledger.storage_device
            if ours and id(storage) not in ledger.sizes:
                ledger._track(storage, storage.nbytes(), counted=False)
            result = original(storage, size)
            if ours:
                ledger.see_storage(storage)
            return result

        resize_.__wrapped__ = original
        torch.UntypedStorage.resize_ = resize_

    @property
    def active(self) -> bool:
        return self._mode is not None


def _fmt(nbytes: int) -> str:
    from .report import format_bytes

    return f"{format_bytes(nbytes)} ({nbytes:,} B)"


def _saved_tensors(roots) -> list[torch.Tensor]:
    """Tensors saved for backward by the autograd graphs that ``roots`` lead to."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    keep = []  # hold nodes so that their ids stay unique during the walk
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        names = _SAVED_NAMES.get(type(node))
        if names is None:
            names = _SAVED_NAMES[type(node)] = [n for n in dir(type(node)) if n.startswith("_saved_")]
        for name in names:
            try:
                value = getattr(node, name)
            except RuntimeError:  # freed by an earlier backward()
                continue
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, (tuple, list)):
                found.extend(v for v in value if isinstance(v, torch.Tensor))
        if hasattr(node, "saved_tensors"):  # a custom autograd.Function
            try:
                found.extend(t for t in node.saved_tensors if isinstance(t, torch.Tensor))
            except RuntimeError:
                pass
        stack.extend(fn for fn, _ in node.next_functions)
    return found


_SAVED_NAMES: dict[type, list[str]] = {}

LEDGER = Ledger()
FAKE_LEDGER = Ledger(fake=True)
