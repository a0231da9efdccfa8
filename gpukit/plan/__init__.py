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
  host's four copies of each offloaded weight bound the host's peak (over ``host_memory``: not predicted).
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
memory need is over the host's (``host_memory``, else Colab's 12.7 GB), after every one that is neither; then the
recipes that keep every update (AMP, accumulation, checkpointing, offload, another implementation), then those
that train the whole model otherwise (16-bit weights without a float32 copy, whose small updates are lost; another
optimizer), then those that train a different model (LoRA, QLoRA); within these, by cost, where costs within 5% are
one cost (the estimate resolves no finer) and PyTorch alone comes before a recipe that needs another library.

Time cost, relative to the plain float32 step of the same batch (estimated, from stated figures): a step does
3 forward passes' worth of arithmetic (the backward pass two); checkpointing recomputes the checkpointed
segments' forward (their FLOPs counted under fake tensors by ``torch.utils.flop_counter``); offload copies every
saved tensor to the host and back at ``host_bandwidth``; an optimizer with its state on the host copies each
offloaded gradient to the host after each micro-batch and each offloaded weight back at ``host_bandwidth``, and
steps on the host (a fused AdamW reads the weight, gradient and two moments of each element and writes three of
them back) at ``host_memory_bandwidth``; each extra micro-batch reads the weights twice more and adds into the
gradients at ``memory_bandwidth``; QLoRA dequantizes each 4-bit weight in every forward and backward, at
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

from ..estimate import CONTEXT_ALLOWANCE
from ..factories import check_factories
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
from .recipe import recipe_code
from .result import Plan
from .search import PlanSearch
from .verify import run_candidate, time_fitting, verify_choice


def plan(make_model: Callable[[], nn.Module], make_optimizer: Callable[[Any], torch.optim.Optimizer],
         make_batch: Callable[[], Any], budget: int | str | None = None, *, device: str = "cuda", gpus: int = 1,
         optimizers: dict[str, Callable] | None = None, implementations: bool = True,
         precisions: tuple[str, ...] = PRECISIONS, accumulate: list[int] | None = None, checkpointing: bool = True,
         offload: bool = True, strategies: tuple[str, ...] | None = None, allowance: int | str | None = None,
         tflops: float | None = None, memory_bandwidth: int | str | None = None, host_bandwidth: int | str = "16GB",
         alternatives: int = 2, verify: bool = True,
         loss: Callable[[nn.Module, Any], torch.Tensor] | str | None = None, lora: bool = True,
         card: str | None = None, host_memory: int | str | None = None,
         host_memory_bandwidth: int | str = "51.2GB") -> Plan:
    """The cheapest way to make one training step fit a memory budget (see the module's docstring).

    Args:
        make_model, make_optimizer, make_batch: as for ``gpukit.estimate.predict``; ``make_batch()`` returns
            the whole batch: ``(inputs, targets)``, or with ``loss`` any structure (a dict, a transformers
            ``BatchEncoding``, tuples, nested) whose tensors share their first dimension. A model that
            already exists (``lambda: model``) is predicted on fake copies and verified on a real copy
            (``copy.deepcopy``): it is never converted or stepped itself.
        budget: the GPU's memory, ``"24GB"`` (GB = 10^9 B), ``"80 GiB"`` or bytes; default: the card's (what
            torch reports where a public report is recorded, else its data sheet's), else ``"24GB"``.
        device: ``"cuda"`` (CUDA's code paths, reserved memory, the context allowance) or ``"cpu"``
            (allocated memory, what ``gpukit.budget`` caps on a CPU).
        gpus: GPUs sharing the batch; above 1 the candidates are DDP, ZeRO-1 and FSDP, per rank.
        optimizers: other optimizers you allow, ``{"SGD momentum": lambda p: torch.optim.SGD(p, 0.1, 0.9)}``.
        implementations: also try the optimizer's for-loop and fused steps (``foreach=False``, ``fused=True``),
            an Adam or AdamW with 8-bit moments (bitsandbytes' ``Adam8bit``, ``AdamW8bit``, where installed),
            the optimizer step fused into backward (``gpukit.bigmodel.OptimizerInBackward``: no accumulation, no
            GradScaler, one GPU), and for a CUDA plan on one GPU an Adam or AdamW with its state and step on the
            host (torchao's ``CPUOffloadOptimizer``, where installed; with ``offload_gradients=True`` too, then
            without accumulation; in float32 or bfloat16 weights, no autocast: the simulated GPU has no autocast
            kernels of its own). Its step is fused Adam(W) on the CPU: rounding-level, as ``fused=True``.
        precisions: of ``"float32"``, ``"bf16"``, ``"fp16"`` (autocast; float16 with a GradScaler), ``"half"``
            (``model.half()`` with BatchNorm in float32; only with optimizers without an eps, such as SGD: Adam's
            eps of 1e-8 is 0 in float16) and ``"bf16 weights"`` (``model.to(torch.bfloat16)``: weights, gradients
            and optimizer state in bfloat16, no float32 copy). The last two lose every update below 2^-11 (float16)
            or 2^-8 (bfloat16) of its weight: their numerics say "small updates lost", and they rank after every
            fitting recipe that keeps a float32 copy.
        accumulate: micro-batch counts to try (default: the powers of two that divide the batch per GPU).
        checkpointing, offload: try activation checkpointing (``gpukit.step.checkpoint_plan``), and saved tensors
            sent to the host (CUDA plans only: on a CPU the host is the device).
        strategies: with ``gpus > 1``, of ``"DDP"``, ``"ZeRO-1"``, ``"FSDP"`` (default all three).
        allowance: memory beyond PyTorch's (CUDA context, libraries): default ``CONTEXT_ALLOWANCE`` on CUDA, 0 on
            the CPU.
        tflops, memory_bandwidth, host_bandwidth: the figures the time cost is estimated with (per second):
            by default the card's float32 TFLOP/s and memory bandwidth (its data sheet's), else 100 TFLOP/s and
            2 TB/s; host copies 16 GB/s.
        host_memory: the host's memory for an optimizer state kept there (bytes, ``"12.7GB"``, ``"64 GiB"``); a
            candidate whose predicted host peak is above it does not fit, and its verdict says so. None: not
            limited, but a candidate whose host peak is above Colab's 12.7 GB ranks after every fitting one that is
            not, and its "ranking" cell says so.
        host_memory_bandwidth: the host's memory bandwidth, per second, for the optimizer step on the host;
            default 51.2 GB/s, two channels of DDR4-3200 (3,200 MT/s x 8 bytes = 25.6 GB/s a channel, JEDEC
            JESD79-4): a desktop's or a cloud VM's share; a server socket has 4 to 12 channels.
        card: the GPU, by name (``"t4"``, ``"A100 80GB"``, ``torch.cuda.get_device_name()``: ``gpukit.cards``).
            On a card without bfloat16 tensor cores (the T4), every bfloat16 recipe ranks after the float16 ones
            of the same cost, and its numerics say why; every prediction takes the attention kernels the card
            has (on a T4 bfloat16 attention runs the math kernel, whose attention matrix is counted).
        alternatives: fitting recipes to predict after the cheapest (for comparison; 0 is fastest).
        verify: run the chosen recipe's step once for real under ``gpukit.budget`` when it is small enough for
            this machine (and time each fitting candidate's step here).
        loss: how the step's loss is computed, as for ``gpukit.step.train_step``: ``None``, cross-entropy of
            ``model(inputs)`` against ``targets``; ``"model"``, the model computes it (``model(**batch).loss``: a
            transformers model with ``labels`` in the batch, no wrapper); or ``loss(model, batch)``. Accumulation
            cuts every tensor of the batch along its first dimension.
        lora: also try training LoRA adapters instead of the model (peft, where installed: rank 16 on every
            ``nn.Linear`` but the output layer, the weights frozen), and for a transformers model where bitsandbytes
            is installed QLoRA (those weights quantized to 4-bit NF4 as ``from_pretrained`` with
            ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16)`` does, ``prepare_model_for_kbit_training``, then the adapters).
            A different model is trained: such a recipe ranks after every one that trains the model itself, on one
            GPU only.

    Returns:
        A ``Plan``: its table (``frame()``, HTML in Jupyter), ``choice``, ``code`` and ``verification``.

    Raises:
        ValueError: for a budget, device, precision, strategy, accumulation or host memory that is not one (the
            message lists what is allowed), a batch that is not ``(inputs, targets)`` without ``loss`` (or whose
            tensors do not share a batch dimension), a ``loss`` that is none of the above, or an optimizer that
            already exists returned by ``make_optimizer`` (``gpukit.factories.check_optimizer``).
        TypeError: a model, optimizer or batch passed where the function that builds it is expected.
    """
    t0 = time.perf_counter()
    check_factories(make_model, make_optimizer, make_batch,
                    batch="lambda: (inputs, targets)" if loss is None else "lambda: batch")
    loss = resolve_loss(loss)
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r}: plan for 'cuda' (a GPU's code paths and reserved memory) or 'cpu'")
    gpu = None
    if card is not None:
        from ..cards import card as find_card

        gpu = find_card(card)
        if device != "cuda":
            raise ValueError(f"card={card!r} is a GPU: plan for it with device='cuda'")
    limit = parse_bytes(budget if budget is not None else
                        (gpu.torch_total_memory or gpu.memory_bytes) if gpu is not None else "24GB")
    tflops = tflops if tflops is not None else gpu.fp32_tflops if gpu is not None else 100.0
    memory_bandwidth = memory_bandwidth if memory_bandwidth is not None else \
        int(gpu.memory_bandwidth) if gpu is not None else "2TB"
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
    for name, value in (("memory_bandwidth", memory_bandwidth), ("host_bandwidth", host_bandwidth),
                        ("host_memory_bandwidth", host_memory_bandwidth)):
        speeds[name] = parse_bytes(value)
    if host_memory is not None:
        try:
            host_memory = parse_bytes(host_memory)
        except ValueError as err:
            raise ValueError(f"host_memory={host_memory!r}: the host's memory for optimizer state kept there, bytes "
                             f"or a size such as '12.7GB' or '64 GiB' (B, KB, MB, GB, KiB, MiB, GiB), or None (not "
                             f"limited); {err}") from None
    if not (isinstance(tflops, (int, float)) and tflops > 0):
        raise ValueError(f"tflops={tflops!r}: the GPU's arithmetic rate in TFLOP/s, a positive number")
    if not isinstance(lora, bool):
        raise ValueError(f"lora={lora!r}: True (also try LoRA adapters, where peft is installed) or False")
    if not isinstance(alternatives, int) or alternatives < 0:
        raise ValueError(f"alternatives={alternatives!r}: a whole number, 0 or more")
    search = PlanSearch(make_model, make_optimizer, make_batch, limit, device=device, gpus=gpus, optimizers=optimizers,
                        implementations=implementations, precisions=tuple(precisions), accumulate=accumulate,
                        checkpointing=checkpointing, offload=offload, strategies=strategies, allowance=allowance,
                        tflops=tflops * 1e12, memory_bandwidth=speeds["memory_bandwidth"], loss=loss,
                        host_bandwidth=speeds["host_bandwidth"], alternatives=alternatives, lora=lora,
                        slow_bf16=gpu is not None and not gpu.bf16_tensor_cores, card=gpu, host_memory=host_memory,
                        host_memory_bandwidth=speeds["host_memory_bandwidth"])
    rows = search.run()
    timing_error = None
    if verify and any(r.fits for r in rows):
        timing_error = time_fitting(search)
        rows = search.ordered()  # measured costs, where there are, rank the fitting recipes
    choice = next((r for r in rows if r.fits and r.need is not None), None)
    facts = search.facts
    note = (f"model: {facts.parameters:,} parameters, batch {facts.batch_size}"
            + (f" ({search.rank_batch} per GPU)" if gpus > 1 else "")
            + f", {facts.forward_flops / 1e9:,.1f} GFLOP per forward; checkpointing: {facts.checkpoint_text}")
    assumptions = ((f"{gpu.name} (its data sheet's figures): " if gpu is not None else "")
                   + f"slowdown estimated at {tflops:g} TFLOP/s, memory {format_bytes(speeds['memory_bandwidth'])}/s, "
                   f"host copies {format_bytes(speeds['host_bandwidth'])}/s (AMP speed-up and communication not "
                   "counted)")
    code = recipe_code(choice.candidate, search, device) if choice else "# nothing fits: see the table"
    verification = Verification(False, "not asked (verify=False)")
    if verify:
        verification = verify_choice(search, choice, timing_error)
    result = Plan(limit, device, gpus, allowance, rows, choice, code, verification, search.predictions,
                  time.perf_counter() - t0, assumptions, note, {k: v[0] for k, v in search.optimizers.items()})
    result._make_model, result._make_batch, result._loss = search.make_real_model, make_batch, search.loss
    return result


__all__ = ["plan", "Plan", "Row", "Candidate", "Verification", "run_candidate", "recipe_code", "PRECISIONS",
           "STRATEGIES", "NUMERICS_NAMES", "NEEDS"]
