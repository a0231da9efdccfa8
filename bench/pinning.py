"""What pinned host memory and ``non_blocking`` copies really do on a GPU (notebooks 07 and 12 teach them).

Two measurements, each row with the host's wait and the GPU's total time:

1. A 256 MiB copy host -> GPU queued behind a busy GPU (``torch.cuda._sleep``, a kernel that spins): from pageable
   or pinned memory, ``non_blocking`` or not, on the compute stream or on a second stream. CUDA orders work on
   one stream, so a copy on the compute stream starts only after the kernels before it; ``non_blocking`` from
   pinned memory frees the *host* at once, and only a second stream lets the copy overlap the computing.
2. ``torch.autograd.graph.save_on_cpu`` on an MLP whose saved activations are 1 GiB: the host's time to return
   from the forward pass and the step's total, with ``pin_memory`` off and on, against keeping them on the GPU.
   Whether the pack hook's copy to the host is asynchronous depends on the torch version (it became
   ``non_blocking`` in pytorch/pytorch pull request 175421, torch 2.12); the row records what this torch does.

Needs a CUDA GPU; on a machine without one it writes nothing. Writes bench/out/pinning.csv.

    python3 kit.py bench pinning
"""

from __future__ import annotations

import inspect
import statistics
import time

import torch
from results import write_csv

MiB = 2**20
COPY_BYTES = 256 * MiB
BUSY_MS = 40.0
REPEATS = 5


def _busy_cycles(ms: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that keep the GPU busy for about ``ms`` milliseconds (measured)."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe)  # first launch out of the way
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    torch.cuda.synchronize()
    return int(probe * ms / start.elapsed_time(end))


def _timed(work) -> tuple[float, float]:
    """(ms until the host got control back, ms until the GPU finished), from an idle GPU."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    work()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e3 * host, 1e3 * (time.perf_counter() - t0)


def copies() -> list[dict]:
    device = torch.device("cuda")
    cycles = _busy_cycles(BUSY_MS)
    pageable = torch.ones(COPY_BYTES // 4)
    pinned = pageable.pin_memory()
    side = torch.cuda.Stream()
    rows = []

    def case(memory: str, non_blocking: bool, stream: str):
        source = pinned if memory == "pinned" else pageable

        def work():
            torch.cuda._sleep(cycles)
            if stream == "second stream":
                with torch.cuda.stream(side):  # the copy needs nothing the kernel makes: no wait
                    source.to(device, non_blocking=non_blocking)
                torch.cuda.current_stream().wait_stream(side)
            else:
                source.to(device, non_blocking=non_blocking)
        return work

    busy = [_timed(lambda: torch.cuda._sleep(cycles))[1] for _ in range(REPEATS)]
    alone = {m: [_timed(lambda s=s: s.to(device))[1] for _ in range(REPEATS)]
             for m, s in (("pageable", pageable), ("pinned", pinned))}
    for memory in ("pageable", "pinned"):
        for non_blocking in (False, True):
            for stream in ("same stream", "second stream"):
                work = case(memory, non_blocking, stream)
                work()
                times = [_timed(work) for _ in range(REPEATS)]
                host = statistics.median(t[0] for t in times)
                total = statistics.median(t[1] for t in times)
                busy_ms, copy_ms = statistics.median(busy), statistics.median(alone[memory])
                rows.append({"measurement": "copy behind a busy GPU", "case": f"{memory}, non_blocking="
                             f"{non_blocking}, {stream}", "bytes": COPY_BYTES, "busy_ms": round(busy_ms, 2),
                             "copy_alone_ms": round(copy_ms, 2), "host_wait_ms": round(host, 2),
                             "total_ms": round(total, 2),
                             "overlapped": total < busy_ms + copy_ms - 0.5 * min(busy_ms, copy_ms)})
    return rows


def pack_copy_non_blocking() -> bool:
    """Whether this torch's ``save_on_cpu(pin_memory=True)`` packs with a ``non_blocking`` copy (its source)."""
    return "non_blocking=is_pinnable" in inspect.getsource(torch.autograd.graph.save_on_cpu)


def saved_on_cpu() -> list[dict]:
    device = torch.device("cuda")
    width, batch, layers = 4096, 8192, 8  # each saved activation 128 MiB in float32: 1 GiB in all
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
    model.to(device)
    x = torch.randn(batch, width, device=device)
    rows = []
    for variant in ("on the GPU", "save_on_cpu(pin_memory=False)", "save_on_cpu(pin_memory=True)"):
        def forward():
            if variant == "on the GPU":
                return model(x).square().mean()
            with torch.autograd.graph.save_on_cpu(pin_memory=variant.endswith("True)")):
                return model(x).square().mean()

        def step():
            model.zero_grad(set_to_none=True)
            forward().backward()

        step()
        host = statistics.median(_timed(forward)[0] for _ in range(REPEATS))
        total = statistics.median(_timed(step)[1] for _ in range(REPEATS))
        rows.append({"measurement": "saved activations", "case": variant, "bytes": layers * batch * width * 4,
                     "host_wait_ms": round(host, 2), "total_ms": round(total, 2),
                     "pack_copy_non_blocking": pack_copy_non_blocking()})
    return rows


def main() -> list[dict]:
    if not torch.cuda.is_available():
        print("pinning: needs a CUDA GPU; nothing measured")
        return []
    rows = copies() + saved_on_cpu()
    for r in rows:
        print(f"{r['measurement']:<24}{r['case']:<46}host {r['host_wait_ms']:>9.2f} ms  total {r['total_ms']:>9.2f} ms",
              flush=True)
    write_csv("pinning.csv", rows)
    return rows


def summary(rows: list[dict]) -> list[str]:
    if not rows:
        return ["pinning: needs a CUDA GPU (not measured)"]
    return [f"pinning: {r['case']}: host {r['host_wait_ms']} ms, total {r['total_ms']} ms" for r in rows]


if __name__ == "__main__":
    main()
