"""The books: every live storage of one kind gpukit knows of, with its size; the queue of storages made and
storages that died, settled in order; each open block's level and peak; the counter switched on and off
(a counting mode pushed on each thread that opens a block, ``UntypedStorage.resize_`` wrapped). ``LEDGER``
counts real CPU memory, ``FAKE_LEDGER`` the storages of fake tensors."""

from __future__ import annotations

import collections
import sys
import threading

import torch

from .._torch import is_traceable_wrapper_subclass, reset_dispatch_mode_flags, set_storage_resize, storage_resize
from .interrupts import INTERRUPTS
from .limits import Limits
from .mode import CountingMode, PerThread
from .records import ADOPTED, BOOK, COUNT, FREED, LIVE, QUEUED, StorageRef, Tally, claim
from .scan import Scan, TensorKinds
from .sizes import ALIGNMENT_LESS_ONE, ALIGNMENT_MASK, round_up


class Ledger(Limits, Scan):
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
        self._refs: dict[int, StorageRef] = {}
        # Storages made inside blocks, and storages that died: a storage's record is put here by the counting
        # mode when the storage is made, and again by its weak reference when it dies (deque.append: no Python
        # code runs, so nothing can interrupt it). ``settle`` books them in that order before anything reads a
        # count, so levels and peaks are the same as if each had been booked at once.
        self._queue: collections.deque = collections.deque()
        self._enqueue = self._queue.append  # the callback of every storage's weak reference (one bound method)
        self.quick = not fake  # whether the counting mode may queue (False while a block books eagerly)
        self._eager = 0  # open blocks that book every allocation as it happens
        self._lock = threading.RLock()  # one thread at a time changes the counts
        self._thread = PerThread()
        self._pushed: dict[CountingMode, threading.Thread] = {}  # counting modes on a thread's stack
        self.tallies: list[Tally] = []  # every open block, on every thread
        self.limits: list[int] = []  # active budgets (gpukit.budget), in rounded bytes
        self._live = 0  # bytes of all known storages, unrounded
        self._live_rounded = 0
        self.listener = None  # a gpukit.allocator.SimulatedDevice told of every allocation and free
        self._orig_storage_resize = None
        self._resize_wrapper = None  # the last UntypedStorage.resize_ wrapper made (its __wrapped__: what it wraps)
        self._tensors: dict[int, StorageRef] = {}  # every tensor object found by a scan, by id
        self._dead_tensors: collections.deque = collections.deque()  # their references, once dead (as _queue)
        # Generational scans rely on CPython <= 3.13's three-generation collector.
        self._incremental = sys.version_info < (3, 14)
        # The collector's own count of collections per generation at the last scan (None: none yet, so the
        # first scan is a full one). Read, not reported by a gc callback: no gpukit code runs inside a
        # collection, where CPython drops any exception, a KeyboardInterrupt from Ctrl-C included.
        self._gc_runs: list[int] | None = None
        self._found: list = []  # a scan's storages not yet booked: (storage, label), booked at its end
        # Storages that stand for host memory where the counted ones stand for a GPU's (a CUDA run keeps an
        # optimizer's step counters on the host: gpukit.hoststate), by key: never counted, never placed
        self.host: dict[int, StorageRef] = {}
        self._kinds = TensorKinds()

    # -- bookkeeping ---------------------------------------------------------

    @property
    def live(self) -> int:
        """Bytes of every live storage the counter knows, unrounded."""
        self.settle()
        return self._live

    @property
    def live_rounded(self) -> int:
        """Bytes of every live storage the counter knows, each rounded up to 512 B."""
        self.settle()
        return self._live_rounded

    def settle(self) -> None:
        """Book the storages queued as made, and the frees of storages that died, in the order they happened."""
        queue = self._queue
        if not queue:
            return
        with self._lock:
            listener = self.listener
            sink = listener.event_queue() if listener is not None else None
            if self.labels or (listener is not None and sink is None) or any(
                    t.label is not None or t.events is not None for t in self.tallies):
                self._settle_each(queue)
            else:
                self._settle_quick(queue, sink)

    def _settle_quick(self, queue: collections.deque, sink: list | None) -> None:
        """``settle`` where no count has a label, no block a timeline, and the simulated device (if any) queues
        events itself (``sink``): ``_allocated`` and ``_freed`` written out, one pass, the totals kept aside.
        Every open block sees the same changes, so the pass keeps one running change and its highest point
        (rounded and not), and each tally takes them at the end: its peak is its level at the start plus that
        highest point, if higher."""
        refs, sizes, popleft = self._refs, self.sizes, queue.popleft
        event = sink.append if sink is not None else None
        # The live totals move with the running change (each booking adds to both): added once, at the end.
        change = change_unrounded = top = top_unrounded = 0
        adopted = adopted_unrounded = 0  # of the change, what the live totals had already (claim: COUNT)
        try:
            while queue:
                ref = queue[0]
                key, state = ref.key, ref.state
                if state == QUEUED:  # made inside a block
                    how = BOOK if refs.get(key) is ref else claim(refs, ref)
                    if how == BOOK:
                        nbytes = ref.nbytes
                        if event is not None and nbytes > 0:  # CUDA hands out no block for an empty storage
                            event((key, nbytes))
                        ref.state = LIVE
                        sizes[key] = nbytes
                    elif how == COUNT:  # adopted by a scan: in the live totals already, in the tallies now
                        nbytes = sizes.get(key, 0)
                        adopted += (nbytes + ALIGNMENT_LESS_ONE) & ALIGNMENT_MASK
                        adopted_unrounded += nbytes
                    else:
                        popleft()
                        continue
                    change += (nbytes + ALIGNMENT_LESS_ONE) & ALIGNMENT_MASK  # round_up, written out
                    change_unrounded += nbytes
                    if change > top:
                        top = change
                    if change_unrounded > top_unrounded:
                        top_unrounded = change_unrounded
                elif state == LIVE or state == ADOPTED:  # died (a storage whose id was taken again while it waited
                    ref.state = FREED                          # here too)
                    if refs.get(key) is ref:
                        del refs[key]
                    if event is not None:
                        event((key, 0))
                    nbytes = sizes.pop(key, 0)
                    if nbytes:
                        change -= (nbytes + ALIGNMENT_LESS_ONE) & ALIGNMENT_MASK
                        change_unrounded -= nbytes
                popleft()
        finally:
            self._live += change_unrounded - adopted_unrounded
            self._live_rounded += change - adopted
            for t in self.tallies:
                if t.level + top > t.peak:
                    t.peak = t.level + top
                if t.level_unrounded + top_unrounded > t.peak_unrounded:
                    t.peak_unrounded = t.level_unrounded + top_unrounded
                t.level += change
                t.level_unrounded += change_unrounded
            if sink is not None:
                self.listener.event_queued()

    def _settle_each(self, queue: collections.deque) -> None:
        refs, sizes = self._refs, self.sizes
        while queue:
            ref = queue[0]
            key, state = ref.key, ref.state
            if state == QUEUED:  # made inside a block
                how = BOOK if refs.get(key) is ref else claim(refs, ref)
                if how != BOOK:
                    if how == COUNT:  # adopted by a scan: in the live totals already, in the tallies now
                        nbytes = sizes.get(key, 0)
                        self._allocated(nbytes)
                        self._live -= nbytes
                        self._live_rounded -= round_up(nbytes)
                    queue.popleft()
                    continue
                if self.listener is not None and self.listener.only is None:  # (queued storages have no label)
                    self.listener.on_alloc(key, ref.nbytes, True)
                ref.state = LIVE
                sizes[key] = ref.nbytes
                self._allocated(ref.nbytes)
            elif state == LIVE or state == ADOPTED:  # died (a storage whose id was taken again while it waited here
                ref.state = FREED                          # too)
                if refs.get(key) is ref:
                    del refs[key]
                if self.listener is not None:
                    self.listener.on_free(key)
                nbytes = sizes.pop(key, 0)
                label = self.labels.pop(key, None)
                if nbytes:
                    self._freed(nbytes, label)
            queue.popleft()

    def _allocated(self, nbytes: int, label: str | None = None) -> None:
        rounded = round_up(nbytes)
        self._live += nbytes
        self._live_rounded += rounded
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
        self._live -= nbytes
        self._live_rounded -= rounded
        if label is not None:
            self.live_by_label[label] -= rounded
        for t in self.tallies:
            if t.label is not None and t.label != label:
                continue
            t.level -= rounded
            t.level_unrounded -= nbytes
            if t.events is not None:
                t.events.append((t.level, t.phase()))

    def _track(self, storage: torch.UntypedStorage, nbytes: int, *, counted: bool, label: str | None = None) -> None:
        key = id(storage)
        if self.listener is not None and self.listener.only in (None, label):  # first: a simulated OOM leaves the
            self.listener.on_alloc(key, nbytes, counted)                       # storage untracked
        ref = StorageRef(storage, self._enqueue)
        ref.key, ref.nbytes, ref.state = key, nbytes, LIVE if counted else ADOPTED
        self._refs[key] = ref
        self.sizes[key] = nbytes
        if label is not None:
            self.labels[key] = label
        if counted:
            self._allocated(nbytes, label)
        else:
            self._live += nbytes
            self._live_rounded += round_up(nbytes)
            if label is not None:
                self.live_by_label[label] = self.live_by_label.get(label, 0) + round_up(nbytes)

    def to_host(self, st: torch.UntypedStorage) -> None:
        """Count ``st`` as host memory from now on, where the counted storages stand for a GPU's: out of the books
        if it is in them (a free, in every open block and on the simulated device), and never counted again,
        whatever op returns it (``hosted``)."""
        with self._lock:
            self.settle()
            key = id(st)
            ref = self._refs.get(key)
            if ref is not None and ref() is st and key in self.sizes:
                del self._refs[key]
                ref.state = FREED  # its death, to come through the queue, is not counted
                if self.listener is not None:
                    self.listener.on_free(key)
                self._freed(self.sizes.pop(key), self.labels.pop(key, None))
            if len(self.host) >= 4096:  # those that died
                self.host = {k: r for k, r in self.host.items() if r() is not None}
            self.host[key] = StorageRef(st)

    def hosted(self, st: torch.UntypedStorage) -> bool:
        """Whether ``st`` is host memory (``to_host``)."""
        ref = self.host.get(id(st))
        return ref is not None and ref() is st

    def _storage_of(self, t: torch.Tensor) -> torch.UntypedStorage | None:
        if t.layout is not torch.strided or is_traceable_wrapper_subclass(t):
            return None
        st = t.untyped_storage()
        return st if st.device.type == self.storage_device else None

    def see_storage(self, st: torch.UntypedStorage, label: str | None = None) -> None:
        """Record ``st`` as allocated now if it is new, or its change of size.

        Raises:
            torch.OutOfMemoryError: when the allocation took the live bytes past an active
                budget (one the op's arguments did not announce; see ``check_request``).
                The storage is counted first: it exists, and its free will be counted too.
        """
        with self._lock:
            self.settle()
            nbytes = st.nbytes()
            key = id(st)
            known = self.sizes.get(key)
            if known is not None and self._refs[key]() is not st:  # a dead storage's id, taken again
                if self.listener is not None:
                    self.listener.on_free(key)
                self._freed(self.sizes.pop(key), self.labels.pop(key, None))
                self._refs.pop(key).state = FREED  # its death, still to come through the queue, is not counted
                known = None
            if known is None:
                if self.host and self.hosted(st):
                    return
                error = self._over_budget(nbytes)
                self._track(st, nbytes, counted=True, label=label)
            elif known != nbytes:
                # Like the allocator: the new block exists before the old one is freed.
                error = self._over_budget(nbytes, st)
                label = self.labels.get(key)
                if self.listener is not None and self.listener.only in (None, label):
                    self.listener.on_resize(key, nbytes)
                self.sizes[key] = self._refs[key].nbytes = nbytes
                self._allocated(nbytes, label)
                self._freed(known, label)
            else:
                return
        if error is not None:
            __tracebackhide__ = True
            try:
                raise error  # a gpukit budget refused the op on your last line above
            finally:
                error = None  # no cycle: the traceback holds this frame, which would hold the error

    def see(self, t: torch.Tensor) -> None:
        """Record the storage of an op's output (called for every op: kept lean)."""
        __tracebackhide__ = True
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

    # -- turning the counter on and off ------------------------------------------

    def start(self, label: str | None = None, *, eager: bool = False) -> Tally:
        """Begin a measured block: returns its tally (of one device type, or all), updated until ``stop``.

        The block counts the process: what every thread inside a block allocates, and every
        free. This thread's counting mode is pushed on its own mode stack if it has none yet.
        ``eager``: book every allocation the moment it happens, not at the next bookkeeping step (a
        timeline tags each change with the phase of training; a simulated cap must fail the allocation
        that passes it); while such a block is open, every block books so.
        """
        with self._lock:
            self.settle()
            self.adopt_existing()
            tally = Tally(label)
            tally.eager = eager
            if self._pushed:
                self._forget_dead_threads()
            mode = self._thread.mode
            if mode is None:
                mode = self._thread.idle
                if mode is None:
                    mode = CountingMode(self)
                else:
                    self._thread.idle = None
                    mode.saw_compile = False  # a new block: warned once more
                if not self._pushed:
                    self._patch_storage_resize()
                self._pushed[mode] = threading.current_thread()
                try:
                    mode.__enter__()
                except BaseException:
                    del self._pushed[mode]
                    if not self._pushed:
                        self._unpatch_storage_resize()
                    raise
                self._thread.mode = mode
            mode.blocks += 1
            tally.mode = mode
            self.tallies.append(tally)
            if eager:
                self._eager += 1
                self.quick = False
        return tally

    def stop(self, tally: Tally) -> None:
        """End a measured block (blocks may end in any order; ending one twice does nothing).

        The counting mode comes off this thread's mode stack with its last block. A block that
        ends on another thread than the one that opened it leaves that thread's mode pushed until
        that thread ends a block of its own (a thread's mode stack is its own to change).
        """
        with self._lock:
            self.settle()
            tallies = self.tallies
            if tallies and tallies[-1] is tally:  # the innermost block ends, as a rule
                self.tallies = tallies[:-1]
            elif any(t is tally for t in tallies):
                self.tallies = [t for t in tallies if t is not tally]
            else:
                return
            if tally.eager:
                self._eager -= 1
                self.quick = not self.fake and self._eager == 0
            mode = tally.mode
            mode.blocks -= 1
            if mode is self._thread.mode and mode.blocks == 0:
                self._thread.mode = None
                try:
                    mode.__exit__(None, None, None)
                    self._thread.idle = mode  # off the stack, whole: this thread's next block pushes it again
                finally:
                    del self._pushed[mode]
            if self._pushed:
                self._forget_dead_threads()
            if not self._pushed:
                self._unpatch_storage_resize()
                reset_dispatch_mode_flags()  # torch 2.10: what the threads' modes left set (gpukit._torch)

    def _forget_dead_threads(self) -> None:
        """A thread's mode stack ends with the thread: forget the modes of threads that ended."""
        for mode, thread in list(self._pushed.items()):
            if not thread.is_alive():
                del self._pushed[mode]
    def _patch_storage_resize(self) -> None:
        # UntypedStorage.resize_ does not pass through the dispatcher (FSDP uses it). The wrapper is made once
        # for each method it wraps (torch's own, as a rule) and kept for the next block.
        original = self._orig_storage_resize = storage_resize()
        wrapper = self._resize_wrapper
        if wrapper is None or wrapper.__wrapped__ is not original:
            wrapper = self._resize_wrapper = self._wrap_storage_resize(original)
        set_storage_resize(wrapper)

    def _wrap_storage_resize(self, original):
        ledger = self

        def resize_(storage, size):
            ours = storage.device.type == ledger.storage_device and ledger._thread.mode is not None
            if ours:
                with ledger._lock:
                    ledger.settle()
                    if id(storage) not in ledger.sizes:
                        ledger._track(storage, storage.nbytes(), counted=False)
                if ledger.limits and size > storage.nbytes():
                    ledger.settle()
                    error = ledger._over_budget(size, storage)
                    if error is not None:
                        __tracebackhide__ = True
                        try:
                            raise error  # a gpukit budget refused the op on your last line above
                        finally:
                            error = None  # no cycle: the traceback holds this frame, which would hold the error
            result = original(storage, size)
            if ours:
                ledger.see_storage(storage)
            return result

        INTERRUPTS.protect(resize_)
        resize_.__wrapped__ = original
        return resize_

    def _unpatch_storage_resize(self) -> None:
        if self._orig_storage_resize is not None:
            set_storage_resize(self._orig_storage_resize)
            self._orig_storage_resize = None

    @property
    def active(self) -> bool:
        """Whether any thread has a block open."""
        return bool(self.tallies) or any(m.blocks for m in self._pushed)


INTERRUPTS.protect(claim, Ledger.to_host, Ledger.start, Ledger.stop, Ledger.settle, Ledger._settle_quick,
                   Ledger._settle_each, Ledger.see_storage, Ledger._track, Ledger._allocated,
                   Ledger._freed, Ledger.adopt_existing, Ledger.check_request,
                   Ledger._patch_storage_resize, Ledger._unpatch_storage_resize, Ledger._forget_dead_threads)

LEDGER = Ledger()
FAKE_LEDGER = Ledger(fake=True)
# One prediction at a time in a process: FAKE_LEDGER counts the storages every thread makes, and a prediction's
# simulated GPU, its CUDA rules and its autocast patch functions of torch's own (F.dropout, torch.autocast's
# __init__, GradScaler's methods) for the whole process. gpukit.estimate.predict, gpukit.offload.predict_offload and
# gpukit.plan hold it: a prediction on another thread waits for the one running (re-entrant: a plan predicts).
ONE_PREDICTION = threading.RLock()


def refuse_inside_a_fake_run(what: str) -> None:
    """Raise where the fake ledger already drives a simulated GPU (held with ``ONE_PREDICTION``, so this thread's):
    ``what`` (``"predict()"``) called inside an ``on_card()`` block or inside the step of a prediction."""
    if FAKE_LEDGER.listener is not None:
        raise RuntimeError(f"{what} cannot run inside an on_card() block, nor inside the step of another prediction: "
                           "the fake tensors' counter is theirs until they end; call it after the block")
