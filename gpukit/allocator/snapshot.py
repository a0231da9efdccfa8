"""What is there, read and written: the segments and a ``torch.cuda.memory._snapshot()``-shaped dict, the
state's key (two states with equal keys answer alike), and a segment put in from a recorded snapshot."""

from __future__ import annotations

from .blocks import Block
from .config import SIZE_MAX, kRoundLarge
from .stats import LARGE_POOL, SMALL_POOL, increase_in_pool


class SnapshotPart:
    """The allocator's part that describes its state and sets one up."""

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
        p = SMALL_POOL if small else LARGE_POOL
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
        increase_in_pool(self.stats[1], p, 1)
        increase_in_pool(self.stats[5], p, size)
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
                    increase_in_pool(self.stats[3], p, 1)
                    increase_in_pool(self.stats[7], p, n)
            else:
                b.allocated = True
                b.requested = req
                self.active[a] = b
                for k, v in ((0, 1), (4, n), (2, 1), (6, n), (8, req)):
                    increase_in_pool(self.stats[k], p, v)

