"""The planner's search cost: plan() for a 1.3-billion-parameter GPT against a 24 GB GPU, on this machine's CPU;
and for a transformers Llama of 1.24 billion parameters, beside one predict() of its step (and an 8B's: one predict()
of its step, its plans against 24 GB and 80 GB).

The model is GPT-3 XL's shape (24 layers of width 2048, 16 heads, sequences of 1024 tokens, GPT-2's vocabulary
of 50,257 with an untied output layer: 1.42 billion parameters) with AdamW, a batch of 8 sequences; the plan is
for CUDA (reserved memory, context allowance) and every prediction runs under fake tensors, so nothing of the
model is allocated. Every plan tries the user's AdamW and plan()'s default variants of it (its for-loop and fused
steps, bitsandbytes' AdamW8bit, both stepped in backward, and with one GPU its state and step on the host with
torchao's CPUOffloadOptimizer), no other optimizer. Reported: seconds, predictions
made (bounds from a prefix of a step and floors count as predictions), candidates pruned, and what it chose.
The libraries are imported before any clock starts (transformers, and bitsandbytes for the 8-bit candidates: 1.6 s
here, once per process), so that the Llama's plan and its predict() are timed alike.
Case ``first``: a new user's first calls. In a fresh process for each (gpukit and transformers imported first, as in
a notebook), the 1.24B Llama's predict() twice, and in another its plan() against 24 GB twice: the first plan(), with
the libraries it imports on the way (bitsandbytes, peft, torchao), against the first predict(), and the second against
the second (the issue's targets: at most 3x, and 2x warm).
Writes bench/out/plan_search.csv (all cases); one case alone (``first``, ``llama``, ``gpt``, ``gpt4``) only prints.

    python3 kit.py bench plan_search
    cd bench && OMP_NUM_THREADS=1 ../.venv/bin/python plan_search.py llama
"""

from __future__ import annotations

import sys
import time

import torch
from results import write_csv

from gpukit.lessons.models import GPTConfig, TinyGPT
from gpukit.plan import Techniques, plan

GPT_1_3B = GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=2048)
BATCH, BUDGET = 8, "24GB"


def make_batch():
    return (torch.randint(0, GPT_1_3B.vocab_size, (BATCH, GPT_1_3B.block_size)),
            torch.randint(0, GPT_1_3B.vocab_size, (BATCH, GPT_1_3B.block_size)))


CASES = {
    # key: (name, plan() keyword arguments); AdamW and its variants (implementations=True, plan()'s default)
    "gpt": ("1 GPU, AdamW and its variants", {}),
    "gpt4": ("4 GPUs, AdamW and its variants, accumulate 1 or 2",
             {"gpus": 4, "techniques": Techniques(accumulate=[1, 2])}),
}


# Llama-3.2-1B's shape (1.24B parameters, vocabulary 128,256, tied embeddings) and Llama-3-8B's, built by
# transformers under fake tensors (nothing downloaded or allocated), trained with the loss the model computes.
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=2048, tie_word_embeddings=True, use_cache=False)
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, use_cache=False)


def llama_batch(vocab: int, batch: int, length: int = 1024):
    ids = torch.randint(0, vocab, (batch, length))
    mask = torch.ones_like(ids)
    mask[::2, -64:] = 0  # padded, as a tokenizer pads: the masks a real step builds (see tests/test_transformers.py)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def llama_factories(shape: dict, batch: int):
    """``(make_model, make_batch, step)`` of a transformers Llama of ``shape`` at ``batch`` x 1,024 tokens, trained
    with the loss the model computes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpukit.step import train_step

    def step(model, optimizer, batch):
        train_step(model, optimizer, batch, loss="model")

    return (lambda: LlamaForCausalLM(LlamaConfig(**shape))), (lambda: llama_batch(shape["vocab_size"], batch)), step


def llama_rows() -> list[dict]:
    """One predict() of the plain step and a whole plan() for the 1.24B Llama against 24 GB, in the same run
    (the target: the plan within 4x the prediction); one predict() of the 8B Llama at 1 x 1,024 tokens, and its
    plans against 24 GB and 80 GB."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return []
    from gpukit.estimate import predict

    # The libraries a plan tries are imported before either clock starts, as transformers is: bitsandbytes takes
    # 1.6 s to import here (it imports torch._inductor), a process's cost once, not a prediction's or a plan's.
    facts = sys.modules["gpukit.plan.facts"]
    if facts.eight_bit_optimizer(lambda params: torch.optim.AdamW(params)) is not None:
        facts._bnb_optim()
    rows = []
    for name, shape, batch in (("Llama-3.2-1B shape", LLAMA_1B, 8), ("Llama-3-8B shape", LLAMA_8B, 1)):
        make_model, make_batch, step = llama_factories(shape, batch)
        t0 = time.perf_counter()
        p = predict(make_model, lambda params: torch.optim.AdamW(params), make_batch, step, device="cuda")
        one = time.perf_counter() - t0
        row = {"case": f"{name}, predict() of the plain step, batch {batch} x 1024", "parameters": f"{p.parameters:,}",
               "budget": "", "seconds": round(one, 1), "predictions": 1, "candidates": "", "pruned": "",
               "choice": f"peak {p.peak / 1e9:.1f} GB", "choice need GB": None, "host GB": None,
               "torch": torch.__version__}
        rows.append(row)
        print(f"{row['case']:<58} {one:6.1f} s  ({row['choice']})", flush=True)
        # The 1.24B Llama against 24 GB (the plan timed against its predict()); the 8B against 24 GB and 80 GB.
        for budget in ((BUDGET,) if shape is LLAMA_1B else ("24GB", "80GB")):
            t0 = time.perf_counter()
            pl = plan(make_model, lambda params: torch.optim.AdamW(params), make_batch, budget, alternatives=0,
                      loss="model")
            seconds = time.perf_counter() - t0
            choice = pl.choice
            rows.append({"case": f"{name}, plan() against {budget} ({seconds / one:.1f}x one predict)",
                         "parameters": row["parameters"], "budget": budget, "seconds": round(seconds, 1),
                         "predictions": pl.predictions, "candidates": len(pl.rows),
                         "pruned": sum(r.need is None for r in pl.rows),
                         "choice": f"{choice.candidate.label} [{choice.candidate.optimizer}]" if choice
                         else "nothing fits", "choice need GB": round(choice.need / 1e9, 2) if choice else None,
                         "host GB": round(choice.host_peak / 1e9, 1) if choice and choice.host_peak else None,
                         "torch": torch.__version__})
            host = f", host {choice.host_peak / 1e9:.1f} GB" if choice and choice.host_peak else ""
            print(f"{rows[-1]['case']:<58} {seconds:6.1f} s  {pl.predictions:>3} predictions; {rows[-1]['choice']}"
                  f"{f' (need {choice.need:,} B{host})' if choice else ''}", flush=True)
    return rows


def first_call(what: str) -> None:
    """Run in a fresh process by ``first_rows``: the 1.24B Llama's ``what`` ("predict" or "plan") twice; prints the
    seconds of each call as JSON."""
    import json

    from gpukit.estimate import predict

    make_model, make_batch, step = llama_factories(LLAMA_1B, 8)
    seconds, predictions = [], 0
    for _ in range(2):
        t0 = time.perf_counter()
        if what == "predict":
            predict(make_model, lambda params: torch.optim.AdamW(params), make_batch, step, device="cuda")
        else:
            predictions = plan(make_model, lambda params: torch.optim.AdamW(params), make_batch, BUDGET,
                               alternatives=0, loss="model").predictions
        seconds.append(time.perf_counter() - t0)
    print(json.dumps({"seconds": seconds, "predictions": predictions}))


def first_rows() -> list[dict]:
    """The first and the second predict() and plan() of the 1.24B Llama, each pair in a fresh process."""
    import json
    import subprocess

    try:
        import transformers  # noqa: F401
    except ImportError:
        return []
    found = {}
    for what in ("predict", "plan"):
        out = subprocess.run([sys.executable, __file__, "--first", what], capture_output=True, text=True, check=True)
        found[what] = json.loads(out.stdout.strip().splitlines()[-1])
    rows = []
    for i, when in enumerate(("first", "second")):
        one, whole = found["predict"]["seconds"][i], found["plan"]["seconds"][i]
        rows.append({"case": f"Llama-3.2-1B shape, {when} plan() against {BUDGET} in a process "
                             f"({whole / one:.1f}x its {when} predict(), {one:.1f} s)",
                     "parameters": "", "budget": BUDGET, "seconds": round(whole, 1),
                     "predictions": found["plan"]["predictions"], "candidates": "", "pruned": "", "choice": "",
                     "choice need GB": None, "host GB": None, "torch": torch.__version__})
        print(f"{rows[-1]['case']:<58} {whole:6.1f} s", flush=True)
    return rows


def main(only: list[str] | None = None) -> list[dict]:
    rows = first_rows() if not only or "first" in only else []
    rows += llama_rows() if not only or "llama" in only else []
    for key, (name, kwargs) in CASES.items():
        if only and key not in only:
            continue
        t0 = time.perf_counter()
        p = plan(lambda: TinyGPT(GPT_1_3B), lambda params: torch.optim.AdamW(params, lr=3e-4), make_batch,
                 BUDGET, alternatives=0, **kwargs)
        seconds = time.perf_counter() - t0
        pruned = sum(r.need is None for r in p.rows)
        row = {"case": name, "parameters": p.model_note.split(" parameters")[0].removeprefix("model: "),
               "budget": BUDGET, "seconds": round(seconds, 1), "predictions": p.predictions,
               "candidates": len(p.rows), "pruned": pruned,
               "choice": f"{p.choice.candidate.label} [{p.choice.candidate.optimizer}]" if p.choice else "nothing fits",
               "choice need GB": round(p.choice.need / 1e9, 2) if p.choice else None, "host GB": None,
               "torch": torch.__version__}
        rows.append(row)
        print(f"{name:<58} {seconds:6.1f} s  {p.predictions:>3} predictions, {pruned}/{len(p.rows)} pruned; "
              f"{row['choice']}{f' (need {p.choice.need:,} B)' if p.choice else ''}", flush=True)
    if not only:
        write_csv("plan_search.csv", rows)
    return rows


def summary(rows: list[dict]) -> list[str]:
    return ["plan() and predict() on big models: "
            + "; ".join(f"{r['case']} {r['seconds']} s, {r['predictions']} predictions"
                        + (f" ({r['choice']})" if r["choice"] else "") for r in rows)]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--first"]:
        first_call(sys.argv[2])
    else:
        main(sys.argv[1:] or None)
