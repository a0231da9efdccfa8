"""Make it fit: the cheapest combination of memory techniques for a model, a batch and a GPU.

    import gpukit
    p = gpukit.plan(make_model, lambda params: torch.optim.AdamW(params), make_batch, budget="24GB")
    p               # the table: the recipe a practitioner would choose first; what each needs, its cost, numerics
    print(p.code)   # the chosen recipe as plain PyTorch, to paste into a training loop

Each candidate is one way of running the same training step (``gpukit.step.train_step``): autocast to bfloat16
or float16 (with a GradScaler), ``model.half()`` with float32 BatchNorm, gradient accumulation over k
micro-batches (the same effective batch), activation checkpointing (``gpukit.step.checkpoint_plan``), saved
activations sent to the host (``save_on_cpu``), another optimizer or optimizer implementation where allowed
(the optimizer's state and step on the host among them: torchao's ``CPUOffloadOptimizer``), LoRA adapters (peft)
over the model's weights or over its Linear weights quantized to 4-bit NF4 (QLoRA: bitsandbytes), and with several
GPUs DDP, ZeRO-1 or FSDP. Its peak is predicted exactly under fake tensors (``gpukit.estimate.predict``; with the
optimizer's state on the host, ``gpukit.offload.predict_offload``: a simulated GPU beside the host), on reserved
memory from the simulated caching allocator plus the context allowance for a CUDA plan. Nothing runs for real
except, at the end, one step of the chosen recipe where the model is small enough for this machine.

How the search stays cheap (every shortcut is stated in the table):

* Accumulation over k micro-batches of b samples is predicted as 2 micro-batches of b: micro-batches 2..k
  allocate the same (the gradients exist from the first), so the peak is the same once the batch held
  before the step is counted at its full size.
* Model state and the optimizer step alone (no forward, no activations) are predicted once per optimizer and
  parameter type: a lower bound of every candidate with them. Over the budget: none of them is predicted. With
  the optimizer's state on the host, what the GPU holds when a step starts is counted from the model alone
  (parameters, buffers, gradients; the state of the small parameters torchao keeps on the GPU left out), and the
  host's four copies of each offloaded weight bound the host's peak (over ``Host.memory``: not predicted).
* Before any candidate of a configuration (precision, micro-batches, checkpointing, offload, LoRA, chunked
  loss) is predicted, its step runs without the warm-up up to the optimizer step, and stops as soon as what it
  allocated puts the configuration over the budget: with what outlives the step taken out, a lower bound of
  every candidate of the configuration, whatever its optimizer (with its state where every parameter got a
  gradient). Most configurations that do not fit end there, at the cost of a forward.
* Up to the optimizer step, a step allocates the same whatever the optimizer (not one stepped in backward, nor one
  that frees each gradient once copied to the host) but for the optimizer's state: one prediction of a
  configuration (precision, micro-batches, checkpointing, offload, LoRA, chunked loss) gives, with each optimizer's
  floor, a lower bound of that configuration with every other optimizer (up to the first backward, with an
  optimizer stepped in backward or one that frees each gradient on the GPU). Over the budget: not predicted.
* Memory goes down as techniques are added (more micro-batches, checkpointing, offload): once two candidates of
  a group (optimizer, precision, parallelism) were predicted not to fit, the group's most saving one is; if it
  does not fit, no candidate of the group does.
* Candidates are predicted cheapest first; once one fits, the costlier ones that only add techniques to a
  fitting one are dominated and never predicted.

How the fitting recipes are ranked (``PlanSearch.rank_fitting``; each row whose place its cost alone would not give
says why in its "ranking" cell): a recipe more than 3 times as costly as the fastest fitting one, or whose host
memory need is over the host's (``Host.memory``, else Colab's 12.7 GB), after every one that is neither; then the
recipes that keep every update (AMP, accumulation, checkpointing, offload, another implementation), then those
that train the whole model otherwise (16-bit weights without a float32 copy, whose small updates are lost; another
optimizer), then those that train a different model (LoRA, QLoRA); within these, by cost, where costs within 5% are
one cost (the estimate resolves no finer) and PyTorch alone comes before a recipe that needs another library.

Time cost, relative to the plain float32 step of the same batch (estimated, from stated figures): a step does
3 forward passes' worth of arithmetic (the backward pass two); checkpointing recomputes the checkpointed
segments' forward (their FLOPs counted under fake tensors by ``torch.utils.flop_counter``); offload copies every
saved tensor to the host and back at the host's ``link``; an optimizer with its state on the host copies each
offloaded gradient to the host after each micro-batch and each offloaded weight back at the ``link``, and
steps on the host (a fused AdamW reads the weight, gradient and two moments of each element and writes three of
them back) at the host's ``memory_bandwidth``; each extra micro-batch reads the weights twice more and adds into the
gradients at the card's ``memory_bandwidth``; QLoRA dequantizes each 4-bit weight in every forward and backward, at
``memory_bandwidth``. AMP's speed-up and communication between GPUs are not counted.
Where the model runs on this machine, each fitting candidate's step is also timed for real (labelled with the
device it ran on). Timed on the planned device, that measured cost ranks the fitting candidates instead of the
estimate; timed elsewhere (a CUDA plan checked on a CPU), it is shown beside the estimate and ranks nothing.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import nn

from ..cards import Card
from ..counter import ONE_PREDICTION, refuse_inside_a_fake_run
from ..factories import check_factories
from ..progress import Progress
from ..report import format_bytes, parse_bytes
from ..step import resolve_loss
from .candidates import (
    NEEDS,
    NUMERICS_NAMES,
    PRECISIONS,
    STRATEGIES,
    Candidate,
    Row,
    Verification,
)
from .params import DEFAULT_CARD, Host, Techniques, from_deprecated, named, resolve_card
from .recipe import recipe_code
from .result import Plan
from .search import PlanSearch
from .verify import run_candidate, time_fitting, verify_choice


def plan(make_model: Callable[[], nn.Module], make_optimizer: Callable[[Any], torch.optim.Optimizer],
         make_batch: Callable[[], Any], budget: int | str | None = None, *, card: Card | str | None = None,
         host: Host | None = None, techniques: Techniques | None = None, gpus: int = 1, device: str = "cuda",
         loss: Callable[[nn.Module, Any], torch.Tensor] | str | None = None, alternatives: int = 2,
         verify: bool = True, **deprecated) -> Plan:
    """The cheapest way to make one training step fit a memory budget (see the module's docstring).

    Args:
        make_model, make_optimizer, make_batch: as for ``gpukit.estimate.predict``; ``make_batch()`` returns
            the whole batch: ``(inputs, targets)``, or with ``loss`` any structure (a dict, a transformers
            ``BatchEncoding``, tuples, nested) whose tensors share their first dimension. A model that
            already exists (``lambda: model``) is predicted on fake copies and verified on a real copy
            (``copy.deepcopy``): it is never converted or stepped itself.
        budget: the GPU's memory, ``"24GB"`` (GB = 10^9 B), ``"80 GiB"`` or bytes; default: the card's (what
            torch reports where a public report is recorded, else its data sheet's), else ``"24GB"``.
        card: the GPU, a ``gpukit.cards.Card`` or its name (``"t4"``, ``"A100 80GB"``,
            ``torch.cuda.get_device_name()``: ``gpukit.cards``); None: ``DEFAULT_CARD`` (Hopper's kernels, 100
            TFLOP/s, 2 TB/s). The time cost is estimated from its float32 TFLOP/s (``fp32_tflops``) and memory
            bandwidth (``memory_bandwidth``, bytes/s); every need adds its ``context_allowance`` (memory beyond
            PyTorch's: the CUDA context, libraries; None: ``gpukit.allocator.CONTEXT_ALLOWANCE`` on CUDA, 0 on the
            CPU). A card ``gpukit.cards`` does not list, or other figures: ``dataclasses.replace(
            gpukit.cards.card("a100-40gb"), fp32_tflops=..., context_allowance=0)``. On a card without bfloat16
            tensor cores (the T4), every bfloat16 recipe ranks after the float16 ones of the same cost, and its
            numerics say why; every prediction takes the attention kernels the card has (on a T4 bfloat16
            attention runs the math kernel, whose attention matrix is counted). A CPU plan takes only
            ``DEFAULT_CARD`` or one replaced from it (the time figures).
        host: the machine around the card, a ``Host``: its memory (a recipe whose host peak is over it does not
            fit), its memory bandwidth (an optimizer step on the host) and the link to the card (copies);
            default ``Host()``.
        techniques: the techniques tried, a ``Techniques`` (precisions, accumulation, checkpointing, offload,
            optimizers and their implementations, LoRA, strategies on several GPUs); default ``Techniques()``,
            all of them.
        gpus: GPUs sharing the batch; above 1 the candidates are DDP, ZeRO-1 and FSDP, per rank.
        device: ``"cuda"`` (CUDA's code paths, reserved memory, the context allowance) or ``"cpu"``
            (allocated memory, what ``gpukit.budget`` caps on a CPU).
        loss: how the step's loss is computed, as for ``gpukit.step.train_step``: ``None``, cross-entropy of
            ``model(inputs)`` against ``targets``; ``"model"``, the model computes it (``model(**batch).loss``: a
            transformers model with ``labels`` in the batch, no wrapper); or ``loss(model, batch)``. Accumulation
            cuts every tensor of the batch along its first dimension.
        alternatives: fitting recipes to predict after the cheapest (for comparison; 0 is fastest).
        verify: run the chosen recipe's step once for real under ``gpukit.budget`` when it is small enough for
            this machine (and time each fitting candidate's step here).
        **deprecated: the keywords ``plan()`` took before, for one release, each with a DeprecationWarning naming
            its new form: ``optimizers``, ``implementations``, ``precisions``, ``accumulate``, ``checkpointing``,
            ``offload``, ``strategies``, ``lora`` (``techniques=Techniques(...)``); ``host_memory``,
            ``host_memory_bandwidth``, ``host_bandwidth`` (``host=Host(memory=..., memory_bandwidth=...,
            link=...)``); ``tflops``, ``memory_bandwidth``, ``allowance`` (the card's ``fp32_tflops``,
            ``memory_bandwidth``, ``context_allowance``: ``card=dataclasses.replace(card, ...)``).

    Returns:
        A ``Plan``: its table (``frame()``, HTML in Jupyter), ``choice``, ``code`` and ``verification``.

    Raises:
        ValueError: for a budget, device, card figure, strategy for the number of GPUs or accumulation that is not
            one (the message lists what is allowed; ``Host`` and ``Techniques`` check their own when made), an old
            keyword beside its new home (``precisions=`` with ``techniques=``), a batch that is not
            ``(inputs, targets)`` without ``loss`` (or whose tensors do not share a batch dimension), a ``loss``
            that is none of the above, or an optimizer that already exists returned by ``make_optimizer``
            (``gpukit.factories.check_optimizer``).
        TypeError: a model, optimizer or batch passed where the function that builds it is expected; a card,
            host or techniques of another type; a keyword ``plan()`` does not take.
    """
    t0 = time.perf_counter()
    card, host, techniques = from_deprecated(deprecated, card, host, techniques, device)
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r}: plan for 'cuda' (a GPU's code paths and reserved memory) or 'cpu'")
    gpu = resolve_card(card, device)
    if not isinstance(alternatives, int) or isinstance(alternatives, bool) or alternatives < 0:
        raise ValueError(f"alternatives={alternatives!r}: a whole number, 0 or more")
    if not isinstance(verify, bool):
        raise TypeError(f"verify={verify!r}: True (run the chosen recipe's step once for real) or False")
    check_factories(make_model, make_optimizer, make_batch,
                    batch="lambda: (inputs, targets)" if loss is None else "lambda: batch")
    loss = resolve_loss(loss)
    limit = parse_bytes(budget if budget is not None else gpu.torch_total_memory or gpu.memory_bytes)
    with ONE_PREDICTION:  # (a plan on another thread ends first: the fake ledger counts every thread)
        refuse_inside_a_fake_run("plan()")
        return _planned(make_model, make_optimizer, make_batch, limit, gpu, host, techniques, gpus, device, loss,
                        alternatives, verify, t0)


def _planned(make_model, make_optimizer, make_batch, limit: int, gpu: Card, host, techniques, gpus: int, device: str,
             loss, alternatives: int, verify: bool, t0: float) -> Plan:
    """``plan()``'s search, its arguments checked (``t0``: when it was called)."""
    with Progress("plan(): candidates decided") as progress:
        progress.update(0, "the model's facts (parameters, FLOPs, blocks to checkpoint)")
        search = PlanSearch(make_model, make_optimizer, make_batch, limit, device=device, gpus=gpus, card=gpu,
                            host=host, techniques=techniques, alternatives=alternatives, loss=loss)
        progress.total, search.progress = len(search.candidates()), progress
        rows = search.run()
        timing_error = None
        if verify and any(r.fits for r in rows):
            progress.update(len(rows), "timing the fitting recipes' steps on this machine")
            timing_error = time_fitting(search)
            rows = search.ordered()  # measured costs, where there are, rank the fitting recipes
        choice = next((r for r in rows if r.fits and r.need is not None), None)
        verification = Verification(False, "not asked (verify=False)")
        if verify:
            progress.update(len(rows), "the chosen recipe's step, run for real")
            verification = verify_choice(search, choice, timing_error)
        progress.summary = (f"plan(): {len(rows)} candidates decided, {search.predictions} predictions, "
                            f"{time.perf_counter() - t0:.0f} s")
    facts = search.facts
    note = (f"model: {facts.parameters:,} parameters, batch {facts.batch_size}"
            + (f" ({search.rank_batch} per GPU)" if gpus > 1 else "")
            + f", {facts.forward_flops / 1e9:,.1f} GFLOP per forward; checkpointing: {facts.checkpoint_text}")
    assumptions = ((f"{gpu.name} (its data sheet's figures): " if named(gpu) else "")
                   + f"slowdown estimated at {gpu.fp32_tflops:g} TFLOP/s, memory {format_bytes(search.memory_bw)}/s, "
                   f"host copies {format_bytes(search.host_bw)}/s (AMP speed-up and communication not counted)")
    code = recipe_code(choice.candidate, search, device) if choice else "# nothing fits: see the table"
    result = Plan(limit, device, gpus, search.allowance, rows, choice, code, verification, search.predictions,
                  time.perf_counter() - t0, assumptions, note, {k: v[0] for k, v in search.optimizers.items()})
    result._make_model, result._make_batch, result._loss = search.make_real_model, make_batch, search.loss
    return result


# ``gpukit.plan`` is this function (gpukit imports it over its module's name): what it takes is spelled the same
# from either, ``gpukit.plan.Techniques(...)``, ``gpukit.plan.Host(...)``, ``gpukit.plan.DEFAULT_CARD``.
plan.Host, plan.Techniques, plan.DEFAULT_CARD = Host, Techniques, DEFAULT_CARD

__all__ = ["plan", "Plan", "Host", "Techniques", "DEFAULT_CARD",
           "Row", "Candidate", "Verification", "run_candidate", "recipe_code", "PRECISIONS",
           "STRATEGIES", "NUMERICS_NAMES", "NEEDS"]
