"""One candidate as a training step to predict: the batch sliced into micro-batches, saved tensors offloaded,
the model built in its precision, the optimizer step alone."""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable

import torch
from torch import nn

from .._torch import ScalerThatAlwaysSteps, TorchDispatchMode, _disable_current_modes, active_fake_mode, in_backward
from ..bigmodel import OptimizerInBackward
from ..counter import FAKE_LEDGER, round_up, saved_tensors
from ..estimate import distinct_storages, state_bytes, storage_bytes
from ..hoststate import gpu_state_only
from ..factories import fake_model, quiet_import, swappable_fakes, valueless
from ..step import (batch_device, batch_tensors, first_samples, half_with_float_batchnorm, micro_backward,
                    micro_batches, train_step)
from .candidates import Candidate
from .facts import LORA_RANK, QUANTIZATION, import_bitsandbytes, lora_targets

# -- predicting one candidate ------------------------------------------------------------------------------------


def slice_batch(make_batch, n: int, b: int):
    """``make_batch`` cut to its first ``n`` samples (copies: a view would keep the whole batch's storage)."""
    if n == b:
        return make_batch

    def make():
        return first_samples(make_batch(), n)

    return make


@contextlib.contextmanager
def fake_save_on_cpu(counter: list[int] | None = None):
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


CHUNK_TOKENS = 1024  # the chunked loss's tokens per chunk: one sequence of 1,024 tokens' logits at a time


def candidate_loss(candidate: Candidate, loss):
    """The loss a candidate's step computes: the plan's, or for a chunked loss ``gpukit.losses``' of the same
    value (the plan's is then the model's own, ``model(**batch).loss``)."""
    if not candidate.chunked_loss:
        return loss
    from ..losses import chunked_causal_lm_loss

    return functools.partial(chunked_causal_lm_loss, chunk_tokens=CHUNK_TOKENS)


def step_for(candidate: Candidate, accumulate: int, copies: list[int] | None = None, loss=None,
              phases: dict | None = None):
    """The candidate's training step, as ``predict()`` runs it. ``phases``: filled by ``_Phases`` in the predicted
    step (what it allocated by the end of the forward and by the optimizer step, and the optimizer's state)."""
    technique = candidate.technique(accumulate)
    loss = candidate_loss(candidate, loss)
    state: dict = {}

    def step(model, optimizer, batch):
        if technique.amp is torch.float16 and "scaler" not in state:
            state["scaler"] = ScalerThatAlwaysSteps(batch_device(batch).type)  # made inside the fake run
        watch = _Phases(phases, model, optimizer, state.get("scaler")) if phases is not None and FAKE_LEDGER.tallies \
            else None  # (the warm-up step runs outside the ledger's block)
        offload = fake_save_on_cpu(copies) if candidate.offload else contextlib.nullcontext()
        with watch or contextlib.nullcontext(), offload:
            train_step(model, optimizer, batch, technique, state.get("scaler"),
                       loss=watch.loss(loss) if watch is not None and loss is not None else loss)

    return step


class _Phases:
    """Inside the predicted step (the fake ledger's innermost block open): the step's allocated peak above its
    start by the end of the first forward (the loss returned, else the model's output) into ``phases["forward"]``,
    by the optimizer step (the GradScaler's, or the optimizer's own) into ``phases["backward"]``; the optimizer's
    state as the prediction counts it into ``phases["state"]``, and whether every trained parameter has a
    gradient from the warm-up into ``phases["every_grad"]`` (their state then exists for every one of them).

    Nothing is allocated: the ledger's books are read where they stand (``settle`` books what it queued, in
    order). Before the optimizer step, the step of any optimizer not stepped in backward allocates the same,
    but for the optimizer's state (the same model, batch and techniques; zero_grad frees every gradient); before
    the first backward, an optimizer stepped in backward too."""

    def __init__(self, phases: dict, model: nn.Module, optimizer, scaler) -> None:
        self.phases, self.model, self.tally = phases, model, FAKE_LEDGER.tallies[-1]
        self.owners = [o for o in (scaler, optimizer) if o is not None]
        self.lost = False  # the loss has returned once (a checkpointed whole model computes it again in backward)
        phases.clear()
        phases["state"] = optimizer_state_bytes(model, optimizer)
        phases["every_grad"] = all(p.grad is not None for p in model.parameters() if p.requires_grad)
        # The gradients the step starts with (zero_grad frees them first): an optimizer that frees each gradient in
        # backward starts without them (gpukit.plan.bounds' phase bound of the forward takes them out).
        phases["grads"] = storage_bytes(p.grad for p in model.parameters() if p.grad is not None)

    def peak(self) -> int:
        FAKE_LEDGER.settle()
        return self.tally.peak

    def loss(self, loss):
        def measured(*args, **kwargs):
            value = loss(*args, **kwargs)
            if not self.lost:
                self.lost = True
                self.phases["forward"] = self.peak()
            return value

        return measured

    def __enter__(self):
        def output(*_):
            self.phases.setdefault("forward", self.peak())

        def stepping(owner):
            step = owner.step

            def first(*args, **kwargs):
                self.phases.setdefault("backward", self.peak())
                return step(*args, **kwargs)

            return first

        self.hook = self.model.register_forward_hook(output)
        self.own = [owner.__dict__.get("step") for owner in self.owners]
        for owner in self.owners:
            owner.step = stepping(owner)
        return self

    def __exit__(self, *exc):
        self.hook.remove()
        for owner, own in zip(self.owners, self.own):
            if own is None:
                del owner.step  # the class's own again
            else:
                owner.step = own
        return False


class _Stop(Exception):
    """Ends a prefix of a step (``prefix_step``) where its bound is known."""


def prefix_step(candidate: Candidate, accumulate: int, loss, found: dict, enough: Callable[[int, bool], bool],
                 last_only: bool = True):
    """The candidate's step as ``step_for`` runs it, up to its optimizer step (the GradScaler's), never into it,
    for ``predict(..., warmup_steps=0)`` with an optimizer that has no state: a bound of the step's need before its
    optimizer step, for any optimizer, at a fraction of a prediction's cost (no warm-up step, no optimizer step,
    and it stops where ``enough(allocated, forward)`` says so: the allocated bytes so far, at the end of the
    first forward or later, never in backward).

    Into ``found``, in bytes: "base", what the step starts with (parameters, buffers, the batch: rounded storages,
    as ``state_bytes``); the step's allocated peak above its start by the end of its first forward (its loss
    returned, else the model's output) into "forward", and by where it stopped into "backward"; "residual", what
    the step made that outlives it (a cache a module keeps), gradients aside: a real step finds it made by its
    warm-up and does not count it; and, where it got to the optimizer step, whether every trained parameter has a
    gradient ("every_grad": then every optimizer has state for each, as its floor does). Once ``predict`` has
    returned, ``prefix_residual(found)`` gives "residual". Stopped before backward, neither offloaded nor
    checkpointed: "saved", ``saved_bytes`` of the output where it stopped (its first forward's saved tensors, or
    those so far: a lower bound of what the configuration with offload copies, over two).

    Micro-batches (``accumulate`` > 1), with ``last_only``: only the last one runs, as it runs in the step; the
    gradients the earlier ones leave are made at the end of its forward (``_earlier_gradients``) and counted from
    its start. The earlier micro-batches allocate what it allocates but those gradients, which it has all along,
    so its peak is the step's (what the first one makes after its forward and keeps, a GradScaler's scale, is made
    later here: the bound leaves it out anyway, as the warm-up's); "forward" is its forward's peak without them,
    the first micro-batch's. Where the gradients it computes show that the ones made are not the first
    micro-batch's (two in one storage, a sparse one), "shared" says why, and the bound needs ``last_only=False``:
    every micro-batch run (a model with sparse embeddings runs them all from the start).

    Without the warm-up the step has no gradients to free first (``zero_grad``) and no optimizer state: the same
    model, batch and techniques allocate the same, so the predicted step's allocated peak is at least "base" +
    a phase - "residual" + the optimizer's state (+ the CUDA workspaces, left out), and its need at least that."""
    technique = candidate.technique(accumulate)
    loss = candidate_loss(candidate, loss)
    last_only = last_only and accumulate > 1

    def step(model, optimizer, batch):
        tally = FAKE_LEDGER.tallies[-1]
        found["base"] = state_bytes(model, optimizer, batch)[0]
        scaler = ScalerThatAlwaysSteps(batch_device(batch).type) if technique.amp is torch.float16 else None
        calls = {"output": 0, "loss": 0}
        first = [True]  # in the first forward (no backward has begun)
        earlier = [0]  # bytes of the gradients the earlier micro-batches leave (``alone``)
        handles: list = []
        # (a sparse gradient, nn.Embedding(sparse=True)'s, is not the dense one made for it)
        alone = last_only and not any(getattr(m, "sparse", False) is True for m in model.modules()
                                      if isinstance(m, (nn.Embedding, nn.EmbeddingBag)))

        def reached(end_of_forward: bool = False, owner_step: bool = False, output=None) -> None:
            if in_backward():
                # A module's forward run again in backward (checkpointing's recompute, the chunked loss's head):
                # never stopped there, where the step's graph may still be held (it would count as what the step
                # leaves); the optimizer step reads the backward's peak.
                return
            FAKE_LEDGER.settle()
            if first[0]:
                found["forward"] = tally.peak
                first[0] = not end_of_forward
                if end_of_forward and alone:
                    # The first micro-batch's forward ends here (its test: over the budget, or hopeless); then the
                    # last one's, which had the earlier ones' gradients from its start (over the budget only).
                    if enough(found["base"] + tally.peak, True):
                        found["backward"] = tally.peak
                        stopped(output)
                    earlier[0], at_least = _earlier_gradients(model, output, found, handles)
                    # Until backward has shown how they come (two in one storage?), they count for their elements
                    # alone: whatever storages hold them, no fewer bytes.
                    found["backward"] = found["forward"] + at_least
                    if enough(found["base"] + found["backward"], False):
                        stopped(output)
                    return
            found["backward"] = max(tally.peak, found["forward"] + earlier[0])
            if owner_step:
                found["every_grad"] = all(p.grad is not None for p in model.parameters() if p.requires_grad)
                raise _Stop
            if enough(found["base"] + found["backward"], end_of_forward):
                stopped(output)

        def stopped(output) -> None:
            if not (candidate.offload or candidate.checkpointed) and output is not None:
                found["saved"] = saved_bytes(output)  # (read last: see saved_bytes)
            raise _Stop

        def counted(what: str) -> bool:
            calls[what] += 1
            return calls[what] == 1  # the first forward's (a later output is the next micro-batch's, or backward's)

        def measured(*args, **kwargs):
            value = loss(*args, **kwargs)
            reached(counted("loss"), output=value)
            return value

        def stop(*args, **kwargs):
            reached(owner_step=True)

        for owner in (scaler, optimizer):
            if owner is not None:
                owner.step = stop
        # Where the bytes so far are read, besides the ends of forwards: after each module's forward (hooks that
        # allocate nothing). Not in backward (``reached``): a step stopped there leaves its graph held until the
        # prediction ends, and it would count as what outlives the step.
        hooks = [m.register_forward_hook(lambda module, args, output: reached(output=output))
                 for m in model.modules() if m is not model]
        # The first forward ends with its loss (train_step's own after the model's output, where loss is None).
        hooks.append(model.register_forward_hook(
            lambda module, args, output: reached(counted("output") and loss is None, output=output)))
        user_loss = measured if loss is not None else None
        try:
            with fake_save_on_cpu() if candidate.offload else contextlib.nullcontext():  # as step_for's
                if alone:  # train_step's own parts, its last micro-batch alone
                    parts = micro_batches(batch, accumulate, user_loss)
                    optimizer.zero_grad(set_to_none=True)
                    kept = micro_backward(model, parts[-1], technique, scaler, user_loss)  # noqa: F841 (as train_step)
                    if scaler is not None:
                        scaler.step(optimizer)
                    else:
                        optimizer.step()
                else:
                    train_step(model, optimizer, batch, technique, scaler, loss=user_loss)
        except _Stop:
            pass
        finally:
            for hook in hooks + handles:
                hook.remove()
        # What outlives the step (read once predict has stopped its tally, after its role tracker has let go of
        # the graph of a step stopped in its forward): the scaler is kept for it, as a real step's is kept.
        found["tally"], found["scaler"] = tally, scaler
        found["grads"] = storage_bytes(p.grad for p in model.parameters() if p.grad is not None)

    return step


def _earlier_gradients(model: nn.Module, output, found: dict, handles: list) -> tuple[int, int]:
    """At the end of the last micro-batch's forward, run alone (``prefix_step``): the gradients the earlier
    micro-batches would have left, made now, and their bytes. A micro-batch gives a gradient to each trained
    parameter its graph reaches (an ``AccumulateGrad`` node); the first one's becomes ``.grad`` (taken over, or
    copied in the parameter's layout: torch/csrc/autograd/functions/accumulate_grad.h), later ones add into it
    in place, so a dense gradient of the parameter's layout (``zeros_like``) is what the first left, unless
    two parameters' gradients come in one storage (both taken over: one storage where these are two) or a
    gradient is sparse: each gradient the micro-batch computes is looked at, and such a case is named in
    ``found["shared"]``. Before the end of the forward they were already there: the caller adds their bytes to
    the forward's peak. Returns their bytes (rounded storages), and their elements' bytes: what they take at
    least in any storages, before backward has shown how they come (a backward that gave two parameters the
    same memory as gradients, each adding into the other's, aside)."""
    reached: set[int] = set()
    seen: set[int] = set()
    keep, stack = [], [t.grad_fn for t in batch_tensors(output) if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)  # (ids stay unique during the walk)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            reached.add(id(variable))
        stack.extend(fn for fn, _ in node.next_functions)
    del keep
    storages: dict[int, weakref.ref] = {}

    def look(grad):
        if grad.layout is not torch.strided:
            found.setdefault("shared", "a sparse gradient")
            return
        st = grad.untyped_storage()
        ref = storages.get(id(st))
        if ref is not None and ref() is st:
            found.setdefault("shared", "two parameters' gradients in one storage")
        storages[id(st)] = weakref.ref(st)

    made = []
    for p in model.parameters():
        if p.requires_grad and p.grad is None and id(p) in reached:
            p.grad = torch.zeros_like(p)
            made.append(p.grad)
            handles.append(p.register_hook(look))
    return storage_bytes(made), sum(g.numel() * g.element_size() for g in made)


def saved_bytes(output) -> int:
    """Bytes of the tensors the autograd graph of ``output`` (a tensor, or any structure of them) saved for
    backward, each saved tensor once per saving, as a saved-tensor hook sees them (``save_on_cpu`` copies each
    to the host and back: twice these bytes), 0-dimensional ones aside (a Python number an op saves is one, and
    the hooks never see it): at most what such a hook sees in the same forward. Read from the graph
    (``_saved_*``), which unpacks them: a saved-tensor hook of the model's own (its checkpointing) would run its
    unpacking, which can recompute and allocate; read it where the step ends."""
    roots = [t.grad_fn for t in batch_tensors(output) if t.grad_fn is not None]
    return sum(t.numel() * t.element_size() for t in saved_tensors(roots) if t.dim() > 0)


def prefix_residual(found: dict) -> int:
    """After ``predict`` has run a ``prefix_step``: what the step made that was still allocated when the prediction
    stopped counting (its tally's level then), but its gradients: a cache a module or a library keeps, the
    GradScaler's scale. A real step finds them made by its warm-up step and does not count them."""
    tally = found.pop("tally")
    found.pop("scaler", None)
    return max(tally.level - found["grads"], 0)


def optimizer_state_bytes(model: nn.Module, optimizer) -> int:
    """The optimizer's state as ``gpukit.estimate.state_bytes`` counts it (each storage once, rounded; for CUDA,
    less what it keeps on the host), less what it shares with the model (parameters, buffers, gradients)."""
    model_storages = {id(t.untyped_storage()) for t in [*model.parameters(), *model.buffers(),
                                                        *(p.grad for p in model.parameters() if p.grad is not None)]}
    storages = distinct_storages(gpu_state_only(v for s in optimizer.state.values() for v in s.values()
                                                if torch.is_tensor(v)))
    return sum(round_up(n) for key, n in storages.items() if key not in model_storages)


def with_lora(model: nn.Module) -> nn.Module:
    """``model`` with LoRA adapters (``peft.get_peft_model``): its weights frozen, rank-``LORA_RANK`` adapters
    trained on ``lora_targets``. peft is imported outside any fake mode: tensors it makes when imported (default
    arguments of its LoHa layers) stay real, and no fake storage lives on in its modules, which would make every
    later prediction collect all garbage first."""
    with quiet_import():
        import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK,
                                                      target_modules=lora_targets(model)))


# bitsandbytes ops whose fake kernels were checked against the real kernels' source, where FakeKernelCheck cannot
# run them (their packed uint8 weights are integer inputs of unknown value): dequantize_4bit's fake kernel returns
# torch.empty(shape, dtype), which is what its CPU kernel (bitsandbytes/backends/cpu/ops.py, for an even last
# dimension and blocks under 2,048) and its CUDA kernel (backends/cuda/ops.py) allocate, nothing else.
CHECKED_BY_SOURCE = frozenset({"bitsandbytes.dequantize_4bit.default"})


class _Dequantized(TorchDispatchMode):
    """Inside a quantized layer's forward on fake tensors: bitsandbytes' ``gemm_4bit`` computed as its default
    kernel computes it (backends/default/ops.py ``_gemm_4bit_default_impl``: the weight dequantized to the input's
    dtype, then ``F.linear``), which is what runs on a CPU (no CPU kernel of its own) and on CUDA above 1,536 rows
    (backends/cuda/ops.py ``_dequant_linear_fallback``: the same two steps). Its fake kernel allocates the output
    alone, as if the dequantized weight were never made."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.bitsandbytes.gemm_4bit.default:
            from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl

            return _gemm_4bit_default_impl(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def quantize_4bit(model: nn.Module) -> nn.Module:
    """The model's ``nn.Linear`` layers as ``from_pretrained(..., quantization_config=BitsAndBytesConfig(
    load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16))`` makes them: replaced
    by ``bitsandbytes.nn.Linear4bit`` by transformers' own ``replace_with_bnb_linear`` (all but the modules
    ``get_keys_to_not_convert`` keeps, the output layer), each weight quantized as transformers' ``Bnb4bitQuantize``
    does it (``Params4bit(weight, requires_grad=False, **the new weight's settings).to(device)``), in place.

    Under fake tensors (a prediction), ``Params4bit`` cannot wrap a fake tensor (``Tensor._make_subclass`` refuses
    a tensor that is already a subclass): the weight is quantized by the function ``Params4bit`` calls,
    ``bitsandbytes.functional.quantize_4bit``, with the same settings (its fake kernel gives the packed uint8
    weight, (n + 1) // 2 bytes, and the absmax's shapes), and held in a plain frozen parameter carrying the same
    attributes and quantization state, which ``Linear4bit.forward`` reads; each layer's forward computes its product
    as bitsandbytes' kernels on a CPU do (``_Dequantized``). On a simulated GPU the cache is then emptied, as peft's
    ``prepare_model_for_kbit_training`` does on a real one (``torch.cuda.empty_cache()``, auto_clear_cache=True)."""
    bnb = import_bitsandbytes()
    with _disable_current_modes():  # (the modules are made on the meta device, Params4bit around real meta tensors)
        from transformers import BitsAndBytesConfig
        from transformers.integrations.bitsandbytes import replace_with_bnb_linear
        from transformers.quantizers.base import get_keys_to_not_convert

        linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
        replace_with_bnb_linear(model, modules_to_not_convert=get_keys_to_not_convert(model),
                                quantization_config=BitsAndBytesConfig(**QUANTIZATION))
    fake = active_fake_mode() is not None
    for name, old in linears.items():
        new = model.get_submodule(name)
        if new is old:
            continue  # kept as it is (the output layer)
        settings = dict(new.weight.__dict__)
        if fake:
            packed, state = bnb.functional.quantize_4bit(
                old.weight.data.contiguous(), blocksize=settings["blocksize"],
                compress_statistics=settings["compress_statistics"], quant_type=settings["quant_type"],
                quant_storage=settings["quant_storage"])
            weight = nn.Parameter(packed, requires_grad=False)
            weight.__dict__.update(settings, quant_state=state, bnb_quantized=True, module=new)
            new.weight, new.quant_state = weight, state

            def forward(x, forward=new.forward):
                with _Dequantized():
                    return forward(x)

            new.forward = forward
        else:
            new.weight = bnb.nn.Params4bit(old.weight.data, requires_grad=False, **settings).to(old.weight.device)
        if old.bias is not None:
            new.bias = old.bias
    linears = old = None  # (the float32 weights are garbage now)
    listener = FAKE_LEDGER.listener if fake else None
    if listener is not None:  # the float32 weights are garbage now: their blocks go back, as CUDA's would
        FAKE_LEDGER.settle()
        listener.allocator.empty_cache()
    return model


def with_qlora(model: nn.Module) -> nn.Module:
    """``model`` as QLoRA trains it: its Linear layers' weights in 4-bit NF4 (``quantize_4bit``), prepared by
    peft's ``prepare_model_for_kbit_training`` (every parameter frozen, 16-bit ones made float32; its gradient
    checkpointing left to the candidate), then LoRA adapters (``with_lora``)."""
    with quiet_import():
        import peft

    model = peft.prepare_model_for_kbit_training(quantize_4bit(model), use_gradient_checkpointing=False)
    return with_lora(model)


def model_maker(make_model, precision: str, fake: bool = True, lora: bool = False, qlora: bool = False):
    """A candidate's model factory. ``fake``: called under fake tensors, where a model that already exists comes
    as a fake copy (``gpukit.factories.fake_model``), so that converting it never reaches the user's model
    (``make_model`` for a real step copies such a model: ``PlanSearch.make_real_model``)."""

    def convert(model: nn.Module) -> nn.Module:
        with swappable_fakes(active_fake_mode()):  # (fake parameters: see gpukit.factories)
            if precision == "half":
                model = half_with_float_batchnorm(model)
            elif precision == "bf16 weights":
                model = model.to(torch.bfloat16)
            if qlora:
                return with_qlora(model)
            return with_lora(model) if lora else model  # (peft moves what it adds: nn.Module._apply)

    if fake:
        return lambda: convert(fake_model(make_model))
    if precision not in ("half", "bf16 weights") and not lora:
        return make_model
    return lambda: convert(make_model())


@functools.cache
def _only_writes(func) -> bool:
    """Whether ``func`` only writes into the tensors it is given (the arithmetic of an update: ``add_``,
    ``_foreach_addcdiv_``, bitsandbytes' 8-bit update): mutable, returning nothing or its first argument, neither
    an ``out=`` variant nor an op that changes a tensor's sizes or strides in place (``resize_``, ``set_``, ``t_``:
    torch.Tag.inplace_view)."""
    schema = func._schema
    if not schema.is_mutable or torch.Tag.inplace_view in func.tags or schema.overload_name.startswith("out"):
        return False
    if schema.name.split("::")[-1] in ("resize_", "resize_as_", "set_", "as_strided_", "swap_"):
        return False
    returns = schema.returns
    return not returns or (len(returns) == 1 and returns[0].alias_info is not None and bool(schema.arguments)
                           and schema.arguments[0].alias_info is not None
                           and schema.arguments[0].alias_info.is_write
                           and returns[0].alias_info.before_set == schema.arguments[0].alias_info.before_set)


class StateAlone(TorchDispatchMode):
    """Inside an optimizer step on fake tensors whose state alone is read (``Bounds.state_info``): an op that only
    writes into tensors it is given (``_only_writes``) allocates nothing and changes no size, and where those are
    fake tensors too big to hold a value (a step counter does: Adam divides by ``1 - beta1 ** step``) it changes
    nothing: it is not run. The state is made by the step's other ops (``zeros_like`` in ``_init_group``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if args and _only_writes(func):
            written = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            if written and all(valueless(t) for t in written):
                return args[0] if func._schema.returns else None
        return func(*args, **(kwargs or {}))


def optimizer_only_step(info: dict):
    """A step without forward or backward: gradients appear as zeros, then the optimizer steps. Its peak is a
    lower bound of every real step with this model and optimizer (the same state, the same optimizer step)."""

    def step(model, optimizer, batch):
        optimizer.zero_grad(set_to_none=True)
        if isinstance(optimizer, OptimizerInBackward):  # one gradient at a time, as its hooks step them
            for p, one in optimizer.optimizers.items():
                p.grad = torch.zeros_like(p)
                one.step()
                one.zero_grad(set_to_none=True)
        else:
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            optimizer.step()
        info["params"] = sum(round_up(p.untyped_storage().nbytes()) for p in model.parameters())
        info["grads"] = sum(round_up(p.grad.untyped_storage().nbytes()) for p in model.parameters()
                            if p.grad is not None)
        info["optimizer_state"] = sum(round_up(v.untyped_storage().nbytes()) for s in optimizer.state.values()
                                      for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
        info["state"] = optimizer_state_bytes(model, optimizer)  # all of it, as a prediction counts it

    return step


@contextlib.contextmanager
def state_by_foreach(optimizer):
    """A for-loop step's state, made by the foreach step: the state is made by the optimizer's ``_init_group``,
    which both implementations call alike (torch/optim/adam.py: only ``fused`` and ``capturable`` change where
    ``step`` lives), and the foreach step dispatches a few ops over all parameters where the for-loop one
    dispatches each per parameter (``gpukit.estimate._foreach_warmup`` makes a warm-up so). Only the state is
    read from such a step (``gpukit.plan.bounds.Bounds.state_info``), never its peak."""
    optimizers = list(getattr(optimizer, "optimizers", {}).values()) or [optimizer]  # stepped in backward: one each
    changed = [(g, g["foreach"]) for opt in optimizers for g in getattr(opt, "param_groups", [])
               if "foreach" in g and not g["foreach"] and not g.get("fused") and not g.get("differentiable", False)]
    for g, _ in changed:
        g["foreach"] = True
    try:
        yield
    finally:
        for g, was in changed:
            g["foreach"] = was


def stateless(params) -> torch.optim.Optimizer:
    """The optimizer of a prefix run (``gpukit.plan.bounds.Bounds.prefix``): never stepped, it has no state."""
    return torch.optim.SGD(params, lr=0.1)
