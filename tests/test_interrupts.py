"""Ctrl-C at any line of gpukit's enter/exit code: the interrupt is raised exactly once, never swallowed,
and leaves no block open, no budget on, no counting mode pushed and no drift in the counter.

A real SIGINT (signal.raise_signal, as Ctrl-C sends) is raised at each distinct line that the enter and
exit paths of ``budget`` and ``measure`` run, one line per run.

The tests set SIGINT's handler themselves: a process started with SIGINT ignored (a shell's background job
without job control, as a CI runner may start the suite) inherits that, Python then installs no
KeyboardInterrupt handler, and Ctrl-C must stay ignored inside a block as outside it.
"""

import gc

import os
import pathlib
import signal
import sys

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

import gpukit
from gpukit.counter import INTERRUPTS, LEDGER, round_up

HERE = os.path.dirname(gpukit.__file__)
COUNTER = sorted(str(p) for p in pathlib.Path(HERE, "counter").glob("*.py"))  # the counter package, every module
TRACED = tuple(COUNTER) + tuple(os.path.join(HERE, f) for f in ("meter.py", "budget.py", "roles.py")) + (
    os.path.join(os.path.dirname(torch.__file__), "utils", "_python_dispatch.py"),)


def scenario(model, optimizer, x):
    with gpukit.budget("1 GiB", device="cpu"):
        with gpukit.measure(device="cpu", record=False, timeline=True, model=model, optimizer=optimizer) as r:
            y = model(x).sum()
            y.backward()
            del y
    return r


class Injector:
    """A trace function that raises SIGINT at the first time the run reaches one chosen line."""

    def __init__(self, target=None):
        self.target, self.lines, self.fired = target, [], False

    def __call__(self, frame, event, arg):
        if frame.f_code.co_filename not in TRACED:
            return None
        return self.local

    def local(self, frame, event, arg):
        if event == "line":
            where = (frame.f_code.co_filename, frame.f_lineno)
            if self.target is None:
                if where not in self.seen:
                    self.seen.add(where)
                    self.lines.append(where)
            elif where == self.target and not self.fired:
                self.fired = True
                signal.raise_signal(signal.SIGINT)
        return self.local

    seen: set


def run_traced(injector, *args):
    sys.settrace(injector)
    try:
        return scenario(*args)
    finally:
        sys.settrace(None)


def state():
    return (list(LEDGER.tallies), list(LEDGER.limits), LEDGER.active, dict(LEDGER._pushed), INTERRUPTS.depth,
            INTERRUPTS.pending, signal.getsignal(signal.SIGINT), _get_current_dispatch_mode(),
            getattr(torch.UntypedStorage.resize_, "__wrapped__", None))


@pytest.fixture
def sigint(request):
    """SIGINT's handler for the test (Python's default one unless parametrized), the inherited one after."""
    inherited = signal.getsignal(signal.SIGINT)
    handler = getattr(request, "param", signal.default_int_handler)
    signal.signal(signal.SIGINT, handler)
    yield handler
    signal.signal(signal.SIGINT, inherited)


@pytest.mark.skipif(sys.gettrace() is not None, reason="needs the trace hook (coverage or a debugger holds it)")
@pytest.mark.parametrize("sigint", [signal.default_int_handler, signal.SIG_IGN], indirect=True,
                         ids=["python-handler", "ignored"])
def test_an_interrupt_at_any_line_of_enter_or_exit_leaves_nothing_behind(sigint):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters())
    x = torch.ones(8, 64)
    scenario(model, optimizer, x)  # warm up: grads exist, the counter knows the process
    clean = state()
    with gpukit.measure(device="cpu", record=False):
        pass
    live = LEDGER.live

    finder = Injector()
    finder.seen = set()
    run_traced(finder, model, optimizer, x)
    assert len(finder.lines) > 50  # the enter and exit paths, not just a line or two

    interrupted, missed = 0, []
    # Ignored, every line would only show that nothing happens: every fourth is enough for that.
    lines = finder.lines if sigint is signal.default_int_handler else finder.lines[::4]
    for line in lines:
        injector = Injector(line)
        try:
            run_traced(injector, model, optimizer, x)
        except KeyboardInterrupt:
            interrupted += 1
        if not injector.fired:  # a line some runs take and others not (a garbage collection, a free to settle)
            missed.append(line)
            continue
        assert state() == clean, f"state left open by an interrupt at {line}"
        model.zero_grad(set_to_none=False)
        with gpukit.measure(device="cpu", record=False) as r:
            t = torch.empty(1000)
            del t
        assert (r.peak, r.delta) == (4096, 0), f"the meter is off after an interrupt at {line}"
        assert LEDGER.live == live, f"the counter drifted after an interrupt at {line}"
    if sigint is signal.SIG_IGN:
        assert interrupted == 0  # an ignored Ctrl-C stays ignored inside a block
    else:
        assert interrupted == len(lines) - len(missed)  # every interrupt reached the caller: none was swallowed
    assert len(missed) <= len(lines) // 20, f"lines the runs did not reach again: {missed}"


def test_no_gpukit_code_runs_inside_the_garbage_collector_or_a_weakref_callback(sigint):
    """CPython drops an exception raised in a gc callback or a weakref callback ("Exception ignored in...").
    A Ctrl-C that lands in gpukit code there would be lost, and the bookkeeping it interrupted left half done
    (the counter drifted by 16,384 B once, after an interrupt in a gc callback of the counter's): so no such
    code may exist. A profile hook sees every Python call; none may be gpukit's while a collection frees
    tensors that the counter knows (weakly referenced storages and tensor objects found by its scans)."""
    seen = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(HERE):
            seen.append(f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)})")

    cycle = [torch.ones(300)]
    cycle.append(cycle)  # only a collection frees it
    gc.collect()
    with gpukit.measure(device="cpu", record=False) as r:
        found = [torch.ones(200)]  # made inside: its storage is watched
        found.append(found)
        del found, cycle
        sys.setprofile(profile)
        try:
            gc.collect()
        finally:
            sys.setprofile(None)
    assert seen == []
    assert r.delta == -round_up(300 * 4)  # both freed, the one from before the block counted
