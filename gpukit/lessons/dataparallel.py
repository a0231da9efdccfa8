"""``nn.DataParallel``'s memory, device by device: measured on several GPUs, accounted for on one device or CPU.

``nn.DataParallel`` runs in one process. Each step it scatters the batch from device 0
to every device, copies the model to every device, runs the replicas in threads,
gathers all outputs back on device 0 (where the loss is computed), and sums the
replicas' gradients into the model on device 0, where the optimizer lives. So
device 0 holds more than the others: the optimizer state, the whole batch and the
gathered outputs. Giving device 0 a smaller share of the batch evens it out.

``accounting()`` builds the per-device table from pieces the meter measures on one
device (the model's parameters, gradients and optimizer state, the activations a
replica keeps for its share of the batch, the gathered outputs); ``measured()``
runs ``nn.DataParallel`` (or ``BalancedDataParallel``) on real GPUs and reads each
device's peak from the CUDA allocator.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import gpukit
from gpukit.counter import round_up
from gpukit.lessons.parallel import state_bytes

ROLES = ("parameters", "gradients", "optimizer_state", "batch", "activations", "gathered_outputs")


def even_shares(batch: int, n_devices: int) -> list[int]:
    """How ``nn.DataParallel`` splits a batch (``torch.chunk``): equal chunks, the last ones smaller."""
    size = -(-batch // n_devices)
    return [min(size, max(0, batch - i * size)) for i in range(n_devices)]


def article_chunk_sizes(batch: int, gpu0_bsz: int, n_devices: int) -> list[int]:
    """The chunks the source article's ``BalancedDataParallel(gpu0_bsz, model)`` scatters a batch into.

    As its ``scatter`` computes them: device 0 gets ``gpu0_bsz`` samples; the others an even share of
    the rest, ``(batch - gpu0_bsz) // (n_devices - 1)``, and the remainder one sample each from device 1
    on. Unless ``gpu0_bsz`` is below that share: then it falls back, without a word, to
    ``nn.DataParallel``'s own split (``even_shares``). With ``gpu0_bsz == 0`` device 0 gets nothing (the
    article then leaves it out of the scatter; its chunk is kept here as 0).

    Raises:
        ValueError: for fewer than two devices, or a ``gpu0_bsz`` outside 0..batch.
    """
    if n_devices < 2:
        raise ValueError(f"a balanced split needs two or more devices, not {n_devices}")
    if not 0 <= gpu0_bsz <= batch:
        raise ValueError(f"gpu0_bsz must be between 0 and the batch ({batch}), not {gpu0_bsz}")
    unit = (batch - gpu0_bsz) // (n_devices - 1)
    if gpu0_bsz >= unit:
        return even_shares(batch, n_devices)
    sizes = [gpu0_bsz] + [unit] * (n_devices - 1)
    for i in range(batch - sum(sizes)):
        sizes[i + 1] += 1
    return sizes


class _Pieces:
    """The measured pieces of one model's ``nn.DataParallel`` step; activations measured once per share."""

    def __init__(self, make_model, x, y, make_optimizer) -> None:
        self.x, self.y = x, y
        self.model = make_model()
        optimizer = make_optimizer(self.model.parameters())
        F.cross_entropy(self.model(x), y).backward()
        optimizer.step()
        held = state_bytes(self.model, optimizer)
        self.params, self.grads, self.opt_state = held["parameters"], held["gradients"], held["optimizer_state"]
        self.model.zero_grad(set_to_none=True)
        with torch.no_grad():
            out = self.model(x)
        with gpukit.measure("cpu", record=False) as gathered:
            logits = torch.cat([out[: len(x) // 2], out[len(x) // 2:]])
        self.gathered = gathered.delta
        del out, logits
        self._kept: dict[int, int] = {0: 0}

    def activations(self, share: int) -> int:
        """Bytes a replica keeps from forward to backward (its output included) for ``share`` samples."""
        if share not in self._kept:
            with gpukit.measure("cpu", record=False) as kept:
                out = self.model(self.x[:share])
            self._kept[share] = kept.delta
            del out
        return self._kept[share]

    def rows(self, shares: list[int]) -> list[dict]:
        if sum(shares) != len(self.x) or min(shares) < 0:
            raise ValueError(f"shares {shares} must be non-negative and add up to the batch ({len(self.x)})")
        batch_bytes = lambda n: round_up(self.x[:n].nbytes) + round_up(self.y[:n].nbytes)  # noqa: E731
        rows = []
        for i, share in enumerate(shares):
            row = {"device": i, "samples": share, "parameters": self.params, "gradients": self.grads,
                   "optimizer_state": self.opt_state if i == 0 else 0,
                   "batch": batch_bytes(len(self.x)) if i == 0 else batch_bytes(share),
                   "activations": self.activations(share), "gathered_outputs": self.gathered if i == 0 else 0}
            row["total"] = sum(row[r] for r in ROLES)
            rows.append(row)
        return rows


def _adam(params):
    return torch.optim.Adam(params)


def accounting(make_model: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor,
               shares: list[int], make_optimizer=_adam) -> list[dict]:
    """Per-device bytes of one ``nn.DataParallel`` training step, from pieces measured on the CPU.

    Device ``i`` gets ``shares[i]`` samples of the batch ``x, y``. Every device holds a copy of
    the parameters, the gradients its replica computes (on device 0 they are summed into the
    model's own) and the activations its replica keeps for backward; device 0 also holds the
    optimizer state, the whole batch (it is scattered from there) and the gathered outputs.

    Returns:
        one dict per device: the bytes of each role in ``ROLES`` and their ``total``.

    Raises:
        ValueError: if the shares are negative or do not add up to the batch.
    """
    return _Pieces(make_model, x, y, make_optimizer).rows(shares)


def balanced_shares(make_model: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor, n_devices: int,
                    step: int = 8, make_optimizer=_adam) -> tuple[list[int], list[dict]]:
    """The split that makes the busiest device's total smallest, giving device 0 fewer samples.

    Device 0's total grows with its share and the others' shrink, so the best share (a multiple of
    ``step``, from 0 to the even split; the other devices share the rest evenly) is where they
    cross: found by bisection on the ``accounting`` totals.

    Returns:
        (shares, the accounting rows for them).
    """
    pieces = _Pieces(make_model, x, y, make_optimizer)

    def split(b0: int) -> tuple[int, list[int], list[dict]]:
        shares = [b0] + even_shares(len(x) - b0, n_devices - 1)
        rows = pieces.rows(shares)
        return max(r["total"] for r in rows), shares, rows

    lo, hi = 0, even_shares(len(x), n_devices)[0] // step  # in units of step
    while hi - lo > 1:  # invariant: device 0 is the busiest at hi*step
        mid = (lo + hi) // 2
        _, _, rows = split(mid * step)
        if rows[0]["total"] >= max(r["total"] for r in rows[1:]):
            hi = mid
        else:
            lo = mid
    best = min((split(b * step) for b in {lo, hi, even_shares(len(x), n_devices)[0] // step}), key=lambda t: t[0])
    return best[1], best[2]


class BalancedDataParallel(nn.DataParallel):
    """``nn.DataParallel`` that scatters the batch (dimension 0) in the given ``shares``, device 0 first."""

    def __init__(self, module: nn.Module, shares: list[int], device_ids=None, **kwargs) -> None:
        super().__init__(module, device_ids=device_ids, **kwargs)
        if len(shares) != len(self.device_ids):
            raise ValueError(f"{len(shares)} shares for {len(self.device_ids)} devices")
        self.shares = list(shares)

    def scatter(self, inputs, kwargs, device_ids):
        if kwargs:
            raise ValueError("BalancedDataParallel scatters positional tensor inputs only")
        pieces = [torch.split(t, self.shares) for t in inputs]
        scattered = tuple(tuple(p[i].to(f"cuda:{d}", non_blocking=True) for p in pieces)
                          for i, d in enumerate(device_ids) if self.shares[i])
        return scattered, tuple({} for _ in scattered)


def measured(make_model: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor,
             shares: list[int] | None = None, device_ids: list[int] | None = None,
             make_optimizer=_adam) -> list[dict]:
    """Per-device peak of one ``nn.DataParallel`` training step on real GPUs, from the CUDA allocator.

    Needs at least two GPUs. With ``shares``, uses ``BalancedDataParallel``. The batch starts on
    device 0; one step runs first so the optimizer state exists; the second step is measured.
    """
    ids = device_ids or list(range(torch.cuda.device_count()))
    if len(ids) < 2:
        raise RuntimeError(f"nn.DataParallel needs two or more GPUs to show its imbalance; this machine has {len(ids)}")
    model = make_model().to(f"cuda:{ids[0]}")
    wrapped = BalancedDataParallel(model, shares, ids) if shares else nn.DataParallel(model, ids)
    optimizer = make_optimizer(model.parameters())
    x, y = x.to(f"cuda:{ids[0]}"), y.to(f"cuda:{ids[0]}")
    rows = []
    for _ in range(2):  # the first step creates the optimizer state; the rows of the second are kept
        optimizer.zero_grad(set_to_none=True)
        for d in ids:
            torch.cuda.synchronize(d)
            torch.cuda.reset_peak_memory_stats(d)
        base = {d: torch.cuda.memory_allocated(d) for d in ids}
        F.cross_entropy(wrapped(x), y).backward()
        optimizer.step()
        for d in ids:
            torch.cuda.synchronize(d)
        rows = [{"device": d, "samples": (shares or even_shares(len(x), len(ids)))[i],
                 "before_step": base[d], "peak": torch.cuda.max_memory_allocated(d)} for i, d in enumerate(ids)]
    return rows
