"""Speed of the simulated CUDA caching allocator (gpukit.allocator).

Two rows kinds in bench/out/allocator.csv:

* ``step``: a training step of each reference model inside ``measure()`` on the CPU, with the
  simulated allocator following every allocation (what ``measure()`` does by default), with the same
  simulation running every step's events afresh (``reset_cpu_device(lazy=False)``: no step's recorded
  outcome reused), and with the counter alone (``set_cpu_simulation(False)``); medians of steady-state
  steps in alternating blocks, and their ratios. Each block starts a fresh simulated device; its first
  three steps are timed apart (the first fills the cache; the second and third run in full while the
  simulation finds that the steps repeat and records one), as what a training run pays once.
* ``replay``: malloc/free events per second through ``CachingAllocator``, from the allocation
  sequence of a real training step recorded on a GPU (data/traces/, replayed over and over until a
  million events), with expandable segments off and on.

    python3 kit.py bench allocator
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from meter_overhead import CASES
from results import write_csv

import gpukit
from gpukit.allocator import CachingAllocator, load_snapshot, reset_cpu_device, set_cpu_simulation
from gpukit.estimate import default_step

TRACE = Path(__file__).resolve().parent.parent / "data" / "traces" / "memory_files_memory_ctx128_fullstep.json.gz"
EVENTS = 1_000_000


def step_case(make_model, make_batch, batch: int, repeats: int, block: int = 5, warm: int = 3) -> dict:
    """Median step time inside ``measure()`` with the simulated allocator (as measure() runs it, and running
    every event), and with the counter alone, in alternating blocks of ``warm`` + ``block`` steps. Each block
    starts a fresh simulated device: its first ``warm`` steps (a cold cache, then the steps a repeat is found
    and recorded in) are timed apart from the steady state a training loop spends its time in."""
    device = torch.device("cpu")
    torch.manual_seed(0)
    x, y = make_batch(batch)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def run() -> float:
        t0 = time.perf_counter()
        with gpukit.measure(device, record=False):
            default_step(model, opt, (x, y))
        return time.perf_counter() - t0

    modes = ("simulated", "every event", "counter")
    times: dict[str, list[float]] = {m: [] for m in modes}
    firsts: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(repeats + 1):
        for mode in modes:
            set_cpu_simulation(mode != "counter")
            if mode != "counter":
                reset_cpu_device(lazy=mode == "simulated")
            first = [run() for _ in range(warm)]
            steps = [run() for _ in range(block)]
            if i:  # the first round warms up every mode
                times[mode] += steps
                firsts[mode] += first
    set_cpu_simulation(True)
    reset_cpu_device()
    med = {m: statistics.median(times[m]) for m in modes}
    first = {m: statistics.mean(firsts[m]) for m in modes}
    return {"counter_ms": round(med["counter"] * 1e3, 3), "with_simulation_ms": round(med["simulated"] * 1e3, 3),
            "every_event_ms": round(med["every event"] * 1e3, 3),
            "ratio": round(med["simulated"] / med["counter"], 3),
            "every_event_ratio": round(med["every event"] / med["counter"], 3), "timed_steps": len(times["counter"]),
            "first_steps_ratio": round(first["simulated"] / first["counter"], 3)}


def replay_speed(expandable: bool) -> dict:
    trace = load_snapshot(TRACE)["device_traces"][0]
    ops = [(e["action"] == "alloc", e["addr"], e["size"]) for e in trace if e["action"] in ("alloc", "free_completed")]
    # only the step's own allocations: frees of blocks made before the trace began are left out
    born, seq = set(), []
    for is_alloc, addr, size in ops:
        if is_alloc:
            born.add(addr)
            seq.append((True, addr, size))
        elif addr in born:
            born.discard(addr)
            seq.append((False, addr, size))
    seq += [(False, a, 0) for a in born]  # free what is left so the sequence repeats from the same state
    sim = CachingAllocator("80 GiB", "expandable_segments:True" if expandable else "")
    malloc, free = sim.malloc, sim.free
    done = 0
    c0, t0 = time.process_time(), time.perf_counter()
    while done < EVENTS:
        live = {}
        for is_alloc, addr, size in seq:
            if is_alloc:
                live[addr] = malloc(size)
            else:
                free(live.pop(addr))
        done += len(seq)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"events": done, "seconds": round(seconds, 3), "events_per_s": int(done / seconds),
            "seconds_per_million": round(seconds / done * 1e6, 3),
            "cpu_seconds_per_million": round(cpu / done * 1e6, 3)}  # CPU time: what a busy machine does not inflate


PICTURE = Path(__file__).resolve().parent.parent / "docs" / "segment_map.png"


def picture(path: Path = PICTURE) -> Path:
    """docs/segment_map.png: notebook 08's fragmentation, on a simulated allocator, with the defaults and with
    max_split_size_mb:40 (a 60 MiB tensor freed, five 8 MiB ones made and three freed, 60 MiB asked again)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mb = 1024 * 1024
    fig, axes = plt.subplots(2, 1, figsize=(9, 4.2))
    for ax, settings in zip(axes, ("", "max_split_size_mb:40")):
        sim = CachingAllocator("80 GiB", settings, fraction=100 * mb / (80 * 1024**3))
        sim.free(sim.malloc(60 * mb))
        smalls = [sim.malloc(8 * mb) for _ in range(5)]
        for a in smalls[0::2]:
            sim.free(a)
        before = sim.segments()
        try:
            sim.malloc(60 * mb)
            outcome = "fits"
        except torch.OutOfMemoryError:
            outcome = "CUDA out of memory"
        from gpukit.allocator import plot_segments

        plot_segments(before, ax=ax, title=f"{settings or 'defaults'}: 16 MiB in use under a 100 MiB cap; "
                                           f"60 MiB asked again: {outcome} (simulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(repeats: int = 20) -> list[dict]:
    rows = []
    for name, make_model, make_batch, batch in CASES:
        row = {"kind": "step", "case": name, "batch": batch, "device": "cpu", "threads": torch.get_num_threads(),
               "repeats": repeats, **step_case(make_model, make_batch, batch, repeats)}
        rows.append(row)
        print(f"{name:<13} batch {batch:>4}: counter alone {row['counter_ms']:8.2f} ms, with the simulated "
              f"allocator {row['with_simulation_ms']:8.2f} ms ({row['ratio']:.3f}x; running every event "
              f"{row['every_event_ratio']:.3f}x; a fresh simulated device's first three steps "
              f"{row['first_steps_ratio']:.2f}x)", flush=True)
    for expandable in (False, True):
        row = {"kind": "replay", "case": "expandable_segments" if expandable else "segments", "device": "cpu",
               **replay_speed(expandable)}
        rows.append(row)
        print(f"replay ({row['case']}): {row['events']:,} malloc/free events in {row['seconds']:.2f} s "
              f"({row['events_per_s']:,}/s; {row['cpu_seconds_per_million']:.2f} CPU-s per million)", flush=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    write_csv("allocator.csv", [{k: r.get(k) for k in keys} for r in rows])
    print(f"wrote {picture()}", flush=True)
    return rows


def summary(rows: list[dict]) -> list[str]:
    steps = ", ".join(f"{r['case']} {r['ratio']:.3f}x ({r['every_event_ratio']:.3f}x running every event)"
                      for r in rows if r["kind"] == "step")
    replays = ", ".join(f"{r['case']} {r['seconds_per_million']:.2f} s ({r['cpu_seconds_per_million']:.2f} CPU-s)"
                        for r in rows if r["kind"] == "replay")
    return [f"simulated allocator: steady-state step time with it over the counter alone: {steps}; "
            f"a million malloc/free events: {replays}"]


if __name__ == "__main__":
    main()
