"""How exact the predictions are, and how long they take.

For each reference setup (gpukit.models.reference_cases): the exact prediction under fake
tensors, the real step measured on CPU, the rule of thumb, their errors, and the seconds
the prediction took. Then the time to predict models too big for this machine.
Writes bench/out/estimate_accuracy.csv and bench/out/estimate_large.csv.

    python3 kit.py bench estimate_accuracy
"""

from __future__ import annotations

import time

import torch
from results import write_csv

from gpukit.estimate import measured_step_peak, predict, rule_of_thumb
from gpukit.models import GPTConfig, TinyGPT, reference_cases, vgg16

BATCH = 128
LARGE = {  # name: (make_model, make_optimizer, make_batch)
    "vgg16 224px batch 64 + sgd momentum": (
        vgg16, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
        lambda: (torch.zeros(64, 3, 224, 224), torch.zeros(64, dtype=torch.long))),
    "gpt 1.3B seq 1024 batch 8 + adamw": (
        lambda: TinyGPT(GPTConfig(vocab_size=32000, block_size=1024, n_layer=24, n_head=16, n_embd=2048)),
        lambda p: torch.optim.AdamW(p),
        lambda: (torch.zeros(8, 1024, dtype=torch.long), torch.zeros(8, 1024, dtype=torch.long))),
    "gpt 6.7B seq 2048 batch 8 + adamw": (
        lambda: TinyGPT(GPTConfig(vocab_size=32000, block_size=2048, n_layer=32, n_head=32, n_embd=4096)),
        lambda p: torch.optim.AdamW(p),
        lambda: (torch.zeros(8, 2048, dtype=torch.long), torch.zeros(8, 2048, dtype=torch.long))),
}


def main() -> list[dict]:
    rows = []
    print(f"{'setup':<20}{'measured B':>14}{'predicted B':>14}{'error %':>9}{'rule B':>14}{'rule %':>8}"
          f"{'predict s':>10}")
    for name, (make_model, make_opt, make_batch, make_sample) in reference_cases(BATCH).items():
        t0 = time.perf_counter()
        pred = predict(make_model, make_opt, make_batch)
        seconds = time.perf_counter() - t0
        real = measured_step_peak(make_model, make_opt, make_batch, device="cpu")
        rule = rule_of_thumb(make_model, make_sample, BATCH, make_opt(make_model().parameters()))
        row = {"setup": name, "batch": BATCH, "parameters": pred.parameters, "measured_bytes": real,
               "predicted_bytes": pred.peak, "error_pct": round(100 * (pred.peak - real) / real, 4),
               "rule_of_thumb_bytes": rule.total, "rule_error_pct": round(100 * (rule.total - real) / real, 1),
               "predict_seconds": round(seconds, 3), "torch": torch.__version__}
        rows.append(row)
        print(f"{name:<20}{real:>14,}{pred.peak:>14,}{row['error_pct']:>9.3f}{rule.total:>14,}"
              f"{row['rule_error_pct']:>8.1f}{seconds:>10.2f}", flush=True)
    write_csv("estimate_accuracy.csv", rows)

    large = []
    for name, (make_model, make_opt, make_batch) in LARGE.items():
        t0 = time.perf_counter()
        pred = predict(make_model, make_opt, make_batch)
        seconds = time.perf_counter() - t0
        large.append({"setup": name, "parameters": pred.parameters, "predicted_peak_bytes": pred.peak,
                      "state_before_step_bytes": pred.before_step, "predict_seconds": round(seconds, 2),
                      "torch": torch.__version__})
        print(f"{name:<40} {pred.parameters:>15,} parameters  peak {pred.peak / 2**30:8.2f} GiB"
              f"  predicted in {seconds:.1f} s", flush=True)
    write_csv("estimate_large.csv", large)
    return rows


def summary(rows: list[dict]) -> list[str]:
    worst = max(rows, key=lambda r: abs(r["error_pct"]))
    rule = [r["rule_error_pct"] for r in rows]
    return [f"estimate accuracy: exact prediction within {abs(worst['error_pct']):.3f}% of the measured peak on "
            f"{len(rows)} setups (largest: {worst['setup']}); "
            f"rule of thumb off by {min(rule):+.1f}% to {max(rule):+.1f}%"]


if __name__ == "__main__":
    main()
