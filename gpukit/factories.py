"""The factories the entry points take, checked; and the user's own model kept out of a prediction.

Every entry point takes *factories* (DESIGN, "Contract of every entry point"): ``make_model()`` builds a
model, ``make_optimizer(params)`` an optimizer over the parameters it is given, ``make_batch()`` a batch.
A prediction calls them under ``FakeTensorMode``, where what they build holds fake tensors: shapes, no
memory. Two slips would let a prediction reach the user's objects, which it must never change:

* an object where a factory is expected (``predict(model, ...)``): ``check_factory`` raises a TypeError
  that says what to pass;
* a factory that returns what already exists (``lambda: model``). Its tensors are real, and a fake step
  would leave fake gradients on them: the next real ``backward()`` adds into a fake tensor and ``step()``
  changes no weight, silently. ``fake_model`` predicts on a copy of such a model instead: ``copy.deepcopy``
  with each of its real tensors mapped to a fake tensor of the same shape, dtype, device and aliasing (no
  value copied, nothing allocated). The model is only read. An optimizer that already exists
  (``lambda params: optimizer``) holds real tensors: ``check_optimizer`` refuses it before it can step.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import os
import sys
import threading
import warnings
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ._torch import (SUPPORTED_NODES, DataDependentOutputException, FakeTensor, FakeTensorMode, TorchDispatchMode,
                     _disable_current_modes, _get_current_dispatch_mode_stack, active_fake_mode, tree_flatten)
from .fakecheck import GENUINE_FLOATS_LIMIT


def check_factory(value: Any, name: str, example: str, builds: str = "one") -> None:
    """Raise a TypeError where ``value`` is an object, not a function that builds one.

    Args:
        value: what was passed as the factory ``name`` (``"make_model"``...).
        name: the argument's name, as the message shows it.
        example: a factory to suggest (``"lambda: MyNet(...)"``).
        builds: what the factory builds, as the message says it (``"one"``, ``"the batch"``).

    Raises:
        TypeError: ``value`` is a model, an optimizer, or anything else that cannot be called.
    """
    if isinstance(value, nn.Module):  # callable (its forward), but not a factory
        what = f"a model ({type(value).__name__})"
    elif isinstance(value, torch.optim.Optimizer):
        what = f"an optimizer ({type(value).__name__})"
    elif not callable(value):
        what = f"a {type(value).__name__}"
    else:
        return
    raise TypeError(f"{name} is {what}, not a function that builds {builds}: pass {example}")


def check_model_factory(make_model: Any, name: str = "make_model", *, copied: bool = True) -> None:
    """``check_factory`` for a model factory; ``copied``: the entry point predicts a model that already exists
    (``lambda: model``) on a fake copy, and the message says so."""
    cls = type(make_model).__name__ if isinstance(make_model, nn.Module) else "MyNet"
    note = (", or lambda: model for a model you already have (predicted on a fake copy; the model is left as it "
            "is)") if copied and isinstance(make_model, nn.Module) else ""
    check_factory(make_model, name, f"lambda: {cls}(...){note}")


def check_optimizer_factory(make_optimizer: Any, name: str = "make_optimizer") -> None:
    """``check_factory`` for an optimizer factory, which builds an optimizer over the parameters it is given."""
    opt = make_optimizer
    cls = f"torch.optim.{type(opt).__name__}" if isinstance(opt, torch.optim.Optimizer) and \
        getattr(torch.optim, type(opt).__name__, None) is type(opt) else "torch.optim.AdamW"
    check_factory(opt, name, f"lambda params: {cls}(params, ...), which builds it over the parameters it is given")


def check_factories(make_model: Any, make_optimizer: Any, make_batch: Any, *, batch: str = "lambda: batch",
                    copied: bool = True) -> None:
    """The checks above for the three factories of a training step (``batch``: the batch factory to suggest)."""
    check_model_factory(make_model, copied=copied)
    check_optimizer_factory(make_optimizer)
    check_factory(make_batch, "make_batch", batch, builds="the batch")


def real_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The model's tensors (parameters, buffers, tensor attributes) that are not fake: ones that existed
    before a factory was called under ``FakeTensorMode`` (it builds fake ones)."""
    return [t for t in _tensors(model).values() if not isinstance(t, FakeTensor)]


def fake_copy(model: nn.Module, fake_mode: FakeTensorMode) -> nn.Module:
    """A copy of ``model`` whose tensors are fake ones of ``fake_mode``; ``model`` is only read.

    Each real parameter, buffer and tensor attribute becomes a fake tensor of the same metadata (tied and
    aliasing tensors stay tied: fake storages follow real ones), without its gradient: a freshly built model
    has none. Everything else is deep-copied, hooks on modules included. Hooks registered on the tensors
    themselves are not copied: they act on the user's tensors.

    Raises:
        ValueError: the model cannot be deep-copied; pass a factory that builds a new one.
    """
    memo: dict[int, Any] = {}
    for key, t in _tensors(model).items():
        memo[key] = t if isinstance(t, FakeTensor) else _fake_of(t, fake_mode)
    try:
        with fake_mode:
            return copy.deepcopy(model, memo)
    except Exception as err:  # something of the user's that copy.deepcopy refuses (a lock, a file...)
        raise ValueError(
            f"make_model returned a model that already exists ({type(model).__name__}: its tensors are real), and "
            f"it cannot be copied to fake tensors ({type(err).__name__}: {err}). The model is unchanged; pass a "
            f"function that builds a new one: lambda: {type(model).__name__}(...)") from err


class ValuesWhileBuilding(TorchDispatchMode):
    """While a model is built on fake tensors: a value read from a tensor whose values a fake tensor does not
    hold (``.item()``, ``bool(t.any())``: ``aten._local_scalar_dense``) is made up instead of refused.

    Building a model reads values in its weight initialisers: torch's own ``nn.init.trunc_normal_`` (used by
    timm's and transformers' ViT, ConvNeXt and Swin) redraws out-of-range values ``while mask.any()``. The
    values a fake model would get do not exist, and the memory a model holds does not depend on them, only on
    its shapes: so a truth value reads ``False`` (nothing is out of range: a redrawing loop ends at once) and a
    floating-point one ``1.0`` (a scale read from the weights divides nothing by zero). An integer can size a
    tensor: it reads ``1`` and is listed in ``made_up`` (the prediction names it), as the memory may then
    differ from a real run's. Values a fake tensor does hold (a constant, a small tensor followed by
    ``FakeKernelCheck``) are read as they are. Filling a fake tensor whose values nothing follows (``_FILLS``:
    the initialisers' normal_, uniform_, zero_ and fill_) is skipped: it would change nothing.
    """

    MADE_UP = {"bool": False, "float": 1.0, "int": 1}

    def __init__(self) -> None:
        super().__init__()
        self.made_up: dict[str, int] = {}  # kind of value ('bool', 'float', 'int') -> reads made up
        self._lists: list[TensorsFromFakeLists] = []

    def __enter__(self):
        lists = TensorsFromFakeLists()  # (a torch-function mode: entered with this one, left with it)
        lists.__enter__()
        self._lists.append(lists)
        try:
            return super().__enter__()
        except BaseException:
            self._lists.pop().__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._lists.pop().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _FILLS and valueless(args[0]):
            return args[0]
        try:
            return func(*args, **(kwargs or {}))
        except DataDependentOutputException:
            if func is not torch.ops.aten._local_scalar_dense.default:
                raise
            kind = _kind(args[0])
            self.made_up[kind] = self.made_up.get(kind, 0) + 1
            return self.MADE_UP[kind]


class ValuesInStep:
    """While a predicted step runs on fake tensors: a value the user's own code reads from a tensor whose values a
    fake tensor does not hold (``loss.item()`` to log it, ``if torch.isnan(loss):``) is made up as a healthy step's,
    as ``ValuesWhileBuilding`` makes one up: a truth value ``False`` (no NaN, nothing to skip), a floating-point one
    ``1.0`` (a loss; nothing divided by it fails), an integer ``1``; each counted by kind in ``made_up``, which the
    prediction names. A value that a library reads inside its own code (``F.gaussian_nll_loss`` checks its variances,
    ``torch.optim.ASGD`` branches on its averaging factor: ``read_by_users_code``) is refused, with an error that
    names the library's line: how the library goes on may depend on it. ``gpukit.fakecheck.FakeKernelCheck`` asks it
    (its ``values``) where a read fails: no dispatch mode of its own, which would cost every op of the step
    (``ReadValues`` is one, for a fake run without that check)."""

    MADE_UP = ValuesWhileBuilding.MADE_UP

    def __init__(self) -> None:
        self.made_up: dict[str, int] = {}  # kind of value ('bool', 'float', 'int') -> reads made up

    def value(self, t: torch.Tensor) -> bool | float | int | ValueReadByLibrary:
        """The value made up for ``t.item()`` read by the user's code, counted; where a library reads it, the
        error to raise, which names the library's line."""
        reader = value_reader()
        if not read_by_users_code(reader):
            where = f"{reader[0]}:{reader[1]} ({reader[2]})" if reader is not None else "torch"
            return ValueReadByLibrary(torch.ops.aten._local_scalar_dense.default, (
                f"aten._local_scalar_dense: {where} reads a value from a fake tensor, which a prediction cannot "
                "follow: the library goes on by it. Values your own step reads (loss.item()) are made up as a healthy "
                "step's; a library's are not. Predict the step without that call, or measure it on a GPU"))
        kind = _kind(t)
        self.made_up[kind] = self.made_up.get(kind, 0) + 1
        return self.MADE_UP[kind]

    def name(self, unfollowed: dict[str, str]) -> dict[str, str]:
        """What the values made up leave unchecked: a truth value may have chosen a branch (named in
        ``unfollowed``); an integer may have sized a tensor (returned, for a prediction's ``unverified_ops``)."""
        read = self.made_up
        if read.get("bool"):
            unfollowed["truth values read in the step"] = (
                f"{read['bool']} read from fake tensors (if torch.isnan(loss): ...) were taken as False, a healthy "
                "step's: a branch on one ran its False side")
        if not read.get("int"):
            return {}
        return {"integers read in the step": (
            f"{read['int']} integer value(s) read from tensors in the step, which fake tensors do not hold, were "
            "taken as 1: a size or a count computed from one may differ from a real run's")}


class ValueReadByLibrary(DataDependentOutputException):
    """A value read from a fake tensor inside a library's code (torch's public functions, an installed package),
    which a prediction cannot follow: the library goes on by it. Fake tensors' own DataDependentOutputException (a
    RuntimeError), so that code which catches that catches this, with a message that names the library's line."""

    def __init__(self, func, message: str) -> None:
        super().__init__(func)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ReadValues(TorchDispatchMode):
    """``ValuesInStep`` as a dispatch mode, for a fake run without a ``FakeKernelCheck`` to ask it
    (``predict_offload``)."""

    def __init__(self, values: ValuesInStep) -> None:
        super().__init__()
        self.values = values

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return func(*args, **(kwargs or {}))
        except DataDependentOutputException as err:
            if func is not torch.ops.aten._local_scalar_dense.default:
                raise
            made = self.values.value(args[0])
            if isinstance(made, BaseException):
                raise made from err
            return made


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_GPUKIT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARIES = tuple(os.sep + d + os.sep for d in ("site-packages", "dist-packages"))


def value_reader() -> tuple[str, int, str] | None:
    """The code reading a value now (``_local_scalar_dense``): ``(file, line, function)`` of the innermost Python
    frame outside gpukit and torch's machinery (its private modules: dispatch, fake tensors, ``_tensor.py``'s
    ``__format__``...); None where there is none."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        inside = name[len(_TORCH_DIR):].split(os.sep) if name.startswith(_TORCH_DIR) else None
        if name.startswith(_GPUKIT_DIR) or (inside is not None and (
                any(part.startswith("_") for part in inside) or inside == ["overrides.py"])):
            frame = frame.f_back
            continue
        return name, frame.f_lineno, frame.f_code.co_name
    return None


def read_by_users_code(reader: tuple[str, int, str] | None) -> bool:
    """Whether ``reader`` (``value_reader()``) is the user's code: neither torch's public code
    (``torch.nn.functional``, ``torch.optim``) nor an installed library's (site-packages), but a notebook's cell, a
    script, a test."""
    return reader is not None and not reader[0].startswith(_TORCH_DIR) and not any(d in reader[0] for d in _LIBRARIES)


def _kind(t: torch.Tensor) -> str:
    return "bool" if t.dtype is torch.bool else "float" if t.is_floating_point() or t.is_complex() else "int"


class TensorsFromFakeLists(TorchFunctionMode):
    """``torch.tensor(data)`` and ``torch.as_tensor(data)`` of a list (or tuple, nested) holding fake tensors, run on
    fake tensors: PyTorch's C++ reads each element's data pointer (torch/csrc/utils/tensor_new.cpp,
    ``internal_new_from_data``), which a fake tensor has none of ("The tensor has a non-zero number of elements, but
    its data is not allocated yet"). A builder that scales its rotary frequencies so (torchtune's Llama 3.1 RoPE:
    ``torch.tensor([f(x) for x in freqs])``) then builds on fake tensors. The result is what torch makes: the
    list's shape, each element a one-element tensor or a number, the dtype torch infers (``promote_types`` of the
    elements' dtypes, a Python float the default dtype, an int int64, a bool bool) unless ``dtype=`` says, on
    ``device=`` or the default device, not tracking gradients unless ``requires_grad=True``. Any other data goes
    to torch as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.tensor or func is torch.as_tensor:
            named = dict(kwargs)  # (both take the data alone by position: tensor(data, *, dtype=None, ...))
            data = args[0] if args else named.pop("data", None)
            found = _list_leaves(data) if isinstance(data, (list, tuple)) else None
            if found is not None and any(isinstance(x, FakeTensor) for x in found[1]):
                return _tensor_from_leaves(*found, **named)
        return func(*args, **kwargs)


def _list_leaves(data) -> tuple[tuple[int, ...], list] | None:
    """The shape of a nested list and its elements in order, or None where torch would refuse it (ragged, or an
    element of more than one value) or it holds something else."""
    if isinstance(data, (list, tuple)):
        parts = [_list_leaves(d) for d in data]
        if any(p is None for p in parts) or len({p[0] for p in parts}) > 1:
            return None
        return (len(data),) + (parts[0][0] if parts else ()), [x for p in parts for x in p[1]]
    if isinstance(data, torch.Tensor):
        return ((), [data]) if data.numel() == 1 else None
    if isinstance(data, (bool, int, float)):
        return (), [data]
    return None


def _tensor_from_leaves(shape, leaves, dtype=None, device=None, requires_grad=False, pin_memory=False):
    if dtype is None:
        for x in leaves:
            kind = (x.dtype if isinstance(x, torch.Tensor) else torch.bool if isinstance(x, bool)
                    else torch.int64 if isinstance(x, int) else torch.get_default_dtype())
            dtype = kind if dtype is None else torch.promote_types(dtype, kind)
    device = torch.device(device) if device is not None else torch.get_default_device()
    values = [x.detach().reshape(()).to(device=device, dtype=dtype) if isinstance(x, torch.Tensor)
              else torch.tensor(x, dtype=dtype, device=device) for x in leaves]
    out = torch.stack(values).reshape(shape)
    return out.requires_grad_() if requires_grad else out


# Initialisers that fill a tensor in place (normal_, uniform_, zeros, a constant): they allocate nothing and change
# no size, and on a fake tensor they change nothing at all. ``ValuesWhileBuilding`` returns the tensor as it is,
# without the dispatch through every mode a prediction stacks (half the ops that building a transformer runs).
_FILLS = frozenset({torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default, torch.ops.aten.zero_.default,
                    torch.ops.aten.fill_.Scalar})


def valueless(t) -> bool:
    """A fake floating-point tensor too big for ``FakeKernelCheck`` to follow its values (their filling would
    matter there): nothing reads what it holds."""
    return isinstance(t, FakeTensor) and t.is_floating_point() and t.numel() > GENUINE_FLOATS_LIMIT


def building() -> bool:
    """Whether a ``ValuesWhileBuilding`` is in force on this thread."""
    return any(isinstance(m, ValuesWhileBuilding) for m in _get_current_dispatch_mode_stack())


_SWAPPING = threading.RLock()


@contextlib.contextmanager
def swappable_fakes(mode: FakeTensorMode | None):
    """Let ``nn.Module.to(dtype)`` convert a fake model's parameters (``model.to(torch.bfloat16)``).

    ``nn.Module._apply`` replaces a fake parameter with ``torch.utils.swap_tensors`` (torch/nn/modules/
    module.py: always for a ``FakeTensor``), which refuses a tensor that has weak references. The fake mode's
    converter holds one to every tensor an op made (``FakeTensorConverter.from_meta_and_device`` memoises the
    fake tensor by its meta tensor's id: torch/_subclasses/fake_tensor.py), so every parameter built from an
    op's output (``nn.Parameter(t)`` detaches ``t``) cannot be swapped. A memo entry only saves converting
    that meta tensor again, which never happens after the op: the entries of the two tensors swapped are
    dropped first."""
    if mode is None:
        yield
        return
    memo = mode.fake_tensor_converter.meta_converter.tensor_memo

    def swap_tensors(t1, t2):
        ids = {id(t1), id(t2)}
        for key in [key for key, value in list(memo.items()) if id(value) in ids]:
            memo.pop(key, None)
        return swap(t1, t2)  # (the swap_tensors in place when this one was installed)

    with _SWAPPING:  # one at a time: a thread's restore must not undo another's, or leave its function in place
        swap = torch.utils.swap_tensors
        torch.utils.swap_tensors = swap_tensors
        try:
            yield
        finally:
            torch.utils.swap_tensors = swap


# Where the libraries a candidate needs talk when imported: torchao's kernels for other GPUs it could not load,
# torch's warning about how torchao registers its enums, bitsandbytes' CPU backend missing an optional kernel
# package, peft's own notices.
IMPORT_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes", "peft")


@contextlib.contextmanager
def this_threads_warnings():
    """Inside the block, every warning this thread issues is recorded in the list it yields (each time it is issued:
    the "always" filter) instead of reaching the output; another thread's warning (a data loader's, a logger's) is
    shown as it would be. On exit, the filters and ``warnings.showwarning`` are as they were.

    ``warnings.catch_warnings(record=True)`` records every thread's: a plan would swallow what the user's other
    threads warned while it ran."""
    me, log = threading.get_ident(), []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning  # the one in force: another thread's warning still goes there

        def show(message, category, filename, lineno, file=None, line=None):
            if threading.get_ident() == me:
                log.append(warnings.WarningMessage(message, category, filename, lineno, file, line))
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield log


@contextlib.contextmanager
def quiet_import():
    """Import a library a prediction needs (peft, torchao, bitsandbytes, transformers' quantizers) outside any fake mode
    (the tensors a library makes when imported stay real, and no fake storage lives on in its modules, which would
    make every later prediction collect all garbage first: ``gpukit.estimate.predict``), with what it logs
    (``IMPORT_LOGGERS``) and warns kept out of the user's output. Where the import fails, what it said is shown
    then, before the error."""

    kept: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record)

    keep, saved = Keep(), []
    for name in IMPORT_LOGGERS:
        log = logging.getLogger(name)
        saved.append((log, log.propagate))
        log.addHandler(keep)
        log.propagate = False
    try:
        with this_threads_warnings() as warned, _disable_current_modes():
            yield
    except BaseException:
        _restore(saved, keep)
        for record in kept:
            logging.getLogger(record.name).handle(record)
        for w in warned:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        raise
    _restore(saved, keep)


def _restore(saved: list[tuple[logging.Logger, bool]], handler: logging.Handler) -> None:
    for log, propagate in saved:
        log.removeHandler(handler)
        log.propagate = propagate


def preload_quietly() -> None:
    """Import, quietly and outside any fake mode, what transformers imports on a model's first build: its
    quantizers, which import torchao (``transformers/quantizers/auto.py``), whose load messages would otherwise
    reach the user from inside a prediction, and whose modules would keep fake tensors made while they load."""
    if "transformers" in sys.modules and "transformers.quantizers.auto" not in sys.modules:
        try:
            with quiet_import():
                importlib.import_module("transformers.quantizers.auto")
        except Exception:  # a transformers without it: the model's own build imports what it needs
            pass


def fake_model(make_model: Callable[[], nn.Module], values: ValuesWhileBuilding | None = None) -> nn.Module:
    """``make_model()`` under the fake mode in force; where that returns a model holding real tensors (one that
    already existed: ``lambda: model``), a ``fake_copy`` of it. Outside a fake mode, ``make_model()`` itself.
    ``values``: a ``ValuesWhileBuilding`` to build under, for initialisers that read values (where none is given
    and none is in force, a new one)."""
    preload_quietly()
    mode = active_fake_mode()
    if values is None and mode is not None and not building():
        values = ValuesWhileBuilding()  # (the planner's bounds build models too: a ViT's trunc_normal_ reads values)
    with swappable_fakes(mode), (values if values is not None else contextlib.nullcontext()):
        model = make_model()
    check_model(model)
    if mode is None or not real_tensors(model):
        return model
    return fake_copy(model, mode)


def check_model(model: Any) -> None:
    """Raise a TypeError where ``make_model()`` returned something else than a model (``lambda: 3``), naming it."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"make_model() must return the model, a torch.nn.Module; it returned "
                        f"{type(model).__name__}: {short_repr(model)}")


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to 80 characters, for an error message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_optimizer(optimizer: Any) -> None:
    """Under ``FakeTensorMode``: raise a ValueError where the optimizer holds a real tensor, so that it
    existed before its factory was called (``lambda params: optimizer``) and a fake step would change it.

    Raises:
        TypeError: for something that is not an optimizer (``lambda params: None``).
        ValueError: saying to build a new optimizer from the parameters given.
    """
    groups = getattr(optimizer, "param_groups", None)
    if not (callable(getattr(optimizer, "step", None)) and isinstance(groups, (list, tuple))):
        raise TypeError(f"make_optimizer(parameters) must return the optimizer, a torch.optim.Optimizer (or one with "
                        f"its step() and param_groups); it returned {type(optimizer).__name__}: "
                        f"{short_repr(optimizer)}")
    held = [p for group in groups for p in group.get("params", ())]
    if any(isinstance(p, torch.Tensor) and not isinstance(p, FakeTensor) for p in held):
        name = type(optimizer).__name__
        where = f"torch.optim.{name}" if getattr(torch.optim, name, None) is type(optimizer) else name
        raise ValueError(
            f"make_optimizer returned an optimizer ({name}) over real tensors, not over the parameters it was "
            "given: one that already exists, which a prediction would step. It is left as it is; build a new one "
            f"from the parameters given: lambda params: {where}(params, ...)")
    refuse_unpredictable_optimizer(optimizer)


# torchao.optim's optimizers whose state is a quantised tensor subclass, stepped by torch.compile(fullgraph=True)
# (torchao/optim/adam.py, _AdamBase.step: single_param_adam). Dynamo compiles nothing while a dispatch mode runs,
# and fullgraph=True makes that an error: the fake step cannot run them.
TORCHAO_LOW_BIT = {"Adam8bit", "AdamW8bit", "Adam4bit", "AdamW4bit", "AdamFp8", "AdamWFp8"}


class UnsupportedOptimizer(NotImplementedError):
    """An optimizer a prediction cannot run: the message names its library and what to do instead."""


def refuse_unpredictable_optimizer(optimizer: Any) -> None:
    """Raise ``UnsupportedOptimizer`` for an optimizer whose step cannot run on fake tensors (torchao's low-bit
    optimizers), before any step: never a fake-tensor exception from inside the library."""
    cls = type(optimizer)
    if cls.__module__.startswith("torchao.optim") and cls.__name__ in TORCHAO_LOW_BIT:
        bits = "8-bit" if "8bit" in cls.__name__ else "4-bit" if "4bit" in cls.__name__ else "FP8"
        raise UnsupportedOptimizer(
            f"torchao.optim.{cls.__name__} cannot be predicted: its step is torch.compile(fullgraph=True) over "
            f"{bits} state tensors, and torch.compile does not run under the fake tensors a prediction steps with. "
            "Instead: predict bitsandbytes.optim.AdamW8bit, whose 8-bit state plan() and predict() count "
            "(torchao's 8-bit state is the same 1 byte a value, in blocks of 256 with a float32 scale each); or "
            "predict torch.optim.AdamW and count its two float32 moments at the state's width; or measure the "
            "step on a GPU with %%gpumem.")


def _tensors(model: nn.Module) -> dict[int, torch.Tensor]:
    """Every tensor the model's modules hold in their attributes (parameters, buffers, plain tensors, inside
    lists and dicts too), by id."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for value in vars(module).values():
            _visit(value, found)
    return found


def _visit(value, found: dict[int, torch.Tensor]) -> None:
    """The tensors ``tree_flatten(value)`` reaches, into ``found``, without its bookkeeping for every leaf (a
    module's attributes have hundreds). (Not a closure: a nested function that calls itself is a reference cycle,
    which would keep ``found`` and its tensors alive until the next collection.)"""
    if isinstance(value, torch.Tensor):
        found.setdefault(id(value), value)
    elif type(value) in (dict, list, tuple):
        for v in (value.values() if type(value) is dict else value):
            _visit(v, found)
    elif type(value) in SUPPORTED_NODES or isinstance(value, tuple) and hasattr(value, "_fields"):
        for leaf in tree_flatten(value)[0]:  # (an OrderedDict, a named tuple...)
            _visit(leaf, found)


def _fake_of(t: torch.Tensor, fake_mode: FakeTensorMode) -> torch.Tensor:
    """A fake tensor like ``t`` (a parameter stays one, with its ``requires_grad``), without its gradient."""
    with _disable_current_modes():  # a real view, made outside the fake mode (which may refuse real inputs)
        detached = t.detach()  # from_tensor would make a fake of the gradient too
    fake = fake_mode.from_tensor(detached)
    if isinstance(t, nn.Parameter):
        with fake_mode:
            return nn.Parameter(fake, requires_grad=t.requires_grad)
    if t.requires_grad:
        fake.requires_grad_()
    return fake


__all__ = ["check_factory", "check_model_factory", "check_optimizer_factory", "check_factories", "check_optimizer",
           "check_model", "short_repr", "fake_copy", "fake_model", "real_tensors", "valueless", "building",
           "ValuesWhileBuilding", "ValuesInStep", "ValueReadByLibrary", "ReadValues", "value_reader",
           "read_by_users_code", "TensorsFromFakeLists"]
