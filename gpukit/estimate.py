"""Predict memory before running: the rule of thumb, and an exact prediction under fake tensors.

    from gpukit.estimate import predict, rule_of_thumb

    p = predict(lambda: MyModel(), lambda params: torch.optim.Adam(params),
                lambda: (torch.randn(64, 3, 224, 224), torch.randint(0, 1000, (64,))))
    p.peak            # bytes a training step would need at its peak, allocating nothing
    p.will_it_fit()   # against common GPU sizes

``predict`` builds the model, optimizer and batch under ``FakeTensorMode``: tensors
with shapes, dtypes and storages but no memory behind them. It runs real training
steps of that model (the same code a user would run) and counts every storage with
the same counter that measures real runs on CPU (gpukit.counter), so a prediction
and a measurement agree to the byte where the code paths agree. Fake kernels that are
not the real ones' own shape logic are checked against the real CPU kernels, and a step
that would fail raises its real error (gpukit.fakecheck); ``device="cuda"`` applies
CUDA's code paths (gpukit.cudarules), and its figures count blocks as torch.cuda does, from
the simulated caching allocator that follows the step (gpukit.allocator).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ._torch import FakeTensor, FakeTensorMode
from .allocator import CONTEXT_ALLOWANCE, CardMemory, WholeBlocks, follow, workspace_segments
from .amp import CardAmp
from .counter import FAKE_LEDGER, ONE_PREDICTION, gc_paused, refuse_inside_a_fake_run, round_up
from .cudadevice import CudaDevices
from .cudarules import TORCH_RULES_VERSION, CudaRules, use_cuda_optimizer_defaults
from .hoststate import gpu_state_only, ran_capturable_off
from .factories import (TensorsFromFakeLists, ValuesInStep, ValuesWhileBuilding, check_factories, check_factory,
                        check_model_factory, check_optimizer, fake_model, short_repr)
from .fakecheck import FakeKernelCheck
from .report import format_bytes, html_table
from .roles import RoleTracker
from .step import batch_tensors, map_tensors, train_step

GPU_SIZES_GB = (16, 24, 40, 48, 80, 141)
# CONTEXT_ALLOWANCE (1 GiB, defined with the simulated device in gpukit.allocator.config, which reserves it
# too): memory a process needs on a GPU beyond what PyTorch allocates, the CUDA context.


default_step = train_step  # the plain step of ``gpukit.step``: what ``predict()`` predicts unless told otherwise


@dataclass
class Prediction:
    """What one training step would allocate, predicted without allocating it.

    ``peak`` is absolute: the model states that exist before the step (parameters,
    gradients, optimizer state, the batch) plus the step's own peak above them.
    Bytes are rounded up to 512 per tensor like the CUDA allocator's; the
    ``*_unrounded`` fields are the sizes as requested. For CUDA (``device="cuda"``, ``card=``)
    ``peak``, ``before_step`` and ``step_peak`` are ``torch.cuda.memory_allocated()``'s: each block
    counted whole, as the simulated caching allocator that follows the step hands them out (a large
    block is not split where 1 MiB or less would remain: ``whole_blocks`` at the peak).
    """

    peak: int
    peak_unrounded: int
    before_step: int              # allocated when the step starts (rounded)
    step_peak: int                # the step's peak above ``before_step``
    step_peak_unrounded: int
    parameters: int               # parameter count
    roles_peak: dict[str, int]    # by role, at the peak (MemTracker's tags), unrounded
    roles_end: dict[str, int]
    modules: list[dict] = field(default_factory=list)  # per-module parameters and outputs
    seconds: float = 0.0
    reserved_peak: int | None = None  # the simulated CUDA caching allocator's reserved bytes at the step's peak
    allocator_events: list = field(default_factory=list, repr=False)  # what it was fed (gpukit.allocator)
    # allocator_events[step_events_from:] are the predicted step's; before it, the build's and the warm-up's
    step_events_from: int = field(default=0, repr=False)
    # Ops whose fake kernel gave outputs of the wrong size, replaced by the real sizes (op -> bytes added per
    # call), and ops that could not be checked against their real kernel (op -> why): gpukit.fakecheck.
    corrected_ops: dict[str, int] = field(default_factory=dict)
    unverified_ops: dict[str, str] = field(default_factory=dict)
    device: str = "cpu"           # whose rules: "cuda" follows PyTorch 2.11's CUDA code paths (gpukit.cudarules)
    workspaces: int = 0           # cuBLAS/cuBLASLt workspaces (CUDA), included in before_step and peak
    # CUDA: how much higher the peak is, its blocks counted whole as torch.cuda.memory_allocated() counts them (a large
    # block is handed out whole where 1 MiB or less would remain), than the tensors' 512-byte sizes make it
    whole_blocks: int = 0
    attention_kernels: dict[str, int] = field(default_factory=dict)  # CUDA: SDPA kernel -> calls
    card: str | None = None       # CUDA: the card whose kernels were chosen (gpukit.cards key); None: Hopper
    # Parts of the step not run as the card runs them (an autocast torch disabled before the prediction...), each
    # with what was done instead: gpukit.amp.
    unfollowed: dict[str, str] = field(default_factory=dict)
    # Values the step read from fake tensors (loss.item(), a truth value), made up as a healthy step's, by kind
    # ("bool", "float", "int"): gpukit.factories.ValuesInStep. An integer may size something (unverified_ops), and
    # a truth value decide a branch (unfollowed).
    made_up: dict[str, int] = field(default_factory=dict)

    @property
    def lower_bound(self) -> bool:
        """True where some op's fake kernel could not be checked (``unverified_ops``): the peak may be low."""
        return bool(self.unverified_ops)

    def will_it_fit(self, sizes_gb=GPU_SIZES_GB, allowance: int = CONTEXT_ALLOWANCE):
        """A table: against GPU memory sizes (GB = 10^9 B), whether the run fits once the caching allocator's
        reserved memory is counted: its allocations replayed through a simulated allocator on a device of
        that size less the context allowance (gpukit.allocator); "needed" is reserved at the peak plus it.
        A prediction made for a card (``predict(card="t4")``) answers for that card first, on the memory torch
        reports for it where that is known (a T4: 14.58 GiB of its 16 GB), then for ``sizes_gb``."""
        import pandas as pd

        from .allocator import replay_events
        from .cards import card as card_named

        reserved = self.peak if self.reserved_peak is None else self.reserved_peak
        need = reserved + allowance
        sizes = [(f"{gb} GB", int(gb * 1e9)) for gb in sizes_gb]
        if self.card is not None:
            c = card_named(self.card)
            usable = c.torch_total_memory or c.memory_bytes
            sizes.insert(0, (f"{c.name} ({format_bytes(usable)}"
                             + (" as torch reports it)" if c.torch_total_memory else ")"), usable))
        rows = []
        for label, cap in sizes:
            fits = need <= cap
            if self.allocator_events and cap > allowance:  # the allocator frees its cache before it fails
                fits = replay_events(self.allocator_events, cap, context_bytes=allowance)[0]
            rows.append({"GPU memory": label, "predicted peak": format_bytes(self.peak),
                         "reserved at peak (simulated)": format_bytes(reserved),
                         "context allowance": format_bytes(allowance), "needed": format_bytes(need),
                         "fits": fits, "headroom": format_bytes(cap - need)})
        return pd.DataFrame(rows)

    def _rows(self) -> list[tuple[str, str]]:
        rows = [("parameters", f"{self.parameters:,}"),
                ("before the step", format_bytes(self.before_step)),
                ("step peak above that", format_bytes(self.step_peak)),
                ("predicted peak", f"{format_bytes(self.peak)}  ({self.peak:,} B)")]
        if self.reserved_peak is not None:
            rows.append(("reserved at the peak (simulated allocator)", format_bytes(self.reserved_peak)))
        rows += [(f"  {role} (at peak)", format_bytes(n)) for role, n in self.roles_peak.items() if n]
        if self.device == "cuda":
            gpu = "Hopper" if self.card is None else self.card
            rows.insert(0, ("rules", f"CUDA code paths of PyTorch {TORCH_RULES_VERSION} ({gpu}), on fake CPU tensors"))
            rows.append(("  cuBLAS workspaces", format_bytes(self.workspaces)))
            if self.whole_blocks:
                rows.append(("  blocks handed out whole", format_bytes(self.whole_blocks)))
            rows += [("  attention kernel", f"{k} x{n}") for k, n in self.attention_kernels.items()]
        rows += [(f"  corrected {op}", f"+{format_bytes(n)} per call (fake kernel checked against the real one)")
                 for op, n in self.corrected_ops.items()]
        if self.unverified_ops:
            rows.append(("LOWER BOUND: unchecked ops", ", ".join(self.unverified_ops)))
        if self.made_up:
            rows.append(("values made up in the step", ", ".join(
                f"{n} {kind} ({ValuesInStep.MADE_UP[kind]})" for kind, n in self.made_up.items())
                + " read from tensors, as a healthy step's"))
        rows += [("NOT AS ON THE CARD", f"{what}: {why}") for what, why in self.unfollowed.items()]
        rows.append(("prediction took", f"{self.seconds:.2f} s"))
        return rows

    def __repr__(self) -> str:
        return "\n".join([f"predicted training step on {self.device} (fake tensors, nothing allocated)"] +
                         [f"  {k:<28} {v}" for k, v in self._rows()])

    def _repr_html_(self) -> str:
        return f"<b>predicted training step (fake tensors, nothing allocated)</b>{html_table(self._rows())}"


def predict(make_model: Callable[[], nn.Module],
            make_optimizer: Callable[[Any], torch.optim.Optimizer],
            make_batch: Callable[[], Any],
            step: Callable[[nn.Module, torch.optim.Optimizer, Any], Any] = default_step,
            *, warmup_steps: int = 1, modules_depth: int = 1, device: str | None = None,
            card: Any = None, breakdown: bool = True) -> Prediction:
    """Predict the memory of one training step exactly, allocating nothing.

    Everything is built under ``FakeTensorMode``, so nothing is allocated; real
    tensors that ``make_batch`` returns or the step meets are turned into fake ones.
    Nothing of yours is changed: a model that already exists (``lambda: model``) is
    predicted on a fake copy (``gpukit.factories``), and the model itself is only read.

    Args:
        make_model: builds the model (``lambda: MyNet(...)``), as for a real run. ``lambda: model`` for a
            model you already have: the prediction runs on a copy with fake tensors (no gradients, the
            training flag and module hooks as the model has them), and the model keeps its weights,
            gradients, buffers and hooks as they were.
        make_optimizer: builds a new optimizer over the parameters it is given (``lambda p: torch.optim.Adam(p)``).
        make_batch: builds one batch, passed to ``step`` as it is (real tensors are fine: they become fake).
        step: runs one training step: ``step(model, optimizer, batch)``.
        warmup_steps: steps run before the predicted one, so that gradients and
            optimizer state exist as they do in the steady state of training.
        modules_depth: depth of the per-module table (1: the model's children).
        device: "cpu" (the default), or "cuda" to apply what a CUDA run (PyTorch 2.11, Hopper GPU unless ``card``
            names another) allocates differently: foreach optimizers by default, cuBLAS workspaces, the attention
            kernel chosen, dropout's fused kernel and its 1-byte mask (gpukit.cudarules).
        card: the GPU the run is for, a ``gpukit.cards.Card`` or its name ("t4", "A100 80GB"...): implies
            ``device="cuda"`` and picks the attention kernels its compute capability has (a T4 has no fused
            kernel for bfloat16: the math fallback, with its attention matrix, is counted).
        breakdown: the step's bytes by role (parameters, gradients, activations...) and the per-module table;
            ``False`` leaves both empty, and the prediction about a fifth faster (the bytes are the same: only
            MemTracker's hooks, which tag each tensor, are left out). The planner's bounds need none of it.

    Returns:
        A ``Prediction``.

    Raises:
        TypeError: a model, an optimizer or a batch passed where the function that builds it is expected
            (``predict(model, ...)``), or a factory that returns something else than a model or an optimizer;
            the message says what to pass.
        ValueError: ``make_optimizer`` returned an optimizer that already exists (over real tensors, not the
            parameters given), which the prediction would step; or ``make_model`` returned a model that already
            exists and cannot be deep-copied. Neither is changed. Also ``warmup_steps`` below 0.
        RuntimeError, IndexError...: the real error, where the step would fail for real (a dtype mismatch, wrong
            shapes, class labels or token ids out of range where the batch's values are known): each op small
            enough is run once for real on the CPU (gpukit.fakecheck).
        RuntimeError: a prediction for the CPU of a step that names CUDA (``model.cuda()``) on a machine without
            a GPU: the message says to predict for a card (``device="cuda"``, ``card=``), where the CUDA devices
            named stand for it (gpukit.cudadevice). Values the step reads from tensors (``loss.item()``) are
            made up as a healthy step's and counted in ``Prediction.made_up`` (gpukit.factories.ValuesInStep).
    """
    check_factories(make_model, make_optimizer, make_batch)
    if card is not None:
        from .cards import Card, card as card_named

        card = card if isinstance(card, Card) else card_named(card)
        if device is not None and torch.device(device).type != "cuda":
            raise ValueError(f"predict(device={device!r}, card={card.key!r}): a card is a CUDA device; "
                             "leave device out or pass 'cuda'")
    if not isinstance(breakdown, bool):
        raise TypeError(f"breakdown={breakdown!r}: True (bytes by role and by module) or False (the bytes alone)")
    if not callable(step):
        raise TypeError(f"step={short_repr(step)}: a function step(model, optimizer, batch) that runs one training "
                        "step (gpukit.step.train_step, the default, or your own)")
    if not isinstance(modules_depth, int) or isinstance(modules_depth, bool) or modules_depth < 0:
        raise ValueError(f"modules_depth={modules_depth!r}: the depth of the per-module table, a whole number: 1 "
                         "(the default) for the model's children, 0 for none")
    if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps!r}: the steps run before the predicted one, a whole number: "
                         "1 (the default) leaves gradients and optimizer state as training has them, 0 predicts "
                         "the first step")
    kind = torch.device(device or ("cuda" if card is not None else "cpu")).type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"predict(device={device!r}): the rules known are those of 'cpu' and 'cuda'")
    # Garbage fake tensors (of an earlier prediction, say) freed in the step would count as its frees: the
    # collector runs first where the fake ledger knows storages that live on (a prediction frees its own garbage
    # before it returns, so after one there are usually none). Its simulated GPU places nothing that existed
    # before it (follow(fresh=True)): garbage in a reference cycle, which only a full collection would find.
    with ONE_PREDICTION:  # (another thread's prediction ends first: the fake ledger counts every thread)
        refuse_inside_a_fake_run("predict()")
        FAKE_LEDGER.settle()
        with gc_paused(full=bool(FAKE_LEDGER.sizes)) as collect_young:
            prediction = _predict(make_model, make_optimizer, make_batch, step, warmup_steps, modules_depth, kind,
                                  collect_young, card, breakdown)
            collect_young()
    return prediction


def _predict(make_model, make_optimizer, make_batch, step, warmup_steps, modules_depth, kind, collect_young, card,
             breakdown):
    t0 = time.perf_counter()
    if kind == "cuda":
        rules = CudaRules(card.compute_capability) if card is not None else CudaRules()
    elif not torch.cuda.is_available():  # a step written for a GPU: torch would say it has no CUDA; say what to do
        rules = CudaDevices(None)
    else:
        rules = contextlib.nullcontext()
    # The step's torch.autocast("cuda"), GradScaler and torch.cuda calls run as on the card (gpukit.amp). Real
    # tensors the step meets (a batch sliced from real data, say) become fake ones.
    amp = CardAmp("cpu", cuda=kind == "cuda", capability=getattr(rules, "capability", (9, 0)))
    # (TensorsFromFakeLists: torch.tensor of a list of the step's fake tensors, as the build gets it too)
    with amp, FakeTensorMode(allow_non_fake_inputs=True) as fake_mode, FakeKernelCheck() as check, rules, \
            TensorsFromFakeLists(), follow(FAKE_LEDGER, fresh=True) as simulated:
        if kind == "cuda":  # the step's torch.cuda.memory_allocated() and the like read the card as it stands
            amp.memory = CardMemory(simulated, rules.workspace_blocks)
        # A fake tensor keeps its mode in its __dict__, which copy.deepcopy copies: a deep-copied module
        # (nn.Transformer clones its layers so) would hold tensors of a new mode, which every op then
        # converts afresh: a new storage counted per use. Copies stay in this mode, as on a real device.
        fake_mode.__deepcopy__ = lambda memo: fake_mode
        with warnings.catch_warnings():
            # Tensor.__deepcopy__ (torch/_tensor.py) asks a subclass for its data_ptr() to choose between
            # clone() and a storage copy; a fake tensor answers with a warning that blames the user's code.
            # It is torch's own question, and the copy is right (it clones), so the model's author never sees it.
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor", category=UserWarning)
            # A model that already existed: a fake copy, the user's left alone. Values its initialisers read
            # (trunc_normal_ redraws while any value is out of range) are made up: memory depends on shapes only.
            values = ValuesWhileBuilding()
            model = fake_model(make_model, values)
        with values:  # bitsandbytes' 8-bit optimizers compute their quantisation maps (.tolist()) when built
            optimizer = make_optimizer(model.parameters())
        check_optimizer(optimizer)
        if kind == "cuda":
            use_cuda_optimizer_defaults(optimizer)
        # map_tensors reaches into any batch (a transformers BatchEncoding too, which pytree leaves whole)
        batch = map_tensors(lambda t: t if isinstance(t, FakeTensor) else _to_fake(t, fake_mode, check), make_batch())
        # Values the step reads from tensors (loss.item() to log it) are made up as a healthy step's, and named.
        step_values = check.values = ValuesInStep()
        with _foreach_warmup(optimizer):
            for _ in range(warmup_steps):
                step(model, optimizer, batch)
        check.quick = warmup_steps > 0  # the warm-up step met the ops with these shapes and this batch
        # Roles of the device the model is on (a model built on "cuda" under fake tensors has its roles there).
        model_device = next((p.device for p in model.parameters()), torch.device("cpu"))
        roles = RoleTracker(model_device, model, optimizer) if breakdown else _NoRoles()
        if any(p.grad is not None and p.grad.layout is not torch.strided for p in model.parameters()):
            roles = _NoRoles()  # MemTracker reads storages, which sparse gradients do not have
        elif any(not p.requires_grad for p in model.parameters()):
            roles = _NoRoles()  # MemTracker hooks every parameter's gradient, and a frozen one refuses the hook
        # and what the step's GradScaler keeps from step to step (its scale and growth tracker, made by the warm-up)
        storages = distinct_storages(state_tensors(model, optimizer, batch) + amp.scaler_tensors())
        before, before_unrounded = sum(round_up(n) for n in storages.values()), sum(storages.values())
        collect_young()  # what the warm-up left is freed before the step, not inside it
        tally = FAKE_LEDGER.start()
        watch = simulated.watch()
        step_events_from = len(simulated.events)  # (a device that records its events runs each at once)
        blocks = WholeBlocks(simulated) if kind == "cuda" else None
        try:
            roles.start(plain_tensors_only=True)
            try:
                step(model, optimizer, batch)
            finally:
                roles.stop()
        finally:
            FAKE_LEDGER.stop(tally)
            reserved_peak = simulated.unwatch(watch)
        modules = _module_table(roles, model, modules_depth)
        n_params = sum(p.numel() for p in model.parameters())
    workspaces, unverified = 0, dict(check.unverified)
    if values.made_up.get("int"):  # an integer read while building may have sized a tensor
        unverified["aten._local_scalar_dense"] = (
            f"{values.made_up['int']} integer value(s) read from tensors while building the model, which fake "
            "tensors do not hold, were taken as 1: a size computed from one may differ from a real run's")
    unfollowed = dict(amp.unfollowed)
    unverified.update(step_values.name(unfollowed))
    if kind == "cuda":  # allocated by the first matrix product and kept: part of the state before the step
        workspaces = rules.workspaces()
        unverified.update(rules.unmodelled)
        if ran_capturable_off(optimizer):
            unverified["capturable=True"] = (
                "the optimizer step ran without capturable, which runs only with its tensors on a GPU (torch asserts "
                "it), its step counters kept on the GPU as capturable keeps them: the scalar tensors capturable's step "
                "makes on the GPU besides (bias corrections, torch/optim/adam.py) are not counted")
    step_peak, whole_blocks = tally.peak, 0
    if blocks is not None and blocks.known():  # torch.cuda's figures count each block whole
        whole_blocks, step_peak = blocks.before_slack, blocks.step_peak()
        before += whole_blocks
    before += workspaces
    before_unrounded += workspaces
    if workspaces and reserved_peak is not None:  # each workspace is a cudaMalloc'd block of its own
        reserved_peak += workspace_segments(rules.workspace_blocks())[1]
    return Prediction(
        peak=before + step_peak, peak_unrounded=before_unrounded + tally.peak_unrounded,
        before_step=before, step_peak=step_peak, step_peak_unrounded=tally.peak_unrounded,
        whole_blocks=whole_blocks + step_peak - tally.peak,
        parameters=n_params, roles_peak=roles.peak, roles_end=roles.end, modules=modules,
        seconds=time.perf_counter() - t0, reserved_peak=reserved_peak, allocator_events=simulated.events,
        step_events_from=step_events_from,
        corrected_ops=dict(check.corrected), unverified_ops=unverified,
        device=kind, workspaces=workspaces, attention_kernels=dict(getattr(rules, "sdpa", {})),
        card=card.key if card is not None else None, unfollowed=unfollowed, made_up=dict(step_values.made_up))


@contextlib.contextmanager
def _foreach_warmup(optimizer: torch.optim.Optimizer):
    """Warm-up steps with the foreach implementation where the user left the choice to PyTorch.

    The warm-up only has to leave the state a step leaves (gradients, optimizer state made by
    ``_init_group``, the same in both implementations); foreach makes it in a few ops over all
    parameters where the for-loop one dispatches each op once per parameter: a third of the
    prediction's time on a large model. The predicted step runs the implementation the user gets.
    """
    changed = [g for g in optimizer.param_groups
               if g.get("foreach", False) is None and not g.get("fused") and not g.get("differentiable", False)]
    for g in changed:
        g["foreach"] = True
    try:
        yield
    finally:
        for g in changed:
            g["foreach"] = None


def _to_fake(t: torch.Tensor, fake_mode: FakeTensorMode, check: FakeKernelCheck) -> torch.Tensor:
    """A fake copy of a real batch tensor; its values are followed where they decide whether the step runs
    (class labels, token ids)."""
    fake = fake_mode.from_tensor(t)
    check.know(fake, t)
    return fake


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> list[torch.Tensor]:
    """What a training step starts with: parameters, buffers, gradients, optimizer state and the batch (while the
    CUDA rules apply, less the optimizer state a CUDA run keeps on the host: ``gpukit.hoststate``)."""
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += gpu_state_only(v for state in optimizer.state.values() for v in state.values()
                              if isinstance(v, torch.Tensor))
    tensors += batch_tensors(batch)
    return tensors


def distinct_storages(tensors) -> dict[int, int]:
    """``id(storage) -> bytes`` of the distinct storages of the strided ``tensors`` (the counter's rule: a
    storage shared by views or by two tensors counts once; sparse tensors are not counted)."""
    return {id(st): st.nbytes() for st in (t.untyped_storage() for t in tensors if t.layout is torch.strided)}


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors``, each rounded as the CUDA allocator rounds a block."""
    return sum(round_up(n) for n in distinct_storages(tensors).values())


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any = ()) -> tuple[int, int]:
    """Bytes of the training state: the distinct storages of ``state_tensors`` (parameters, buffers,
    gradients, optimizer state, and the batch), as ``(allocated, requested)``: rounded as the CUDA
    allocator rounds each block (``allocated_size``), and as asked for."""
    storages = distinct_storages(state_tensors(model, optimizer, batch))
    return sum(round_up(n) for n in storages.values()), sum(storages.values())


def measured_step_peak(make_model: Callable[[], nn.Module],
                       make_optimizer: Callable[[Any], torch.optim.Optimizer],
                       make_batch: Callable[[], Any],
                       step: Callable[[nn.Module, torch.optim.Optimizer, Any], Any] = default_step,
                       *, device: str | torch.device = "cpu", warmup_steps: int = 1, seed: int = 0) -> int:
    """The real counterpart of ``predict(...).peak``: run the same steps for real and measure the last one.

    Returns the bytes (rounded like the CUDA allocator's) of the state before the step
    (``state_tensors``) plus the step's measured peak above it.
    """
    from .meter import measure, resolve_device

    check_factories(make_model, make_optimizer, make_batch, copied=False)
    dev = resolve_device(device)
    torch.manual_seed(seed)
    model = make_model().to(dev)
    optimizer = make_optimizer(model.parameters())
    batch = map_tensors(lambda t: t.to(dev), make_batch())
    for _ in range(warmup_steps):
        step(model, optimizer, batch)
    with gc_paused(), measure(dev, record=False) as report:
        step(model, optimizer, batch)
    return state_bytes(model, optimizer, batch)[0] + report.peak


class _NoRoles:
    """No breakdown by role (sparse gradients); the prediction's bytes do not depend on it."""

    peak: dict = {}
    end: dict = {}

    def start(self, plain_tensors_only: bool = False) -> None:
        pass

    def stop(self) -> None:
        pass

    def module_stats(self) -> dict:
        return {}


def _module_table(roles: RoleTracker, model: nn.Module, depth: int) -> list[dict]:
    """Per module: parameter bytes and the bytes of the outputs its forward produced."""
    stats = roles.module_stats()
    rows = []
    for name, module in model.named_modules():
        level = 0 if name == "" else name.count(".") + 1
        if level == 0 or level > depth or module not in stats:
            continue
        s = stats[module]
        rows.append({"module": name, "type": type(module).__name__,
                     "parameters": sum(p.numel() for p in module.parameters()),
                     "parameter bytes": getattr(s, "parameter_mem", 0),
                     "output bytes": getattr(s, "output_mem", 0)})
    return rows


@dataclass
class RuleOfThumb:
    """The estimate from the literature: parameters x n + batch x activations per sample x bytes x 2."""

    parameters: int
    n: int                        # copies of the parameters: 2 SGD, 3 SGD+momentum, 4 Adam
    bytes_per_value: int
    batch_size: int
    activations_per_sample: int   # output elements of every leaf module, for one sample

    @property
    def model_states(self) -> int:
        return self.parameters * self.n * self.bytes_per_value

    @property
    def activations(self) -> int:
        return self.batch_size * self.activations_per_sample * self.bytes_per_value * 2

    @property
    def total(self) -> int:
        return self.model_states + self.activations

    def __repr__(self) -> str:
        return (f"rule of thumb: {self.parameters:,} parameters x {self.n} x {self.bytes_per_value} B"
                f" = {format_bytes(self.model_states)}\n"
                f"             + batch {self.batch_size} x {self.activations_per_sample:,} activations"
                f" x {self.bytes_per_value} B x 2 = {format_bytes(self.activations)}\n"
                f"             = {format_bytes(self.total)}")


OPTIMIZER_COPIES = {"sgd": 2, "sgd-momentum": 3, "adam": 4, "adamw": 4}


def optimizer_copies(optimizer: torch.optim.Optimizer | str) -> int:
    """n in the rule of thumb: how many parameter-sized tensors training keeps (weights, grads, state)."""
    if isinstance(optimizer, str):
        try:
            return OPTIMIZER_COPIES[optimizer.lower()]
        except KeyError:
            raise ValueError(f"unknown optimizer {optimizer!r}; one of {sorted(OPTIMIZER_COPIES)}") from None
    if isinstance(optimizer, torch.optim.SGD):
        return 3 if optimizer.defaults.get("momentum", 0) else 2
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 4
    raise ValueError(f"no rule-of-thumb factor for {type(optimizer).__name__}; pass n as 'sgd', 'adam'...")


def layer_table(make_model: Callable[[], nn.Module], make_input: Callable[[], Any]) -> list[dict]:
    """Every leaf module in forward order: its output shape, output elements and parameters.

    Runs one forward pass under fake tensors (nothing is allocated), so it works for
    models far too big for this machine. A model that already exists (``lambda: model``) is run as a fake copy.
    """
    check_model_factory(make_model)
    check_factory(make_input, "make_input", "lambda: torch.zeros(...)", builds="the input")
    rows: list[dict] = []
    with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode, CudaDevices("cpu"), TensorsFromFakeLists():
        model = fake_model(make_model)
        # an input that already exists (lambda: x) is read through a fake copy, as predict() reads a batch
        x = map_tensors(lambda t: t if isinstance(t, FakeTensor) else fake_mode.from_tensor(t), make_input())

        def hook(module, _inputs, output):
            if isinstance(output, torch.Tensor):
                rows.append({"layer": names[module], "type": type(module).__name__,
                             "output shape": tuple(output.shape), "output elements": output.numel(),
                             "parameters": sum(p.numel() for p in module.parameters(recurse=False))})

        names = {m: n for n, m in model.named_modules()}
        handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
        try:
            with torch.no_grad():
                model(x)
        finally:
            for h in handles:
                h.remove()
    return rows


def rule_of_thumb(make_model: Callable[[], nn.Module], make_sample: Callable[[], Any], batch_size: int,
                  optimizer: torch.optim.Optimizer | str = "adam", bytes_per_value: int = 4) -> RuleOfThumb:
    """The rule of thumb for a model: ``make_sample`` builds the input of ONE sample (batch of 1)."""
    check_factory(make_sample, "make_sample", "lambda: torch.zeros(1, ...)", builds="the sample")
    rows = layer_table(make_model, make_sample)
    with FakeTensorMode(), CudaDevices("cpu"):
        n_params = sum(p.numel() for p in fake_model(make_model).parameters())
    return RuleOfThumb(parameters=n_params, n=optimizer_copies(optimizer), bytes_per_value=bytes_per_value,
                       batch_size=batch_size, activations_per_sample=sum(r["output elements"] for r in rows))


__all__ = ["predict", "measured_step_peak", "Prediction", "rule_of_thumb", "RuleOfThumb", "layer_table",
           "default_step", "state_tensors", "state_bytes", "distinct_storages", "storage_bytes", "optimizer_copies",
           "GPU_SIZES_GB", "CONTEXT_ALLOWANCE"]
