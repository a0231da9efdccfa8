"""Optimizer state on the host: what a host-offloading optimizer leaves on the GPU, and the copies it costs a step.

    from torchao.optim import CPUOffloadOptimizer
    from gpukit.offload import predict_offload

    p = predict_offload(lambda: MyModel(), lambda params: CPUOffloadOptimizer(params, torch.optim.AdamW), make_batch)
    p.device_peak, p.host_state, p.copies      # bytes on the GPU, bytes on the host, a step's copies each way

torchao's ``CPUOffloadOptimizer`` (torchao/optim/cpu_offload.py) gives each parameter of at least ``minimal_size``
elements (4,096 by default) a copy of itself and of its gradient in pinned host memory, and an optimizer of its own
over them on the host (AdamW: fused, on the CPU). A hook on the parameter (``register_post_accumulate_grad_hook``)
copies its gradient to the host as soon as backward completes it, and frees the GPU's with ``offload_gradients=True``;
``step()`` steps each host optimizer, then copies the updated parameter back. Smaller parameters keep an optimizer
on the GPU. So the GPU holds the parameters, their gradients and the activations; the host, per offloaded
parameter, the parameter, its gradient and the optimizer state (four copies of it with AdamW); and every step
copies each offloaded gradient to the host and each offloaded parameter back.

``predict_offload`` runs the user's own step with the user's own optimizer on a simulated GPU: the model and the
batch on ``meta`` under ``FakeTensorMode`` (shapes, no memory), the host on the CPU, also fake. gpukit's counter
tells the two apart by the device each tensor shows (``gpukit.counter.FAKE_LEDGER``) and rounds each block as the
CUDA allocator does; ``gpukit.copies`` counts what crosses. Nothing is allocated and no copy happens, so it
predicts bytes, not time. The GPU side follows CUDA's code paths as ``predict(device="cuda")`` does
(``gpukit.cudarules``, for the card named or a Hopper GPU): an optimizer left to choose gets the foreach
implementation; the first matrix product of forward and of backward each allocate a cuBLAS workspace; dropout in
training keeps the fused kernel's bool mask (the host's tensors keep the CPU's noise tensor); and the
attention kernel is the card's. On ``meta`` PyTorch itself would always take the math composite
(``_fused_sdp_choice_meta``, aten/src/ATen/native/transformers/attention.cpp: the fused choice only for a tensor
with the CUDA key), which keeps the attention matrix a GPU's fused kernels do not; so where the card has a fused
kernel for the call, the simulated device runs the CPU's flash kernel, whose outputs (and the float32 logsumexp it
saves) are those of CUDA's flash kernel, as a CUDA prediction on the CPU does. With an optimizer that keeps
everything on the GPU, the GPU side is then ``predict(device="cuda")``'s step to the byte (tests/test_offload.py).
Fake CUDA tensors cannot stand for the GPU on a CPU-only PyTorch: autograd aborts the process on the first
``backward`` through one (its input metadata asks for a CUDA device guard).

What such an optimizer asks of CUDA itself is stood in by ``cuda_stand_ins()``, each named as the CPU stand-in it
is. On a GPU, use the optimizer as it is and measure with ``gpukit.measure("cuda")``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ._torch import FakeTensor, FakeTensorMode, TorchDispatchMode
from .allocator import CardMemory, WholeBlocks, follow, workspace_segments
from .amp import CardAmp
from .cudarules import SDPA, SM90, CudaRules, sdpa_backend, use_cuda_optimizer_defaults
from .counter import FAKE_LEDGER, ONE_PREDICTION, gc_paused, refuse_inside_a_fake_run
from .factories import (ReadValues, TensorsFromFakeLists, ValuesInStep, ValuesWhileBuilding, check_factories,
                        check_optimizer, fake_model, swappable_fakes)
from .report import format_bytes, html_table
from .step import map_tensors, train_step
from .traffic import Traffic, copies

SIMULATED_DEVICE = "meta"  # the simulated GPU (DESIGN: "a meta device for a second memory")

# Modules that ask "is there a GPU?" before they build their streams, by the name they hold the question under.
_DEVICE_PROBES = (("torchao.optim.cpu_offload", "get_available_devices"),)
_STANDING_IN = threading.RLock()
_DEPTH = [0]  # cuda_stand_ins() blocks open (on the thread holding _STANDING_IN): the outermost stands in


class _Event:
    """A CUDA event's stand-in: work on one CPU thread is done when the call that queued it returns."""

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    """A CUDA stream's stand-in: one CPU thread runs everything in order already, and a stream allocates nothing."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _Event:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _PlainHostMemory(TorchDispatchMode):
    """``pin_memory=True`` asked of a factory op, answered with plain host memory: without CUDA there is no pinned
    allocator, and the bytes are the same (which allocator rounds them, and how, is the difference)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs and kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def cuda_stand_ins():
    """Run an optimizer written for CUDA that keeps its state on the host (torchao's ``CPUOffloadOptimizer``) where
    there is no GPU: the CPU, or the simulated GPU of ``predict_offload``. Each stand-in, and why the bytes hold:

    * ``torch.cuda.Stream``, ``Event``, ``current_stream`` and ``stream(...)``: streams and events that order
      nothing. On a GPU they let the copies overlap the kernels; one CPU thread runs everything in order already.
    * ``Tensor.record_stream``: does nothing. On a GPU it holds a freed block back from reuse until the side
      stream is done with it, while the block already counts as freed: the CUDA allocator's ``free()`` takes its
      bytes off the allocated count before it records the events (c10/cuda/CUDACachingAllocator.cpp).
    * The question "which GPU is there?" of the modules in ``_DEVICE_PROBES`` (torchao asks it in its
      constructor, and refuses a machine without CUDA): answered "cuda".
    * ``pin_memory=True``: plain host memory of the same size.

    None of them allocates or copies. Time is what they cannot stand for. Use it on a machine without CUDA; it
    replaces ``torch.cuda``'s streams for every thread while it is open, one such block at a time. A block opened
    inside another (a step of ``plan()``'s recipe run inside yours) changes nothing: the outer one stands in.
    """
    with _STANDING_IN:
        if _DEPTH[0]:
            _DEPTH[0] += 1
            try:
                yield
            finally:
                _DEPTH[0] -= 1
            return
        cuda = torch.cuda
        saved = {name: getattr(cuda, name) for name in ("Stream", "Event", "current_stream", "stream")}
        probes = [(sys.modules[m], name, getattr(sys.modules[m], name)) for m, name in _DEVICE_PROBES
                  if m in sys.modules and hasattr(sys.modules[m], name)]
        stream = _Stream()
        cuda.Stream, cuda.Event = _Stream, _Event
        cuda.current_stream = lambda device=None: stream
        cuda.stream = lambda s=None: contextlib.nullcontext()
        torch.Tensor.record_stream = lambda self, s: None  # (torch.Tensor inherits torch._C.TensorBase's)
        for module, name, _ in probes:
            setattr(module, name, lambda: ["cpu", "cuda"])
        _DEPTH[0] = 1
        try:
            with _PlainHostMemory():
                yield
        finally:
            _DEPTH[0] = 0
            for name, value in saved.items():
                setattr(cuda, name, value)
            del torch.Tensor.record_stream
            for module, name, value in probes:
                setattr(module, name, value)


@contextlib.contextmanager
def _fused_on_the_simulated_device():
    """``fused=True`` on the simulated GPU: ``torch.optim`` checks a fused optimizer's parameters against the devices
    with fused kernels (torch/optim/optimizer.py, ``_device_dtype_check_for_fused``), and ``meta`` is not one. The
    fused op itself has a fake kernel (``torch._fused_adamw_``), which allocates nothing, as CUDA's kernel does not;
    its ``step`` counter is a float32 tensor on the parameter's device, as on a GPU."""
    from torch.optim import optimizer as module

    original = module._get_fused_kernels_supported_devices
    module._get_fused_kernels_supported_devices = lambda: [*original(), SIMULATED_DEVICE]
    try:
        yield
    finally:
        module._get_fused_kernels_supported_devices = original


class _CardAttentionOnTheSimulatedDevice(TorchFunctionMode):
    """``scaled_dot_product_attention`` on the simulated GPU as the card runs it. On ``meta`` PyTorch takes the math
    composite whatever the inputs (``_fused_sdp_choice_meta``: no CUDA key, math); where the card has a fused
    kernel for the call (``gpukit.cudarules.sdpa_backend``), the CPU's flash kernel runs instead, as PyTorch's
    composite calls it on a CPU (attention.cpp ``scaled_dot_product_attention``: a boolean mask made additive in
    the query's dtype first, ``convert_boolean_attn_mask``). ``CudaRules`` then sees that kernel as it does in a
    CUDA prediction (the memory-efficient kernel's padded logsumexp). Where the card takes the math kernel, or on
    any other device, the call goes on unchanged."""

    def __init__(self, capability: tuple[int, int]) -> None:
        super().__init__()
        self.capability = capability

    def __enter__(self):
        # Backward runs without the forward's torch-function modes (the engine does not carry them), so the forward
        # that checkpointing recomputes there would take the math composite on 'meta' and save other tensors than
        # the first forward did (torch.utils.checkpoint refuses that). The function itself, looked up by its name
        # at each call (torch.nn.functional.scaled_dot_product_attention, as transformers and most models call it),
        # takes the card's kernel too while the mode is open.
        self.named = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = functools.wraps(SDPA)(
            lambda *args, **kwargs: self.attention(SDPA, args, kwargs))
        try:
            return super().__enter__()
        except BaseException:
            F.scaled_dot_product_attention = self.named
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            F.scaled_dot_product_attention = self.named

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not SDPA:
            return func(*args, **kwargs)
        return self.attention(func, args, kwargs)

    def attention(self, func, args, kwargs):
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        given = dict(zip(names, args)) | {n: kwargs[n] for n in names if n in kwargs}
        query, key, value, mask = (given.get(n) for n in names[:4])
        if query.device.type != SIMULATED_DEVICE or sdpa_backend(query, key, value, mask is not None,
                                                                 self.capability) == "math":
            return func(*args, **kwargs)
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros_like(mask, dtype=query.dtype).masked_fill_(mask.logical_not(), float("-inf"))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, given.get("dropout_p", 0.0), given.get("is_causal", False), attn_mask=mask,
            scale=given.get("scale"))[0]


@contextlib.contextmanager
def card_kernels(capability: tuple[int, int]):
    """The card's own kernels for the simulated GPU on ``meta``, where PyTorch would take others: ``fused=True``
    optimizers, and the card's attention kernel instead of the math composite (which keeps the attention matrix
    the card's fused kernels do not). ``predict_offload`` and ``on_card(cuda, gpu="meta")`` run under it."""
    with _fused_on_the_simulated_device(), _CardAttentionOnTheSimulatedDevice(capability):
        yield


def _drop_parameter_hooks(model: nn.Module) -> None:
    """Take the post-accumulate-grad hooks off the prediction's own (fake) parameters. Such a hook is kept in C++
    (the parameter's autograd meta), where the garbage collector cannot see a cycle back to the parameter: torchao's
    ``CPUOffloadOptimizer`` registers hooks that hold the optimizer, which holds the parameters and their host
    copies, so without this they would outlive the prediction and sit in the next one's simulated device."""
    for param in model.parameters():
        hooks = param._post_accumulate_grad_hooks
        if hooks:
            hooks.clear()


def _cuda_defaults(optimizer: Any) -> None:
    """The foreach implementation where the optimizer (or torchao's on-device optimizer of the small parameters,
    ``d_opt``) left the choice to PyTorch, as CUDA parameters get it (``gpukit.cudarules``)."""
    from .bigmodel import OptimizerInBackward

    for opt in (optimizer, getattr(optimizer, "d_opt", None)):
        if isinstance(opt, (torch.optim.Optimizer, OptimizerInBackward)):
            use_cuda_optimizer_defaults(opt)


@dataclass
class OffloadPrediction:
    """One training step with memory on two sides, predicted on a simulated GPU: bytes on the device (rounded per
    block as the CUDA allocator rounds), bytes on the host (rounded the same way), and the copies between them."""

    device_state: int        # on the GPU when a step starts: parameters, gradients left, the batch, state kept there
    device_step_peak: int    # the step's peak on the GPU above that
    host_state: int          # on the host when a step starts
    host_step_peak: int      # the step's peak on the host above that
    combined_step_peak: int  # the step's peak of both together: where the two are one memory (a run on a CPU)
    copies: Traffic          # what one step copies each way
    parameters: int
    seconds: float = 0.0
    device: str = field(default="meta (simulated GPU)")
    card: str | None = None  # the card whose attention kernels it ran (gpukit.cards), None: a Hopper GPU's
    workspaces: int = 0      # cuBLAS/cuBLASLt workspaces on the GPU, included in device_state
    reserved_peak: int | None = None  # the GPU's reserved bytes at the step's peak (simulated caching allocator)
    attention_kernels: dict[str, int] = field(default_factory=dict)  # CUDA's kernel -> calls, per step run
    # Parts of the step not run as the card runs them (autocast, which meta tensors do not have), each with what was
    # done instead: gpukit.amp.
    unfollowed: dict[str, str] = field(default_factory=dict)
    # Values the step's own code read from fake tensors (loss.item()), made up as a healthy step's, by kind
    # (gpukit.factories.ValuesInStep); a truth value or an integer among them is named in ``unfollowed``.
    made_up: dict[str, int] = field(default_factory=dict)
    # What the card runs that the prediction could not follow (op -> why: cuDNN's workspaces, sized by the algorithm
    # cuDNN picks at run time; gpukit.cudarules): the GPU's peak may be higher
    unverified_ops: dict[str, str] = field(default_factory=dict)
    # What the simulated GPU's caching allocator was fed (gpukit.allocator), from the model's first tensor on;
    # allocator_events[step_events_from:] are the predicted step's
    allocator_events: list = field(default_factory=list, repr=False)
    step_events_from: int = field(default=0, repr=False)

    @property
    def device_peak(self) -> int:
        return self.device_state + self.device_step_peak

    @property
    def host_peak(self) -> int:
        return self.host_state + self.host_step_peak

    @property
    def lower_bound(self) -> bool:
        """True where the card runs something the prediction could not follow (``unverified_ops``): the GPU's peak
        may be higher."""
        return bool(self.unverified_ops)

    def _rows(self) -> list[tuple[str, str]]:
        c = self.copies
        return [("parameters", f"{self.parameters:,}"),
                ("device", f"{self.device}: fake tensors, nothing allocated, no copy made"),
                ("GPU when the step starts", format_bytes(self.device_state)),
                ("GPU peak", f"{format_bytes(self.device_peak)}  ({self.device_peak:,} B)"),
                ("host when the step starts", format_bytes(self.host_state)),
                ("host peak", f"{format_bytes(self.host_peak)}  ({self.host_peak:,} B)"),
                ("copied to the host per step", f"{format_bytes(c.device_to_host)} in {c.copies_to_host} copies"),
                ("copied to the GPU per step", f"{format_bytes(c.host_to_device)} in {c.copies_to_device} copies"),
                *[("NOT AS ON THE CARD", f"{what}: {why}") for what, why in self.unfollowed.items()],
                *([("LOWER BOUND: unchecked ops", ", ".join(self.unverified_ops))] if self.unverified_ops else []),
                ("prediction took", f"{self.seconds:.2f} s")]

    TITLE = "predicted training step, GPU and host (fake tensors, nothing allocated)"

    def __repr__(self) -> str:
        return "\n".join([self.TITLE] + [f"  {k:<30} {v}" for k, v in self._rows()])

    def _repr_html_(self) -> str:
        return f"<b>{self.TITLE}</b>{html_table(self._rows())}"


def predict_offload(make_model: Callable[[], nn.Module],
                    make_optimizer: Callable[[Any], Any],
                    make_batch: Callable[[], Any],
                    step: Callable[[nn.Module, Any, Any], Any] = train_step,
                    *, warmup_steps: int = 1, card: Any = None) -> OffloadPrediction:
    """Predict a step whose optimizer keeps state on the host: the GPU's bytes, the host's and the copies.

    The model is built on the CPU by ``make_model`` (as ``from_config`` builds it) and moved to the simulated GPU,
    as ``model.cuda()`` moves it; the batch is moved there too before the step, as a training loop moves it.
    Then ``make_optimizer`` builds the optimizer over the parameters on the GPU, and ``step`` runs, with
    ``cuda_stand_ins()`` in force, ``warmup_steps`` times and once more, measured.

    Args:
        make_model: builds the model, on the CPU.
        make_optimizer: builds the optimizer over the parameters it is given
            (``lambda p: CPUOffloadOptimizer(p, torch.optim.AdamW)``); any optimizer works.
        make_batch: builds one batch, on the CPU.
        step: runs one training step: ``step(model, optimizer, batch)`` (``gpukit.step.train_step`` by default).
        warmup_steps: steps before the measured one, so that gradients and optimizer state exist.
        card: the GPU (a ``gpukit.cards.Card`` or its name): the attention kernels its compute capability has;
            a Hopper GPU's by default, as ``predict(device="cuda")``.

    Returns:
        An ``OffloadPrediction``.

    Raises:
        TypeError: an object where a factory is expected.
        ValueError: an optimizer that already exists (``check_optimizer``).
    """
    check_factories(make_model, make_optimizer, make_batch)
    if card is not None:
        from .cards import Card, card as card_named

        card = card if isinstance(card, Card) else card_named(card)
    with ONE_PREDICTION:  # (another thread's prediction ends first: the fake ledger counts every thread)
        refuse_inside_a_fake_run("predict_offload()")
        return _offload_step(make_model, make_optimizer, make_batch, step, warmup_steps, card)


def _offload_step(make_model, make_optimizer, make_batch, step, warmup_steps: int, card) -> OffloadPrediction:
    """``predict_offload``'s prediction, its arguments checked (``card``: a ``Card`` or None)."""
    # the rules' dropout (the fused kernel's bool mask) is for the GPU's tensors; the host's run the CPU's
    rules = CudaRules(card.compute_capability if card is not None else SM90, gpu=SIMULATED_DEVICE)
    FAKE_LEDGER.settle()
    t0 = time.perf_counter()
    # The simulated caching allocator follows the simulated GPU's storages alone (the host's are another allocator's:
    # pinned or pageable host memory), from the model's first tensor on, as in predict().
    # The step's torch.autocast("cuda"), GradScaler and torch.cuda calls run as on the card, as far as meta tensors
    # allow (gpukit.amp).
    amp = CardAmp(SIMULATED_DEVICE, cuda=True, capability=rules.capability)
    with amp, gc_paused(full=True) as collect_young, FakeTensorMode(allow_non_fake_inputs=True) as mode, \
            cuda_stand_ins(), card_kernels(rules.capability), rules, TensorsFromFakeLists(), \
            follow(FAKE_LEDGER, only=SIMULATED_DEVICE, fresh=True) as simulated:
        mode.__deepcopy__ = lambda memo: mode  # copies stay in this mode (as in estimate.predict)
        amp.memory = CardMemory(simulated, rules.workspace_blocks)  # the step's memory reads: the GPU's side
        kept = [FAKE_LEDGER.start(label=SIMULATED_DEVICE), FAKE_LEDGER.start(label="cpu")]
        model = optimizer = batch = None
        try:
            values = ValuesWhileBuilding()
            model = fake_model(make_model, values)
            with swappable_fakes(mode):
                model.to(SIMULATED_DEVICE)
            with values:
                optimizer = make_optimizer(model.parameters())
            check_optimizer(optimizer)
            _cuda_defaults(optimizer)
            moved: dict[int, torch.Tensor] = {}  # one tensor twice in the batch (labels that are the ids): one copy

            def to_device(t: torch.Tensor) -> torch.Tensor:
                if id(t) not in moved:
                    moved[id(t)] = (t if isinstance(t, FakeTensor) else mode.from_tensor(t)).to(SIMULATED_DEVICE)
                return moved[id(t)]

            made = make_batch()
            batch = map_tensors(to_device, made)
            del made, moved
            step_values = ValuesInStep()  # what the step's own code reads from tensors (loss.item()): made up, named
            with ReadValues(step_values):
                for _ in range(warmup_steps):
                    step(model, optimizer, batch)
            collect_young()  # what the warm-up left is freed before the step, not inside it
            on_step = [FAKE_LEDGER.start(label=SIMULATED_DEVICE), FAKE_LEDGER.start(label="cpu"), FAKE_LEDGER.start()]
            device_state, host_state = kept[0].level, kept[1].level
            blocks = WholeBlocks(simulated)  # the GPU's figures as torch.cuda counts them: each block whole
            step_events_from = len(simulated.events)
            watch = simulated.watch()
            try:
                with copies() as traffic, ReadValues(step_values):
                    step(model, optimizer, batch)
            finally:
                for tally in reversed(on_step):
                    FAKE_LEDGER.stop(tally)
                reserved_peak = simulated.unwatch(watch)
            n_params = sum(p.numel() for p in model.parameters())
        finally:
            for tally in reversed(kept):
                FAKE_LEDGER.stop(tally)
            if model is not None:
                _drop_parameter_hooks(model)
        del model, optimizer, batch
        collect_young()
    device, host, both = on_step
    device_step_peak = device.peak
    if blocks.known():  # (as in estimate.predict; the host's memory is not the caching allocator's)
        device_state, device_step_peak = device_state + blocks.before_slack, blocks.step_peak()
    unfollowed = dict(amp.unfollowed)
    unfollowed.update(step_values.name(unfollowed))  # (no lower-bound flag here: an integer read is named beside them)
    workspaces = rules.workspaces()  # made by the warm-up's first matrix products, kept: part of the state
    # each workspace is a cudaMalloc'd block of its own (as in estimate.predict)
    reserved_peak += workspace_segments(rules.workspace_blocks())[1]
    return OffloadPrediction(device_state=device_state + workspaces, device_step_peak=device_step_peak,
                             host_state=host_state, host_step_peak=host.peak, combined_step_peak=both.peak,
                             copies=traffic, parameters=n_params, seconds=time.perf_counter() - t0,
                             card=card.key if card is not None else None, workspaces=workspaces,
                             reserved_peak=reserved_peak,
                             attention_kernels=dict(rules.sdpa), unfollowed=unfollowed,
                             made_up=dict(step_values.made_up), unverified_ops=dict(rules.unmodelled),
                             allocator_events=simulated.events,
                             step_events_from=step_events_from)


__all__ = ["card_kernels", "cuda_stand_ins", "predict_offload", "OffloadPrediction", "SIMULATED_DEVICE"]
