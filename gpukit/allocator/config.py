"""The allocator's settings: ``PYTORCH_CUDA_ALLOC_CONF`` parsed as PyTorch parses it, and the size constants
and round-up rules the policy uses (c10/cuda/CUDAAllocatorConfig.{h,cpp}, c10/core/AllocatorConfig.{h,cpp})."""

from __future__ import annotations

from dataclasses import dataclass, field

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

# Memory a process needs on a GPU beyond what PyTorch allocates: the CUDA context (kernels
# of torch and its libraries loaded on the device) and cuBLAS/cuDNN workspaces. It depends on
# the GPU, driver and CUDA version; 1 GiB is an allowance, not a measurement: see it on your
# machine as nvidia-smi's "used" minus torch.cuda.memory_reserved() after one step. plan() and
# predict() leave it free on every GPU; a simulated device holds it unless told otherwise.
CONTEXT_ALLOWANCE = 2**30


@dataclass
class AllocatorConfig:
    """The native allocator's settings, as ``PYTORCH_CUDA_ALLOC_CONF`` sets them.

    Build one from the string a user would export: ``AllocatorConfig.parse("max_split_size_mb:128")``.

    Every key that torch 2.13's parsers accept is accepted, with their checks
    (AcceleratorAllocatorConfig::parseArgs in c10/core/AllocatorConfig.cpp, then
    CUDAAllocatorConfig::parseArgs in c10/cuda/CUDAAllocatorConfig.cpp). Simulated: max_split_size_mb,
    max_non_split_rounding_mb, garbage_collection_threshold, roundup_power2_divisions,
    expandable_segments, per_process_memory_fraction, and large_segment_size_mb (PyTorch 2.13: the
    segment of a request between 1 and 10 MiB, ``get_allocation_size``; it must be more than 10 MiB and
    becomes the least max_split_size_mb and max_non_split_rounding_mb; it is kept by later strings;
    expandable segments still map 20 MiB pages here). Accepted with no effect on the simulation:
    ``backend:native`` and ``release_lock_on_cudamalloc`` (a threading detail); the ``pinned_*`` keys
    (they set the host allocator for pinned memory, not the device's); ``graph_capture_record_stream_reuse``
    (CUDA graph capture is not simulated); ``throw_on_cudamalloc_oom`` (its early refusal, counted in
    ``num_oom_rejections``, is not simulated: a simulated cudaMalloc fails only where the capacity or the
    fraction says so, which the simulation checks before allocating anyway).
    """

    max_split_size: int = SIZE_MAX
    max_non_split_rounding_size: int = kLargeBuffer
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    per_process_memory_fraction: float | None = None
    roundup_power2_divisions: list[int] = field(default_factory=lambda: [0] * kRoundUpPowerOfTwoIntervals)
    large_segment_size: int = kLargeBuffer
    throw_on_cudamalloc_oom: bool = False
    graph_capture_record_stream_reuse: bool = False
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
            cfg.large_segment_size = previous.large_segment_size
            cfg.throw_on_cudamalloc_oom = previous.throw_on_cudamalloc_oom
            cfg.graph_capture_record_stream_reuse = previous.graph_capture_record_stream_reuse
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
                least = cfg.large_segment_size // kMB  # 20 unless large_segment_size_mb says more
                if mb < least:
                    raise ValueError(f"CachingAllocator option {key} too small, must be >= {least}")
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
                expect(i + 1, ":")
                i += 2
                mb = integer(value(i, key), key)
                if mb <= kMinLargeAlloc // kMB:
                    raise ValueError(f"CachingAllocator option large_segment_size_mb must be > "
                                     f"{kMinLargeAlloc // kMB} MB")
                cfg.large_segment_size = min(mb, SIZE_MAX // kMB) * kMB
            elif key in ("throw_on_cudamalloc_oom", "graph_capture_record_stream_reuse"):
                expect(i + 1, ":")
                i += 2
                v = value(i, key)
                if v not in ("True", "False"):
                    raise ValueError(f"Expected 'True' or 'False' for {key}, not {v!r}")
                setattr(cfg, key, v == "True")
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
            elif key in ("backend", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
                         "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
                         "pinned_num_register_threads", "pinned_use_background_threads", "pinned_free_catch_all",
                         "pinned_reserve_segment_size_mb", "pinned_max_round_threshold_mb",
                         "pinned_max_cached_size_mb"):
                # accepted and checked as PyTorch checks them; they change nothing simulated here
                expect(i + 1, ":")
                i += 2
                v = value(i, key)
                if key == "backend" and v != "native":
                    raise ValueError("only the native allocator (backend:native) is simulated, "
                                     "not cudaMallocAsync")
                if key in ("release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "pinned_use_cuda_host_register",
                           "pinned_use_hip_host_register", "pinned_use_background_threads",
                           "pinned_free_catch_all") and v not in ("True", "False"):
                    raise ValueError(f"Expected a single True/False argument for {key}")
                if key in ("pinned_reserve_segment_size_mb", "pinned_max_round_threshold_mb",
                           "pinned_max_cached_size_mb"):
                    n = integer(v, key)  # ConfigTokenizer::toSizeT (std::stoull: "-1" wraps round)
                    if key == "pinned_reserve_segment_size_mb" and n == 0:
                        raise ValueError("Pinned reserve segment size has to be greater than 0")
                if key == "pinned_num_register_threads":
                    n = integer(v, key) if v.isdigit() else -1
                    if n <= 0 or n & (n - 1):
                        raise ValueError("Number of register threads has to be power of 2 ")
                    if n > 128:
                        raise ValueError("Number of register threads should be less than or equal to 128")
            else:
                raise ValueError(f"Unrecognized CachingAllocator option: {key} (simulated options: "
                                 "max_split_size_mb, max_non_split_rounding_mb, garbage_collection_threshold, "
                                 "roundup_power2_divisions, expandable_segments, large_segment_size_mb, "
                                 "per_process_memory_fraction)")
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
