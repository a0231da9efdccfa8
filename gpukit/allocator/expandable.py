"""Expandable segments (``expandable_segments:True``): one growing segment per stream and pool, mapped page by
page as requests need it (2 MiB pages small, 20 MiB large) and unmapped page by page when released."""

from __future__ import annotations

from bisect import bisect_left, insort

from .blocks import Block, BlockPool, ExpandableSegment
from .config import kLargeBuffer, kSmallBuffer
from .stats import LARGE_POOL, SMALL_POOL, decrease_in_pool, increase_in_pool


class ExpandablePart:
    """The allocator's part that maps and unmaps the pages of its expandable segments."""

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
        increase_in_pool(self.stats[5], SMALL_POOL if pool.is_small else LARGE_POOL, mapped)
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
        decrease_in_pool(self.stats[5], SMALL_POOL if pool.is_small else LARGE_POOL, u_size)
        self.counters["num_device_free"] += 1
        if self.trace is not None:
            self.trace.append(("segment_unmap", u_addr, u_size, b.stream))

    def _release_expandable_segment(self, b: Block) -> None:
        self.expandable.remove(b.es)
        self._erase_unmapped(b.pool, b)

