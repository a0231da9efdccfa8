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
holds are not reused: an upper bound). No arithmetic is done, so a value read from a tensor (``.item()``) is made up:
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
            self.real_peak_allocated = max(self.real_peak_allocated, stats["allocated_bytes.all.peak"])
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

    def fake_begin(self) -> None:
        from gpukit._torch import FakeTensorMode
        from gpukit.allocator import cpu_device, follow
        from gpukit.counter import FAKE_LEDGER
        from gpukit.factories import swappable_fakes
        from gpukit.fakecheck import FakeKernelCheck
        from gpukit.meter import measure

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
            simulated = stack.enter_context(follow(FAKE_LEDGER))  # no capacity: what it reserves, whatever its size
            tally = FAKE_LEDGER.start()
            stack.callback(FAKE_LEDGER.stop, tally)
            watch = simulated.watch()
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
            self.peak_reserved = max(self.peak_reserved, reserved + simulated.unwatch(watch))
        finally:
            stack.close()
        self.peak_allocated = max(self.peak_allocated, allocated + tally.peak)
        self.made_up += sum(values.made_up.values())


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


def report() -> None:
    """In the lesson's kernel, after its last cell: one line with what the rehearsal found."""
    from IPython import get_ipython

    counter = get_ipython().user_ns["__gpukit_rehearsal__"]
    counter.fake_end()  # a cell on fake tensors stopped by the time limit
    counter.after_cell()
    print(MARK + json.dumps(counter.found()))


__all__ = ["install", "report", "MARK"]
