"""The statistics: every figure of ``torch.cuda.memory_stats()`` (current, peak, allocated, freed; all, small pool,
large pool), kept as ``DeviceCachingAllocator`` keeps its ``DeviceStats``, and ``memory_summary()``'s table."""

from __future__ import annotations

from .config import SIZE_MAX

STAT_NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
              "active_bytes", "inactive_split_bytes", "requested_bytes")
POOL_NAMES = ("all", "small_pool", "large_pool")
SMALL_POOL, LARGE_POOL = 1, 2  # where a pool's figures sit in a statistic's array (0: all pools)


class StatisticsPart:
    """The allocator's part that reads and resets its statistics (``CachingAllocator.stats``)."""

    def memory_allocated(self) -> int:
        return self.stats[4][0][0]

    def memory_reserved(self) -> int:
        return self.stats[5][0][0]

    def max_memory_allocated(self) -> int:
        return self.stats[4][0][1]

    def max_memory_reserved(self) -> int:
        return self.stats[5][0][1]

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


def increase(s: list, n: int) -> None:
    """One statistic ``[current, peak, allocated, freed]`` up by ``n``, as c10's ``Stat::increase``."""
    s[0] += n
    if s[0] > s[1]:
        s[1] = s[0]
    s[2] += n


def decrease(s: list, n: int) -> None:
    """One statistic ``[current, peak, allocated, freed]`` down by ``n``, as c10's ``Stat::decrease``."""
    s[0] -= n
    s[3] += n


def increase_in_pool(arr: list, p: int, n: int) -> None:
    """A statistic's array up by ``n``: its all-pools figure and pool ``p``'s (``SMALL_POOL``, ``LARGE_POOL``), as
    c10's ``update_stat_array`` (written out: it runs on every allocation)."""
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


def decrease_in_pool(arr: list, p: int, n: int) -> None:
    """A statistic's array down by ``n``: its all-pools figure and pool ``p``'s."""
    s = arr[0]
    s[0] -= n
    s[3] += n
    s = arr[p]
    s[0] -= n
    s[3] += n
