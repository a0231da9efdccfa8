"""The simulated CUDA caching allocator (gpukit.allocator) against references written elsewhere.

Device: a simulated CUDA GPU (gpukit.allocator.CachingAllocator); no real device is touched.

1. Allocation sequences from PyTorch's own allocator tests (test/test_cuda.py, which
   test/test_cuda_expandable_segments.py runs again with expandable segments on; and
   c10/test/core/AllocatorConfig_test.cpp), each with the figures and outcomes PyTorch
   asserts, run with expandable segments off and on as PyTorch's CI runs them.
   Every PyTorch test ported here names its source test.
2. Real traces recorded with torch.cuda.memory._record_memory_history on GPUs (data/traces/):
   every allocation must land at the recorded address and every segment event must be the
   recorded one.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
import re
from pathlib import Path

import pytest
import torch

from gpukit.allocator import (AllocatorConfig, CachingAllocator, SimulatedOutOfMemoryError, format_size,
                              load_snapshot, replay)

MB = 1024 * 1024
GPU = 80 * 1024**3  # an 80 GiB device (no real GPU's capacity is assumed by any assert below)
TRACES = Path(__file__).resolve().parent.parent / "data" / "traces"


def EXPANDABLE(test):
    """Run a ported test twice, as PyTorch's CI does: test_cuda.py with expandable segments off, and
    test_cuda_expandable_segments.py with them on (one pytest item: each item pays conftest's gc)."""
    sig = inspect.signature(test)
    params = [p for name, p in sig.parameters.items() if name != "expandable"]

    def both(*args, **kwargs):
        for expandable in (False, True):
            try:
                test(*args, expandable=expandable, **kwargs)
            except BaseException as err:
                err.add_note(f"with expandable_segments:{expandable}")
                raise

    both.__name__, both.__doc__, both.__module__ = test.__name__, test.__doc__, test.__module__
    both.__signature__ = sig.replace(parameters=params)
    return both



def sim(expandable: bool = False, total=GPU, **kw) -> CachingAllocator:
    return CachingAllocator(total, "expandable_segments:True" if expandable else "", **kw)


def float32(n: int) -> int:
    return 4 * n


# -- 1. PyTorch's own tests ---------------------------------------------------------------------------------


@EXPANDABLE
def test_memory_stats(expandable):
    """test_cuda.py TestCuda.test_memory_stats: 1 kB active, then freed."""
    s = sim(expandable)
    s.empty_cache()
    s.reset_peak_stats()
    s.reset_accumulated_stats()
    prev_max_allocated, prev_max_reserved = s.max_memory_allocated(), s.max_memory_reserved()
    assert s.memory_allocated() == prev_max_allocated and s.memory_reserved() == prev_max_reserved
    prev_active = s.memory_stats()["active_bytes.all.current"]
    tmp = s.malloc(float32(256))  # torch.randn(256, device="cuda")
    assert s.memory_stats()["active_bytes.all.current"] == 1024 + prev_active
    assert s.memory_stats()["active_bytes.all.freed"] == 0
    s.free(tmp)
    s.empty_cache()
    assert s.memory_stats()["active_bytes.all.current"] == prev_active
    assert s.memory_stats()["active_bytes.all.freed"] == 1024
    s.reset_peak_stats()
    assert s.max_memory_allocated() == prev_max_allocated
    assert s.max_memory_reserved() == prev_max_reserved


@EXPANDABLE
def test_memory_allocation(expandable):
    """test_cuda.py TestCuda.test_memory_allocation: caching_allocator_alloc(1), then delete."""
    s = sim(expandable)
    prev = s.memory_allocated()
    mem = s.malloc(1)
    assert s.memory_allocated() > prev
    s.free(mem)
    assert s.memory_allocated() == prev


@EXPANDABLE
def test_out_of_memory(expandable):
    """test_cuda.py TestCuda.test_out_of_memory: the message for 800000000 GiB, and the 1 EB guard."""
    s = sim(expandable)
    s.malloc(float32(1024))
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 800000000.00 GiB. GPU 0 has a total capacity of"):
        s.malloc(1024 * 1024 * 1024 * 800000000)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate more than 1EB memory"):
        s.malloc(1024 * 1024 * 1024 * 8000000000)


@EXPANDABLE
def test_out_of_memory_retry(expandable):
    """test_cuda.py TestCuda.test_out_of_memory_retry: half the device twice fails, once freed it fits.

    The real device holds a CUDA context besides the allocator's memory, which is what
    makes two halves too much; the simulated one holds 500 MiB.
    """
    s = sim(expandable, context_bytes=500 * MB)
    size = int(s.total_memory * 0.5)
    a = s.malloc(size)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        s.malloc(size)
    s.free(a)
    b = s.malloc(size)
    s.free(b)
    s.empty_cache()
    assert s.memory_reserved() == 0


@EXPANDABLE
def test_set_per_process_memory_fraction(expandable):
    """test_cuda.py TestCuda.test_set_per_process_memory_fraction: 0.499 fits, 0.5 does not."""
    s = sim(expandable)
    with pytest.raises(TypeError, match="Invalid type"):
        s.set_memory_fraction(1)
    with pytest.raises(ValueError, match="Invalid fraction value"):
        s.set_memory_fraction(-0.1)
    with pytest.raises(ValueError, match="Invalid fraction value"):
        s.set_memory_fraction(2.0)
    tensor = s.malloc(float32(1024))
    s.empty_cache()
    total = s.total_memory
    s.set_memory_fraction(0.5)
    application = int(total * 0.499) - s.max_memory_reserved()
    tmp = s.malloc(application)
    s.free(tmp)
    s.empty_cache()
    with pytest.raises(torch.OutOfMemoryError, match="out of memory"):
        s.malloc(int(total * 0.5))
    s.free(tensor)


@EXPANDABLE
def test_zero_byte_request_is_a_null_pointer_with_no_block(expandable):
    """Device: a simulated CUDA GPU (no real device). NativeCachingAllocator::allocate
    (CUDACachingAllocator.cpp) calls malloc only ``if (size != 0)`` and returns a null pointer;
    NativeCachingAllocator::free and recordStream return at once for a null pointer."""
    s = sim(expandable)
    before = s.memory_stats()
    assert s.malloc(0) == 0 and s.malloc(0, stream=1) == 0
    s.record_stream(0, 1)
    s.free(0)
    s.free(0)  # a null pointer has no block to free twice
    assert s.memory_stats() == before and s.segments() == []
    a = s.malloc(1)  # the smallest real request still takes a 512-byte block in a 2 MiB segment
    assert a != 0 and s.memory_allocated() == 512 and s.memory_reserved() == 2 * MB


@pytest.mark.parametrize("how", ["call", "setting"])
def test_memory_fraction_one_sets_no_cap(how):
    """Device: a simulated 2 GiB CUDA GPU (no real device). DeviceCachingAllocator::setMemoryFraction
    (CUDACachingAllocator.cpp) empties ``allowed_memory_maximum`` for a fraction of 1.0: no cap, so
    ``garbage_collection_threshold`` (which needs one) frees nothing, and the OOM message has no
    "... allowed;" part: the allocator acts as if no fraction had ever been set."""
    def run(fraction):
        conf = "garbage_collection_threshold:0.25"
        if how == "setting":
            s = CachingAllocator("2 GiB", conf + f",per_process_memory_fraction:{fraction}", context_bytes=0)
        else:
            s = CachingAllocator("2 GiB", conf, context_bytes=0)
            s.set_memory_fraction(0.5)  # a cap first: 1.0 must remove it, not keep the old one
            s.set_memory_fraction(fraction)
        s.free(s.malloc(600 * MB))  # a cached 600 MiB segment, above 0.25 of any cap
        s.malloc(700 * MB)  # does not fit in it: with a cap, garbage collection frees it first
        return s

    uncapped, capped = run(1.0), run(0.999)
    assert uncapped.allowed_memory_maximum is None
    assert uncapped.memory_reserved() == 1300 * MB  # nothing collected
    assert capped.memory_reserved() == 700 * MB  # the 600 MiB segment collected
    with pytest.raises(torch.OutOfMemoryError) as err:
        uncapped.malloc(1500 * MB)
    never = CachingAllocator("2 GiB", context_bytes=0)
    never.free(never.malloc(600 * MB))
    never.malloc(700 * MB)
    with pytest.raises(torch.OutOfMemoryError) as ref:
        never.malloc(1500 * MB)
    assert "allowed" not in str(err.value) and str(err.value) == str(ref.value)


@EXPANDABLE
def test_caching_allocator_record_stream_oom(expandable):
    """test_cuda.py TestCuda.test_caching_allocator_record_stream_oom (issue #19219).

    Blocks freed while another stream uses them must still be reclaimed when cudaMalloc
    fails. On an 8 GiB device the 100 x 160 MiB loop reaches that point, so the retry path runs.
    """
    s = sim(expandable, total=8 * 1024**3)
    stream = 1
    y = s.malloc(float32(40 * MB), stream)
    for _ in range(100):
        x = s.malloc(float32(40 * MB))
        s.record_stream(x, stream)  # x.record_stream(stream); del x
        s.free(x)
    assert s.memory_stats()["num_alloc_retries"] > 0  # the case the test exists for was reached
    s.free(y)
    s.empty_cache()


@EXPANDABLE
def test_record_stream(expandable):
    """test_cuda.py TestCuda.test_record_stream: not reused while the other stream may use it; reused after."""
    s = sim(expandable)
    side = 1
    result = s.malloc(float32(4))
    tmp = s.malloc(float32(4), side)  # t.cuda(non_blocking=True) on the side stream
    ptr = tmp
    s.record_stream(tmp, 0)  # tmp.record_stream(torch.cuda.current_stream())
    s.free(tmp)
    tmp2 = s.malloc(float32(4), side)
    assert tmp2 != ptr, "allocation reused to soon"
    s.synchronize()  # torch.cuda.current_stream().synchronize()
    tmp3 = s.malloc(float32(4), side)
    assert tmp3 == ptr, "allocation not reused"
    for a in (result, tmp2, tmp3):
        s.free(a)


@EXPANDABLE
def test_record_stream_on_shifted_view(expandable):
    """test_cuda.py TestCuda.test_record_stream_on_shifted_view (issue #27366)."""
    s = sim(expandable)
    stream_alloc, stream_record = 1, 2
    base = s.malloc(float32(2), stream_alloc)
    s.record_stream(base, stream_record)  # view.record_stream(stream_record), a view of base
    data_ptr = base
    s.free(base)
    s.stream_synchronize(stream_alloc)  # waits for stream_alloc only: stream_record may still use the block
    try_realloc = s.malloc(float32(2), stream_alloc)
    assert try_realloc != data_ptr


@EXPANDABLE
def test_freed_block_used_on_another_stream_is_freed_by_the_next_malloc_once_its_event_completed(expandable):
    """Device: a simulated CUDA GPU (no real device). CUDACachingAllocator.cpp: ``free`` of a block with
    ``stream_uses`` records one event per stream (``insert_events``); DeviceCachingAllocator::malloc starts with
    ``process_events`` (``if (C10_LIKELY(captures_underway.empty()))``), which frees a block once the events
    of all its streams completed, each stream's queue oldest first up to the first event not completed.
    Completing an event frees nothing by itself: the next malloc does."""
    s = sim(expandable)
    a = s.malloc(float32(4))
    s.record_stream(a, 1)
    s.record_stream(a, 2)
    s.free(a)
    assert s.memory_stats()["active_bytes.all.current"] == 512  # pending: both streams may still use it
    s.stream_synchronize(1)
    b = s.malloc(float32(4))  # stream 2's event not completed: still pending, a is not reused
    assert b != a and s.pending
    s.stream_synchronize(2)
    assert s.memory_stats()["active_bytes.all.current"] == 1024  # completed, not yet processed
    c = s.malloc(float32(4))  # process_events frees a first: best fit, lowest address, it is reused
    assert c == a and not s.pending and not s.cuda_events
    assert s.memory_stats()["active_bytes.all.current"] == 1024 and s.memory_stats()["num_sync_all_streams"] == 0
    d = s.malloc(float32(4))
    s.record_stream(d, 3)
    s.free(d)
    s.synchronize()  # torch.cuda.synchronize(): every stream's event completed
    assert s.pending  # still held until the next malloc
    assert s.malloc(float32(4)) == d and not s.pending


@EXPANDABLE
def test_memory_snapshot(expandable):
    """test_cuda.py TestCudaMallocAsync.test_memory_snapshot: x is the second block of a segment,
    found by its requested size at its address; empty_cache's last event frees a segment."""
    rng = random.Random(0)
    s = sim(expandable, record_history=True)
    s.empty_cache()
    s.free(s.malloc(float32(2 * 311 * 411)))  # torch.rand(2 * 311, 411), dropped at once
    unused = s.malloc(float32(310 * 410))
    x = s.malloc(float32(311 * 411))
    tensors = [s.malloc(float32(128)) for _ in range(1000)]
    while tensors:
        s.free(tensors.pop(rng.randint(0, len(tensors) - 1)))
    s.free(s.malloc(float32(128 * 5)))
    found = []
    for seg in s.snapshot()["segments"]:
        for i, b in enumerate(seg["blocks"]):
            if b["requested_size"] == 311 * 411 * 4:
                found.append((b["address"], i))
    assert found == [(x, 1)]  # the block at x's address, second in its segment
    s.free(unused)
    s.free(x)
    s.empty_cache()
    assert s.snapshot()["device_traces"][0][-1]["action"] in ("segment_free", "segment_unmap")


def test_max_split_expandable():
    """test_cuda.py TestCudaMallocAsync.test_max_split_expandable: 3 x 40 MiB fit a 120 MiB cap, a
    fourth does not, and after freeing them 120 MiB fits (release_cached_blocks meets an
    expandable segment in the free list)."""
    s = sim(False)
    total_allowed = 120 * MB + s.memory_reserved()
    fraction = total_allowed / s.mem_get_info()[1]
    assert int(round(fraction * s.total_memory)) == total_allowed
    s.set_memory_fraction(fraction)
    s.set_settings("expandable_segments:False,max_split_size_mb:40")
    a = s.malloc(40 * MB)
    s.set_settings("expandable_segments:True,max_split_size_mb:40")
    b = s.malloc(40 * MB)
    s.set_settings("expandable_segments:False,max_split_size_mb:40")
    c = s.malloc(40 * MB)
    with pytest.raises(torch.OutOfMemoryError):
        s.malloc(40 * MB)
    for t in (a, b, c):
        s.free(t)
    s.malloc(120 * MB)


def test_garbage_collect_expandable():
    """test_cuda.py TestCudaMallocAsync.test_garbage_collect_expandable: garbage collection with an
    expandable block in the free list, then 80 MiB fits a 120 MiB cap."""
    s = sim(False)
    total_allowed = 120 * MB + s.memory_reserved()
    fraction = total_allowed / s.mem_get_info()[1]
    assert fraction * s.total_memory == total_allowed
    s.set_memory_fraction(fraction)
    s.set_settings("expandable_segments:False,garbage_collection_threshold:0.5")
    a = s.malloc(40 * MB)
    s.set_settings("expandable_segments:True,garbage_collection_threshold:0.5")
    b = s.malloc(40 * MB)
    s.free(a)
    s.free(b)
    s.malloc(80 * MB)


def _power2_div(size: int, div_factor: int) -> int:
    """test_allocator_settings's own helper, as written there."""
    pow2 = 1
    while pow2 < size:
        pow2 = pow2 * 2
    if pow2 == size:
        return pow2
    step = pow2 / 2 / div_factor
    ret = pow2 / 2
    while ret < size:
        ret = ret + step
    return ret


@EXPANDABLE
def test_allocator_settings(expandable):
    """test_cuda.py TestCudaMallocAsync.test_allocator_settings: roundup_power2_divisions, single value
    and array syntax; a new settings string resets the others; bad settings are refused."""
    s = sim(expandable)
    key_allocated, key_requested = "active_bytes.all.allocated", "requested_bytes.all.allocated"
    es = "expandable_segments:True," if expandable else ""  # test_cuda_expandable_segments keeps it on
    nelems = 21 * 1024 * 1024
    nbytes = 4 * nelems
    nbytes_big = 4 * 100 * 1024 * 1024
    live = []
    start_mem = s.memory_stats()[key_allocated]
    s.set_settings(es)
    live.append(s.malloc(nbytes))
    reg_mem = s.memory_stats()[key_allocated]
    start_requested = s.memory_stats()[key_requested]
    s.set_settings(es + "roundup_power2_divisions:4")
    live.append(s.malloc(nbytes))
    pow2_div4_mem = s.memory_stats()[key_allocated]
    current_requested = s.memory_stats()[key_requested]
    assert reg_mem - start_mem == nbytes
    assert pow2_div4_mem - reg_mem == _power2_div(nbytes, 4)
    assert current_requested - start_requested == nbytes

    s.set_settings(es + "garbage_collection_threshold:0.5")
    s.set_settings(es + "garbage_collection_threshold:0.5,max_split_size_mb:40")
    s.empty_cache()
    start_mem = s.memory_stats()[key_allocated]
    live.append(s.malloc(nbytes))
    assert s.memory_stats()[key_allocated] - start_mem == nbytes  # the divisions were reset

    s.empty_cache()
    s.set_settings(es + "garbage_collection_threshold:0.5,roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]")
    start_mem = s.memory_stats()[key_allocated]
    live.append(s.malloc(nbytes))
    assert s.memory_stats()[key_allocated] - start_mem == _power2_div(nbytes, 8)
    s.empty_cache()
    start_mem = s.memory_stats()[key_allocated]
    live.append(s.malloc(nbytes_big))
    assert s.memory_stats()[key_allocated] - start_mem == _power2_div(nbytes_big, 2)

    s.empty_cache()
    s.set_settings(es + "release_lock_on_cudamalloc:True")
    start_mem = s.memory_stats()[key_allocated]
    live.append(s.malloc(nbytes))
    assert s.memory_stats()[key_allocated] - start_mem == nbytes

    for bad in ("foo:1,bar:2", "garbage_collection_threshold:1.2", "max_split_size_mb:2",
                "release_lock_on_cudamalloc:none", "pinned_use_cuda_host_register:none",
                "pinned_num_register_threads:none", "pinned_num_register_threads:1024"):
        with pytest.raises(ValueError):
            s.set_settings(bad)


def test_torch_2_13_settings_are_accepted_with_their_checks():
    """No device: the settings string only. The keys torch 2.13 accepts (c10/cuda/CUDAAllocatorConfig.h
    getKeys, CUDAAllocatorConfig::parseArgs; c10/core/AllocatorConfig.cpp parseLargeSegmentSize) with the
    checks each parser makes: booleans are exactly True/False (ConfigTokenizer::toBool),
    pinned_reserve_segment_size_mb > 0, large_segment_size_mb > 10 (kMinLargeAlloc / kMB)."""
    cfg = AllocatorConfig.parse("graph_capture_record_stream_reuse:True,throw_on_cudamalloc_oom:True,"
                                "pinned_reserve_segment_size_mb:64,pinned_free_catch_all:True,"
                                "pinned_max_round_threshold_mb:8,pinned_max_cached_size_mb:1024,"
                                "release_lock_on_hipmalloc:False,pinned_use_hip_host_register:False")
    assert cfg.graph_capture_record_stream_reuse and cfg.throw_on_cudamalloc_oom
    assert AllocatorConfig.parse("large_segment_size_mb:11").large_segment_size == 11 * MB
    for bad, says in (("throw_on_cudamalloc_oom:true", "True"), ("graph_capture_record_stream_reuse:1", "True"),
                      ("pinned_reserve_segment_size_mb:0", "greater than 0"), ("pinned_free_catch_all:yes", "True"),
                      ("large_segment_size_mb:10", "must be > 10 MB"), ("pinned_max_cached_size_mb:x", "whole")):
        with pytest.raises(ValueError, match=says):
            AllocatorConfig.parse(bad)


@pytest.mark.parametrize("setting", ["large_segment_size_mb:30", "large_segment_size_mb:30,max_split_size_mb:30"])
def test_large_segment_size_sets_the_segment_of_mid_size_requests(setting):
    """Device: a simulated CUDA GPU (no real device). CUDACachingAllocator.cpp get_allocation_size (torch
    2.13) gives a request between 1 and 10 MiB a segment of AcceleratorAllocatorConfig::large_segment_size();
    parseMaxSplitSize and parseMaxNonSplitRoundingSize then refuse less than that many MiB, and the size
    stays through later settings strings (checked against torch 2.13's own parser on CPU:
    torch._C._accelerator_setAllocatorSettings)."""
    s = CachingAllocator(GPU, setting)
    s.malloc(3 * MB)
    assert s.memory_reserved() == 30 * MB  # not 20 MiB
    s.malloc(28 * MB)  # 10 MiB and more: its own segment rounded to 2 MiB, as before (27 MiB are left)
    assert s.memory_reserved() == 58 * MB
    for bad in ("max_split_size_mb:20", "max_non_split_rounding_mb:29"):
        with pytest.raises(ValueError, match="must be >= 30"):
            s.set_settings(bad)
    s.set_settings("garbage_collection_threshold:0.5")
    assert s.config.large_segment_size == 30 * MB


@pytest.mark.parametrize("max_split_size_mb_setting", [False, True])
@EXPANDABLE
def test_raises_oom(expandable, max_split_size_mb_setting):
    """test_cuda.py TestCudaMallocAsync.test_raises_oom: a 4 TiB request, with and without max_split_size_mb."""
    s = sim(expandable)
    if max_split_size_mb_setting:
        s.set_settings(("expandable_segments:True," if expandable else "") + "max_split_size_mb:1024")
        s.empty_cache()
    with pytest.raises(torch.OutOfMemoryError):
        s.malloc(float32(1024 * 1024 * 1024 * 1024))
    assert s.memory_stats()["num_ooms"] == 1


def _check_consistent(s: CachingAllocator, live: dict[int, int]) -> None:
    """No two live blocks overlap, and the statistics add up to what the segments hold."""
    spans = []
    allocated = reserved = 0
    for seg in s.segments():
        reserved += seg["total_size"]
        at = seg["address"]
        for b in seg["blocks"]:
            assert b["address"] == at, "blocks of a segment tile it"
            at += b["size"]
            if b["state"] == "active_allocated":
                allocated += b["size"]
                spans.append((b["address"], b["address"] + b["size"]))
    spans.sort()
    assert all(e <= s2 for (_, e), (s2, _) in zip(spans, spans[1:]))
    assert sorted(live) == sorted(a for a, _ in spans)
    assert s.memory_allocated() == allocated and s.memory_reserved() == reserved


@EXPANDABLE
def test_allocator_fuzz(expandable):
    """test_cuda.py TestCudaMallocAsync.test_allocator_fuzz: 10000 random allocations of 2-20 MiB,
    frees and empty_cache calls under 1 GiB, as seeded there (random.seed(123)); PyTorch checks
    that no tensor is overwritten, here: no two live blocks overlap and the statistics add up."""
    rng = random.Random(123)
    s = sim(expandable)
    mem: list[tuple[int, int]] = []
    total = 0
    for step in range(10000):
        while total >= 1024 * 1024 * 1024 / (4 * 10):
            _, n = mem.pop(rng.randrange(0, len(mem)))
            total -= n
            s.free(_)
        action = rng.choices(["alloc", "free", "empty_cache"], weights=[1, 1 if mem else 0, 0.1])[0]
        if action == "alloc":
            b = rng.randrange(2 * 1024 * 1024 // 4, 20 * 1024 * 1024 // 4)
            mem.append((s.malloc(4 * b), b))
            total += b
        elif action == "free":
            a, n = mem.pop(rng.randrange(0, len(mem)))
            s.free(a)
            total -= n
        else:
            s.empty_cache()
        if step % 1000 == 0:
            _check_consistent(s, {a: n for a, n in mem})
    _check_consistent(s, {a: n for a, n in mem})
    for a, _ in mem:
        s.free(a)
    s.empty_cache()
    assert s.memory_reserved() == 0 and s.memory_allocated() == 0


@EXPANDABLE
def test_small_allocations_pack_into_2mib_segments(expandable):
    """test_cuda.py TestMemPool.test_mempool_with_allocator's comments, in the default pool: a 1 MiB
    allocation packs into a 2 MiB segment, a second 1 MiB one into the same segment, a third needs
    a new one. And TestMemPool.test_mempool_ctx_multithread: two 1 MiB blocks, 2 MiB active."""
    s = sim(expandable)
    nelem_1mb = 1024 * 1024 // 4
    out_0 = s.malloc(float32(nelem_1mb))
    assert len(s.segments()) == 1
    out_1 = s.malloc(float32(nelem_1mb))
    assert len(s.segments()) == 1
    assert [seg["active_size"] for seg in s.segments()] == [2097152]
    out_2 = s.malloc(float32(nelem_1mb))
    assert len(s.segments()) == (1 if expandable else 2)  # an expandable segment grows instead
    for a in (out_0, out_1, out_2):
        s.free(a)


def test_mempool_no_split_default_pool_splits():
    """test_cuda.py TestMemPool.test_mempool_no_split, its splitting pool: two 4 MiB allocations share
    one 20 MiB segment, which then holds three blocks (the rest is a free block)."""
    s = sim(False)
    nelem_1mb = 1024 * 1024 // 4
    s.malloc(float32(4 * nelem_1mb))
    s.malloc(float32(4 * nelem_1mb))
    segs = s.segments()
    assert [seg["total_size"] for seg in segs] == [20 * MB]
    assert len(segs[0]["blocks"]) == 3


def test_allocator_config_parse():
    """c10/test/core/AllocatorConfig_test.cpp: the values parsed from a settings string (the keys of
    the device allocator; the pinned-memory and backend keys of that test change nothing simulated)."""
    cfg = AllocatorConfig.parse("max_split_size_mb:40,max_non_split_rounding_mb:30,garbage_collection_threshold:0.5,"
                                "roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1],expandable_segments:True")
    assert cfg.max_split_size == 40 * MB
    assert cfg.max_non_split_rounding_size == 30 * MB
    assert cfg.garbage_collection_threshold == 0.5
    assert cfg.expandable_segments is True
    expected = {32: 8, 64: 8, 128: 2, 256: 4, 512: 2, 1024: 4, 2048: 1, 4096: 1, 8192: 1}
    assert {mb: cfg.divisions_for(mb * MB) for mb in expected} == expected
    cfg = AllocatorConfig.parse("max_split_size_mb:20,max_non_split_rounding_mb:40,garbage_collection_threshold:0.8")
    assert (cfg.max_split_size, cfg.max_non_split_rounding_size, cfg.garbage_collection_threshold) == \
        (20 * MB, 40 * MB, 0.8)


# -- 2. Recorded traces from real GPUs ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(p.name for p in TRACES.glob("*.json.gz")))
def test_replay_of_a_recorded_trace_matches_every_event(name):
    """Every allocation of a real run lands at the address the real allocator gave it, every
    segment it created or freed is created or freed here, and the final segments are identical."""
    rep = replay(load_snapshot(TRACES / name))
    assert rep.allocs > 1000
    assert rep.allocs_same_address == rep.allocs, rep.mismatches[:3]
    assert rep.segment_events_matched == rep.segment_events_recorded, rep.mismatches[:3]
    assert rep.final_segments_matched == rep.final_segments > 0


def test_replay_tells_a_different_policy_apart():
    """The replay check has teeth: the same trace under another policy (no splitting of blocks of
    20 MiB or more) puts allocations elsewhere."""
    snap = load_snapshot(TRACES / "memory_files_memory_ctx128_fullstep.json.gz")
    snap["allocator_settings"] = dict(snap["allocator_settings"], max_split_size=20 * MB)
    rep = replay(snap)
    assert rep.allocs_same_address < rep.allocs


# -- the module's own behaviour -------------------------------------------------------------------------------


def test_rounding_pools_and_segment_sizes():
    """512 B rounding, the small pool in 2 MiB segments, 20 MiB segments under 10 MiB, 2 MiB rounding above."""
    s = sim()
    assert s.round_size(1) == 512 and s.round_size(513) == 1024
    assert [s.get_allocation_size(n) for n in (512, MB, MB + 512, 10 * MB - 512, 10 * MB, 11 * MB + 1)] == \
        [2 * MB, 2 * MB, 20 * MB, 20 * MB, 10 * MB, 12 * MB]
    a = s.malloc(MB + 1)  # large pool: a 20 MiB segment, split
    assert s.memory_reserved() == 20 * MB and s.memory_allocated() == MB + 512
    st = s.memory_stats()
    assert st["inactive_split_bytes.large_pool.current"] == 20 * MB - (MB + 512)
    assert st["segment.large_pool.current"] == 1 and st["segment.small_pool.current"] == 0
    s.free(a)
    assert s.memory_stats()["inactive_split.all.current"] == 0  # merged back: one unsplit free block
    s.empty_cache()
    assert s.memory_reserved() == 0


def test_should_split_keeps_a_remainder_of_1mib_or_less():
    """A large block is split only when more than 1 MiB would remain (kSmallSize)."""
    s = sim()
    a = s.malloc(12 * MB)  # a 12 MiB segment
    s.free(a)
    b = s.malloc(11 * MB)  # 1 MiB would remain: the whole 12 MiB block is handed out
    assert s.memory_allocated() == 12 * MB
    s.free(b)
    c = s.malloc(10 * MB + 512)  # more than 1 MiB remains: split
    assert s.memory_allocated() == 10 * MB + 512
    s.free(c)


def test_streams_have_their_own_pools():
    s = sim()
    a = s.malloc(MB + 1, stream=0)
    s.free(a)
    s.malloc(MB + 1, stream=1)
    assert s.memory_reserved() == 40 * MB  # the cached block of stream 0 is not used by stream 1


def test_oom_message_text_and_figures():
    """CUDA's message, figure by figure, with a per-process fraction and fragmentation."""
    s = CachingAllocator("16 GiB", context_bytes="500 MiB", fraction=0.25)
    blocks = [s.malloc(6 * MB) for _ in range(612)]  # three per 20 MiB segment: 204 segments, 4080 MiB
    for i, b in enumerate(blocks):
        if i % 3 != 2:
            s.free(b)  # each segment: 12 MiB free, 6 MiB in use, 2 MiB free: nothing can be released
    assert s.memory_reserved() == 204 * 20 * MB and s.memory_allocated() == 204 * 6 * MB
    with pytest.raises(SimulatedOutOfMemoryError) as err:
        s.malloc(18 * MB)  # its own 18 MiB segment would pass the 4 GiB cap
    msg = str(err.value)
    assert msg == ("CUDA out of memory. Tried to allocate 18.00 MiB. GPU 0 has a total capacity of 16.00 GiB of which "
                   "11.53 GiB is free. Including non-PyTorch memory, this process has 4.47 GiB memory in use. "
                   "4.00 GiB allowed; Of the allocated memory 1.20 GiB is allocated by PyTorch, and 2.79 GiB is "
                   "reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
                   "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
                   "Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html"
                   "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")
    # the figures: free = 16 GiB - 500 MiB - 4080 MiB; in use = 4080 MiB + 500 MiB; 1224 MiB allocated
    assert format_size(16 * 1024 * MB - 500 * MB - 4080 * MB) == "11.53 GiB"
    assert format_size(4580 * MB) == "4.47 GiB" and format_size(1224 * MB) == "1.20 GiB"
    assert format_size(4080 * MB - 1224 * MB) == "2.79 GiB"
    st = s.memory_stats()
    assert st["num_ooms"] == 1 and st["num_alloc_retries"] == 1


def test_format_size_matches_c10():
    assert [format_size(n) for n in (0, 1024, 1025, MB, MB + 1, 1024**3, 1024**3 + 1)] == \
        ["0 bytes", "1024 bytes", "1.00 KiB", "1024.00 KiB", "1.00 MiB", "1024.00 MiB", "1.00 GiB"]


@pytest.mark.parametrize("bad", [-1, 1.5, "1", None, True])
def test_malloc_refuses_what_is_not_a_size(bad):
    with pytest.raises(ValueError, match="malloc takes a size"):
        sim().malloc(bad)


def test_free_refuses_an_unknown_or_freed_address():
    s = sim()
    a = s.malloc(10)
    s.free(a)
    with pytest.raises(ValueError, match="invalid device pointer"):
        s.free(a)
    with pytest.raises(ValueError, match="invalid device pointer"):
        s.free(12345)


def test_load_snapshot_refuses_code(tmp_path):
    """A snapshot pickle holds plain data; one that would build an object is refused, never run."""
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [Evil()]}))
    with pytest.raises(ValueError, match="refused"):
        load_snapshot(path)
    path.write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(ValueError, match="no 'segments'"):
        load_snapshot(path)


def test_expandable_segments_grow_and_unmap():
    """One segment per stream that grows by 20 MiB pages (large pool) and gives back whole free pages."""
    s = sim(True, record_history=True)
    a = s.malloc(30 * MB)
    b = s.malloc(30 * MB)
    assert s.memory_reserved() == 60 * MB  # 30 + 30 mapped in 20 MiB pages, one segment
    assert len(s.segments()) == 1 and s.segments()[0]["is_expandable"]
    s.free(a)
    s.free(b)
    s.empty_cache()
    assert s.memory_reserved() == 0
    assert [e[0] for e in s.trace if e[0].startswith("segment")] == ["segment_map", "segment_map", "segment_unmap"]


# -- driven by the CPU counter: measure() and budget() on a CPU ----------------------------------------------


def test_measure_on_cpu_reports_simulated_reserved():
    """Device: cpu, with the simulated GPU behind it. A 64 MiB tensor takes a 66 MiB segment (rounded to
    2 MiB); deleting it leaves the segment cached; empty_cache gives it back."""
    import gpukit
    from gpukit.allocator import reset_cpu_device

    dev = reset_cpu_device("16 GiB")
    try:
        with gpukit.measure("cpu", record=False) as r:
            x = torch.empty(64 * MB + 1, dtype=torch.uint8, device="cpu")
            del x
        assert r.reserved_simulated and "reserved, simulated" in repr(r)
        assert r.peak == 64 * MB + 512
        assert r.reserved_peak - r.reserved_start == 66 * MB
        assert r.reserved_end == r.reserved_peak  # cached, not given back
        dev.allocator.empty_cache()  # gives the 66 MiB segment back (and any other cached one)
        assert dev.allocator.memory_reserved() <= r.reserved_start
        assert all(seg["total_size"] != 66 * MB for seg in dev.allocator.segments())
    finally:
        reset_cpu_device()


def test_budget_reserved_on_cpu_raises_cudas_oom_and_leaves_the_counter_consistent():
    """Device: cpu. budget(reserved=True) caps the simulated reserved memory: fragmentation that leaves
    enough free bytes in total still fails, with CUDA's message; the failed tensor is not counted."""
    import gpukit
    from gpukit.allocator import reset_cpu_device
    from gpukit.counter import LEDGER

    dev = reset_cpu_device("16 GiB")
    base = dev.allocator.memory_reserved()  # CPU tensors that already exist hold segments too
    try:
        with gpukit.budget(base + 190 * MB, device="cpu", reserved=True):
            blocks = [torch.empty(6 * MB, dtype=torch.uint8, device="cpu") for _ in range(27)]  # 9 x 20 MiB
            del blocks[0::3], blocks[0::2]  # every segment keeps one 6 MiB block: nothing to release
            live = LEDGER.live_rounded
            with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory. Tried to allocate 18.00 MiB") as e:
                torch.empty(18 * MB, dtype=torch.uint8, device="cpu")
            assert f"{format_size(base + 190 * MB)} allowed" in str(e.value)
            assert LEDGER.live_rounded == live
            del blocks
    finally:
        reset_cpu_device()


def test_budget_reserved_is_cpu_only(monkeypatch):
    """Device: cuda, stood in (the device is resolved as a GPU machine would; nothing runs on it)."""
    import sys

    import gpukit

    monkeypatch.setattr(sys.modules["gpukit.budget"], "resolve_device", lambda device: torch.device("cuda", 0))
    with pytest.raises(ValueError, match="reserved=True"):
        gpukit.budget("1 GiB", device="cuda", reserved=True)


def test_predict_gives_reserved_at_the_peak_and_will_it_fit_replays_it():
    """Device: a simulated GPU fed by predict()'s fake tensors (nothing allocated). Reserved memory at the
    peak covers the allocated peak; will_it_fit replays the allocations on each size: a device that holds
    the allocated peak but not what the allocator needs does not fit."""
    from torch import nn

    from gpukit.estimate import predict

    p = predict(lambda: nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                      nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)),
                lambda ps: torch.optim.Adam(ps), lambda: (torch.randn(512, 64), torch.randint(0, 10, (512,))))
    assert p.reserved_peak >= p.peak > 0 and p.allocator_events
    below, between, above = p.peak - 2 * MB, (p.peak + p.reserved_peak) // 2, p.reserved_peak + 2 * MB
    table = p.will_it_fit(sizes_gb=(below / 1e9, between / 1e9, above / 1e9), allowance=0)
    assert list(table["fits"]) == [False, False, True]
    assert "reserved, simulated" in repr(p) or "simulated allocator" in repr(p)


def test_ctrl_c_inside_the_simulation_leaves_measure_usable(monkeypatch):
    """Device: cpu. A KeyboardInterrupt in the middle of a simulated malloc reaches the user; the counter
    is switched off, and the next measure() starts a fresh simulated device and reports reserved memory."""
    import gpukit
    from gpukit import allocator
    from gpukit.counter import LEDGER

    dev = allocator.reset_cpu_device()
    real = dev.allocator.malloc

    def interrupted(size, stream=0):
        monkeypatch.setattr(dev.allocator, "malloc", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(dev.allocator, "malloc", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            with gpukit.measure("cpu", record=False):
                torch.empty(3 * MB, dtype=torch.uint8, device="cpu")
        assert not LEDGER.active and dev.failed and LEDGER.listener is None
        with gpukit.measure("cpu", record=False) as r:
            x = torch.empty(3 * MB, dtype=torch.uint8, device="cpu")
        assert r.reserved_simulated and r.reserved_end >= r.live_end and allocator.cpu_device() is not dev
        del x
    finally:
        allocator.reset_cpu_device()


def test_garbage_collection_threshold_frees_old_cached_blocks_before_growing():
    """garbage_collection_threshold (with a per-process cap): past threshold x cap, cached unsplit blocks at
    least as old as the average (counted in free-block searches) go back before a new segment is made."""
    for gc, expected in (("", 100 * MB), ("garbage_collection_threshold:0.5", 40 * MB)):
        s = CachingAllocator("80 GiB", gc, fraction=100 * MB / (80 * 1024**3))
        a, b = s.malloc(30 * MB), s.malloc(30 * MB)
        s.free(a)
        s.free(b)  # 60 MiB cached, above half the 100 MiB cap
        s.malloc(40 * MB)  # no cached block fits: with gc both old blocks go first, then a 40 MiB segment
        assert s.memory_reserved() == expected, gc
        assert s.memory_stats()["num_device_free"] == (2 if gc else 0)


def test_a_cpu_run_bigger_than_the_simulated_gpu_is_not_failed():
    """Device: cpu. Without a cap the user set, a simulated GPU too small for the run stops simulating
    (with a warning) instead of failing a real CPU program."""
    import gpukit
    from gpukit.allocator import reset_cpu_device

    dev = reset_cpu_device("64 MiB", context_bytes=0)  # small on purpose: no room for a context
    try:
        with pytest.warns(RuntimeWarning, match="no longer simulated"):
            with gpukit.measure("cpu", record=False) as r:
                x = torch.empty(100 * MB, dtype=torch.uint8, device="cpu")
        assert r.peak == 100 * MB and dev.failed
        del x
    finally:
        reset_cpu_device()


def test_the_cpu_simulated_device_read_outside_a_block_has_counted_every_free():
    """Device: cpu, with the simulated GPU behind it. The counter counts a free when it next does its books;
    reading the simulated device must not show a storage that died since."""
    import gpukit
    from gpukit.allocator import cpu_device, reset_cpu_device

    reset_cpu_device("16 GiB")
    try:
        with gpukit.measure("cpu", record=False):
            x = torch.empty(16 * MB, dtype=torch.uint8, device="cpu")
        allocated = cpu_device().allocator.memory_allocated()
        del x  # outside any block
        assert cpu_device().allocator.memory_allocated() == allocated - 16 * MB
    finally:
        reset_cpu_device()


# -- a unit that repeats is applied, not run again ---------------------------------------------------------------


class _Twins:
    """Two simulated devices fed the same events: one as measure() runs it (queued, repeats reused) and
    one that runs every event when it happens. Nothing in this file drives the second one cleverly."""

    def __init__(self, config: str = ""):
        from gpukit.allocator import SimulatedDevice

        self.lazy = SimulatedDevice("16 GiB", config)
        self.eager = SimulatedDevice("16 GiB", config, lazy=False)
        self.next_key = 1

    def alloc(self, nbytes: int, key: int | None = None) -> int:
        if key is None:
            key, self.next_key = self.next_key, self.next_key + 1
        for dev in (self.lazy, self.eager):
            dev.on_alloc(key, nbytes)
        return key

    def free(self, key: int) -> None:
        for dev in (self.lazy, self.eager):
            dev.on_free(key)

    def watched(self, body) -> None:
        """``body()`` inside a block on both devices: the peak of reserved memory each reports must agree."""
        cells = [dev.watch() for dev in (self.lazy, self.eager)]
        body()
        peaks = [dev.unwatch(c) for dev, c in zip((self.lazy, self.eager), cells)]
        assert peaks[0] == peaks[1]

    def same(self) -> None:
        lazy, eager = self.lazy.allocator, self.eager.allocator
        assert lazy.memory_stats() == eager.memory_stats()
        assert lazy.segments() == eager.segments()
        assert self.lazy.addr == self.eager.addr


def _training_step(twins: _Twins, params: list[int], grads: list[int], batch: int) -> list[int]:
    """One step of a made-up training loop: the old gradients go, activations pile up and go in reverse order
    while the new gradients are made, a temporary in between; returns the new gradients' keys."""
    for g in grads:
        twins.free(g)
    acts = [twins.alloc(batch * (i + 1) * 3000) for i in range(6)]
    tmp = twins.alloc(12 * MB + 4096)
    twins.free(tmp)
    new = []
    for a, p in zip(reversed(acts), params * 2):
        twins.free(a)
        if len(new) < len(params):
            new.append(twins.alloc(p))
    return new


@pytest.mark.parametrize("config", ["", "expandable_segments:True"])
def test_a_reused_step_gives_what_running_every_event_gives(config):
    """Device: two simulated GPUs, fed the same events (no torch device). A training loop's steps repeat; the
    queued device applies a recorded step instead of running it, and every statistic, segment, address and
    block peak agrees with the device that runs every event, also after calls that change the allocator
    behind the queue's back (empty_cache, a malloc on a held reference, new settings, a storage that died
    unseen, a bigger batch)."""
    twins = _Twins(config)
    sizes = [300_000, 4 * MB, 2 * MB + 512, 700, 9 * MB]
    params = [twins.alloc(s) for s in sizes]
    grads: list[int] = []
    held = twins.lazy.allocator, twins.eager.allocator  # references kept past the queue

    kept = []

    def steps(n: int, batch: int = 64, leak: bool = False) -> None:
        nonlocal grads
        for _ in range(n):
            def body():
                nonlocal grads
                grads = _training_step(twins, params, grads, batch)
                if leak:  # total_loss += loss: the same events every step, and a state that grows
                    kept.append(twins.alloc(1 * MB))
            twins.watched(body)
            twins.same()

    steps(8)
    assert twins.lazy.units_reused >= 4, (twins.lazy.units_run, twins.lazy.units_reused)
    for a in held:
        a.empty_cache()
    steps(5)
    extra = [a.malloc(5 * MB) for a in held]  # on the allocators themselves, not through the devices
    steps(5)
    for a, x in zip(held, extra):
        a.free(x)
    for a in held:
        a.set_settings("max_split_size_mb:40")
    steps(5)
    steps(3)  # long enough for a step to be reused under these settings
    for a in held:  # by assignment, as a user may: no call tells the device (blocks of 4 MiB up are oversize)
        a.config = dataclasses.replace(a.config, max_split_size=4 * MB)
    steps(5)
    twins.alloc(3 * MB, key=params[1])  # a storage that died unseen: its key comes back with a new one
    steps(4, batch=256)
    steps(5)
    steps(6, leak=True)
    steps(5)
    assert twins.lazy.units_reused >= 12, (twins.lazy.units_run, twins.lazy.units_reused)
    assert twins.eager.units_run == twins.eager.units_reused == 0  # it ran every event as it came


def test_nested_blocks_each_keep_their_own_reserved_peak():
    """Device: cpu, with the simulated GPU behind it. An inner block that ends with the same reserved memory
    as the outer one began with must not take the outer block's peak with it."""
    import gpukit
    from gpukit.allocator import reset_cpu_device

    reset_cpu_device("16 GiB")
    try:
        with gpukit.measure("cpu", record=False) as outer:
            with gpukit.measure("cpu", record=False):
                pass
            x = torch.empty(64 * MB, dtype=torch.uint8, device="cpu")
        assert outer.reserved_peak - outer.reserved_start == 64 * MB
        del x
    finally:
        reset_cpu_device()


def test_a_measured_training_loop_reports_the_same_reserved_memory_reused_or_run():
    """Device: cpu, with the simulated GPU behind it. A steady training loop inside measure(); a second simulated
    device that runs every event is fed the same events (the counter's calls to the first, passed on) and has
    adopted the same storages. The steps the first device reuses report the reserved memory, and leave the
    statistics and segments, that running every event gives."""
    import gpukit
    from gpukit.allocator import SimulatedDevice, reset_cpu_device
    from gpukit.counter import LEDGER

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(256, 64, device="cpu"), torch.randint(0, 10, (256,), device="cpu")
    dev = reset_cpu_device("16 GiB")
    twin = SimulatedDevice("16 GiB", lazy=False)
    for key, nbytes in list(LEDGER.sizes.items()):  # what dev adopted, in the order it adopted it
        twin.on_alloc(key, nbytes, False)

    def both(name):
        first, second = getattr(dev, name), getattr(twin, name)

        def call(*args):
            first(*args)
            second(*args)
        return call

    for name in ("on_alloc", "on_free", "on_resize"):
        setattr(dev, name, both(name))  # the counter calls its listener's methods: these, now

    class Tee:
        """The event queue the counter appends to directly (``event_queue``): each event to the twin too."""

        def __init__(self, queue):
            self.queue = queue

        def append(self, event):
            key, nbytes = event
            twin.on_alloc(key, nbytes) if nbytes else twin.on_free(key)
            self.queue.append(event)

    real_queue = dev.event_queue
    dev.event_queue = lambda: None if real_queue() is None else Tee(real_queue())
    try:
        for _ in range(10):
            cell = twin.watch()
            with gpukit.measure("cpu", record=False) as r:
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            assert (r.reserved_peak, r.reserved_end) == (twin.unwatch(cell), twin.reserved())
            assert dev.allocator.memory_stats() == twin.allocator.memory_stats()
            assert dev.allocator.segments() == twin.allocator.segments()
        assert dev.units_reused >= 5 and twin.units_reused == 0
    finally:
        reset_cpu_device()


def test_a_cap_after_reused_steps_still_fails_the_allocation_that_passes_it():
    """Device: cpu, with the simulated GPU behind it. Once steps are being reused, budget(reserved=True) must
    still raise CUDA's out-of-memory error from the allocation that passes the cap, inside the block."""
    import gpukit
    from gpukit.allocator import cpu_device, reset_cpu_device

    reset_cpu_device("16 GiB")
    try:
        for _ in range(6):
            with gpukit.measure("cpu", record=False):
                t = torch.empty(30 * MB, dtype=torch.uint8, device="cpu")
                del t
        assert cpu_device().units_reused >= 2
        cpu_device().allocator.empty_cache()  # as budget() does on entry: the cap counts from here
        base = cpu_device().allocator.memory_reserved()
        made = []
        with pytest.raises(SimulatedOutOfMemoryError, match="CUDA out of memory. Tried to allocate 30.00 MiB"):
            with gpukit.budget(base + 40 * MB, device="cpu", reserved=True):
                made.append(torch.empty(20 * MB, dtype=torch.uint8, device="cpu"))
                made.append(torch.empty(30 * MB, dtype=torch.uint8, device="cpu"))
        assert len(made) == 1  # the first fits; the second fails where it is asked for
    finally:
        reset_cpu_device()


def test_a_unit_that_repeats_while_the_state_grows_is_compared_less_and_less_often(monkeypatch):
    """Device: a simulated GPU (no torch device). A leak (``total_loss += loss``) repeats the same events
    while the allocator's state grows, so no unit can be reused; comparing whole states every time would
    cost a model's every block per step. Each failed comparison doubles the wait before the next one."""
    calls = []
    real = CachingAllocator.state_key
    monkeypatch.setattr(CachingAllocator, "state_key", lambda self: calls.append(1) or real(self))
    twins = _Twins("expandable_segments:True")
    for _ in range(100):
        twins.watched(lambda: twins.alloc(1 * MB))
        twins.same()
    assert twins.lazy.units_reused == 0
    # Checked after 1, 2, 4, ... 64 repeats: about seven checks of one or two states each in 100 units;
    # comparing every unit would take 100 to 200.
    assert 6 <= len(calls) <= 30, len(calls)


def test_blocks_on_two_threads_leave_the_simulated_device_in_step_with_the_counter():
    """Device: cpu, with the simulated GPU behind it. Two threads measure training-like loops at once (their
    events queued from both, each block end running the queue): afterwards the simulated allocator holds
    exactly what the counter counts live (small tensors only: each gets a block of its rounded size; both
    counted from where they stood, as storages of earlier tests may be bigger)."""
    import threading

    import gpukit
    from gpukit.allocator import cpu_device, reset_cpu_device
    from gpukit.counter import LEDGER

    dev = reset_cpu_device("16 GiB")
    errors, kept = [], []

    def held() -> int:
        return dev.allocator.memory_allocated() - LEDGER.live_rounded

    start = held()

    def loop(width: int) -> None:
        try:
            for i in range(40):
                with gpukit.measure("cpu", record=False):
                    acts = [torch.empty(width * (j + 1), device="cpu") for j in range(5)]
                    del acts[::2]
                    if i % 10 == 0:
                        kept.append(torch.empty(width, device="cpu"))
                    del acts
        except BaseException as err:  # noqa: BLE001 - handed to the test thread
            errors.append(err)

    try:
        threads = [threading.Thread(target=loop, args=(w,)) for w in (1000, 3000)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        assert cpu_device() is dev and len(kept) == 8 and held() == start
        kept.clear()
        assert held() == start
    finally:
        reset_cpu_device()


def test_a_held_simulated_device_read_after_a_del_has_counted_the_free():
    """Device: cpu, with the simulated GPU behind it. The device reset_cpu_device() returns, read later
    through the reference kept (not through cpu_device()), shows a tensor deleted outside any block as freed."""
    import gpukit
    from gpukit.allocator import reset_cpu_device

    dev = reset_cpu_device("16 GiB")
    try:
        with gpukit.measure("cpu", record=False):
            x = torch.empty(16 * MB, dtype=torch.uint8, device="cpu")
        allocated = dev.allocator.memory_allocated()
        del x
        assert dev.allocator.memory_allocated() == allocated - 16 * MB
    finally:
        reset_cpu_device()


@pytest.mark.parametrize("abbreviated", [False, True])
def test_memory_summary_is_torch_cuda_memory_summary_of_the_simulated_statistics(monkeypatch, abbreviated):
    """Device: a simulated CUDA GPU (no real device). The table is torch/cuda/memory.py memory_summary's:
    the installed torch formats the simulated statistics itself (its memory_stats replaced by the
    simulation's), and the two texts are equal. The figures of a known sequence are checked by hand:
    3 MiB in a new 20 MiB segment (17 MiB split off: non-releasable), 1000 bytes (1024 rounded) in a
    2 MiB small segment, freed (its segment whole again), then 70 MiB under max_split_size_mb:64: an
    oversize block in an oversize segment of its own, freed (the segment stays cached)."""
    import torch.cuda.memory as cuda_memory

    s = CachingAllocator("16 GiB", "max_split_size_mb:64")
    s.malloc(3 * MB)
    s.free(s.malloc(1000))
    big = s.malloc(70 * MB)  # oversize: at or above max_split_size
    s.free(big)
    monkeypatch.setattr(cuda_memory, "memory_stats", lambda device=None: s.memory_stats())
    assert s.memory_summary(abbreviated) == cuda_memory.memory_summary(0, abbreviated=abbreviated)

    lines = s.memory_summary().splitlines()

    def row(metric, below=0):  # the "all" row of a metric, or a pool's row below it
        return lines[[line.startswith(f"| {metric:<21} |") for line in lines].index(True) + below]

    assert row("Allocated memory") == "| Allocated memory      |   3072 KiB |  74752 KiB |  74753 KiB |  71681 KiB |"
    assert row("Allocated memory", 2) == "|       from small pool |      0 KiB |      1 KiB |      1 KiB |      1 KiB |"
    assert row("Non-releasable memory") == "| Non-releasable memory |  17408 KiB |  19455 KiB |  19455 KiB |   2047 KiB |"
    assert row("GPU reserved memory") == "| GPU reserved memory   |  94208 KiB |  94208 KiB |  94208 KiB |      0 B   |"
    assert row("Oversize allocations") == "| Oversize allocations  |       0    |       1    |       1    |       1    |"
    assert row("Oversize GPU segments") == "| Oversize GPU segments |       1    |       1    |       1    |       0    |"
    assert lines[1] == "|                  PyTorch CUDA memory summary, device ID 0                 |"


def test_simulated_device_memory_summary_is_its_allocators():
    """Device: a simulated CUDA GPU fed by the counter (SimulatedDevice; no real device): the summary of the
    device, up to date, is its allocator's."""
    from gpukit.allocator import SimulatedDevice

    dev = SimulatedDevice("16 GiB", context_bytes=0, lazy=False)
    dev.on_alloc(1, 3 * MB)
    dev.on_alloc(2, 1000)
    dev.on_free(2)
    assert dev.memory_summary() == dev.allocator.memory_summary()
    assert "|   3072 KiB |   3073 KiB |" in dev.memory_summary()


def test_simulated_device_holds_the_cuda_context_allowance_by_default():
    """Device: a simulated 16 GiB CUDA GPU (no real device). A real process holds a CUDA context from its
    first CUDA call, before any tensor: nvidia-smi counts it, cudaMemGetInfo's free memory lacks it, the
    OOM message's "this process has" includes it, reserved memory does not. The simulated device holds
    the allowance plan() and predict() use (one constant), unless told otherwise."""
    from gpukit import estimate
    from gpukit.allocator import CONTEXT_ALLOWANCE, SimulatedDevice, cpu_device, reset_cpu_device

    assert estimate.CONTEXT_ALLOWANCE is CONTEXT_ALLOWANCE == 2**30
    s = CachingAllocator("16 GiB")
    assert s.context_bytes == CONTEXT_ALLOWANCE and s.memory_reserved() == 0
    assert s.mem_get_info() == (15 * 1024**3, 16 * 1024**3) and s.nvidia_smi_bytes() == CONTEXT_ALLOWANCE
    s.malloc(3 * MB)
    assert s.nvidia_smi_bytes() == CONTEXT_ALLOWANCE + 20 * MB and s.memory_reserved() == 20 * MB
    with pytest.raises(torch.OutOfMemoryError, match="of which 14.98 GiB is free. Including non-PyTorch memory, "
                                                     "this process has 1.02 GiB memory in use"):
        s.malloc(15 * 1024**3)
    assert SimulatedDevice("16 GiB")._alloc.context_bytes == CONTEXT_ALLOWANCE
    assert CachingAllocator("16 GiB", context_bytes=0).mem_get_info()[0] == 16 * 1024**3
    try:
        assert reset_cpu_device().allocator.context_bytes == CONTEXT_ALLOWANCE
        set_off = reset_cpu_device(context_bytes=0)
        assert set_off.allocator.context_bytes == 0 and cpu_device() is set_off
    finally:
        reset_cpu_device()
