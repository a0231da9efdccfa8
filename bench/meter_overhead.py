"""Overhead of the meter: a training step plain, inside gpukit.measure(), and as a %%gpumem cell.

Each row times one training step of a reference model on the digits data, alternating plain
steps, steps inside ``measure()``, steps run through the ``%%gpumem -q`` cell magic (in an
IPython shell, as in Jupyter), and steps under an empty TorchDispatchMode (so drifts in the
machine's speed hit all alike), and reports the medians and their ratios to the plain step.
The empty mode is the floor any dispatch-mode counter pays: PyTorch calls into Python for every
op. On a GPU the meter reads the CUDA allocator's statistics instead, and each timing waits for
the GPU (torch.cuda.synchronize). Writes bench/out/meter_overhead.csv.

    python3 kit.py bench meter_overhead
"""

from __future__ import annotations

import statistics
import time

import torch
from IPython.core.interactiveshell import InteractiveShell
from results import write_csv
from torch.utils._python_dispatch import TorchDispatchMode

import gpukit
from gpukit.lessons.data import digit_tokens_batch, digits_batch
from gpukit.estimate import default_step
from gpukit.meter import default_device
from gpukit.lessons.models import MLP, ConvNet, GPTConfig, TinyGPT

CASES = [  # (name, model factory, batch factory, batch size)
    ("mlp-256x2", lambda: MLP(width=256, depth=2), digits_batch, 256),
    ("mlp-1024x3", lambda: MLP(width=1024, depth=3), digits_batch, 512),
    ("convnet-32", lambda: ConvNet(channels=32), digits_batch, 256),
    ("tinygpt-2x64", lambda: TinyGPT(GPTConfig()), digit_tokens_batch, 64),
]


class EmptyMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def ipython_shell() -> InteractiveShell:
    """An IPython shell with gpukit's magics loaded, as ``%load_ext gpukit`` does in Jupyter."""
    shell = InteractiveShell.instance()
    gpukit.load_ipython_extension(shell)
    return shell


def time_case(make_model, make_batch, batch: int, repeats: int, device: torch.device, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    x, y = (t.to(device) for t in make_batch(batch))
    model = make_model().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    shell = ipython_shell()

    def step():
        default_step(model, opt, (x, y))

    def measured_step():
        with gpukit.measure(device, record=False):
            step()

    def magic_step():
        shell.run_cell_magic("gpumem", f"-q -d {device}", "step()")

    def empty_mode_step():
        with EmptyMode():
            step()

    shell.user_ns["step"] = step
    runs = {step: [], measured_step: [], magic_step: [], empty_mode_step: []}
    for _ in range(3):
        for fn in runs:
            fn()
    for _ in range(repeats):
        for fn, times in runs.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
    gpukit.clear_history()  # the magic records every run
    p, m, g, e = (statistics.median(t) for t in runs.values())
    return {"plain_ms": round(p * 1e3, 3), "measure_ms": round(m * 1e3, 3), "measure_ratio": round(m / p, 3),
            "gpumem_ms": round(g * 1e3, 3), "gpumem_ratio": round(g / p, 3),
            "empty_mode_ms": round(e * 1e3, 3), "empty_mode_ratio": round(e / p, 3)}


def main(repeats: int = 40) -> list[dict]:
    device = default_device()
    rows = []
    for name, make_model, make_batch, batch in CASES:
        row = {"model": name, "batch": batch, "device": str(device), "threads": torch.get_num_threads(),
               "repeats": repeats, **time_case(make_model, make_batch, batch, repeats, device)}
        rows.append(row)
        print(f"{name:<13} batch {batch:>4} on {device}: plain {row['plain_ms']:8.2f} ms   measure() "
              f"{row['measure_ratio']:.3f}x   %%gpumem {row['gpumem_ratio']:.3f}x   "
              f"(empty dispatch mode alone: {row['empty_mode_ratio']:.3f}x)", flush=True)
    write_csv("meter_overhead.csv", rows)
    return rows


def summary(rows: list[dict]) -> list[str]:
    ratios = ", ".join(f"{r['model']} {r['measure_ratio']:.2f}x / {r['gpumem_ratio']:.2f}x" for r in rows)
    return [f"meter overhead on {rows[0]['device']} (step time with measure() / with %%gpumem, over plain): {ratios}"]


if __name__ == "__main__":
    main()
