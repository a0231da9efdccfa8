"""Recorded traces: reading ``torch.cuda.memory._dump_snapshot()`` pickles safely, keeping them compact, and
replaying them through the simulation to compare with what the real allocator did."""

from __future__ import annotations

import pickle
from bisect import bisect_left
from dataclasses import dataclass, field

import torch

from .caching import CachingAllocator
from .config import SIZE_MAX, AllocatorConfig, kMinBlockSize, kRoundUpPowerOfTwoIntervals, kSmallBuffer, kSmallSize


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
