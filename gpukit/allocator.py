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
for PyTorch 2.11; the functions below carry the C++ names so that each can be checked
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
Of the settings newer than 2.11, ``per_process_memory_fraction`` is simulated;
``large_segment_size_mb`` is refused with a message saying so.

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
  another stream uses it waits for ``synchronize()``);
* every statistic of ``torch.cuda.memory_stats()`` and a ``torch.cuda.memory._snapshot()``
  -shaped snapshot, drawn by ``plot_segments`` like ``torch.cuda._memory_viz``'s segment view.

Left out: CUDA graph private pools and ``torch.cuda.MemPool`` (``use_mem_pool``,
``use_on_oom``, no-split pools), IPC sharing, ``cudaMallocAsync`` (``backend:cudaMallocAsync``),
``release_lock_on_cudamalloc`` (a threading detail), pinned host memory, the free-memory
callbacks of other libraries, ``throw_on_cudamalloc_oom`` and the expandable-segment
reserve options of versions after 2.13, and several devices (one device per object).
CUDA events are not timed: a block used on another stream is free once ``synchronize()``
(or an ``empty_cache()``, which synchronizes) says the GPU caught up. Addresses are
made up (a new segment starts above every earlier one); a replay of a recorded trace
can take the recorded ones instead (``address_source``).

Driving it: ``CachingAllocator.malloc/free`` directly; ``SimulatedDevice`` fed by gpukit's counter
(``measure()`` on CPU uses ``cpu_device()``; ``predict()`` runs under ``follow(FAKE_LEDGER)``);
``replay(load_snapshot(path))`` for a recorded ``torch.cuda.memory._dump_snapshot()`` pickle.
A ``SimulatedDevice`` queues the counter's events and runs them when it is read; a training step that
repeats from the state it leaves unchanged is run once and then applied from its record (the policy is
deterministic: same state, same events, same outcome), so following a training loop costs a step next to
nothing once it is steady (``python3 kit.py bench allocator``).

Validated against PyTorch's own allocator tests and recorded traces: tests/test_allocator.py.
"""

from __future__ import annotations

import math
import pickle
import threading
from bisect import bisect_left, insort
from dataclasses import dataclass, field

import torch

# c10/core/AllocatorConfig.h and CUDACachingAllocator.cpp
kMinBlockSize = 512  # all sizes are rounded to at least 512 bytes
kSmallSize = 1048576  # largest "small" allocation is 1 MiB
kSmallBuffer = 2097152  # "small" allocations are packed in 2 MiB blocks
kLargeBuffer = 20971520  # "large" allocations may be packed in 20 MiB blocks
kMinLargeAlloc = 10485760  # allocations between 1 and 10 MiB may use kLargeBuffer
kRoundLarge = 2097152  # round up large allocations to 2 MiB
kMB = 1024 * 1024
kRoundUpPowerOfTwoIntervals = 16
SIZE_MAX = 2**64 - 1

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


# -- settings ------------------------------------------------------------------------------------------------


@dataclass
class AllocatorConfig:
    """The native allocator's settings, as ``PYTORCH_CUDA_ALLOC_CONF`` sets them.

    Build one from the string a user would export: ``AllocatorConfig.parse("max_split_size_mb:128")``.
    """

    max_split_size: int = SIZE_MAX
    max_non_split_rounding_size: int = kLargeBuffer
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    per_process_memory_fraction: float | None = None
    roundup_power2_divisions: list[int] = field(default_factory=lambda: [0] * kRoundUpPowerOfTwoIntervals)
    text: str = ""

    @classmethod
    def parse(cls, text: str, previous: "AllocatorConfig | None" = None) -> "AllocatorConfig":
        """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` string as AcceleratorAllocatorConfig::parseArgs does.

        Like ``torch.cuda.memory._set_allocator_settings``, a new string resets
        max_split_size, roundup_power2_divisions and garbage_collection_threshold to their
        defaults and keeps the other settings of ``previous`` unless it names them.

        Raises:
            ValueError: for an option or a value PyTorch would refuse, saying what is allowed.
        """
        cfg = cls(text=text)
        if previous is not None:
            cfg.max_non_split_rounding_size = previous.max_non_split_rounding_size
            cfg.expandable_segments = previous.expandable_segments
            cfg.per_process_memory_fraction = previous.per_process_memory_fraction
        if not isinstance(text, str):
            raise ValueError(f"allocator settings are a string such as 'max_split_size_mb:128', not {text!r}")
        tokens: list[str] = []
        buf = ""
        for ch in text:
            if ch in ",:[]":
                if buf:
                    tokens.append(buf)
                    buf = ""
                tokens.append(ch)
            elif ch != " ":
                buf += ch
        if buf:
            tokens.append(buf)

        def expect(i: int, c: str) -> None:
            if i >= len(tokens) or tokens[i] != c:
                raise ValueError(f"error parsing allocator settings {text!r}: expected {c!r}")

        def value(i: int, name: str) -> str:
            if i >= len(tokens):
                raise ValueError(f"error parsing allocator settings {text!r}: expecting a {name} value")
            return tokens[i]

        def integer(s: str, name: str) -> int:
            try:
                return int(s)
            except ValueError:
                raise ValueError(f"{name} takes a whole number, not {s!r}") from None

        i = 0
        while i < len(tokens):
            key = tokens[i]
            if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
                expect(i + 1, ":")
                i += 2
                mb = integer(value(i, key), key)
                if mb < kLargeBuffer // kMB:
                    raise ValueError(f"CachingAllocator option {key} too small, must be >= {kLargeBuffer // kMB}")
                mb = min(mb, SIZE_MAX // kMB)
                if key == "max_split_size_mb":
                    cfg.max_split_size = mb * kMB
                else:
                    cfg.max_non_split_rounding_size = mb * kMB
            elif key == "garbage_collection_threshold":
                expect(i + 1, ":")
                i += 2
                try:
                    v = float(value(i, key))
                except ValueError:
                    raise ValueError(f"garbage_collection_threshold takes a number in (0.0, 1.0), "
                                     f"not {tokens[i]!r}") from None
                if not 0 < v < 1.0:
                    raise ValueError("garbage_collect_threshold is invalid, set it in (0.0, 1.0)")
                cfg.garbage_collection_threshold = v
            elif key == "expandable_segments":
                expect(i + 1, ":")
                i += 2
                v = value(i, key)
                if v not in ("True", "False"):
                    raise ValueError("Expected a single True/False argument for expandable_segments")
                cfg.expandable_segments = v == "True"
            elif key == "roundup_power2_divisions":
                expect(i + 1, ":")
                i += 2
                i = cfg._parse_roundup(tokens, i, text)
            elif key == "large_segment_size_mb":
                raise ValueError("large_segment_size_mb (PyTorch 2.13) is not simulated: the simulation follows "
                                 "PyTorch 2.11, whose large segments are 20 MiB")
            elif key == "per_process_memory_fraction":
                expect(i + 1, ":")
                i += 2
                try:
                    v = float(value(i, key))
                except ValueError:
                    v = -1.0
                if not 0.0 <= v <= 1.0:
                    raise ValueError("per_process_memory_fraction is invalid, set it in [0.0, 1.0]")
                cfg.per_process_memory_fraction = v
            elif key in ("backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                         "pinned_num_register_threads", "pinned_use_background_threads"):
                # accepted and checked as PyTorch checks them; they change nothing simulated here
                expect(i + 1, ":")
                i += 2
                v = value(i, key)
                if key == "backend" and v != "native":
                    raise ValueError("only the native allocator (backend:native) is simulated, "
                                     "not cudaMallocAsync")
                if key in ("release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
                           "pinned_use_background_threads") and v not in ("True", "False"):
                    raise ValueError(f"Expected a single True/False argument for {key}")
                if key == "pinned_num_register_threads":
                    n = integer(v, key) if v.isdigit() else -1
                    if n <= 0 or n & (n - 1):
                        raise ValueError("Number of register threads has to be power of 2 ")
                    if n > 128:
                        raise ValueError("Number of register threads should be less than or equal to 128")
            else:
                raise ValueError(f"Unrecognized CachingAllocator option: {key} (simulated options: "
                                 "max_split_size_mb, max_non_split_rounding_mb, garbage_collection_threshold, "
                                 "roundup_power2_divisions, expandable_segments)")
            if i + 1 < len(tokens):
                expect(i + 1, ",")
                i += 1
            i += 1
        return cfg

    def _parse_roundup(self, tokens: list[str], i: int, text: str) -> int:
        divs = self.roundup_power2_divisions

        def power_of_two(v: int) -> bool:
            return v > 0 and v & (v - 1) == 0

        if i >= len(tokens):
            raise ValueError("Error, expecting roundup_power2_divisions value")
        if tokens[i] == "[":
            last_index = 0
            first = True
            i += 1
            while i < len(tokens) and tokens[i] != "]":
                key = tokens[i]
                if i + 2 >= len(tokens) or tokens[i + 1] != ":":
                    raise ValueError(f"error parsing roundup_power2_divisions in {text!r}")
                try:
                    val = int(tokens[i + 2])
                except ValueError:
                    raise ValueError(f"roundup_power2_divisions takes whole numbers, not {tokens[i + 2]!r}") from None
                if not (val == 0 or power_of_two(val)):
                    raise ValueError("For roundups, the divisons has to be power of 2 or 0 to disable roundup ")
                if key == ">":
                    for j in range(last_index + 1, len(divs)):
                        divs[j] = val
                else:
                    try:
                        mb = int(key)
                    except ValueError:
                        raise ValueError(f"roundup_power2_divisions intervals are MB powers of 2, not {key!r}") from None
                    if not power_of_two(mb):
                        raise ValueError("For roundups, the intervals have to be power of 2 ")
                    index = min(max(mb.bit_length() - 1, 0), len(divs) - 1)
                    if first:
                        for j in range(index):
                            divs[j] = val
                        first = False
                    divs[index] = val
                    last_index = index
                i += 3
                if i < len(tokens) and tokens[i] == ",":
                    i += 1
            if i >= len(tokens):
                raise ValueError(f"error parsing roundup_power2_divisions in {text!r}: missing ']'")
            return i
        try:
            val = int(tokens[i])
        except ValueError:
            raise ValueError(f"roundup_power2_divisions takes a power of 2, not {tokens[i]!r}") from None
        if not power_of_two(val):
            raise ValueError("For roundups, the divisons has to be power of 2 ")
        divs[:] = [val] * len(divs)
        return i

    def divisions_for(self, size: int) -> int:
        """AllocatorConfig::roundup_power2_divisions(size): intervals from 1 MiB to 64 GiB."""
        index = (size.bit_length() - 1) - 20
        return self.roundup_power2_divisions[min(max(index, 0), kRoundUpPowerOfTwoIntervals - 1)]


def roundup_power2_next_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    power2_division = power2_floor >> (divisions.bit_length() - 1)
    if power2_division == 0:
        return power2_floor << 1
    round_size_floor = size & ~(power2_division - 1)
    return size if round_size_floor == size else round_size_floor + power2_division


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
        fraction: ``set_per_process_memory_fraction`` (None: no cap).
        context_bytes: device memory the process holds outside the allocator (the CUDA
            context, cuBLAS workspaces are allocator memory and not included); it counts
            against the capacity and in what nvidia-smi shows.
        device: the GPU index the OOM message names.
        record_history: keep a trace of events like ``_record_memory_history`` does.
        address_source: ``f(size) -> address or None`` for the address of each new
            segment (a replay passes the recorded ones); None: fresh made-up addresses.

    Raises:
        ValueError: for sizes, fractions or settings that are not allowed.
    """

    def __init__(self, total_memory: int | str = 80 * 1024**3, config: str | AllocatorConfig | None = None, *,
                 fraction: float | None = None, context_bytes: int | str = 0, device: int = 0,
                 record_history: bool = False, address_source=None) -> None:
        from .report import parse_bytes

        self.total_memory = parse_bytes(total_memory)
        if self.total_memory <= 0:
            raise ValueError("total_memory must be a positive size, such as '16 GiB'")
        self.context_bytes = 0 if context_bytes == 0 else parse_bytes(context_bytes)
        if self.context_bytes >= self.total_memory:
            raise ValueError(f"context_bytes ({self.context_bytes}) leaves no memory on a "
                             f"{self.total_memory}-byte device")
        self.device = int(device)
        self.config = config if isinstance(config, AllocatorConfig) else AllocatorConfig.parse(config or "")
        self._roundup = any(self.config.roundup_power2_divisions)
        if self.config.per_process_memory_fraction is not None and fraction is None:
            fraction = self.config.per_process_memory_fraction
        self.small = BlockPool(True)
        self.large = BlockPool(False)
        self.active: dict[int, Block] = {}  # addr -> allocated block (or freed but waiting for streams)
        self.pending: list[Block] = []  # freed while other streams used them: wait for synchronize()
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
        """``torch.cuda.set_per_process_memory_fraction``: cap reserved memory at ``fraction`` of the device."""
        if not isinstance(fraction, float):  # as torch.cuda.set_per_process_memory_fraction checks
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.allowed_memory_maximum = int(fraction * float(self.total_memory))

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
    def get_allocation_size(size: int) -> int:
        if size <= kSmallSize:
            return kSmallBuffer
        if size < kMinLargeAlloc:
            return kLargeBuffer
        return kRoundLarge * ((size + kRoundLarge - 1) // kRoundLarge)

    def malloc(self, size: int, stream: int = 0) -> int:
        """Allocate ``size`` bytes on ``stream``; returns the block's address.

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
            alloc_size = self.get_allocation_size(size)
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
        """``Tensor.record_stream``: the block is also used on ``stream``."""
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
            ValueError: for an address that is not allocated.
        """
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
        if b.stream_uses:
            b.event_count = len(b.stream_uses)
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
        """Nothing to do until ``synchronize()``: the simulation does not time GPU work."""

    def synchronize(self) -> None:
        """``torch.cuda.synchronize()``: blocks freed while other streams used them become free."""
        self.generation += 1
        pending, self.pending = self.pending, []
        for b in pending:
            b.event_count = 0
            self._free_block(b)

    def _synchronize_and_free_events(self) -> None:
        self.counters["num_sync_all_streams"] += 1
        self.synchronize()

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
        return (self._next_addr, self.total_allocated_memory, tuple(blocks), tuple(self.small.keys),
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
        from .report import format_bytes

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


def plot_segments(segments: list[dict], ax=None, title: str | None = None, max_segments: int = 40):
    """Draw a segment map, one bar per segment with its blocks in place, like ``torch.cuda._memory_viz``'s
    segment view: allocated blocks coloured, cached free blocks grey.

    Args:
        segments: ``torch.cuda.memory._snapshot()["segments"]`` of a real GPU, or ``CachingAllocator.segments()``.
        max_segments: draw at most this many (the largest), in address order.

    Returns:
        The matplotlib Axes.
    """
    import matplotlib.pyplot as plt

    from .report import format_bytes

    segs = list(segments)
    if len(segs) > max_segments:
        segs = sorted(segs, key=lambda s: -s["total_size"])[:max_segments]
    segs.sort(key=lambda s: s["address"])
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.9 + 0.32 * max(len(segs), 1)))
    widest = max((s["total_size"] for s in segs), default=1) / kMB
    palette = plt.get_cmap("tab20").colors
    allocated = reserved = 0
    for row, s in enumerate(segs):
        y = len(segs) - 1 - row
        reserved += s["total_size"]
        for b in s["blocks"]:
            x = (b["address"] - s["address"]) / kMB
            if b["state"] == "active_allocated":
                allocated += b["size"]
                color = palette[(b["address"] // 512) % len(palette)]
            else:
                color = "#dddddd"
            ax.barh(y, b["size"] / kMB, left=x, height=0.8, color=color, edgecolor="white", linewidth=0.4)
        kind = ("expandable " if s.get("is_expandable") else "") + s.get("segment_type", "")
        stream = f", stream {s['stream']}" if s.get("stream") else ""
        ax.text(widest * 1.01, y, f"{format_bytes(s['total_size'])} {kind}{stream}", va="center", fontsize=8)
    ax.set_yticks([])
    ax.set_xlim(0, widest * 1.3)
    ax.set_xlabel("offset in segment (MiB); coloured: allocated blocks, grey: cached free blocks "
                  "(reserved but unallocated)", fontsize=8)
    ax.set_title(title or f"segments: {format_bytes(reserved)} reserved, {format_bytes(allocated)} allocated")
    return ax


def load_snapshot(path_or_bytes) -> dict:
    """Read a ``torch.cuda.memory._snapshot()`` pickle (``_dump_snapshot``) without running code from it.

    Snapshots hold only plain data (dicts, lists, strings, numbers); any other object in
    the pickle is refused, so a file from elsewhere cannot execute anything.

    Raises:
        ValueError: for a file that is not a memory snapshot.
    """
    import io

    class _PlainData(pickle.Unpickler):
        def find_class(self, module, name):
            raise pickle.UnpicklingError(f"a memory snapshot holds plain data; refused {module}.{name}")

    data = path_or_bytes if isinstance(path_or_bytes, bytes) else open(path_or_bytes, "rb").read()
    if data[:2] == b"\x1f\x8b":  # the compact gzip-JSON form kept in data/traces/
        return _expand_compact(data)
    try:
        snap = _PlainData(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError) as err:
        raise ValueError(f"not a torch.cuda.memory snapshot pickle: {err}") from err
    if not isinstance(snap, dict) or "segments" not in snap:
        raise ValueError("not a torch.cuda.memory snapshot: no 'segments' (make one with "
                         "torch.cuda.memory._dump_snapshot after _record_memory_history)")
    return snap


def _expand_compact(data: bytes) -> dict:
    """A snapshot from data/traces/: the events and segments of a real one, numbers only."""
    import gzip
    import json

    d = json.loads(gzip.decompress(data))
    traces = [[{"action": a, ("device_free" if a == "oom" else "addr"): addr, "size": size, "stream": stream}
               for a, addr, size, stream in t] for t in d["device_traces"]]
    segments = [{"device": dev, "address": addr, "total_size": total, "segment_type": kind, "stream": stream,
                 "is_expandable": exp, "blocks": [{"address": a, "size": n, "requested_size": r, "state": st}
                                                  for a, n, r, st in blocks]}
                for dev, addr, total, kind, stream, exp, blocks in d["segments"]]
    return {"segments": segments, "device_traces": traces, "allocator_settings": d.get("allocator_settings", {})}


def save_compact(snap: dict, path) -> None:
    """Keep only a snapshot's allocator events and segments (numbers, no stack frames) as gzip JSON."""
    import gzip
    import json

    keep = ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size", "garbage_collection_threshold", "expandable_segments",
            "roundup_power2_divisions")
    settings = snap.get("allocator_settings") or {}
    out = {"allocator_settings": {k: settings[k] for k in keep if k in settings},
           "device_traces": [[[e["action"], e.get("addr", e.get("device_free", 0)), e.get("size", 0),
                               e.get("stream", 0)] for e in t] for t in snap.get("device_traces", [])],
           "segments": [[s.get("device", 0), s["address"], s["total_size"], s["segment_type"], s.get("stream", 0),
                         bool(s.get("is_expandable", False)),
                         [[b["address"], b["size"], b.get("requested_size", 0), b["state"]] for b in s["blocks"]]]
                        for s in snap["segments"]]}
    with gzip.open(path, "wt") as f:
        json.dump(out, f, separators=(",", ":"))


def config_of_snapshot(snap: dict) -> AllocatorConfig:
    """The allocator settings a snapshot was recorded with (its ``allocator_settings``)."""
    s = snap.get("allocator_settings") or {}
    cfg = AllocatorConfig(text=s.get("PYTORCH_CUDA_ALLOC_CONF", "") or "")
    mss = s.get("max_split_size", -1)
    if mss not in (-1, None) and mss < SIZE_MAX:
        cfg.max_split_size = int(mss)
    cfg.garbage_collection_threshold = float(s.get("garbage_collection_threshold", 0.0) or 0.0)
    cfg.expandable_segments = bool(s.get("expandable_segments", False))
    divs = s.get("roundup_power2_divisions")
    if isinstance(divs, dict):
        for k, v in divs.items():
            cfg.roundup_power2_divisions[min(int(k).bit_length() - 1, kRoundUpPowerOfTwoIntervals - 1)] = int(v)
    return cfg


@dataclass
class ReplayReport:
    """How a simulated replay of a recorded trace compares with what the real allocator did."""

    events: int = 0
    allocs: int = 0
    allocs_same_address: int = 0
    segment_events_recorded: int = 0
    segment_events_matched: int = 0
    empty_cache_calls: int = 0  # inferred: runs of segment frees that no allocation caused
    pre_existing_segments: int = 0
    final_segments_matched: int = 0
    final_segments: int = 0
    mismatches: list = field(default_factory=list)
    allocator: "CachingAllocator | None" = None

    def __str__(self) -> str:
        return (f"{self.events} events: {self.allocs_same_address}/{self.allocs} allocations at the recorded address, "
                f"{self.segment_events_matched}/{self.segment_events_recorded} segment events as recorded "
                f"({self.empty_cache_calls} empty_cache calls inferred), final segments "
                f"{self.final_segments_matched}/{self.final_segments} identical")


def replay(snap: dict, device: int = 0, total_memory: int | str = 80 * 1024**3) -> ReplayReport:
    """Replay a recorded trace (``_record_memory_history`` + ``_snapshot``) through the simulation.

    The allocations and frees of the trace drive the simulated allocator; segments the
    trace shows being created take the recorded addresses, so that every allocation's
    address and every segment event can be compared with what the real allocator did.
    Segments that existed before recording began are rebuilt from the final snapshot (or
    from the trace's frees of them). Runs of segment frees that no allocation caused are
    ``torch.cuda.empty_cache()`` calls (the trace does not record them); the replay makes them.

    Raises:
        ValueError: for a snapshot without a trace for ``device``.
    """
    from collections import deque

    traces = snap.get("device_traces") or []
    if device >= len(traces) or not traces[device]:
        raise ValueError(f"the snapshot has no recorded trace for device {device}; record one with "
                         "torch.cuda.memory._record_memory_history() before the run")
    trace = traces[device]
    rep = ReplayReport(events=len(trace))
    pending_segments: deque = deque()

    def address_source(size):
        while pending_segments:
            e = pending_segments.popleft()
            if e["size"] == size:
                return e["addr"]
        return None

    sim = CachingAllocator(total_memory, config_of_snapshot(snap), device=device, record_history=True,
                           address_source=address_source)
    rep.allocator = sim
    # Segments that existed before the trace began, with the blocks allocated then.
    made = {e["addr"] for e in trace if e["action"] in ("segment_alloc", "segment_map")}
    live_at_end: dict[int, int] = {}
    for e in trace:
        if e["action"] == "alloc":
            live_at_end[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            live_at_end.pop(e["addr"], None)
    freed_first = {}  # segments the trace frees before (or without) making them: they existed before
    seen = set()
    for e in trace:
        if e["action"] in ("segment_alloc", "segment_map"):
            seen.add(e["addr"])
        elif e["action"] == "segment_free" and e["addr"] not in seen:
            freed_first.setdefault(e["addr"], e)
    # blocks the trace frees without having allocated them were allocated before it began
    born: set[int] = set()
    freed_unborn: dict[int, int] = {}
    for e in trace:
        if e["action"] == "alloc":
            born.add(e["addr"])
        elif e["action"] == "free_completed" and e["addr"] not in born:
            freed_unborn.setdefault(e["addr"], e["size"])
    unborn = sorted(freed_unborn)
    for seg in snap.get("segments", []):
        if seg.get("device", device) != device or seg["address"] in made or seg.get("is_expandable"):
            continue
        allocated = [(b["address"], b["size"], b.get("requested_size", b["size"]))
                     for b in seg["blocks"] if b["state"] != "inactive" and b["address"] not in live_at_end]
        lo = bisect_left(unborn, seg["address"])
        hi = bisect_left(unborn, seg["address"] + seg["total_size"])
        taken = {a for a, _, _ in allocated}
        extra = [a for a in unborn[lo:hi] if a not in taken]
        starts = sorted(taken | set(extra)) + [seg["address"] + seg["total_size"]]
        small = seg["segment_type"] == "small"
        for a in extra:
            # its block is what the allocator made of the request: the rounded size, or the
            # whole gap to the next block when the rest was too small to split off
            req = freed_unborn[a]
            size = sim.round_size(req)
            gap = starts[bisect_left(starts, a) + 1] - a
            if size < gap and (gap - size < kMinBlockSize if small else gap - size <= kSmallSize):
                size = gap
            allocated.append((a, min(size, gap), req))
        sim.add_segment(seg["address"], seg["total_size"], small=seg["segment_type"] == "small",
                        stream=seg.get("stream", 0) or 0, allocated=allocated)
        rep.pre_existing_segments += 1
    for addr, e in freed_first.items():
        sim.add_segment(addr, e["size"], small=e["size"] == kSmallBuffer, stream=e.get("stream", 0) or 0)
        rep.pre_existing_segments += 1

    streams: dict = {}

    def stream_id(s):
        return streams.setdefault(s, len(streams)) if s not in (0, None) else 0

    sim_trace = sim.trace
    alias: dict[int, int] = {}
    recorded_frees: list = []
    i = 0
    n = len(trace)
    while i < n:
        e = trace[i]
        a = e["action"]
        if a in ("segment_alloc", "segment_map"):
            pending_segments.append(e)
            rep.segment_events_recorded += 1
            i += 1
            # matched when the allocation that follows creates it (checked below)
            continue
        if a == "segment_free" or a == "segment_unmap":
            recorded_frees.append(e)
            rep.segment_events_recorded += 1
            i += 1
            continue
        if recorded_frees:  # a run of frees no allocation explained: empty_cache()
            mark = len(sim_trace)
            sim.empty_cache()
            rep.empty_cache_calls += 1
            got = {(x[0], x[1], x[2]) for x in sim_trace[mark:] if x[0] in ("segment_free", "segment_unmap")}
            want = {(x["action"], x["addr"], x["size"]) for x in recorded_frees}
            rep.segment_events_matched += len(got & want)
            if got != want:
                rep.mismatches.append(("empty_cache", i, sorted(want - got)[:3], sorted(got - want)[:3]))
            recorded_frees = []
        if a == "alloc":
            mark = len(sim_trace)
            want_segs = [(x["action"], x["addr"], x["size"]) for x in pending_segments]
            try:
                addr = sim.malloc(e["size"], stream_id(e.get("stream")))
            except torch.OutOfMemoryError as err:
                rep.mismatches.append(("oom", i, str(err)[:80]))
                i += 1
                continue
            rep.allocs += 1
            if addr == e["addr"]:
                rep.allocs_same_address += 1
            elif len(rep.mismatches) < 50:
                rep.mismatches.append(("alloc", i, e["addr"], addr, e["size"]))
            got_segs = [(x[0], x[1], x[2]) for x in sim_trace[mark:]
                        if x[0] in ("segment_alloc", "segment_map", "segment_free", "segment_unmap")]
            rep.segment_events_matched += sum(1 for x in got_segs if x in want_segs)
            pending_segments.clear()
            alias[e["addr"]] = addr  # the program frees what it got; here, the simulated block
        elif a == "free_completed":
            try:
                sim.free(alias.pop(e["addr"], e["addr"]))
            except ValueError:
                rep.mismatches.append(("free of a block the replay does not hold", i, e["addr"]))
        i += 1
    if recorded_frees:
        mark = len(sim_trace)
        sim.empty_cache()
        rep.empty_cache_calls += 1
        got = {(x[0], x[1], x[2]) for x in sim_trace[mark:] if x[0] in ("segment_free", "segment_unmap")}
        want = {(x["action"], x["addr"], x["size"]) for x in recorded_frees}
        rep.segment_events_matched += len(got & want)
    # the final state against the final snapshot
    final = {(s["address"], s["total_size"], tuple((b["address"], b["size"], b["state"] == "active_allocated")
                                                   for b in s["blocks"]))
             for s in snap.get("segments", []) if s.get("device", device) == device}
    mine = {(s["address"], s["total_size"], tuple((b["address"], b["size"], b["state"] == "active_allocated")
                                                  for b in s["blocks"]))
            for s in sim.segments()}
    rep.final_segments = len(final)
    rep.final_segments_matched = len(final & mine)
    return rep


# -- driven by gpukit's counter ----------------------------------------------------------------------------------


class SimulatedDevice:
    """A simulated GPU fed by a gpukit counter: every storage it sees allocated is ``malloc``-ed here,
    every storage it sees die is freed, so reserved memory follows the program as on CUDA.

    Attach it to a ``gpukit.counter.Ledger`` (``attach``); storages the ledger already knows are
    placed first, in the order it learnt of them. ``measure()`` on a CPU uses one per process
    (``cpu_device()``); ``predict()`` one per prediction.

    The counter's events are queued and run through the allocator in order, as one *unit*, whenever the
    device is read (``allocator``, ``reserved()``, ``watch``/``unwatch``: each ``measure()`` block reads it
    at its start and end). A unit that comes again, from the state it left the allocator in before (the
    steady state of a training loop: each step makes and frees the same sizes, in the same order, and ends
    where it began), is not run again: the allocator is deterministic, so the outcome recorded the first
    time (every address, every statistic, the peak of reserved memory) is applied instead. A unit is
    recorded only after its signature was seen before, and only where the state before and after it compare
    equal (``CachingAllocator.state_key``); any other call on the allocator (``generation``) or a change of
    its settings voids the record. ``lazy=False`` runs each event when it happens, and so does a device
    under a cap (``budget(..., reserved=True)``), whose out-of-memory error must come from the allocation
    that causes it.
    """

    _MAX_QUEUE = 1 << 16  # events queued before the device runs them unasked
    _MAX_UNITS = 8  # signatures kept, of units seen and of units recorded (a long step's is long)
    _MAX_WAIT = 64  # a unit that repeats without leaving the state unchanged is checked again after 1, 2, 4...

    def __init__(self, total_memory: int | str = 80 * 1024**3, config: str | AllocatorConfig | None = None, *,
                 context_bytes: int | str = 0, record_events: bool = False, lazy: bool = True) -> None:
        self._alloc = CachingAllocator(total_memory, config, context_bytes=context_bytes)
        self.addr: dict[int, int] = {}  # the ledger's storage key -> simulated address
        self.peaks: list[list[int]] = []  # [peak reserved] of each block watching
        self.events: list | None = [] if record_events else None  # ("a", key, nbytes) / ("f", key)
        self.ledger = None
        self.failed = False  # interrupted mid-update (Ctrl-C): detached, its state no longer trusted
        self.lazy = lazy and not record_events
        self._queue: list[tuple[int, int]] = []  # (key, nbytes) of an allocation, (key, 0) of a free
        self._lock = threading.RLock()  # the ledger's lock while attached: the one its events come under
        self._state = None  # the allocator's state_key(), when known: valid at generation _state_gen
        self._state_gen = -1  # ... and while the settings and sizes _settings() gives are those it was taken with
        self._state_settings: tuple = ()
        self._memo_state = None  # the state that every recorded unit starts and ends in
        self._memo: dict[tuple, tuple] = {}  # a unit's signature -> its outcome
        self._seen: dict[tuple, list[int]] = {}  # signature of a unit run -> [runs to wait, next wait]
        self.units_run = 0  # units the allocator ran
        self.units_reused = 0  # units whose recorded outcome was applied

    @property
    def allocator(self) -> CachingAllocator:
        """The simulated allocator, up to date: every storage that died is freed, every event applied."""
        self._catch_up()
        return self._alloc

    def reserved(self) -> int:
        """Reserved memory now (``torch.cuda.memory_reserved()``)."""
        self._catch_up()
        return self._alloc.memory_reserved()

    def _catch_up(self) -> None:
        if self.ledger is not None:
            self.ledger.settle()  # frees of storages that died since the counter last did its books
        self.flush()

    def attach(self, ledger) -> "SimulatedDevice":
        if ledger.listener is not None and ledger.listener is not self:
            raise RuntimeError("this counter already drives another simulated device; detach it first")
        self.flush()
        ledger.settle()  # storages that died since the counter last did its books are not adopted
        ledger.listener = self
        self.ledger = ledger
        self._lock = ledger._lock
        for key, nbytes in list(ledger.sizes.items()):
            if key not in self.addr:
                self.on_alloc(key, nbytes, False)
        return self

    def detach(self) -> None:
        if self.ledger is not None and self.ledger.listener is self:
            self.flush()
            self.ledger.listener = None
        self.ledger = None

    def _fail(self) -> None:
        self.failed = True
        self._queue = []
        self.detach()

    # -- the counter's events ------------------------------------------------------------------------------

    def on_alloc(self, key: int, nbytes: int, counted: bool = True) -> None:
        """A storage of ``nbytes`` was made (``counted``) or found (an existing one, adopted).

        Raises:
            SimulatedOutOfMemoryError: when the simulated device cannot hold a new storage under a cap.
        """
        if nbytes <= 0:  # CUDA hands out no block for an empty storage
            return
        if self.lazy and counted and self._alloc.allowed_memory_maximum is None:
            self._enqueue(key, nbytes)
            return
        self.flush()
        self._alloc_now(key, nbytes, counted)

    def books_at_once(self) -> bool:
        """Whether the counter must hand over each allocation as it happens: under a cap, the out-of-memory
        error comes from the allocation that passes it."""
        return self._alloc.allowed_memory_maximum is not None

    def _enqueue(self, key: int, nbytes: int) -> None:
        queue = self._queue
        queue.append((key, nbytes))
        if len(queue) >= self._MAX_QUEUE:
            self.flush()

    def _alloc_now(self, key: int, nbytes: int, counted: bool) -> None:
        if self.failed:
            return
        alloc = self._alloc
        try:
            a = alloc.malloc(nbytes)
        except torch.OutOfMemoryError:
            if counted and alloc.allowed_memory_maximum is not None:
                raise  # a cap the user set (budget(..., reserved=True)): the lesson's OOM
            self._too_small()
            return
        except BaseException:  # interrupted half-way (KeyboardInterrupt): stop following rather than drift
            self._fail()
            raise
        old = self.addr.get(key)
        self.addr[key] = a
        if old is not None:  # the key of a storage that died unseen
            alloc.free(old)
        if self.events is not None:
            self.events.append(("a", key, nbytes))
        self._raise_peaks(alloc.stats[5][0][0])  # reserved_bytes.all.current

    def on_resize(self, key: int, nbytes: int) -> None:
        """A storage changed size: like the allocator, the new block exists before the old is freed."""
        self.flush()
        old = self.addr.pop(key, None)
        try:
            if nbytes > 0:
                self._alloc_now(key, nbytes, True)
        except BaseException:
            if old is not None:
                self.addr[key] = old
            raise
        if old is not None:
            self._alloc.free(old)
            if self.events is not None:
                self.events.append(("f", key))

    def on_free(self, key: int) -> None:
        if self.lazy:
            self._enqueue(key, 0)
            return
        a = self.addr.pop(key, None)
        if a is not None:
            try:
                self._alloc.free(a)
            except BaseException:  # called from a weakref callback: never let a broken state repeat
                self._fail()
                raise
            if self.events is not None:
                self.events.append(("f", key))

    def _too_small(self) -> None:
        # The simulated GPU is smaller than what the program really holds: never fail a real run for that;
        # stop simulating, and say so.
        import warnings

        warnings.warn(f"the simulated GPU ({format_size(self._alloc.total_memory)}) cannot hold this process's "
                      "tensors: reserved memory is no longer simulated (a bigger one: "
                      "gpukit.allocator.reset_cpu_device(total_memory=...))", RuntimeWarning, stacklevel=3)
        self._fail()

    # -- running the queue ---------------------------------------------------------------------------------

    def flush(self) -> None:
        """Run the queued events through the allocator (or apply the recorded outcome of the same unit)."""
        if not self._queue:
            return
        with self._lock:
            queue = self._queue
            if not queue or self.failed:
                return
            self._queue = []
            try:
                self._run(queue)
            except BaseException:  # interrupted half-way (KeyboardInterrupt): stop following rather than drift
                self._fail()
                raise

    def _settings(self) -> tuple:
        """What a caller can change by assignment, without a call that bumps ``generation``."""
        a = self._alloc
        return a.config, a.total_memory, a.context_bytes  # configs compare by their fields

    def _state_known(self) -> bool:
        """Whether ``_state`` is the allocator's state now: nothing called on it, nothing assigned, since."""
        return (self._state is not None and self._alloc.generation == self._state_gen
                and self._settings() == self._state_settings)

    def _plain(self) -> bool:
        """Whether the allocator is in a state a recorded unit can stand for: no cap (and so no garbage
        collection), no trace to write, no blocks waiting for other streams, addresses of its own."""
        a = self._alloc
        return (a.allowed_memory_maximum is None and a.trace is None and not a.pending
                and a.address_source is None)

    def _run(self, queue: list[tuple[int, int]]) -> None:
        alloc, addr = self._alloc, self.addr
        # The unit's signature: each allocation's size and the block it replaces (a storage that died unseen),
        # each free's block; a block the unit made is named by its number in the unit (-1 - i), an older one
        # by its address. Keys (storage ids) differ from step to step; this does not.
        sig: list = []
        mine: dict[int, int] = {}  # key -> number of the unit's allocation that still holds it
        gone: set[int] = set()  # keys of older storages the unit freed
        n = 0
        for key, nbytes in queue:
            if nbytes:
                i = mine.get(key)
                if i is not None:
                    old = -1 - i
                else:
                    old = None if key in gone else addr.get(key)
                    if old is not None:
                        gone.add(key)
                sig.append((nbytes, old))
                mine[key] = n
                n += 1
            else:
                i = mine.pop(key, None)
                if i is not None:
                    sig.append(-1 - i)
                elif key not in gone:
                    a = addr.get(key)
                    if a is not None:
                        gone.add(key)
                        sig.append(a)
        if not sig:
            return
        sig = tuple(sig)
        outcome = None
        if self._state is self._memo_state and self._state_known() and self._plain():
            outcome = self._memo.get(sig)
        if outcome is not None:
            self._apply(outcome)
            self.units_reused += 1
        else:
            seen = self._seen.get(sig)
            candidate = seen is not None and seen[0] == 0 and self._plain()
            if seen is not None and seen[0] > 0:
                seen[0] -= 1
            if candidate:
                before = self._state if self._state_known() else alloc.state_key()
            outcome = self._replay(sig)
            if outcome is None:  # the simulated GPU is too small: no longer simulating
                return
            self.units_run += 1
            if candidate:
                after = alloc.state_key()
                if after == self._memo_state:
                    after = self._memo_state
                self._state, self._state_gen, self._state_settings = after, alloc.generation, self._settings()
                if after == before:  # the unit left the allocator as it found it: record it
                    if after is not self._memo_state or len(self._memo) >= self._MAX_UNITS:
                        self._memo, self._memo_state = {}, after
                    self._memo[sig] = outcome
                    self._seen.clear()
                else:  # the same events, a state that moves (a leak): comparing states costs, so less often
                    seen[0], seen[1] = seen[1], min(2 * seen[1], self._MAX_WAIT)
            else:
                self._state = None
                if seen is None:
                    if len(self._seen) >= self._MAX_UNITS:
                        self._seen.clear()
                    self._seen[sig] = [0, 1]
        addrs = outcome[0]
        for key in gone:
            del addr[key]
        for key, i in mine.items():
            addr[key] = addrs[i]
        self._raise_peaks(outcome[3])

    def _cells(self) -> list[list[int]]:
        a = self._alloc
        return [s for stat in a.stats for s in stat] + [a.oversize_allocations, a.oversize_segments]

    def _replay(self, sig: tuple) -> tuple | None:
        """Run one unit through the allocator; its outcome: (addresses, per statistic (its peak in the unit,
        what it added to allocated and freed), counters' changes, reserved memory's peak in the unit)."""
        alloc = self._alloc
        malloc, free = alloc.malloc, alloc.free
        cells = self._cells()
        saved = [(s[1], s[2], s[3]) for s in cells]
        for s in cells:
            s[1] = s[0]  # each statistic's peak, from here on: the unit's own
        counters = dict(alloc.counters)
        addrs: list[int] = []
        too_small = False
        try:
            for e in sig:
                if e.__class__ is tuple:
                    addrs.append(malloc(e[0]))
                    old = e[1]
                    if old is not None:
                        free(addrs[-1 - old] if old < 0 else old)
                else:
                    free(addrs[-1 - e] if e < 0 else e)
        except torch.OutOfMemoryError:
            too_small = True
        finally:
            in_unit = [s[1] for s in cells]
            for s, (peak, _, _) in zip(cells, saved):
                if peak > s[1]:
                    s[1] = peak
        if too_small:
            self._too_small()
            return None
        stats = tuple((p, s[2] - a, s[3] - f) for s, p, (_, a, f) in zip(cells, in_unit, saved))
        changed = tuple((k, v - counters[k]) for k, v in alloc.counters.items() if v != counters[k])
        return tuple(addrs), stats, changed, in_unit[5 * len(POOL_NAMES)]  # reserved_bytes.all

    def _apply(self, outcome: tuple) -> None:
        """What replaying a recorded unit from the state it starts and ends in would do to the statistics."""
        _, stats, changed, _ = outcome
        for s, (peak, allocated, freed) in zip(self._cells(), stats):
            if peak > s[1]:
                s[1] = peak
            s[2] += allocated
            s[3] += freed
        counters = self._alloc.counters
        for k, v in changed:
            counters[k] += v

    # -- peaks of blocks -----------------------------------------------------------------------------------

    def _raise_peaks(self, reserved: int) -> None:
        for p in self.peaks:
            if reserved > p[0]:
                p[0] = reserved

    def watch(self) -> list[int]:
        """Start following the peak of reserved memory; returns the [peak] cell to read and ``unwatch``."""
        cell = [self.reserved()]
        self.peaks.append(cell)
        return cell

    def unwatch(self, cell: list[int]) -> int:
        self._catch_up()
        for i, c in enumerate(self.peaks):
            if c is cell:  # this block's cell: another block's may hold the same number
                del self.peaks[i]
                break
        return cell[0]


_CPU_DEVICE: SimulatedDevice | None = None
_CPU_SIMULATION = True


def set_cpu_simulation(enabled: bool) -> None:
    """Turn the simulated GPU behind ``measure()`` on CPU on or off (off: allocated bytes only)."""
    global _CPU_SIMULATION, _CPU_DEVICE
    _CPU_SIMULATION = bool(enabled)
    if not enabled and _CPU_DEVICE is not None:
        _CPU_DEVICE.detach()
        _CPU_DEVICE = None


def cpu_device() -> SimulatedDevice | None:
    """The simulated GPU that follows this process's CPU tensors (what ``measure()`` on CPU reports);
    None when ``set_cpu_simulation(False)`` turned it off."""
    global _CPU_DEVICE
    if not _CPU_SIMULATION:
        return None
    if _CPU_DEVICE is None or _CPU_DEVICE.failed:  # a device whose update was interrupted starts afresh
        from .counter import LEDGER

        _CPU_DEVICE = SimulatedDevice().attach(LEDGER)
    else:
        from .counter import LEDGER

        LEDGER.settle()  # frees of storages that died since the counter last counted: read an up-to-date device
    return _CPU_DEVICE


def reset_cpu_device(total_memory: int | str = 80 * 1024**3, config: str | AllocatorConfig | None = None, *,
                     context_bytes: int | str = 0, lazy: bool = True) -> SimulatedDevice:
    """Start the CPU's simulated GPU afresh, with a capacity and ``PYTORCH_CUDA_ALLOC_CONF`` settings
    (``lazy=False``: every event run when it happens, and no unit reused; see ``SimulatedDevice``).

    Raises:
        ValueError: for a size or setting that is not allowed.
    """
    global _CPU_DEVICE
    from .counter import LEDGER

    fresh = SimulatedDevice(total_memory, config, context_bytes=context_bytes, lazy=lazy)
    if _CPU_DEVICE is not None:
        _CPU_DEVICE.detach()
    _CPU_DEVICE = fresh.attach(LEDGER)
    return fresh


class follow:
    """``with follow(ledger) as device:``: a simulated GPU that follows every allocation and free the
    ledger sees during the block (its counting is on throughout), recording them in ``device.events``.
    ``predict()`` runs under ``follow(FAKE_LEDGER)`` to give reserved memory at the peak."""

    def __init__(self, ledger, total_memory: int | str = 2**60,
                 config: str | AllocatorConfig | None = None) -> None:
        # no capacity by default: what a run would reserve, whatever its size (will_it_fit replays it per GPU)
        self.ledger = ledger
        self.device = SimulatedDevice(total_memory, config, record_events=True)

    def __enter__(self) -> SimulatedDevice:
        self.device.attach(self.ledger)
        try:
            self._tally = self.ledger.start()
        except BaseException:
            self.device.detach()
            raise
        return self.device

    def __exit__(self, *exc) -> bool:
        try:
            self.ledger.stop(self._tally)
        finally:
            self.device.detach()
        return False


def replay_events(events, total_memory: int, *, context_bytes: int = 0,
                  config: str | AllocatorConfig | None = None) -> tuple[bool, int, CachingAllocator]:
    """Run recorded ``SimulatedDevice`` events on a device of ``total_memory`` bytes.

    Returns:
        (whether every allocation succeeded, the peak of reserved memory, the allocator).
    """
    sim = CachingAllocator(total_memory, config, context_bytes=context_bytes)
    addr: dict[int, int] = {}
    malloc, free = sim.malloc, sim.free
    try:
        for e in events:
            if e[0] == "a":
                a = malloc(e[2])
                old = addr.get(e[1])
                addr[e[1]] = a
                if old is not None:
                    free(old)
            else:
                a = addr.pop(e[1], None)
                if a is not None:
                    free(a)
    except torch.OutOfMemoryError:
        return False, sim.max_memory_reserved(), sim
    return True, sim.max_memory_reserved(), sim


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
