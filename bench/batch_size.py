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
from gpukit.batchsize import Trainer, double_then_bisect, predict_then_confirm, shrink_on_failure
from gpukit.data import digit_tokens_batch, digits_batch
from gpukit.models import MLP, ConvNet, GPTConfig, TinyGPT

MARGIN = 0.05
SETUPS = {  # name: (make_model, make_optimizer, make_batch, budget)
    "mlp 512x3 + adam": (lambda: MLP(width=512, depth=3), lambda p: torch.optim.Adam(p), digits_batch, "24MB"),
    "convnet 16 + momentum": (lambda: ConvNet(16), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                              digits_batch, "24MB"),
    "tinygpt 2x64 + adamw": (lambda: TinyGPT(GPTConfig()), lambda p: torch.optim.AdamW(p), digit_tokens_batch,
                             "64MB"),
}


def main() -> list[dict]:
    rows = []
    for name, (make_model, make_opt, make_batch, limit) in SETUPS.items():
        def trainer():
            return Trainer(make_model, make_opt, make_batch, limit)

        truth = double_then_bisect(trainer()).batch
        truth_margin = double_then_bisect(trainer(), limit=int(gpukit.parse_bytes(limit) * (1 - MARGIN))).batch
        for search in (double_then_bisect(trainer()), shrink_on_failure(trainer(), start=4096),
                       predict_then_confirm(trainer(), margin=MARGIN)):
            row = {"setup": name, "budget": limit, "true max": truth, f"true max at {MARGIN:.0%} margin": truth_margin,
                   **search.row(), "torch": torch.__version__}
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
