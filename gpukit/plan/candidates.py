"""What a plan is made of: the candidates (one way of running the step each), their rows in the table, and the
verification; the table's columns and the numerics' names."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..estimate import Prediction
from ..report import format_bytes
from ..step import Technique

PRECISIONS = ("float32", "bf16", "fp16", "half", "bf16 weights")
STRATEGIES = ("single GPU", "DDP", "ZeRO-1", "FSDP")
# What changes numerically, from least to most; the tolerance is on |g - g_plain| / |g_plain| for the gradients
# of one step, 16 units of roundoff of the arithmetic that changed (None: not comparable with the plain step).
# LOST_UPDATES: weights kept in 16 bits with no float32 copy ("half", "bf16 weights"): an update smaller than the
# weight's last bit rounds back to the old weight, step after step, which changes training, not only its rounding.
# DIFFERENT_MODEL: adapters trained instead of the weights (LoRA, QLoRA).
SAME, ROUNDING, STATISTICS, LOST_UPDATES, TRAINING, DIFFERENT_MODEL = 0, 1, 2, 3, 4, 5
NUMERICS_NAMES = {SAME: "same gradient", ROUNDING: "rounding-level", STATISTICS: "changed statistics",
                  LOST_UPDATES: "small updates lost", TRAINING: "changed training",
                  DIFFERENT_MODEL: "a different model"}
# The table's columns, by what they hold. The need a candidate is judged by: on CUDA, reserved memory at the peak
# (the simulated caching allocator) plus the context allowance; on a CPU, allocated memory at the peak (the counter).
NEEDS = {"cuda": "needs (reserved + context)", "cpu": "needs (allocated at peak)"}
HEADROOM = "budget - needs"
ESTIMATED = "step time, estimated (x plain step)"
MEASURED = "step time, measured (x plain step)"
HOW = "how needs were found"
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "half": 2.0 ** -11,
                 "bf16 weights": 2.0 ** -8}
# What the parameters are stored in, by precision (autocast keeps them in float32).
WEIGHTS = {"float32": torch.float32, "bf16": torch.float32, "fp16": torch.float32, "half": torch.float16,
           "bf16 weights": torch.bfloat16}


@dataclass(frozen=True)
class Candidate:
    """One way to run the step: the optimizer (a label of ``Plan.optimizers``), precision, micro-batches,
    checkpointing, offload, LoRA adapters in place of the full model's training, a chunked loss and, with several
    GPUs, the parallelism."""

    optimizer: str
    precision: str = "float32"
    accumulate: int = 1
    checkpointed: bool = False
    offload: bool = False
    strategy: str = "single GPU"
    lora: bool = False
    chunked_loss: bool = False  # a causal LM's loss a chunk of tokens at a time (gpukit.losses)
    qlora: bool = False  # with ``lora``: the adapted layers' weights quantized to 4-bit NF4 (bitsandbytes), QLoRA

    def __post_init__(self) -> None:
        if self.qlora and not self.lora:
            raise ValueError("qlora=True trains LoRA adapters over 4-bit weights: pass lora=True with it")

    @property
    def group(self) -> tuple[str, str, str, bool, bool]:
        return self.optimizer, self.precision, self.strategy, self.lora, self.qlora

    def technique(self, accumulate: int | None = None) -> Technique:
        """The ``gpukit.step.Technique`` of this candidate (offload is left to the caller: see ``fake_save_on_cpu``)."""
        amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        return Technique(self.label, amp=amp, accumulate=accumulate or self.accumulate,
                         checkpointed=self.checkpointed, half=self.precision == "half",
                         cast=torch.bfloat16 if self.precision == "bf16 weights" else None)

    @property
    def label(self) -> str:
        parts = {"float32": [], "bf16": ["AMP bf16"], "fp16": ["AMP fp16 + GradScaler"],
                 "half": ["half(), BatchNorm float32"], "bf16 weights": ["bf16 weights"]}[self.precision][:]
        if self.lora:
            parts.insert(0, "QLoRA (NF4 weights)" if self.qlora else "LoRA")
        if self.accumulate > 1:
            parts.append(f"accumulate {self.accumulate}")
        if self.checkpointed:
            parts.append("checkpointing")
        if self.offload:
            parts.append("offload saved tensors")
        if self.chunked_loss:
            parts.append("chunked loss")
        if self.strategy != "single GPU":
            parts.insert(0, self.strategy)
        return " + ".join(parts) or "plain"

    def saves_at_least(self, other: "Candidate") -> bool:
        """Same group, and every memory technique of ``other`` at least as strong here."""
        return (self.group == other.group and self.accumulate >= other.accumulate
                and self.checkpointed >= other.checkpointed and self.offload >= other.offload
                and self.chunked_loss >= other.chunked_loss)


@dataclass
class Row:
    """A candidate's line in the plan's table."""

    candidate: Candidate
    verdict: str = "not predicted"     # "fits", "does not fit", "pruned: ..." (why it was not predicted)
    fits: bool | None = None           # None: not known (dominated, not predicted)
    peak: int | None = None            # allocated at the peak (predicted; the full batch held)
    reserved: int | None = None        # reserved at the peak (simulated allocator), CUDA plans
    need: int | None = None            # what the budget is compared with
    how: str = ""                      # how ``need`` was obtained
    slowdown: float = 1.0              # estimated step time / plain step time
    measured_slowdown: float | None = None
    measured_on: str | None = None
    numerics: int = SAME
    numerics_note: str = ""
    tolerance: float | None = None
    copy_bytes: int = 0                # offload: bytes to the host and back, per step
    host_peak: int | None = None       # optimizer state on the host: the host's predicted peak
    lower_bound: bool = False          # some op's fake kernel was unchecked: the peak may be low
    bound: int | None = None           # pruned: the lower bound of its need that was over the budget
    prediction: Prediction | None = field(default=None, repr=False)  # host offload: an OffloadPrediction
    libraries: tuple[str, ...] = ()    # what the recipe needs besides PyTorch (bitsandbytes, peft, torchao...)
    ranking: str = ""                  # why it ranks where cost alone would not put it (a tie, a demotion)

    def cells(self, budget: int, device: str) -> dict:
        """The row as the table shows it, for a plan on ``device`` ("cuda" or "cpu": what its needs are)."""
        return {"techniques": self.candidate.label, "optimizer": self.candidate.optimizer,
                "verdict": self.verdict,
                NEEDS[device]: format_bytes(self.need) + (" (lower bound)" if self.lower_bound else ""),
                HEADROOM: format_bytes(budget - self.need) if self.need is not None else "-",
                ESTIMATED: f"{self.slowdown:.2f}x",
                MEASURED: (f"{self.measured_slowdown:.2f}x on {self.measured_on}"
                           if self.measured_slowdown is not None else "-"),
                "numerics": f"{NUMERICS_NAMES[self.numerics]}: {self.numerics_note}" if self.numerics_note
                else NUMERICS_NAMES[self.numerics],
                "libraries": "PyTorch" + "".join(f" + {name}" for name in self.libraries),
                "ranking": self.ranking or "-",
                HOW: self.how}


@dataclass
class Verification:
    """One real step of the chosen recipe under ``gpukit.budget`` (or why there was none)."""

    ran: bool
    message: str
    fitted: bool | None = None
    measured_peak: int | None = None
    predicted_peak: int | None = None
