"""Make it fit: the cheapest combination of memory techniques for a model, a batch and a GPU.

    import gpukit
    p = gpukit.plan(make_model, lambda params: torch.optim.AdamW(params), make_batch, budget="24GB")
    p               # the table: cheapest recipe that fits first, predicted peak, headroom, slowdown, numerics
    print(p.code)   # the chosen recipe as plain PyTorch, to paste into a training loop

Each candidate is one way of running the same training step (``gpukit.step.train_step``): autocast to bfloat16
or float16 (with a GradScaler), ``model.half()`` with float32 BatchNorm, gradient accumulation over k
micro-batches (the same effective batch), activation checkpointing (``gpukit.step.checkpoint_plan``), saved
activations sent to the host (``save_on_cpu``), another optimizer or optimizer implementation where allowed,
and with several GPUs DDP, ZeRO-1 or FSDP. Its peak is predicted exactly under fake tensors
(``gpukit.estimate.predict``), on reserved memory from the simulated caching allocator plus the context
allowance for a CUDA plan. Nothing runs for real except, at the end, one step of the chosen recipe where the
model is small enough for this machine.

How the search stays cheap (every shortcut is stated in the table):

* Accumulation over k micro-batches of b samples is predicted as 2 micro-batches of b: micro-batches 2..k
  allocate the same (the gradients exist from the first), so the peak is the same once the batch held
  before the step is counted at its full size.
* Model state and the optimizer step alone (no forward, no activations) are predicted once per optimizer and
  parameter type: a lower bound of every candidate with them. Over the budget: none of them is predicted.
* Memory goes down as techniques are added (more micro-batches, checkpointing, offload): before the cheapest
  candidate of a group (optimizer, precision, parallelism) is predicted, the group's most saving one is; if
  it does not fit, no candidate of the group does.
* Candidates are predicted cheapest first; once one fits, the costlier ones that only add techniques to a
  fitting one are dominated and never predicted.

Time cost, relative to the plain float32 step of the same batch (estimated, from stated figures): a step does
3 forward passes' worth of arithmetic (the backward pass two); checkpointing recomputes the checkpointed
segments' forward (their FLOPs counted under fake tensors by ``torch.utils.flop_counter``); offload copies every
saved tensor to the host and back at ``host_bandwidth``; each extra micro-batch reads the weights twice more and
adds into the gradients at ``memory_bandwidth``. AMP's speed-up and communication between GPUs are not counted.
Where the model runs on this machine, each fitting candidate's step is also timed for real (labelled with the
device it ran on). Timed on the planned device, that measured cost ranks the fitting candidates instead of the
estimate; timed elsewhere (a CUDA plan checked on a CPU), it is shown beside the estimate and ranks nothing.
"""

from __future__ import annotations

import contextlib
import copy
import heapq
import html
import inspect
import math
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import nn

from ._torch import FakeTensorMode, ScalerThatAlwaysSteps, tree_flatten, tree_map_only
from .counter import round_up
from .estimate import CONTEXT_ALLOWANCE, Prediction, predict
from .factories import check_factories, check_optimizer, fake_copy, fake_model, real_tensors
from .report import format_bytes, parse_bytes
from .step import Technique, checkpoint_plan, half_with_float_batchnorm, train_step

PRECISIONS = ("float32", "bf16", "fp16", "half")
STRATEGIES = ("single GPU", "DDP", "ZeRO-1", "FSDP")
# What changes numerically, from least to most; the tolerance is on |g - g_plain| / |g_plain| for the gradients
# of one step, 16 units of roundoff of the arithmetic that changed (None: not comparable with the plain step).
SAME, ROUNDING, STATISTICS, TRAINING = 0, 1, 2, 3
NUMERICS_NAMES = {SAME: "same gradient", ROUNDING: "rounding-level", STATISTICS: "changed statistics",
                  TRAINING: "changed training"}
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "half": 2.0 ** -11}


@dataclass(frozen=True)
class Candidate:
    """One way to run the step: the optimizer (a label of ``Plan.optimizers``), precision, micro-batches,
    checkpointing, offload and, with several GPUs, the parallelism."""

    optimizer: str
    precision: str = "float32"
    accumulate: int = 1
    checkpointed: bool = False
    offload: bool = False
    strategy: str = "single GPU"

    @property
    def group(self) -> tuple[str, str, str]:
        return self.optimizer, self.precision, self.strategy

    def technique(self, accumulate: int | None = None) -> Technique:
        """The ``gpukit.step.Technique`` of this candidate (offload is left to the caller: see ``_offload``)."""
        amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        return Technique(self.label, amp=amp, accumulate=accumulate or self.accumulate,
                         checkpointed=self.checkpointed, half=self.precision == "half")

    @property
    def label(self) -> str:
        parts = {"float32": [], "bf16": ["AMP bf16"], "fp16": ["AMP fp16 + GradScaler"],
                 "half": ["half(), BatchNorm float32"]}[self.precision][:]
        if self.accumulate > 1:
            parts.append(f"accumulate {self.accumulate}")
        if self.checkpointed:
            parts.append("checkpointing")
        if self.offload:
            parts.append("offload saved tensors")
        if self.strategy != "single GPU":
            parts.insert(0, self.strategy)
        return " + ".join(parts) or "plain"

    def saves_at_least(self, other: "Candidate") -> bool:
        """Same group, and every memory technique of ``other`` at least as strong here."""
        return (self.group == other.group and self.accumulate >= other.accumulate
                and self.checkpointed >= other.checkpointed and self.offload >= other.offload)


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
    lower_bound: bool = False          # some op's fake kernel was unchecked: the peak may be low
    prediction: Prediction | None = field(default=None, repr=False)

    def cells(self, budget: int) -> dict:
        return {"techniques": self.candidate.label, "optimizer": self.candidate.optimizer,
                "verdict": self.verdict,
                "predicted peak": format_bytes(self.need) + (" (lower bound)" if self.lower_bound else ""),
                "headroom": format_bytes(budget - self.need) if self.need is not None else "-",
                "slowdown (estimated)": f"{self.slowdown:.2f}x",
                "slowdown (measured)": (f"{self.measured_slowdown:.2f}x on {self.measured_on}"
                                        if self.measured_slowdown is not None else "-"),
                "numerics": f"{NUMERICS_NAMES[self.numerics]}: {self.numerics_note}" if self.numerics_note
                else NUMERICS_NAMES[self.numerics],
                "how": self.how}


@dataclass
class Verification:
    """One real step of the chosen recipe under ``gpukit.budget`` (or why there was none)."""

    ran: bool
    message: str
    fitted: bool | None = None
    measured_peak: int | None = None
    predicted_peak: int | None = None


@dataclass
class Plan:
    """What ``plan()`` found: ``rows`` (cheapest fitting first), ``choice`` (the first fitting row or None),
    ``code`` (the chosen recipe in plain PyTorch), ``verification`` and the search's own figures."""

    budget: int
    device: str
    gpus: int
    allowance: int
    rows: list[Row]
    choice: Row | None
    code: str
    verification: Verification
    predictions: int
    seconds: float
    assumptions: str
    model_note: str
    optimizers: dict[str, Callable] = field(default_factory=dict, repr=False)  # label -> make_optimizer

    def run(self, row: Row, limit: int | str | None = None, device: str = "cpu"):
        """One real step of a row's candidate (``run_candidate``), under ``limit`` if given."""
        return run_candidate(self._make_model, self.optimizers[row.candidate.optimizer], self._make_batch,
                             row.candidate, limit=None if limit is None else parse_bytes(limit), device=device)

    def frame(self):
        """The table as a pandas DataFrame."""
        import pandas as pd

        return pd.DataFrame([r.cells(self.budget) for r in self.rows])

    def _head(self) -> list[str]:
        what = (f"budget {format_bytes(self.budget)} ({self.budget / 1e9:g} GB) on {self.device}"
                + (f", {self.gpus} GPUs: per-rank figures" if self.gpus > 1 else "")
                + (f"; needed = reserved at the peak (simulated allocator) + context allowance "
                   f"{format_bytes(self.allowance)}" if self.device == "cuda" else "; needed = allocated at the peak"))
        found = (f"cheapest that fits: {self.choice.candidate.label} (optimizer: {self.choice.candidate.optimizer})"
                 if self.choice else "nothing fits: see the smallest needs below")
        return [what, self.model_note, found,
                f"{self.predictions} predictions in {self.seconds:.1f} s; {self.assumptions}",
                f"verification: {self.verification.message}"]

    def __repr__(self) -> str:
        import pandas as pd

        shown = [r.cells(self.budget) for r in self.rows if r.need is not None]
        with pd.option_context("display.max_colwidth", 70, "display.width", 250, "display.max_columns", 20):
            table = pd.DataFrame(shown).drop(columns=["how", "verdict"]).to_string(index=False) if shown else ""
        code = "\n".join("    " + line for line in self.code.splitlines())
        return "\n".join(self._head() + ["predicted:", table, self._pruned_line(), "recipe:", code])

    def _pruned_line(self) -> str:
        reasons: dict[str, int] = {}
        for r in self.rows:
            if r.need is None:
                why = r.verdict.removeprefix("pruned: ").split(":")[0].split(" need ")[0]
                reasons[why] = reasons.get(why, 0) + 1
        if not reasons:
            return "nothing pruned"
        return (f"{sum(reasons.values())} candidates not predicted (frame() lists them): "
                + "; ".join(f"{n} {why}" for why, n in reasons.items()))

    def _repr_html_(self) -> str:
        import pandas as pd

        head = "".join(f"<div>{html.escape(line)}</div>" for line in self._head())
        shown = [r.cells(self.budget) for r in self.rows if r.need is not None]
        table = pd.DataFrame(shown).to_html(index=False, escape=True) if shown else ""
        table += f"<div>{html.escape(self._pruned_line())}</div>"
        return f"<b>make it fit</b>{head}{table}<b>recipe</b><pre>{html.escape(self.code)}</pre>"

    def plot(self, ax=None, max_rows: int = 14):
        """The predicted candidates' needs as horizontal bars against the budget line; returns the axes."""
        import matplotlib.pyplot as plt

        rows = [r for r in self.rows if r.need is not None][:max_rows][::-1]
        if ax is None:
            _, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
        gib = [r.need / 2**30 for r in rows]
        colours = ["tab:green" if r.fits else "tab:red" for r in rows]
        ax.barh(range(len(rows)), gib, color=colours)
        ax.set_yticks(range(len(rows)), [f"{r.candidate.label} [{r.candidate.optimizer}]" for r in rows],
                     fontsize=8)
        ax.axvline(self.budget / 2**30, color="black", linestyle="--", label=f"budget {self.budget / 1e9:g} GB")
        ax.set_xlabel("predicted need (GiB)")
        ax.legend(loc="lower right")
        ax.set_title("candidates: green fits, red does not")
        return ax


# -- what the search needs to know about the model -------------------------------------------------------------


@dataclass
class _ModelFacts:
    parameters: int
    batch_size: int
    batch_bytes_per_sample: list[tuple[int, int]]  # per batch tensor: (elements per sample, element size)
    forward_flops: int
    recompute_flops: int
    has_batchnorm: bool
    checkpoint_text: str
    checkpoint_code: str
    largest_block_bytes: int  # float32 parameter bytes of the largest checkpoint block (FSDP's unit)
    existing_model: bool = False  # make_model() returns a model that already exists (real tensors under fake mode)

    def batch_bytes(self, n: int) -> int:
        return sum(round_up(per * n * size) for per, size in self.batch_bytes_per_sample)


def _qualified_names(model: nn.Module) -> dict[nn.Module, str]:
    return {m: n for n, m in model.named_modules()}


def _model_facts(make_model, make_batch) -> _ModelFacts:
    """Shapes, parameters and forward FLOPs, under fake tensors (nothing allocated)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
        model = make_model()
        existing = bool(real_tensors(model))
        if existing:  # the user's own model (lambda: model): read through a fake copy, never run itself
            model = fake_copy(model, fake_mode)
        batch = make_batch()
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(torch.is_tensor(t) for t in batch)):
            raise ValueError("make_batch() must return (inputs, targets), two tensors whose first dimension is "
                             "the batch, as gpukit.step.train_step takes them")
        x, y = batch
        if x.dim() == 0 or y.dim() == 0 or x.shape[0] != y.shape[0]:
            raise ValueError(f"inputs {tuple(x.shape)} and targets {tuple(y.shape)} need the same first "
                             "dimension: the batch")
        b = int(x.shape[0])
        per_sample = [(t.numel() // b, t.element_size()) for t in (x, y)]
        cp = checkpoint_plan(model)
        names = _qualified_names(model)
        counted: list[int] = []
        counter = FlopCounterMode(display=False)
        if cp.kind == "blocks":
            watched = list(cp.modules)
        elif cp.kind == "sequential":
            seq = cp.modules[0]
            size = len(seq) // cp.segments
            watched = list(seq)[: size * (cp.segments - 1)]  # checkpoint_sequential runs the last segment plainly
        else:
            watched = []
        handles = []
        for m in watched:
            handles.append(m.register_forward_pre_hook(lambda *_: counted.append(-counter.get_total_flops())))
            handles.append(m.register_forward_hook(lambda *_: counted.append(counter.get_total_flops())))
        try:
            with torch.no_grad(), counter:
                model(x)
        finally:
            for h in handles:
                h.remove()
        total = counter.get_total_flops()
        recompute = total if cp.kind == "whole" else sum(counted)
        n_params = sum(p.numel() for p in model.parameters())
        has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        largest = max((sum(p.numel() * 4 for p in m.parameters()) for m in cp.modules), default=0) \
            if cp.kind == "blocks" else n_params * 4
        if cp.kind == "blocks":
            parent = names[cp.modules[0]].rsplit(".", 1)[0] if "." in names[cp.modules[0]] else ""
            where = f"model.{parent}" if parent else "model"
            code = (f"for block in {where}:  # {cp}\n"
                    "    block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)")
        elif cp.kind == "sequential":
            where = f"model.{names[cp.modules[0]]}" if names[cp.modules[0]] else "model"
            code = (f"{where}.forward = functools.partial(  # {cp}\n"
                    f"    checkpoint_sequential, {where}, {cp.segments}, use_reentrant=False)")
        else:
            code = ""
    return _ModelFacts(n_params, b, per_sample, int(total), int(recompute), has_bn, str(cp), code, largest, existing)


# -- optimizers --------------------------------------------------------------------------------------------------


def _implementations(label: str, make_optimizer, device: str) -> list[tuple[str, Callable, str]]:
    """The other implementations of an optimizer's step (for-loop, fused) that its class offers and the device
    does not already use: ``(label, make_optimizer, note)``."""
    with FakeTensorMode():
        probe = make_optimizer([nn.Parameter(torch.zeros(2))])
    cls = type(probe)
    accepted = inspect.signature(cls.__init__).parameters
    group = probe.param_groups[0]
    if group.get("fused") or group.get("differentiable"):
        return []
    found = []
    default_foreach = device == "cuda" and group.get("foreach") is None  # CUDA's default: foreach
    if "foreach" in accepted and (default_foreach or group.get("foreach")):
        found.append((f"{label}, foreach=False", {"foreach": False}, "for-loop step: same update"))
    if "fused" in accepted:
        found.append((f"{label}, fused=True", {"fused": True, "foreach": False}, "fused step: same update"))

    def variant(changes):
        def make(params):
            opt = make_optimizer(params)
            groups = [dict(g) for g in opt.param_groups]
            for g in groups:
                g.update(changes)
            kwargs = {k: v for k, v in opt.defaults.items() if k in accepted and k != "params"}
            kwargs.update(changes)
            return type(opt)(groups, **kwargs)

        return make

    return [(name, variant(changes), note) for name, changes, note in found]


def _optimizer_name(make_optimizer) -> str:
    with FakeTensorMode():
        opt = make_optimizer([nn.Parameter(torch.zeros(2))])
        check_optimizer(opt)  # one that already exists would be stepped by every prediction: refused first
    name = type(opt).__name__
    if isinstance(opt, torch.optim.SGD):
        name += f"(momentum={opt.defaults.get('momentum', 0)})"
    return name


def _adam_like(make_optimizer) -> bool:
    """Optimizers with a second moment and an eps (Adam, AdamW, RMSprop...): unsafe with float16 weights."""
    with FakeTensorMode():
        opt = make_optimizer([nn.Parameter(torch.zeros(2))])
    return "eps" in opt.defaults


# -- predicting one candidate ------------------------------------------------------------------------------------


def _slice_batch(make_batch, n: int, b: int):
    """``make_batch`` cut to its first ``n`` samples (copies: a view would keep the whole batch's storage)."""
    if n == b:
        return make_batch

    def make():
        x, y = make_batch()
        return x[:n].clone(), y[:n].clone()

    return make


@contextlib.contextmanager
def _offload(counter: list[int] | None = None):
    """What ``torch.autograd.graph.save_on_cpu`` does to device memory, on fake tensors: every tensor saved for
    backward leaves the device (the host copy is not device memory) and comes back, as a new tensor of its size,
    when backward unpacks it (zeros: fake tensors carry no values worth keeping). ``counter[0]`` adds up the bytes copied (both ways)."""

    def pack(t):
        if counter is not None:
            counter[0] += 2 * t.numel() * t.element_size()
        return t.size(), t.dtype, t.device

    def unpack(packed):
        size, dtype, device = packed
        return torch.zeros(size, dtype=dtype, device=device)  # the copy's memory; zeros: valid class indices

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _step_for(candidate: Candidate, accumulate: int, copies: list[int] | None = None):
    technique = candidate.technique(accumulate)
    state: dict = {}

    def step(model, optimizer, batch):
        if technique.amp is torch.float16 and "scaler" not in state:
            state["scaler"] = ScalerThatAlwaysSteps(batch[0].device.type)  # made inside the fake run
        with _offload(copies) if candidate.offload else contextlib.nullcontext():
            train_step(model, optimizer, batch, technique, state.get("scaler"))

    return step


def _half_with_float_batchnorm_fake(model: nn.Module) -> nn.Module:
    """``half_with_float_batchnorm`` for a model of fake tensors, whose ``model.half()`` cannot swap its
    parameters: each floating-point parameter and buffer outside BatchNorm gets float16 data in place."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            continue
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            if t.is_floating_point():
                t.data = t.data.half()
    return model


def _model_maker(make_model, precision: str, fake: bool = True):
    """A candidate's model factory. ``fake``: called under fake tensors, where a model that already exists comes
    as a fake copy (``gpukit.factories.fake_model``), so that making it half never reaches the user's model."""
    if fake:
        return lambda: (_half_with_float_batchnorm_fake if precision == "half" else (lambda m: m))(
            fake_model(make_model))
    if precision != "half":
        return make_model
    return lambda: half_with_float_batchnorm(make_model())


def _optimizer_only(info: dict):
    """A step without forward or backward: gradients appear as zeros, then the optimizer steps. Its peak is a
    lower bound of every real step with this model and optimizer (the same state, the same optimizer step)."""

    def step(model, optimizer, batch):
        optimizer.zero_grad(set_to_none=True)
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        optimizer.step()
        info["params"] = sum(round_up(p.untyped_storage().nbytes()) for p in model.parameters())
        info["grads"] = sum(round_up(p.grad.untyped_storage().nbytes()) for p in model.parameters()
                            if p.grad is not None)
        info["optimizer_state"] = sum(round_up(v.untyped_storage().nbytes()) for s in optimizer.state.values()
                                      for v in s.values() if torch.is_tensor(v) and v.dim() > 0)

    return step


# -- the plan ----------------------------------------------------------------------------------------------------


class _Search:
    def __init__(self, make_model, make_optimizer, make_batch, limit, *, device, gpus, optimizers,
                 implementations, precisions, accumulate, checkpointing, offload, strategies, allowance,
                 tflops, memory_bandwidth, host_bandwidth, alternatives):
        self.make_model, self.make_batch = make_model, make_batch
        self.limit, self.device, self.gpus, self.allowance = limit, device, gpus, allowance
        self.tflops, self.memory_bw, self.host_bw = tflops, memory_bandwidth, host_bandwidth
        self.alternatives = alternatives
        self.facts = _model_facts(make_model, make_batch)
        # Real steps (the verification, Plan.run) train what they build: a model that already exists is copied.
        self.make_real_model = (lambda: copy.deepcopy(make_model())) if self.facts.existing_model else make_model
        b = self.facts.batch_size
        if b % gpus:
            raise ValueError(f"the batch of {b} does not divide among {gpus} GPUs; make it a multiple of {gpus}")
        self.rank_batch = b // gpus
        user = _optimizer_name(make_optimizer)
        self.optimizers: dict[str, tuple[Callable, str, int]] = {f"yours: {user}": (make_optimizer, "", SAME)}
        for name, make in (optimizers or {}).items():
            if not callable(make):
                raise TypeError(f"optimizers[{name!r}] must build an optimizer from parameters "
                                f"(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)), not {make!r}")
            self.optimizers[name] = (make, f"{_optimizer_name(make)} instead of {user}", TRAINING)
        if implementations:
            for name, (make, note, rank) in list(self.optimizers.items()):
                for vname, vmake, vnote in _implementations(name, make, device):
                    self.optimizers[vname] = (vmake, "; ".join(filter(None, [note, vnote])),
                                              max(rank, ROUNDING if "fused" in vname else SAME))
        self.adam_like = {name: _adam_like(make) for name, (make, _, _) in self.optimizers.items()}
        ks = accumulate if accumulate is not None else [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256)
                                                        if self.rank_batch % k == 0]
        bad = [k for k in ks if not isinstance(k, int) or k < 1 or self.rank_batch % k]
        if bad or not ks:
            raise ValueError(f"accumulate={accumulate!r}: each k must divide the batch per GPU "
                             f"({self.rank_batch}) into equal micro-batches")
        self.ks = sorted(set(ks) | {1})
        self.ckpt = [False, True] if checkpointing else [False]
        self.offl = [False, True] if offload and device == "cuda" else [False]
        self.precisions = precisions
        self.strategies = strategies
        self.predictions = 0
        self.floors: dict[tuple[str, str], dict] = {}
        self.rows: dict[Candidate, Row] = {}
        self.copies: dict[tuple, int] = {}
        self.found: list[Candidate] = []

    # figures -------------------------------------------------------------------------------------------------

    def numerics(self, c: Candidate) -> tuple[int, str, float | None]:
        rank, notes = SAME, []
        opt_note, opt_rank = self.optimizers[c.optimizer][1:]
        if opt_note:
            rank = max(rank, opt_rank)
            notes.append(opt_note)
        if c.precision in ("bf16", "fp16"):
            rank = max(rank, ROUNDING)
            notes.append(f"{'bfloat16' if c.precision == 'bf16' else 'float16'} arithmetic")
        if c.precision == "half":
            rank = max(rank, TRAINING)
            notes.append("float16 weights and updates, no float32 copy")
        if c.accumulate > 1 or c.strategy != "single GPU":
            rank = max(rank, ROUNDING)
            notes.append("sums in another order")
            if self.facts.has_batchnorm:
                rank = max(rank, STATISTICS)
                notes.append(f"BatchNorm normalises each micro-batch of {self.rank_batch // c.accumulate}")
        if c.checkpointed and self.facts.has_batchnorm:
            rank = max(rank, STATISTICS)
            notes.append("BatchNorm running statistics updated again by the recomputation")
        tolerance = None
        if rank <= ROUNDING or (rank == TRAINING and not self.facts.has_batchnorm):
            tolerance = 16 * UNIT_ROUNDOFF[c.precision] if (c.precision != "float32" or rank > SAME) else 1e-6
            if c.precision == "float32" and rank > SAME:
                tolerance = 1e-5  # float32 sums reordered: a few units of roundoff per layer
        return rank, "; ".join(notes), tolerance

    def slowdown(self, c: Candidate, copy_bytes: int = 0) -> float:
        step_seconds = 3 * self.facts.forward_flops / self.tflops
        if step_seconds <= 0:
            return 1.0
        extra = 0.0
        if c.checkpointed:
            extra += self.facts.recompute_flops / self.tflops
        if c.accumulate > 1:
            weight_bytes = self.facts.parameters * (2 if c.precision == "half" else 4)
            extra += (c.accumulate - 1) * 4 * weight_bytes / self.memory_bw  # weights read twice, grads read+written
        extra += copy_bytes / self.host_bw
        return 1.0 + extra / step_seconds

    def candidates(self) -> list[Candidate]:
        found = []
        for opt in self.optimizers:
            for precision in self.precisions:
                if precision == "half" and self.adam_like[opt]:
                    continue  # eps (1e-8) is 0 in float16 and the second moment underflows: not safe
                for strategy in self.strategies:
                    for k in self.ks:
                        for ck in self.ckpt:
                            for off in self.offl:
                                found.append(Candidate(opt, precision, k, ck, off, strategy))
        return found

    def key(self, c: Candidate, copy_bytes: int | None) -> tuple:
        rank = self.numerics(c)[0]
        return (rank == TRAINING, round(self.slowdown(c, copy_bytes or 0), 4), rank, c.accumulate, c.checkpointed, c.offload,
                list(self.optimizers).index(c.optimizer), PRECISIONS.index(c.precision),
                STRATEGIES.index(c.strategy))

    # predictions ---------------------------------------------------------------------------------------------

    def floor(self, c: Candidate) -> dict:
        """Model state and the optimizer step alone, for this optimizer and parameter type."""
        key = (c.optimizer, "half" if c.precision == "half" else "float32")
        if key not in self.floors:
            info: dict = {}
            p = predict(_model_maker(self.make_model, c.precision), self.optimizers[c.optimizer][0], lambda: (),
                        step=_optimizer_only(info), device=self.device)
            self.predictions += 1
            info["peak"] = p.peak
            self.floors[key] = info
        return self.floors[key]

    def state_change(self, c: Candidate) -> int:
        """Bytes a rank holds more (+) or less (-) than one process training alone, by the sharding formulas
        (the stages of the ZeRO paper; DDP's gradient buckets are a second copy of the gradients)."""
        if c.strategy == "single GPU":
            return 0
        f, n = self.floor(c), self.gpus
        p, g, o = f["params"], f["grads"], f["optimizer_state"]
        if c.strategy == "DDP":
            return g
        if c.strategy == "ZeRO-1":
            return g - o + math.ceil(o / n)
        unit = self.facts.largest_block_bytes // (2 if c.precision == "half" else 1)
        return -(p + g + o) + math.ceil((p + g + o) / n) + 2 * unit + unit  # two gathered units and one's grads

    def lower_bound(self, c: Candidate) -> int:
        return self.floor(c)["peak"] + self.state_change(c) + self.allowance

    def evaluate(self, c: Candidate) -> Row:
        if c in self.rows and self.rows[c].need is not None:
            return self.rows[c]
        rank, note, tol = self.numerics(c)
        micro = self.rank_batch // c.accumulate
        proxy_k = 1 if c.accumulate == 1 else 2
        n = micro * proxy_k
        copies = [0]
        p = predict(_model_maker(self.make_model, c.precision), self.optimizers[c.optimizer][0],
                    _slice_batch(self.make_batch, n, self.facts.batch_size), step=_step_for(c, proxy_k, copies),
                    device=self.device)
        self.predictions += 1
        held = self.facts.batch_bytes(self.facts.batch_size) - self.facts.batch_bytes(n)  # the full batch held
        how = ["predicted"]
        if proxy_k != c.accumulate:
            how.append(f"as 2 micro-batches of {micro} with the batch of {self.facts.batch_size} held")
        peak = p.peak + held
        reserved = None if p.reserved_peak is None else p.reserved_peak + held
        base = reserved if self.device == "cuda" and reserved is not None else peak
        change = self.state_change(c)
        if change:
            how.append(f"{c.strategy} per rank: {'+' if change > 0 else ''}{format_bytes(change)} by the sharding "
                       "formula, not predicted")
        need = base + change + self.allowance
        copy_bytes = copies[0] * (c.accumulate // proxy_k)
        row = Row(c, "fits" if need <= self.limit else "does not fit", need <= self.limit, peak=peak,
                  reserved=reserved, need=need, how="; ".join(how), slowdown=self.slowdown(c, copy_bytes),
                  numerics=rank, numerics_note=note, tolerance=tol, copy_bytes=copy_bytes,
                  lower_bound=p.lower_bound, prediction=p)
        self.rows[c] = row
        return row

    def pruned(self, c: Candidate, why: str, fits: bool | None = False) -> None:
        rank, note, tol = self.numerics(c)
        self.rows.setdefault(c, Row(c, f"pruned: {why}", fits, slowdown=self.slowdown(c), numerics=rank,
                                    numerics_note=note, tolerance=tol))

    # the search ------------------------------------------------------------------------------------------------

    def run(self) -> list[Row]:
        todo = self.candidates()
        heap = [(self.key(c, None if c.offload else 0), i, c, not c.offload) for i, c in enumerate(todo)]
        heapq.heapify(heap)
        probed: dict[tuple, bool] = {}
        fitting: list[Candidate] = []
        while heap:
            key, i, c, exact = heapq.heappop(heap)
            if len(fitting) > self.alternatives:
                self.pruned(c, "costlier than the recipes found", None)
                continue
            dominated = next((f for f in fitting if c.saves_at_least(f)), None)
            if dominated is not None:
                self.pruned(c, f"adds techniques to {dominated.label}, which fits", True)
                continue
            lower = self.lower_bound(c)
            if lower > self.limit:
                self.pruned(c, f"model state and optimizer step alone need {format_bytes(lower)}")
                continue
            amp = self.amp_bound(c)
            if amp > self.limit:
                self.pruned(c, f"autocast at best halves what float32 needs above the model state: at least "
                               f"{format_bytes(amp)} need")
                continue
            if c.group not in probed:
                probed[c.group] = self.evaluate(self.most_saving(c)).fits
            if not probed[c.group]:
                if c not in self.rows:
                    self.pruned(c, "does not fit even with the most micro-batches, checkpointing and offload")
                continue
            failed = next((r.candidate for r in self.rows.values() if r.fits is False and r.need is not None
                           and r.candidate.saves_at_least(c)), None)
            if failed is not None:
                if c not in self.rows:
                    self.pruned(c, f"saves no more than {failed.label}, which does not fit")
                continue
            if not exact:  # offload: count its copies (a forward under fake tensors), then queue it at its cost
                heapq.heappush(heap, (self.key(c, self.copy_bytes(c)), i, c, True))
                continue
            row = self.evaluate(c)
            if row.fits:
                fitting.append(c)
        self.found = fitting
        return self.ordered()

    def most_saving(self, c: Candidate) -> Candidate:
        return Candidate(c.optimizer, c.precision, max(self.ks), max(self.ckpt), max(self.offl), c.strategy)

    def amp_bound(self, c: Candidate) -> int:
        """A lower bound for autocast candidates: autocast keeps the float32 state and at best halves what the
        step needs above it, so it needs at least the state plus half of what the float32 group's most saving
        candidate needs above it (that candidate is predicted for this, where float32 is a precision tried)."""
        if c.precision not in ("bf16", "fp16") or "float32" not in self.precisions:
            return 0
        ref = self.most_saving(replace(c, precision="float32"))
        floor = self.lower_bound(ref)
        if floor > self.limit:
            return floor
        probe = self.evaluate(ref)
        return floor + max(probe.need - floor, 0) // 2

    def copy_bytes(self, c: Candidate) -> int:
        """Bytes ``save_on_cpu`` sends to the host and back in one step of this candidate (fake forwards)."""
        key = (c.precision, c.accumulate, c.checkpointed)  # the optimizer does not change what is saved
        if key not in self.copies:
            micro = self.rank_batch // c.accumulate
            copies = [0]
            with FakeTensorMode(allow_non_fake_inputs=True):
                model = _model_maker(self.make_model, c.precision)()
                x, y = _slice_batch(self.make_batch, micro, self.facts.batch_size)()
                t = c.technique(1)
                with _offload(copies):
                    if t.half and x.is_floating_point():
                        x = x.half()
                    amp = torch.autocast(x.device.type, dtype=t.amp) if t.amp else contextlib.nullcontext()
                    with amp:
                        from .step import _forward

                        _forward(model, x, t.checkpointed)
            self.copies[key] = copies[0] * c.accumulate
        return self.copies[key]

    def cost(self, r: Row) -> float:
        """A row's step time over the plain step's: measured where its step was timed on the planned device, else
        estimated (a CPU's timings say nothing of a GPU's: a CUDA plan checked on a CPU keeps its estimates)."""
        if r.measured_slowdown is not None and r.measured_on == self.device:
            return r.measured_slowdown
        return r.slowdown

    def ordered(self) -> list[Row]:
        def order(r: Row):
            # Predicted to fit; then dominated (they add techniques to one that fits, and cost more than it); then
            # predicted not to fit; then pruned.
            group = (0 if r.need is not None else 1) if r.fits else 2 if r.need is not None else 3
            return (group, r.numerics == TRAINING, self.cost(r), r.numerics, r.need if r.need is not None else 0)

        return sorted(self.rows.values(), key=order)


def plan(make_model: Callable[[], nn.Module], make_optimizer: Callable[[Any], torch.optim.Optimizer],
         make_batch: Callable[[], Any], budget: int | str = "24GB", *, device: str = "cuda", gpus: int = 1,
         optimizers: dict[str, Callable] | None = None, implementations: bool = True,
         precisions: tuple[str, ...] = PRECISIONS, accumulate: list[int] | None = None, checkpointing: bool = True,
         offload: bool = True, strategies: tuple[str, ...] | None = None, allowance: int | str | None = None,
         tflops: float = 100.0, memory_bandwidth: int | str = "2TB", host_bandwidth: int | str = "16GB",
         alternatives: int = 2, verify: bool = True) -> Plan:
    """The cheapest way to make one training step fit a memory budget (see the module's docstring).

    Args:
        make_model, make_optimizer, make_batch: as for ``gpukit.estimate.predict``; ``make_batch()`` returns
            ``(inputs, targets)`` of the whole batch, as ``gpukit.step.train_step`` takes them. A model that
            already exists (``lambda: model``) is predicted on fake copies and verified on a real copy
            (``copy.deepcopy``): it is never converted or stepped itself.
        budget: the GPU's memory, ``"24GB"`` (GB = 10^9 B), ``"80 GiB"`` or bytes.
        device: ``"cuda"`` (CUDA's code paths, reserved memory, the context allowance) or ``"cpu"``
            (allocated memory, what ``gpukit.budget`` caps on a CPU).
        gpus: GPUs sharing the batch; above 1 the candidates are DDP, ZeRO-1 and FSDP, per rank.
        optimizers: other optimizers you allow, ``{"SGD momentum": lambda p: torch.optim.SGD(p, 0.1, 0.9)}``.
        implementations: also try the optimizer's for-loop and fused steps (``foreach=False``, ``fused=True``).
        precisions: of ``"float32"``, ``"bf16"``, ``"fp16"`` (with a GradScaler) and ``"half"`` (``model.half()``
            with BatchNorm in float32; only with optimizers without an eps, such as SGD: Adam's eps of 1e-8 is 0
            in float16).
        accumulate: micro-batch counts to try (default: the powers of two that divide the batch per GPU).
        checkpointing, offload: try activation checkpointing (``gpukit.step.checkpoint_plan``), and saved tensors
            sent to the host (CUDA plans only: on a CPU the host is the device).
        strategies: with ``gpus > 1``, of ``"DDP"``, ``"ZeRO-1"``, ``"FSDP"`` (default all three).
        allowance: memory beyond PyTorch's (CUDA context, libraries): default ``CONTEXT_ALLOWANCE`` on CUDA, 0 on
            the CPU.
        tflops, memory_bandwidth, host_bandwidth: the figures the time cost is estimated with (per second;
            assumed unless you pass your GPU's).
        alternatives: fitting recipes to predict after the cheapest (for comparison; 0 is fastest).
        verify: run the chosen recipe's step once for real under ``gpukit.budget`` when it is small enough for
            this machine (and time each fitting candidate's step here).

    Returns:
        A ``Plan``: its table (``frame()``, HTML in Jupyter), ``choice``, ``code`` and ``verification``.

    Raises:
        ValueError: for a budget, device, precision, strategy or accumulation that is not one (the message lists
            what is allowed), a batch that is not ``(inputs, targets)``, or an optimizer that already exists
            returned by ``make_optimizer`` (``gpukit.factories.check_optimizer``).
        TypeError: a model, optimizer or batch passed where the function that builds it is expected.
    """
    t0 = time.perf_counter()
    check_factories(make_model, make_optimizer, make_batch, batch="lambda: (inputs, targets)")
    limit = parse_bytes(budget)
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r}: plan for 'cuda' (a GPU's code paths and reserved memory) or 'cpu'")
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ValueError(f"gpus={gpus!r}: a whole number of GPUs, 1 or more")
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown or not precisions or isinstance(precisions, str):
        raise ValueError(f"precisions={precisions!r}: choose from {', '.join(PRECISIONS)}")
    if gpus == 1:
        if strategies not in (None, ("single GPU",), ["single GPU"]):
            raise ValueError("strategies apply to several GPUs: pass gpus=2 or more")
        strategies = ("single GPU",)
    else:
        strategies = tuple(strategies or STRATEGIES[1:])
        unknown = [s for s in strategies if s not in STRATEGIES[1:]]
        if unknown or not strategies:
            raise ValueError(f"strategies={strategies!r}: choose from {', '.join(STRATEGIES[1:])}")
    allowance = (CONTEXT_ALLOWANCE if device == "cuda" else 0) if allowance is None else \
        (0 if allowance == 0 else parse_bytes(allowance))
    speeds = {}
    for name, value in (("memory_bandwidth", memory_bandwidth), ("host_bandwidth", host_bandwidth)):
        speeds[name] = parse_bytes(value)
    if not (isinstance(tflops, (int, float)) and tflops > 0):
        raise ValueError(f"tflops={tflops!r}: the GPU's arithmetic rate in TFLOP/s, a positive number")
    if not isinstance(alternatives, int) or alternatives < 0:
        raise ValueError(f"alternatives={alternatives!r}: a whole number, 0 or more")
    search = _Search(make_model, make_optimizer, make_batch, limit, device=device, gpus=gpus, optimizers=optimizers,
                     implementations=implementations, precisions=tuple(precisions), accumulate=accumulate,
                     checkpointing=checkpointing, offload=offload, strategies=strategies, allowance=allowance,
                     tflops=tflops * 1e12, memory_bandwidth=speeds["memory_bandwidth"],
                     host_bandwidth=speeds["host_bandwidth"], alternatives=alternatives)
    rows = search.run()
    timing_error = None
    if verify and any(r.fits for r in rows):
        timing_error = _time_fitting(search)
        rows = search.ordered()  # measured costs, where there are, rank the fitting recipes
    choice = next((r for r in rows if r.fits and r.need is not None), None)
    facts = search.facts
    note = (f"model: {facts.parameters:,} parameters, batch {facts.batch_size}"
            + (f" ({search.rank_batch} per GPU)" if gpus > 1 else "")
            + f", {facts.forward_flops / 1e9:,.1f} GFLOP per forward; checkpointing: {facts.checkpoint_text}")
    assumptions = (f"slowdown estimated at {tflops:g} TFLOP/s, memory {format_bytes(speeds['memory_bandwidth'])}/s, "
                   f"host copies {format_bytes(speeds['host_bandwidth'])}/s (AMP speed-up and communication not "
                   "counted)")
    code = recipe_code(choice.candidate, search, device) if choice else "# nothing fits: see the table"
    verification = Verification(False, "not asked (verify=False)")
    if verify:
        verification = _verify(search, choice, timing_error)
    result = Plan(limit, device, gpus, allowance, rows, choice, code, verification, search.predictions,
                  time.perf_counter() - t0, assumptions, note, {k: v[0] for k, v in search.optimizers.items()})
    result._make_model, result._make_batch = search.make_real_model, make_batch
    return result


# -- running candidates for real ---------------------------------------------------------------------------------


def _verify_on(search: _Search) -> str:
    """Where the plan's steps run for real: the planned device if this machine has it, else the CPU."""
    return search.device if search.device == "cpu" or torch.cuda.is_available() else "cpu"


def _small_enough(search: _Search, row: Row) -> bool:
    """Whether a real step of this candidate can run here: on the GPU, within its free memory; on the CPU, at
    most a quarter of the free memory (a step the size of the machine is not a cheap check)."""
    if _verify_on(search) == "cuda":
        free = torch.cuda.mem_get_info()[0]
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
        except (ValueError, OSError, AttributeError):
            free = 2**30
    return row.peak is not None and row.peak <= free and row.candidate.strategy == "single GPU"


def run_candidate(make_model, make_optimizer, make_batch, candidate: Candidate, *, limit: int | None = None,
                  device: str = "cpu", seed: int = 0, timed_steps: int = 0):
    """Build the candidate's model, optimizer and batch on ``device``, run a warm-up step, then one step under
    ``gpukit.budget(limit)`` (counting what the process held before as outside the budget).

    Returns:
        ``(model, measured peak: state plus the step's peak, median seconds of ``timed_steps`` more steps or None)``.

    Raises:
        torch.OutOfMemoryError: the step did not fit ``limit``.
    """
    from .budget import budget as memory_budget
    from .counter import gc_paused
    from .estimate import state_bytes
    from .meter import measure, resolve_device

    dev = resolve_device(device)
    if candidate.strategy != "single GPU":
        raise ValueError(f"{candidate.strategy} needs several processes: run it with torchrun")
    with gc_paused() as collect_young:  # one full collection; what the build and warm-up leave goes before the step
        other = 0
        if dev.type == "cpu":
            with measure(dev, record=False) as r:
                pass
            other = r.live_end
        torch.manual_seed(seed)
        with dev:
            model = _model_maker(make_model, candidate.precision, fake=False)()
        model.to(dev)
        optimizer = make_optimizer(model.parameters())
        batch = tree_map_only(torch.Tensor, lambda t: t.to(dev), make_batch())
        technique = candidate.technique()
        scaler = torch.amp.GradScaler(dev.type) if technique.amp is torch.float16 else None
        offload = torch.autograd.graph.save_on_cpu(pin_memory=dev.type == "cuda") if candidate.offload \
            else contextlib.nullcontext()

        def step():
            with offload:
                train_step(model, optimizer, batch, technique, scaler)

        step()  # warm-up: gradients and optimizer state exist
        cap = contextlib.nullcontext() if limit is None else memory_budget(limit + other, dev)
        collect_young()
        with measure(dev, record=False) as report, cap:
            step()
    peak = state_bytes(model, optimizer, batch)[0] + report.peak
    seconds = None
    if timed_steps:
        times: list[float] = []
        deadline = time.perf_counter() + 2.0  # at least one step; no more once two seconds have passed
        while len(times) < timed_steps and (not times or time.perf_counter() < deadline):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t = time.perf_counter()
            step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t)
        seconds = statistics.median(times)
    return model, peak, seconds


def _time_fitting(search: _Search) -> str | None:
    """Time the step of each fitting candidate small enough for this machine, beside the plain step's (their
    ``measured_slowdown``); returns why they could not run here, or None."""
    fitting = [r for r in search.rows.values() if r.fits and r.need is not None and _small_enough(search, r)]
    if not fitting:
        return None
    here = _verify_on(search)  # a plan for the CPU runs on the CPU, also on a machine with a GPU
    make_opt = search.optimizers
    plain = Candidate(next(iter(make_opt)))
    try:
        _, _, base = run_candidate(search.make_real_model, make_opt[plain.optimizer][0], search.make_batch, plain,
                                   device=here, timed_steps=3)
        for r in fitting:
            _, _, s = run_candidate(search.make_real_model, make_opt[r.candidate.optimizer][0], search.make_batch,
                                    r.candidate, device=here, timed_steps=3)
            r.measured_slowdown, r.measured_on = s / base, here
    except (RuntimeError, NotImplementedError) as err:  # a kernel this machine lacks (float16 on some CPUs)
        return str(err).splitlines()[0][:120]
    return None


def _verify(search: _Search, choice: Row | None, timing_error: str | None) -> Verification:
    if choice is None:
        return Verification(False, "nothing to verify: no candidate fits")
    if not _small_enough(search, choice):
        why = ("per-rank figures need several GPUs" if choice.candidate.strategy != "single GPU"
               else f"its predicted peak ({format_bytes(choice.peak)}) is too big for this machine")
        return Verification(False, f"not run here: {why}; the prediction stands alone", predicted_peak=choice.peak)
    if timing_error is not None:
        return Verification(False, f"could not run here: {timing_error}")
    here = _verify_on(search)
    make_opt = search.optimizers
    c = choice.candidate
    limit = search.limit - search.allowance if here == search.device else None
    try:
        _, measured, _ = run_candidate(search.make_real_model, make_opt[c.optimizer][0], search.make_batch, c,
                                       device=here, limit=limit)
        fitted = True
    except torch.OutOfMemoryError:
        measured, fitted = None, False
    predicted = choice.peak
    if here == search.device:
        msg = (f"one real step on {here} under gpukit.budget({format_bytes(limit)}): "
               + (f"fitted; measured peak {format_bytes(measured)} ({measured:,} B), predicted {format_bytes(predicted)}"
                  f" ({predicted:,} B)" if fitted else "OUT OF MEMORY: the prediction was wrong"))
    else:
        extra = "; offload saves nothing on a CPU (the host is the device)" if c.offload else ""
        msg = (f"one real step on {here} (this machine has no GPU: the budget is the GPU's, so it was run without "
               f"one): measured peak {format_bytes(measured)} on {here}'s code paths, predicted "
               f"{format_bytes(predicted)} allocated on CUDA's{extra}")
    return Verification(True, msg, fitted, measured, predicted)


# -- the recipe as code ------------------------------------------------------------------------------------------


def recipe_code(c: Candidate, search: _Search, device: str) -> str:
    """The candidate as plain PyTorch: setup lines, then the loop body."""
    make, note, _ = search.optimizers[c.optimizer]
    with FakeTensorMode():
        opt = make([nn.Parameter(torch.zeros(2))])
    cls = type(opt)
    defaults = {k: v for k, v in opt.defaults.items()}
    accepted = inspect.signature(cls.__init__).parameters
    args = []
    for k, v in defaults.items():
        if k in accepted and k != "params" and accepted[k].default is not inspect.Parameter.empty \
                and v != accepted[k].default and not (k == "lr" and isinstance(v, torch.Tensor)):
            args.append(f"{k}={v!r}")
    module = "torch.optim"
    dev = device
    lines = ["import functools", "import torch", "import torch.nn.functional as F",
             "from torch.utils.checkpoint import checkpoint, checkpoint_sequential", "",
             f"model = make_model().to({dev!r})"]
    if c.precision == "half":
        lines += ["model.half()  # float16 weights; BatchNorm back to float32 (its running statistics overflow)",
                  "for m in model.modules():",
                  "    if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):",
                  "        m.float()"]
    lines.append(f"optimizer = {module}.{cls.__name__}(model.parameters(){''.join(', ' + a for a in args)})")
    if c.precision == "fp16":
        lines.append(f"scaler = torch.amp.GradScaler({dev!r})")
    if c.checkpointed:
        lines.append(search.facts.checkpoint_code or "# checkpointing: the whole model, in the forward below")
    k = c.accumulate
    lines += ["", "for x, y in loader:", f"    x, y = x.to({dev!r}), y.to({dev!r})"]
    if c.precision == "half":
        lines.append("    x = x.half() if x.is_floating_point() else x")
    lines.append("    optimizer.zero_grad(set_to_none=True)")
    ind = "    "
    if k > 1:
        lines.append(f"    for xs, ys in zip(x.chunk({k}), y.chunk({k})):  # {k} micro-batches, one optimizer step")
        ind, xs, ys = "        ", "xs", "ys"
    else:
        xs, ys = "x", "y"
    ctx = []
    if c.precision in ("bf16", "fp16"):
        ctx.append(f"torch.autocast({dev!r}, dtype=torch.{'bfloat16' if c.precision == 'bf16' else 'float16'})")
    if c.offload:
        ctx.append(f"torch.autograd.graph.save_on_cpu(pin_memory={dev == 'cuda'})")
    forward = (f"checkpoint(model, {xs}, use_reentrant=False)" if c.checkpointed and not search.facts.checkpoint_code
               else f"model({xs})")
    body = [f"out = {forward}", f"loss = F.cross_entropy(out.float().flatten(0, -2), {ys}.flatten())"
            + (f" / {k}" if k > 1 else "")]
    if ctx:
        lines.append(f"{ind}with {', '.join(ctx)}:")
        lines += [f"{ind}    {b}" for b in body]
    else:
        lines += [f"{ind}{b}" for b in body]
    lines.append(f"{ind}{'scaler.scale(loss)' if c.precision == 'fp16' else 'loss'}.backward()")
    lines += ["    scaler.step(optimizer)", "    scaler.update()"] if c.precision == "fp16" else ["    optimizer.step()"]
    if c.strategy != "single GPU":
        wrap = {"DDP": "model = torch.nn.parallel.DistributedDataParallel(model)  # after .to(device), before the "
                       "optimizer",
                "ZeRO-1": "optimizer = torch.distributed.optim.ZeroRedundancyOptimizer(model.parameters(), "
                          f"optimizer_class={module}.{cls.__name__})  # with DDP as above",
                "FSDP": "for block in blocks: fully_shard(block); fully_shard(model)  "
                        "# torch.distributed.fsdp, before the optimizer"}[c.strategy]
        lines.insert(5, f"# {c.strategy}, launched with torchrun --nproc-per-node={search.gpus}; x, y: this rank's "
                        f"share (DistributedSampler)\n# {wrap}")
    return "\n".join(lines)


__all__ = ["plan", "Plan", "Row", "Candidate", "Verification", "run_candidate", "recipe_code", "PRECISIONS",
           "STRATEGIES", "NUMERICS_NAMES"]
