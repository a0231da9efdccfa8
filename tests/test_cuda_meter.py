"""The CUDA meter: nested peaks from one global peak counter.

The first tests drive the meter with a stand-in for the allocator's counters (current and a
resettable peak, as torch.cuda.memory_stats reports them), so the logic is checked on machines
without a GPU. The last ones run on a real GPU only.
"""

import pytest
import torch

from gpukit.meter import _CudaMeter
from gpukit.report import MemoryReport


class FakeAllocatorStats:
    """current / peak counters with PyTorch's semantics: reset sets every peak to its current value."""

    def __init__(self):
        self.current = {"allocated": 0, "requested": 0, "reserved": 0}
        self.peak = dict(self.current)

    def alloc(self, n, requested=None):
        self.current["allocated"] += n
        self.current["requested"] += requested if requested is not None else n
        self.current["reserved"] = max(self.current["reserved"], self.current["allocated"])
        for k in self.peak:
            self.peak[k] = max(self.peak[k], self.current[k])

    def free(self, n, requested=None):
        self.current["allocated"] -= n
        self.current["requested"] -= requested if requested is not None else n

    def memory_stats(self, device=None):
        names = {"allocated": "allocated_bytes.all", "requested": "requested_bytes.all",
                 "reserved": "reserved_bytes.all"}
        out = {}
        for k, name in names.items():
            out[f"{name}.current"] = self.current[k]
            out[f"{name}.peak"] = self.peak[k]
        return out

    def reset_peak_memory_stats(self, device=None):
        self.peak = dict(self.current)


@pytest.fixture
def fake(monkeypatch):
    stats = FakeAllocatorStats()
    monkeypatch.setattr(torch.cuda, "memory_stats", stats.memory_stats)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", stats.reset_peak_memory_stats)
    return stats


def block():
    meter, report = _CudaMeter(torch.device("cuda", 0)), MemoryReport(device="cuda:0")
    return meter, report


def test_peak_and_delta_are_relative_to_the_start(fake):
    fake.alloc(10_240)                     # before the block
    meter, r = block()
    meter.start(r)
    fake.free(10_240)                      # dropping a tensor from before the block
    fake.alloc(10_240)                     # and making one of the same size
    fake.alloc(4_000_256, requested=4_000_000)
    fake.free(4_000_256, requested=4_000_000)
    meter.stop(r)
    assert (r.peak, r.delta) == (4_000_256, 0)
    assert r.peak_unrounded == 4_000_000
    assert (r.live_start, r.live_end) == (10_240, 10_240)


def test_nested_blocks_each_get_their_own_peak_from_one_counter(fake):
    outer_m, outer = block()
    outer_m.start(outer)
    fake.alloc(8_000)                      # outer's own high point: 8,000 ...
    fake.free(8_000)
    inner_m, inner = block()
    inner_m.start(inner)                   # ... which this reset would lose without the fold
    fake.alloc(3_000)
    fake.free(3_000)
    inner_m.stop(inner)
    fake.alloc(1_000)
    outer_m.stop(outer)
    assert inner.peak == 3_000
    assert outer.peak == 8_000
    assert outer.delta == 1_000


def test_an_inner_peak_counts_for_the_outer_block_too(fake):
    outer_m, outer = block()
    outer_m.start(outer)
    inner_m, inner = block()
    inner_m.start(inner)
    fake.alloc(50_000)
    fake.free(50_000)
    inner_m.stop(inner)
    outer_m.stop(outer)
    assert inner.peak == outer.peak == 50_000


def test_a_measured_block_restarts_the_device_peak_that_max_memory_allocated_reads(fake, monkeypatch):
    # As measure()'s docstring says: PyTorch keeps one resettable peak per device, and a block resets it, so a
    # user's own torch.cuda.max_memory_allocated() read after a block reports the peak since that block began.
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda device=None: fake.memory_stats()["allocated_bytes.all.peak"])
    torch.cuda.reset_peak_memory_stats()
    fake.alloc(50_000)                     # the user's own high point...
    fake.free(50_000)
    meter, r = block()
    meter.start(r)                         # ...which the block's reset forgets
    fake.alloc(2_000)
    fake.free(2_000)
    meter.stop(r)
    assert r.peak == 2_000
    assert torch.cuda.max_memory_allocated() == 2_000


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_on_a_gpu_a_million_floats_is_4_000_256_bytes():
    import gpukit

    from gpukit.counter import cuda_allocated_range

    with gpukit.measure("cuda") as r:
        x = torch.empty(1_000_000, device="cuda")
    assert r.peak_unrounded == r.delta_unrounded == 4_000_000
    # Over 1 MiB: a cached block is handed out whole when at most 1 MiB of it would remain.
    low, high = cuda_allocated_range(4_000_000)
    assert low <= r.peak == r.delta <= high and low == 4_000_256
    assert r.backend == "CUDA caching allocator" and r.reserved_end >= r.live_end
    del x


@cuda
def test_on_a_gpu_nested_blocks_and_pre_existing_frees():
    import gpukit

    big = torch.empty(10_000_000, device="cuda")
    with gpukit.measure("cuda") as outer:
        del big
        big = torch.empty(10_000_000, device="cuda")
        with gpukit.measure("cuda") as inner:
            t = torch.empty(250_000, device="cuda")
            del t
    assert (outer.peak_unrounded, outer.delta_unrounded) == (1_000_000, 0)
    # 1,000,000 B is a small-pool request: allocated exactly as rounded. The 40 MB one is large: freed and made
    # again, it may get a block of another size than the one it had (should_split), so only requested is exact.
    assert (inner.peak, inner.delta, inner.peak_unrounded) == (1_000_448, 0, 1_000_000)
