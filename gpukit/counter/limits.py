"""Refusing what passes a budget: what an op will allocate on the CPU, known before it runs (from its
arguments, else from the op run on meta tensors), and the ``torch.OutOfMemoryError`` past a cap."""

from __future__ import annotations

import math

import torch

from .._torch import tree_flatten
from .mode import ALIASES, alias_entry
from .sizes import round_up


class Limits:
    """The ledger's part that checks its budgets (``Ledger.limits``)."""

    def _over_budget(self, nbytes: int, storage: torch.UntypedStorage | None = None
                     ) -> torch.OutOfMemoryError | None:
        """The error for ``nbytes`` more (a new storage, or ``storage`` at its new size), or None if they fit."""
        if not self.limits:
            return None
        want, live, tightest = round_up(nbytes), self._live_rounded, None
        for cap in self.limits:
            # A cap may leave storages out: those gpukit.budget(host=...) says a GPU run keeps in host memory.
            host = cap.host_bytes(self) if hasattr(cap, "host_bytes") else 0
            if host and storage is not None and cap.holds(storage):
                continue  # host memory that grows is not the device's
            if tightest is None or cap - live + host < tightest[0]:
                tightest = (cap - live + host, cap, host)
        if tightest is None or want <= tightest[0]:
            return None
        room, limit, host = tightest
        on_host = f" (not counting {_fmt(host)} on the host)" if host else ""
        return torch.OutOfMemoryError(
            f"out of memory under a gpukit budget ({'fake tensors' if self.fake else 'CPU, simulated'}). "
            f"Tried to allocate {_fmt(want)}; {_fmt(live - host)} already allocated{on_host}; "
            f"budget {_fmt(int(limit))}, of which {_fmt(max(room, 0))} free.")

    def check_request(self, func, args, kwargs) -> None:
        """Refuse an op, before it runs, whose arguments ask for more memory than the budget leaves.

        Raises:
            torch.OutOfMemoryError: as the CUDA allocator would, before any memory is taken.
        """
        if self.fake:
            return
        for storage, nbytes in _requests(func, args, kwargs):
            if storage is not None and nbytes <= storage.nbytes():
                continue  # fits in the storage it has
            self.settle()
            error = self._over_budget(nbytes, storage)
            if error is not None:
                __tracebackhide__ = True
                try:
                    raise error  # a gpukit budget refused the op on your last line above
                finally:
                    error = None  # no cycle: the traceback holds this frame, which would hold the error


def _numel(size) -> int:
    return math.prod(int(n) for n in size)


def _requests(func, args, kwargs) -> list[tuple["torch.UntypedStorage | None", int]]:
    """What an op will allocate on the CPU, known before it runs: a list of (storage that grows, or None for a
    new one; its bytes). From the arguments where they say it (factory ops with a size: ``empty``, ``zeros``,
    ``randn``, ``new_*``, ``*_like``; ``resize_``), else from the op run on meta tensors, which allocate nothing
    (``out=`` tensors an op resizes; the outputs of any other op that makes new storages: ``x.expand(n)
    .contiguous()`` asks for no size, yet makes ``n`` elements). An op without a meta kernel, or whose output
    sizes depend on its data (``nonzero``), is counted after it runs."""
    schema = func._schema
    names = [a.name for a in schema.arguments]
    values = dict(zip(names, args))
    values.update(kwargs)
    found = []
    if func is torch.ops.aten.resize_.default:
        t, size = args[0], args[1]
        if t.is_cpu and t.layout is torch.strided:
            found.append((t.untyped_storage(), (t.storage_offset() + _numel(size)) * t.element_size()))
        return found
    outs = values.get("out")
    if outs is not None:
        outs = [outs] if isinstance(outs, torch.Tensor) else [o for o in outs if isinstance(o, torch.Tensor)]
        outs = [o for o in outs if o.is_cpu and o.layout is torch.strided and type(o) is torch.Tensor]
        if not outs:
            return found
        if "size" in values and len(outs) == 1:
            shapes = [values["size"]]
        else:  # the shapes the op will give its outputs
            result = _on_meta(func, args, kwargs)
            if result is None:
                return found
            if len(result) != len(outs):
                return found
            shapes = [r.shape for r in result]
        for o, shape in zip(outs, shapes):
            found.append((o.untyped_storage(), (o.storage_offset() + _numel(shape)) * o.element_size()))
        return found
    if "dtype" in values or "dtype" in names:
        self = values.get("self")
        self = self if isinstance(self, torch.Tensor) else None
        device = values.get("device") or (self.device if self is not None else torch.device("cpu"))
        if torch.device(device).type != "cpu" or values.get("layout") not in (None, torch.strided):
            return found
        dtype = values.get("dtype") or (self.dtype if self is not None else torch.get_default_dtype())
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        if "size" in names and isinstance(values.get("size"), (list, tuple, torch.Size)):
            size = values["size"]
            if "stride" in values:  # empty_strided: the farthest element, plus one
                numel = 0 if 0 in size else 1 + sum((int(n) - 1) * int(st) for n, st in zip(size, values["stride"]))
            else:
                numel = _numel(size)
            found.append((None, numel * itemsize))
        elif self is not None and schema.name.endswith("_like"):
            found.append((None, self.numel() * itemsize))
        if found:
            return found
    aliases = ALIASES.get(id(func)) or alias_entry(func)
    if aliases[1]:
        return found  # a view or an in-place op: no new storage
    try:
        key = (func, _meta_key(args), _meta_key(kwargs))
        nbytes = _FRESH_BYTES.get(key)
    except TypeError:  # an argument that is no plain value (a generator, a symbolic size): sized afresh
        key = nbytes = None
    if nbytes is None:
        nbytes = 0
        fresh = [i for i, r in enumerate(schema.returns) if r.alias_info is None]
        if fresh and any(isinstance(a, torch.Tensor) and a.is_cpu for a in tree_flatten((args, kwargs))[0]):
            result = _on_meta(func, args, kwargs)
            if result is not None and len(result) == len(schema.returns):
                nbytes = sum(r.untyped_storage().nbytes() for i, r in enumerate(result)
                             if i in fresh and isinstance(r, torch.Tensor))
        if key is not None:
            if len(_FRESH_BYTES) >= 4096:  # a step repeats its few hundred shapes: start over past that
                _FRESH_BYTES.clear()
            _FRESH_BYTES[key] = nbytes
    if nbytes:
        found.append((None, nbytes))
    return found


# What an op's new storages take, by its arguments' shapes, strides, dtypes and plain values (_meta_key): a
# training step repeats the same ops on the same shapes, and running each on meta tensors costs 0.2 ms.
_FRESH_BYTES: dict = {}
_KEYABLE = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _meta_key(v):
    """A hashable stand-in for an op's argument that determines its outputs' sizes; TypeError for any other."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.device.type, tuple(v.shape), v.stride(), v.layout)
    if type(v) in _KEYABLE:
        return (type(v), v)  # 1 and True (and 1.0) size outputs differently (dtype promotion)
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_meta_key(x) for x in v))
    if isinstance(v, dict):
        return tuple((k, _meta_key(x)) for k, x in v.items())
    raise TypeError(type(v))


def _on_meta(func, args, kwargs) -> list | None:
    """The op's outputs computed on meta tensors of the same shapes, strides and dtypes (no memory, no data), or
    None where the op has no meta kernel or its outputs' sizes depend on the data."""
    def meta(v):
        if isinstance(v, torch.Tensor):
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        if isinstance(v, (list, tuple)):
            return type(v)(meta(x) for x in v)
        return v
    try:
        result = func(*meta(list(args)), **{k: meta(v) for k, v in kwargs.items()})
    except Exception:
        return None
    return [result] if isinstance(result, torch.Tensor) else list(result) if isinstance(result, (list, tuple)) \
        else None

def _fmt(nbytes: int) -> str:
    from ..report import format_bytes

    return f"{format_bytes(nbytes)} ({nbytes:,} B)"

