"""How exact the meter is: its peak against an independent measurement of the same training step.

For each reference setup (gpukit.lessons.models.reference_cases), in the steady state (gradients and
optimizer state exist): the CPU counter's peak (unrounded: as requested) against PyTorch's own
MemTracker measuring the same step; and, on a machine with CUDA, gpukit.measure('cuda')'s peak of
requested bytes (from the allocator's statistics) against the same peak replayed from the allocator's own
trace of allocations and frees (torch.cuda.memory._record_memory_history), after gpukit.warm_up.
Difference in bytes and percent; the kit promises agreement within 0.1%.
Writes bench/out/exactness.csv.

    python3 kit.py bench exactness
"""

from __future__ import annotations

import gc

import torch
from results import write_csv

import gpukit
from gpukit.estimate import default_step
from gpukit.lessons.models import reference_cases
from gpukit.roles import memtracker_peak

BATCH = 128
TOLERANCE = 0.001  # 0.1%


def steady_state(make_model, make_optimizer, make_batch, device: torch.device):
    """Model, optimizer and batch on ``device`` after two training steps (gradients and optimizer state exist)."""
    torch.manual_seed(0)
    model = make_model().to(device)
    optimizer = make_optimizer(model.parameters())
    batch = tuple(t.to(device) for t in make_batch())
    for _ in range(2):
        default_step(model, optimizer, batch)
    return model, optimizer, batch


def allocator_trace_peak(run, device: torch.device) -> int:
    """Peak requested bytes of ``run()`` above its start, replayed from the CUDA caching allocator's own log of
    allocations and frees (``torch.cuda.memory._record_memory_history`` and ``_snapshot()['device_traces']``).

    Independent of the statistics gpukit reads (``memory_stats``' counters): each 'alloc' event carries the
    size requested and each 'free_requested' the same size again (c10/cuda/CUDACachingAllocator.cpp,
    ``record_trace(TraceEntry::ALLOC, ..., orig_size, ...)`` and ``FREE_REQUESTED ... block->requested_size``),
    so the replay is compared with gpukit's peak of requested bytes.
    """
    index = device.index
    torch.cuda.synchronize(device)
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=10**7)
    try:
        traces = torch.cuda.memory._snapshot()["device_traces"]
        skip = len(traces[index]) if index < len(traces) else 0
        run()
        torch.cuda.synchronize(device)
        events = torch.cuda.memory._snapshot()["device_traces"][index][skip:]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    level = peak = 0
    for event in events:
        if event["action"] == "alloc":
            level += event["size"]
            peak = max(peak, level)
        elif event["action"] == "free_requested":
            level -= event["size"]
    return peak


def compare(setup: str, device: torch.device, meter: str, meter_bytes: int, reference: str,
            reference_bytes: int) -> dict:
    diff = meter_bytes - reference_bytes
    pct = 100 * diff / reference_bytes
    return {"setup": setup, "device": str(device), "meter": meter, "meter_bytes": meter_bytes,
            "reference": reference, "reference_bytes": reference_bytes, "diff_bytes": diff,
            "diff_pct": round(pct, 5), "within_0.1%": abs(diff) <= TOLERANCE * reference_bytes}


def compare_case(name: str, make_model, make_optimizer, make_batch, device: torch.device) -> dict:
    """One setup on one device: gpukit's peak of a steady-state step, then the reference's of the next one."""
    model, optimizer, batch = steady_state(make_model, make_optimizer, make_batch, device)

    def step():
        default_step(model, optimizer, batch)

    gc.collect()
    with gpukit.measure(device, record=False) as report:
        step()
    gc.collect()
    if device.type == "cuda":
        return compare(name, device, "gpukit.measure (CUDA allocator, requested)", report.peak_unrounded,
                       "CUDA allocator trace", allocator_trace_peak(step, device))
    return compare(name, device, "gpukit counter (unrounded)", report.peak_unrounded,
                   "torch MemTracker", memtracker_peak(step, model, optimizer, *batch))


def main() -> list[dict]:
    devices = [torch.device("cpu")] + ([gpukit.resolve_device("cuda")] if torch.cuda.is_available() else [])
    rows = []
    for device in devices:
        gpukit.warm_up(device)  # cuBLAS's workspaces exist before the first measured step
    print(f"{'setup':<20}{'device':<8}{'gpukit B':>14}{'reference B':>14}{'diff B':>9}{'diff %':>10}  reference")
    for device in devices:
        for name, (make_model, make_opt, make_batch, _) in reference_cases(BATCH).items():
            row = compare_case(name, make_model, make_opt, make_batch, device)
            rows.append(row)
            print(f"{name:<20}{row['device']:<8}{row['meter_bytes']:>14,}{row['reference_bytes']:>14,}"
                  f"{row['diff_bytes']:>9,}{row['diff_pct']:>10.4f}  {row['reference']}"
                  f"{'' if row['within_0.1%'] else '  OUTSIDE 0.1%'}", flush=True)
    write_csv("exactness.csv", rows)
    return rows


def summary(rows: list[dict]) -> list[str]:
    lines = []
    for device in dict.fromkeys(r["device"] for r in rows):
        mine = [r for r in rows if r["device"] == device]
        ok = sum(r["within_0.1%"] for r in mine)
        worst = max(mine, key=lambda r: abs(r["diff_pct"]))
        lines.append(f"exactness on {device}: {ok}/{len(mine)} setups within 0.1% of {mine[0]['reference']}; "
                     f"largest difference {worst['diff_bytes']:,} B ({worst['diff_pct']:.4f}%, {worst['setup']})")
    return lines


if __name__ == "__main__":
    main()
