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

import random

import pytest
import torch

from allocator_cases import EXPANDABLE, GPU, MB, TRACES, float32, sim
from gpukit.allocator import AllocatorConfig, CachingAllocator, load_snapshot, replay

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
