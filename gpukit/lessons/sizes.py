"""Each lesson's sizes, from the one table that knows the card: the CPU's, a card under 40 GB's (sized and rehearsed
on a 15 GB T4, Colab's and Kaggle's) and a card of 40 GB or more's (sized and rehearsed on an 80 GB H100).

    from gpukit.lessons.sizes import lesson_settings
    S = lesson_settings("00_where_memory_goes")
    DEVICE, BATCH, WIDTH = S.device, S.BATCH, S.WIDTH

A GPU's sizes show the effect in MiB to GiB and fit its card with headroom; the CPU's run in seconds on two cores.
The sizes are the only thing that differs: a lesson runs the same code on every device, and on a CPU the simulated
CUDA caching allocator answers where a GPU's own would.

A rehearsal (``python3 kit.py rehearse --card t4``) runs a lesson on the CPU with a card's sizes: the environment
variable ``GPUKIT_REHEARSE`` names the card (a ``gpukit.cards`` key), the device stays the CPU, and the simulated
allocator behind the CPU meter gets the card's memory, so what a lesson measures there is what the card would hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..cards import REHEARSE_VAR, Card, card as card_named, rehearsed_card

BIG = 40e9  # bytes: a card with this much memory or more gets the large sizes

# notebook -> tier -> sizes. "gpu" serves both GPU tiers where they agree; "t4" and "h100" where they do not.
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "00_where_memory_goes": {
        "cpu": {"BATCH": 256, "WIDTH": 256, "EXPLORER_BATCHES": (256, 1024, 4096)},
        "gpu": {"BATCH": 8192, "WIDTH": 4096, "EXPLORER_BATCHES": (4096, 16384, 65536)},  # big enough to see in MiB
    },
    "02_no_grad": {
        "cpu": {"CHANNELS": 32, "EVAL_BATCH": 1024},
        # At 16,384 images the evaluation that keeps its graph, beside the two without, needs 16.4 GB: a card
        # under 40 GB gets half the batch (tests/test_t4.py predicts it).
        "t4": {"CHANNELS": 256, "EVAL_BATCH": 8192},
        "h100": {"CHANNELS": 256, "EVAL_BATCH": 16384},
    },
    "03_mixed_precision": {
        # The batch wider than the model, on every device: halved activations outweigh the 16-bit weight copies.
        # SPEED_*: the step a GPU times (a CPU times nothing: it emulates float16).
        "cpu": {"WIDTH": 256, "BATCH": 1024, "SPEED_BATCH": 256, "SPEED_STEPS": 5},
        "gpu": {"WIDTH": 4096, "BATCH": 32768, "SPEED_BATCH": 8192, "SPEED_STEPS": 20},
    },
    "04_gradient_accumulation": {
        # Activations (3 x batch x width floats) at least six times the gradients (2 x width^2), so that the
        # exercise's 8 micro-batches fit half the whole batch's step by the lesson's own bound (2A/k + G).
        "cpu": {"BATCH": 2048, "WIDTH": 256},
        "gpu": {"BATCH": 65536, "WIDTH": 1024},
    },
    "05_gradient_checkpointing": {
        # 64 blocks keep 2 GiB on a GPU. A block's gradient (4 width^2 bytes) at most a sixteenth of its
        # activations (8 batch x width bytes): the exercise's 8 segments of 64 blocks, which hold 23 blocks'
        # activations and the gradients, then fit half the plain step's 64. TIME_REPEATS: timed steps, each way.
        "cpu": {"WIDTH": 128, "BATCH": 1024, "TIME_REPEATS": 5},
        "gpu": {"WIDTH": 512, "BATCH": 8192, "TIME_REPEATS": 20},
    },
    "06_half_with_float_batchnorm": {
        # NUM_*: the model whose float16 rounding sections 2-3 count, the same everywhere: what rounding loses does
        # not depend on the size, and a CPU emulates float16 (a half() step at a card's sizes takes it half an hour).
        "cpu": {"CHANNELS": 16, "BATCH": 512, "NUM_CHANNELS": 16, "NUM_BATCH": 512},
        "gpu": {"CHANNELS": 128, "BATCH": 8192, "NUM_CHANNELS": 16, "NUM_BATCH": 512},
    },
    "07_cpu_offload": {
        # Embedding-table rows: its float32 table, gradient and Adam's two moments take 16 bytes a value; 2**22
        # rows of 256 take 16 GiB, more than a T4 holds, so a card under 40 GB gets 2**20 (4 GiB, on the GPU or,
        # offloaded, in the host RAM of Colab's T4 runtime: 12.7 GB). The CPU runs the T4's step on the simulated
        # card (fake tensors: no memory, no arithmetic); its real training runs at sizes of its own, in the lesson.
        "cpu": {"ROWS": 2**20, "EMB": 256, "HIDDEN": 4096, "BATCH": 16384},
        "t4": {"ROWS": 2**20, "EMB": 256, "HIDDEN": 4096, "BATCH": 16384},
        "h100": {"ROWS": 2**22, "EMB": 256, "HIDDEN": 4096, "BATCH": 16384},
    },
    "08_oom_and_batch_size": {
        # CARD_*: an MLP step that allocates more than the card holds, at its batch and at half of it (a T4: 6 GiB
        # for one activation), and fits it with headroom at a quarter (tests/test_t4.py): two halvings on a real card
        # as on the simulated one. The CPU runs the T4's on the simulated card. The others: real steps under a
        # budget (the batch-size finder, a failed step's clean-up, the leaks).
        "cpu": {"CARD_WIDTH": 1024, "CARD_DEPTH": 3, "CARD_BATCH": 3 * 2**19,
                "BUDGET": "8MB", "WIDTH": 256, "DEPTH": 2, "BIG_BATCH": 4096},
        "t4": {"CARD_WIDTH": 1024, "CARD_DEPTH": 3, "CARD_BATCH": 3 * 2**19,
               "BUDGET": "1GB", "WIDTH": 2048, "DEPTH": 2, "BIG_BATCH": 65536},
        "h100": {"CARD_WIDTH": 1024, "CARD_DEPTH": 3, "CARD_BATCH": 5 * 2**21,
                 "BUDGET": "1GB", "WIDTH": 2048, "DEPTH": 2, "BIG_BATCH": 65536},
    },
    "10_gpu_results": {
        # SIZE: gpukit.lessons.techniques.SIZES. STEPS: timed steps a row, up to MAX_SECONDS (a CPU's times would
        # say nothing of a GPU's: it emulates float16).
        "cpu": {"SIZE": "small", "STEPS": 0, "MAX_SECONDS": 1.5},
        "gpu": {"SIZE": "cuda", "STEPS": 5, "MAX_SECONDS": 10},
    },
    "11_everyday_savings": {
        "cpu": {"BATCH": 512, "WIDTH": 256, "ATT_BATCH": 4, "ATT_HEADS": 4, "HEAD_DIM": 16,
                "LENGTHS": [256, 512, 768, 1024], "RNN_HIDDEN": 128, "RNN_BATCH": 32, "RNN_STEPS": 32,
                "MS_CHANNELS": 16, "MS_BATCH": 256, "FUSE_SHAPE": (256, 4096)},
        "gpu": {"BATCH": 8192, "WIDTH": 4096, "ATT_BATCH": 8, "ATT_HEADS": 8, "HEAD_DIM": 64,
                "LENGTHS": [512, 1024, 1536, 2048], "RNN_HIDDEN": 1024, "RNN_BATCH": 64, "RNN_STEPS": 256,
                "MS_CHANNELS": 64, "MS_BATCH": 4096, "FUSE_SHAPE": (8192, 8192)},
    },
}

# What a rehearsal on the CPU shortens: repetitions of timed steps, whose times on this CPU say nothing of the card's
# and which, at a card's sizes, take much of a rehearsal. Nothing else changes: the memory a lesson measures and every
# assertion it makes are the card's (no cell that repeats these steps asserts a time). Each entry keeps at least two
# repetitions: the lessons take the median of all but the first.
REHEARSAL_REPEATS: dict[str, dict[str, Any]] = {
    "05_gradient_checkpointing": {"TIME_REPEATS": 2},
}

# Cells a rehearsal runs on fake tensors (gpukit.lessons.rehearsal.fake_begin), by the cell's id in the notebook: the
# same code, every tensor made with the shape, dtype and size the real run gives it, on the card's simulated
# allocator, and no arithmetic. Only cells whose real arithmetic at a card's sizes would take this CPU hours, and
# whose assertions, if any, read memory, never a computed value: a CPU emulates float16 (one float16 step of notebook
# 02's speed model, 8,192 x 4,096 wide, takes about 35 minutes on two cores; 09's technique matrix runs such steps for
# three models). A value a cell reads from a tensor there (``loss.item()`` to wait for the GPU, a GradScaler's check
# for inf) is made up, and the table says how many were. (A cell that calls predict() cannot be listed: a prediction
# has the fake tensors' simulated allocator to itself.)
REHEARSAL_ON_FAKE_TENSORS: dict[str, dict[str, str]] = {
    "03_mixed_precision": {"1e11f86a": "kept for backward", "a3c41f0e": "its check", "5d0e7a21": "a step's peak",
                           "9e4f1a2b": "the exercise's check", "6a7b8c9d": "its solution", "4d5e6f70": "weight cache"},
    "06_half_with_float_batchnorm": {"nb05-04": "three first steps", "nb05-06": "their check"},
    "10_gpu_results": {"efbc5d28": "technique matrix", "42be59ee": "one row by hand"},
}


def shortened(notebook: str, tier: str) -> dict[str, tuple[Any, Any]]:
    """What a rehearsal of ``notebook`` at a card of ``tier`` repeats fewer times: name -> (the card's, the
    rehearsal's)."""
    table = SIZES.get(notebook, {})
    sizes = table.get(tier) or table.get("gpu") or {}
    out = {}
    for name, fewer in REHEARSAL_REPEATS.get(notebook, {}).items():
        card_value = sizes[name]
        out[name] = (card_value, fewer(card_value) if callable(fewer) else fewer)
    return out


@dataclass(frozen=True)
class LessonSettings:
    """What a lesson's settings cell needs: the device, the card (None on a CPU or an unknown GPU), the tier of
    sizes ("cpu", "t4": a card under 40 GB, "h100": 40 GB and more) and the sizes themselves, as attributes."""

    notebook: str
    device: torch.device
    tier: str
    card: Card | None
    sizes: dict[str, Any] = field(default_factory=dict)
    rehearsal: bool = False       # a card's sizes on the CPU, its memory given to the simulated allocator
    shortened: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # a rehearsal's fewer timed repetitions

    def __getattr__(self, name: str) -> Any:
        sizes = self.__dict__.get("sizes", {})
        if name in sizes:
            return sizes[name]
        raise AttributeError(f"{self.__dict__.get('notebook')!r} has no size {name!r}: it has {', '.join(sizes)}")

    def __repr__(self) -> str:
        where = {"cpu": "the CPU's sizes", "t4": "a card under 40 GB's sizes (a T4's)",
                 "h100": "the sizes of a card with 40 GB or more (an H100's)"}[self.tier]
        on = f"{self.device}" + (f" ({self.card.name})" if self.card is not None else "")
        if self.rehearsal:
            on = f"the CPU, rehearsing {self.card.name}: its memory given to the simulated CUDA allocator"
        listed = ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in self.sizes.items())
        fewer = "; ".join(f"{k} {new} (the card's: {old})" for k, (old, new) in self.shortened.items())
        return f"{self.notebook} on {on}: {where}: {listed}" + (
            f"; timed steps repeated fewer times in a rehearsal: {fewer}" if fewer else "")


def card_memory(c: Card) -> int:
    """The bytes a card's simulated device gets (``Card.device_bytes``): what torch reports for it where a report is
    recorded (a T4's 14,930 MiB), else the data sheet's figure (an H100's 80 GB)."""
    return c.device_bytes


def tier_of(total_memory: int) -> str:
    return "h100" if total_memory >= BIG else "t4"


def lesson_settings(notebook: str, device: torch.device | str | None = None) -> LessonSettings:
    """The sizes of ``notebook`` for the machine it runs on (or ``device``): a GPU's tier by its memory, the CPU's
    otherwise; in a rehearsal the card's, on the CPU, with the simulated CUDA allocator resized to the card."""
    if notebook not in SIZES:
        raise ValueError(f"no sizes for {notebook!r}: the lessons with sizes are {', '.join(SIZES)}")
    table = SIZES[notebook]
    rehearsing = rehearsed_card()
    if rehearsing is not None:
        from ..allocator import reset_cpu_device

        reset_cpu_device(total_memory=card_memory(rehearsing))
        tier, dev, found = tier_of(rehearsing.memory_bytes), torch.device("cpu"), rehearsing
    else:
        dev = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        tier, found = "cpu", None
        if dev.type == "cuda":
            props = torch.cuda.get_device_properties(dev)
            tier = tier_of(props.total_memory)
            try:
                found = card_named(props.name)
            except ValueError:
                found = None  # a card not in gpukit.cards: sized by its memory alone
    sizes = dict(table.get(tier) or table["gpu"])
    fewer = shortened(notebook, tier) if rehearsing is not None else {}
    sizes.update({name: rehearsed for name, (_, rehearsed) in fewer.items()})
    return LessonSettings(notebook, dev, tier, found, sizes, rehearsal=rehearsing is not None, shortened=fewer)


__all__ = ["lesson_settings", "LessonSettings", "SIZES", "REHEARSAL_REPEATS", "REHEARSAL_ON_FAKE_TENSORS",
           "REHEARSE_VAR", "rehearsed_card", "card_memory", "shortened"]
