"""The GPU run recorded in data/runs/ replayed: its rows, read as data, predicted for the card that measured them.
Device: cpu (predicting for the NVIDIA H100 80GB HBM3 that recorded data/runs/nvidia-h100-80gb-hbm3.csv with
torch 2.11.0+cu130). ``python3 kit.py bench recorded_runs`` replays every row and lists those still off by more
than 0.5%; this test replays four that the predictor follows to the byte: their memory is the optimizer step's, the
host's, the bias gradient's sum (with the staging buffer CUDA's reduction kernel takes), and AMP fp16's. That run
kept its cache from row to row: its rows are replayed as its process ran them too."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def load_bench(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def replay():
    sys.path.insert(0, str(ROOT / "bench"))  # (bench/recorded_runs.py imports bench/results.py)
    try:
        yield load_bench("recorded_runs")
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_the_recorded_rows_are_read_as_data_and_name_their_card(replay):
    rows = replay.recorded_rows()
    h100 = [r for r in rows if r["run"] == "nvidia-h100-80gb-hbm3.csv"]
    assert len(h100) == 30 and {r["device_name"] for r in h100} == {"NVIDIA H100 80GB HBM3"}
    assert all(int(r["peak_bytes"]) >= int(r["state_bytes"]) > 0 for r in h100)


@pytest.mark.parametrize("technique", ["offload saved activations", "accumulation k=4", "baseline", "AMP fp16"])
def test_a_recorded_h100_row_is_predicted_to_the_byte(replay, technique):
    """The deep MLP, 8192 samples a step: with saved activations on the host the GPU's peak is the optimizer
    step's; with 4 micro-batches too. AdamW's 18 step counters (512 B each) are on the host, not the GPU
    (torch/optim/adam.py: on the parameter's device only when capturable or fused; gpukit.hoststate). The
    baseline's peak is the sum of the last hidden layer's (8192, 4096) gradient into its bias's, while CUDA's
    reduction kernel holds its 132 MiB staging buffer (gpukit.cudarules: Reduce.cuh's global_memory_size). AMP fp16
    keeps its GradScaler's scale and growth tracker (512 B each) on the GPU between steps."""
    row = next(r for r in replay.recorded_rows() if r["model"] == "deep mlp 4096x8" and r["technique"] == technique)
    got = replay.predict_row(row)
    assert got["card"] == "h100" and got["predicted_workspace_bytes"] > 0
    assert (got["predicted_peak_bytes"], got["predicted_state_bytes"]) == (int(row["peak_bytes"]),
                                                                           int(row["state_bytes"]))
    # reserved: whole segments (2 MiB multiples: CUDACachingAllocator.cpp's kSmallBuffer, kRoundLarge), at least what
    # the step allocated with the workspaces
    reserved = got["predicted_reserved_bytes"]
    assert reserved % 2**21 == 0 and reserved >= got["predicted_peak_bytes"] + got["predicted_workspace_bytes"]


def test_the_replay_writes_its_predictions_beside_the_measurements_of_this_machines_run_only(replay, tmp_path):
    """Device: none. ``--record`` (kit.py gpu-check runs it on the GPU that recorded the run) writes each replayed
    row's predicted figures into that run's CSV, beside its measured ones, with what predicted them; a row not
    replayed gets empty cells, every measured cell stays as it was, and another card's run is left alone."""
    import csv
    import shutil

    names = ("nvidia-h100-80gb-hbm3.csv", "nvidia-h200.csv")
    for name in names:
        shutil.copy(ROOT / "data" / "runs" / name, tmp_path / name)
    before = {name: (tmp_path / name).read_text() for name in names}
    figures = {"predicted_peak_bytes": 5, "predicted_state_bytes": 3, "predicted_reserved_bytes": 2**21,
               "predicted_workspace_bytes": 1}
    rows = [{"run": names[0], "model": "deep mlp 4096x8", "technique": "baseline", "status": "ok", **figures},
            {"run": names[0], "model": "tinygpt 12x768", "technique": "AMP fp16", "status": "not predicted: x"},
            {"run": names[1], "model": "deep mlp 4096x8", "technique": "baseline", "status": "ok", **figures}]
    h100 = {"device_name": "NVIDIA H100 80GB HBM3", "device_type": "cuda", "cores": 2}
    assert replay.write_back(rows, tmp_path, info=h100) == [names[0]]
    assert (tmp_path / names[1]).read_text() == before[names[1]]
    with open(tmp_path / names[0]) as f:
        written = list(csv.DictReader(f))
    with open(ROOT / "data" / "runs" / names[0]) as f:
        measured = list(csv.DictReader(f))
    assert [{k: r[k] for k in m} for r, m in zip(written, measured)] == measured and len(written) == len(measured)
    for r in written:
        mine = (r["model"], r["technique"]) == ("deep mlp 4096x8", "baseline")
        assert [r[k] for k in figures] == ([str(v) for v in figures.values()] if mine else [""] * 4)
        assert r["predicted_with"].startswith("gpukit ") == mine


def test_the_h200s_tiny_gpt_row_is_predicted_to_the_byte_as_torch_cuda_counts_blocks(replay):
    """Device: cpu, predicting for the NVIDIA H200 that recorded data/runs/nvidia-h200.csv (torch 2.11.0+cu130, the
    cache emptied before each row). The tiny GPT's parameters and AdamW's moments are tensors of 2.25 to 9 MiB:
    the caching allocator splits a large block only where more than 1 MiB would remain (CUDACachingAllocator.cpp
    ``should_split``), and ``torch.cuda.memory_allocated()`` counts the block whole. Its baseline step, measured at
    3,551,142,912 B with 1,385,757,696 B between steps, was predicted 51.7 MB and 23.6 MB under from the tensors'
    sizes alone; the simulated allocator's blocks give both to the byte."""
    row = next(r for r in replay.recorded_rows() if r["run"] == "nvidia-h200.csv"
               and r["model"] == "tinygpt 12x768" and r["technique"] == "baseline")
    got = replay.predict_row(row)
    assert got["card"] == "h200"
    assert (got["predicted_peak_bytes"], got["predicted_state_bytes"]) == (int(row["peak_bytes"]),
                                                                           int(row["state_bytes"]))
    assert (int(row["peak_bytes"]), int(row["state_bytes"])) == (3_551_142_912, 1_385_757_696)


def test_the_summary_counts_rows_within_the_bar_on_every_figure_and_on_peak_and_state_alone(replay):
    """Device: none. A row is within the bar when its peak, its state and, where the run recorded it, its reserved
    memory are within 0.5%; the summary also counts the rows whose peak and state alone are."""
    rows = [{"run": "a.csv", "model": "m", "technique": "t1", "status": "ok", "peak_error_pct": 0.0,
             "state_error_pct": 0.5, "reserved_error_pct": -0.2},
            {"run": "a.csv", "model": "m", "technique": "t2", "status": "ok", "peak_error_pct": 0.1,
             "state_error_pct": 0.0, "reserved_error_pct": -30.0},
            {"run": "b.csv", "model": "m", "technique": "t3", "status": "ok", "peak_error_pct": 0.6,
             "state_error_pct": 0.0},
            {"run": "b.csv", "model": "m", "technique": "t4", "status": "not predicted: x"}]
    rows[1].update(trace_same_order="9/10 GPU, 9/9 predicted", trace_difference="#3: GPU [512] (1), predicted [] (0)",
                   trace_replay_reserved_bytes=2097152)  # (a run that kept its traces)
    lines = replay.summary(rows)
    assert lines[0] == ("recorded GPU runs: 1 of 4 rows predicted within 0.5% (peak and state, and reserved memory "
                        "where the run has it); 2 on peak and state alone")
    assert lines[1:] == ["  off on a:", "    m, t2: peak +0.10%, state +0.00%, reserved -30.00%",
                         "      its trace: 9/10 GPU, 9/9 predicted allocations in the same order; first apart #3: GPU "
                         "[512] (1), predicted [] (0); the GPU's events replayed reserve 2,097,152 B",
                         "  off on b:", "    m, t3: peak +0.60%, state +0.00%", "    m, t4: not predicted: x"]


def test_a_rows_allocator_trace_is_kept_and_set_beside_a_predictions_events(replay, tmp_path):
    """Device: cpu, the row's trace recorded on the simulated card (gpukit.SimulatedCuda) as the technique matrix
    records it on a GPU (``torch.cuda.memory._record_memory_history``). The trace replays to the addresses and
    segments the card recorded; set beside itself it parts nowhere, and beside events that lost one allocation
    and gained another it names that allocation's number and both sizes."""
    from gpukit.allocator.replay import load_snapshot
    from gpukit.lessons.techniques import TECHNIQUES, measure_technique, recorded_trace, reference_setups, trace_name

    setup = reference_setups("small")[0]
    path = tmp_path / "cpu" / trace_name(setup.name, TECHNIQUES[3].name)
    assert path.name == "deep-mlp-64x8--accumulation-k-4.json.gz"
    row = measure_technique(setup, TECHNIQUES[3], "cpu", steps=0, trace=path)
    assert row["status"] == "ok"
    snap = load_snapshot(path)
    trace = snap["device_traces"][0]
    events = [("a", e["addr"], e["size"]) if e["action"] == "alloc" else ("f", e["addr"])
              for e in trace if e["action"] in ("alloc", "free_completed")]
    allocs = [e for e in events if e[0] == "a"]
    assert len(allocs) > 100
    same = replay.compare_trace(snap, events, 2**34)
    assert same["trace_same_order"] == f"{len(allocs)}/{len(allocs)} GPU, {len(allocs)}/{len(allocs)} predicted"
    assert same["trace_difference"] == "none: the same sizes in the same order"
    assert same["trace_replay_reserved_bytes"] == sum(s["total_size"] for s in snap["segments"])
    assert same["trace_replay"].startswith(f"{len(trace)} events: {len(allocs)}/{len(allocs)} allocations at the "
                                           "recorded address")
    k = events.index(allocs[40])
    changed = events[:k] + [("a", -1, 123_456)] + events[k + 1:]
    apart = replay.compare_trace(snap, changed, 2**34)
    assert apart["trace_difference"] == f"#40: GPU [{allocs[40][2]:,}] (1), predicted [123,456] (1)"
    assert replay.compare_trace(snap, None, 2**34)["trace_difference"] == "the prediction keeps no events"
    # A trace that cannot be read leaves the row's prediction as it is, and says so.
    (tmp_path / "bogus.json.gz").write_bytes(b"\x1f\x8bnot a trace")
    recorded = next(r for r in replay.recorded_rows()
                    if r["model"] == "deep mlp 4096x8" and r["technique"] == "AMP fp16")
    got = replay.predict_row(recorded, tmp_path / "bogus.json.gz")
    assert (got["predicted_peak_bytes"], got["predicted_state_bytes"]) == (int(recorded["peak_bytes"]),
                                                                           int(recorded["state_bytes"]))
    assert got["trace_difference"].startswith("trace bogus.json.gz not read: ")
    # A block that fails keeps no trace, and leaves no simulated card following the process's tensors.
    import gpukit.simulated

    with pytest.raises(RuntimeError), recorded_trace(torch.device("cpu"), tmp_path / "failed.json.gz"):
        torch.ones(1000)
        raise RuntimeError("the step failed")
    assert not (tmp_path / "failed.json.gz").exists()
    assert gpukit.simulated._ACTIVE is None or gpukit.simulated._ACTIVE._closed
    # A trace that cannot be written (its folder is a file) warns and leaves the row's figures as they are.
    (tmp_path / "a file").write_text("")
    with pytest.warns(RuntimeWarning, match="the allocator trace could not be kept"):
        again = measure_technique(setup, TECHNIQUES[3], "cpu", steps=0, trace=tmp_path / "a file" / path.name)
    assert (again["status"], again["peak_bytes"], again["state_bytes"]) == ("ok", row["peak_bytes"], row["state_bytes"])


def test_a_run_that_kept_its_cache_is_predicted_as_its_process_ran_up_to_a_row_that_failed(replay, tmp_path):
    """Device: cpu, predicting for the NVIDIA H100 that recorded data/runs/nvidia-h100-80gb-hbm3.csv (torch
    2.11.0+cu130) in one process that never emptied the cache: ``kit.py gpu-check`` ran the exactness benchmark's
    CUDA cases, then the matrix's rows. A tensor takes a cached block an earlier row left, whole where 1 MiB or less
    would remain (CUDACachingAllocator.cpp ``should_split``), and ``torch.cuda.memory_allocated()`` counts the block:
    from an emptied cache the convnet's baseline is predicted 786,432 B under on its peak and its state. Replayed
    after what its process ran before it, both are right to the byte; so is the deep MLP's checkpointing row, whose
    recompute on backward's thread made a cuBLASLt workspace (1 MiB) that the warm-up had not made. A technique the
    card did not run allocated nothing and changes nothing; after a row that failed on the GPU the cache is unknown,
    and the next row says it was predicted from an emptied cache."""
    import csv
    import shutil

    runs = ROOT / "data" / "runs"  # (in earlier/, dated, once a later H100 run replaces it: bench/results.py)
    kept = next(p for p in (runs / "nvidia-h100-80gb-hbm3.csv", runs / "earlier/nvidia-h100-80gb-hbm3-2026-11-25.csv")
                if p.exists() and "2026-11-25" in p.read_text().splitlines()[1])
    # replayed as kept in earlier/ (where a later H100 run puts it), with its report beside it
    (tmp_path / "earlier").mkdir()
    shutil.copy(kept.with_name(f"{kept.stem}-gpu-check.txt"),
                tmp_path / "earlier" / "nvidia-h100-80gb-hbm3-2026-11-25-gpu-check.txt")
    with open(kept) as f:
        measured = list(csv.DictReader(f))
    assert replay.kept_its_cache(measured)
    assert not replay.kept_its_cache([r for r in replay.recorded_rows(every=True) if r["run"] == "nvidia-h200.csv"])
    conv = [r for r in measured if r["model"].startswith("convnet")]
    figures = ("peak_bytes", "state_bytes", "step_ms", "samples_per_s")
    not_run = {**conv[2], **dict.fromkeys(figures, ""), "status": "not run: this card has no bfloat16"}
    failed = {**conv[1], **dict.fromkeys(figures, ""), "status": "failed on cuda: CUDA error: an illegal access"}
    with open(tmp_path / "earlier" / "nvidia-h100-80gb-hbm3-2026-11-25.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(measured[0]))
        writer.writeheader()
        writer.writerows(measured[:10] + [not_run, conv[0], failed, conv[3]])
    got = {r["technique"] if r["model"].startswith("deep") else "convnet " + r["technique"]: r
           for r in replay.replay_rows(replay.recorded_rows(tmp_path, every=True), tmp_path)}
    assert len(got) == 12 and all(r["status"] == "ok" for r in got.values())
    for name in ("checkpointing", "convnet baseline"):
        row = got[name]
        assert row["cache"] == "kept from what its process ran before it"
        assert (row["predicted_peak_bytes"], row["predicted_state_bytes"]) == (row["measured_peak_bytes"],
                                                                               row["measured_state_bytes"])
    ckpt, base = got["checkpointing"], got["convnet baseline"]
    assert ckpt["measured_state_bytes"] - ckpt["fresh_state_bytes"] == 2**20
    assert (base["measured_peak_bytes"] - base["fresh_peak_bytes"],
            base["measured_state_bytes"] - base["fresh_state_bytes"]) == (786_432, 786_432)
    after = got["convnet accumulation k=4"]
    assert after["cache"] == ("kept, but the cache after convnet 128 (BatchNorm), AMP fp16 (failed on cuda: CUDA "
                              "error: an illegal access) is unknown: predicted from an emptied cache")
    assert "fresh_peak_bytes" not in after and after["measured_state_bytes"] - after["predicted_state_bytes"] == 786_432
    lines = replay.summary(list(got.values()))
    assert lines[1] == ("  earlier/nvidia-h100-80gb-hbm3-2026-11-25 kept its cache from row to row: 11 rows predicted "
                        "as its process ran them; from an emptied cache 10 of them would be within 0.5%")


def test_a_run_that_kept_its_cache_without_its_report_is_predicted_from_an_emptied_cache_and_says_why(replay,
                                                                                                        tmp_path):
    """Device: cpu, predicting for the NVIDIA H100. Without the gpu-check report that says what the process's
    warm-up left allocated, the process cannot be replayed: its rows are predicted from an emptied cache and say
    why, where the replay would have raised or guessed."""
    import csv

    with open(ROOT / "data" / "runs" / "nvidia-h200.csv") as f:  # (its first row, as the H100's run kept it)
        row = {k: v for k, v in next(csv.DictReader(f)).items() if k != "reserved_bytes"}
    with open(tmp_path / "h200-kept.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        writer.writeheader()
        writer.writerow(row)
    got = replay.replay_rows(replay.recorded_rows(tmp_path, every=True), tmp_path)
    assert [r["status"] for r in got] == ["ok"] and "fresh_peak_bytes" not in got[0]
    assert got[0]["cache"].startswith("kept, but its process's start is unknown (FileNotFoundError: ")
    assert got[0]["cache"].endswith(": predicted from an emptied cache")
    assert got[0]["predicted_peak_bytes"] == int(row["peak_bytes"])  # (the deep MLP's baseline: to the byte)
