"""The caching policy: blocks, pools and segments, malloc/free, statistics and the out-of-memory error, as
``DeviceCachingAllocator`` keeps them (c10/cuda/CUDACachingAllocator.cpp)."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque

import torch

from .config import (CONTEXT_ALLOWANCE, SIZE_MAX, AllocatorConfig, kLargeBuffer, kMinBlockSize, kMinLargeAlloc,
                     kRoundLarge, kSmallBuffer, kSmallSize, roundup_power2_next_division)

SIMULATED = "simulated CUDA caching allocator"
OOM_ADVICE = (" If reserved but unallocated memory is large try setting"
              " PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid"
              " fragmentation.  See documentation for Memory Management "
              " (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")

STAT_NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
              "active_bytes", "inactive_split_bytes", "requested_bytes")
POOL_NAMES = ("all", "small_pool", "large_pool")
_SMALL, _LARGE = 1, 2


def format_size(size: int) -> str:
    """c10::CachingAllocator::format_size (c10/core/Allocator.h): how CUDA's messages print sizes."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024.0:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576.0:.2f} MiB"
    return f"{size / 1073741824.0:.2f} GiB"


# -- blocks, pools, segments ------------------------------------------------------------------------------------


class Block:
    __slots__ = ("addr", "size", "requested", "stream", "pool", "allocated", "prev", "next", "mapped",
                 "es", "gc_base", "stream_uses", "event_count")

    def __init__(self, addr: int, size: int, stream: int, pool: "BlockPool") -> None:
        self.addr = addr
        self.size = size
        self.requested = 0
        self.stream = stream
        self.pool = pool
        self.allocated = False
        self.prev: Block | None = None
        self.next: Block | None = None
        self.mapped = True
        self.es: ExpandableSegment | None = None
        self.gc_base = 0
        self.stream_uses: set | None = None
        self.event_count = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else ("free" if self.mapped else "unmapped")
        return f"Block({self.addr:#x}, {self.size}, {state}, stream {self.stream})"


class BlockPool:
    """Free blocks of one pool, ordered by (stream, size, address) like ``BlockComparatorSize``."""

    __slots__ = ("is_small", "keys", "blocks", "unmapped", "gc_calls")

    def __init__(self, is_small: bool) -> None:
        self.is_small = is_small
        self.keys: list[tuple[int, int, int]] = []
        self.blocks: dict[int, Block] = {}  # addr -> free mapped block
        self.unmapped: list[tuple[int, int]] = []  # (stream, addr), BlockComparatorAddress
        self.gc_calls = 0  # get_free_blocks_call_count

    def insert(self, b: Block) -> None:
        b.gc_base = self.gc_calls
        insort(self.keys, (b.stream, b.size, b.addr))
        self.blocks[b.addr] = b

    def erase(self, b: Block) -> None:
        keys = self.keys
        i = bisect_left(keys, (b.stream, b.size, b.addr))
        del keys[i]
        del self.blocks[b.addr]

    def block_at(self, i: int) -> Block:
        return self.blocks[self.keys[i][2]]


class ExpandableSegment:
    """Virtual address space for one (stream, pool), mapped page by page (2 MiB small, 20 MiB large)."""

    def __init__(self, base: int, segment_size: int, max_handles: int, stream: int) -> None:
        self.base = base
        self.segment_size = segment_size
        self.max_handles = max_handles
        self.stream = stream
        self.handles: list[bool] = []

    def size(self) -> int:
        return self.max_handles * self.segment_size


# -- the allocator --------------------------------------------------------------------------------------------


class SimulatedOutOfMemoryError(torch.OutOfMemoryError):
    """``torch.OutOfMemoryError`` raised by the simulated allocator, with CUDA's message."""


class CachingAllocator:
    """One simulated CUDA device and its caching allocator.

    Args:
        total_memory: the GPU's capacity (bytes or a size such as ``"80 GiB"``), what
            ``torch.cuda.get_device_properties().total_memory`` reports.
        config: a ``PYTORCH_CUDA_ALLOC_CONF`` string or an ``AllocatorConfig``.
        fraction: ``set_per_process_memory_fraction`` (None or 1.0: no cap).
        context_bytes: device memory the process holds outside the allocator: the CUDA context,
            which a real process holds from its first CUDA call, before any tensor. By default
            ``CONTEXT_ALLOWANCE`` (1 GiB), the allowance ``plan()`` and ``predict()`` leave free on
            every GPU: its real size depends on the GPU, driver and CUDA version (nvidia-smi's "used"
            minus ``torch.cuda.memory_reserved()`` shows it). It counts against the capacity, in
            ``mem_get_info()`` and the OOM message's figures and in what nvidia-smi shows; 0 for the
            allocator's memory alone.
        device: the GPU index the OOM message names.
        record_history: keep a trace of events like ``_record_memory_history`` does.
        address_source: ``f(size) -> address or None`` for the address of each new
            segment (a replay passes the recorded ones); None: fresh made-up addresses.

    Raises:
        ValueError: for sizes, fractions or settings that are not allowed.
    """

    def __init__(self, total_memory: int | str = 80 * 1024**3, config: str | AllocatorConfig | None = None, *,
                 fraction: float | None = None, context_bytes: int | str = CONTEXT_ALLOWANCE, device: int = 0,
                 record_history: bool = False, address_source=None) -> None:
        from ..report import parse_bytes

        self.total_memory = parse_bytes(total_memory)
        if self.total_memory <= 0:
            raise ValueError("total_memory must be a positive size, such as '16 GiB'")
        self.context_bytes = 0 if context_bytes == 0 else parse_bytes(context_bytes)
        if self.context_bytes >= self.total_memory:
            raise ValueError(f"context_bytes ({self.context_bytes}) leaves no memory on a "
                             f"{self.total_memory}-byte device (context_bytes=0: the allocator's memory alone)")
        self.device = int(device)
        self.config = config if isinstance(config, AllocatorConfig) else AllocatorConfig.parse(config or "")
        self._roundup = any(self.config.roundup_power2_divisions)
        if self.config.per_process_memory_fraction is not None and fraction is None:
            fraction = self.config.per_process_memory_fraction
        self.small = BlockPool(True)
        self.large = BlockPool(False)
        self.active: dict[int, Block] = {}  # addr -> allocated block (or freed but waiting for streams)
        self.pending: list[Block] = []  # freed while other streams used them: wait for their events
        self.cuda_events: dict[int, deque] = {}  # stream -> (event number, block) in the order recorded
        self._event_seq = 0  # events recorded so far (numbered from 1)
        self._completed: dict[int, int] = {}  # stream -> the last event number its work has reached
        self.expandable: list[ExpandableSegment] = []
        self.total_allocated_memory = 0  # what the driver has handed out (reserved)
        self.allowed_memory_maximum: int | None = None
        self._next_addr = 0x7F0000000000
        self.address_source = address_source
        self.stats = [[[0, 0, 0, 0] for _ in POOL_NAMES] for _ in STAT_NAMES]
        self.counters = dict(num_alloc_retries=0, num_ooms=0, num_sync_all_streams=0, num_device_alloc=0,
                             num_device_free=0)
        self.oversize_allocations = [0, 0, 0, 0]
        self.oversize_segments = [0, 0, 0, 0]
        self.trace: list[tuple] | None = [] if record_history else None
        self.generation = 0  # bumped by every public call that can change the state (SimulatedDevice's memo)
        if fraction is not None:
            self.set_memory_fraction(fraction)

    # -- public API, named after torch.cuda's ----------------------------------------------------------------

    def set_memory_fraction(self, fraction: float) -> None:
        """``torch.cuda.set_per_process_memory_fraction``: cap reserved memory at ``fraction`` of the device.

        As DeviceCachingAllocator::setMemoryFraction does: a fraction of 1.0 removes the cap
        (``allowed_memory_maximum`` is empty), so garbage collection stays off and the OOM message
        names no "allowed" figure, exactly as when no fraction was ever set.
        """
        if not isinstance(fraction, float):  # as torch.cuda.set_per_process_memory_fraction checks
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.allowed_memory_maximum = int(fraction * float(self.total_memory)) if fraction < 1.0 else None

    def set_settings(self, config: str | AllocatorConfig) -> None:
        """``torch.cuda.memory._set_allocator_settings``: change the settings mid-run."""
        self.generation += 1
        self.config = config if isinstance(config, AllocatorConfig) else AllocatorConfig.parse(config, self.config)
        self._roundup = any(self.config.roundup_power2_divisions)
        if self.config.per_process_memory_fraction is not None:
            self.set_memory_fraction(self.config.per_process_memory_fraction)

    def memory_allocated(self) -> int:
        return self.stats[4][0][0]

    def memory_reserved(self) -> int:
        return self.stats[5][0][0]

    def max_memory_allocated(self) -> int:
        return self.stats[4][0][1]

    def max_memory_reserved(self) -> int:
        return self.stats[5][0][1]

    def mem_get_info(self) -> tuple[int, int]:
        """``torch.cuda.mem_get_info``: (free, total) bytes of the simulated device."""
        return self.total_memory - self.context_bytes - self.total_allocated_memory, self.total_memory

    def nvidia_smi_bytes(self) -> int:
        """What nvidia-smi shows for this process: reserved memory plus the context."""
        return self.total_allocated_memory + self.context_bytes

    def memory_stats(self) -> dict[str, int]:
        """The flat dictionary of ``torch.cuda.memory_stats()``, same keys."""
        out: dict[str, int] = {}
        for name, arr in zip(STAT_NAMES, self.stats):
            for pool, s in zip(POOL_NAMES, arr):
                for metric, v in zip(("current", "peak", "allocated", "freed"), s):
                    out[f"{name}.{pool}.{metric}"] = v
        out.update(self.counters)
        for name, s in (("oversize_allocations", self.oversize_allocations),
                        ("oversize_segments", self.oversize_segments)):
            for metric, v in zip(("current", "peak", "allocated", "freed"), s):
                out[f"{name}.{metric}"] = v
        out["max_split_size"] = -1 if self.config.max_split_size == SIZE_MAX else self.config.max_split_size
        return dict(sorted(out.items()))

    def memory_summary(self, abbreviated: bool = False) -> str:
        """``torch.cuda.memory_summary()``: the statistics of ``memory_stats()`` in PyTorch's own table.

        Line for line the formatting of ``memory_summary`` in torch/cuda/memory.py (torch 2.13): the
        allocated, active, requested, reserved and non-releasable (``inactive_split``) bytes and the
        allocation, active, segment and non-releasable counts, each for all / large pool / small pool
        (``abbreviated``: all only), then the oversize allocations and segments; sizes in units chosen
        by the "all" row's value, as there.
        """
        stats = self.memory_stats()
        device = self.device

        def _format_size(sz, pref_sz):
            prefixes = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"]
            prefix = prefixes[0]
            for new_prefix in prefixes[1:]:
                if pref_sz < 768 * 1024:
                    break
                prefix = new_prefix
                sz //= 1024
                pref_sz /= 1024
            return f"{sz:6d} {prefix}"

        def _format_count(cnt, pref_cnt):
            prefixes = [" ", "K", "M"]
            prefix = prefixes[0]
            for new_prefix in prefixes[1:]:
                if pref_cnt < 750 * 1000:
                    break
                prefix = new_prefix
                cnt //= 1000
                pref_cnt /= 1000
            return f"{cnt:7d} {prefix} "

        metrics_to_display = [
            ("allocated_bytes", "Allocated memory", _format_size),
            ("active_bytes", "Active memory", _format_size),
            ("requested_bytes", "Requested memory", _format_size),
            ("reserved_bytes", "GPU reserved memory", _format_size),
            ("inactive_split_bytes", "Non-releasable memory", _format_size),
            ("allocation", "Allocations", _format_count),
            ("active", "Active allocs", _format_count),
            ("segment", "GPU reserved segments", _format_count),
            ("inactive_split", "Non-releasable allocs", _format_count),
        ]
        lines = []
        lines.append("=" * 75)
        lines.append(" {_:16} PyTorch CUDA memory summary, device ID {device:<17d} ")
        lines.append("-" * 75)
        lines.append("  {_:9} CUDA OOMs: {num_ooms:<12d} | {_:6} cudaMalloc retries: {num_alloc_retries:<8d}  ")
        lines.append("=" * 75)
        lines.append("        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ")
        for metric_key, metric_name, formatter in metrics_to_display:
            lines.append("-" * 75)
            submetrics = [("all", metric_name)]
            if not abbreviated:
                submetrics.append(("large_pool", "      from large pool"))
                submetrics.append(("small_pool", "      from small pool"))
            current_prefval = peak_prefval = allocated_prefval = freed_prefval = None
            for submetric_key, submetric_name in submetrics:
                prefix = metric_key + "." + submetric_key + "."
                current = stats[prefix + "current"]
                peak = stats[prefix + "peak"]
                allocated = stats[prefix + "allocated"]
                freed = stats[prefix + "freed"]
                if current_prefval is None:
                    current_prefval, peak_prefval, allocated_prefval, freed_prefval = current, peak, allocated, freed
                lines.append(
                    f" {submetric_name:<21} | {formatter(current, current_prefval)} | {formatter(peak, peak_prefval)} | "
                    f"{formatter(allocated, allocated_prefval)} | {formatter(freed, freed_prefval)} ")
        for metric_key, metric_name, formatter in [("oversize_allocations", "Oversize allocations", _format_count),
                                                   ("oversize_segments", "Oversize GPU segments", _format_count)]:
            lines.append("-" * 75)
            prefix = metric_key + "."
            current = stats[prefix + "current"]
            peak = stats[prefix + "peak"]
            allocated = stats[prefix + "allocated"]
            freed = stats[prefix + "freed"]
            lines.append(
                f" {metric_name:<21} | {formatter(current, current)} | {formatter(peak, peak)} | "
                f"{formatter(allocated, allocated)} | {formatter(freed, freed)} ")
        lines.append("=" * 75)
        fmt_dict = {"_": "", "device": device}
        for k, v in stats.items():
            fmt_dict[k.replace(".", "-")] = v
        return "|" + "|\n|".join(lines).format(**fmt_dict) + "|\n"

    def reset_peak_stats(self) -> None:
        for arr in self.stats:
            for s in arr:
                s[1] = s[0]
        self.oversize_allocations[1] = self.oversize_allocations[0]
        self.oversize_segments[1] = self.oversize_segments[0]

    def reset_accumulated_stats(self) -> None:
        for arr in self.stats:
            for s in arr:
                s[2] = s[3] = 0
        for k in self.counters:
            self.counters[k] = 0
        for s in (self.oversize_allocations, self.oversize_segments):
            s[2] = s[3] = 0

    # -- malloc ------------------------------------------------------------------------------------------

    def round_size(self, size: int) -> int:
        if size < kMinBlockSize:
            return kMinBlockSize
        if not self._roundup:
            return kMinBlockSize * ((size + kMinBlockSize - 1) // kMinBlockSize)
        divisions = self.config.divisions_for(size)
        if divisions > 1 and size > kMinBlockSize * divisions:
            return roundup_power2_next_division(size, divisions)
        return kMinBlockSize * ((size + kMinBlockSize - 1) // kMinBlockSize)

    @staticmethod
    def get_allocation_size(size: int, large_segment_size: int = kLargeBuffer) -> int:
        """The segment a new request of ``size`` (rounded) bytes gets; between 1 and 10 MiB that is
        ``large_segment_size`` (20 MiB unless ``large_segment_size_mb`` says otherwise, PyTorch 2.13)."""
        if size <= kSmallSize:
            return kSmallBuffer
        if size < kMinLargeAlloc:
            return large_segment_size
        return kRoundLarge * ((size + kRoundLarge - 1) // kRoundLarge)

    def malloc(self, size: int, stream: int = 0) -> int:
        """Allocate ``size`` bytes on ``stream``; returns the block's address.

        A request of 0 bytes returns 0 (CUDA's null pointer) and allocates nothing, as
        NativeCachingAllocator::allocate does (it calls malloc only ``if (size != 0)``); ``free(0)``
        and ``record_stream(0, ...)`` then do nothing, as NativeCachingAllocator::free and
        recordStream return at once for a null pointer.

        Raises:
            SimulatedOutOfMemoryError: (a ``torch.OutOfMemoryError``) with CUDA's message.
            ValueError: for a negative or non-integer size.
        """
        if type(size) is not int or size < 0:  # bool is refused too
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ValueError(f"malloc takes a size in bytes (an int >= 0), not {size!r}")
            size = int(size)
        if size >= 1152921504606846976:
            self._oom_plain("CUDA out of memory. Tried to allocate more than 1EB memory.")
        if size == 0:
            return 0
        orig_size = size
        self.generation += 1
        if self.pending:
            self.process_events()
        if self._roundup:
            size = self.round_size(size)
        else:  # round_size without power-2 divisions: up to a multiple of 512 bytes
            size = kMinBlockSize if size < kMinBlockSize else (size + kMinBlockSize - 1) & -kMinBlockSize
        pool = self.small if size <= kSmallSize else self.large
        block = self._get_free_block(pool, stream, size)
        if block is None:
            alloc_size = self.get_allocation_size(size, self.config.large_segment_size)
            gc = self.config.garbage_collection_threshold
            if self.allowed_memory_maximum is not None and gc > 0.0:
                self._garbage_collect_cached_blocks()
            block = self._alloc_block(pool, stream, size, alloc_size, False)
            if block is None and self._release_available_cached_blocks(pool, stream, size):
                block = self._alloc_block(pool, stream, size, alloc_size, False)
            if block is None:
                self._release_cached_blocks()
                block = self._alloc_block(pool, stream, size, alloc_size, True)
            if block is None:
                self._raise_oom(size, alloc_size, stream)
        remaining = block.size - size  # should_split, inline: this is the hot path
        if pool.is_small or self.config.expandable_segments:
            split = remaining >= kMinBlockSize
        else:
            split = size < self.config.max_split_size and remaining > kSmallSize
        return self._alloc_found_block(block, pool, stream, size, orig_size, split)

    def _get_free_block(self, pool: BlockPool, stream: int, size: int) -> Block | None:
        cfg = self.config
        if self.allowed_memory_maximum is not None and cfg.garbage_collection_threshold > 0.0:
            pool.gc_calls += 1
        keys = pool.keys
        i = bisect_left(keys, (stream, size, -1))
        n = len(keys)
        if i == n or keys[i][0] != stream:
            return None
        b = pool.blocks[keys[i][2]]
        if b.es is not None:
            if cfg.expandable_segments:
                def expandable_size(x: Block) -> int:
                    return x.size + (x.next.size if x.next is not None and not x.next.mapped else 0)
                j = i + 1
                while b.es is not None and j < n and keys[j][0] == stream:
                    nb = pool.blocks[keys[j][2]]
                    if expandable_size(nb) < expandable_size(b):
                        i, b = j, nb
                        j += 1
                    else:
                        break
            else:
                i += 1
                while i < n and keys[i][0] == stream and pool.blocks[keys[i][2]].es is not None:
                    i += 1
                if i == n or keys[i][0] != stream:
                    return None
                b = pool.blocks[keys[i][2]]
        mss = cfg.max_split_size
        if size < mss and b.size >= mss:
            return None
        if size >= mss and b.size >= size + cfg.max_non_split_rounding_size:
            return None
        del keys[i]
        del pool.blocks[b.addr]
        return b

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool.is_small or self.config.expandable_segments:
            return remaining >= kMinBlockSize
        return size < self.config.max_split_size and remaining > kSmallSize

    def _alloc_found_block(self, block: Block, pool: BlockPool, stream: int, size: int, orig_size: int,
                           split: bool) -> int:
        st = self.stats
        p = _SMALL if pool.is_small else _LARGE
        already_split = block.is_split()
        if split:
            remaining = block
            block = Block(remaining.addr, size, stream, pool)
            block.es = remaining.es
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.addr += size
            remaining.size -= size
            pool.insert(remaining)
            if block.es is None:
                if already_split:
                    _dec2(st[7], p, block.size)
                else:
                    _inc2(st[7], p, remaining.size)
                    _inc2(st[3], p, 1)
        elif already_split and block.es is None:
            _dec2(st[7], p, block.size)
            _dec2(st[3], p, 1)
        block.allocated = True
        block.requested = orig_size
        self.active[block.addr] = block
        n = block.size
        # allocation, allocated_bytes, active, active_bytes, requested_bytes: +1/+size, in "all" and the pool
        for s in (st[0][0], st[0][p], st[2][0], st[2][p]):
            c = s[0] + 1
            s[0] = c
            if c > s[1]:
                s[1] = c
            s[2] += 1
        for s in (st[4][0], st[4][p], st[6][0], st[6][p]):
            c = s[0] + n
            s[0] = c
            if c > s[1]:
                s[1] = c
            s[2] += n
        for s in (st[8][0], st[8][p]):
            c = s[0] + orig_size
            s[0] = c
            if c > s[1]:
                s[1] = c
            s[2] += orig_size
        if block.size >= self.config.max_split_size:
            _inc(self.oversize_allocations, 1)
        if self.trace is not None:
            self.trace.append(("alloc", block.addr, orig_size, stream))
        return block.addr

    # -- getting memory from the driver ----------------------------------------------------------------------

    def _device_free(self) -> int:
        return self.total_memory - self.context_bytes - self.total_allocated_memory

    def _new_address(self, size: int) -> int:
        if self.address_source is not None:
            addr = self.address_source(size)
            if addr is not None:
                return addr
        addr = self._next_addr
        self._next_addr += -(-size // kRoundLarge) * kRoundLarge
        return addr

    def _alloc_block(self, pool: BlockPool, stream: int, size: int, alloc_size: int, is_retry: bool) -> Block | None:
        if is_retry:
            self.counters["num_alloc_retries"] += 1
        if self.allowed_memory_maximum is not None and \
                self.total_allocated_memory + alloc_size > self.allowed_memory_maximum:
            return None
        if self.config.expandable_segments:
            return self._try_allocate_expandable_block(pool, stream, size)
        if alloc_size > self._device_free():  # cudaMalloc fails
            return None
        self.total_allocated_memory += alloc_size
        block = Block(self._new_address(alloc_size), alloc_size, stream, pool)
        p = _SMALL if pool.is_small else _LARGE
        _inc2(self.stats[1], p, 1)
        _inc2(self.stats[5], p, alloc_size)
        if alloc_size >= self.config.max_split_size:
            _inc(self.oversize_segments, 1)
        self.counters["num_device_alloc"] += 1
        if self.trace is not None:
            self.trace.append(("segment_alloc", block.addr, alloc_size, stream))
        return block

    def _release_available_cached_blocks(self, pool: BlockPool, stream: int, size: int) -> bool:
        mss = self.config.max_split_size
        if mss == SIZE_MAX:
            return False
        key_size = mss if size < mss else size
        keys = pool.keys
        i = bisect_left(keys, (stream, key_size, -1))
        if i == len(keys) or keys[i][0] != stream or pool.block_at(i).es is not None:
            if i == 0:
                return False
            released = 0
            i -= 1
            while released < key_size and keys[i][1] >= mss and keys[i][0] == stream:
                cur = pool.block_at(i)
                first = i == 0
                if not first:
                    i -= 1
                if cur.es is None:
                    released += cur.size
                    self._release_block(cur)
                if first:
                    break
            if released < key_size:
                return False
        else:
            self._release_block(pool.block_at(i))
        return True

    def _release_cached_blocks(self) -> None:
        self._synchronize_and_free_events()
        self._release_blocks(self.large)
        self._release_blocks(self.small)

    def _release_blocks(self, pool: BlockPool) -> None:
        to_unmap = []
        for key in list(pool.keys):
            b = pool.blocks[key[2]]
            if b.es is not None:
                to_unmap.append(b)
            elif b.prev is None and b.next is None:
                self._release_block(b)
        for b in to_unmap:
            self._unmap_block(b)
            if b.prev is None and b.next is None:
                self._release_expandable_segment(b)

    def _release_block(self, b: Block) -> None:
        pool = b.pool
        self.counters["num_device_free"] += 1
        if self.trace is not None:
            self.trace.append(("segment_free", b.addr, b.size, b.stream))
        self.total_allocated_memory -= b.size
        p = _SMALL if pool.is_small else _LARGE
        _dec2(self.stats[1], p, 1)
        _dec2(self.stats[5], p, b.size)
        if b.size >= self.config.max_split_size:
            _dec(self.oversize_segments, 1)
        pool.erase(b)

    def _garbage_collect_cached_blocks(self) -> None:
        gc_threshold = int(self.config.garbage_collection_threshold * float(self.allowed_memory_maximum))
        if self.total_allocated_memory <= gc_threshold:
            return
        target_size = self.total_allocated_memory - gc_threshold
        reclaimed = 0
        pool = self.large
        total_age = 0
        count = 0
        for key in pool.keys:
            b = pool.blocks[key[2]]
            if not b.is_split():
                total_age += pool.gc_calls - b.gc_base
                count += 1
        if count == 0:
            return
        freed = True
        while reclaimed < target_size and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for key in list(pool.keys):
                b = pool.blocks.get(key[2])
                if b is None or b.size != key[1]:
                    continue
                age = pool.gc_calls - b.gc_base
                if not b.is_split() and b.es is None and age >= age_threshold:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self._release_block(b)

    # -- expandable segments ----------------------------------------------------------------------------

    def _find_expandable_block(self, pool: BlockPool, stream: int, size: int) -> Block:
        def allocatable(b: Block | None) -> bool:
            return b is not None and not b.allocated and b.event_count == 0 and not b.stream_uses

        def has_space(b: Block | None) -> bool:
            got = 0
            while got < size and allocatable(b):
                got += b.size
                b = b.next
            return got >= size

        i = bisect_left(pool.unmapped, (stream, -1))
        while i < len(pool.unmapped) and pool.unmapped[i][0] == stream:
            c = self._unmapped_by_addr[pool.unmapped[i][1]]
            if allocatable(c.prev):
                c = c.prev
            if has_space(c):
                return c
            i += 1
        segment_size = kSmallBuffer if pool.is_small else kLargeBuffer
        space = self.total_memory + self.total_memory // 8
        max_handles = -(-space // segment_size)
        es = ExpandableSegment(self._new_address(max_handles * segment_size), segment_size, max_handles, stream)
        self.expandable.append(es)
        c = Block(es.base, es.size(), stream, pool)
        c.mapped = False
        c.es = es
        self._insert_unmapped(pool, c)
        return c

    @property
    def _unmapped_by_addr(self) -> dict[int, Block]:
        d = getattr(self, "_unmapped_map", None)
        if d is None:
            d = self._unmapped_map = {}
        return d

    def _insert_unmapped(self, pool: BlockPool, b: Block) -> None:
        insort(pool.unmapped, (b.stream, b.addr))
        self._unmapped_by_addr[b.addr] = b

    def _erase_unmapped(self, pool: BlockPool, b: Block) -> None:
        i = bisect_left(pool.unmapped, (b.stream, b.addr))
        del pool.unmapped[i]
        del self._unmapped_by_addr[b.addr]

    def _es_map(self, es: ExpandableSegment, addr: int, size: int) -> int:
        """ExpandableSegment::map: pages covering [addr, addr+size); the bytes mapped, 0 when out of memory."""
        seg = es.segment_size
        begin = (addr - es.base) // seg
        end = -(-(addr + size - es.base) // seg)
        if begin == end:
            return 0
        while end > len(es.handles):
            es.handles.append(False)
        need = (end - begin) * seg
        if need > self._device_free():  # cuMemCreate fails
            while es.handles and not es.handles[-1]:
                es.handles.pop()
            return 0
        for i in range(begin, end):
            es.handles[i] = True
        return need

    def _map_block(self, to_map: Block, size: int) -> bool:
        es = to_map.es
        mapped = self._es_map(es, to_map.addr, size)
        if mapped == 0:
            return False
        pool = to_map.pool
        self._erase_unmapped(pool, to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = Block(to_map.addr + mapped, to_map.size - mapped, to_map.stream, pool)
            rest.mapped = False
            rest.es = es
            rest.prev, rest.next = to_map, to_map.next
            if to_map.next is not None:
                to_map.next.prev = rest
            to_map.next = rest
            self._insert_unmapped(pool, rest)
            to_map.size = mapped
        self._try_merge_blocks(to_map, to_map.prev, pool)
        self._try_merge_blocks(to_map, to_map.next, pool)
        pool.insert(to_map)
        self.total_allocated_memory += mapped
        _inc2(self.stats[5], _SMALL if pool.is_small else _LARGE, mapped)
        self.counters["num_device_alloc"] += 1
        if self.trace is not None:
            self.trace.append(("segment_map", to_map.addr, mapped, to_map.stream))
        return True

    def _try_allocate_expandable_block(self, pool: BlockPool, stream: int, size: int) -> Block | None:
        c = self._find_expandable_block(pool, stream, size)
        if not c.mapped and not self._map_block(c, min(c.size, size)):
            return None
        while c.size < size:
            nxt = c.next
            if not self._map_block(nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt
        pool.erase(c)
        return c

    def _unmap_block(self, b: Block) -> None:
        es = b.es
        seg = es.segment_size
        begin = -(-(b.addr - es.base) // seg)
        end = (b.addr + b.size - es.base) // seg
        if begin >= end:
            return
        for i in range(begin, end):
            es.handles[i] = False
        while es.handles and not es.handles[-1]:
            es.handles.pop()
        pool = b.pool
        pool.erase(b)
        u_addr, u_size = es.base + begin * seg, (end - begin) * seg
        before = u_addr - b.addr
        if before > 0:
            bf = Block(b.addr, before, b.stream, pool)
            bf.es = es
            bf.prev, bf.next = b.prev, b
            if b.prev is not None:
                b.prev.next = bf
            b.prev = bf
            pool.insert(bf)
        after = b.size - (before + u_size)
        if after > 0:
            af = Block(u_addr + u_size, after, b.stream, pool)
            af.es = es
            af.prev, af.next = b, b.next
            if b.next is not None:
                b.next.prev = af
            b.next = af
            pool.insert(af)
        b.addr, b.size, b.mapped = u_addr, u_size, False
        self._try_merge_blocks(b, b.prev, pool)
        self._try_merge_blocks(b, b.next, pool)
        self._insert_unmapped(pool, b)
        self.total_allocated_memory -= u_size
        _dec2(self.stats[5], _SMALL if pool.is_small else _LARGE, u_size)
        self.counters["num_device_free"] += 1
        if self.trace is not None:
            self.trace.append(("segment_unmap", u_addr, u_size, b.stream))

    def _release_expandable_segment(self, b: Block) -> None:
        self.expandable.remove(b.es)
        self._erase_unmapped(b.pool, b)

    # -- free ------------------------------------------------------------------------------------------

    def record_stream(self, addr: int, stream: int) -> None:
        """``Tensor.record_stream``: the block is also used on ``stream`` (nothing for a null pointer)."""
        if addr == 0:
            return
        b = self._active_block(addr)
        self.generation += 1
        if stream != b.stream:
            if b.stream_uses is None:
                b.stream_uses = set()
            b.stream_uses.add(stream)

    def _active_block(self, addr: int) -> Block:
        b = self.active.get(addr)
        if b is None or not b.allocated:
            raise ValueError(f"invalid device pointer: {addr:#x} (not allocated by this allocator, or freed)")
        return b

    def free(self, addr: int) -> None:
        """Free the block at ``addr`` (a tensor's storage dying).

        Raises:
            ValueError: for an address that is not allocated (0, the null pointer, is freed as a no-op).
        """
        if addr == 0:
            return
        b = self._active_block(addr)
        self.generation += 1
        b.allocated = False
        pool = b.pool
        p = _SMALL if pool.is_small else _LARGE
        st = self.stats
        _dec2(st[0], p, 1)
        _dec2(st[4], p, b.size)
        if self.trace is not None:
            self.trace.append(("free_requested", b.addr, b.requested, b.stream))
        if b.size >= self.config.max_split_size:
            _dec(self.oversize_allocations, 1)
        if b.stream_uses:  # insert_events: one event on each stream that used the block
            b.event_count = len(b.stream_uses)
            for used in sorted(b.stream_uses):
                self._event_seq += 1
                self.cuda_events.setdefault(used, deque()).append((self._event_seq, b))
            b.stream_uses = None
            self.pending.append(b)
        else:
            self._free_block(b)

    def _free_block(self, b: Block) -> None:
        if self.trace is not None:
            self.trace.append(("free_completed", b.addr, b.requested, b.stream))
        del self.active[b.addr]  # an allocated block keeps its address: it is the key
        size, requested = b.size, b.requested
        pool = b.pool
        n_blocks = n_bytes = 0
        for cand in (b.prev, b.next):
            sub = self._try_merge_blocks(b, cand, pool)
            if sub:
                n_blocks -= 1
                n_bytes -= sub
        pool.insert(b)
        if b.prev is not None or b.next is not None:
            n_blocks += 1
            n_bytes += b.size
        st = self.stats
        p = _SMALL if pool.is_small else _LARGE
        if b.es is None:
            if n_blocks > 0:
                _inc2(st[3], p, n_blocks)
            elif n_blocks < 0:
                _dec2(st[3], p, -n_blocks)
            if n_bytes > 0:
                _inc2(st[7], p, n_bytes)
            elif n_bytes < 0:
                _dec2(st[7], p, -n_bytes)
        for arr, v in ((st[2], 1), (st[6], size), (st[8], requested)):
            for s in (arr[0], arr[p]):
                s[0] -= v
                s[3] += v

    def _try_merge_blocks(self, dst: Block, src: Block | None, pool: BlockPool) -> int:
        if src is None or src.allocated or src.event_count > 0 or src.stream_uses or dst.mapped != src.mapped:
            return 0
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        sub = src.size
        dst.size += sub
        if src.mapped:
            pool.erase(src)
        else:
            self._erase_unmapped(pool, src)
        return sub

    def process_events(self) -> None:
        """DeviceCachingAllocator::process_events: each stream's events, oldest first, up to the first one
        not completed; a block whose last event completed is freed (``free_block``). ``malloc`` calls it
        first, as PyTorch's does when no CUDA graph capture is under way (none is simulated). The order of
        the streams is theirs sorted (PyTorch's hash map has an order of its own; the outcome is the same)."""
        for stream in sorted(self.cuda_events):
            events = self.cuda_events[stream]
            done = self._completed.get(stream, 0)
            while events and events[0][0] <= done:  # cudaEventQuery: completed
                _, b = events.popleft()
                b.event_count -= 1
                if b.event_count == 0:
                    self.pending.remove(b)
                    self._free_block(b)
            if not events:
                del self.cuda_events[stream]

    def stream_synchronize(self, stream: int) -> None:
        """``torch.cuda.Stream.synchronize()`` (or its work seen done, as ``Event.query()`` would): the events
        recorded on ``stream`` so far have completed. As in PyTorch, the blocks they held are freed by the
        next ``malloc`` (``process_events``), not by this call."""
        self.generation += 1
        self._completed[stream] = self._event_seq

    def synchronize(self) -> None:
        """``torch.cuda.synchronize()``: every stream's events so far have completed; the next ``malloc``
        frees the blocks freed while other streams used them (``process_events``)."""
        self.generation += 1
        for stream in self.cuda_events:
            self._completed[stream] = self._event_seq

    def _synchronize_and_free_events(self) -> None:
        """DeviceCachingAllocator::synchronize_and_free_events (empty_cache and the OOM path): waits for
        every event and frees the blocks they held at once."""
        self.counters["num_sync_all_streams"] += 1
        self.synchronize()
        self.process_events()

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: give every unsplit cached segment back to the driver."""
        self.generation += 1
        self._release_cached_blocks()

    # -- out of memory -------------------------------------------------------------------------------------

    def oom_message(self, alloc_size: int) -> str:
        """The text of CUDA's out-of-memory error for a request of ``alloc_size`` bytes now.

        As DeviceCachingAllocator::malloc builds it (CUDACachingAllocator.cpp); the
        "this process" part is what NVML reports: reserved memory plus the context.
        """
        device_free, device_total = self.mem_get_info()
        allowed = "" if self.allowed_memory_maximum is None else f"{format_size(self.allowed_memory_maximum)} allowed; "
        proc = (f"Including non-PyTorch memory, this process has {format_size(self.nvidia_smi_bytes())} "
                "memory in use. ") if self.nvidia_smi_bytes() else ""  # NVML lists processes that hold memory
        allocated = self.memory_allocated()
        reserved = self.memory_reserved()
        return ("CUDA out of memory. Tried to allocate " + format_size(alloc_size) + ". GPU " + str(self.device)
                + " has a total capacity of " + format_size(device_total) + " of which " + format_size(device_free)
                + " is free. " + proc + allowed + "Of the allocated memory " + format_size(allocated)
                + " is allocated by PyTorch, and " + format_size(reserved - allocated)
                + " is reserved by PyTorch but unallocated." + OOM_ADVICE)

    def _raise_oom(self, size: int, alloc_size: int, stream: int) -> None:
        self.counters["num_ooms"] += 1
        if self.trace is not None:
            self.trace.append(("oom", self._device_free(), size, stream))
        raise SimulatedOutOfMemoryError(self.oom_message(alloc_size))

    def _oom_plain(self, message: str) -> None:
        raise SimulatedOutOfMemoryError(message)

    # -- what is there ---------------------------------------------------------------------------------------

    def segments(self) -> list[dict]:
        """The ``segments`` of ``torch.cuda.memory._snapshot()``: each with its blocks, by address."""
        heads: dict[int, Block] = {}
        for b in list(self.active.values()) + list(self.small.blocks.values()) + list(self.large.blocks.values()):
            h = b
            while h.prev is not None and h.prev.mapped:
                h = h.prev
            heads[h.addr] = h
        out = []
        for addr in sorted(heads):
            h = heads[addr]
            blocks = []
            b = h
            while b is not None and b.mapped:
                active = b.allocated or b.event_count > 0
                state = "active_allocated" if b.allocated else ("active_pending_free" if active else "inactive")
                blocks.append({"address": b.addr, "size": b.size, "requested_size": b.requested if active else 0,
                               "state": state, "frames": []})
                b = b.next
            total = sum(x["size"] for x in blocks)
            out.append({"device": self.device, "address": h.addr, "total_size": total, "stream": h.stream,
                        "segment_type": "small" if h.pool.is_small else "large", "segment_pool_id": (0, 0),
                        "is_expandable": h.es is not None, "frames": [],
                        "allocated_size": sum(x["size"] for x in blocks if x["state"] == "active_allocated"),
                        "active_size": sum(x["size"] for x in blocks if x["state"] != "inactive"),
                        "requested_size": sum(x["requested_size"] for x in blocks),
                        "blocks": blocks})
        return out

    def snapshot(self) -> dict:
        """A ``torch.cuda.memory._snapshot()``-shaped dict (``_memory_viz`` can read it)."""
        traces = []
        if self.trace is not None:
            keys = {"oom": ("device_free", "size")}
            for action, a, size, stream in self.trace:
                first, second = keys.get(action, ("addr", "size"))
                traces.append({"action": action, first: a, second: size, "stream": stream, "frames": []})
        return {"segments": self.segments(), "device_traces": [traces],
                "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": self.config.text,
                                       "max_split_size": -1 if self.config.max_split_size == SIZE_MAX
                                       else self.config.max_split_size,
                                       "garbage_collection_threshold": self.config.garbage_collection_threshold,
                                       "expandable_segments": self.config.expandable_segments}}

    def state_key(self) -> tuple:
        """Everything that decides what the allocator does next, as one comparable value: two states with
        the same key answer every sequence of calls alike (statistics' running totals aside). Every block
        (address, size, requested size, stream, neighbours, state; blocks waiting for other streams too), the
        free pools' order, the next new segment's address, what the driver has handed out, the capacity, the
        cap and the settings."""
        def block(b: Block) -> tuple:
            return (b.addr, b.size, b.requested, b.stream, b.allocated, b.mapped, b.es is not None,
                    None if b.prev is None else b.prev.addr, None if b.next is None else b.next.addr,
                    b.event_count, None if not b.stream_uses else tuple(sorted(b.stream_uses)))
        blocks = sorted(map(block, [*self.active.values(), *self.small.blocks.values(),
                                    *self.large.blocks.values(), *self._unmapped_by_addr.values()]))
        expandable = tuple((e.base, e.segment_size, e.max_handles, e.stream, tuple(e.handles))
                           for e in self.expandable)
        events = tuple((stream, tuple((b.addr, seq <= self._completed.get(stream, 0)) for seq, b in q))
                       for stream, q in sorted(self.cuda_events.items()))
        return (self._next_addr, self.total_allocated_memory, tuple(blocks), events, tuple(self.small.keys),
                tuple(self.large.keys), tuple(self.small.unmapped), tuple(self.large.unmapped), expandable,
                self.total_memory, self.context_bytes, self.allowed_memory_maximum, repr(self.config))

    def fragmentation(self) -> int:
        """Reserved but unallocated bytes (what the OOM message calls so)."""
        return self.memory_reserved() - self.memory_allocated()

    def largest_free_block(self) -> int:
        """The largest cached free block (``torch.cuda`` cacheInfo), 0 if none."""
        return max((k[1] for pool in (self.small, self.large) for k in pool.keys), default=0)

    def plot_segments(self, ax=None, title: str | None = None, max_segments: int = 40):
        """Draw this allocator's segment map (see ``plot_segments``); returns the matplotlib Axes."""
        from ..report import format_bytes
        from .plots import plot_segments

        title = title or (f"segments (simulated): {format_bytes(self.memory_reserved())} reserved, "
                          f"{format_bytes(self.memory_allocated())} allocated")
        return plot_segments(self.segments(), ax=ax, title=title, max_segments=max_segments)

    # -- a state found in a recorded snapshot ------------------------------------------------------------------

    def add_segment(self, addr: int, size: int, *, small: bool, stream: int = 0,
                    allocated: list[tuple[int, int, int]] = ()) -> None:
        """Put a segment that already exists into the simulation (for a replay that starts mid-run).

        Args:
            addr, size: where the segment is and its bytes.
            small: whether it belongs to the small pool.
            allocated: its allocated blocks as (address, size, requested size); the rest is free,
                in maximal free blocks as the allocator keeps them.

        Raises:
            ValueError: for blocks outside the segment or overlapping.
        """
        self.generation += 1
        pool = self.small if small else self.large
        p = _SMALL if small else _LARGE
        pieces = []
        at = addr
        for a, n, req in sorted(allocated):
            if a < at or a + n > addr + size:
                raise ValueError(f"block {a:#x}+{n} lies outside segment {addr:#x}+{size} or overlaps another")
            if a > at:
                pieces.append((at, a - at, None))
            pieces.append((a, n, req))
            at = a + n
        if at < addr + size:
            pieces.append((at, addr + size - at, None))
        self.total_allocated_memory += size
        _inc2(self.stats[1], p, 1)
        _inc2(self.stats[5], p, size)
        self._next_addr = max(self._next_addr, -(-(addr + size) // kRoundLarge) * kRoundLarge)
        prev = None
        split = len(pieces) > 1
        for a, n, req in pieces:
            b = Block(a, n, stream, pool)
            b.prev = prev
            if prev is not None:
                prev.next = b
            prev = b
            if req is None:
                pool.insert(b)
                if split:
                    _inc2(self.stats[3], p, 1)
                    _inc2(self.stats[7], p, n)
            else:
                b.allocated = True
                b.requested = req
                self.active[a] = b
                for k, v in ((0, 1), (4, n), (2, 1), (6, n), (8, req)):
                    _inc2(self.stats[k], p, v)


def _inc(s: list, n: int) -> None:
    s[0] += n
    if s[0] > s[1]:
        s[1] = s[0]
    s[2] += n


def _dec(s: list, n: int) -> None:
    s[0] -= n
    s[3] += n


def _inc2(arr: list, p: int, n: int) -> None:
    s = arr[0]
    s[0] += n
    if s[0] > s[1]:
        s[1] = s[0]
    s[2] += n
    s = arr[p]
    s[0] += n
    if s[0] > s[1]:
        s[1] = s[0]
    s[2] += n


def _dec2(arr: list, p: int, n: int) -> None:
    s = arr[0]
    s[0] -= n
    s[3] += n
    s = arr[p]
    s[0] -= n
    s[3] += n
