"""`kit.py gpu-check`: the kit proved on a lent GPU within a time budget (the exactness benchmark, the technique
matrix recorded and replayed against the predictions, every notebook run on the card and stored, the tests on
CUDA), each stage with a deadline of its own, and a report of what differed from the CPU runs."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import venv

GPU_PROBE = """
import json, torch
ok = torch.cuda.is_available()
info = {"cuda": ok, "torch": torch.__version__, "cuda_version": torch.version.cuda}
if ok:
    import gpukit
    from gpukit.warmup import cublas_workspace_bytes
    info.update(name=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                devices=torch.cuda.device_count(), workspace=cublas_workspace_bytes("cuda"),
                first_warm_up=gpukit.warm_up("cuda"), second_warm_up=gpukit.warm_up("cuda"))
    # what a checkpointed Linear with a bias still makes after the warm-up (its recompute runs on backward's thread)
    from torch.utils.checkpoint import checkpoint
    before = torch.cuda.memory_allocated()
    linear = torch.nn.Linear(1024, 1024, device="cuda")
    x = torch.randn(256, 1024, device="cuda", requires_grad=True)
    checkpoint(linear, x, use_reentrant=False).sum().backward()
    del linear, x
    torch.cuda.synchronize()
    info["checkpointed_linear_left"] = torch.cuda.memory_allocated() - before
print(json.dumps(info))
"""
# A lent GPU machine runs one command for at most 10 minutes, and a task has 15 minutes of it, its start included: the
# check fits in BUDGET_S from kit.py's start, set-up included, every stage with a deadline of its own. What comes back
# from it is at most 8 files of 16 MiB each: the check packs everything it wrote into one.
BUDGET_S = 470  # under 8 minutes of device time: the machine's start and a rerun fit the loan too
PACK_BYTES = 16 * 2**20
STARTED, STARTED_WALL = time.monotonic(), time.time()
NOTEBOOK_WORKERS = 8      # as in the notebooks' first GPU run (data/runs/notebooks-on-gpus.txt)
NOTEBOOK_GRACE_S = 10     # a notebook's runner stops it at the deadline; one still running this much later is killed
NOTEBOOK_MIN_S = 10       # no notebook is started with less time left than this


class TimeUp(Exception):
    """The check was told to end (SIGTERM) before its stages were done."""


def stop(proc: subprocess.Popen, grace: float) -> None:
    """Interrupt a process started in a session of its own (SIGINT to its group, as Ctrl-C: pytest still writes its
    record), and kill the group if it has not ended ``grace`` seconds later."""
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def start(cmd: list, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` from the repository in a session of its own, its output into ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        return subprocess.Popen([str(c) for c in cmd], cwd=venv.ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_until(proc: subprocess.Popen, deadline: float, grace: float = 15.0) -> int | None:
    """Wait for ``proc`` until ``deadline`` (time.monotonic()), then stop it. Its exit status, or None if it was cut."""
    try:
        return proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        stop(proc, grace)
        return None
    except BaseException:
        stop(proc, 0.0)
        raise


def run_until(cmd: list, deadline: float, log: Path, env: dict[str, str] | None = None,
              grace: float = 15.0) -> int | None:
    """Run ``cmd`` from the repository, its output into ``log``, until ``deadline``; then stop it. Returns its exit
    status, or None when it was cut."""
    return wait_until(start(cmd, log, env), deadline, grace)


def code_of(notebook: Path) -> str:
    import json

    cells = json.loads(notebook.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def reads_the_clock(notebook: Path) -> bool:
    """Whether a notebook times something on this machine: it then runs alone, so that no other notebook's work
    shares the GPU and the cores while it measures."""
    return bool(re.search(r"\bperf_counter\b|\btime\.time\(|\bmonotonic\(|\btimeit\b", code_of(notebook)))


def fills_the_card(notebook: Path) -> bool:
    """Whether a notebook runs out of the card's memory on purpose (it catches ``OutOfMemoryError``): it then runs
    alone. Beside it, the others' requests fail instead (on an H200, 2026-11-27, notebook 08's step too big for the
    card left 85 MiB free, and notebooks 00, 02 and 07 ran out of memory)."""
    return "OutOfMemoryError" in code_of(notebook)


def why_alone(notebook: Path) -> str | None:
    """Why a notebook runs alone on the card, or None when it can share it."""
    return "they time steps" if reads_the_clock(notebook) else "they fill the card" if fills_the_card(notebook) \
        else None


def run_notebooks(notebooks: list[Path], workers: int, deadline: float, to: Path, logs: Path, card: str,
                  torch_version: str) -> list[dict]:
    """Run the notebooks, ``workers`` at a time, each stored in ``to`` with its outputs by tests/notebooks_on_card.py
    (which stops its notebook at the deadline); one still running NOTEBOOK_GRACE_S past it is killed. Returns each
    notebook's summary, in the order given (not the order they ended in, which the machine's load decides); a
    notebook never started has ``cut`` set and no file."""
    pending, running, results = list(notebooks), {}, []
    order = {nb.stem: i for i, nb in enumerate(notebooks)}
    try:
        results = run_pending(pending, running, results, workers, deadline, to, logs, card, torch_version)
        return sorted(results, key=lambda r: order.get(r["notebook"], len(order)))
    except BaseException:             # told to end (SIGTERM): no kernel outlives the check
        for proc, out in running.values():
            stop(proc, 0.0)
            out.close()
        raise


def run_pending(pending: list[Path], running: dict, results: list[dict], workers: int, deadline: float, to: Path,
                   logs: Path, card: str, torch_version: str) -> list[dict]:
    import json

    while pending or running:
        while pending and len(running) < workers:
            left = deadline - time.monotonic()
            if left < NOTEBOOK_MIN_S:
                results += [{"notebook": nb.stem, "cut": "not started: no time left", "failed": [], "ran": 0}
                            for nb in pending]
                pending.clear()
                break
            nb = pending.pop(0)
            out = open(logs / f"{nb.stem}.log", "w")
            proc = subprocess.Popen(
                [str(venv.VENV_PY), str(venv.ROOT / "tests" / "notebooks_on_card.py"), str(nb), "--to", str(to),
                 "--seconds", f"{left:.0f}", "--card", card, "--torch", torch_version],
                cwd=venv.ROOT, env=venv.test_environment(), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
            running[nb] = (proc, out)
        time.sleep(0.2)
        for nb, (proc, out) in list(running.items()):
            late = time.monotonic() > deadline + NOTEBOOK_GRACE_S
            if proc.poll() is None and not late:
                continue
            if late:
                stop(proc, 5.0)
            out.close()
            del running[nb]
            last = ((logs / f"{nb.stem}.log").read_text().strip().splitlines() or [""])[-1]
            try:
                results.append(json.loads(last))
            except ValueError:
                results.append({"notebook": nb.stem, "failed": [], "ran": None,
                                "cut": "killed past the deadline" if late else f"the runner failed (exit "
                                       f"{proc.returncode}): {last[:300]}"})
    return results


def notebook_lines(results: list[dict], alone: dict[str, str], stored: Path) -> list[str]:
    """The report's lines on the notebooks; ``alone`` maps those that ran alone to why (``why_alone``)."""
    done = [r for r in results if not r["failed"] and not r["cut"]]
    reasons = sorted(set(alone.values()))
    lines = [f"notebooks: {len(done)} of {len(results)} ran to the end with no failing cell, stored with their outputs "
             f"in {stored.relative_to(venv.ROOT)}/"
             + (" (" + "; ".join(f"{', '.join(sorted(n for n, w in alone.items() if w == why))} alone: {why}"
                                 for why in reasons) + ")" if alone else "")]
    for r in sorted(results, key=lambda r: r["notebook"]):
        took = f" ({r['seconds']:.0f} s)" if r.get("seconds") is not None else ""
        if r["cut"]:
            ran = "" if r["ran"] is None else f"; {r['ran']} code cells ran"
            lines.append(f"  cut: {r['notebook']}: {r['cut']}{ran}{took}")
        for index, why in r["failed"]:
            lines.append(f"  failure: {r['notebook']}: cell {index}: {why}")
    return lines


def cuda_test_files() -> list[str]:
    """The test files with tests that run only with CUDA (they skip on the CPU), from the repository."""
    return sorted(str(p.relative_to(venv.ROOT)) for p in (venv.ROOT / "tests").glob("test_*.py")
                  if "cuda.is_available()" in p.read_text())


def read_junit(junit: Path) -> tuple[int, list[str], list[str]]:
    """(tests, failures and errors, skips) of a pytest record, each as a report line."""
    import xml.etree.ElementTree as ET

    failed, skipped, total = [], [], 0
    for case in (ET.parse(junit).getroot().iter("testcase") if junit.exists() else ()):
        total += 1
        name = f"{case.get('classname')}::{case.get('name')}"
        for kind, into in (("failure", failed), ("error", failed), ("skipped", skipped)):
            found = case.find(kind)
            if found is not None:
                why = ((found.get("message") or kind).splitlines() or [kind])[0][:200]
                into.append(f"  {kind}: {name}: {why}")
    return total, failed, skipped


def written_since(start: float, folders: list[Path]) -> list[Path]:
    return sorted(p for folder in folders if folder.exists() for p in folder.rglob("*")
                  if p.is_file() and p.stat().st_mtime >= start - 1)


def pack(tarball: Path, files: list[Path], limit: int = PACK_BYTES) -> list[str]:
    """Pack ``files`` (paths in the repository) into one tar.gz of at most ``limit`` bytes, leaving out the largest
    files until it fits; returns the report's lines about it."""
    import tarfile

    files, left_out = sorted(files), []
    while True:
        tarball.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tarball, "w:gz") as tar:
            for f in files:
                tar.add(f, arcname=str(f.relative_to(venv.ROOT)))
        size = tarball.stat().st_size
        if size <= limit or not files:
            break
        biggest = max(files, key=lambda f: f.stat().st_size)
        files.remove(biggest)
        left_out.append(f"  left out of the archive, over its {limit / 2**20:.0f} MiB: "
                        f"{biggest.relative_to(venv.ROOT)} ({biggest.stat().st_size / 2**20:.1f} MiB)")
    return [f"packed: {len(files)} files into {tarball} ({size / 2**20:.2f} MiB)"] + left_out


def gpu_check(args: list[str]) -> int:
    """Prove the kit on this machine's GPU within a time budget: the exactness benchmark and the technique matrix
    recorded in data/runs/, every notebook run on the card and stored with its outputs in data/runs/<gpu>/, the tests
    that need CUDA (then the others, in the time left), and a short report of everything that differed from what the
    CPU runs expect, in data/runs/<gpu>-gpu-check.txt. With --out, everything it wrote is packed into
    OUT/gpu-check.tar.gz. Other arguments go to pytest."""
    import argparse
    import csv
    import json

    parser = argparse.ArgumentParser(prog="python3 kit.py gpu-check", description=gpu_check.__doc__)
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help=f"seconds for the whole check from kit.py's start, set-up included (default {BUDGET_S})")
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT") or None,
                        help="folder for gpu-check.tar.gz (default: $OUT where set)")
    parser.add_argument("--notebooks", default="", help="comma-separated name prefixes (03,05_gr): only those")
    parser.add_argument("--workers", type=int, default=NOTEBOOK_WORKERS, help="notebooks run at once")
    parser.add_argument("--skip", action="append", default=[], choices=["bench", "notebooks", "tests"])
    parser.add_argument("--tests", choices=["cuda", "all"], default="all", help="the test files with CUDA-only tests, "
                        "or those and then all the others in the time left (default)")
    parser.add_argument("--cpu", action="store_true", help="run the stages where torch sees no GPU (a rehearsal of "
                        "the command: its card is 'cpu'); without it, no GPU means nothing runs")
    opts, pytest_args = parser.parse_known_args(args)
    end = STARTED + opts.budget
    left = lambda: end - time.monotonic()  # noqa: E731

    probe = subprocess.run([str(venv.VENV_PY), "-c", GPU_PROBE], cwd=venv.ROOT, capture_output=True, text=True)
    if probe.returncode != 0:
        print(probe.stderr[-2000:], file=sys.stderr)
        return probe.returncode
    info = json.loads(probe.stdout.strip().splitlines()[-1])
    if not info["cuda"] and not opts.cpu:
        print(f"kit.py gpu-check: .venv's torch {info['torch']} sees no CUDA GPU. Run kit.py with the python3 "
              "that has this machine's CUDA torch (python3 -c 'import torch; print(torch.cuda.is_available())' "
              "says True), or install a CUDA build of torch into .venv.", file=sys.stderr)
        return 2
    card = info.get("name", "cpu")
    slug = re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-")
    where = (f"{card} (sm_{''.join(map(str, info['capability']))}, {info['devices']} GPU(s))" if info["cuda"] else
             "no GPU: the stages rehearsed on the CPU")
    out = venv.ROOT / "bench" / "out"
    logs = out / "gpu-check"
    logs.mkdir(parents=True, exist_ok=True)
    stored = venv.ROOT / "data" / "runs" / slug
    lines = [f"gpukit gpu-check: {where}, torch {info['torch']}, CUDA {info['cuda_version']}",
             f"budget: {opts.budget:.0f} s from kit.py's start; set-up and probe took "
             f"{time.monotonic() - STARTED:.0f} s"]
    if info["cuda"]:
        # cuBLAS's workspaces (gpukit.warm_up): expected at least one per thread that multiplied.
        first, size = info["first_warm_up"], info["workspace"]
        note = "as expected" if size <= first <= 2 * size + 4 * 2**20 else \
            "NOT between 1 and 2 workspaces (+ cuBLASLt's)"
        lines.append(f"warm-up: the first matmuls left {first:,} B allocated = {first / size:.2f} x the {size:,} B "
                     f"cuBLAS workspace ({note}); the second warm-up {info['second_warm_up']:,} B (expected 0)")
        # The H100's technique matrix of 2026-11-25 made a 1 MiB block more in its first checkpointed row, kept:
        # backward's cuBLASLt workspace (CublasHandlePool.cpp: one per handle and stream), which the warm-up did not make.
        made = info["checkpointed_linear_left"]
        lines.append(f"after the warm-up, a checkpointed Linear(1024, 1024) with a bias left {made:,} B allocated "
                     f"({'as expected' if made == 0 else 'NOT 0: a workspace the warm-up did not make'})")
    problems = []

    def ended(signum, frame):
        raise TimeUp()

    previous = signal.signal(signal.SIGTERM, ended)
    stage, compare, recorded = "bench", None, []

    def compared(deadline: float) -> list[str]:
        """The replay's lines, once it has ended or been stopped at ``deadline``."""
        code = wait_until(compare, deadline)
        table = out / "recorded_runs.csv"
        if code is None:
            problems.append("predictions")
            return ["predictions: CUT at their deadline (bench/out/gpu-check/recorded_runs.log); "
                    "`python3 kit.py bench recorded_runs` replays the recorded matrix on any machine"]
        if code != 0 or not table.exists() or table.stat().st_mtime < compare_began - 1:
            problems.append("predictions")
            return [f"predictions: bench recorded_runs failed (exit {code}; bench/out/gpu-check/recorded_runs.log)"]
        found = comparison_lines(table, recorded[0])
        problems.extend(["predictions"] if len(found) > 1 else [])
        return found
    try:
        # 1. The exactness benchmark (CUDA: the meter against the allocator's own trace) and the technique matrix,
        # alone on the machine: the matrix times steps.
        if "bench" not in opts.skip:
            began, began_wall = time.monotonic(), time.time()   # files' times are the wall clock's
            print(f"== benchmarks: exactness, techniques --record ({min(150.0, 0.35 * left()):.0f} s at most)",
                  flush=True)
            code = run_until([venv.VENV_PY, venv.ROOT / "bench" / "run.py", "exactness", "techniques", "--record"],
                             began + min(150.0, 0.35 * left()), logs / "bench.log")
            took = time.monotonic() - began
            if code is None:
                problems.append("bench")
                lines.append(f"benchmarks: CUT after {took:.0f} s, their deadline (bench/out/gpu-check/bench.log)")
            else:
                lines.append(f"benchmarks: exactness and techniques (exit {code}, {took:.0f} s); the technique "
                             "matrix is in data/runs/")
                problems += ["bench"] if code != 0 else []
            exact = out / "exactness.csv"
            if exact.exists() and exact.stat().st_mtime >= began_wall - 1:
                with open(exact) as f:
                    for row in csv.DictReader(f):
                        if row.get("within_0.1%") != "True":
                            lines.append(f"  exactness off: {row['setup']} on {row['device']}: {row['meter_bytes']} "
                                         f"B against {row['reference_bytes']} B ({row['reference']})")
            recorded = [p.name for p in written_since(began_wall, [venv.ROOT / "data" / "runs"]) if p.suffix == ".csv"]
            if code == 0 and recorded:
                # The run just recorded, replayed: each row predicted for this card beside its measurement (CPU work
                # on fake tensors, so it runs beside the notebooks that do not time anything).
                compare = start([venv.VENV_PY, venv.ROOT / "bench" / "run.py", "recorded_runs", "--record"],
                                logs / "recorded_runs.log")
                compare_began = time.time()

        # 2. Every notebook on the card, stored with its outputs. Those that time steps or fill the card run alone,
        # one at a time, after the others; the others get a share of the time that leaves the lone ones theirs.
        stage = "notebooks"
        if "notebooks" not in opts.skip:
            wanted = [p.strip() for p in opts.notebooks.split(",") if p.strip()]
            notebooks = [nb for nb in sorted((venv.ROOT / "notebooks").glob("*.ipynb"))
                         if not wanted or any(nb.name.startswith(w) for w in wanted)]
            alone = [nb for nb in notebooks if why_alone(nb)]
            together = [nb for nb in notebooks if nb not in alone]
            stored.mkdir(parents=True, exist_ok=True)
            began = time.monotonic()
            deadline = began + min(420.0, 0.85 * left())
            share = (deadline - began) * (0.4 if alone else 1.0) - (NOTEBOOK_GRACE_S if alone else 0)
            print(f"== notebooks: {len(together)}, {opts.workers} at a time ({share:.0f} s at most), then "
                  f"{len(alone)} alone (until {deadline - began:.0f} s)", flush=True)
            results = run_notebooks(together, opts.workers, began + share, stored, logs, card, info["torch"])
            if compare:                     # before the notebooks that time steps: nothing else runs beside them
                lines += compared(began + share)
                compare = None
            results += run_notebooks(alone, 1, deadline, stored, logs, card, info["torch"])
            summary = notebook_lines(results, {nb.stem: why_alone(nb) for nb in alone}, stored)
            summary[0] += f"; {time.monotonic() - began:.0f} s"
            lines += summary
            (stored / "notebooks.json").write_text(json.dumps(results, indent=1) + "\n")
            problems += ["notebooks"] if any(r["failed"] or r["cut"] for r in results) else []

        if compare:
            lines += compared(time.monotonic() + min(120.0, 0.5 * left()))
            compare = None

        # 3. The tests: first those that need CUDA, then the others, in the time left.
        stage = "tests"
        if "tests" not in opts.skip:
            lines += run_tests(end, logs, pytest_args, problems, others=opts.tests == "all")
    except TimeUp:
        problems.append(stage)
        lines.append(f"ENDED from outside (SIGTERM) during the {stage} stage: the stages after it did not run")
    finally:
        signal.signal(signal.SIGTERM, previous)
        if compare:
            stop(compare, 0.0)
        report = venv.ROOT / "data" / "runs" / f"{slug}-gpu-check.txt"
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text("\n".join(lines) + "\n")
        if opts.out:
            written = written_since(STARTED_WALL, [venv.ROOT / "data" / "runs", venv.ROOT / "data" / "traces", out])
            lines += pack(Path(opts.out) / "gpu-check.tar.gz", written)
            report.write_text("\n".join(lines) + "\n")
            pack(Path(opts.out) / "gpu-check.tar.gz", written)      # with the report's last lines
        print("\n".join(lines) + f"\nreport written to {report.relative_to(venv.ROOT)}")
    return 1 if problems else 0


def comparison_lines(table: Path, run: str, tolerance_pct: float = 0.5) -> list[str]:
    """The recorded run ``run`` (a data/runs/ CSV's name) replayed by bench/recorded_runs.py: how many of its rows
    were predicted within ``tolerance_pct`` of the measured peak, state and reserved memory (where the run recorded
    it), and each row that was not."""
    import csv

    with open(table) as f:
        rows = [r for r in csv.DictReader(f) if r.get("run") == run]
    errors = ("peak_error_pct", "state_error_pct", "reserved_error_pct")
    off = [r for r in rows if r.get("status") != "ok"
           or any(r.get(e) and abs(float(r[e])) > tolerance_pct for e in errors)]
    reserved = any(r.get("reserved_error_pct") for r in rows)
    allocated = [r for r in rows if r.get("status") == "ok" and all(
        r.get(e) and abs(float(r[e])) <= tolerance_pct for e in errors[:2])]
    lines = [f"predictions: {len(rows) - len(off)} of {len(rows)} rows of {run} predicted within {tolerance_pct:g}% "
             f"of the measured peak{', state and reserved memory' if reserved else ' and state'} "
             f"({table.relative_to(venv.ROOT)})" + (f"; {len(allocated)} on peak and state alone" if reserved else "")]
    for r in off:
        why = r["status"] if r.get("status") != "ok" else ", ".join(
            f"{e.split('_')[0]} {float(r[e]):+.2f}%" for e in errors if r.get(e))
        lines.append(f"  prediction off: {r['model']}, {r['technique']}: {why}")
        if r.get("trace_difference"):  # the row's allocator trace beside the prediction's (bench/recorded_runs.py)
            lines.append(f"    its trace: {r['trace_same_order']} allocations in the same order; first apart "
                         f"{r['trace_difference']}; the GPU's events replayed reserve "
                         f"{int(r['trace_replay_reserved_bytes']):,} B")
    return lines


def run_tests(end: float, logs: Path, pytest_args: list[str], problems: list[str], others: bool = True) -> list[str]:
    """pytest with xdist, first over the test files with CUDA-only tests, then over the rest, each session stopped at
    the budget's end less the packing's time; every test limited by pytest-timeout where .venv has it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    timeout = subprocess.run([str(venv.VENV_PY), "-c", "import pytest_timeout"], capture_output=True).returncode == 0
    cuda_files = cuda_test_files()
    lines = []
    for name, selection in (("CUDA", cuda_files), ("other", [f"--ignore={f}" for f in cuda_files] + ["tests"])):
        if not selection or (name == "other" and not others):
            continue
        deadline = end - 20
        if deadline - time.monotonic() < 30:
            problems.append("tests")
            lines.append(f"tests ({name}): not run, no time left")
            continue
        junit = logs / f"junit-{name.lower()}.xml"
        junit.unlink(missing_ok=True)  # never read a record left by an earlier run
        per_test = ["-p", "timeout", f"--timeout={max(10, int((deadline - time.monotonic()) / 2))}"] if timeout else []
        began = time.monotonic()
        print(f"== tests ({name}): {deadline - began:.0f} s at most", flush=True)
        code = run_until([venv.VENV_PY, "-m", "pytest", "-p", "xdist", "-n", str(min(16, cores)), "-m", "not notebook",
                          "-p", "no:cacheprovider", f"--junitxml={junit}", *per_test, *pytest_args, *selection],
                         deadline, logs / f"tests-{name.lower()}.log", env=venv.test_environment())
        total, failed, skipped = read_junit(junit)
        status = "CUT at the budget's end" if code is None else f"pytest exit {code}"
        lines.append(f"tests ({name}): {total - len(failed) - len(skipped)} passed, {len(failed)} failed, "
                     f"{len(skipped)} skipped ({status}, {time.monotonic() - began:.0f} s)"
                     + ("" if junit.exists() else "; pytest wrote no record, see bench/out/gpu-check/"
                        f"tests-{name.lower()}.log"))
        lines += failed + skipped
        if failed or code not in (0, 5):
            problems.append("tests")
    return lines


