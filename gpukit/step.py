"""One training step, with the memory techniques as options.

    from gpukit.step import Technique, train_step
    train_step(model, optimizer, (x, y))                                       # the plain step
    train_step(model, optimizer, (x, y), Technique("bf16 + ckpt", amp=torch.bfloat16, checkpointed=True))

The step is plain PyTorch: ``zero_grad``, forward under ``torch.autocast`` (when asked), cross-entropy,
``backward`` through a ``GradScaler`` (float16 only), ``step``; gradient accumulation splits the batch into
micro-batches. It is the step ``predict()`` predicts by default, the step of the technique matrix and of the
technique explorer, and the step the tests measure, so a figure from one is a figure for the others.

Checkpointing is chosen by the model's structure, not by its class (``checkpoint_plan``): the blocks of the
longest ``nn.ModuleList`` or ``nn.Sequential`` of repeated blocks (modules of one type that have layers of
their own, such as transformer blocks: one segment each, as language models do it), else
``round(sqrt(n))`` segments of the longest ``nn.Sequential`` (``checkpoint_sequential``), else the whole
model as one segment. Nothing in the model is changed: the chosen modules' forwards go through
``torch.utils.checkpoint`` only while the step's forward runs.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential


@dataclass(frozen=True)
class Technique:
    """What a training step does differently from the plain float32 one."""

    name: str = "baseline"
    amp: torch.dtype | None = None   # autocast to this type (float16 also scales the loss with a GradScaler)
    accumulate: int = 1              # micro-batches per optimizer step
    checkpointed: bool = False       # keep segment boundaries only; recompute the rest in backward
    half: bool = False               # model.half(), BatchNorm back in float32 (``half_with_float_batchnorm``)
    offload: bool = False            # tensors saved for backward go to the host (save_on_cpu)

    def __post_init__(self) -> None:
        if self.amp not in (None, torch.float16, torch.bfloat16):
            raise ValueError(f"amp must be None, torch.float16 or torch.bfloat16, not {self.amp!r}")
        if not isinstance(self.accumulate, int) or isinstance(self.accumulate, bool) or self.accumulate < 1:
            raise ValueError(f"accumulate must be a whole number of micro-batches >= 1, not {self.accumulate!r}")


BASELINE = Technique("baseline")


@dataclass(frozen=True)
class CheckpointPlan:
    """Which modules a checkpointed step recomputes: ``kind`` is ``'blocks'`` (each module of ``modules``
    is one segment), ``'sequential'`` (``modules[0]`` in ``segments`` segments) or ``'whole'``."""

    kind: str
    modules: tuple[nn.Module, ...]
    segments: int

    def __str__(self) -> str:
        if self.kind == "blocks":
            return f"{self.segments} segments: one per {type(self.modules[0]).__name__}"
        if self.kind == "sequential":
            return f"{self.segments} segments of an nn.Sequential of {len(self.modules[0])} layers"
        return "1 segment: the whole model"


def checkpoint_plan(model: nn.Module) -> CheckpointPlan:
    """The segments a checkpointed step uses for ``model`` (see the module's docstring)."""
    blocks = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2
              and len({type(b) for b in m}) == 1 and any(True for _ in m[0].children())]
    if blocks:
        longest = max(blocks, key=len)  # the first of the longest: the outermost
        return CheckpointPlan("blocks", tuple(longest), len(longest))
    sequentials = [m for m in model.modules() if isinstance(m, nn.Sequential) and len(m) >= 2]
    if sequentials:
        longest = max(sequentials, key=len)
        return CheckpointPlan("sequential", (longest,), max(1, round(math.sqrt(len(longest)))))
    return CheckpointPlan("whole", (model,), 1)


def _checkpointed_forward(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _sequential_forward(seq: nn.Sequential, segments: int, x):
    return checkpoint_sequential(seq, segments, x, use_reentrant=False)


@contextlib.contextmanager
def checkpointing(model: nn.Module, plan: CheckpointPlan | None = None) -> Iterator[CheckpointPlan]:
    """Within the block, the forward of ``model`` recomputes its segments in backward (``checkpoint_plan``).

    The segments' forwards are routed through ``torch.utils.checkpoint`` (non-reentrant) and put back on
    exit; backward may run after the block (the recomputation keeps the functions it needs).
    """
    plan = plan or checkpoint_plan(model)
    if plan.kind == "sequential":
        patched = {plan.modules[0]: functools.partial(_sequential_forward, plan.modules[0], plan.segments)}
    else:
        patched = {m: functools.partial(_checkpointed_forward, m.forward) for m in plan.modules}
    if plan.kind == "whole":  # the model itself: call through the original forward from outside
        patched = {}
    try:
        for module, forward in patched.items():
            module.forward = forward  # an instance attribute: nn.Module.__call__ finds it first
        yield plan
    finally:
        for module in patched:
            module.__dict__.pop("forward", None)


def half_with_float_batchnorm(model: nn.Module) -> nn.Module:
    """``model.half()``, with every BatchNorm put back in float32 (its running statistics overflow float16).
    Returns the model."""
    model.half()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.float()
    return model


def _forward(model: nn.Module, xs: Any, checkpointed: bool):
    if not checkpointed:
        return model(xs)
    with checkpointing(model) as plan:
        if plan.kind == "whole":
            return checkpoint(model, xs, use_reentrant=False)
        return model(xs)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
               technique: Technique = BASELINE, scaler: torch.amp.GradScaler | None = None) -> None:
    """One optimizer step on ``batch = (inputs, targets)`` with the technique's mechanisms.

    The loss is cross-entropy over the last dimension of the model's output (classes, or a language model's
    vocabulary). A float16 ``technique.amp`` needs ``scaler``, a ``torch.amp.GradScaler`` kept across steps
    (its scale adapts from step to step); other techniques need none. ``technique.half`` expects a model
    already made half (``half_with_float_batchnorm``); floating-point inputs are cast to float16 here.
    Returns nothing: a returned loss would keep its memory alive (call ``loss.item()`` in your own loop).
    """
    t = technique
    if t.amp is torch.float16 and (scaler is None or not scaler.is_enabled()):
        raise ValueError("float16 autocast needs an enabled torch.amp.GradScaler: pass "
                         "scaler=torch.amp.GradScaler(device.type), kept across steps")
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    for xs, ys in zip(x.chunk(t.accumulate), y.chunk(t.accumulate)):
        if t.half and xs.is_floating_point():
            xs = xs.half()
        amp = torch.autocast(xs.device.type, dtype=t.amp) if t.amp else contextlib.nullcontext()
        offload = (torch.autograd.graph.save_on_cpu(pin_memory=xs.is_cuda) if t.offload
                   else contextlib.nullcontext())
        with amp, offload:
            out = _forward(model, xs, t.checkpointed)
            loss = F.cross_entropy(out.float().flatten(0, -2), ys.flatten())
            if t.accumulate > 1:
                loss = loss / t.accumulate  # the gradients of k micro-batches add up to the full batch's
        (scaler.scale(loss) if scaler is not None else loss).backward()
        del out, loss
    if scaler is not None:
        scaler.step(optimizer)  # a disabled scaler just steps
        scaler.update()
    else:
        optimizer.step()


__all__ = ["Technique", "BASELINE", "CheckpointPlan", "checkpoint_plan", "checkpointing",
           "half_with_float_batchnorm", "train_step"]
