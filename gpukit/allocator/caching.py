"""The caching policy, as ``DeviceCachingAllocator`` keeps it (c10/cuda/CUDACachingAllocator.cpp): the
allocator's state, its settings, and ``malloc`` (rounding, the best-fit free block, splitting). Its other parts
are its bases, one module each: ``stats`` (``memory_stats``, ``memory_summary``), ``driver`` (segments from the
driver and back), ``expandable`` (expandable segments), ``free`` (``free``, stream events, ``empty_cache``),
``oom`` (the out-of-memory error) and ``snapshot`` (segments, snapshot, state key); ``blocks`` holds the blocks,
pools and segments they move. Every name these modules define is importable from here too."""

from __future__ import annotations

# Some names below are imported only to be importable from here, where they were defined before the parts moved out.
from bisect import bisect_left
from collections import deque

from .blocks import Block, BlockPool, ExpandableSegment
from .config import (CONTEXT_ALLOWANCE, SIZE_MAX, AllocatorConfig, kLargeBuffer, kMinBlockSize, kMinLargeAlloc,
                     kRoundLarge, kSmallBuffer, kSmallSize, roundup_power2_next_division)
from .driver import DriverPart
from .expandable import ExpandablePart
from .free import FreePart
from .oom import OOM_ADVICE, OutOfMemoryPart, SimulatedOutOfMemoryError, format_size
from .snapshot import SnapshotPart
from .stats import (LARGE_POOL, POOL_NAMES, SMALL_POOL, STAT_NAMES, StatisticsPart, decrease_in_pool, increase,
                    increase_in_pool)

SIMULATED = "simulated CUDA caching allocator"


class CachingAllocator(StatisticsPart, DriverPart, ExpandablePart, FreePart, OutOfMemoryPart, SnapshotPart):
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
        self.name: str | None = None  # the card simulated ("Tesla T4"), named in its out-of-memory error
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

    def mem_get_info(self) -> tuple[int, int]:
        """``torch.cuda.mem_get_info``: (free, total) bytes of the simulated device."""
        return self.total_memory - self.context_bytes - self.total_allocated_memory, self.total_memory

    def nvidia_smi_bytes(self) -> int:
        """What nvidia-smi shows for this process: reserved memory plus the context."""
        return self.total_allocated_memory + self.context_bytes

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
        p = SMALL_POOL if pool.is_small else LARGE_POOL
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
                    decrease_in_pool(st[7], p, block.size)
                else:
                    increase_in_pool(st[7], p, remaining.size)
                    increase_in_pool(st[3], p, 1)
        elif already_split and block.es is None:
            decrease_in_pool(st[7], p, block.size)
            decrease_in_pool(st[3], p, 1)
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
            increase(self.oversize_allocations, 1)
        if self.trace is not None:
            self.trace.append(("alloc", block.addr, orig_size, stream))
        return block.addr
