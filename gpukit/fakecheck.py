"""Checking fake kernels against the real ones, so that a prediction is exact or says where it may not be.

A prediction runs the step under ``FakeTensorMode``: every op's output sizes come from its
fake (meta) kernel. For most ops that kernel is the real one's own shape logic: a *structured*
kernel (``structured: True`` in aten/src/ATen/native/native_functions.yaml) computes its output
sizes in one meta function that the CPU, CUDA and Meta kernels share, and a view allocates
nothing. Other ops have a fake kernel written apart from the real one, and it can be wrong:
``aten.mkldnn_rnn_layer``'s returns an empty workspace where the real CPU kernel returns
12.5 MB for a small LSTM layer.

``FakeKernelCheck`` sits above the fake mode and, once per op and input signature (shapes,
strides, dtypes, other arguments), runs the real op on the CPU with small real inputs of the
same signature, then

* compares the sizes of the outputs; where the real ones differ, the fake outputs are replaced
  by fake tensors of the real sizes, here and every time the signature comes back;
* raises the real op's error when the real op refuses the inputs (a float64 batch into a float32
  ``Linear``, class labels out of range): the step would fail for real. Inputs whose values are
  known (integer tensors of a real batch, and what is computed from them) are used as they are;
  integer inputs of unknown value are not made up (a made-up index can crash a kernel, not just
  make it raise); floats are made up (0.5; after an error, drawn from [0, 1)), and an error counts
  only when both fillings raise it, so that an error caused by the made-up values does not;
* where the op is too big to run here (``limit`` bytes of inputs and outputs), it cannot know:
  an op that is not structured, allocates, and has an output of a shape none of its inputs has is
  then named in ``unverified``, and the prediction is a lower bound where such a kernel leaves
  memory out (the wrong fake kernels seen so far all did: workspaces returned empty). An op whose
  outputs mirror its inputs' shapes (element-wise, casts, copies, foreach ops), or whose output shapes
  follow a rule read from its real kernel (``SHAPE_RULES``: embeddings, CPU flash attention), is not
  named.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ._torch import DataDependentOutputException, FakeTensor, TorchDispatchMode, _disable_current_modes, tree_flatten, tree_unflatten

CHECK_LIMIT = 16 * 2**20  # bytes of inputs and outputs up to which an op is run for real
LOW_PRECISION_LIMIT = 2**20  # the same for a structured op with float16 or bfloat16 inputs (slow on many CPUs)
KNOWN_VALUES_LIMIT = 2**20  # elements: integer tensors whose real values are followed through the step
GENUINE_FLOATS_LIMIT = 64  # elements: small float tensors (optimizer scalars) followed where their values are real


@dataclass(frozen=True)
class Finding:
    """What the real op said about one signature: the outputs whose sizes differ, as (index, shape, stride,
    dtype, (storage elements, storage offset)), or why it could not be run."""

    corrections: tuple = ()
    unverified: str = ""


@functools.cache
def structured_ops() -> frozenset[str]:
    """Names (``add.Tensor``) of the ATen ops whose output sizes come from a meta function shared by
    every backend: structured kernels and the functional variants that delegate to one."""
    try:
        from importlib.resources import files

        text = (files("torchgen") / "packaged/ATen/native/native_functions.yaml").read_text()
    except Exception:  # no torchgen in this installation: trust nothing by structure, check more
        return frozenset()
    names = set()
    for entry in text.split("\n- func: ")[1:]:
        name = entry.split("(", 1)[0].strip()
        if "\n  structured: True" in entry or "\n  structured_delegate:" in entry:
            names.add(name if "." in name else name + ".default")
    return frozenset(names)


@functools.cache
def _trusted(func) -> bool:
    """Whether ``func``'s fake outputs are the real ones by construction: structured, or it allocates
    nothing (every output aliases an input), or it has no tensor input (a factory: sizes are its arguments)."""
    schema = func._schema
    if all(r.alias_info is not None for r in schema.returns):
        return True
    if not any("Tensor" in str(a.type) for a in schema.arguments):
        return True
    name = schema.name.split("::", 1)[-1] + "." + (schema.overload_name or "default")
    return name in structured_ops()


def _cpu_stand_in(func, args):
    """``func`` itself, or where its arguments ask for a variant only CUDA's kernel has, the same computation on the
    CPU: softmax and log-softmax of a float16 input to float32 (``half_to_float``, which gpukit.cuda_autocast takes
    as CUDA does: aten/src/ATen/native/SoftMax.cpp) and their backward, whose float32 gradient gives a float16 one.
    The CPU kernels refuse both ("softmax with half to float conversion is not supported on CPU")."""
    aten = torch.ops.aten
    if func in (aten._softmax.default, aten._log_softmax.default) and len(args) > 2 and args[2]:
        return lambda x, dim, half_to_float: func(x.float(), dim, False)
    if func in (aten._softmax_backward_data.default, aten._log_softmax_backward_data.default) and len(args) > 3 \
            and isinstance(args[0], torch.Tensor) and args[0].dtype != args[3]:
        return lambda grad, out, dim, dtype: func(grad, out, dim, grad.dtype).to(dtype)
    return func


# Output shapes of ops that are not structured and whose outputs are not their inputs' shapes, as their real
# kernels make them, for the ops every language model meets at sizes too big to run here. A fake output of these
# shapes is the real one (tests/test_fakecheck.py runs each real kernel at small sizes against its rule).
SHAPE_RULES = {
    # aten/src/ATen/native/Embedding.cpp, embedding: weight.index_select(0, indices.reshape(-1)), viewed as
    # indices' shape + (embedding dim,)
    "aten.embedding.default": lambda args: [(*args[1].shape, args[0].shape[-1])],
    # Embedding.cpp, embedding_dense_backward_cpu: a (num_weights, grad.size(-1)) gradient of the weight
    "aten.embedding_dense_backward.default": lambda args: [(args[2], args[0].shape[-1])],
    # aten/src/ATen/native/TensorShape.cpp, slice_backward: zeros of input_sizes, the gradient copied into a slice
    "aten.slice_backward.default": lambda args: [tuple(args[1])],
    # aten/src/ATen/native/layer_norm.cpp, layer_norm_cpu: the output like the input, the mean and rstd with the
    # normalized dimensions kept as 1s
    "aten.native_layer_norm.default": lambda args: [tuple(args[0].shape)] + 2 * [
        (*args[0].shape[:args[0].dim() - len(args[1])], *[1] * len(args[1]))],
    # aten/src/ATen/native/TensorShape.cpp, stack: the tensors (of one shape) each unsqueezed at dim, wrapped over
    # their dim() + 1 dimensions, then cat along it (a rotary cache: torchtune's stacks its cosines and sines)
    "aten.stack.default": lambda args: [_stacked(args[0], args[1] if len(args) > 1 else 0)],
    # aten/src/ATen/native/transformers/attention.cpp, _scaled_dot_product_flash_attention_cpu: the output
    # (batch, heads, queries, value dim) and the logsumexp (batch, heads, queries)
    "aten._scaled_dot_product_flash_attention_for_cpu.default": lambda args: [
        (*args[0].shape[:-1], args[2].shape[-1]), tuple(args[0].shape[:-1])],
}


def _stacked(tensors, dim: int) -> tuple[int, ...]:
    """``torch.stack(tensors, dim)``'s output shape."""
    shape = tuple(tensors[0].shape)
    d = dim % (len(shape) + 1)
    return (*shape[:d], len(tensors), *shape[d:])


def _by_rule(func, args, flat_out) -> bool:
    """Whether ``func`` has a ``SHAPE_RULES`` entry and its fake outputs have the shapes it gives."""
    rule = SHAPE_RULES.get(str(func))
    if rule is None:
        return False
    try:
        expected = [tuple(shape) for shape in rule(args)]
    except (IndexError, AttributeError, TypeError):  # called another way than the rule reads it: not known
        return False
    return expected == [tuple(o.shape) for o in flat_out if isinstance(o, torch.Tensor)]


def _mirrors(tensors, flat_out) -> bool:
    """Whether every output has the shape of one of the op's tensor inputs: an element-wise op, a cast, a copy,
    a foreach op over a list. Such a kernel's output sizes are its inputs' (the dtype is in the fake output);
    the wrong fake kernels seen so far returned a workspace of some other size (empty where the real one is not),
    which this never is."""
    shapes = {tuple(t.shape) for t in tensors}
    outputs = [o for o in flat_out if isinstance(o, torch.Tensor)]
    return bool(outputs) and all(tuple(o.shape) in shapes and o.layout is torch.strided for o in outputs)


def _followable_factory(func, out) -> bool:
    """A factory op (``torch.full``, ``torch.arange``, ``torch.randint``) whose small integer output can be made."""
    return (isinstance(out, torch.Tensor) and not out.is_floating_point() and not out.is_complex()
            and out.layout is torch.strided and out.device.type == "cpu" and out.numel() <= KNOWN_VALUES_LIMIT)


@contextlib.contextmanager
def _real_run():
    """Run an op for real: outside every mode (the counters see nothing), in the grad mode of the step (kernels
    read it: mkldnn_rnn_layer returns its workspace only when grad is on; the made-up inputs need no grad), and
    with the CPU's random state put back (a checked dropout must not move the user's random numbers)."""
    with _disable_current_modes():
        state = torch.get_rng_state()
        try:
            yield
        finally:
            torch.set_rng_state(state)


def _signature(x):
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.stride() if x.layout is torch.strided else None, x.dtype, x.device.type,
                x.layout)
    if isinstance(x, (list, tuple)):
        return tuple(_signature(v) for v in x)
    return repr(x)


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except Exception:
        return t.numel() * t.element_size()


class _MetaFailuresUnlogged(logging.Filter):
    """Drops FakeTensorMode's "failed while attempting to run meta for <op>" log record, with its traceback, on the
    threads where a ``FakeKernelCheck`` is open (torch/_subclasses/fake_tensor.py logs it at ERROR for every fake
    kernel that raises). The check raises that error itself, or the real kernel's error for the same inputs, with its
    traceback: the log only printed it once more, before the user's own error."""

    MESSAGE = "failed while attempting to run meta for"
    LOGGER = "torch._subclasses.fake_tensor"

    def __init__(self) -> None:
        super().__init__()
        self.open: dict[int, int] = {}  # thread ident -> checks open on it
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        return not (threading.get_ident() in self.open and isinstance(record.msg, str)
                    and record.msg.startswith(self.MESSAGE))

    def enter(self) -> None:
        with self.lock:
            if not self.open:
                logging.getLogger(self.LOGGER).addFilter(self)
            ident = threading.get_ident()
            self.open[ident] = self.open.get(ident, 0) + 1

    def exit(self) -> None:
        with self.lock:
            ident = threading.get_ident()
            if self.open.get(ident, 0) > 1:
                self.open[ident] -= 1
            else:
                self.open.pop(ident, None)
            if not self.open:
                logging.getLogger(self.LOGGER).removeFilter(self)


_META_FAILURES = _MetaFailuresUnlogged()


class FakeKernelCheck(TorchDispatchMode):
    """Checks fake kernels against real CPU kernels (see the module's docstring); enter it inside the fake mode.

    After the block, ``corrected`` maps each op whose fake outputs were replaced to the bytes added per call,
    and ``unverified`` each op that could not be checked to the reason.
    """

    _cache: dict = {}  # signature -> Finding, for the whole process: a kernel does not change

    def __init__(self, limit: int | None = None) -> None:
        super().__init__()
        self.limit = CHECK_LIMIT if limit is None else limit
        self.corrected: dict[str, int] = {}
        self.unverified: dict[str, str] = {}
        self.known = WeakIdKeyDictionary()  # fake integer tensor -> real tensor holding valid values
        self.genuine = WeakIdKeyDictionary()  # fake tensor -> real tensor holding the values a real run has
        self.opaque = WeakIdKeyDictionary()  # corrected outputs (workspaces) -> the op that made them
        self._seen: set = set()  # funcs met, for ``quick``
        self._fix: set = set()  # funcs with a correction
        self.quick = False  # after a warm-up step: only ops not met yet, or corrected, are looked at
        # What makes up a value read from a tensor nobody follows (an object whose ``value(tensor)`` gives it, or the
        # exception to raise: predict's gpukit.factories.ValuesInStep while its steps run); None: each is refused.
        self.values = None
        self._generator = torch.Generator().manual_seed(0)  # made-up values leave the user's random state alone

    def __enter__(self):
        _META_FAILURES.enter()
        try:
            return super().__enter__()
        except BaseException:
            _META_FAILURES.exit()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _META_FAILURES.exit()

    def know(self, fake: torch.Tensor, real: torch.Tensor, genuine: bool = True) -> None:
        """Follow the values of ``real`` (an integer tensor of the batch, say) as those of ``fake``, where small.

        ``genuine``: the values a real run has (from the batch, or computed from genuine values only); others
        are valid made-up ones (indices that a made-up input gave), good for running kernels, not for reading.
        """
        if real.layout is not torch.strided or real.device.type == "meta":  # a meta tensor holds no values
            return
        if not real.is_floating_point() and not real.is_complex() and real.numel() <= KNOWN_VALUES_LIMIT:
            self.known[fake] = real
        if genuine and real.numel() <= GENUINE_FLOATS_LIMIT or (genuine and fake in self.known):
            self.genuine[fake] = real

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except DataDependentOutputException as err:
            if func is torch.ops.aten._local_scalar_dense.default:
                if args[0] in self.genuine:
                    with _disable_current_modes():
                        return self.genuine[args[0]].item()  # ``.item()`` of a value that is known for real
                if self.values is not None:
                    made = self.values.value(args[0])
                    if isinstance(made, BaseException):
                        raise made from err
                    return made
            raise
        except Exception as fake_error:
            real_error = self._real_error(func, args, kwargs)
            if real_error is None:
                raise
            raise real_error.with_traceback(None) from fake_error
        if (self.quick and func in self._seen and func not in self._fix
                and not any(isinstance(a, FakeTensor) and a in self.genuine for a in args)):
            return out
        self._seen.add(func)
        if kwargs or any(isinstance(a, (list, tuple, dict)) for a in args):
            flat_in = tree_flatten((args, kwargs))[0]
        else:
            flat_in = args
        tensors = [a for a in flat_in if isinstance(a, torch.Tensor)]
        if not tensors:
            if _followable_factory(func, out):
                with _real_run():  # random ones (randint) from the same random state as a real run
                    self.know(out, func(*args, **kwargs))
            return out
        known = self.known
        # Inputs with values (a real tensor, or followed values): rerun each time, so outputs get values too.
        has_known = any(t in known or not isinstance(t, FakeTensor) for t in tensors)
        flat_out, spec = tree_flatten(out)
        trusted = _trusted(func)
        if trusted and not has_known and func not in self._fix and (
                (size := self._size(tensors, flat_out)) > self.limit
                or (size > LOW_PRECISION_LIMIT and any(t.dtype in (torch.float16, torch.bfloat16) for t in tensors))):
            # Sizes from the meta function every backend shares: the real run would only look for an error. In
            # 16 bits it can cost much on a CPU without 16-bit arithmetic (a float16 product of 1024 x 2048 by
            # 2048 x 2048: 32 s here), and the step it checks is one planned for a GPU.
            return out
        all_genuine = all(t in self.genuine or not isinstance(t, FakeTensor) for t in tensors)
        key = (func, _signature(args), _signature(kwargs))
        finding = None if has_known else self._cache.get(key)
        real_out = None
        if finding is None:
            finding, real_out = self._check(func, args, kwargs, flat_out, tensors, trusted)
            if not has_known:
                self._cache[key] = finding
        if finding.unverified:
            self.unverified.setdefault(str(func), finding.unverified)
        if any(isinstance(o, torch.Tensor) and o.layout is not torch.strided for o in flat_out):
            self.unverified.setdefault(str(func), "returns a sparse tensor: gpukit counts strided tensors only")
        if finding.corrections:
            self._fix.add(func)
            added = 0
            for i, shape, stride, dtype, storage in finding.corrections:
                old = flat_out[i]
                storage_elems, offset = storage
                flat_out[i] = torch.empty(storage_elems, dtype=dtype, device=old.device).as_strided(shape, stride, offset)
                # A kernel's private data (a workspace) for its backward: the real bytes where this call was run.
                self.opaque[flat_out[i]] = (str(func), real_out[i] if real_out is not None else None)
                added += _nbytes(flat_out[i]) - _nbytes(old)
            self.corrected[str(func)] = max(self.corrected.get(str(func), 0), added)
            out = tree_unflatten(flat_out, spec)
        if self.genuine and func._schema.is_mutable:  # values changed in place are known only if rerun here
            for arg, t in zip(func._schema.arguments, args):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    for x in (t if isinstance(t, (list, tuple)) else [t]):
                        if isinstance(x, torch.Tensor) and not (real_out is not None and all_genuine):
                            self.genuine.pop(x, None)
        if real_out is not None:  # integer outputs (indices, masks) keep their values
            for fake, real in zip(flat_out, real_out):
                if isinstance(fake, torch.Tensor) and isinstance(real, torch.Tensor) and fake not in self.opaque:
                    self.know(fake, real, genuine=all_genuine)
        return out

    def _size(self, tensors, flat_out) -> int:
        return sum(t.numel() * t.element_size() for t in tensors) + sum(
            o.numel() * o.element_size() for o in flat_out if isinstance(o, torch.Tensor))

    def _why_not_run(self, tensors, flat_out) -> str:
        """Why the op cannot be run for real here, or "" if it can."""
        if any(t.layout is not torch.strided or t.device.type != "cpu" for t in tensors):
            return "not a strided CPU op"
        size = self._size(tensors, flat_out)
        if size > self.limit:
            return f"too big to run for real here ({size / 2**20:.0f} MiB of inputs and outputs)"
        opaque = [self.opaque[t][0] for t in tensors if t in self.opaque and self.opaque[t][1] is None]
        if opaque:
            # A kernel's private data (mkldnn_rnn_layer's workspace) made up for its backward can crash it;
            # the real one is kept only where the op that made it ran here.
            return f"takes the workspace that {opaque[0]} returns"
        if any(not (t.is_floating_point() or t.is_complex()) and t.dtype is not torch.bool and t.numel()
               and t not in self.known and t not in self.opaque and isinstance(t, FakeTensor) for t in tensors):
            # Made-up indices or offsets can make a kernel read or write out of bounds (a crash, not an error);
            # made-up masks (booleans) cannot.
            return "takes integer inputs of unknown value (indices, offsets, workspaces)"
        return ""

    def _real_inputs(self, args, kwargs, varied: bool = False):
        """Real CPU tensors for the fake ones: the known values of integer tensors, floats made up (0.5, or
        drawn from [0, 1) when ``varied``).
        Aliases stay aliases; followed values are copied (an in-place op must not change them)."""
        made: dict[int, torch.Tensor] = {}

        def real(x):
            if not isinstance(x, torch.Tensor):
                return x
            if id(x) not in made:
                value = self.known.get(x) if isinstance(x, FakeTensor) else x
                if value is None:
                    value = self.genuine.get(x)
                if value is None and x in self.opaque:
                    value = self.opaque[x][1]
                with _disable_current_modes():
                    if value is not None:
                        value = value.clone()
                    else:  # the whole storage, filled, then the same view of it (expanded strides included)
                        base = torch.empty(_nbytes(x) // x.element_size(), dtype=x.dtype, device="cpu")
                        if (x.is_floating_point() or x.is_complex()) and not varied:
                            base.fill_(0.5)
                        elif x.is_floating_point() or x.is_complex():
                            base.uniform_(0, 1, generator=self._generator)
                        else:
                            base.zero_()
                        value = base.as_strided(tuple(x.shape), x.stride(), x.storage_offset())
                made[id(x)] = value
            return made[id(x)]

        flat, spec = tree_flatten((args, kwargs))
        return tree_unflatten([real(x) for x in flat], spec)

    def _run(self, func, args, kwargs):
        """The real op's outputs (flattened) and None, or None and its error: an error counts only when made-up
        floats drawn afresh raise it too."""
        error = None
        func = _cpu_stand_in(func, args)
        for varied in (False, True):
            real_args, real_kwargs = self._real_inputs(args, kwargs, varied)
            try:
                with _real_run():
                    return tree_flatten(func(*real_args, **real_kwargs))[0], None
            except NotImplementedError as e:
                return None, e
            except Exception as e:  # noqa: BLE001 - whatever the real kernel raises is the answer
                error = e
        return None, error

    def _real_error(self, func, args, kwargs) -> Exception | None:
        """The real op's error where the fake one raised (its message is the one a user meets), where the op
        can be run here; None otherwise."""
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if not tensors or self._why_not_run(tensors, []):
            return None
        _, error = self._run(func, args, kwargs)
        return None if isinstance(error, NotImplementedError) else error

    def _check_range(self, func, args) -> None:
        """Indices of known value checked against the size they index, for the ops too big to run here that
        take them (a token id past the vocabulary, a label past the classes); the real kernels' messages."""
        aten = torch.ops.aten
        if func is aten.embedding.default and args[1] in self.genuine:
            ids, rows = self.genuine[args[1]], args[0].shape[0]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
                raise IndexError("index out of range in self")
        elif func is aten.nll_loss_forward.default and args[1] in self.genuine:
            target, classes = self.genuine[args[1]], args[0].shape[-1]
            ignore = args[4] if len(args) > 4 else -100
            bad = target[(target != ignore) & ((target < 0) | (target >= classes))]
            if bad.numel():
                raise IndexError(f"Target {int(bad[0])} is out of bounds.")

    def _check(self, func, args, kwargs, flat_out, tensors, trusted):
        """(Finding, the real op's flattened outputs or None)."""
        why = self._why_not_run(tensors, flat_out)
        if why:
            with _disable_current_modes():
                self._check_range(func, args)
            strided = [t for t in tensors if t.layout is torch.strided]
            allocates = any(isinstance(o, torch.Tensor) and (o.layout is not torch.strided or not any(
                o.untyped_storage() is t.untyped_storage() for t in strided)) for o in flat_out)
            known = trusted or _mirrors(tensors, flat_out) or _by_rule(func, args, flat_out)
            return Finding(unverified=why if allocates and not known else ""), None
        real_out, error = self._run(func, args, kwargs)
        if isinstance(error, NotImplementedError):
            return Finding(unverified=f"the real kernel cannot run here: {str(error).splitlines()[0]}"), None
        if error is not None:
            raise error.with_traceback(None)  # the step would fail for real
        fixes = []
        inputs = {id(t.untyped_storage()) for t in tensors}
        for i, (fake, real) in enumerate(zip(flat_out, real_out)):
            if not isinstance(fake, torch.Tensor) or not isinstance(real, torch.Tensor):
                continue
            if fake.layout is not torch.strided or id(fake.untyped_storage()) in inputs:
                continue
            if _nbytes(fake) != _nbytes(real):
                fixes.append((i, tuple(real.shape), real.stride(), real.dtype,
                              (_nbytes(real) // real.element_size(), real.storage_offset())))
        return Finding(corrections=tuple(fixes)), real_out


__all__ = ["FakeKernelCheck", "Finding", "CHECK_LIMIT", "structured_ops"]
