"""How exact the predictions are, and how long they take.

For each reference setup (gpukit.lessons.models.reference_cases): the exact prediction under fake
tensors, the real step measured on CPU, the rule of thumb, their errors, and the seconds
the prediction took. Then the time to predict models too big for this machine (wall and CPU
seconds, with the load average: the machine may be shared). On a GPU, predict(device="cuda")
against the same steps measured there.
Writes bench/out/estimate_accuracy.csv, bench/out/estimate_large.csv (and estimate_accuracy_cuda.csv).

    python3 kit.py bench estimate_accuracy
"""

from __future__ import annotations

import os
import time

import torch
from results import write_csv

from gpukit.estimate import measured_step_peak, predict, rule_of_thumb
from gpukit.lessons.models import GPTConfig, TinyGPT, reference_cases, vgg16

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
        load = os.getloadavg()[0]
        t0, c0 = time.perf_counter(), time.process_time()
        pred = predict(make_model, make_opt, make_batch)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        large.append({"setup": name, "parameters": pred.parameters, "predicted_peak_bytes": pred.peak,
                      "state_before_step_bytes": pred.before_step, "predict_seconds": round(seconds, 2),
                      "predict_cpu_seconds": round(cpu, 2), "load_average_1min": round(load, 2),
                      "lower_bound": pred.lower_bound, "unchecked_ops": " ".join(pred.unverified_ops),
                      "torch": torch.__version__})
        print(f"{name:<40} {pred.parameters:>15,} parameters  peak {pred.peak / 2**30:8.2f} GiB"
              f"  predicted in {seconds:.1f} s ({cpu:.1f} s of CPU, load average {load:.1f})"
              f"{'  LOWER BOUND' if pred.lower_bound else ''}", flush=True)
    write_csv("estimate_large.csv", large)
    if torch.cuda.is_available():
        cuda_rows(rows)
    return rows


def cuda_rows(cpu_rows: list[dict]) -> list[dict]:
    """On a GPU: predict(device="cuda") against the same steps measured on the GPU, per reference setup.

    The measured figure is the tensors before the step plus the step's peak above them (measured_step_peak);
    the cuBLAS workspaces exist before the step and hold no tensor, so they are compared apart: predicted
    against torch.cuda.memory_allocated() minus the live tensors after the step.
    """
    rows = []
    print(f"{'setup (cuda)':<20}{'measured B':>14}{'predicted B':>14}{'error %':>9}{'workspace B':>13}"
          f"{'measured ws B':>14}", flush=True)
    for name, (make_model, make_opt, make_batch, _) in reference_cases(BATCH).items():
        pred = predict(make_model, make_opt, make_batch, device="cuda")
        real = measured_step_peak(make_model, make_opt, make_batch, device="cuda")
        predicted = pred.peak - pred.workspaces
        untracked = torch.cuda.memory_allocated() - _live_tensor_bytes()
        row = {"setup": name, "device": "cuda", "measured_bytes": real, "predicted_bytes": predicted,
               "error_pct": round(100 * (predicted - real) / real, 4), "predicted_workspace_bytes": pred.workspaces,
               "allocated_minus_tensors_bytes": untracked, "attention_kernels": str(pred.attention_kernels),
               "torch": torch.__version__}
        rows.append(row)
        print(f"{name:<20}{real:>14,}{predicted:>14,}{row['error_pct']:>9.3f}{pred.workspaces:>13,}{untracked:>14,}",
              flush=True)
    write_csv("estimate_accuracy_cuda.csv", rows)
    return rows


def _live_tensor_bytes() -> int:
    """Rounded bytes of the distinct CUDA storages Python can reach (what is left is not a tensor's)."""
    import gc

    from gpukit.counter import round_up

    seen = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.is_cuda and obj.layout is torch.strided:
            st = obj.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(round_up(n) for n in seen.values())


def summary(rows: list[dict]) -> list[str]:
    worst = max(rows, key=lambda r: abs(r["error_pct"]))
    rule = [r["rule_error_pct"] for r in rows]
    return [f"estimate accuracy: exact prediction within {abs(worst['error_pct']):.3f}% of the measured peak on "
            f"{len(rows)} setups (largest: {worst['setup']}); "
            f"rule of thumb off by {min(rule):+.1f}% to {max(rule):+.1f}%"]


if __name__ == "__main__":
    main()
