"""Run gpukit's benchmarks: `python3 kit.py bench [NAME ...] [--record] [--results-page] [--threads N]`.

    python3 kit.py bench                       every benchmark: bench/out/NAME.csv each, then bench/out/summary.txt
    python3 kit.py bench exactness techniques  only those
    python3 kit.py bench techniques --record   also keep the technique matrix as data/runs/<machine>.csv
    python3 kit.py bench recorded_runs --record   also write the predictions into data/runs/<machine>.csv
    python3 kit.py bench --results-page        only rewrite docs/results.md's results section (and docs/results.png)
                                               from bench/out/ and data/runs/; after NAMEs: run them first
    python3 kit.py bench --threads 0           torch's intra-op threads, here and in the notebooks' kernels
                                               (default 1; 0: torch's own default, one per core); CSVs record them

One thread by default: the figures then hold on a machine shared with other work, where threads that wait
for each other made small steps several times slower (on two shared cores, notebook 07 took 100 s with two
threads and 43 s with one). Ratios (overhead, peak over baseline) do not depend on it; absolute times do.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
BENCHMARKS = ["meter_overhead", "exactness", "estimate_accuracy", "layer_coverage", "batch_size", "techniques",
              "notebooks", "allocator", "plan_search", "pinning", "recorded_runs",
              "published", "torchtune_builders"]


def write_summary(lines: list[str], seconds: float) -> str:
    """The short text summary of a run, printed and kept as bench/out/summary.txt."""
    from results import OUT, machine

    m = machine()
    device = m["device_name"] if m["device_type"] == "cuda" else "no GPU"
    head = (f"gpukit benchmarks, {m['date']}: {m['cpu']} ({m['cores']} cores, torch on {m['threads']} of them), "
            f"{device}, torch {m['torch']}; "
            f"total {seconds:.0f} s ({seconds / 60:.1f} min)")
    text = "\n".join([head, *lines]) + "\n"
    OUT.mkdir(exist_ok=True)
    (OUT / "summary.txt").write_text(text)
    return text


def main(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python3 kit.py bench", description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"benchmarks to run, of {BENCHMARKS} (default: all)")
    parser.add_argument("--record", action="store_true", help="keep the technique matrix in data/runs/ (with "
                        "recorded_runs: the predictions of this machine's recorded run, beside its measurements)")
    parser.add_argument("--results-page", action="store_true", help="rewrite docs/results.md's results section")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's intra-op threads (default 1; 0: torch's default, one per core)")
    opts = parser.parse_args(args)
    names, record, page = opts.names, opts.record, opts.results_page
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {BENCHMARKS}")
    if record and names and not {"techniques", "recorded_runs"} & set(names):
        parser.error("--record keeps the technique matrix, or the predictions of this machine's recorded run, in "
                     "data/runs/: run it with `techniques` or `recorded_runs`")
    if opts.threads:
        import torch

        torch.set_num_threads(opts.threads)
        os.environ["OMP_NUM_THREADS"] = str(opts.threads)  # for the notebooks' kernels
    if not names:
        names = ["techniques"] if record else [] if page else BENCHMARKS
    t0 = time.perf_counter()
    lines = []
    for name in names:
        print(f"== {name}", flush=True)
        module = importlib.import_module(name)
        rows = module.main(record=record) if name in ("techniques", "recorded_runs") else module.main()
        lines += module.summary(rows)
    if names:
        print(f"== summary\n{write_summary(lines, time.perf_counter() - t0)}", end="", flush=True)
    if page:
        import results_page

        print(f"== results page: rewrote {results_page.main()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
