"""A rehearsal: each lesson run on this CPU with the sizes a card gets (gpukit.lessons.sizes), on the simulated CUDA
caching allocator given that card's memory, with every assertion the lesson makes evaluated and counted.

    python3 kit.py rehearse --card t4 [notebooks/01_no_grad.ipynb ...]
    python3 kit.py rehearse --card cpu             # the CPU's own sizes: the assertion counts to compare with

Each notebook runs in a fresh kernel with ``GPUKIT_REHEARSE`` naming the card. Its cells are rewritten as they run
(an IPython AST transformer): ``assert test, message`` counts the assertion, records it if it fails and goes on, so
one failure does not hide the ones after it. After each cell the simulated allocator's peaks are read; at the end
the kernel's own peak of resident memory (the host RAM the lesson needed). The card's memory holds the peak
reserved bytes plus the context allowance (gpukit.allocator's ``CONTEXT_ALLOWANCE``) or the lesson does not fit;
Colab's T4 runtime also has its host RAM checked (``HOST_BYTES``).

Arithmetic is real: a lesson whose GPU sizes take longer than ``--limit`` seconds on this CPU is stopped and
recorded as not rehearsed, never as passed. Writes ``data/rehearsals/<card>.csv``, one row per notebook, and exits
non-zero if an assertion failed, a cell raised, a lesson did not fit or was not rehearsed to its end.
"""

from __future__ import annotations

import argparse
import ast
import csv
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
OUT = ROOT / "data" / "rehearsals"
MARK = "GPUKIT-REHEARSAL "
# The host RAM of the runtime a card is lent with, where one is known: Colab's standard runtime with a T4 shows
# 12.7 GB of system RAM in its resources panel (a reported figure, not measured here).
HOST_BYTES = {"t4": int(12.7e9)}
COLUMNS = ["notebook", "card", "status", "assertions", "cpu_assertions", "failed", "errors", "peak_allocated_bytes",
           "peak_reserved_bytes", "context_bytes", "card_bytes", "host_peak_bytes", "host_bytes", "fits", "seconds",
           "first_failure"]


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

    def after_cell(self, *_) -> None:
        from gpukit.allocator import cpu_device

        device = cpu_device()
        if device is not None:
            stats = device.allocator.memory_stats()
            self.peak_allocated = max(self.peak_allocated, stats["allocated_bytes.all.peak"])
            self.peak_reserved = max(self.peak_reserved, stats["reserved_bytes.all.peak"])


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


def install() -> None:
    """In the lesson's kernel, before its first cell: count its assertions and follow the allocator's peaks."""
    from IPython import get_ipython

    from gpukit.allocator import reset_cpu_device
    from gpukit.lessons.sizes import card_memory, rehearsed_card

    card = rehearsed_card()
    if card is not None:  # every lesson's simulated GPU is the card's, whether it asks for sizes or not
        reset_cpu_device(total_memory=card_memory(card))
    shell = get_ipython()
    counter = _Counter()
    shell.user_ns["__gpukit_rehearsal__"] = counter
    shell.ast_transformers.append(_CountAsserts(shell))
    shell.events.register("post_run_cell", counter.after_cell)


def report() -> None:
    """In the lesson's kernel, after its last cell: one line with what the rehearsal found."""
    import resource

    from IPython import get_ipython

    counter = get_ipython().user_ns["__gpukit_rehearsal__"]
    counter.after_cell()
    print(MARK + json.dumps({"assertions": counter.evaluated, "failed": counter.failed,
                             "failures": counter.failures[:5], "peak_allocated_bytes": counter.peak_allocated,
                             "peak_reserved_bytes": counter.peak_reserved,
                             "host_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


# -- the runner -------------------------------------------------------------------------------------------------

def rehearse(path: Path, card_key: str, limit: float) -> dict:
    """Run one notebook for a card ("cpu": its own CPU sizes) and return its row."""
    import nbclient
    import nbformat
    from nbclient.exceptions import DeadKernelError

    from gpukit.allocator import CONTEXT_ALLOWANCE
    from gpukit.cards import card as card_named
    from gpukit.lessons.sizes import REHEARSE_VAR, card_memory

    c = None if card_key == "cpu" else card_named(card_key)
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell("from gpukit.lessons.rehearsal import install; install()"))
    nb.cells.append(nbformat.v4.new_code_cell("from gpukit.lessons.rehearsal import report; report()"))
    row = {"notebook": path.stem, "card": card_key, "status": "complete", "errors": 0,
           "context_bytes": CONTEXT_ALLOWANCE if c else 0, "card_bytes": card_memory(c) if c else None,
           "host_bytes": HOST_BYTES.get(card_key)}
    saved = {k: os.environ.get(k) for k in (REHEARSE_VAR, "MPLBACKEND")}
    os.environ.pop(REHEARSE_VAR, None)
    if c is not None:
        os.environ[REHEARSE_VAR] = c.key
    os.environ["MPLBACKEND"] = "agg"
    start = time.perf_counter()
    # Past the limit the kernel is interrupted (the cell gets a KeyboardInterrupt) and the report cell runs next.
    client = nbclient.NotebookClient(nb, timeout=int(limit), kernel_name="python3", allow_errors=True,
                                     interrupt_on_timeout=True, resources={"metadata": {"path": str(path.parent)}})
    last = len(nb.cells) - 1
    try:
        with client.setup_kernel():
            for index, cell in enumerate(nb.cells[:last]):
                left = int(limit - (time.perf_counter() - start))
                if left <= 0:
                    row["status"] = f"not rehearsed to its end: over {limit:.0f} s at cell {index}"
                    break
                if cell.cell_type != "code":
                    continue
                client.timeout = left
                client.execute_cell(cell, index)
                if time.perf_counter() - start > limit:
                    row["status"] = f"not rehearsed to its end: over {limit:.0f} s at cell {index}"
                    break
                row["errors"] += sum(o.get("output_type") == "error" for o in cell.get("outputs", []))
            client.timeout = 120
            client.execute_cell(nb.cells[last], last)
    except DeadKernelError as e:
        row["status"] = f"the kernel died: {e}"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    row["seconds"] = round(time.perf_counter() - start, 1)
    found = next((json.loads(line[len(MARK):]) for o in nb.cells[-1].get("outputs", [])
                  for line in o.get("text", "").splitlines() if line.startswith(MARK)), None)
    if found is None:
        row.update(assertions=None, failed=None, fits=False, first_failure="")
        return row
    failures = found.pop("failures")
    row.update(found, first_failure=failures[0] if failures else "")
    if not row["first_failure"] and row["errors"]:
        row["first_failure"] = next(f"{o['ename']}: {o['evalue']}"[:300] for cell in nb.cells
                                    for o in cell.get("outputs", []) if o.get("output_type") == "error")
    fits_card = c is None or row["peak_reserved_bytes"] + row["context_bytes"] <= row["card_bytes"]
    fits_host = row["host_bytes"] is None or row["host_peak_bytes"] <= row["host_bytes"]
    row["fits"] = row["status"] == "complete" and fits_card and fits_host
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kit.py rehearse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--card", required=True, help="a gpukit.cards key (t4, h100...) or 'cpu'")
    parser.add_argument("--limit", type=float, default=600.0, help="seconds a notebook may run (default 600)")
    parser.add_argument("notebooks", nargs="*", type=Path)
    args = parser.parse_args(argv)
    if args.card != "cpu":
        from gpukit.cards import card as card_named

        args.card = card_named(args.card).key  # an unknown card: ValueError listing the cards
    paths = [p.resolve() for p in args.notebooks] or sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    missing = [str(p) for p in paths if p.suffix != ".ipynb" or not p.is_file()]
    if missing:
        parser.error(f"not notebooks: {', '.join(missing)}")
    counts = {}
    cpu_table = OUT / "cpu.csv"
    if args.card != "cpu" and cpu_table.is_file():
        with cpu_table.open() as f:
            counts = {r["notebook"]: r["assertions"] for r in csv.DictReader(f)}
    table = OUT / f"{args.card}.csv"
    rows = {}
    if table.is_file():  # rows of notebooks not run now are kept
        with table.open() as f:
            rows = {r["notebook"]: r for r in csv.DictReader(f)}
    bad = 0
    for path in paths:
        row = rehearse(path, args.card, args.limit)
        row["cpu_assertions"] = counts.get(path.stem, "")
        rows[path.stem] = row
        ok = (row["status"] == "complete" and row["failed"] == 0 and row["errors"] == 0 and row["fits"]
              and (row["cpu_assertions"] in ("", str(row["assertions"]))))
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {path.stem}: {row['status']}, {row['assertions']} assertions "
              f"({row['failed']} failed, {row['errors']} errors), reserved peak "
              f"{(row.get('peak_reserved_bytes') or 0) / 2**20:,.0f} MiB, host peak "
              f"{(row.get('host_peak_bytes') or 0) / 2**30:.1f} GiB, {row['seconds']} s"
              + (f"\n     {row['first_failure']}" if row["first_failure"] else ""), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    with table.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for name in sorted(rows):
            writer.writerow(rows[name])
    print(f"written: {table}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
