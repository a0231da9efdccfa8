"""The step as a GPU user writes it, under a prediction: ``torch.autocast("cuda")``, a ``GradScaler`` and
``torch.cuda``'s own calls.

    scaler = torch.amp.GradScaler("cuda")

    def step(model, optimizer, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch).sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer); scaler.update(); optimizer.zero_grad()

    gpukit.predict(make_model, make_optimizer, make_batch, step, card="t4")

Where there is no GPU, torch disables both with a warning (torch/amp/autocast_mode.py ``autocast.__init__`` and
torch/amp/grad_scaler.py ``GradScaler.__init__`` ask ``torch.cuda.amp.common.amp_definitely_not_available()``), so
the step would run in float32; and a scaler's ``step()`` reads its found_inf (``_maybe_opt_step``: ``.item()``),
which a fake tensor cannot answer. ``CardAmp``, which ``predict`` and ``predict_offload`` open around their fake run,
runs them as the card does, and prints nothing:

* ``torch.autocast("cuda", ...)``, spelled any way (positionally, ``device_type="cuda"``, ``torch.amp.autocast``,
  the deprecated ``torch.cuda.amp.autocast``, whose deprecation warning a GPU prints too), made inside a prediction
  for a card is the card's autocast: torch's own CUDA path through ``__init__`` (with no dtype named, CUDA's
  default, ``torch.get_autocast_dtype("cuda")``: float16; bfloat16 on every card, as ``torch.cuda.is_bf16_supported``
  answers on one: natively from sm80, emulated below). While it is entered the fake tensors' own device autocasts
  with the same dtype and on/off: CPU autocast on the fake CPU tensors of ``predict(device="cuda")``, running
  CUDA's op lists (``gpukit.cuda_autocast``). ``torch.autocast("meta")`` in ``predict_offload`` (a
  step that says ``x.device.type``) is the GPU's autocast there.
* A ``GradScaler`` of any device is run as the card runs it, from a fresh start on the prediction's fake device
  (the loss's): its scale (float32) and growth tracker (int32), made by the first ``scale()`` and kept from step to
  step, a 512-byte block each on CUDA, counted in what the step starts with; ``unscale_``'s inverse scale (through
  float64), its found_inf, and each one's per-device copy (``_MultiDeviceReplicator.get``: ``copy=True``); the step
  taken, as after a healthy backward (no inf); ``update()`` in place. ``get_scale()`` reads the initial scale.
* ``torch.cuda``'s own calls, where torch has no GPU (it refuses each: "Torch not compiled with CUDA enabled"):
  ``synchronize()`` does nothing (the simulated card runs everything in order already); ``empty_cache()`` is named
  below. The memory reads a training loop logs, ``memory_allocated()``, ``max_memory_allocated()``,
  ``memory_reserved()``, ``max_memory_reserved()`` and ``reset_peak_memory_stats()``, are answered by the
  prediction's card as it stands at that moment (``gpukit.allocator.CardMemory``: each block whole, the workspaces
  made by then; the peaks from the prediction's start, as a fresh process's, or the step's own reset, which leaves
  the prediction's step peak as it was), on a machine with a GPU of its own too: a predicted step reads the card
  predicted. ``memory_stats()``, ``memory_summary()`` and ``mem_get_info()`` raise an error that says where the
  prediction's figures are.
* Afterwards every scaler is as it was before (a fake tensor left in the user's scaler would break their next real
  step), and torch's functions are put back, also when the step raises or is interrupted.

Not followed as the card would run it, and named in ``unfollowed`` (the prediction's field of that name):

* ``torch.cuda.empty_cache()``, where torch has no GPU: not run on the simulated card, whose cached blocks are kept,
  so the reserved memory predicted may be above the card's (allocated memory is the same).

* A ``GradScaler("cuda")`` that is disabled when the step meets it, on a machine without a GPU: torch disabled it
  when it was made (warning then), or it was made with ``enabled=False``; torch keeps nothing that tells which. It
  runs enabled, as the card makes ``GradScaler("cuda")``: 1 KiB more than a disabled one.
* A ``torch.autocast("cuda")`` that is off when entered, on a machine without a GPU (made before the prediction, a
  decorator on a function defined earlier say, or made with ``enabled=False``): its region runs in float32, as made.
  Made inside the step, it is the card's autocast.
* Autocast on ``predict_offload``'s simulated GPU: ``meta`` tensors have no autocast (torch picks autocast's kernels
  by the tensor's backend, and ``torch.amp.is_autocast_available("meta")`` is False); the region runs in float32,
  so the GPU's side is high. ``torch.autocast("meta")`` is made as the card's ("cuda") there, so that a step that
  says ``x.device.type`` runs; that wrapper of ``autocast.__init__`` is in place only while ``predict_offload`` runs.
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch

from ._torch import (FakeTensor, ScalerThatAlwaysSteps, autocast_enabled, restore_scaler, scaler_device,
                     scaler_enabled, scaler_init_scale, scaler_state, scaler_step_rule, scaler_tensors,
                     set_scaler_step_rule, start_scaler_afresh)
from .allocator import CardMemory
from .counter import INTERRUPTS

_LOW = (torch.float16, torch.bfloat16)
_LOCAL = threading.local()   # .stack: the CardAmp blocks open on this thread, innermost last
_INSTALL = threading.Lock()
_INSTALLED: dict = {}        # what the wrappers replaced, while any CardAmp is open in the process
_OPEN = [0, 0]               # CardAmp blocks open, all threads: all of them, those on 'meta'


def _active() -> "CardAmp | None":
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None


class CardAmp:
    """Within the block, on this thread, the user's autocast and GradScaler run as on the card (module docstring).

    Args:
        device: the device type of the fake tensors that stand for the card: "cpu" (``predict``) or "meta"
            (``predict_offload``).
        cuda: a prediction for a card; False (a CPU prediction): ``torch.autocast("cuda")`` is left to torch, which
            disables it without a GPU, as a CPU run does; scalers are still run on fake tensors.
        capability: the card's compute capability.
    """

    def __init__(self, device: str = "cpu", cuda: bool = True, capability: tuple[int, int] = (9, 0)) -> None:
        self.device, self.cuda, self.capability = device, cuda, tuple(capability)
        self.unfollowed: dict[str, str] = {}
        # the scalers met, by id: (a weak reference, the state to put back). Weak: one the step makes and drops is
        # freed as on the card, and one of the user's is alive at the end to be put back.
        self._adopted: dict[int, tuple[weakref.ref, dict]] = {}
        self._own: dict[int, weakref.ref] = {}  # gpukit's ScalerThatAlwaysSteps met, by id: run as they are
        self._mirrored: list = []  # (autocast region, the device's (enabled, dtype) before it), innermost last
        self._emptied = 0  # torch.cuda.empty_cache() calls met where torch has no GPU
        # What answers the step's torch.cuda memory reads (gpukit.allocator.CardMemory), set by the prediction once
        # its simulated card exists; None: they are refused
        self.memory = None

    # -- the block ------------------------------------------------------------------------------------------------
    def __enter__(self) -> "CardAmp":
        meta = self.device == "meta"
        INTERRUPTS.hold()  # Ctrl-C waits until torch is fully patched, or fully put back
        installed = False
        try:
            _install(meta)
            installed = True
            _LOCAL.__dict__.setdefault("stack", []).append(self)
            INTERRUPTS.deliver()  # one that came while opening: undo, then raise it
        except BaseException:
            try:
                if self in getattr(_LOCAL, "stack", ()):
                    _LOCAL.stack.remove(self)
                if installed:
                    _uninstall(meta)
            finally:
                INTERRUPTS.release()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        try:
            try:
                while self._mirrored:  # a region the step left open (it raised inside a with block it did not leave)
                    self._unmirror(self._mirrored[-1][0])
            finally:
                adopted, self._adopted, self._own = self._adopted, {}, {}
                try:
                    for ref, state in adopted.values():
                        scaler = ref()
                        if scaler is not None:
                            restore_scaler(scaler, state)
                finally:
                    stack = _LOCAL.stack
                    if self in stack:
                        stack.remove(self)
                    _uninstall(self.device == "meta")
        finally:
            INTERRUPTS.release()  # an interrupt held back while closing is raised here
        return False

    def scaler_tensors(self) -> list[torch.Tensor]:
        """The tensors the step's scalers keep between steps (scale, growth tracker): on the card when a step
        starts."""
        scalers = [ref() for ref, _ in self._adopted.values()] + [ref() for ref in self._own.values()]
        return [t for s in scalers if s is not None for t in scaler_tensors(s)]

    # -- scalers --------------------------------------------------------------------------------------------------
    def adopt(self, scaler: torch.amp.GradScaler) -> None:
        """Met ``scaler`` in the step: its state is kept, to be put back at the end, and it runs from a fresh start
        (gpukit's own ``ScalerThatAlwaysSteps``, made for fake runs, runs as it is)."""
        key = id(scaler)
        if isinstance(scaler, ScalerThatAlwaysSteps):  # its state is the step's too: counted, left as it is
            self._own[key] = weakref.ref(scaler)
            return
        if key in self._adopted and self._adopted[key][0]() is scaler:
            return
        self._adopted[key] = (weakref.ref(scaler), scaler_state(scaler))
        enable = (self.cuda and not scaler_enabled(scaler) and scaler_device(scaler) == "cuda"
                  and _original("amp_definitely_not_available")())
        if enable:
            self.unfollowed["GradScaler('cuda') disabled when made"] = (
                "made where there is no GPU, torch disabled it (it warned then), and kept nothing that tells that from "
                "enabled=False: predicted enabled, as the card makes it (a disabled one keeps 1 KiB less)")
        start_scaler_afresh(scaler, enable=enable)

    # -- torch.cuda's own calls, where torch has no GPU ----------------------------------------------------------------
    def cuda_call(self, name: str) -> int | None:
        """``torch.cuda.<name>()`` in the step, where torch has no GPU, or a memory read wherever the prediction's
        card answers it (module docstring)."""
        if self.memory is not None and name in self.memory.READS:
            return self.memory.read(name)
        if name == "empty_cache":
            self._emptied += 1
            self.unfollowed["torch.cuda.empty_cache()"] = (
                f"called {self._emptied} time(s) in the steps predicted, and not run on the simulated card: its cached "
                "blocks were kept, so the reserved memory predicted may be above the card's (allocated memory is the "
                "same)")
        elif name != "synchronize":
            answered = ", ".join(f"{n}()" for n in CardMemory.READS)
            raise RuntimeError(
                f"torch.cuda.{name}() in a step predicted for a card, on a machine without a GPU, is not answered "
                f"(the simulated card answers {answered}): the card's figures are the prediction's (p.peak, "
                "p.step_peak, p.reserved_peak). To read torch.cuda's other calls on a simulated card, run the step in "
                "`with gpukit.on_card(gpukit.SimulatedCuda('t4')):` and ask that card")
        return None

    # -- autocast -------------------------------------------------------------------------------------------------
    def _mirror(self, region) -> None:
        """``region`` (a torch.autocast) was entered: where it is the card's, the fake device autocasts as it says."""
        if not self.cuda or region.device not in ("cuda", "meta"):
            return
        if not autocast_enabled(region) and _original("amp_definitely_not_available")():
            # Made inside the prediction it would be on, unless made with enabled=False: torch keeps nothing that
            # tells which (the prediction sees the object, not how it was made).
            self.unfollowed["torch.autocast('cuda') made off"] = (
                "made before the prediction where there is no GPU (torch disabled it then, and warned), or made with "
                "enabled=False: its region ran in float32. Made inside the step, it is the card's autocast")
            return
        if self.device == "meta":
            if autocast_enabled(region):
                self.unfollowed["autocast on the simulated GPU"] = (
                    "meta tensors have no autocast (torch.amp.is_autocast_available('meta') is False): the region's "
                    "ops ran in float32, so the GPU's side is high")
            return
        before = (torch.is_autocast_enabled(self.device), torch.get_autocast_dtype(self.device))
        on = autocast_enabled(region) and region.fast_dtype in _LOW  # (float32 on CUDA casts nothing down)
        torch.set_autocast_enabled(self.device, on)
        if on:
            torch.set_autocast_dtype(self.device, region.fast_dtype)
        self._mirrored.append((region, before))

    def _unmirror(self, region) -> None:
        if not self._mirrored or self._mirrored[-1][0] is not region:
            return
        _, (enabled, dtype) = self._mirrored.pop()
        torch.set_autocast_enabled(self.device, enabled)
        torch.set_autocast_dtype(self.device, dtype)


# -- the wrappers, installed while any CardAmp is open; each asks for this thread's -----------------------------------
def _original(name: str):
    return _INSTALLED.get(name) or {"amp_definitely_not_available": torch.cuda.amp.common.amp_definitely_not_available,
                                    "is_bf16_supported": torch.cuda.is_bf16_supported}[name]


def _not_available():
    amp = _active()
    if amp is not None and amp.cuda:
        return False  # the card is there
    return _INSTALLED["amp_definitely_not_available"]()


def _bf16_supported(including_emulation: bool = True):
    amp = _active()
    if amp is not None and amp.cuda:  # torch/cuda/__init__.py: sm80+, or a bfloat16 tensor made on the device
        return including_emulation or amp.capability >= (8, 0)
    return _INSTALLED["is_bf16_supported"](including_emulation)


# torch.cuda's functions a step may call, which torch refuses where it has no GPU (CardAmp.cuda_call)
_CUDA_CALLS = ("synchronize", "empty_cache", "memory_allocated", "max_memory_allocated", "memory_reserved",
               "max_memory_reserved", "reset_peak_memory_stats", "memory_stats", "memory_summary", "mem_get_info")


def _cuda_call(name: str, original):
    @functools.wraps(original)
    def call(*args, **kwargs):
        amp = _active()
        if amp is not None and amp.cuda and amp.memory is not None and name in CardMemory.READS:
            return amp.cuda_call(name)  # the predicted card's figures, also on a machine with a GPU of its own
        if amp is None or not amp.cuda or torch.cuda.is_available():
            return original(*args, **kwargs)
        return amp.cuda_call(name)

    return call


def _scaler_method(name: str):
    original = getattr(torch.amp.GradScaler, name)

    def method(self, *args, **kwargs):
        amp = _active()
        if amp is not None:
            amp.adopt(self)
            INTERRUPTS.deliver()
        return original(self, *args, **kwargs)

    method.__name__, method.__qualname__, method.__doc__ = original.__name__, original.__qualname__, original.__doc__
    return original, method


def _install(meta: bool) -> None:
    with _INSTALL:
        _OPEN[0] += 1
        _OPEN[1] += meta
        try:
            if _OPEN[0] == 1:
                _do_install()
            if meta and _OPEN[1] == 1:
                _install_meta()
        except BaseException:
            _OPEN[0] -= 1
            _OPEN[1] -= meta
            if _OPEN[1] == 0:
                _restore_meta()
            if _OPEN[0] == 0:
                _restore()
            raise


def _do_install() -> None:
    common, cuda, scaler, autocast = torch.cuda.amp.common, torch.cuda, torch.amp.GradScaler, torch.autocast
    _INSTALLED["amp_definitely_not_available"] = common.amp_definitely_not_available
    common.amp_definitely_not_available = _not_available
    _INSTALLED["is_bf16_supported"] = cuda.is_bf16_supported
    cuda.is_bf16_supported = _bf16_supported
    calls = _INSTALLED["cuda_calls"] = {name: getattr(cuda, name) for name in _CUDA_CALLS}
    for name, original in calls.items():
        setattr(cuda, name, _cuda_call(name, original))

    step_rule = _INSTALLED["step_rule"] = scaler_step_rule()

    def healthy_step(self, optimizer, optimizer_state, *args, **kwargs):
        if any(isinstance(v, FakeTensor) for v in optimizer_state["found_inf_per_device"].values()):
            return optimizer.step(*args, **kwargs)  # a fake found_inf holds no value: the step of a healthy backward
        return step_rule(self, optimizer, optimizer_state, *args, **kwargs)

    set_scaler_step_rule(healthy_step)
    methods = _INSTALLED["scaler_methods"] = {}
    for name in ("is_enabled", "scale", "unscale_", "step", "update"):
        methods[name], wrapped = _scaler_method(name)
        setattr(scaler, name, wrapped)
    get_scale = methods["get_scale"] = scaler.get_scale

    def initial_scale(self):
        if _active() is not None and isinstance(getattr(self, "_scale", None), FakeTensor):
            return scaler_init_scale(self)  # a healthy run's until growth_interval steps without inf
        return get_scale(self)

    scaler.get_scale = initial_scale
    enter, exit_ = _INSTALLED["autocast"] = autocast.__enter__, autocast.__exit__

    def autocast_enter(self):
        out = enter(self)
        amp = _active()
        if amp is not None:
            amp._mirror(self)
            INTERRUPTS.deliver()
        return out

    def autocast_exit(self, *exc):
        amp = _active()
        try:
            return exit_(self, *exc)
        finally:
            if amp is not None:
                amp._unmirror(self)
                INTERRUPTS.deliver()

    autocast.__enter__, autocast.__exit__ = autocast_enter, autocast_exit


def _install_meta() -> None:
    """``torch.autocast("meta")`` (``x.device.type`` in a step on predict_offload's simulated GPU) made as the card's,
    "cuda" (torch refuses "meta": it has no autocast)."""
    init = _INSTALLED["autocast_init"] = torch.autocast.__init__

    def autocast_init(self, *args, **kwargs):
        amp = _active()
        if amp is not None and amp.cuda and amp.device == "meta":
            if args and args[0] == "meta":
                args = ("cuda", *args[1:])
            elif kwargs.get("device_type") == "meta":
                kwargs = {**kwargs, "device_type": "cuda"}
        init(self, *args, **kwargs)

    torch.autocast.__init__ = autocast_init


def _restore_meta() -> None:
    if "autocast_init" in _INSTALLED:
        torch.autocast.__init__ = _INSTALLED.pop("autocast_init")


def _restore() -> None:
    """Put back every function ``_do_install`` replaced (as far as it got)."""
    common, cuda, scaler, autocast = torch.cuda.amp.common, torch.cuda, torch.amp.GradScaler, torch.autocast
    if "autocast" in _INSTALLED:
        autocast.__enter__, autocast.__exit__ = _INSTALLED.pop("autocast")
    for name, original in _INSTALLED.pop("scaler_methods", {}).items():
        setattr(scaler, name, original)
    if "step_rule" in _INSTALLED:
        set_scaler_step_rule(_INSTALLED.pop("step_rule"))
    for name, original in _INSTALLED.pop("cuda_calls", {}).items():
        setattr(cuda, name, original)
    if "is_bf16_supported" in _INSTALLED:
        cuda.is_bf16_supported = _INSTALLED.pop("is_bf16_supported")
    if "amp_definitely_not_available" in _INSTALLED:
        common.amp_definitely_not_available = _INSTALLED.pop("amp_definitely_not_available")


def _uninstall(meta: bool) -> None:
    with _INSTALL:
        _OPEN[0] -= 1
        _OPEN[1] -= meta
        if meta and _OPEN[1] == 0:
            _restore_meta()
        if _OPEN[0] == 0:
            _restore()


# Their frames hold Ctrl-C back until torch's state and the user's scalers are whole again (gpukit.counter.interrupts).
INTERRUPTS.protect(CardAmp.__enter__, CardAmp.__exit__, CardAmp.adopt, CardAmp._mirror, CardAmp._unmirror, _install,
                   _uninstall, restore_scaler)

__all__ = ["CardAmp"]
