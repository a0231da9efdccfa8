"""The simulated CUDA caching allocator driven by the CPU counter: measure(), budget() and predict() on a CPU
report reserved memory from it; a unit that repeats is applied rather than run again; threads, summaries.

Device: cpu, with a simulated CUDA GPU behind it (gpukit.allocator); no real device is touched.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from allocator_cases import MB
from gpukit.allocator import CachingAllocator, SimulatedOutOfMemoryError, format_size

# -- driven by the CPU counter: measure() and budget() on a CPU ----------------------------------------------


def test_measure_on_cpu_reports_simulated_reserved():
    """Device: cpu, with the simulated GPU behind it. A 64 MiB tensor takes a 66 MiB segment (rounded to
    2 MiB); deleting it leaves the segment cached; empty_cache gives it back."""
    import gpukit
    from gpukit.allocator import reset_cpu_device

    dev = reset_cpu_device("16 GiB")
    try:
        with gpukit.measure("cpu", record=False) as r:
            x = torch.empty(64 * MB + 1, dtype=torch.uint8, device="cpu")
            del x
        assert r.reserved_simulated and "reserved, simulated" in repr(r)
        assert r.peak == 64 * MB + 512
        assert r.reserved_peak - r.reserved_start == 66 * MB
        assert r.reserved_end == r.reserved_peak  # cached, not given back
        dev.allocator.empty_cache()  # gives the 66 MiB segment back (and any other cached one)
        assert dev.allocator.memory_reserved() <= r.reserved_start
        assert all(seg["total_size"] != 66 * MB for seg in dev.allocator.segments())
    finally:
        reset_cpu_device()


def test_budget_reserved_on_cpu_raises_cudas_oom_and_leaves_the_counter_consistent():
    """Device: cpu. budget(reserved=True) caps the simulated reserved memory: fragmentation that leaves
    enough free bytes in total still fails, with CUDA's message; the failed tensor is not counted."""
    import gpukit
    from gpukit.allocator import reset_cpu_device
    from gpukit.counter import LEDGER

    dev = reset_cpu_device("16 GiB")
    base = dev.allocator.memory_reserved()  # CPU tensors that already exist hold segments too
    try:
        with gpukit.budget(base + 190 * MB, device="cpu", reserved=True):
            blocks = [torch.empty(6 * MB, dtype=torch.uint8, device="cpu") for _ in range(27)]  # 9 x 20 MiB
            del blocks[0::3], blocks[0::2]  # every segment keeps one 6 MiB block: nothing to release
            live = LEDGER.live_rounded
            with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory. Tried to allocate 18.00 MiB") as e:
                torch.empty(18 * MB, dtype=torch.uint8, device="cpu")
            assert f"{format_size(base + 190 * MB)} allowed" in str(e.value)
            assert LEDGER.live_rounded == live
            del blocks
    finally:
        reset_cpu_device()


def test_a_reserved_budget_says_so_when_a_live_block_keeps_a_segment_over_it_as_it_opens():
    """Device: cpu (the simulated allocator behind the counter: the reserved memory CUDA's budget caps). A 64 MiB
    tensor freed stays cached, and a 2 MiB one made next is cut from its block: empty_cache() cannot release that
    segment (c10/cuda/CUDACachingAllocator.cpp releases only segments whose blocks are all free), so a budget
    under it opens already exceeded and warns with the figures. Made first, on an empty cache, the small tensor
    takes a segment of its own, the large one's goes back, and the same budget opens quietly. The warning made an
    error raises as the block opens and leaves no cap behind."""
    import warnings

    import gpukit
    from gpukit.allocator import reset_cpu_device

    try:
        for small_first in (False, True):
            dev = reset_cpu_device("16 GiB")
            with gpukit.measure("cpu", record=False):  # the counter, and the allocator behind it, follow
                base = dev.allocator.memory_reserved()  # what the process's other CPU tensors hold
                if small_first:
                    small = torch.empty(2 * MB, dtype=torch.uint8, device="cpu")
                big = torch.empty(64 * MB, dtype=torch.uint8, device="cpu")
                del big
                if not small_first:
                    small = torch.empty(2 * MB, dtype=torch.uint8, device="cpu")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    with gpukit.budget(base + 32 * MB, device="cpu", reserved=True):
                        reserved = dev.allocator.memory_reserved()
                with warnings.catch_warnings():  # the warning as an error: raised as the block opens, no cap left
                    warnings.simplefilter("error", gpukit.BudgetWarning)
                    try:
                        with gpukit.budget(base + 32 * MB, device="cpu", reserved=True):
                            entered = True
                    except gpukit.BudgetWarning:
                        entered = False
                assert entered is small_first and dev.allocator.allowed_memory_maximum is None
                del small
            messages = [str(w.message) for w in caught if w.category is gpukit.BudgetWarning]
            if small_first:
                assert messages == [] and reserved == base + 20 * MB  # 1-10 MiB requests take 20 MiB segments
            else:
                assert reserved == base + 64 * MB and len(messages) == 1
                assert f"{gpukit.format_bytes(base + 64 * MB)} stays reserved after empty_cache()" in messages[0]
                assert "gpukit.warm_up()" in messages[0]
    finally:
        reset_cpu_device()


def test_budget_reserved_is_cpu_only(monkeypatch):
    """Device: cuda, stood in (the device is resolved as a GPU machine would; nothing runs on it)."""
    import sys

    import gpukit

    monkeypatch.setattr(sys.modules["gpukit.budget"], "resolve_device", lambda device: torch.device("cuda", 0))
    with pytest.raises(ValueError, match="reserved=True"):
        gpukit.budget("1 GiB", device="cuda", reserved=True)


def test_predict_gives_reserved_at_the_peak_and_will_it_fit_replays_it():
    """Device: a simulated GPU fed by predict()'s fake tensors (nothing allocated). Reserved memory at the
    peak covers the allocated peak; will_it_fit replays the allocations on each size: a device that holds
    the allocated peak but not what the allocator needs does not fit."""
    from torch import nn

    from gpukit.estimate import predict

    p = predict(lambda: nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                      nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)),
                lambda ps: torch.optim.Adam(ps), lambda: (torch.randn(512, 64), torch.randint(0, 10, (512,))))
    assert p.reserved_peak >= p.peak > 0 and p.allocator_events
    below, between, above = p.peak - 2 * MB, (p.peak + p.reserved_peak) // 2, p.reserved_peak + 2 * MB
    table = p.will_it_fit(sizes_gb=(below / 1e9, between / 1e9, above / 1e9), allowance=0)
    assert list(table["fits"]) == [False, False, True]
    assert "reserved, simulated" in repr(p) or "simulated allocator" in repr(p)


def test_ctrl_c_inside_the_simulation_leaves_measure_usable(monkeypatch):
    """Device: cpu. A KeyboardInterrupt in the middle of a simulated malloc reaches the user; the counter
    is switched off, and the next measure() starts a fresh simulated device and reports reserved memory."""
    import gpukit
    from gpukit import allocator
    from gpukit.counter import LEDGER

    dev = allocator.reset_cpu_device()
    real = dev.allocator.malloc

    def interrupted(size, stream=0):
        monkeypatch.setattr(dev.allocator, "malloc", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(dev.allocator, "malloc", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            with gpukit.measure("cpu", record=False):
                torch.empty(3 * MB, dtype=torch.uint8, device="cpu")
        assert not LEDGER.active and dev.failed and LEDGER.listener is None
        with gpukit.measure("cpu", record=False) as r:
            x = torch.empty(3 * MB, dtype=torch.uint8, device="cpu")
        assert r.reserved_simulated and r.reserved_end >= r.live_end and allocator.cpu_device() is not dev
        del x
    finally:
        allocator.reset_cpu_device()


def test_garbage_collection_threshold_frees_old_cached_blocks_before_growing():
    """garbage_collection_threshold (with a per-process cap): past threshold x cap, cached unsplit blocks at
    least as old as the average (counted in free-block searches) go back before a new segment is made."""
    for gc, expected in (("", 100 * MB), ("garbage_collection_threshold:0.5", 40 * MB)):
        s = CachingAllocator("80 GiB", gc, fraction=100 * MB / (80 * 1024**3))
        a, b = s.malloc(30 * MB), s.malloc(30 * MB)
        s.free(a)
        s.free(b)  # 60 MiB cached, above half the 100 MiB cap
        s.malloc(40 * MB)  # no cached block fits: with gc both old blocks go first, then a 40 MiB segment
        assert s.memory_reserved() == expected, gc
        assert s.memory_stats()["num_device_free"] == (2 if gc else 0)


def test_a_cpu_run_bigger_than_the_simulated_gpu_is_not_failed():
    """Device: cpu. Without a cap the user set, a simulated GPU too small for the run stops simulating
    (with a warning) instead of failing a real CPU program."""
    import gpukit
    from gpukit.allocator import reset_cpu_device

    dev = reset_cpu_device("64 MiB", context_bytes=0)  # small on purpose: no room for a context
    try:
        with pytest.warns(RuntimeWarning, match="no longer simulated"):
            with gpukit.measure("cpu", record=False) as r:
                x = torch.empty(100 * MB, dtype=torch.uint8, device="cpu")
        assert r.peak == 100 * MB and dev.failed
        del x
    finally:
        reset_cpu_device()


def test_the_cpu_simulated_device_read_outside_a_block_has_counted_every_free():
    """Device: cpu, with the simulated GPU behind it. The counter counts a free when it next does its books;
    reading the simulated device must not show a storage that died since."""
    import gpukit
    from gpukit.allocator import cpu_device, reset_cpu_device

    reset_cpu_device("16 GiB")
    try:
        with gpukit.measure("cpu", record=False):
            x = torch.empty(16 * MB, dtype=torch.uint8, device="cpu")
        allocated = cpu_device().allocator.memory_allocated()
        del x  # outside any block
        assert cpu_device().allocator.memory_allocated() == allocated - 16 * MB
    finally:
        reset_cpu_device()


# -- a unit that repeats is applied, not run again ---------------------------------------------------------------


class _Twins:
    """Two simulated devices fed the same events: one as measure() runs it (queued, repeats reused) and
    one that runs every event when it happens. Nothing in this file drives the second one cleverly."""

    def __init__(self, config: str = ""):
        from gpukit.allocator import SimulatedDevice

        self.lazy = SimulatedDevice("16 GiB", config)
        self.eager = SimulatedDevice("16 GiB", config, lazy=False)
        self.next_key = 1

    def alloc(self, nbytes: int, key: int | None = None) -> int:
        if key is None:
            key, self.next_key = self.next_key, self.next_key + 1
        for dev in (self.lazy, self.eager):
            dev.on_alloc(key, nbytes)
        return key

    def free(self, key: int) -> None:
        for dev in (self.lazy, self.eager):
            dev.on_free(key)

    def watched(self, body) -> None:
        """``body()`` inside a block on both devices: the peak of reserved memory each reports must agree."""
        cells = [dev.watch() for dev in (self.lazy, self.eager)]
        body()
        peaks = [dev.unwatch(c) for dev, c in zip((self.lazy, self.eager), cells)]
        assert peaks[0] == peaks[1]

    def same(self) -> None:
        lazy, eager = self.lazy.allocator, self.eager.allocator
        assert lazy.memory_stats() == eager.memory_stats()
        assert lazy.segments() == eager.segments()
        assert self.lazy.addr == self.eager.addr


def _training_step(twins: _Twins, params: list[int], grads: list[int], batch: int) -> list[int]:
    """One step of a made-up training loop: the old gradients go, activations pile up and go in reverse order
    while the new gradients are made, a temporary in between; returns the new gradients' keys."""
    for g in grads:
        twins.free(g)
    acts = [twins.alloc(batch * (i + 1) * 3000) for i in range(6)]
    tmp = twins.alloc(12 * MB + 4096)
    twins.free(tmp)
    new = []
    for a, p in zip(reversed(acts), params * 2):
        twins.free(a)
        if len(new) < len(params):
            new.append(twins.alloc(p))
    return new


@pytest.mark.parametrize("config", ["", "expandable_segments:True"])
def test_a_reused_step_gives_what_running_every_event_gives(config):
    """Device: two simulated GPUs, fed the same events (no torch device). A training loop's steps repeat; the
    queued device applies a recorded step instead of running it, and every statistic, segment, address and
    block peak agrees with the device that runs every event, also after calls that change the allocator
    behind the queue's back (empty_cache, a malloc on a held reference, new settings, a storage that died
    unseen, a bigger batch)."""
    twins = _Twins(config)
    sizes = [300_000, 4 * MB, 2 * MB + 512, 700, 9 * MB]
    params = [twins.alloc(s) for s in sizes]
    grads: list[int] = []
    held = twins.lazy.allocator, twins.eager.allocator  # references kept past the queue

    kept = []

    def steps(n: int, batch: int = 64, leak: bool = False) -> None:
        nonlocal grads
        for _ in range(n):
            def body():
                nonlocal grads
                grads = _training_step(twins, params, grads, batch)
                if leak:  # total_loss += loss: the same events every step, and a state that grows
                    kept.append(twins.alloc(1 * MB))
            twins.watched(body)
            twins.same()

    steps(8)
    assert twins.lazy.units_reused >= 4, (twins.lazy.units_run, twins.lazy.units_reused)
    for a in held:
        a.empty_cache()
    steps(5)
    extra = [a.malloc(5 * MB) for a in held]  # on the allocators themselves, not through the devices
    steps(5)
    for a, x in zip(held, extra):
        a.free(x)
    for a in held:
        a.set_settings("max_split_size_mb:40")
    steps(5)
    steps(3)  # long enough for a step to be reused under these settings
    for a in held:  # by assignment, as a user may: no call tells the device (blocks of 4 MiB up are oversize)
        a.config = dataclasses.replace(a.config, max_split_size=4 * MB)
    steps(5)
    twins.alloc(3 * MB, key=params[1])  # a storage that died unseen: its key comes back with a new one
    steps(4, batch=256)
    steps(5)
    steps(6, leak=True)
    steps(5)
    assert twins.lazy.units_reused >= 12, (twins.lazy.units_run, twins.lazy.units_reused)
    assert twins.eager.units_run == twins.eager.units_reused == 0  # it ran every event as it came


def test_nested_blocks_each_keep_their_own_reserved_peak():
    """Device: cpu, with the simulated GPU behind it. An inner block that ends with the same reserved memory
    as the outer one began with must not take the outer block's peak with it."""
    import gpukit
    from gpukit.allocator import reset_cpu_device

    reset_cpu_device("16 GiB")
    try:
        with gpukit.measure("cpu", record=False) as outer:
            with gpukit.measure("cpu", record=False):
                pass
            x = torch.empty(64 * MB, dtype=torch.uint8, device="cpu")
        assert outer.reserved_peak - outer.reserved_start == 64 * MB
        del x
    finally:
        reset_cpu_device()


def test_a_measured_training_loop_reports_the_same_reserved_memory_reused_or_run():
    """Device: cpu, with the simulated GPU behind it. A steady training loop inside measure(); a second simulated
    device that runs every event is fed the same events (the counter's calls to the first, passed on) and has
    adopted the same storages. The steps the first device reuses report the reserved memory, and leave the
    statistics and segments, that running every event gives."""
    import gpukit
    from gpukit.allocator import SimulatedDevice, reset_cpu_device
    from gpukit.counter import LEDGER

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(256, 64, device="cpu"), torch.randint(0, 10, (256,), device="cpu")
    dev = reset_cpu_device("16 GiB")
    twin = SimulatedDevice("16 GiB", lazy=False)
    for key, nbytes in list(LEDGER.sizes.items()):  # what dev adopted, in the order it adopted it
        twin.on_alloc(key, nbytes, False)

    def both(name):
        first, second = getattr(dev, name), getattr(twin, name)

        def call(*args):
            first(*args)
            second(*args)
        return call

    for name in ("on_alloc", "on_free", "on_resize"):
        setattr(dev, name, both(name))  # the counter calls its listener's methods: these, now

    class Tee:
        """The event queue the counter appends to directly (``event_queue``): each event to the twin too."""

        def __init__(self, queue):
            self.queue = queue

        def append(self, event):
            key, nbytes = event
            twin.on_alloc(key, nbytes) if nbytes else twin.on_free(key)
            self.queue.append(event)

    real_queue = dev.event_queue
    dev.event_queue = lambda: None if real_queue() is None else Tee(real_queue())
    try:
        for _ in range(10):
            cell = twin.watch()
            with gpukit.measure("cpu", record=False) as r:
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            assert (r.reserved_peak, r.reserved_end) == (twin.unwatch(cell), twin.reserved())
            assert dev.allocator.memory_stats() == twin.allocator.memory_stats()
            assert dev.allocator.segments() == twin.allocator.segments()
        assert dev.units_reused >= 5 and twin.units_reused == 0
    finally:
        reset_cpu_device()


def test_a_cap_after_reused_steps_still_fails_the_allocation_that_passes_it():
    """Device: cpu, with the simulated GPU behind it. Once steps are being reused, budget(reserved=True) must
    still raise CUDA's out-of-memory error from the allocation that passes the cap, inside the block."""
    import gpukit
    from gpukit.allocator import cpu_device, reset_cpu_device

    reset_cpu_device("16 GiB")
    try:
        for _ in range(6):
            with gpukit.measure("cpu", record=False):
                t = torch.empty(30 * MB, dtype=torch.uint8, device="cpu")
                del t
        assert cpu_device().units_reused >= 2
        cpu_device().allocator.empty_cache()  # as budget() does on entry: the cap counts from here
        base = cpu_device().allocator.memory_reserved()
        made = []
        with pytest.raises(SimulatedOutOfMemoryError, match="CUDA out of memory. Tried to allocate 30.00 MiB"):
            with gpukit.budget(base + 40 * MB, device="cpu", reserved=True):
                made.append(torch.empty(20 * MB, dtype=torch.uint8, device="cpu"))
                made.append(torch.empty(30 * MB, dtype=torch.uint8, device="cpu"))
        assert len(made) == 1  # the first fits; the second fails where it is asked for
    finally:
        reset_cpu_device()


def test_a_unit_that_repeats_while_the_state_grows_is_compared_less_and_less_often(monkeypatch):
    """Device: a simulated GPU (no torch device). A leak (``total_loss += loss``) repeats the same events
    while the allocator's state grows, so no unit can be reused; comparing whole states every time would
    cost a model's every block per step. Each failed comparison doubles the wait before the next one."""
    calls = []
    real = CachingAllocator.state_key
    monkeypatch.setattr(CachingAllocator, "state_key", lambda self: calls.append(1) or real(self))
    twins = _Twins("expandable_segments:True")
    for _ in range(100):
        twins.watched(lambda: twins.alloc(1 * MB))
        twins.same()
    assert twins.lazy.units_reused == 0
    # Checked after 1, 2, 4, ... 64 repeats: about seven checks of one or two states each in 100 units;
    # comparing every unit would take 100 to 200.
    assert 6 <= len(calls) <= 30, len(calls)


def test_blocks_on_two_threads_leave_the_simulated_device_in_step_with_the_counter():
    """Device: cpu, with the simulated GPU behind it. Two threads measure training-like loops at once (their
    events queued from both, each block end running the queue): afterwards the simulated allocator holds
    exactly what the counter counts live (small tensors only: each gets a block of its rounded size; both
    counted from where they stood, as storages of earlier tests may be bigger)."""
    import threading

    import gpukit
    from gpukit.allocator import cpu_device, reset_cpu_device
    from gpukit.counter import LEDGER

    dev = reset_cpu_device("16 GiB")
    errors, kept = [], []

    def held() -> int:
        return dev.allocator.memory_allocated() - LEDGER.live_rounded

    start = held()

    def loop(width: int) -> None:
        try:
            for i in range(40):
                with gpukit.measure("cpu", record=False):
                    acts = [torch.empty(width * (j + 1), device="cpu") for j in range(5)]
                    del acts[::2]
                    if i % 10 == 0:
                        kept.append(torch.empty(width, device="cpu"))
                    del acts
        except BaseException as err:  # noqa: BLE001 - handed to the test thread
            errors.append(err)

    try:
        threads = [threading.Thread(target=loop, args=(w,)) for w in (1000, 3000)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        assert cpu_device() is dev and len(kept) == 8 and held() == start
        kept.clear()
        assert held() == start
    finally:
        reset_cpu_device()


def test_a_held_simulated_device_read_after_a_del_has_counted_the_free():
    """Device: cpu, with the simulated GPU behind it. The device reset_cpu_device() returns, read later
    through the reference kept (not through cpu_device()), shows a tensor deleted outside any block as freed."""
    import gpukit
    from gpukit.allocator import reset_cpu_device

    dev = reset_cpu_device("16 GiB")
    try:
        with gpukit.measure("cpu", record=False):
            x = torch.empty(16 * MB, dtype=torch.uint8, device="cpu")
        allocated = dev.allocator.memory_allocated()
        del x
        assert dev.allocator.memory_allocated() == allocated - 16 * MB
    finally:
        reset_cpu_device()


@pytest.mark.parametrize("abbreviated", [False, True])
def test_memory_summary_is_torch_cuda_memory_summary_of_the_simulated_statistics(monkeypatch, abbreviated):
    """Device: a simulated CUDA GPU (no real device). The table is torch/cuda/memory.py memory_summary's:
    the installed torch formats the simulated statistics itself (its memory_stats replaced by the
    simulation's), and the two texts are equal. The figures of a known sequence are checked by hand:
    3 MiB in a new 20 MiB segment (17 MiB split off: non-releasable), 1000 bytes (1024 rounded) in a
    2 MiB small segment, freed (its segment whole again), then 70 MiB under max_split_size_mb:64: an
    oversize block in an oversize segment of its own, freed (the segment stays cached)."""
    import torch.cuda.memory as cuda_memory

    s = CachingAllocator("16 GiB", "max_split_size_mb:64")
    s.malloc(3 * MB)
    s.free(s.malloc(1000))
    big = s.malloc(70 * MB)  # oversize: at or above max_split_size
    s.free(big)
    monkeypatch.setattr(cuda_memory, "memory_stats", lambda device=None: s.memory_stats())
    assert s.memory_summary(abbreviated) == cuda_memory.memory_summary(0, abbreviated=abbreviated)

    lines = s.memory_summary().splitlines()

    def row(metric, below=0):  # the "all" row of a metric, or a pool's row below it
        return lines[[line.startswith(f"| {metric:<21} |") for line in lines].index(True) + below]

    assert row("Allocated memory") == "| Allocated memory      |   3072 KiB |  74752 KiB |  74753 KiB |  71681 KiB |"
    assert row("Allocated memory", 2) == "|       from small pool |      0 KiB |      1 KiB |      1 KiB |      1 KiB |"
    assert row("Non-releasable memory") == "| Non-releasable memory |  17408 KiB |  19455 KiB |  19455 KiB |   2047 KiB |"
    assert row("GPU reserved memory") == "| GPU reserved memory   |  94208 KiB |  94208 KiB |  94208 KiB |      0 B   |"
    assert row("Oversize allocations") == "| Oversize allocations  |       0    |       1    |       1    |       1    |"
    assert row("Oversize GPU segments") == "| Oversize GPU segments |       1    |       1    |       1    |       0    |"
    assert lines[1] == "|                  PyTorch CUDA memory summary, device ID 0                 |"


def test_simulated_device_memory_summary_is_its_allocators():
    """Device: a simulated CUDA GPU fed by the counter (SimulatedDevice; no real device): the summary of the
    device, up to date, is its allocator's."""
    from gpukit.allocator import SimulatedDevice

    dev = SimulatedDevice("16 GiB", context_bytes=0, lazy=False)
    dev.on_alloc(1, 3 * MB)
    dev.on_alloc(2, 1000)
    dev.on_free(2)
    assert dev.memory_summary() == dev.allocator.memory_summary()
    assert "|   3072 KiB |   3073 KiB |" in dev.memory_summary()


def test_simulated_device_holds_the_cuda_context_allowance_by_default():
    """Device: a simulated 16 GiB CUDA GPU (no real device). A real process holds a CUDA context from its
    first CUDA call, before any tensor: nvidia-smi counts it, cudaMemGetInfo's free memory lacks it, the
    OOM message's "this process has" includes it, reserved memory does not. The simulated device holds
    the allowance plan() and predict() use (one constant), unless told otherwise."""
    from gpukit import estimate
    from gpukit.allocator import CONTEXT_ALLOWANCE, SimulatedDevice, cpu_device, reset_cpu_device

    assert estimate.CONTEXT_ALLOWANCE is CONTEXT_ALLOWANCE == 2**30
    s = CachingAllocator("16 GiB")
    assert s.context_bytes == CONTEXT_ALLOWANCE and s.memory_reserved() == 0
    assert s.mem_get_info() == (15 * 1024**3, 16 * 1024**3) and s.nvidia_smi_bytes() == CONTEXT_ALLOWANCE
    s.malloc(3 * MB)
    assert s.nvidia_smi_bytes() == CONTEXT_ALLOWANCE + 20 * MB and s.memory_reserved() == 20 * MB
    with pytest.raises(torch.OutOfMemoryError, match="of which 14.98 GiB is free. Including non-PyTorch memory, "
                                                     "this process has 1.02 GiB memory in use"):
        s.malloc(15 * 1024**3)
    assert SimulatedDevice("16 GiB")._alloc.context_bytes == CONTEXT_ALLOWANCE
    assert CachingAllocator("16 GiB", context_bytes=0).mem_get_info()[0] == 16 * 1024**3
    try:
        assert reset_cpu_device().allocator.context_bytes == CONTEXT_ALLOWANCE
        set_off = reset_cpu_device(context_bytes=0)
        assert set_off.allocator.context_bytes == 0 and cpu_device() is set_off
    finally:
        reset_cpu_device()


def test_whole_blocks_are_known_only_from_a_device_a_counter_feeds():
    """Device: cpu (simulated devices). ``WholeBlocks`` reads the blocks over the storages' sizes, which only the
    counter that feeds the device knows: from a device no counter feeds it says it does not know (a prediction then
    keeps the tensors' sizes) rather than count every block as slack."""
    from gpukit.allocator import SimulatedDevice, WholeBlocks

    alone = SimulatedDevice(2**34)
    alone.on_alloc(1, 9_961_472)
    assert alone.allocator.memory_allocated() == 9_961_472 and not WholeBlocks(alone).known()
