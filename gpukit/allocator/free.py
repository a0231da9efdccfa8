"""Freeing: a block back to its pool, merged with its free neighbours; a block another stream used waits for
that stream's event (``record_stream``, ``process_events``, ``synchronize``); ``empty_cache()``."""

from __future__ import annotations

from collections import deque

from .blocks import Block, BlockPool
from .stats import LARGE_POOL, SMALL_POOL, decrease, decrease_in_pool, increase_in_pool


class FreePart:
    """The allocator's part that frees blocks, now or once the streams that used them are done."""

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
        p = SMALL_POOL if pool.is_small else LARGE_POOL
        st = self.stats
        decrease_in_pool(st[0], p, 1)
        decrease_in_pool(st[4], p, b.size)
        if self.trace is not None:
            self.trace.append(("free_requested", b.addr, b.requested, b.stream))
        if b.size >= self.config.max_split_size:
            decrease(self.oversize_allocations, 1)
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
        p = SMALL_POOL if pool.is_small else LARGE_POOL
        if b.es is None:
            if n_blocks > 0:
                increase_in_pool(st[3], p, n_blocks)
            elif n_blocks < 0:
                decrease_in_pool(st[3], p, -n_blocks)
            if n_bytes > 0:
                increase_in_pool(st[7], p, n_bytes)
            elif n_bytes < 0:
                decrease_in_pool(st[7], p, -n_bytes)
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

