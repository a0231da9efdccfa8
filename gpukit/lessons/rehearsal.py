"""What a rehearsal runs inside a lesson's kernel (bench/rehearse.py, ``python3 kit.py rehearse --card t4``): every
``assert`` of the lesson's cells counted, a failing one recorded and the run going on, the simulated CUDA allocator's
peaks read after each cell, and one line at the end with what was found.

    from gpukit.lessons.rehearsal import install; install()     # before the lesson's first cell
    from gpukit.lessons.rehearsal import report; report()       # after its last

Cells are rewritten as they run (an IPython AST transformer): ``assert test, message`` becomes a call that counts the
assertion, records it with its message if it fails, and goes on, so one failure does not hide the ones after it.
Under ``GPUKIT_REHEARSE`` (a ``gpukit.cards`` key) the simulated GPU behind the CPU meter gets that card's memory
first, whether the lesson asks for its sizes or not.
"""

from __future__ import annotations

import ast
import json

MARK = "GPUKIT-REHEARSAL "


# -- in the kernel ----------------------------------------------------------------------------------------------

class _Counter:
    def __init__(self) -> None:
        self.evaluated = self.failed = 0
        self.failures: list[str] = []
        self.peak_allocated = self.peak_reserved = 0

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
                "host_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


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
    shell.user_ns["__gpukit_rehearsal__"] = counter
    shell.ast_transformers.append(_CountAsserts(shell))
    shell.events.register("post_run_cell", counter.after_cell)


def report() -> None:
    """In the lesson's kernel, after its last cell: one line with what the rehearsal found."""
    from IPython import get_ipython

    counter = get_ipython().user_ns["__gpukit_rehearsal__"]
    counter.after_cell()
    print(MARK + json.dumps(counter.found()))


__all__ = ["install", "report", "MARK"]
