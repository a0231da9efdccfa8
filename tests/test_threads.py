"""Blocks on several threads: each thread pushes and pops its own counting mode, and every open block
counts the process (allocations on every thread inside a block, and every free), as CUDA's allocator does."""

import sys
import threading

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

import gpukit
from gpukit.counter import LEDGER, round_up

MB = 250_000  # float32 elements in 1 MB


def in_threads(*bodies):
    """Run each body on a thread of its own; re-raise the first error any of them hit."""
    errors, modes_after = [], []

    def wrap(body):
        try:
            body()
            modes_after.append(_get_current_dispatch_mode())
        except BaseException as err:  # noqa: BLE001 - handed to the test thread
            errors.append(err)

    threads = [threading.Thread(target=wrap, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    assert modes_after == [None] * len(bodies)  # no thread is left with a counting mode


def test_overlapping_blocks_on_two_threads_each_see_the_process():
    step = threading.Barrier(2, timeout=30)
    reports = {}

    def first():
        with gpukit.measure(device="cpu", record=False) as reports["a"]:
            step.wait()                      # 1: both blocks are open
            a = torch.empty(MB)              # +1 MB, seen by both blocks
            step.wait()                      # 2
            step.wait()                      # 3: the other thread made and freed 2 MB, kept 3 MB
        step.wait()                          # 4: this block ended first, the other is still open
        step.wait()                          # 5
        step.wait()                          # 6: the other block has ended too
        del a

    def second():
        with gpukit.measure(device="cpu", record=False) as reports["b"]:
            step.wait()                      # 1
            step.wait()                      # 2
            tmp = torch.empty(2 * MB)
            del tmp
            kept = torch.empty(3 * MB)
            step.wait()                      # 3
            step.wait()                      # 4
            b = torch.empty(MB)              # after the first block ended: only this block sees it
            step.wait()                      # 5
        step.wait()                          # 6: only now may the first thread free its tensor
        del kept, b

    in_threads(first, second)
    one, two, three = round_up(4 * MB), round_up(8 * MB), round_up(12 * MB)
    a, b = reports["a"], reports["b"]
    assert (a.peak, a.delta) == (one + max(two, three), one + three)
    assert (b.peak, b.delta) == (one + three + one, one + three + one)
    assert not LEDGER.active and not LEDGER._pushed
    assert torch.UntypedStorage.resize_ is LEDGER._orig_storage_resize or LEDGER._orig_storage_resize is None


def test_a_block_on_one_thread_counts_the_allocations_and_frees_of_a_block_on_another():
    # Another thread's tensor, made and dropped inside its own block, nets to zero in this one.
    step = threading.Barrier(2, timeout=30)
    reports = {}

    def watcher():
        with gpukit.measure(device="cpu", record=False) as reports["w"]:
            step.wait()
            step.wait()

    def worker():
        step.wait()
        with gpukit.measure(device="cpu", record=False) as reports["x"]:
            x = torch.empty(MB)
            del x
        step.wait()

    in_threads(watcher, worker)
    assert (reports["w"].delta, reports["w"].peak) == (0, round_up(4 * MB))
    assert (reports["x"].delta, reports["x"].peak) == (0, round_up(4 * MB))


def test_many_threads_opening_and_closing_blocks_leave_no_mode_and_no_drift():
    # Threads switched after nearly every bytecode, so that a scan (each block's start) meets the other
    # threads' tensors between the op that made them and their queueing; small tensors, so that a storage
    # booked twice or freed once too few shows as 512 B.
    with gpukit.measure(device="cpu", record=False):
        pass
    before = LEDGER.live_rounded

    def body():
        for _ in range(200):
            with gpukit.measure(device="cpu", record=False):
                t = torch.ones(10) * 2
                del t

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        in_threads(*[body] * 4)
    finally:
        sys.setswitchinterval(interval)
    assert not LEDGER.active and not LEDGER._pushed
    assert LEDGER.live_rounded == before
    assert _get_current_dispatch_mode() is None


def adopt_as_a_scan_would(t):
    """What a block's start on another thread does when its scan meets ``t`` before the thread that made it,
    inside a block, has queued its storage (the op has returned it, the counting mode not yet run its next line)."""
    st = t.untyped_storage()
    with LEDGER._lock:
        LEDGER._track(st, st.nbytes(), counted=False)


@pytest.mark.parametrize("read_while_alive", [False, True], ids=["dies-before-booked", "booked-alive"])
def test_a_storage_a_scan_adopted_before_its_maker_queued_it_is_booked_once_and_counted_in_the_block(
        read_while_alive):
    with gpukit.measure(device="cpu", record=False):
        pass
    before = LEDGER.live_rounded
    with gpukit.measure(device="cpu", record=False) as r:
        t = torch.ones(1000)
        adopt_as_a_scan_would(t)
        if read_while_alive:
            assert LEDGER.live_rounded == before + round_up(4000)  # booked once
        del t  # (not read before: both records of the storage come through the queue dead)
    assert LEDGER.live_rounded == before
    assert (r.peak, r.delta) == (round_up(4000), 0)  # made in the block: counted in it


def test_a_budget_on_one_thread_caps_a_measured_block_on_another():
    # One process, one cap (CUDA's set_per_process_memory_fraction is per process too).
    with gpukit.measure(device="cpu", record=False):
        pass
    cap = LEDGER.live_rounded + round_up(4 * MB)
    step = threading.Barrier(2, timeout=30)
    outcome = {}

    def capped():
        with gpukit.budget(cap, device="cpu"):
            step.wait()
            step.wait()

    def other():
        step.wait()
        try:
            with gpukit.measure(device="cpu", record=False):
                torch.empty(2 * MB)
        except torch.OutOfMemoryError:
            outcome["oom"] = True
        step.wait()

    in_threads(capped, other)
    assert outcome == {"oom": True}
    assert LEDGER.limits == [] and not LEDGER.active


def test_a_block_that_ends_on_another_thread_still_closes():
    meter = gpukit.measure(device="cpu", record=False)
    opened = threading.Event()

    def opener():
        report = meter.__enter__()
        torch.empty(MB)
        opened.report = report
        opened.set()

    t = threading.Thread(target=opener)
    t.start()
    t.join()
    assert opened.is_set()
    meter.__exit__(None, None, None)  # on this thread
    assert not LEDGER.tallies
    assert opened.report.peak == round_up(4 * MB)


def test_a_mode_left_on_an_ended_thread_leaves_no_process_wide_flag_that_stops_torch_compile(monkeypatch):
    """Device: cpu. torch 2.10's dynamo skips every frame while a process-wide flag says a dispatch mode is on,
    which TorchDispatchMode.__enter__ sets and __exit__ puts back: a counting mode left on a thread that ended is
    never exited, and every later torch.compile ran eagerly (found on 2.10: three tests of this file, then a
    compile test). torch 2.11 and later ask the thread's own stack (any_torch_dispatch_mode_on_stack); without
    that function, as on 2.10, gpukit sets the flag from this thread's stack once no counting mode is left."""
    from torch.utils import _python_dispatch as dispatch

    monkeypatch.delattr(dispatch, "any_torch_dispatch_mode_on_stack", raising=False)  # torch 2.10 has none
    meter = gpukit.measure(device="cpu", record=False)
    t = threading.Thread(target=meter.__enter__)
    t.start()
    t.join()
    assert dispatch._is_in_any_mode_without_ignore_compile_internals  # set on that thread, never put back there
    meter.__exit__(None, None, None)
    assert not dispatch._is_in_any_mode_without_ignore_compile_internals
    assert not dispatch._is_in_torch_dispatch_mode and not LEDGER._pushed


def test_a_prediction_on_another_thread_waits_for_the_one_running_and_each_is_its_own():
    """Device: cpu (predicting for CUDA: each prediction drives a simulated GPU from the fake ledger, which counts
    every thread). A prediction started on a second thread while one runs (here from inside the first one's model
    factory, so that the two overlap) waits for it: each gives what it gives alone, to the byte, for predict(),
    predict_offload() and plan()."""
    from gpukit.estimate import predict
    from gpukit.offload import predict_offload

    make_optimizer = lambda params: torch.optim.AdamW(params)  # noqa: E731
    small = lambda: torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))  # noqa
    wide = lambda: torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 8))  # noqa
    batch = lambda: (torch.randn(32, 64), torch.randint(0, 8, (32,)))  # noqa: E731
    runs = {
        "predict": lambda make_model: predict(make_model, make_optimizer, batch, device="cuda").reserved_peak,
        "offload": lambda make_model: predict_offload(make_model, make_optimizer, batch).reserved_peak,
        "plan": lambda make_model: gpukit.plan(make_model, make_optimizer, batch, "4GB", verify=False, alternatives=0,
                                               techniques=gpukit.plan.Techniques(precisions=["float32", "bf16"],
                                                                                 implementations=False)).choice.need,
    }
    alone = {(what, name): run(model) for what, run in runs.items() for name, model in (("small", small),
                                                                                        ("wide", wide))}
    for first, second in (("predict", "offload"), ("plan", "predict"), ("offload", "plan")):
        got, errors = {}, []

        def second_run():
            try:
                got[second] = runs[second](wide)
            except BaseException as err:  # noqa: BLE001 - handed to the test thread
                errors.append(err)

        other = threading.Thread(target=second_run)

        def overlapping():  # the first one's model factory: the second starts while the first is running
            if other.ident is None:
                other.start()
                other.join(timeout=0.3)  # (it waits for the first, which goes on)
            return small()

        got[first] = runs[first](overlapping)
        other.join(timeout=120)
        if errors:
            raise errors[0]
        assert (got[first], got[second]) == (alone[(first, "small")], alone[(second, "wide")]), (first, second)
