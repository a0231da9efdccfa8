"""The planner's search cost: plan() for a 1.3-billion-parameter GPT against a 24 GB GPU, on this machine's CPU.

The model is GPT-3 XL's shape (24 layers of width 2048, 16 heads, sequences of 1024 tokens, GPT-2's vocabulary
of 50,257 with an untied output layer: 1.42 billion parameters) with AdamW, a batch of 8 sequences; the plan is
for CUDA (reserved memory, context allowance) and every prediction runs under fake tensors, so nothing of the
model is allocated. Reported: seconds, predictions made, candidates pruned, and what it chose.
Writes bench/out/plan_search.csv.

    python3 kit.py bench plan_search
"""

from __future__ import annotations

import time

import torch
from results import write_csv

from gpukit.lessons.models import GPTConfig, TinyGPT
from gpukit.plan import plan

GPT_1_3B = GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=2048)
BATCH, BUDGET = 8, "24GB"


def make_batch():
    return (torch.randint(0, GPT_1_3B.vocab_size, (BATCH, GPT_1_3B.block_size)),
            torch.randint(0, GPT_1_3B.vocab_size, (BATCH, GPT_1_3B.block_size)))


CASES = {
    # name: plan() keyword arguments
    "1 GPU, AdamW only": {},
    "4 GPUs, AdamW only": {"gpus": 4, "accumulate": [1, 2]},
}


def main() -> list[dict]:
    rows = []
    for name, kwargs in CASES.items():
        t0 = time.perf_counter()
        p = plan(lambda: TinyGPT(GPT_1_3B), lambda params: torch.optim.AdamW(params, lr=3e-4), make_batch,
                 BUDGET, alternatives=0, **kwargs)
        seconds = time.perf_counter() - t0
        pruned = sum(r.need is None for r in p.rows)
        row = {"case": name, "parameters": p.model_note.split(" parameters")[0].removeprefix("model: "),
               "budget": BUDGET, "seconds": round(seconds, 1), "predictions": p.predictions,
               "candidates": len(p.rows), "pruned": pruned,
               "choice": f"{p.choice.candidate.label} [{p.choice.candidate.optimizer}]" if p.choice else "nothing fits",
               "choice need GB": round(p.choice.need / 1e9, 2) if p.choice else None,
               "torch": torch.__version__}
        rows.append(row)
        print(f"{name:<22} {seconds:6.1f} s  {p.predictions:>3} predictions, {pruned}/{len(p.rows)} pruned; "
              f"{row['choice']}", flush=True)
    write_csv("plan_search.csv", rows)
    return rows


def summary(rows: list[dict]) -> list[str]:
    return ["plan() for a 1.3B GPT against 24 GB: "
            + "; ".join(f"{r['case']} {r['seconds']} s, {r['predictions']} predictions ({r['choice']})" for r in rows)]


if __name__ == "__main__":
    main()
