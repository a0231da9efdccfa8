"""A simulation of PyTorch's CUDA caching allocator: reserved memory and fragmentation on any machine.

    from gpukit.allocator import CachingAllocator
    sim = CachingAllocator(total_memory="16 GiB")
    a = sim.malloc(3 * 2**20)         # 3 MiB: carved from a new 20 MiB segment
    sim.free(a)                        # back to the cache, still reserved
    sim.memory_reserved()              # 20971520
    sim.empty_cache()                  # the segment goes back to the driver

What is modelled is the policy of ``DeviceCachingAllocator`` in
c10/cuda/CUDACachingAllocator.cpp, with its settings from c10/core/AllocatorConfig.{h,cpp}
(``PYTORCH_CUDA_ALLOC_CONF``, the ``AcceleratorAllocatorConfig`` of PyTorch 2.9 and later),
for PyTorch 2.11; its functions carry the C++ names so that each can be checked
against the source. Versions differ in details this follows the newer side of: an oversize
cached block serves a request within ``max_non_split_rounding_mb`` (20 MiB unless set; older
versions: 20 MiB always); garbage collection and ``release_available_cached_blocks`` skip
expandable-segment blocks; ``roundup_power2_divisions:[...,>:N]`` sets the intervals after
the last one named (older parsers overwrote that one too); a new settings string resets
max_split_size, the divisions and the gc threshold and keeps the rest. The out-of-memory
message's figures are built as in every version since 2.3; its closing advice (``OOM_ADVICE``) is
the text of the source read (PyTorch's main branch), which some 2026 error logs show word for word,
while others of early 2026 (2.10) name ``PYTORCH_ALLOC_CONF`` and the
``.../notes/cuda.html#environment-variables`` page instead: 2.11's own wording was not available here.
Of the settings newer than 2.11, ``per_process_memory_fraction`` and ``large_segment_size_mb`` are
simulated; every other key torch 2.13 accepts is accepted, with its checks (``AllocatorConfig``).

* sizes rounded up to 512 B (``round_size``), or to a power-of-two division
  (``roundup_power2_divisions``); requests of at most 1 MiB come from the small pool,
  packed in 2 MiB segments; larger ones from the large pool, in 20 MiB segments for
  requests under 10 MiB, else in segments of the request rounded up to 2 MiB
  (``get_allocation_size``);
* best fit among the cached free blocks of the same pool and stream, ordered by
  (stream, size, address) (``get_free_block``), never an oversize block
  (``max_split_size``) for a smaller request, and an oversize one only within
  ``max_non_split_rounding_size`` of the request;
* splitting (``should_split``: small blocks when 512 B or more remain, large ones
  when more than 1 MiB remains and the request is under ``max_split_size``) and
  merging of free neighbours (``free_block``, ``try_merge_blocks``);
* when no cached block fits: ``garbage_collection_threshold`` (with a per-process
  fraction set), a new segment, and on failure (device capacity, or the per-process
  fraction of ``set_per_process_memory_fraction``) freeing oversize cached blocks
  (``release_available_cached_blocks``), then every unsplit cached segment
  (``release_cached_blocks``, counted in ``num_alloc_retries``), then the OOM error
  with CUDA's exact message (``num_ooms``);
* ``empty_cache()``; ``expandable_segments`` (one growing segment per stream and pool,
  mapped in 2 MiB pages for the small pool and 20 MiB pages for the large pool,
  unmapped page by page); per-stream pools and ``record_stream`` (a block freed while
  another stream uses it waits for that stream's event: ``stream_synchronize(stream)`` or ``synchronize()``
  completes it, and the next ``malloc`` frees the block, ``process_events``);
* every statistic of ``torch.cuda.memory_stats()`` and a ``torch.cuda.memory._snapshot()``
  -shaped snapshot, drawn by ``plot_segments`` like ``torch.cuda._memory_viz``'s segment view.

Left out: CUDA graph private pools and ``torch.cuda.MemPool`` (``use_mem_pool``,
``use_on_oom``, no-split pools), IPC sharing, ``cudaMallocAsync`` (``backend:cudaMallocAsync``),
``release_lock_on_cudamalloc`` (a threading detail), pinned host memory, the free-memory
callbacks of other libraries, ``throw_on_cudamalloc_oom`` (accepted, no effect), the expandable-segment
reserve options of versions after 2.13, and several devices (one device per object).
CUDA events are not timed: an event completes when ``stream_synchronize(stream)`` or ``synchronize()``
says its stream caught up (then the next ``malloc`` frees its block), or at ``empty_cache()`` and on the
out-of-memory path, which synchronize and free at once (``synchronize_and_free_events``). Addresses are
made up (a new segment starts above every earlier one); a replay of a recorded trace
can take the recorded ones instead (``address_source``).

Driving it: ``CachingAllocator.malloc/free`` directly; ``SimulatedDevice`` fed by gpukit's counter
(``measure()`` on CPU uses ``cpu_device()``; ``predict()`` runs under ``follow(FAKE_LEDGER)``);
``replay(load_snapshot(path))`` for a recorded ``torch.cuda.memory._dump_snapshot()`` pickle.
A ``SimulatedDevice`` queues the counter's events and runs them when it is read; a training step that
repeats from the state it leaves unchanged is run once and then applied from its record (the policy is
deterministic: same state, same events, same outcome), so following a training loop costs a step next to
nothing once it is steady (``python3 kit.py bench allocator``).

The modules follow PyTorch's own split: ``config`` the settings (``CUDAAllocatorConfig``), ``caching`` the
policy (``CUDACachingAllocator.cpp``: the allocator's state and ``malloc``), with its named parts beside it:
``blocks`` (blocks, pools, segments), ``stats`` (``memory_stats``, ``memory_summary``), ``driver`` (segments from
the driver and back), ``expandable`` (expandable segments), ``free`` (``free`` and stream events), ``oom`` (the
out-of-memory error) and ``snapshot`` (segments, snapshot, state key); ``device`` the simulated device the
counter feeds, ``replay`` recorded traces, ``plots`` the segment map. Every name is importable from
``gpukit.allocator``.

Validated against PyTorch's own allocator tests and recorded traces: tests/test_allocator.py.
"""

from .blocks import Block, BlockPool, ExpandableSegment
from .caching import SIMULATED, CachingAllocator
from .config import (CONTEXT_ALLOWANCE, SIZE_MAX, AllocatorConfig, kLargeBuffer, kMB, kMinBlockSize, kMinLargeAlloc,
                     kRoundLarge, kRoundUpPowerOfTwoIntervals, kSmallBuffer, kSmallSize, roundup_power2_next_division)
from .device import (SimulatedDevice, apply_events, cpu_device, follow, replay_events, reset_cpu_device,
                     set_cpu_simulation, use_cpu_device)
from .oom import OOM_ADVICE, SimulatedOutOfMemoryError, format_size
from .plots import plot_segments
from .reads import CardMemory, WholeBlocks, workspace_segments
from .replay import ReplayReport, config_of_snapshot, load_snapshot, replay, save_compact
from .stats import POOL_NAMES, STAT_NAMES

__all__ = ["AllocatorConfig", "Block", "BlockPool", "CONTEXT_ALLOWANCE", "CachingAllocator", "ExpandableSegment",
           "OOM_ADVICE", "POOL_NAMES", "ReplayReport", "SIMULATED", "SIZE_MAX", "STAT_NAMES", "SimulatedDevice",
           "SimulatedOutOfMemoryError", "config_of_snapshot", "cpu_device", "follow", "format_size",
           "kLargeBuffer", "kMB", "kMinBlockSize", "kMinLargeAlloc", "kRoundLarge", "kRoundUpPowerOfTwoIntervals",
           "kSmallBuffer", "kSmallSize", "load_snapshot", "plot_segments", "replay", "replay_events",
           "reset_cpu_device", "roundup_power2_next_division", "save_compact", "set_cpu_simulation", "use_cpu_device",
           "WholeBlocks", "CardMemory", "apply_events", "workspace_segments"]
