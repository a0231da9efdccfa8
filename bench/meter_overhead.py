"""Overhead of the CPU meter: a training step with and without gpukit.measure().

Each row times one training step of a reference model on the digits data, alternating
plain steps, measured steps, and steps under an empty TorchDispatchMode (so drifts in the
machine's speed hit all alike), and reports the medians and the ratio measured / plain.
The empty mode is the floor any dispatch-mode counter pays: PyTorch calls into Python for
every op. Writes bench/out/meter_overhead.csv.

    python3 kit.py bench meter_overhead
"""

from __future__ import annotations

import statistics
import time

import torch
from results import write_csv
from torch.utils._python_dispatch import TorchDispatchMode

import gpukit
from gpukit.data import load_digits
from gpukit.models import MLP, ConvNet

CASES = [  # (name, model factory, batch size)
    ("mlp-256x2", lambda: MLP(width=256, depth=2), 256),
    ("mlp-1024x3", lambda: MLP(width=1024, depth=3), 512),
    ("convnet-32", lambda: ConvNet(channels=32), 256),
]


class EmptyMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def time_case(make_model, batch: int, repeats: int, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    images, labels = load_digits()
    x, y = images[:batch], labels[:batch]
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def measured_step():
        with gpukit.measure(record=False):
            step()

    def empty_mode_step():
        with EmptyMode():
            step()

    runs = {step: [], measured_step: [], empty_mode_step: []}
    for _ in range(3):
        for fn in runs:
            fn()
    for _ in range(repeats):
        for fn, times in runs.items():
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    p, m, e = (statistics.median(t) for t in runs.values())
    return {"plain_ms": round(p * 1e3, 3), "measured_ms": round(m * 1e3, 3), "ratio": round(m / p, 3),
            "empty_mode_ms": round(e * 1e3, 3), "empty_mode_ratio": round(e / p, 3)}


def main(repeats: int = 40) -> list[dict]:
    rows = []
    for name, make_model, batch in CASES:
        row = {"model": name, "batch": batch, "device": "cpu", "torch": torch.__version__,
               "threads": torch.get_num_threads(), "repeats": repeats, **time_case(make_model, batch, repeats)}
        rows.append(row)
        print(f"{name:<12} batch {batch:>4}: plain {row['plain_ms']:8.2f} ms   measured {row['measured_ms']:8.2f} ms"
              f"   ratio {row['ratio']:.3f}   (empty dispatch mode alone: {row['empty_mode_ratio']:.3f})", flush=True)
    write_csv("meter_overhead.csv", rows)
    return rows


if __name__ == "__main__":
    main()
