"""torchtune's model builders under predict() and plan(), where torchtune is installed.

Two small Llamas built by torchtune's component builders (``llama3_1``: Llama 3.1's scaled rotary frequencies,
made from a list of 0-d tensors; ``llama3_2``: the same with tied embeddings), each step predicted on the CPU
and measured for real there (to the byte, or the error); then Llama 3.2 1B from its own builder
(``llama3_2_1b``: 1.24 billion parameters, a 131,072-position rotary cache) predicted for a T4 and an H100
on fake tensors, and planned for a T4 (15 GB). AdamW; a batch of 2 x 64 tokens (small) or 1 x 1,024 (1B); the
loss is train_step's cross-entropy of the logits against the next tokens given as targets.

torchtune is not among gpukit's extras: its newest release (0.6.1) imports ``torchao.dtypes.nf4tensor``, which
torchao 0.18 no longer has, and its model builders import ``torchtune.data``, hence datasets and pyarrow. In an
environment of its own, beside gpukit's lessons extra:

    pip install torchtune==0.6.1 "torchao<0.18" datasets

Without torchtune it says so and writes nothing. Writes bench/out/torchtune_builders.csv.

    python3 kit.py bench torchtune_builders
"""

from __future__ import annotations

import time

import torch
from results import write_csv

from gpukit.estimate import measured_step_peak, predict

GiB = 2**30
VOCAB = 1000


def small_builders() -> dict:
    from torchtune.models.llama3_1 import llama3_1
    from torchtune.models.llama3_2 import llama3_2

    shape = dict(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=128, max_seq_len=256,
                 intermediate_dim=256)
    return {"llama3_1 (2 layers, width 128, scaled RoPE)": lambda: llama3_1(**shape),
            "llama3_2 (2 layers, width 128, tied embeddings)": lambda: llama3_2(**shape)}


def tokens(vocab: int, batch: int, length: int):
    ids = torch.randint(0, vocab, (batch, length + 1), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return lambda: (x.clone(), y.clone())


def adamw(params):
    return torch.optim.AdamW(params)


def main() -> list[dict]:
    try:
        from torchtune.models.llama3_2 import llama3_2_1b
    except ImportError as error:
        print(f"torchtune is not importable here ({error}): see this benchmark's docstring for its set-up")
        return []
    rows = []
    for name, build in small_builders().items():
        batch = tokens(VOCAB, 2, 64)
        t = time.perf_counter()
        p = predict(build, adamw, batch, device="cpu")
        seconds = time.perf_counter() - t
        measured = measured_step_peak(build, adamw, batch, device="cpu")
        rows.append(dict(case=name, device="cpu", predicted=p.peak, reserved=None, measured=measured,
                         error_bytes=p.peak - measured, lower_bound=p.lower_bound, seconds=round(seconds, 1)))
    batch = tokens(128256, 1, 1024)
    for card in ("t4", "h100"):
        t = time.perf_counter()
        p = predict(llama3_2_1b, adamw, batch, card=card)
        rows.append(dict(case="llama3_2_1b (1.24B)", device=card, predicted=p.peak, reserved=p.reserved_peak,
                         measured=None, error_bytes=None, lower_bound=p.lower_bound,
                         seconds=round(time.perf_counter() - t, 1)))
    from gpukit.plan import plan

    t = time.perf_counter()
    chosen = plan(llama3_2_1b, adamw, batch, "15GB", card="t4", verify=False).choice
    rows.append(dict(case=f"llama3_2_1b planned for a T4: {chosen.candidate.label}, {chosen.candidate.optimizer}",
                     device="t4", predicted=chosen.peak, reserved=chosen.reserved, measured=None, error_bytes=None,
                     lower_bound=chosen.lower_bound, seconds=round(time.perf_counter() - t, 1)))
    for r in rows:
        figures = f"{r['predicted'] / GiB:7.3f} GiB allocated" + (
            f", {r['reserved'] / GiB:.3f} GiB reserved" if r["reserved"] is not None else "")
        against = f"; measured {r['measured']:,} B, error {r['error_bytes']:+,} B" if r["measured"] is not None else ""
        print(f"{r['case']:70s} {r['device']:5s} {figures}{against}; lower bound: {r['lower_bound']}; "
              f"{r['seconds']} s", flush=True)
    write_csv("torchtune_builders.csv", rows)
    return rows


def summary(rows: list[dict]) -> list[str]:
    if not rows:
        return ["torchtune builders: not run (torchtune not installed)"]
    small = [r for r in rows if r["measured"] is not None]
    exact = sum(r["error_bytes"] == 0 for r in small)
    return [f"torchtune builders: {exact}/{len(small)} small models predicted to the byte on the CPU; Llama 3.2 1B "
            f"predicted for a T4 and an H100 and planned for a T4 "
            f"({', '.join('flagged' if r['lower_bound'] else 'exact' for r in rows if r['measured'] is None)})"]


if __name__ == "__main__":
    main()
