"""Blocks, pools and segments: a block of a segment (split and merged in place), the free blocks of one pool
in ``BlockComparatorSize`` order, and an expandable segment's address space (c10/cuda/CUDACachingAllocator.cpp)."""

from __future__ import annotations

from bisect import bisect_left, insort


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
