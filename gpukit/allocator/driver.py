"""Getting memory from the driver and giving it back: a new segment (``cudaMalloc``, within the device and the
per-process fraction), releasing cached segments when a request does not fit, and ``garbage_collection_threshold``."""

from __future__ import annotations

from bisect import bisect_left

from .blocks import Block, BlockPool
from .config import SIZE_MAX, kRoundLarge
from .stats import LARGE_POOL, SMALL_POOL, decrease, decrease_in_pool, increase, increase_in_pool


class DriverPart:
    """The allocator's part that holds segments of device memory (``total_allocated_memory``)."""

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
        p = SMALL_POOL if pool.is_small else LARGE_POOL
        increase_in_pool(self.stats[1], p, 1)
        increase_in_pool(self.stats[5], p, alloc_size)
        if alloc_size >= self.config.max_split_size:
            increase(self.oversize_segments, 1)
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
        p = SMALL_POOL if pool.is_small else LARGE_POOL
        decrease_in_pool(self.stats[1], p, 1)
        decrease_in_pool(self.stats[5], p, b.size)
        if b.size >= self.config.max_split_size:
            decrease(self.oversize_segments, 1)
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

