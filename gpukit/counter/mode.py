"""The counting mode: a ``TorchDispatchMode`` that sees every op a thread runs inside measured blocks and hands
the storages of its outputs to the ledger (queued on the hot path, booked at once where a budget or a timeline
needs it); which ops only alias their inputs, read from their schemas; and the warning that ``torch.compile`` ran
eagerly under it (``CompileRanEagerWarning``)."""

from __future__ import annotations

import os
import sys
import threading
import warnings

import torch

from .._torch import (FakeTensor, TorchDispatchMode, disabled_torch_dispatch_impl, dynamo_code_in_question,
                      let_dynamo_trace_again, never_traced, op_entry_point)
from .interrupts import INTERRUPTS
from .records import QUEUED, StorageRef


class CompileRanEagerWarning(UserWarning):
    """``torch.compile`` ran eagerly inside a measured CPU block, so the block measured the eager program."""


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn``, called from here, that names the innermost frame outside
    torch, gpukit and IPython (whose magics run a cell): the user's line, however deep the warning is found.
    IPython 7 (Colab's) wraps each magic in a function the ``decorator`` package writes, named
    ``<decorator-gen-N>``: that frame is IPython's too."""
    modules = (torch, sys.modules[__package__.partition('.')[0]], sys.modules.get("IPython"))
    internal = (*(os.path.dirname(m.__file__) + os.sep for m in modules if m is not None), "<decorator-gen-")
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1
    return level


def warn_compile_ran_eagerly() -> None:
    """Warn that torch.compile ran eagerly in a measured CPU block (once per block; see CountingMode)."""
    warnings.warn(
        "torch.compile ran eagerly inside a gpukit block on the CPU: dynamo does not compile while a "
        "TorchDispatchMode is active, and gpukit counts CPU memory with one. So the figures are those of the "
        "eager program, not of the compiled graph (whose fused kernels may skip intermediate tensors). Measure the "
        "compiled model on a GPU, or compare without torch.compile. After the block torch.compile compiles "
        "as before.",
        CompileRanEagerWarning, stacklevel=user_stacklevel())


class PerThread(threading.local):
    """A thread's counting modes (PyTorch keeps its dispatch modes on a stack per thread)."""

    mode: "CountingMode | None" = None  # this thread's counting mode, while it has a block open
    idle: "CountingMode | None" = None  # the mode its last block popped, pushed again by its next one


def _dispatches(cls: type) -> bool:
    """Whether a tensor subclass has a ``__torch_dispatch__`` of its own (``nn.Parameter`` and the like do not)."""
    return getattr(cls, "__torch_dispatch__", None) is not disabled_torch_dispatch_impl


class CountingMode(TorchDispatchMode):
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
        if not PLAIN_TENSORS.issuperset(types) and any(t not in self.own_types and _dispatches(t)
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
            # runs through its C++ entry point where its Python __call__ would only forward to it (alias_entry).
            entry = ALIASES.get(id(func))  # (by id: an op's own __hash__ is Python code)
            if entry is None:
                entry = alias_entry(func)
            out = entry[2](*args, **kwargs) if kwargs else entry[2](*args)
            if entry[1]:  # a view, or an in-place op: no storage made, none resized
                if INTERRUPTS.pending:
                    INTERRUPTS.deliver()
                return out
            if type(out) in PLAIN_TENSORS:
                outs = (out,)
            elif isinstance(out, (tuple, list)):
                outs = out
            else:
                outs = ()
                if isinstance(out, torch.Tensor):
                    self._see_nested(out)
            for t in outs:
                if type(t) not in PLAIN_TENSORS:  # (a parameter comes back from the optimizer's in-place ops)
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
                    ref = StorageRef(st, enqueue)
                    ref.key, ref.nbytes, ref.state = key, st.nbytes(), QUEUED
                    # Queued first: a Ctrl-C between these two lines leaves a record the queue books (and
                    # books once, should the storage be queued again), never a storage known but not counted.
                    # Filed only under a free key: a scan on another thread (Ledger.start) may have filed this
                    # very storage since the lookup above, and its record must stay (its weak reference books the
                    # death); one of a dead storage is taken out by its own death, queued before this record.
                    enqueue(ref)
                    ledger._refs.setdefault(key, ref)
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


never_traced(CountingMode.__torch_dispatch__.__code__)


# id(op) -> (op, whether it only returns tensors of storages its inputs have: aliases_only, what runs it:
# op_entry_point). Keyed by id, since hashing an OpOverload runs Python code (its __hash__) on every op of a
# measured step; the entry holds the op, so no other object can take its id while the entry exists.
ALIASES: dict = {}


def alias_entry(func) -> tuple:
    """An op's entry of ``ALIASES``, made the first time the op runs in a block."""
    entry = ALIASES[id(func)] = (func, aliases_only(func), op_entry_point(func))
    return entry


def aliases_only(func) -> bool:
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

PLAIN_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))  # tensor types with nothing of their own to unwrap
