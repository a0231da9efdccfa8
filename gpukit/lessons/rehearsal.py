"""What a rehearsal runs inside a lesson's kernel (bench/rehearse.py, ``python3 kit.py rehearse --card t4``): every
``assert`` and every ``claim()`` (gpukit.lessons.claims) of the lesson's cells counted, a failing one recorded and the run going on, the simulated CUDA allocator's
peaks read after each cell, and one line at the end with what was found.

    from gpukit.lessons.rehearsal import install; install()     # before the lesson's first cell
    from gpukit.lessons.rehearsal import report; report()       # after its last

Cells are rewritten as they run (an IPython AST transformer): ``assert test, message`` becomes a call that counts the
assertion, records it with its message if it fails, and goes on, so one failure does not hide the ones after it.
Under ``GPUKIT_REHEARSE`` (a ``gpukit.cards`` key) the simulated GPU behind the CPU meter gets that card's memory
first, whether the lesson asks for its sizes or not.

A cell listed in ``gpukit.lessons.sizes.REHEARSAL_ON_FAKE_TENSORS`` runs between ``fake_begin()`` and ``fake_end()``
(cells the runner puts around it): on fake tensors, the machinery of ``predict()``. Every tensor gets the shape, dtype
and storage the real run gives it (``FakeKernelCheck`` corrects the fake kernels that get one wrong), ``measure("cpu")``
counts the fake CPU tensors, and a simulated allocator of the card follows them beside the real one: the peak
reserved bytes are the real allocator's at the cell's start plus the fake cell's own peak (blocks the real cache
holds are not reused: an upper bound). Where the lesson made its own simulated card (``cuda =
gpukit.SimulatedCuda()``), that card places them beside its real tensors instead, as ``on_card`` does, so that
``cuda.memory_allocated()`` and its peaks count them as a GPU's would. No arithmetic is done, so a value read from a tensor (``.item()``) is made up:
``False``, ``0`` or ``0.0`` (no inf found, nothing out of range, as in healthy training), and counted.
"""

from __future__ import annotations

import ast
import contextlib
import json

from gpukit.factories import ValuesWhileBuilding

MARK = "GPUKIT-REHEARSAL "


# -- in the kernel ----------------------------------------------------------------------------------------------

class _Counter:
    def __init__(self) -> None:
        self.evaluated = self.failed = 0
        self.failures: list[str] = []
        self.peak_allocated = self.peak_reserved = 0
        self.real_peak_allocated = 0  # of real tensors alone (in host RAM here): fake cells' take none

    def check(self, ok, message, where: str) -> None:
        self.evaluated += 1
        if not ok:
            self.failed += 1
            try:
                text = message()
            except Exception as e:  # noqa: BLE001 - a message that cannot be made is reported, not raised
                text = f"(its message raised {e!r})"
            self.failures.append(f"{where}{': ' + str(text) if text is not None else ''}")

    progress: str | None = None  # a file rewritten after each cell with what ``found()`` says

    def after_cell(self, *_) -> None:
        from gpukit.allocator import cpu_device

        device = cpu_device()
        if device is not None:
            stats = device.allocator.memory_stats()
            self.peak_allocated = max(self.peak_allocated, stats["allocated_bytes.all.peak"])
            if self.fake is None:  # a fake cell's tensors take no host RAM; once one was on the lesson's card, its
                # peak statistic counts them, and the real tensors' level now is what is known of theirs
                real = stats["allocated_bytes.all.current" if self.fakes_on_card else "allocated_bytes.all.peak"]
                self.real_peak_allocated = max(self.real_peak_allocated, real)
            self.peak_reserved = max(self.peak_reserved, stats["reserved_bytes.all.peak"])
        if self.progress is not None:  # what a runner that has to kill this kernel still learns
            import os

            partial = f"{self.progress}.part"
            with open(partial, "w") as f:
                json.dump(self.found(), f)
            os.replace(partial, self.progress)

    def found(self) -> dict:
        import resource

        return {"assertions": self.evaluated, "failed": self.failed, "failures": self.failures[:5],
                "peak_allocated_bytes": self.peak_allocated, "peak_reserved_bytes": self.peak_reserved,
                "host_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "made_up_values": self.made_up, "real_peak_allocated_bytes": self.real_peak_allocated}

    # While a cell runs on fake tensors: its modes, its simulated allocator, and the real allocator's allocated and
    # reserved bytes at its start. ``made_up``: the values read from fake tensors, made up, in every such cell.
    fake: tuple | None = None
    made_up = 0
    fakes_on_card = False  # a fake cell ran on the lesson's own simulated card (``cuda = gpukit.SimulatedCuda()``)

    def fake_begin(self) -> None:
        from gpukit._torch import FakeTensorMode
        from gpukit.allocator import SimulatedDevice, cpu_device, follow
        from gpukit.counter import FAKE_LEDGER
        from gpukit.factories import swappable_fakes
        from gpukit.fakecheck import FakeKernelCheck
        from gpukit.meter import measure
        from gpukit.simulated import simulated_cuda

        if self.fake is not None:
            raise RuntimeError("a cell on fake tensors is already open")
        real = cpu_device()
        if real is not None:  # the simulation learns of tensors made outside measured blocks at the next one
            with measure("cpu", record=False):
                pass
        stats = real.allocator.memory_stats() if real is not None else {}
        allocated, reserved = stats.get("allocated_bytes.all.current", 0), stats.get("reserved_bytes.all.current", 0)
        stack = contextlib.ExitStack()
        try:
            mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(swappable_fakes(mode))  # model.to(...) of a fake model (gpukit.factories)
            stack.enter_context(FakeKernelCheck())
            values = stack.enter_context(_HealthyValues())
            card = simulated_cuda()
            if card is None:
                simulated = stack.enter_context(follow(FAKE_LEDGER))  # no capacity: what it reserves, whatever its size
                tally = FAKE_LEDGER.start()
                stack.callback(FAKE_LEDGER.stop, tally)
                watch = simulated.watch()
            else:
                # The lesson's own simulated card (``cuda = gpukit.SimulatedCuda()``) places the fake tensors beside
                # its real ones, as ``on_card`` does: ``cuda.memory_allocated()`` and its peaks count them, as a GPU's
                # would, and the card's reserved peak is read after the cell.
                simulated = watch = None
                tally = FAKE_LEDGER.start()
                stack.callback(FAKE_LEDGER.stop, tally)
                placing = SimulatedDevice(allocator=card.allocator, lazy=False)
                placing.attach(FAKE_LEDGER, place=False)
                card._device.also = placing  # the card read up to date after a del, as in an on_card() block
                stack.callback(_release, card, placing)
                self.fakes_on_card = True
        except BaseException:
            stack.close()
            raise
        self.fake = (stack, simulated, watch, tally, values, allocated, reserved)

    def fake_end(self) -> None:
        if self.fake is None:
            return
        stack, simulated, watch, tally, values, allocated, reserved = self.fake
        self.fake = None
        try:
            if simulated is not None:
                self.peak_reserved = max(self.peak_reserved, reserved + simulated.unwatch(watch))
        finally:
            stack.close()
        self.peak_allocated = max(self.peak_allocated, allocated + tally.peak)
        self.made_up += sum(values.made_up.values())


def _release(card, device) -> None:
    """A fake cell's end on the lesson's card: the fake tensors still referenced leave it, as ``on_card``'s do at
    its block's end; the peaks they reached stay in its statistics."""
    from gpukit.counter import FAKE_LEDGER

    FAKE_LEDGER.settle()  # tensors that died in the cell are freed in their order first
    card._device.also = None
    device.detach()
    alloc = device.allocator
    for addr in list(device.addr.values())[::-1]:
        alloc.free(addr)
    device.addr.clear()


class _CountAsserts(ast.NodeTransformer):
    """``assert test, msg`` -> ``__gpukit_rehearsal__.check(test, lambda: msg, "line L: assert test")``."""

    def __init__(self, shell) -> None:
        self.shell = shell

    def visit_Assert(self, node: ast.Assert):
        self.generic_visit(node)
        where = f"line {node.lineno}: assert {ast.unparse(node.test)[:160]}"
        message = ast.Lambda(args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]),
                             body=node.msg if node.msg is not None else ast.Constant(None))
        call = ast.Call(func=ast.Attribute(value=ast.Name("__gpukit_rehearsal__", ast.Load()), attr="check",
                                           ctx=ast.Load()),
                        args=[node.test, message, ast.Constant(where)], keywords=[])
        return ast.copy_location(ast.Expr(call), node)


class _HealthyValues(ValuesWhileBuilding):
    """A value read from a fake tensor in a rehearsal: that of a healthy step (no inf found by a GradScaler,
    nothing out of range, a loss of 0), counted in ``made_up``."""

    MADE_UP = {"bool": False, "float": 0.0, "int": 0}


def install(progress: str | None = None) -> None:
    """In the lesson's kernel, before its first cell: count its assertions and follow the allocator's peaks (and,
    with ``progress``, write what is found so far to that file after every cell)."""
    from IPython import get_ipython

    from gpukit.allocator import reset_cpu_device
    from gpukit.lessons.sizes import card_memory, rehearsed_card

    card = rehearsed_card()
    if card is not None:  # every lesson's simulated GPU is the card's, whether it asks for sizes or not
        reset_cpu_device(total_memory=card_memory(card))
    shell = get_ipython()
    counter = _Counter()
    counter.progress = progress
    from gpukit.lessons import claims

    claims.RECORDER = counter  # every claim() counted as an assert is, a failed one recorded
    shell.user_ns["__gpukit_rehearsal__"] = counter
    shell.ast_transformers.append(_CountAsserts(shell))
    shell.events.register("post_run_cell", counter.after_cell)
    _keep_peaks_across_resets(counter)


def _keep_peaks_across_resets(counter: _Counter) -> None:
    """A lesson resets the card's peaks before each step it measures (``cuda.reset_peak_memory_stats()``), often
    several times in one cell: the card's allocator hands its peaks so far to the counter first, so that the largest
    step of a cell is not lost to the next one's reset. Only the CPU's simulated card (``cpu_device()``, a lesson's
    ``SimulatedCuda`` included) counts: a prediction's allocator is another's."""
    from gpukit.allocator import CachingAllocator, cpu_device

    reset = CachingAllocator.reset_peak_stats

    def reset_peak_stats(alloc: CachingAllocator) -> None:
        device = cpu_device()
        if device is not None and device._alloc is alloc:
            stats = alloc.memory_stats()
            counter.peak_allocated = max(counter.peak_allocated, stats["allocated_bytes.all.peak"])
            counter.peak_reserved = max(counter.peak_reserved, stats["reserved_bytes.all.peak"])
        reset(alloc)

    CachingAllocator.reset_peak_stats = reset_peak_stats


def report() -> None:
    """In the lesson's kernel, after its last cell: one line with what the rehearsal found."""
    from IPython import get_ipython

    counter = get_ipython().user_ns["__gpukit_rehearsal__"]
    counter.fake_end()  # a cell on fake tensors stopped by the time limit
    counter.after_cell()
    print(MARK + json.dumps(counter.found()))


__all__ = ["install", "report", "MARK"]
