"""The simulated CUDA caching allocator's own rules (gpukit.allocator), beyond PyTorch's tests: rounding, pools,
splitting, streams, its out-of-memory message, refusals of bad input, expandable segments.

Device: a simulated CUDA GPU (gpukit.allocator.CachingAllocator); no real device is touched.
"""

from __future__ import annotations

import pytest

from allocator_cases import MB, sim
from gpukit.allocator import CachingAllocator, SimulatedOutOfMemoryError, format_size, load_snapshot

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
    # It says first that it is simulated, then CUDA's own words.
    label = "[a simulated GPU: gpukit's model of the CUDA caching allocator; no GPU ran this] "
    assert msg.startswith(label) and msg[len(label):] == s.oom_message(18 * MB)
    assert msg[len(label):] == ("CUDA out of memory. Tried to allocate 18.00 MiB. GPU 0 has a total capacity of 16.00 GiB of which "
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
