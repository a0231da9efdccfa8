"""Finding what existed before a block: every tensor Python can reach (``gc``, generation by generation),
their ``.grad``, and the tensors autograd's graphs saved, adopted without counting them as allocated; and
``gc_paused``, which keeps the collector still while a block runs."""

from __future__ import annotations

import contextlib
import gc
import itertools

import torch

from .._torch import FakeTensor, _disable_current_modes, is_traceable_wrapper_subclass
from .mode import PLAIN_TENSORS
from .records import StorageRef


class Scan:
    """The ledger's part that finds the storages of tensors made before its blocks."""

    def adopt_existing(self) -> None:
        """Learn every CPU storage Python can reach now, without counting it as allocated.

        The first call scans every object the garbage collector tracks; later calls
        scan only the generations that can hold tensors made since the last scan
        (a tensor is born in generation 0 and moves up only when a collection
        runs, which ``gc.get_stats()`` counts). Tensors found before are re-read
        every time, since their ``.grad``, graph or storage may have changed.
        """
        # The storages found are booked at the end, after what other threads' blocks queued meanwhile: a
        # thread inside a block holds each new tensor for a moment before queueing its storage, and the scan may
        # meet it there (Ledger.settle books that one in the tallies when its record comes: claim, COUNT).
        self._found = found_storages = []
        runs, before = [g["collections"] for g in gc.get_stats()], self._gc_runs
        self._gc_runs = runs
        # The oldest generation collected since the last scan: its survivors moved one generation up.
        if before is None or runs[2] != before[2]:
            dirty = 2
        elif runs[1] != before[1]:
            dirty = 1
        else:
            dirty = 0 if runs[0] != before[0] else -1
        tensors, dead = self._tensors, self._dead_tensors
        while dead:
            ref = dead.popleft()
            if tensors.get(ref.key) is ref:
                del tensors[ref.key]
        full = dirty >= 1 or not self._incremental
        for gen in (None,) if full else range(dirty + 2):
            # No list may be built around these: one made before the call would be
            # inside it, a cycle that keeps every object listed alive until the next collection.
            found = gc.get_objects() if gen is None else gc.get_objects(gen)
            kinds = self._kinds.all() if gen is None else self._kinds.among(found)
            # The tensors among them, picked without a Python step per object (a full scan meets
            # hundreds of thousands of objects, nearly none of them tensors).
            for obj in itertools.compress(found, map(kinds.__contains__, map(type, found))):
                known = tensors.get(id(obj))
                if known is not None and known() is obj:
                    continue
                if type(obj) in PLAIN_TENSORS or self._keep(obj):
                    # The callback is deque.append, as for storages: no Python code runs when a tensor dies.
                    ref = tensors[id(obj)] = StorageRef(obj, dead.append)
                    ref.key = id(obj)
                else:
                    self._read(obj, [])
        obj = found = None
        graph_roots: list = []
        sizes, plain, strided = self.sizes, (PLAIN_TENSORS if not self.fake else ()), torch.strided
        for ref in list(tensors.values()):
            obj = ref()
            if obj is None:
                continue
            if type(obj) not in plain:
                self._read(obj, graph_roots)
                continue
            # _read, written out for the common case (parameters, gradients, optimizer state: every block
            # re-reads each of them): a plain tensor's storage, its graph, and a leaf's gradient.
            if obj.is_cpu and obj.layout is strided:
                st = obj.untyped_storage()
                if id(st) not in sizes:
                    found_storages.append((st, None))
            grad_fn = obj.grad_fn
            if grad_fn is not None:
                graph_roots.append(grad_fn)
                if not obj.retains_grad:
                    continue
            grad = obj.grad
            if grad is not None:
                if type(grad) in plain and grad.is_cpu and grad.layout is strided:  # _adopt's common case
                    st = grad.untyped_storage()
                    if id(st) not in sizes:
                        found_storages.append((st, None))
                else:
                    self._adopt(grad)
        obj = grad = st = None
        if graph_roots:
            # Reading a saved tensor runs the unpack hook it was saved with (saved_tensors_hooks) and an op or
            # two (a detach), under whatever modes this thread has: a fake mode would turn a real saved tensor
            # into a new fake one, which the fake ledger would adopt and then see die inside the block,
            # lowering its peak. The graphs are read with the thread's modes off.
            with _disable_current_modes():
                for t in saved_tensors(graph_roots):
                    self._adopt(t)
        if found_storages:
            self.settle()
            sizes = self.sizes
            for st, label in found_storages:
                if id(st) not in sizes and not (self.host and self.hosted(st)):
                    self._track(st, st.nbytes(), counted=False, label=label)
            found_storages.clear()

    def _keep(self, t: torch.Tensor) -> bool:
        """Whether to keep a weak reference to this tensor object between scans.

        Not to tensor subclasses that PyTorch may swap in place (DTensor: FSDP2;
        fake tensors: ``nn.Module.to()`` swaps a fake parameter always): ``torch.utils.swap_tensors``
        refuses tensors with weak references. Their storages are adopted when first found; what they
        gain later (a ``.grad``, a graph) is a new object, found by the next scan of the young ones.
        """
        return not is_traceable_wrapper_subclass(t) and not isinstance(t, FakeTensor)

    def _read(self, t: torch.Tensor, graph_roots: list) -> None:
        """Adopt a tensor's storage, its ``.grad``, and note its autograd graph."""
        try:
            self._adopt(t)
            # The fake ledger's tensors are fake: a real tensor's graph holds none of them.
            if t.grad_fn is not None and (not self.fake or isinstance(t, FakeTensor) or t.is_meta):
                graph_roots.append(t.grad_fn)
            if t.is_leaf or t.retains_grad:
                grad = t.grad
                if grad is not None:
                    self._adopt(grad)
        except Exception:  # an exotic tensor type that has no storage to count
            pass

    def _adopt(self, t: torch.Tensor) -> None:
        if type(t) in PLAIN_TENSORS and not self.fake:  # every block re-reads each known tensor: the common case
            if t.is_cpu and t.layout is torch.strided:
                st = t.untyped_storage()
                if id(st) not in self.sizes:
                    self._found.append((st, None))
            return
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
            self._found.append((st, t.device.type if self.fake else None))


def _tensor_types() -> frozenset:
    """``torch.Tensor`` and every subclass of it that exists now (an object is a tensor when its type is one)."""
    kinds, todo = {torch.Tensor}, [torch.Tensor]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in kinds:
                kinds.add(sub)
                todo.append(sub)
    return frozenset(kinds)


class TensorKinds:
    """The tensor types among a scan's objects, known without walking every subclass of ``torch.Tensor`` each
    time (a process with IPython and torch's subsystems loaded has many: the walk cost a block 40 us): the
    types met before are remembered as tensor types or not, and only a type not met before is asked."""

    _MAX_OTHERS = 4096  # non-tensor types remembered (classes made on the fly would otherwise pile up)

    def __init__(self) -> None:
        self.kinds: frozenset = frozenset()
        self.others: set = set()
        self.met: set = set()  # kinds | others: a scan whose types are all in it has nothing to ask

    def all(self) -> frozenset:
        """Every tensor type that exists now (for a full scan, whose objects are too many to collect types of)."""
        self.kinds = _tensor_types()
        self.met = self.kinds | self.others
        return self.kinds

    def among(self, objects: list) -> frozenset:
        """The tensor types, a superset of those of ``objects``."""
        if self.met.issuperset(map(type, objects)):  # no type not met before (as a rule): no set to build
            return self.kinds
        new = set(map(type, objects))
        new -= self.kinds
        new -= self.others
        if new:
            found = {t for t in new if issubclass(t, torch.Tensor)}
            if found:
                self.kinds = self.kinds | found
            if len(self.others) > self._MAX_OTHERS:
                self.others.clear()
            self.others |= new - found
            self.met = self.kinds | self.others
        return self.kinds


@contextlib.contextmanager
def gc_paused(full: bool = True):
    """Collect garbage (unless ``full`` is false), then keep the collector still until the end: garbage made
    before (an earlier prediction's fake tensors, say) freed in the middle of a measured step would otherwise
    count as the step's own frees.

    Yields ``collect_young()``, which frees what became garbage since the pause began as a full
    collection would, at the cost of a young one: while the collector is still, what is made stays in the
    youngest generation, and only a collection moves it up (this one's own, or one someone ran anyway:
    each is followed, and the generations it filled are collected too).
    """
    if full:
        gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    runs = [g["collections"] for g in gc.get_stats()]
    filled = [0]  # the oldest generation that may hold objects made during the pause

    def collect_young() -> None:
        since = [g["collections"] for g in gc.get_stats()]
        foreign = max((gen for gen in range(3) if since[gen] != runs[gen]), default=-1)
        gen = min(max(filled[0], foreign + 1), 2)
        gc.collect(gen)
        filled[0] = min(gen + 1, 2)  # the survivors moved up a generation
        runs[:] = [g["collections"] for g in gc.get_stats()]

    try:
        yield collect_young
    finally:
        if was_enabled:
            gc.enable()


def saved_tensors(roots) -> list[torch.Tensor]:
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

