"""The technique matrix: what each memory technique does to peak memory and speed, per reference model.

For a deep MLP, a ConvNet with BatchNorm and a tiny GPT (sized for the device): the baseline
float32 step, AMP fp16 (with GradScaler), AMP bf16, accumulation over 4 micro-batches,
checkpointing, model.half() with BatchNorm in float32, saved activations offloaded to the host,
and combinations. Each row: peak bytes of a steady-state step (model state included), the
median step time, samples per second, and the peak over the baseline's. The techniques
themselves are plain PyTorch in gpukit/step.py (train_step).
Writes bench/out/techniques.csv; with --record also data/runs/<machine>.csv, and each row's allocator trace (its
build, warm-up step and measured step: ``gpukit.lessons.techniques.recorded_trace``) in data/traces/<machine>/, which
bench/recorded_runs.py sets beside the row's prediction.

    python3 kit.py bench techniques [--record]
"""

from __future__ import annotations

from results import RUNS_DIR, TRACES, keep_earlier, machine, slug, write_csv, write_run

from gpukit.lessons.techniques import run_matrix


def main(record: bool = False) -> list[dict]:
    if record:  # an earlier run of this machine, of another day, is kept with its traces before new ones are written
        keep_earlier(RUNS_DIR / f"{slug(machine())}.csv", machine()["date"])
    rows = run_matrix(traces=TRACES / slug(machine()) if record else None)
    write_csv("techniques.csv", rows)
    if record:
        print(f"recorded as {write_run(rows)}")
    return rows


def summary(rows: list[dict]) -> list[str]:
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and r["peak_vs_baseline"] is not None]
        best = min(mine, key=lambda r: r["peak_vs_baseline"])
        fastest = max((r for r in mine if r["samples_per_s"]), key=lambda r: r["samples_per_s"])
        lines.append(f"techniques, {model}: lowest peak {best['technique']} ({best['peak_vs_baseline']:.2f}x "
                     f"baseline), fastest {fastest['technique']} ({fastest['samples_per_s']:,.0f} samples/s)"
                     + ("; half: pure float16 weights, updates below 2^-11 of a weight lost, not a way to train"
                        if "half" in (best["technique"] + fastest["technique"]) else ""))
    skipped = [r for r in rows if r["status"] != "ok"]
    for r in skipped:
        lines.append(f"techniques, {r['model']}: {r['technique']}: {r['status']}")
    return lines


if __name__ == "__main__":
    import sys

    main(record="--record" in sys.argv[1:])
