"""A rehearsal: each lesson run on this CPU with the sizes a card gets (gpukit.lessons.sizes), on the simulated CUDA
caching allocator given that card's memory, with every assertion the lesson makes evaluated and counted.

    python3 kit.py rehearse --card t4 [notebooks/02_no_grad.ipynb ...]
    python3 kit.py rehearse --card cpu             # the CPU's own sizes: the assertion counts to compare with

Each notebook runs in a fresh kernel, driven by a runner process of its own, with ``GPUKIT_REHEARSE`` naming the
card. Its cells are rewritten as they run
(an IPython AST transformer): ``assert test, message`` counts the assertion, records it if it fails and goes on, so
one failure does not hide the ones after it. After each cell the simulated allocator's peaks are read; at the end
the kernel's own peak of resident memory. The card's memory holds the peak reserved bytes plus the context allowance
(gpukit.allocator's ``CONTEXT_ALLOWANCE``) or the lesson does not fit. Colab's T4 runtime also has its host RAM
checked (``HOST_BYTES``) against ``host_need_bytes``: the kernel's peak resident memory less the simulated device's
peak allocated bytes of real tensors, since on this CPU the device's tensors live in host RAM and on a GPU they do
not. It is a lower bound of the host RAM the lesson needs beside the card (the two peaks need not come at one
moment): over the limit, the lesson certainly does not fit; under it, probably.

Arithmetic is real: a lesson whose GPU sizes take longer than ``--limit`` seconds on this CPU is stopped and
recorded as not rehearsed, never as passed. What a rehearsal repeats fewer times than the card would is timed steps
only (``gpukit.lessons.sizes.REHEARSAL_REPEATS``: their times on this CPU say nothing of the card's, and no cell that
repeats them asserts a time); the table's ``shortened`` column names them. The cells of
``gpukit.lessons.sizes.REHEARSAL_ON_FAKE_TENSORS`` (arithmetic of hours here, assertions on memory alone) run on fake
tensors, with the card's allocator (gpukit.lessons.rehearsal): the ``fake_cells`` column names them and
``made_up_values`` counts the values read from tensors there. Writes ``data/rehearsals/<card>.csv``, one row per
notebook (docs/rehearsals.md sums the tables up), and exits non-zero if an assertion failed, a cell raised, a lesson
did not fit or was not rehearsed to its end.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpukit.lessons.rehearsal import MARK  # noqa: E402

NOTEBOOKS = ROOT / "notebooks"
OUT = ROOT / "data" / "rehearsals"
# The host RAM of the runtime a card is lent with, where one is known: Colab's standard runtime with a T4 shows
# 12.7 GB of system RAM in its resources panel (a reported figure, not measured here).
HOST_BYTES = {"t4": int(12.7e9)}
COLUMNS = ["notebook", "card", "status", "assertions", "cpu_assertions", "failed", "errors", "peak_allocated_bytes",
           "peak_reserved_bytes", "context_bytes", "card_bytes", "host_peak_bytes", "host_need_bytes", "host_bytes",
           "fits", "seconds", "shortened", "fake_cells", "made_up_values", "first_failure"]


def rehearse(path: Path, card_key: str, limit: float, grace: float = 120.0, progress: Path | None = None) -> dict:
    """Run one notebook for a card ("cpu": its own CPU sizes) and return its row. Past ``limit`` seconds the kernel
    is interrupted; one that is still busy ``grace`` seconds later (code that catches the interrupt, a long op that
    does not return to Python) is killed, and the row says so."""
    import nbclient
    import nbformat
    from nbclient.exceptions import DeadKernelError

    from gpukit.allocator import CONTEXT_ALLOWANCE
    from gpukit.cards import card as card_named
    from gpukit.lessons.sizes import REHEARSAL_ON_FAKE_TENSORS, REHEARSE_VAR, card_memory, shortened, tier_of

    c = None if card_key == "cpu" else card_named(card_key)
    nb = nbformat.read(path, as_version=4)
    fake = REHEARSAL_ON_FAKE_TENSORS.get(path.stem, {}) if c is not None else {}
    missing = set(fake) - {cell.get("id") for cell in nb.cells}
    if missing:  # a cell renamed: rehearsed for real it would run for hours
        raise ValueError(f"{path.name} has no cell {', '.join(sorted(missing))} (REHEARSAL_ON_FAKE_TENSORS)")
    if fake:  # the kernel's rehearsal opens and closes the fake tensors around each listed cell
        nb.cells = [new for cell in nb.cells for new in (
            [nbformat.v4.new_code_cell("__gpukit_rehearsal__.fake_begin()"), cell,
             nbformat.v4.new_code_cell("__gpukit_rehearsal__.fake_end()")] if cell.get("id") in fake else [cell])]
    nb.cells.insert(0, nbformat.v4.new_code_cell(
        f"from gpukit.lessons.rehearsal import install; install({str(progress) if progress else None!r})"))
    nb.cells.append(nbformat.v4.new_code_cell("from gpukit.lessons.rehearsal import report; report()"))
    row = {"notebook": path.stem, "card": card_key, "status": "complete", "errors": 0,
           "context_bytes": CONTEXT_ALLOWANCE if c else 0, "card_bytes": card_memory(c) if c else None,
           "host_bytes": HOST_BYTES.get(card_key),
           # timed steps repeated fewer times than on the card (gpukit.lessons.sizes.REHEARSAL_REPEATS)
           "shortened": "; ".join(f"{name} {new} (card: {old})" for name, (old, new)
                                  in (shortened(path.stem, tier_of(c.memory_bytes)) if c else {}).items()),
           "fake_cells": "; ".join(fake.values())}
    saved = {k: os.environ.get(k) for k in (REHEARSE_VAR, "MPLBACKEND")}
    os.environ.pop(REHEARSE_VAR, None)
    if c is not None:
        os.environ[REHEARSE_VAR] = c.key
    os.environ["MPLBACKEND"] = "agg"
    # Past the limit the kernel is interrupted (the cell gets a KeyboardInterrupt) and the report cell runs next.
    # The limit counts the notebook's own cells: the rehearsal's first cell (gpukit's import, seconds on a loaded
    # machine) runs before the clock starts.
    client = nbclient.NotebookClient(nb, timeout=int(limit), kernel_name="python3", allow_errors=True,
                                     interrupt_on_timeout=True, resources={"metadata": {"path": str(path.parent)}})
    last = len(nb.cells) - 1
    def stop(why: str) -> None:  # the first reason stays
        if row["status"] == "complete":
            row["status"] = why

    def kill() -> None:  # the interrupt was not enough
        process = getattr(getattr(client.km, "provisioner", None), "process", None)
        if process is not None and process.poll() is None:
            stop(f"not rehearsed to its end: over {limit:.0f} s, and killed {grace:.0f} s after")
            process.kill()

    watchdog = threading.Timer(limit + grace, kill)
    watchdog.daemon = True
    start = time.perf_counter()
    try:
        with client.setup_kernel():
            client.timeout = 300
            client.execute_cell(nb.cells[0], 0)
            start = time.perf_counter()
            watchdog.start()
            for index, cell in enumerate(nb.cells[:last]):
                if index == 0:
                    continue
                left = int(limit - (time.perf_counter() - start))
                if left <= 0:
                    stop(f"not rehearsed to its end: over {limit:.0f} s at cell {index}")
                    break
                if cell.cell_type != "code":
                    continue
                client.timeout = left
                client.execute_cell(cell, index)
                if time.perf_counter() - start > limit:
                    stop(f"not rehearsed to its end: over {limit:.0f} s at cell {index}")
                    break
                row["errors"] += sum(o.get("output_type") == "error" for o in cell.get("outputs", []))
            client.timeout = 120
            client.execute_cell(nb.cells[last], last)
    except DeadKernelError as e:
        stop(f"the kernel died: {e}")
    finally:
        watchdog.cancel()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    row["seconds"] = round(time.perf_counter() - start, 1)
    found = next((json.loads(line[len(MARK):]) for o in nb.cells[-1].get("outputs", [])
                  for line in o.get("text", "").splitlines() if line.startswith(MARK)), None)
    if found is None and progress is not None and progress.is_file():  # killed: what it had found by its last cell
        found = json.loads(progress.read_text())
    if found is None:
        row.update(assertions=None, failed=None, fits=False, first_failure="")
        return row
    _take(row, found)
    if not row["first_failure"] and row["errors"]:
        row["first_failure"] = next(f"{o['ename']}: {o['evalue']}"[:300] for cell in nb.cells
                                    for o in cell.get("outputs", []) if o.get("output_type") == "error")
    fits_card = c is None or row["peak_reserved_bytes"] + row["context_bytes"] <= row["card_bytes"]
    # (the tensors of a cell on fake tensors take no host RAM here: only the real ones' peak is taken off)
    row["host_need_bytes"] = max(row["host_peak_bytes"] - row.pop("real_peak_allocated_bytes",
                                                                  row["peak_allocated_bytes"]), 0)
    fits_host = row["host_bytes"] is None or row["host_need_bytes"] <= row["host_bytes"]
    row["fits"] = row["status"] == "complete" and fits_card and fits_host
    return row


def isolated(path: Path, card_key: str, limit: float, grace: float = 120.0, slack: float = 60.0) -> dict:
    """``rehearse`` in a process of its own. A runner still there ``slack`` seconds after its kernel should have been
    killed (its kernel client can wait on a dead kernel for good: seen twice, with the kernel a zombie) is killed
    with every process under it, and the row says so; the notebooks after it are rehearsed all the same."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        progress = out.with_name("progress.json")  # the kernel's findings so far, after each cell
        proc = subprocess.Popen([sys.executable, __file__, "--card", card_key, "--limit", str(limit), "--grace",
                                 str(grace), "--one", str(out), str(path)])
        try:
            code = proc.wait(timeout=limit + grace + slack)
            why = f"its runner exited with code {code} before writing its row"
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            why = f"not rehearsed to its end: its runner still waited {limit + grace + slack:.0f} s on, and was killed"
        if out.is_file():
            return json.loads(out.read_text())
        row = {"notebook": path.stem, "card": card_key, "status": why, "assertions": None, "failed": None, "errors": 0,
               "fits": False, "seconds": round(time.perf_counter() - start, 1), "first_failure": ""}
        if progress.is_file():  # what the kernel had found when it was killed: assertions evaluated up to there
            _take(row, json.loads(progress.read_text()))
    return row


def _take(row: dict, found: dict) -> None:
    """Put what the kernel reported (``gpukit.lessons.rehearsal``'s ``found()``) into the notebook's row."""
    failures = found.pop("failures")
    row.update(found, first_failure=failures[0] if failures else "")


def kill_tree(pid: int) -> None:
    """Kill ``pid`` and every process under it (read from /proc: a kernel may have a session of its own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    doomed, todo = [], [pid]
    while todo:
        p = todo.pop()
        doomed.append(p)
        todo += children.get(p, [])
    for p in doomed:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


START, END = "<!-- rehearsals:start -->", "<!-- rehearsals:end -->"


PAGE = ROOT / "docs" / "rehearsals.md"  # the page that sums the tables up, between START and END


def rehearsals_section(folder: Path | None = None) -> str:
    """docs/rehearsals.md's summary of the recorded tables: per card, one line per notebook."""
    folder = folder or OUT
    lines = []
    for table in sorted(folder.glob("*.csv"), key=lambda p: (p.stem != "cpu", p.stem)):
        with table.open() as f:
            rows = list(csv.DictReader(f))
        lines += [f"**{table.stem}** (`data/rehearsals/{table.name}`)", "",
                  "| notebook | status | assertions (CPU run) | failed | errors | reserved peak + context "
                  "| host beside it | fits | differs from the card |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            reserved = int(r["peak_reserved_bytes"] or 0) + int(r["context_bytes"] or 0)
            card = f" of {int(r['card_bytes']) / 2**30:,.1f} GiB" if r["card_bytes"] else ""
            need = r.get("host_need_bytes") or max(int(r["host_peak_bytes"] or 0)
                                                   - int(r["peak_allocated_bytes"] or 0), 0)
            host = f"{int(need) / 2**30:.1f} GiB"
            counts = f"{r['assertions'] or '-'}" + (f" ({r['cpu_assertions']})" if r["cpu_assertions"] else "")
            differs = ([f"fewer: {r['shortened']}"] if r.get("shortened") else []) + (
                [f"on fake tensors: {r['fake_cells']} ({r.get('made_up_values') or 0} values made up)"]
                if r.get("fake_cells") else [])
            lines.append(f"| {r['notebook']} | {r['status']} | {counts} | {r['failed'] or '-'} | {r['errors']} "
                         f"| {reserved / 2**30:,.2f} GiB{card} | {host} | {r['fits']} "
                         f"| {'; '.join(differs) or 'as on the card'} |")
        lines.append("")
    return "\n".join(lines).strip()


def write_rehearsals_page(page: Path | None = None) -> None:
    """Replace what lies between docs/rehearsals.md's markers with ``rehearsals_section()``."""
    page = page or PAGE
    if not page.is_file():
        return  # no docs/ (an installed copy): nothing to update
    text = page.read_text()
    if text.count(START) != 1 or text.count(END) != 1:
        return  # a page without the section: nothing to update
    head, rest = text.split(START)
    _, tail = rest.split(END)
    page.write_text(f"{head}{START}\n{rehearsals_section()}\n{END}{tail}")


def write_table(table: Path, rows: dict[str, dict]) -> None:
    table.parent.mkdir(parents=True, exist_ok=True)
    with table.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")  # (git's line ends)
        writer.writeheader()
        for name in sorted(rows):
            writer.writerow(rows[name])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kit.py rehearse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--card", required=True, help="a gpukit.cards key (t4, h100...) or 'cpu'")
    parser.add_argument("--limit", type=float, default=600.0, help="seconds a notebook may run (default 600)")
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--grace", type=float, default=120.0, help=argparse.SUPPRESS)
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # one notebook, its row to this file
    args = parser.parse_args(argv)
    if args.one is not None:
        row = rehearse(args.notebooks[0].resolve(), args.card, args.limit, args.grace,
                       progress=args.one.with_name("progress.json"))
        args.one.write_text(json.dumps(row))
        return 0
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
        row = isolated(path, args.card, args.limit, args.grace)
        row["cpu_assertions"] = counts.get(path.stem, "")
        rows[path.stem] = row
        ok = (row["status"] == "complete" and row["failed"] == 0 and row["errors"] == 0 and row["fits"]
              and (row["cpu_assertions"] in ("", str(row["assertions"]))))
        bad += not ok
        write_table(table, rows)  # after each notebook: a later one that hangs loses nothing
        print(f"{'ok  ' if ok else 'FAIL'} {path.stem}: {row['status']}, {row['assertions']} assertions "
              f"({row['failed']} failed, {row['errors']} errors), reserved peak "
              f"{(row.get('peak_reserved_bytes') or 0) / 2**20:,.0f} MiB, host beside it "
              f"{(row.get('host_need_bytes') or 0) / 2**30:.1f} GiB, {row['seconds']} s"
              + (f"\n     {row['first_failure']}" if row["first_failure"] else ""), flush=True)
    print(f"written: {table}")
    if OUT == ROOT / "data" / "rehearsals":
        write_rehearsals_page()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
