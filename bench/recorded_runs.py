"""The recorded GPU runs replayed: every CUDA row of data/runs/*.csv predicted for its card, beside the measurement.

A recorded technique matrix (``kit.py bench techniques --record`` on a GPU) holds, per reference model and
technique, the peak of a steady step and the model's state, measured with PyTorch's allocator statistics. Here
each such row is predicted on fake tensors for the card that ran it (``predict(card=...)``; the offload row with
``predict_offload``), with the same setup, technique and ``train_step`` (``gpukit.lessons.techniques``, the
"cuda" sizes, one warm-up step). The recorded run made cuBLAS's workspaces before it measured
(``gpukit.warm_up``), so they are left out of the predicted figures (``Prediction.workspaces``), as they are out
of the measured ones.

A run recorded with its reserved memory (``reserved_bytes``: the technique matrix records it on a GPU since
2026-11-28) is compared on it too, with the prediction's reserved memory (the simulated caching allocator's, the
workspaces' own segments included, as the run's emptied cache kept them).

Rows off by more than 0.5% (the peak, the state or the reserved memory) are printed at the end: what a GPU run says
the predictor still misses. Where the run also kept each row's allocator trace (data/traces/<run>/, recorded by the
technique matrix with ``--record`` since 2026-11-28), the row says where the prediction's allocations first part
from the GPU's (``trace_difference``: the sizes in order, matched as ``difflib`` matches sequences) and what the
simulated allocator reserves when it runs the GPU's own events (``trace_replay_reserved_bytes``): the first says
what the step allocated that the prediction did not, the second whether the allocator's rules or the events differ.

A run recorded before the matrix emptied the cache before each row (the H100's of 2026-11-25: its CSV has no
reserved memory) measured each row after everything its process had run before it: ``kit.py gpu-check`` ran the
exactness benchmark's CUDA cases, then the matrix's rows in order, in one process that never emptied the cache. A
tensor then takes a cached block that an earlier row left, whole where 1 MiB or less would remain, which counts in
``torch.cuda.memory_allocated()``: the convnet's rows there measured 786,432 B more than the same rows on the H200,
from an emptied cache, with the same torch. Such a run's rows are predicted as its process ran them
(``RecordingProcess``): each prediction's allocator events, in the process's order, through one simulated caching
allocator that keeps its cache; the workspaces as the run's warm-up left them (its gpu-check report), and those a
row's step takes beyond them made in that row, as the process made them. The rows' figures from an emptied cache
are kept beside (``fresh_peak_bytes``, ``fresh_state_bytes``).

Writes bench/out/recorded_runs.csv. With ``--record`` (on the machine that recorded a run: ``kit.py gpu-check`` runs
it so), the predicted figures are also written into that run's own CSV in data/runs/, beside the measured ones, with
the gpukit and torch that predicted them.

    python3 kit.py bench recorded_runs [--record]
"""

from __future__ import annotations

import csv
import difflib
import re
import time
from pathlib import Path

import torch
from results import EARLIER, TRACES, write_csv

from gpukit._torch import ScalerThatAlwaysSteps
from gpukit.allocator import CachingAllocator, apply_events
from gpukit.allocator.replay import load_snapshot, replay
from gpukit.cards import card as card_named
from gpukit.counter import round_up
from gpukit.cudarules import cublas_workspace_bytes, cublaslt_workspace_bytes
from gpukit.estimate import default_step, predict
from gpukit.lessons.models import reference_cases
from gpukit.lessons.runs import RUNS_DIR
from gpukit.lessons.techniques import TECHNIQUES, reference_setups, trace_name
from gpukit.offload import predict_offload
from gpukit.step import half_with_float_batchnorm, train_step

TOLERANCE = 0.005  # the bar: 0.5% of the measured figure


def recorded_rows(folder: Path = RUNS_DIR, every: bool = False) -> list[dict]:
    """Every row of every recorded run in ``folder`` and in its ``earlier/`` (runs a later one of the same machine
    replaced: ``results.write_run``) that a GPU measured (device_type cuda, status ok), in the order each run
    measured them, each with its file's path in ``folder`` (``run``); ``every``: the rows that were not measured
    too (a technique the card cannot run, a row that failed), which a process that kept its cache ran between the
    others."""
    rows = []
    for path in sorted(Path(folder).glob("*.csv")) + sorted(Path(folder).glob(f"{EARLIER}/*.csv")):
        with path.open() as f:
            rows += [dict(r, run=path.relative_to(folder).as_posix()) for r in csv.DictReader(f)
                     if r.get("device_type") == "cuda" and (every or r.get("status") == "ok")]
    return rows


class RecordingProcess:
    """The CUDA caching allocator of a process that recorded a run without emptying its cache between rows, replayed
    on the simulated one (gpukit.allocator.CachingAllocator, the card's memory): every prediction ``run`` here goes
    on from the cache the ones before it left, as the process's rows went on from one another's.

    ``warmed``: the bytes the process's first warm-up left allocated (cuBLAS's and cuBLASLt's workspaces, one
    cudaMalloc'd block each: aten/src/ATen/cuda/CublasHandlePool.cpp; kept for the process's life). A prediction
    whose step takes more workspaces than were made before it (a checkpointed Linear recomputed on backward's
    thread, which the warm-up did not make take one) makes them at its start, inside its state, as the process did.
    """

    def __init__(self, card, warmed: int) -> None:
        self.card, self.made = card, 0
        self.allocator = CachingAllocator(card.device_bytes)
        self._make_workspaces(warmed)

    def _make_workspaces(self, nbytes: int) -> None:
        sm90 = self.card.compute_capability == (9, 0)
        big, small = cublas_workspace_bytes(sm90), cublaslt_workspace_bytes(sm90)
        blocks, rest = divmod(nbytes, big)
        lt, rest = divmod(rest, small)
        if rest:
            raise ValueError(f"{nbytes:,} B of workspaces are no sum of cuBLAS's ({big:,} B) and cuBLASLt's "
                             f"({small:,} B) on the {self.card.name}")
        for n in [big] * blocks + [small] * lt:
            self.allocator.malloc(round_up(n))
        self.made += nbytes

    def run(self, p) -> tuple[int, int]:
        """Run a prediction's allocator events (``Prediction``'s or ``OffloadPrediction``'s) here, then free what
        they left (the row's objects die with it); returns ``(state, peak)`` as ``torch.cuda.memory_allocated()``
        counted them in the process: the allocated bytes its build and warm-up added, and those plus the most its
        step added."""
        alloc, addr = self.allocator, {}
        start = alloc.memory_allocated()
        if p.workspaces > self.made:
            self._make_workspaces(p.workspaces - self.made)
        events, k = p.allocator_events, p.step_events_from
        apply_events(alloc, events[:k], addr)
        at = alloc.memory_allocated()
        alloc.reset_peak_stats()
        apply_events(alloc, events[k:], addr)
        peak = alloc.max_memory_allocated() - start
        for a in addr.values():
            alloc.free(a)
        return at - start, peak


def kept_its_cache(run_rows: list[dict]) -> bool:
    """Whether a recorded run measured its rows without emptying the cache between them: the matrix empties it
    before each row since it records reserved memory (2026-11-28), and a run recorded before has no such column."""
    return bool(run_rows) and "reserved_bytes" not in run_rows[0]


def recording_process(run: str, folder: Path = RUNS_DIR) -> RecordingProcess:
    """The process that recorded ``run`` (a CSV's name in ``folder``), replayed up to its matrix's first row: the
    warm-up's workspaces, as its gpu-check report (``<run>-gpu-check.txt``) gives them, then the exactness
    benchmark's CUDA cases, which ``kit.py gpu-check`` ran before the matrix in the same process
    (bench/exactness.py: each model moved to the GPU, stepped twice, then measured for a step and traced for
    another; ``reference_cases`` at its batch of 128)."""
    report = (Path(folder) / run).with_name(f"{Path(run).stem}-gpu-check.txt")
    found = re.search(r"warm-up: the first matmuls left ([0-9,]+) B allocated", report.read_text())
    if found is None:
        raise ValueError(f"{report.name} does not say what the warm-up left allocated")
    with Path(folder, run).open() as f:
        device_name = next(csv.DictReader(f))["device_name"]
    process = RecordingProcess(card_named(device_name), int(found.group(1).replace(",", "")))
    for make_model, make_optimizer, make_batch, _ in reference_cases(128).values():
        process.run(predict(make_model, make_optimizer, make_batch, default_step, card=process.card,
                            breakdown=False, warmup_steps=3))
    return process


def predict_row(row: dict, trace: Path | None = None, process: RecordingProcess | None = None) -> dict:
    """The prediction of one recorded row: its peak and state without cuBLAS's workspaces, and the seconds; with the
    row's allocator ``trace`` (a compact snapshot), also how the prediction's allocations compare with it
    (``compare_trace``). With the ``process`` that recorded the row (a run that kept its cache), the peak and state
    are the process's (``RecordingProcess.run``, the row's turn in it), and those from an emptied cache go beside
    (``fresh_peak_bytes``, ``fresh_state_bytes``)."""
    setup = next(s for s in reference_setups("cuda") if s.name == row["model"])
    technique = next(t for t in TECHNIQUES if t.name == row["technique"])
    card = card_named(row["device_name"])  # torch's device name ("NVIDIA H100 80GB HBM3") names the card

    def make_model():
        model = setup.make_model()
        return half_with_float_batchnorm(model) if technique.half else model

    def step(model, optimizer, batch, state={}):  # noqa: B006 (the scaler is kept across steps, as a loop keeps it)
        if technique.amp is torch.float16 and "scaler" not in state:
            state["scaler"] = ScalerThatAlwaysSteps("cpu")
        train_step(model, optimizer, batch, technique, state.get("scaler"))

    t0 = time.perf_counter()
    make_batch = lambda: setup.make_batch(setup.batch)  # noqa: E731
    adamw = lambda params: torch.optim.AdamW(params)  # noqa: E731
    if technique.offload:
        p = predict_offload(make_model, adamw, make_batch, step, card=card)
        peak, state = p.device_peak, p.device_state
    else:
        p = predict(make_model, adamw, make_batch, step, card=card, breakdown=False)
        peak, state = p.peak, p.before_step
    out = {"predicted_peak_bytes": peak - p.workspaces, "predicted_state_bytes": state - p.workspaces,
           "predicted_reserved_bytes": p.reserved_peak, "predicted_workspace_bytes": p.workspaces, "card": card.key,
           "predict_seconds": round(time.perf_counter() - t0, 2), "cache": "emptied before the row",
           "not_followed": ", ".join(sorted(op.removesuffix(".default") for op in p.unverified_ops))}
    if process is not None:
        out["fresh_peak_bytes"], out["fresh_state_bytes"] = out["predicted_peak_bytes"], out["predicted_state_bytes"]
        out["predicted_state_bytes"], out["predicted_peak_bytes"] = process.run(p)
        out["cache"] = "kept from what its process ran before it"
    if trace is not None and trace.exists():
        try:
            out.update(compare_trace(load_snapshot(trace), getattr(p, "allocator_events", None), card.device_bytes))
        except (ValueError, KeyError, OSError, EOFError) as err:  # the prediction stands; the trace is named
            out["trace_difference"] = f"trace {trace.name} not read: {type(err).__name__}: {err}"[:200]
    return out


def compare_trace(snap: dict, events: list | None, total_memory: int) -> dict:
    """A recorded row's allocator trace beside its prediction's events (``Prediction.allocator_events``; None where
    the prediction keeps none, as ``predict_offload``'s): the allocations in the same order out of each side's
    (``trace_same_order``), where they first part (``trace_difference``: the allocation's number on the GPU and up to
    four sizes on each side, from ``difflib.SequenceMatcher``'s first three differing runs), and the reserved bytes
    the simulated allocator reaches running the GPU's own events (``trace_replay_reserved_bytes``, with ``replay``'s
    account of addresses and segments matched)."""
    trace = snap["device_traces"][0] if snap.get("device_traces") else []
    gpu = [e["size"] for e in trace if e["action"] == "alloc"]
    report = replay(snap, total_memory=total_memory)
    out = {"trace_replay_reserved_bytes": report.allocator.max_memory_reserved(), "trace_replay": str(report)}
    if events is None:
        return {**out, "trace_same_order": "", "trace_difference": "the prediction keeps no events"}
    predicted = [e[2] for e in events if e[0] == "a"]
    matcher = difflib.SequenceMatcher(None, gpu, predicted, autojunk=False)
    same = sum(block.size for block in matcher.get_matching_blocks())

    def sizes(seq: list[int]) -> str:
        shown = ", ".join(f"{n:,}" for n in seq[:4])
        return f"[{shown}{', ...' if len(seq) > 4 else ''}] ({len(seq)})"

    parts = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            parts.append(f"#{i1}: GPU {sizes(gpu[i1:i2])}, predicted {sizes(predicted[j1:j2])}")
        if len(parts) == 3:
            break
    return {**out, "trace_same_order": f"{same}/{len(gpu)} GPU, {same}/{len(predicted)} predicted",
            "trace_difference": "; ".join(parts) or "none: the same sizes in the same order"}


def error(predicted: int, measured: int) -> float:
    return (predicted - measured) / measured


def main(record: bool = False) -> list[dict]:
    print(f"{'model':<26}{'technique':<44}{'peak MiB':>10}{'pred.':>10}{'err %':>8}{'state MiB':>11}{'pred.':>10}"
          f"{'err %':>8}", flush=True)
    rows = replay_rows(recorded_rows(every=True))
    write_csv("recorded_runs.csv", rows)
    if record:
        written = ", ".join(write_back(rows)) or "none (no run of this machine was replayed)"
        print(f"predictions written beside the measurements in data/runs/: {written}")
    return rows


def replay_rows(every: list[dict], folder: Path = RUNS_DIR) -> list[dict]:
    """Each measured row of ``every`` (``recorded_rows(folder, every=True)``) predicted, beside its measurement, in
    the order its run measured them; the rows of a run that kept its cache as its process ran them
    (``recording_process``), up to a row that failed on the GPU or is not predicted here: what that row left in the
    cache is unknown, so those after it are predicted from an emptied cache, and say so (``cache``)."""
    rows = []
    processes: dict[str, RecordingProcess | str | None] = {}  # run -> its process, or why its history is unknown
    for rec in every:
        run = rec["run"]
        if run not in processes:
            processes[run] = None
            if kept_its_cache([r for r in every if r["run"] == run]):
                try:
                    processes[run] = recording_process(run, folder)
                except Exception as err:  # (its rows are then predicted from an emptied cache, and say why)
                    processes[run] = f"its process's start is unknown ({type(err).__name__}: {err})"[:200]
        process = processes[run]
        if rec.get("status") != "ok":
            if isinstance(process, RecordingProcess) and not rec.get("status", "").startswith("not run"):
                processes[run] = f"the cache after {rec['model']}, {rec['technique']} ({rec['status'][:60]}) is unknown"
            continue
        out = {"run": run, "model": rec["model"], "technique": rec["technique"],
               "measured_peak_bytes": int(rec["peak_bytes"]), "measured_state_bytes": int(rec["state_bytes"]),
               "torch_measured": rec["torch"]}
        try:
            out.update(predict_row(rec, TRACES / Path(run).with_suffix("") / trace_name(rec["model"], rec["technique"]),
                                   process if isinstance(process, RecordingProcess) else None))
        except Exception as err:  # a row the predictor cannot follow is reported, by name, and the rest go on
            out["status"] = f"not predicted: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
            rows.append(out)
            print(f"{rec['model']:<26}{rec['technique']:<44}  {out['status']}", flush=True)
            if isinstance(process, RecordingProcess):  # what that row left cached is not known: nor what follows
                processes[run] = f"the cache after {rec['model']}, {rec['technique']} (not predicted) is unknown"
            continue
        if isinstance(process, str):  # a run that kept its cache, from a point the replay cannot follow
            out["cache"] = f"kept, but {process}: predicted from an emptied cache"
        out["peak_error_pct"] = round(100 * error(out["predicted_peak_bytes"], out["measured_peak_bytes"]), 3)
        out["state_error_pct"] = round(100 * error(out["predicted_state_bytes"], out["measured_state_bytes"]), 3)
        out["measured_reserved_bytes"] = out["reserved_error_pct"] = None  # (a run recorded before had none)
        if rec.get("reserved_bytes"):  # (recorded since 2026-11-28)
            out["measured_reserved_bytes"] = int(rec["reserved_bytes"])
            out["reserved_error_pct"] = round(100 * error(out["predicted_reserved_bytes"],
                                                          out["measured_reserved_bytes"]), 3)
        out["status"] = "ok"
        rows.append(out)
        print(f"{rec['model']:<26}{rec['technique']:<44}{out['measured_peak_bytes'] / 2**20:>10.1f}"
              f"{out['predicted_peak_bytes'] / 2**20:>10.1f}{out['peak_error_pct']:>8.2f}"
              f"{out['measured_state_bytes'] / 2**20:>11.1f}{out['predicted_state_bytes'] / 2**20:>10.1f}"
              f"{out['state_error_pct']:>8.2f}", flush=True)
    return rows


PREDICTED = ("predicted_peak_bytes", "predicted_state_bytes", "predicted_reserved_bytes", "predicted_workspace_bytes")


def write_back(rows: list[dict], folder: Path = RUNS_DIR, info: dict | None = None) -> list[str]:
    """Write each replayed row's predicted figures into its recorded run's CSV in ``folder``, beside the measured
    ones (the columns ``PREDICTED``, and ``predicted_with``: the gpukit and torch that predicted), for the run of this
    machine only (``results.slug`` of ``info``, by default this machine's: a run another card recorded keeps what it
    had). Returns the names of the files written."""
    from results import machine, slug, write_rows

    import gpukit

    mine = f"{slug(info or machine())}.csv"
    written = []
    for path in sorted(Path(folder).glob(mine)):
        with path.open() as f:
            recorded = list(csv.DictReader(f))
        found = {(r["model"], r["technique"]): r for r in rows if r["run"] == path.name and r.get("status") == "ok"}
        if not found:
            continue
        with_ = f"gpukit {gpukit.__version__}, torch {torch.__version__}"
        for row in recorded:
            got = found.get((row["model"], row["technique"]))
            row.update({k: got[k] for k in PREDICTED} if got else dict.fromkeys(PREDICTED, ""))
            row["predicted_with"] = with_ if got else ""
        write_rows(path, recorded, {})
        written.append(path.name)
    return written


def within(row: dict, figures=("peak", "state", "reserved"), tolerance: float = TOLERANCE) -> bool:
    """Whether the row was predicted and each of ``figures`` the run recorded is within ``tolerance`` of it."""
    return row.get("status") == "ok" and all(abs(row.get(f"{f}_error_pct") or 0) <= 100 * tolerance
                                             for f in figures)


def off(rows: list[dict], tolerance: float = TOLERANCE) -> list[dict]:
    """The rows whose predicted peak, state or (where the run recorded it) reserved memory is off by more than
    ``tolerance`` of the measured one, or not predicted at all."""
    return [r for r in rows if not within(r, tolerance=tolerance)]


def summary(rows: list[dict]) -> list[str]:
    missed = off(rows)
    allocated = [r for r in rows if within(r, ("peak", "state"))]
    lines = [f"recorded GPU runs: {len(rows) - len(missed)} of {len(rows)} rows predicted within "
             f"{100 * TOLERANCE:g}% (peak and state, and reserved memory where the run has it); "
             f"{len(allocated)} on peak and state alone"]
    for run in dict.fromkeys(r["run"] for r in rows if str(r.get("cache", "")).startswith("kept from")):
        mine = [r for r in rows if r["run"] == run and str(r.get("cache", "")).startswith("kept from")]
        fresh = sum(all(abs(error(r[f"fresh_{f}_bytes"], r[f"measured_{f}_bytes"])) <= TOLERANCE
                        for f in ("peak", "state")) for r in mine)
        lines.append(f"  {run.removesuffix('.csv')} kept its cache from row to row: {len(mine)} rows predicted as its "
                     f"process ran them; from an emptied cache {fresh} of them would be within {100 * TOLERANCE:g}%")
    for run in dict.fromkeys(r["run"] for r in missed):  # each recorded run (a card) apart, in the order read
        lines.append(f"  off on {run.removesuffix('.csv')}:")
        for r in missed:
            if r["run"] == run:
                reserved = r.get("reserved_error_pct")
                why = r["status"] if r.get("status") != "ok" else (
                    f"peak {r['peak_error_pct']:+.2f}%, state {r['state_error_pct']:+.2f}%"
                    + (f", reserved {reserved:+.2f}%" if reserved is not None else ""))
                lines.append(f"    {r['model']}, {r['technique']}: {why}"
                             + (f" (named as not followed: {r['not_followed']})"
                                if r.get("not_followed") else ""))
                if r.get("trace_difference"):
                    lines.append(f"      its trace: {r['trace_same_order']} allocations in the same order; first apart "
                                 f"{r['trace_difference']}; the GPU's events replayed reserve "
                                 f"{r['trace_replay_reserved_bytes']:,} B")
    return lines


if __name__ == "__main__":
    import sys

    print("\n".join(summary(main(record="--record" in sys.argv[1:]))))
