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

Threads: PyTorch keeps its dispatch modes on a stack per thread
(``torch.utils._python_dispatch``, ``TorchDispatchModeTLS`` in c10), so each
thread that opens a block pushes a counting mode of its own and pops it from its
own stack. Every open block counts the process, as the CUDA allocator does:
allocations made on any thread that is inside a block, and every free.

Ctrl-C: a SIGINT that arrives while gpukit updates its own state waits until the
update is done (``INTERRUPTS``), so an interrupt never leaves a block half open.

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

import collections
import contextlib
import operator
import gc
import itertools
import math
import signal
import _signal  # signal's own C module: the same handlers, without the enum conversions a block paid 4 times
import sys
import threading
import weakref

import torch

from ._torch import (FakeTensor, TorchDispatchMode, _disable_current_modes, disabled_torch_dispatch_impl,
                     dynamo_code_in_question, is_traceable_wrapper_subclass, let_dynamo_trace_again, never_traced,
                     op_entry_point, reset_dispatch_mode_flags,
                     set_storage_resize, storage_resize, tree_flatten)

ALIGNMENT = 512  # the CUDA caching allocator rounds every block up to this (kMinBlockSize)
SMALL_REQUEST = 1 << 20  # kSmallSize: requests up to this come from the small pool, split exactly
# round_up(n) == (n + _ALIGNMENT_LESS_ONE) & _ALIGNMENT_MASK for every n >= 0 (ALIGNMENT is a power of two)
_ALIGNMENT_LESS_ONE, _ALIGNMENT_MASK = ALIGNMENT - 1, -ALIGNMENT


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


class Tally:
    """Running level and peak of one measured block, relative to its start.

    ``label`` limits it to the storages of one device type (a fake ledger tells
    fake tensors apart by the device they pretend to be on); None counts all.
    """

    __slots__ = ("level", "level_unrounded", "peak", "peak_unrounded", "label", "events", "phase", "mode", "eager")

    def __init__(self, label: str | None = None) -> None:
        self.level = self.level_unrounded = self.peak = self.peak_unrounded = 0
        self.label = label
        self.events: list | None = None  # (level, phase) after every change, when a timeline is wanted
        self.phase = None  # a callable naming the phase of training (forward, backward, optimizer)
        self.mode = None  # the counting mode of the thread that opened the block
        self.eager = False  # every allocation booked as it happens (a timeline's phases, a simulated cap)


class _DeferredInterrupts:
    """Holds back Ctrl-C while gpukit changes its own state, and delivers it right after.

    Python runs a SIGINT handler between any two bytecodes of the main thread. While a
    block is open on the main thread, gpukit's handler looks at the frames that were
    running: inside one of gpukit's enter/exit or bookkeeping functions it only notes the
    interrupt, which those functions then raise once their state is whole again (an
    interrupted ``__enter__`` first undoes what it did, so the block never starts).
    Anywhere else (the user's code in the block) it calls the handler that was there
    before, so Ctrl-C stops the user's code at once, as always. Other threads never
    receive SIGINT in Python, so only the main thread needs this.
    """

    def __init__(self) -> None:
        self.codes: set = set()
        self.pending = False
        self.depth = 0  # open holds on the main thread
        self.previous = None
        self._installed = self._handler  # one bound method, so that the handler is recognised

    def protect(self, *functions) -> None:
        """Mark functions whose frames hold interrupts back."""
        for fn in functions:
            self.codes.add(getattr(fn, "__func__", fn).__code__)

    def hold(self) -> None:
        """Start holding back interrupts in protected code (call first thing on an enter path)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if self.depth == 0:
            current = _signal.getsignal(signal.SIGINT)
            if current is not self._installed:
                self.previous = current
                _signal.signal(signal.SIGINT, self._installed)
        self.depth += 1

    def release(self) -> None:
        """End a hold (last thing on an exit path); the last one puts the previous handler back.
        Then raise an interrupt that was held back."""
        if threading.current_thread() is not threading.main_thread():
            return
        self.depth = max(self.depth - 1, 0)
        if self.depth == 0 and _signal.getsignal(signal.SIGINT) is self._installed:
            _signal.signal(signal.SIGINT, self.previous)
        self.deliver()

    def deliver(self) -> None:
        """Raise an interrupt that was held back, if there is one."""
        if self.pending:
            self.pending = False
            self._call_previous(signal.SIGINT, sys._getframe(1))

    def _handler(self, signum, frame) -> None:
        codes, f = self.codes, frame
        while f is not None:
            if f.f_code in codes:
                self.pending = True
                return
            f = f.f_back
        self._call_previous(signum, frame)

    def _call_previous(self, signum, frame) -> None:
        previous = self.previous
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt


INTERRUPTS = _DeferredInterrupts()


# A storage's record moves through these states: queued by the counting mode (made, not yet booked), booked
# (counted live), freed. The same record goes through the ledger's queue twice: once when the storage is made,
# once when it dies (its weak reference's callback), so the queue keeps allocations and frees in their order.
_QUEUED, _LIVE, _FREED = 0, 1, 2


class _StorageRef(weakref.ref):
    """A weak reference to a storage (or a tensor object) that knows the key it is filed under, and for a
    storage its size when made and its state."""

    __slots__ = ("key", "nbytes", "state")


def _claim(refs: dict, ref: _StorageRef) -> bool:
    """File a queued record under its key, unless the storage is already booked under another record (queued
    again after an interrupted record): then this one is dropped (False)."""
    current = refs.get(ref.key)
    if current is not None and current.state == _LIVE and current() is not None and current() is ref():
        ref.state = _FREED
        return False
    refs[ref.key] = ref
    return True


class _PerThread(threading.local):
    mode: "_CountingMode | None" = None  # this thread's counting mode, while it has a block open
    idle: "_CountingMode | None" = None  # the mode its last block popped, pushed again by its next one


def _dispatches(cls: type) -> bool:
    """Whether a tensor subclass has a ``__torch_dispatch__`` of its own (``nn.Parameter`` and the like do not)."""
    return getattr(cls, "__torch_dispatch__", None) is not disabled_torch_dispatch_impl


class _CountingMode(TorchDispatchMode):
    """Sees every op a thread runs inside measured blocks and hands its output tensors to the ledger."""

    def __init__(self, ledger: "Ledger") -> None:
        super().__init__()
        self.ledger = ledger
        self.own_types = (torch.Tensor, FakeTensor) if ledger.fake else (torch.Tensor,)
        self.blocks = 0  # blocks open on this mode's thread
        self.saw_compile = False  # torch.compile ran eagerly under this mode (warned once)
        self.declined: set = set()  # code objects dynamo declined to trace because this mode was on

    def ignore_compile_internals(self) -> bool:
        """False, as for every mode (torch/utils/_python_dispatch.py): torch.compile then runs eagerly.

        Dynamo asks this of each mode on the stack before it traces a frame (``any_torch_dispatch_mode_on_stack``
        in ``CatchErrorsWrapper.__call__``, torch/_dynamo/convert_frame.py), and skips the frame while a mode
        that does not ignore it is on: a call here while a block is open means torch.compile ran eagerly in it.
        The codes it skips are noted, to let dynamo trace them again once the mode is off (``__exit__``).
        """
        if self.blocks:
            code = dynamo_code_in_question(2)  # here <- any_torch_dispatch_mode_on_stack <- CatchErrorsWrapper
            if code is not None:
                self.declined.add(code)
            if not self.saw_compile:
                self.saw_compile = True
                from .meter import warn_compile_ran_eagerly

                warn_compile_ran_eagerly()
        return False

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            return super().__exit__(exc_type, exc_value, traceback)
        finally:
            if self.declined:
                declined, self.declined = self.declined, set()
                for code in declined:
                    let_dynamo_trace_again(code)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Not wrapped in torch._disable_dynamo, whose two frames would sit in every traceback of a budget's
        # OutOfMemoryError between the user's line and gpukit's; dynamo skips this code instead (below).
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        __tracebackhide__ = True  # IPython and pytest end a budget's OutOfMemoryError at the user's op
        if not _PLAIN_TENSORS.issuperset(types) and any(t not in self.own_types and _dispatches(t)
                                                          for t in types):
            if any(issubclass(t, FakeTensor) for t in types):
                return func(*args, **(kwargs or {}))  # fake tensors hold no memory to count here
            # Another tensor subclass (DTensor...): let it unwrap itself; the ops
            # it runs on plain tensors come back through this mode.
            return NotImplemented
        ledger = self.ledger
        listener = ledger.listener
        # (A simulated device under a cap must see each allocation as it happens: its OOM comes from the one
        # that passes the cap.)
        if ledger.quick and not ledger.limits and (listener is None or listener._alloc.allowed_memory_maximum is None):
            # The hot path: the op's new storages are queued, booked in order with the frees at the next
            # bookkeeping step (Ledger.settle), before anything reads the counts. Every op of a measured
            # step comes here, so it is written out: no call but the op and the storage's own methods. The op
            # runs through its C++ entry point where its Python __call__ would only forward to it (_alias_entry).
            entry = _ALIASES.get(id(func))  # (by id: an op's own __hash__ is Python code)
            if entry is None:
                entry = _alias_entry(func)
            out = entry[2](*args, **kwargs) if kwargs else entry[2](*args)
            if entry[1]:  # a view, or an in-place op: no storage made, none resized
                if INTERRUPTS.pending:
                    INTERRUPTS.deliver()
                return out
            if type(out) in _PLAIN_TENSORS:
                outs = (out,)
            elif isinstance(out, (tuple, list)):
                outs = out
            else:
                outs = ()
                if isinstance(out, torch.Tensor):
                    self._see_nested(out)
            for t in outs:
                if type(t) not in _PLAIN_TENSORS:  # (a parameter comes back from the optimizer's in-place ops)
                    if isinstance(t, (torch.Tensor, tuple, list)):
                        self._see_nested(t)
                    continue
                if not t.is_cpu or t.layout is not torch.strided:
                    continue
                st = t.untyped_storage()
                key = id(st)
                known = ledger._refs.get(key)
                if known is None or known() is not st:
                    enqueue = ledger._enqueue
                    ref = _StorageRef(st, enqueue)
                    ref.key, ref.nbytes, ref.state = key, st.nbytes(), _QUEUED
                    # Queued first: a Ctrl-C between these two lines leaves a record the queue books (and
                    # books once, should the storage be queued again), never a storage known but not counted.
                    enqueue(ref)
                    ledger._refs[key] = ref
                elif known.nbytes != st.nbytes():
                    ledger.see_storage(st)  # resized in place (an out= op): booked at once
            if INTERRUPTS.pending:
                INTERRUPTS.deliver()
            return out
        kwargs = kwargs or {}
        if ledger.limits:
            ledger.check_request(func, args, kwargs)  # refuse before the memory is taken
        try:
            out = func(*args, **kwargs)
        except RuntimeError as err:
            if ledger.limits and not isinstance(err, torch.OutOfMemoryError) and "can't allocate memory" in str(err):
                raise torch.OutOfMemoryError(f"out of memory under a gpukit budget (CPU): the machine itself "
                                             f"could not provide the memory: {err}") from err
            raise
        see = ledger.see
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
        if INTERRUPTS.pending:
            INTERRUPTS.deliver()
        return out

    def _see_nested(self, out) -> None:
        see = self.ledger.see
        if isinstance(out, torch.Tensor):
            see(out)
        else:
            for o in out:
                if isinstance(o, torch.Tensor):
                    see(o)


never_traced(_CountingMode.__torch_dispatch__.__code__)


# id(op) -> (op, whether it only returns tensors of storages its inputs have: _aliases_only, what runs it:
# op_entry_point). Keyed by id, since hashing an OpOverload runs Python code (its __hash__) on every op of a
# measured step; the entry holds the op, so no other object can take its id while the entry exists.
_ALIASES: dict = {}


def _alias_entry(func) -> tuple:
    entry = _ALIASES[id(func)] = (func, _aliases_only(func), op_entry_point(func))
    return entry


def _aliases_only(func) -> bool:
    """Whether every tensor an op returns aliases one of its inputs, and it cannot change a storage's size:
    views (``view``, ``t``, ``split``, ``detach``) and in-place ops (``add_``, ``mul_``); not ``out=`` ops, which
    may resize their output, nor ``resize_`` and ``set_``. From the op's schema: its returns' alias annotations
    (``Tensor(a)``, ``Tensor(a!)``, as in native_functions.yaml)."""
    schema = func._schema
    returns = schema.returns
    if not returns or any(r.alias_info is None for r in returns):
        return False
    if any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False  # an out= overload
    name = schema.name.split("::")[-1]
    if "resize" in name or name.startswith(("set_", "_set", "lift")):
        # lift_fresh returns its input, a tensor made outside the dispatcher (torch.tensor(0) makes one, then
        # lifts it): its storage is seen first there.
        return False
    return all(not r.alias_info.is_write for r in returns) or name.endswith("_")


def _numel(size) -> int:
    return math.prod(int(n) for n in size)


def _requests(func, args, kwargs) -> list[tuple["torch.UntypedStorage | None", int]]:
    """What an op will allocate on the CPU, known before it runs: a list of (storage that grows, or None for a
    new one; its bytes). From the arguments where they say it (factory ops with a size: ``empty``, ``zeros``,
    ``randn``, ``new_*``, ``*_like``; ``resize_``), else from the op run on meta tensors, which allocate nothing
    (``out=`` tensors an op resizes; the outputs of any other op that makes new storages: ``x.expand(n)
    .contiguous()`` asks for no size, yet makes ``n`` elements). An op without a meta kernel, or whose output
    sizes depend on its data (``nonzero``), is counted after it runs."""
    schema = func._schema
    names = [a.name for a in schema.arguments]
    values = dict(zip(names, args))
    values.update(kwargs)
    found = []
    if func is torch.ops.aten.resize_.default:
        t, size = args[0], args[1]
        if t.is_cpu and t.layout is torch.strided:
            found.append((t.untyped_storage(), (t.storage_offset() + _numel(size)) * t.element_size()))
        return found
    outs = values.get("out")
    if outs is not None:
        outs = [outs] if isinstance(outs, torch.Tensor) else [o for o in outs if isinstance(o, torch.Tensor)]
        outs = [o for o in outs if o.is_cpu and o.layout is torch.strided and type(o) is torch.Tensor]
        if not outs:
            return found
        if "size" in values and len(outs) == 1:
            shapes = [values["size"]]
        else:  # the shapes the op will give its outputs
            result = _on_meta(func, args, kwargs)
            if result is None:
                return found
            if len(result) != len(outs):
                return found
            shapes = [r.shape for r in result]
        for o, shape in zip(outs, shapes):
            found.append((o.untyped_storage(), (o.storage_offset() + _numel(shape)) * o.element_size()))
        return found
    if "dtype" in values or "dtype" in names:
        self = values.get("self")
        self = self if isinstance(self, torch.Tensor) else None
        device = values.get("device") or (self.device if self is not None else torch.device("cpu"))
        if torch.device(device).type != "cpu" or values.get("layout") not in (None, torch.strided):
            return found
        dtype = values.get("dtype") or (self.dtype if self is not None else torch.get_default_dtype())
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        if "size" in names and isinstance(values.get("size"), (list, tuple, torch.Size)):
            size = values["size"]
            if "stride" in values:  # empty_strided: the farthest element, plus one
                numel = 0 if 0 in size else 1 + sum((int(n) - 1) * int(st) for n, st in zip(size, values["stride"]))
            else:
                numel = _numel(size)
            found.append((None, numel * itemsize))
        elif self is not None and schema.name.endswith("_like"):
            found.append((None, self.numel() * itemsize))
        if found:
            return found
    aliases = _ALIASES.get(id(func)) or _alias_entry(func)
    if aliases[1]:
        return found  # a view or an in-place op: no new storage
    try:
        key = (func, _meta_key(args), _meta_key(kwargs))
        nbytes = _FRESH_BYTES.get(key)
    except TypeError:  # an argument that is no plain value (a generator, a symbolic size): sized afresh
        key = nbytes = None
    if nbytes is None:
        nbytes = 0
        fresh = [i for i, r in enumerate(schema.returns) if r.alias_info is None]
        if fresh and any(isinstance(a, torch.Tensor) and a.is_cpu for a in tree_flatten((args, kwargs))[0]):
            result = _on_meta(func, args, kwargs)
            if result is not None and len(result) == len(schema.returns):
                nbytes = sum(r.untyped_storage().nbytes() for i, r in enumerate(result)
                             if i in fresh and isinstance(r, torch.Tensor))
        if key is not None:
            if len(_FRESH_BYTES) >= 4096:  # a step repeats its few hundred shapes: start over past that
                _FRESH_BYTES.clear()
            _FRESH_BYTES[key] = nbytes
    if nbytes:
        found.append((None, nbytes))
    return found


# What an op's new storages take, by its arguments' shapes, strides, dtypes and plain values (_meta_key): a
# training step repeats the same ops on the same shapes, and running each on meta tensors costs 0.2 ms.
_FRESH_BYTES: dict = {}
_KEYABLE = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _meta_key(v):
    """A hashable stand-in for an op's argument that determines its outputs' sizes; TypeError for any other."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.device.type, tuple(v.shape), v.stride(), v.layout)
    if type(v) in _KEYABLE:
        return (type(v), v)  # 1 and True (and 1.0) size outputs differently (dtype promotion)
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_meta_key(x) for x in v))
    if isinstance(v, dict):
        return tuple((k, _meta_key(x)) for k, x in v.items())
    raise TypeError(type(v))


def _on_meta(func, args, kwargs) -> list | None:
    """The op's outputs computed on meta tensors of the same shapes, strides and dtypes (no memory, no data), or
    None where the op has no meta kernel or its outputs' sizes depend on the data."""
    def meta(v):
        if isinstance(v, torch.Tensor):
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        if isinstance(v, (list, tuple)):
            return type(v)(meta(x) for x in v)
        return v
    try:
        result = func(*meta(list(args)), **{k: meta(v) for k, v in kwargs.items()})
    except Exception:
        return None
    return [result] if isinstance(result, torch.Tensor) else list(result) if isinstance(result, (list, tuple)) \
        else None


_PLAIN_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))  # tensor types with nothing of their own to unwrap


def _tensor_types() -> frozenset:
    """``torch.Tensor`` and every subclass of it that exists now (an object is a tensor when its type is one)."""
    kinds, todo = {torch.Tensor}, [torch.Tensor]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in kinds:
                kinds.add(sub)
                todo.append(sub)
    return frozenset(kinds)


class _TensorKinds:
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
        self._refs: dict[int, _StorageRef] = {}
        # Storages made inside blocks, and storages that died: a storage's record is put here by the counting
        # mode when the storage is made, and again by its weak reference when it dies (deque.append: no Python
        # code runs, so nothing can interrupt it). ``settle`` books them in that order before anything reads a
        # count, so levels and peaks are the same as if each had been booked at once.
        self._queue: collections.deque = collections.deque()
        self._enqueue = self._queue.append  # the callback of every storage's weak reference (one bound method)
        self.quick = not fake  # whether the counting mode may queue (False while a block books eagerly)
        self._eager = 0  # open blocks that book every allocation as it happens
        self._lock = threading.RLock()  # one thread at a time changes the counts
        self._thread = _PerThread()
        self._pushed: dict[_CountingMode, threading.Thread] = {}  # counting modes on a thread's stack
        self.tallies: list[Tally] = []  # every open block, on every thread
        self.limits: list[int] = []  # active budgets (gpukit.budget), in rounded bytes
        self._live = 0  # bytes of all known storages, unrounded
        self._live_rounded = 0
        self.listener = None  # a gpukit.allocator.SimulatedDevice told of every allocation and free
        self._orig_storage_resize = None
        self._resize_wrapper = None  # the last UntypedStorage.resize_ wrapper made (its __wrapped__: what it wraps)
        self._tensors: dict[int, _StorageRef] = {}  # every tensor object found by a scan, by id
        self._dead_tensors: collections.deque = collections.deque()  # their references, once dead (as _queue)
        # Generational scans rely on CPython <= 3.13's three-generation collector.
        self._incremental = sys.version_info < (3, 14)
        # The collector's own count of collections per generation at the last scan (None: none yet, so the
        # first scan is a full one). Read, not reported by a gc callback: no gpukit code runs inside a
        # collection, where CPython drops any exception, a KeyboardInterrupt from Ctrl-C included.
        self._gc_runs: list[int] | None = None
        self._kinds = _TensorKinds()

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
        try:
            while queue:
                ref = queue[0]
                key, state = ref.key, ref.state
                if state == _QUEUED:  # made inside a block
                    if refs.get(key) is not ref and not _claim(refs, ref):
                        popleft()
                        continue
                    nbytes = ref.nbytes
                    if event is not None and nbytes > 0:  # CUDA hands out no block for an empty storage
                        event((key, nbytes))
                    ref.state = _LIVE
                    sizes[key] = nbytes
                    change += (nbytes + _ALIGNMENT_LESS_ONE) & _ALIGNMENT_MASK  # round_up, written out
                    change_unrounded += nbytes
                    if change > top:
                        top = change
                    if change_unrounded > top_unrounded:
                        top_unrounded = change_unrounded
                elif state == _LIVE:  # died (a storage whose id was taken again while it waited here too)
                    ref.state = _FREED
                    if refs.get(key) is ref:
                        del refs[key]
                    if event is not None:
                        event((key, 0))
                    nbytes = sizes.pop(key, 0)
                    if nbytes:
                        change -= (nbytes + _ALIGNMENT_LESS_ONE) & _ALIGNMENT_MASK
                        change_unrounded -= nbytes
                popleft()
        finally:
            self._live += change_unrounded
            self._live_rounded += change
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
            if state == _QUEUED:  # made inside a block
                if refs.get(key) is not ref and not _claim(refs, ref):
                    queue.popleft()
                    continue
                if self.listener is not None:
                    self.listener.on_alloc(key, ref.nbytes, True)
                ref.state = _LIVE
                sizes[key] = ref.nbytes
                self._allocated(ref.nbytes)
            elif state == _LIVE:  # died (a storage whose id was taken again while it waited here too)
                ref.state = _FREED
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
        if self.listener is not None:  # first: a simulated OOM leaves the storage untracked
            self.listener.on_alloc(key, nbytes, counted)
        ref = _StorageRef(storage, self._enqueue)
        ref.key, ref.nbytes, ref.state = key, nbytes, _LIVE
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
                self._refs.pop(key).state = _FREED  # its death, still to come through the queue, is not counted
                known = None
            if known is None:
                error = self._over_budget(nbytes)
                self._track(st, nbytes, counted=True, label=label)
            elif known != nbytes:
                # Like the allocator: the new block exists before the old one is freed.
                error = self._over_budget(nbytes, st)
                if self.listener is not None:
                    self.listener.on_resize(key, nbytes)
                label = self.labels.get(key)
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

    def _over_budget(self, nbytes: int, storage: torch.UntypedStorage | None = None
                     ) -> torch.OutOfMemoryError | None:
        """The error for ``nbytes`` more (a new storage, or ``storage`` at its new size), or None if they fit."""
        if not self.limits:
            return None
        want, live, tightest = round_up(nbytes), self._live_rounded, None
        for cap in self.limits:
            # A cap may leave storages out: those gpukit.budget(host=...) says a GPU run keeps in host memory.
            host = cap.host_bytes(self) if hasattr(cap, "host_bytes") else 0
            if host and storage is not None and cap.holds(storage):
                continue  # host memory that grows is not the device's
            if tightest is None or cap - live + host < tightest[0]:
                tightest = (cap - live + host, cap, host)
        if tightest is None or want <= tightest[0]:
            return None
        room, limit, host = tightest
        on_host = f" (not counting {_fmt(host)} on the host)" if host else ""
        return torch.OutOfMemoryError(
            f"out of memory under a gpukit budget ({'fake tensors' if self.fake else 'CPU, simulated'}). "
            f"Tried to allocate {_fmt(want)}; {_fmt(live - host)} already allocated{on_host}; "
            f"budget {_fmt(int(limit))}, of which {_fmt(max(room, 0))} free.")

    def check_request(self, func, args, kwargs) -> None:
        """Refuse an op, before it runs, whose arguments ask for more memory than the budget leaves.

        Raises:
            torch.OutOfMemoryError: as the CUDA allocator would, before any memory is taken.
        """
        if self.fake:
            return
        for storage, nbytes in _requests(func, args, kwargs):
            if storage is not None and nbytes <= storage.nbytes():
                continue  # fits in the storage it has
            self.settle()
            error = self._over_budget(nbytes, storage)
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

    # -- finding what existed before a block -----------------------------------

    def adopt_existing(self) -> None:
        """Learn every CPU storage Python can reach now, without counting it as allocated.

        The first call scans every object the garbage collector tracks; later calls
        scan only the generations that can hold tensors made since the last scan
        (a tensor is born in generation 0 and moves up only when a collection
        runs, which ``gc.get_stats()`` counts). Tensors found before are re-read
        every time, since their ``.grad``, graph or storage may have changed.
        """
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
                if type(obj) in _PLAIN_TENSORS or self._keep(obj):
                    # The callback is deque.append, as for storages: no Python code runs when a tensor dies.
                    ref = tensors[id(obj)] = _StorageRef(obj, dead.append)
                    ref.key = id(obj)
                else:
                    self._read(obj, [])
        obj = found = None
        graph_roots: list = []
        sizes, plain, strided = self.sizes, (_PLAIN_TENSORS if not self.fake else ()), torch.strided
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
                    self._track(st, st.nbytes(), counted=False)
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
                        self._track(st, st.nbytes(), counted=False)
                else:
                    self._adopt(grad)
        obj = grad = st = None
        if graph_roots:
            # Reading a saved tensor runs the unpack hook it was saved with (saved_tensors_hooks) and an op or
            # two (a detach), under whatever modes this thread has: a fake mode would turn a real saved tensor
            # into a new fake one, which the fake ledger would adopt and then see die inside the block,
            # lowering its peak. The graphs are read with the thread's modes off.
            with _disable_current_modes():
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
        if type(t) in _PLAIN_TENSORS and not self.fake:  # every block re-reads each known tensor: the common case
            if t.is_cpu and t.layout is torch.strided:
                st = t.untyped_storage()
                if id(st) not in self.sizes:
                    self._track(st, st.nbytes(), counted=False)
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
            self._track(st, st.nbytes(), counted=False, label=t.device.type if self.fake else None)

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
                    mode = _CountingMode(self)
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

INTERRUPTS.protect(_claim, Ledger.start, Ledger.stop, Ledger.settle, Ledger._settle_quick, Ledger._settle_each, Ledger.see_storage, Ledger._track, Ledger._allocated,
                   Ledger._freed, Ledger.adopt_existing, Ledger.check_request,
                   Ledger._patch_storage_resize, Ledger._unpatch_storage_resize, Ledger._forget_dead_threads)

LEDGER = Ledger()
FAKE_LEDGER = Ledger(fake=True)
