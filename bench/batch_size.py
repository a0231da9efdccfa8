"""The batch-size finder against the two classic strategies, counted in real training steps.

For each setup: the true maximum batch under the budget (by bisection with real steps),
the batch each strategy finds, and how many real trial steps (and predictions) it took.
Writes bench/out/batch_size.csv.

    python3 kit.py bench batch_size
"""

from __future__ import annotations


import torch
from results import write_csv

import gpukit
import gpukit.meter
from gpukit.batchsize import Trainer, double_then_bisect, predict_then_confirm, shrink_on_failure
from gpukit.lessons.data import digit_tokens_batch, digits_batch
from gpukit.lessons.models import MLP, ConvNet, GPTConfig, TinyGPT

MARGIN = 0.05
# name: (make_model, make_optimizer, make_batch, budget). A CPU budget caps the live tensor bytes of the whole
# process, so a few MB above what it holds is a real limit. A CUDA budget caps the allocator's reserved memory
# (set_per_process_memory_fraction): segments of 2 and 20 MiB and cuBLAS's workspaces count against it, so a GPU
# gets GB budgets and models big enough to fill them.
SETUPS = {
    "cpu": {
        "mlp 512x3 + adam": (lambda: MLP(width=512, depth=3), lambda p: torch.optim.Adam(p), digits_batch, "24MB"),
        "convnet 16 + momentum": (lambda: ConvNet(16), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                  digits_batch, "24MB"),
        "tinygpt 2x64 + adamw": (lambda: TinyGPT(GPTConfig()), lambda p: torch.optim.AdamW(p),
                                 digit_tokens_batch, "64MB"),
    },
    "cuda": {
        "mlp 4096x3 + adam": (lambda: MLP(width=4096, depth=3), lambda p: torch.optim.Adam(p), digits_batch, "4GB"),
        "convnet 64 + momentum": (lambda: ConvNet(64), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                  digits_batch, "4GB"),
        "tinygpt 4x256 + adamw": (lambda: TinyGPT(GPTConfig(n_layer=4, n_embd=256)), lambda p: torch.optim.AdamW(p),
                                  digit_tokens_batch, "8GB"),
    },
}
SHRINK_START = {"cpu": 4096, "cuda": 1 << 17}  # above the largest batch that fits
CAPS = {"cpu": "live tensor bytes (gpukit's counter)",
        "cuda": "reserved bytes (torch.cuda.set_per_process_memory_fraction)"}


def main() -> list[dict]:
    rows = []
    device = gpukit.meter.default_device()
    gpukit.warm_up(device)  # cuBLAS's workspaces exist before the first trial, as in every trial after it
    print(f"on {device}: a budget caps {CAPS[device.type]}")
    for name, (make_model, make_opt, make_batch, limit) in SETUPS[device.type].items():
        def trainer():
            return Trainer(make_model, make_opt, make_batch, limit, device=device)

        truth = double_then_bisect(trainer()).batch
        truth_margin = double_then_bisect(trainer(), limit=int(gpukit.parse_bytes(limit) * (1 - MARGIN))).batch
        for search in (double_then_bisect(trainer()), shrink_on_failure(trainer(), start=SHRINK_START[device.type]),
                       predict_then_confirm(trainer(), margin=MARGIN)):
            row = {"setup": name, "device": str(device), "budget": limit, "budget caps": CAPS[device.type],
                   "true max": truth, f"true max at {MARGIN:.0%} margin": truth_margin, **search.row(),
                   "torch": torch.__version__}
            rows.append(row)
            print(f"{name:<22} budget {limit:>5}  true max {truth:>5} ({truth_margin} at margin)  "
                  f"{search.strategy:<24} found {search.batch:>5} with {search.real_steps:>2} real steps"
                  f" and {search.predictions:>2} predictions", flush=True)
    write_csv("batch_size.csv", rows)
    return rows


def summary(rows: list[dict]) -> list[str]:
    steps = {}
    for r in rows:
        steps.setdefault(r["strategy"], []).append(r["real steps"])
    return ["batch size finders, real trial steps per setup: "
            + "; ".join(f"{name} {'/'.join(map(str, n))}" for name, n in steps.items())]


if __name__ == "__main__":
    main()
