"""One candidate as a training step to predict: the batch sliced into micro-batches, saved tensors offloaded,
the model built in its precision, the optimizer step alone."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from .._torch import ScalerThatAlwaysSteps, active_fake_mode
from ..bigmodel import OptimizerInBackward
from ..counter import FAKE_LEDGER, round_up
from ..factories import fake_model, swappable_fakes
from ..step import batch_device, first_samples, half_with_float_batchnorm, train_step
from .candidates import Candidate
from .facts import LORA_RANK, lora_targets

# -- predicting one candidate ------------------------------------------------------------------------------------


def _slice_batch(make_batch, n: int, b: int):
    """``make_batch`` cut to its first ``n`` samples (copies: a view would keep the whole batch's storage)."""
    if n == b:
        return make_batch

    def make():
        return first_samples(make_batch(), n)

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


CHUNK_TOKENS = 1024  # the chunked loss's tokens per chunk: one sequence of 1,024 tokens' logits at a time


def candidate_loss(candidate: Candidate, loss):
    """The loss a candidate's step computes: the plan's, or for a chunked loss ``gpukit.losses``' of the same
    value (the plan's is then the model's own, ``model(**batch).loss``)."""
    if not candidate.chunked_loss:
        return loss
    from ..losses import chunked_causal_lm_loss

    return functools.partial(chunked_causal_lm_loss, chunk_tokens=CHUNK_TOKENS)


def _step_for(candidate: Candidate, accumulate: int, copies: list[int] | None = None, loss=None,
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
        with watch or contextlib.nullcontext(), _offload(copies) if candidate.offload else contextlib.nullcontext():
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


def optimizer_state_bytes(model: nn.Module, optimizer) -> int:
    """The optimizer's state as ``gpukit.estimate.state_bytes`` counts it (each storage once, rounded), less what
    it shares with the model (parameters, buffers, gradients)."""
    model_storages = {id(t.untyped_storage()) for t in [*model.parameters(), *model.buffers(),
                                                        *(p.grad for p in model.parameters() if p.grad is not None)]}
    storages = {id(st): st.nbytes() for st in (v.untyped_storage() for s in optimizer.state.values()
                                               for v in s.values()
                                               if torch.is_tensor(v) and v.layout is torch.strided)}
    return sum(round_up(n) for key, n in storages.items() if key not in model_storages)


def with_lora(model: nn.Module) -> nn.Module:
    """``model`` with LoRA adapters (``peft.get_peft_model``): its weights frozen, rank-``LORA_RANK`` adapters
    trained on ``lora_targets``."""
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK,
                                                      target_modules=lora_targets(model)))


def _model_maker(make_model, precision: str, fake: bool = True, lora: bool = False):
    """A candidate's model factory. ``fake``: called under fake tensors, where a model that already exists comes
    as a fake copy (``gpukit.factories.fake_model``), so that converting it never reaches the user's model
    (``make_model`` for a real step copies such a model: ``_Search.make_real_model``)."""

    def convert(model: nn.Module) -> nn.Module:
        with swappable_fakes(active_fake_mode()):  # (fake parameters: see gpukit.factories)
            if precision == "half":
                model = half_with_float_batchnorm(model)
            elif precision == "bf16 weights":
                model = model.to(torch.bfloat16)
        return with_lora(model) if lora else model

    if fake:
        return lambda: convert(fake_model(make_model))
    if precision not in ("half", "bf16 weights") and not lora:
        return make_model
    return lambda: convert(make_model())


def _optimizer_only(info: dict):
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
