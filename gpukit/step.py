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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from ._torch import SUPPORTED_NODES, tree_map_only


@dataclass(frozen=True)
class Technique:
    """What a training step does differently from the plain float32 one."""

    name: str = "baseline"
    amp: torch.dtype | None = None   # autocast to this type (float16 also scales the loss with a GradScaler)
    accumulate: int = 1              # micro-batches per optimizer step
    checkpointed: bool = False       # keep segment boundaries only; recompute the rest in backward
    half: bool = False               # model.half(), BatchNorm back in float32 (``half_with_float_batchnorm``)
    offload: bool = False            # tensors saved for backward go to the host (save_on_cpu)
    cast: torch.dtype | None = None  # floating-point inputs cast to this type: a model whose weights are in it

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
    own = _own_checkpointing(model) if plan.kind == "blocks" else None
    if own is not None:
        with own:
            yield plan
        return
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


def own_checkpointing_methods(model: nn.Module) -> tuple[str, str, str, str] | None:
    """For a transformers model that checkpoints its layers itself (``supports_gradient_checkpointing``): the
    names of its methods ``(enable, disable, keyword of enable's options, is-on property)``, as the installed
    transformers spells them (``activation_checkpointing_*`` from 5.24, ``gradient_checkpointing_*`` before);
    else None."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return None
    for names in (("activation_checkpointing_enable", "activation_checkpointing_disable",
                   "activation_checkpointing_kwargs", "is_activation_checkpointing"),
                  ("gradient_checkpointing_enable", "gradient_checkpointing_disable", "gradient_checkpointing_kwargs",
                   "is_gradient_checkpointing")):
        if callable(getattr(model, names[0], None)) and callable(getattr(model, names[1], None)):
            return names
    return None


def _own_checkpointing(model: nn.Module):
    """For a transformers model (``own_checkpointing_methods``): a context that turns its own checkpointing on and
    back off, as its users write it; else None.

    Its own way matters: a transformers layer run through ``torch.utils.checkpoint`` by gpukit would update the
    model's key-value cache twice (forward and recomputation); the layer checkpointing itself leaves the cache
    out (transformers' ``GradientCheckpointingLayer``). A model whose checkpointing is already on is left as it
    is, and so is the hook that makes its input embeddings require gradients where turning it on added one."""
    names = own_checkpointing_methods(model)
    if names is None:
        return None
    enable, disable, kwargs, is_on = names

    @contextlib.contextmanager
    def turned_on():
        if getattr(model, is_on, False):
            yield
            return
        had_hook = hasattr(model, "_require_grads_hook")
        getattr(model, enable)(**{kwargs: {"use_reentrant": False}})
        try:
            yield
        finally:
            getattr(model, disable)()
            if not had_hook and hasattr(model, "_require_grads_hook"):
                model.disable_input_require_grads()

    return turned_on()


def half_with_float_batchnorm(model: nn.Module) -> nn.Module:
    """``model.half()``, with every BatchNorm put back in float32 (its running statistics overflow float16).
    Returns the model."""
    model.half()
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.float()
    return model


# -- batches of any structure: a tensor, tuples, lists, dicts, a transformers BatchEncoding, nested ----------------


def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """``batch`` with ``fn`` applied to every tensor in it, its structure kept: tuples (named ones too), lists
    and mappings are rebuilt as their own type (a transformers ``BatchEncoding`` stays one), anything else is
    kept as it is."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = {k: map_tensors(fn, v) for k, v in batch.items()}
        try:
            return type(batch)(items)
        except Exception:  # a mapping type that cannot be built from a dict
            return items
    if isinstance(batch, tuple):
        items = [map_tensors(fn, v) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    if isinstance(batch, list):
        return [map_tensors(fn, v) for v in batch]
    if type(batch) in SUPPORTED_NODES:  # another container registered with torch's pytree (a dataclass, say)
        return tree_map_only(torch.Tensor, fn, batch)
    return batch


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor in ``batch``, in order."""
    found: list[torch.Tensor] = []
    map_tensors(found.append, batch)
    return found


def batch_size(batch: Any) -> int:
    """The batch dimension: the first dimension, which every tensor of ``batch`` with one must share.

    Raises:
        ValueError: no tensor with a dimension, or tensors whose first dimensions differ (named by shape).
    """
    sized = [t for t in batch_tensors(batch) if t.dim() > 0]
    if not sized:
        raise ValueError("the batch holds no tensor with a batch dimension: return the batch's tensors "
                         "(a dict, a tuple, a transformers BatchEncoding...) from make_batch()")
    sizes = {int(t.shape[0]) for t in sized}
    if len(sizes) > 1:
        shapes = ", ".join(str(tuple(t.shape)) for t in sized)
        raise ValueError(f"the batch's tensors must share their first dimension, the batch; they have {shapes}")
    return sizes.pop()


def split_batch(batch: Any, k: int) -> list:
    """``batch`` cut into ``k`` micro-batches along the batch dimension (views, as ``Tensor.chunk`` makes them);
    tensors without one (scalars) go whole into each.

    Raises:
        ValueError: ``k`` does not divide the batch (``batch_size``'s errors too).
    """
    b = batch_size(batch)
    if b % k:
        raise ValueError(f"{k} micro-batches need a batch that divides by {k}; it has {b} samples")
    n = b // k
    return [map_tensors(lambda t: t[i * n:(i + 1) * n] if t.dim() > 0 else t, batch) for i in range(k)]


def first_samples(batch: Any, n: int) -> Any:
    """The first ``n`` samples of ``batch``, as copies (a view would keep the whole batch's storage alive)."""
    return map_tensors(lambda t: t[:n].clone() if t.dim() > 0 else t, batch)


def batch_device(batch: Any) -> torch.device:
    """The device of the batch's first tensor (the CPU for a batch without one)."""
    tensors = batch_tensors(batch)
    return tensors[0].device if tensors else torch.device("cpu")


def _forward(model: nn.Module, xs: Any, checkpointed: bool):
    if not checkpointed:
        return model(xs)
    with checkpointing(model) as plan:
        if plan.kind == "whole":
            return checkpoint(model, xs, use_reentrant=False)
        return model(xs)


def model_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The loss a model computes itself from a batch of keyword arguments, as a transformers model does with
    ``labels`` in the batch: ``model(**batch).loss``. Pass ``loss="model"`` for it."""
    return model(**batch).loss


def resolve_loss(loss: Callable[[nn.Module, Any], torch.Tensor] | str | None):
    """``None`` (cross-entropy of ``model(inputs)`` against ``targets``), ``"model"`` (``model_loss``) or a
    function ``loss(model, batch) -> scalar tensor``; returned as ``None`` or a function.

    Raises:
        ValueError: for anything else.
    """
    if loss is None or (callable(loss) and not isinstance(loss, (str, nn.Module))):
        return loss
    if loss == "model":
        return model_loss
    raise ValueError(f"loss={loss!r}: pass None (cross-entropy of model(inputs) against targets, for a batch "
                     "(inputs, targets)), 'model' (the model computes it: model(**batch).loss, as a transformers "
                     "model does) or a function loss(model, batch) that returns the loss, a scalar tensor")


def _user_loss(model: nn.Module, micro: Any, loss, checkpointed: bool) -> torch.Tensor:
    if not checkpointed:
        value = loss(model, micro)
    else:
        with checkpointing(model) as plan:
            value = (checkpoint(loss, model, micro, use_reentrant=False) if plan.kind == "whole"
                     else loss(model, micro))
    if not (isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()):
        raise TypeError(f"loss(model, batch) must return the loss, a scalar floating-point tensor; it returned "
                        f"{type(value).__name__}{'' if not isinstance(value, torch.Tensor) else tuple(value.shape)}")
    return value


def micro_loss(model: nn.Module, micro: Any, technique: Technique, loss=None) -> tuple[torch.Tensor, Any, Any]:
    """One micro-batch's forward and loss with the technique's mechanisms (half inputs, autocast, saved tensors
    on the host, checkpointing), divided by the number of micro-batches: ``(loss, the model's output or None,
    the micro-batch as the forward took it)``. ``loss``: None, for ``(inputs, targets)`` and cross-entropy, or a
    function from ``resolve_loss``. The caller keeps the output until backward has run, as a training loop does."""
    t = technique
    cast = torch.float16 if t.half else t.cast
    if loss is None:
        xs, ys = micro
        if cast is not None and xs.is_floating_point():
            xs = xs.to(cast)
        micro, device = (xs, ys), xs.device
    else:
        if cast is not None:
            micro = map_tensors(lambda v: v.to(cast) if v.is_floating_point() else v, micro)
        device = batch_device(micro)
    amp = torch.autocast(device.type, dtype=t.amp) if t.amp else contextlib.nullcontext()
    offload = (torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda") if t.offload
               else contextlib.nullcontext())
    with amp, offload:
        if loss is None:
            out = _forward(model, micro[0], t.checkpointed)
            value = F.cross_entropy(out.float().flatten(0, -2), micro[1].flatten())
        else:
            out, value = None, _user_loss(model, micro, loss, t.checkpointed)
        if t.accumulate > 1:
            value = value / t.accumulate  # the gradients of k micro-batches add up to the full batch's
    return value, out, micro


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
               technique: Technique = BASELINE, scaler: torch.amp.GradScaler | None = None,
               loss: Callable[[nn.Module, Any], torch.Tensor] | str | None = None) -> None:
    """One optimizer step on ``batch`` with the technique's mechanisms.

    With ``loss=None`` the batch is ``(inputs, targets)`` and the loss is cross-entropy over the last dimension
    of the model's output (classes, or a language model's vocabulary). ``loss="model"``: the model computes it
    from a batch of keyword arguments (``model(**batch).loss``, a transformers model with ``labels`` in the
    batch); a function ``loss(model, batch)`` returns it for a batch of any structure (dicts, tuples, a
    ``BatchEncoding``, nested). Accumulation then cuts every tensor of the batch along its first dimension.
    A float16 ``technique.amp`` needs ``scaler``, a ``torch.amp.GradScaler`` kept across steps
    (its scale adapts from step to step); other techniques need none. ``technique.half`` expects a model
    already made half (``half_with_float_batchnorm``); floating-point inputs are cast to float16 here, and to
    ``technique.cast`` for a model whose weights are in that type (``model.to(torch.bfloat16)``).
    Returns nothing: a returned loss would keep its memory alive (call ``loss.item()`` in your own loop).
    """
    t = technique
    if t.amp is torch.float16 and (scaler is None or not scaler.is_enabled()):
        raise ValueError("float16 autocast needs an enabled torch.amp.GradScaler: pass "
                         "scaler=torch.amp.GradScaler(device.type), kept across steps")
    from .bigmodel import OptimizerInBackward

    if isinstance(optimizer, OptimizerInBackward) and (t.accumulate > 1 or scaler is not None):
        raise ValueError("an optimizer stepped in backward (OptimizerInBackward) steps each parameter as soon as "
                         "its gradient is complete: it cannot wait for more micro-batches (accumulate > 1) or for "
                         "a GradScaler's check of every gradient; use accumulate=1 and no scaler")
    loss = resolve_loss(loss)
    parts = micro_batches(batch, t.accumulate, loss)
    optimizer.zero_grad(set_to_none=True)
    for micro in parts:
        micro = micro_backward(model, micro, t, scaler, loss)  # (as the forward took it: kept to the step's end)
    if scaler is not None:
        scaler.step(optimizer)  # a disabled scaler just steps
        scaler.update()
    else:
        optimizer.step()


def micro_batches(batch: Any, k: int, loss=None) -> list:
    """``batch`` cut into ``k`` micro-batches along its first dimension, as ``train_step`` cuts it: ``(inputs,
    targets)`` pairs where ``loss`` (resolved: ``resolve_loss``) is None, else the batch's own structure."""
    if loss is None:
        if not is_pair_batch(batch):
            raise TypeError(
                f"a step with loss=None takes a batch (inputs, targets) of two tensors, and this batch is "
                f"{_described(batch)}: pass loss='model' where the model computes its loss from the batch "
                "(model(**batch).loss, a transformers model given labels), or loss=a function(model, batch) that "
                "returns it: plan(..., loss='model'), and predict(..., step=lambda model, optimizer, batch: "
                "gpukit.step.train_step(model, optimizer, batch, loss='model'))")
        x, y = batch
        return list(zip(x.chunk(k), y.chunk(k)))
    return split_batch(batch, k)


def is_pair_batch(batch: Any) -> bool:
    """Whether ``batch`` is ``(inputs, targets)``, two tensors, as ``train_step`` takes it with ``loss=None``."""
    return isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)


def _described(batch: Any) -> str:
    """A batch's kind in a few words, for an error: 'a dict with keys input_ids, labels', 'a tuple of 3 items'."""
    if isinstance(batch, Mapping):
        return f"a {type(batch).__name__} with keys {', '.join(map(str, list(batch)[:6]))}"
    if isinstance(batch, (tuple, list)):
        kinds = ", ".join(type(v).__name__ for v in batch[:4])
        return f"a {type(batch).__name__} of {len(batch)} item(s) ({kinds}{', ...' if len(batch) > 4 else ''})"
    return f"a {type(batch).__name__}"


def micro_backward(model: nn.Module, micro: Any, technique: Technique, scaler=None, loss=None) -> Any:
    """One micro-batch's forward, loss and backward, as ``train_step`` runs each (``micro_loss``; the loss scaled
    by ``scaler`` where there is one); its gradients add up in ``.grad``. Returns the micro-batch as the forward
    took it (cast, for a half model)."""
    value, out, micro = micro_loss(model, micro, technique, loss)
    (scaler.scale(value) if scaler is not None else value).backward()
    return micro


__all__ = ["Technique", "BASELINE", "CheckpointPlan", "checkpoint_plan", "checkpointing",
           "half_with_float_batchnorm", "own_checkpointing_methods", "train_step", "micro_loss", "micro_batches",
           "micro_backward", "is_pair_batch", "model_loss", "resolve_loss", "map_tensors", "batch_tensors",
           "batch_size", "split_batch", "first_samples", "batch_device"]
