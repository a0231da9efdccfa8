"""The CPU meter counts exactly what the CUDA caching allocator would: known sizes give known bytes."""

import gc
import sys

import pytest
import torch

import gpukit
from gpukit.counter import LEDGER, round_up


def test_float32_million_is_4_000_000_bytes_rounded_to_4_000_256():
    with gpukit.measure("cpu") as r:
        x = torch.empty(1_000_000)
    assert (r.peak, r.delta) == (4_000_256, 4_000_256)
    assert (r.peak_unrounded, r.delta_unrounded) == (4_000_000, 4_000_000)
    assert r.live_end - r.live_start == 4_000_256
    assert r.device == "cpu" and r.backend == "exact live-tensor counter"
    del x


@pytest.mark.parametrize("dtype, numel, expected", [
    (torch.float16, 1000, 2048),    # 2,000 B -> 4 blocks of 512
    (torch.int64, 64, 512),         # exactly 512
    (torch.uint8, 513, 1024),
    (torch.float32, 1, 512),        # a scalar still takes one block
    (torch.float32, 0, 0),          # an empty tensor takes nothing
])
def test_sizes_round_up_to_512_like_the_cuda_allocator(dtype, numel, expected):
    with gpukit.measure("cpu") as r:
        t = torch.zeros(numel, dtype=dtype)
    assert r.delta == expected == round_up(numel * t.element_size())
    assert r.delta_unrounded == numel * t.element_size()


def test_views_and_in_place_ops_add_nothing():
    x = torch.ones(1000, 1000)
    with gpukit.measure("cpu") as r:
        v = x.view(-1)[10:]
        w = x.t()
        x.add_(1).mul_(2)
        v.zero_()
    assert (r.peak, r.delta) == (0, 0)
    del v, w


def test_parameter_data_inside_a_block_works_and_adds_nothing():
    # nn.Parameter is a tensor subclass without a __torch_dispatch__ of its own: the meter
    # must treat it as a plain tensor (old-style updates such as p.data.mul_() are common).
    layer = torch.nn.Linear(100, 100)
    with gpukit.measure("cpu") as r:
        weight = layer.weight.data
        weight.mul_(0.5)
        with torch.no_grad():
            layer.bias.data.zero_()
    assert (r.peak, r.delta) == (0, 0)
    assert weight.data_ptr() == layer.weight.data_ptr()


def test_a_storage_is_freed_when_its_last_view_dies():
    with gpukit.measure("cpu") as r:
        x = torch.empty(1000, 1000)
        v = x[500:]
        del x
        level_with_view = LEDGER.live_rounded
        del v
    assert level_with_view - LEDGER.live_rounded == 4_000_256
    assert r.peak == 4_000_256 and r.delta == 0


def test_peak_catches_a_400_mb_temporary_deleted_inside_the_block():
    with gpukit.measure("cpu") as r:
        tmp = torch.empty(100_000_000)
        del tmp
        keep = torch.empty(10)
    assert r.peak == 400_000_000  # a multiple of 512 already
    assert r.delta == 512
    del keep


def test_a_temporary_made_and_freed_inside_one_expression_counts():
    x = torch.ones(1_000_000)
    with gpukit.measure("cpu") as r:
        s = (x * 2).sum()  # x * 2 is a 4 MB temporary that never gets a name
    assert r.peak == 4_000_256 + 512
    assert r.delta == 512
    del s


def test_dropping_a_tensor_from_before_the_block_counts_as_a_free():
    big = torch.empty(10_000_000)  # 40 MB made before the block
    with gpukit.measure("cpu") as r:
        del big
        big = torch.empty(10_000_000)
    assert r.peak <= 512
    assert r.delta == 0
    assert r.peak_unrounded == 0


def test_zero_grad_set_to_none_lowers_the_level_before_backward_raises_it():
    model = torch.nn.Linear(1000, 1000)
    model(torch.ones(1, 1000)).sum().backward()
    grad_bytes = round_up(1000 * 1000 * 4) + round_up(1000 * 4)
    with gpukit.measure("cpu") as r:
        model.zero_grad(set_to_none=True)
        after_zero_grad = LEDGER.live_rounded
    assert r.delta == -grad_bytes
    assert r.peak == 0
    assert after_zero_grad == r.live_start - grad_bytes


def test_backward_of_a_graph_built_before_the_block_frees_its_saved_tensors():
    w = torch.ones(1000, requires_grad=True)
    x = torch.ones(1000, 1000)
    loss = (x * w).exp().sum()  # exp's output (4 MB) is saved for backward, held only by the graph
    with gpukit.measure("cpu") as r:
        loss.backward()
    # grad of w (4,000 B) stays; the saved exp output is freed.
    assert r.delta == round_up(4000) - 4_000_256


def test_resize_is_counted():
    t = torch.empty(0)
    with gpukit.measure("cpu") as r:
        t.resize_(1000)
        t.untyped_storage().resize_(8000)
    assert r.delta == 8192
    assert r.delta_unrounded == 8000


def test_views_and_in_place_ops_count_nothing_and_an_out_op_that_grows_its_output_counts_the_growth():
    """Device: cpu. The counter skips ops whose outputs only alias their inputs (their schemas say so), but not
    an ``out=`` op, which resizes an output that is too small, nor ``resize_`` or ``set_``."""
    from gpukit.counter.mode import aliases_only

    aten = torch.ops.aten
    assert all(aliases_only(op) for op in (aten.view.default, aten.t.default, aten.split.Tensor,
                                            aten.detach.default, aten.add_.Tensor, aten.mul_.Tensor))
    assert not any(aliases_only(op) for op in (aten.add.Tensor, aten.add.out, aten.resize_.default,
                                                aten.set_.source_Storage, aten.resize_as_.default,
                                                aten.lift_fresh.default))
    a, out = torch.ones(1000), torch.empty(0)
    with gpukit.measure("cpu", record=False) as r:
        a.add_(1).mul_(2)
        v = a.view(10, 100).t()
        torch.add(a, a, out=out)  # out grows from 0 to 4,000 bytes: a new storage behind the same tensor
        del v
        scalar = torch.tensor(0)  # made outside the dispatcher, then lifted (aten.lift_fresh, which aliases it)
    assert (r.peak, r.delta, r.delta_unrounded) == (round_up(4000) + 512, round_up(4000) + 512, 4000 + 8)
    del scalar


def test_tensors_on_other_devices_are_not_counted():
    with gpukit.measure(device="cpu") as r:
        m = torch.empty(1_000_000, device="meta")
    assert (r.peak, r.delta) == (0, 0)
    del m


def test_nested_blocks_each_report_their_own_peak():
    with gpukit.measure("cpu") as outer:
        a = torch.empty(1_000_000)              # +4,000,256
        with gpukit.measure("cpu") as inner:
            b = torch.empty(250_000)            # +1,000,448
            del b
        c = torch.empty(500_000)                # +2,000,384
        del c
    assert (inner.peak, inner.delta) == (1_000_448, 0)
    assert outer.peak == 4_000_256 + 2_000_384
    assert outer.delta == 4_000_256
    assert inner.live_start == outer.live_start + 4_000_256
    del a


def test_an_outer_block_peaks_inside_an_inner_one():
    # The inner block's allocation and free are booked in one pass at its end: each open block takes the
    # pass's highest point from its own level (device: cpu).
    with gpukit.measure("cpu") as outer:
        a = torch.empty(1_000_000)              # +4,000,256
        with gpukit.measure("cpu") as inner:
            b = torch.empty(750_000)            # +3,000,320
            del b
        c = torch.empty(250_000)                # +1,000,448
        del c
    assert (inner.peak, inner.delta) == (3_000_320, 0)
    assert (outer.peak, outer.delta) == (4_000_256 + 3_000_320, 4_000_256)
    del a


def test_a_block_that_raises_restores_everything_and_reraises():
    resize = torch.UntypedStorage.resize_
    with pytest.raises(ZeroDivisionError):
        with gpukit.measure("cpu") as r:
            x = torch.empty(1000)
            1 / 0
    assert not LEDGER.active and torch.UntypedStorage.resize_ is resize
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    assert _get_current_dispatch_mode() is None
    assert r.delta == 4096  # filled in all the same...
    assert len(gpukit.history()) == 0  # ...but not recorded


def test_no_leak_over_20_measured_blocks():
    model = torch.nn.Linear(100, 100)
    x = torch.ones(32, 100)
    with gpukit.measure("cpu", record=False):  # the counter learns model and x
        pass
    gc.collect()
    before = (LEDGER.live, len(LEDGER.sizes))
    for _ in range(20):  # the counts must come back exactly: one leaked entry per block would show
        with gpukit.measure("cpu", record=False) as r:
            model(x).sum().backward()
        model.zero_grad(set_to_none=True)
    gc.collect()
    assert (LEDGER.live, len(LEDGER.sizes)) == before
    assert r.delta == round_up(100 * 100 * 4) + round_up(100 * 4)  # the grads that block made


def test_live_bytes_match_the_tensors_actually_alive():
    gc.collect()
    with gpukit.measure("cpu", record=False):
        pass
    start = LEDGER.live
    tensors = [torch.empty(n) for n in (10, 1000, 12345)]
    with gpukit.measure("cpu", record=False) as r:
        pass
    assert LEDGER.live - start == sum(t.nbytes for t in tensors)
    assert r.live_start == LEDGER.live_rounded


def test_history_and_last():
    with gpukit.measure("cpu", label="a"):
        x = torch.empty(256)
    with gpukit.measure("cpu", label="b", record=False):
        y = torch.empty(256)
    with gpukit.measure("cpu", label="c"):
        del x, y
    h = gpukit.history()
    assert list(h["label"]) == ["a", "c"]
    assert list(h["delta"]) == [1024, -2048]
    assert gpukit.last().label == "c"


def test_last_without_measurements_says_what_to_do():
    with pytest.raises(LookupError, match="%%gpumem"):
        gpukit.last()


@pytest.mark.parametrize("bad", ["mps", "tpu", "cuda:0" if not torch.cuda.is_available() else "cuda:99"])
def test_bad_devices_are_refused_with_a_clear_error(bad):
    with pytest.raises(ValueError, match="cpu|cuda|GPU"):
        gpukit.measure(bad)


def test_report_renders_as_text_and_html():
    with gpukit.measure("cpu", label="x") as r:
        t = torch.empty(1_000_000)
    text, page = repr(r), r._repr_html_()
    for s in (text, page):
        assert "4,000,256" in s and "4,000,000" in s and "cpu" in s
    assert page.startswith("<div") and "<table" in page
    assert "0x" not in text  # nothing that changes between runs
    del t


def test_swapping_tensors_still_works_after_a_measurement():
    # PyTorch refuses to swap tensors that have weak references (FSDP2 swaps DTensor parameters; so does
    # Module.to() with swap_module_params_on_conversion). The counter keeps none on such tensors.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(10)
        other = torch.empty(10)
        with gpukit.measure("cpu", record=False):
            pass
        torch.utils.swap_tensors(fake, other)


def test_a_test_that_leaves_the_device_out_fails_here_as_it_would_measure_the_gpu_there():
    # conftest.py makes gpukit's default device raise, so a forgotten device fails on this CPU machine.
    with pytest.raises(RuntimeError, match="name the device it measures"):
        gpukit.measure()
    with pytest.raises(RuntimeError, match="name the device it measures"):
        gpukit.budget("1GB")


@pytest.mark.uses_default_device
def test_the_default_device_is_the_current_gpu_when_there_is_one_else_the_cpu(monkeypatch):
    from gpukit.meter import default_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert default_device() == torch.device("cuda", 1)


@pytest.mark.parametrize("nbytes, low, high", [(1, 512, 512), (2**20, 2**20, 2**20),
                                               (2**20 + 1, 2**20 + 512, 2**21 + 512),
                                               (64 * 2**20, 64 * 2**20, 65 * 2**20)])
def test_cuda_counts_small_requests_exactly_and_large_ones_up_to_a_mib_more(nbytes, low, high):
    # c10/cuda/CUDACachingAllocator.cpp: kSmallSize = 1 MiB; a large block is split only if > 1 MiB remains.
    from gpukit.counter import cuda_allocated_range

    assert cuda_allocated_range(nbytes) == (low, high)


def test_history_is_bounded_by_default_and_can_keep_more():
    from gpukit.report import HISTORY_LIMIT, record

    try:
        for i in range(HISTORY_LIMIT + 5):
            record(gpukit.MemoryReport(label=f"step {i}"))
        h = gpukit.history()
        assert len(h) == HISTORY_LIMIT and h["label"].iloc[-1] == f"step {HISTORY_LIMIT + 4}"
        gpukit.keep_history(None)  # keep everything from now on
        for i in range(10):
            record(gpukit.MemoryReport(label="more"))
        assert len(gpukit.history()) == HISTORY_LIMIT + 10
        gpukit.keep_history(3)
        assert list(gpukit.history()["label"]) == ["more"] * 3
        with pytest.raises(ValueError, match="positive number of reports"):
            gpukit.keep_history(0)
    finally:
        gpukit.keep_history()


def test_a_report_is_found_by_its_label_and_a_missing_label_says_so():
    with gpukit.measure(device="cpu", label="first"):
        x = torch.empty(256)
    with gpukit.measure(device="cpu", label="second"):
        y = torch.empty(512)
    assert gpukit.last("first").delta == 1024 and gpukit.last("second").delta == 2048
    with pytest.raises(LookupError, match="no measurement labelled 'third'.*'first', 'second'"):
        gpukit.last("third")
    del x, y


def test_allocated_size_is_public_and_refuses_what_is_not_a_byte_count():
    import numpy as np

    assert gpukit.allocated_size(0) == 0 and gpukit.allocated_size(1) == 512 and gpukit.allocated_size(512) == 512
    assert gpukit.allocated_size(np.int64(513)) == 1024 and gpukit.allocated_size(torch.tensor(4).item()) == 512
    assert gpukit.allocated_size_range(2**20) == (2**20, 2**20)  # split to size up to 1 MiB
    assert gpukit.allocated_size_range(2**20 + 1) == (2**20 + 512, 2**21 + 512)
    for bad in (-1, 1.5, True, "512"):
        with pytest.raises(ValueError, match="non-negative number of bytes"):
            gpukit.allocated_size(bad)


def test_html_tables_escape_what_a_user_wrote():
    report = gpukit.MemoryReport(device="cpu", label="<script>x</script>", live_start=0, peak=1, delta=0, live_end=0)
    page = report._repr_html_()
    assert "<script>" not in page and "&lt;script&gt;" in page
    from gpukit.report import html_table

    table = html_table([("<b>", "1 < 2", "&")], columns=("a", "b", "c"))
    assert "<b>" not in table.replace("<tbody>", "") and "1 &lt; 2" in table and "&amp;" in table


# The counting mode queues each new storage; Ledger.settle books it, in order with the frees, before
# anything reads a count. These pin what the queue must keep exact.

def test_storages_made_and_freed_before_they_are_booked_give_the_exact_peak():
    """Device: cpu. Each storage dies before the next is made (their ids are taken again), all before the
    block reads a count: the peak is the largest one alone, the delta zero."""
    sizes = [1000, 70_000, 3, 4096, 12_345, 70_000]
    with gpukit.measure(device="cpu", record=False) as r:
        for n in sizes:
            t = torch.empty(n, dtype=torch.uint8)
            del t
    assert (r.peak, r.delta) == (round_up(70_000), 0)


def test_outputs_that_are_parameters_or_several_tensors_are_counted_once():
    """Device: cpu. The optimizer's in-place ops return the parameter itself (nothing new); ``max(dim=)``
    returns two new tensors."""
    p = torch.nn.Parameter(torch.ones(1000))
    x = torch.ones(300, 7)
    with gpukit.measure(device="cpu", record=False) as r:
        with torch.no_grad():
            assert p.add_(1) is p
        values, indices = torch.max(x, dim=0)
    assert r.delta == round_up(7 * 4) + round_up(7 * 8)


def test_a_storage_queued_twice_is_booked_once():
    """Device: cpu. A Ctrl-C between queueing a storage and filing it leaves it queued but unknown, so a
    later op queues it again: the second record must not count it twice (nor its free)."""
    from gpukit.counter.records import QUEUED, StorageRef

    with gpukit.measure(device="cpu", record=False) as r:
        t = torch.empty(1000)
        LEDGER.settle()
        st = t.untyped_storage()
        again = StorageRef(st, LEDGER._queue.append)
        again.key, again.nbytes, again.state = id(st), st.nbytes(), QUEUED
        LEDGER._queue.append(again)
        LEDGER.settle()
        assert LEDGER.live_rounded - r.live_start == round_up(4000)
        del t, st
    assert (r.peak, r.delta) == (round_up(4000), 0)


# -- torch.compile inside a measured CPU block --------------------------------------------------------------

def _dynamo_asks_each_mode():
    import torch._dynamo

    return getattr(torch._dynamo.config, "inline_torch_dispatch_torch_compile", False)


# Dynamo asks each mode on the stack (ignore_compile_internals) only where this option is on (the default of the
# torch this was written against, 2.13); elsewhere it reads a global flag and gpukit is not told.
asks_each_mode = pytest.mark.skipif(not _dynamo_asks_each_mode(),
                                    reason="this torch's dynamo does not ask the modes on the stack")


@pytest.fixture
def compiled_calls():
    """A torch.compile backend that records each graph it is given and each run of a compiled graph."""
    import torch._dynamo

    seen = {"compiled": 0, "ran": 0}

    def backend(gm, example_inputs):
        seen["compiled"] += 1

        def run(*args):
            seen["ran"] += 1
            return gm.forward(*args)
        return run

    torch._dynamo.reset()
    yield backend, seen
    torch._dynamo.reset()


@asks_each_mode
def test_torch_compile_runs_eagerly_in_a_cpu_block_and_warns_once_at_the_users_line(compiled_calls):
    import warnings

    backend, seen = compiled_calls
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))
    x = torch.randn(4, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gpukit.measure(device="cpu", record=False) as r:
            line = sys._getframe().f_lineno + 1
            y = torch.compile(model, backend=backend)(x)
            torch.compile(lambda t: t.sin().cos(), backend=backend)(x)
    assert seen == {"compiled": 0, "ran": 0}           # dynamo traced nothing: the ops ran eagerly
    assert torch.equal(y, model(x)) and r.peak > 0      # and were counted
    eager = [w for w in caught if w.category is gpukit.CompileRanEagerWarning]
    assert len(eager) == 1 and (eager[0].filename, eager[0].lineno) == (__file__, line)
    assert "eager program, not of the compiled graph" in str(eager[0].message)
    assert "on a GPU" in str(eager[0].message)


@asks_each_mode
def test_each_block_warns_of_torch_compile_once(compiled_calls):
    """A thread's counting mode is pushed again by its next block (not made anew): it still warns once a block."""
    import warnings

    backend, seen = compiled_calls
    f = torch.compile(lambda t: t.sin().cos(), backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with gpukit.measure(device="cpu", record=False):
                f(torch.ones(4))
                f(torch.ones(4))
    assert len([w for w in caught if w.category is gpukit.CompileRanEagerWarning]) == 2
    assert seen == {"compiled": 0, "ran": 0}


def test_the_counting_mode_runs_each_op_as_calling_it_does():
    """The counter calls an op's C++ entry point where the op's Python __call__ only forwards to it."""
    from gpukit._torch import op_entry_point

    add = torch.ops.aten.add.Tensor
    a, b = torch.arange(4.0), torch.ones(4)
    assert torch.equal(op_entry_point(add)(a, b, alpha=2), add(a, b, alpha=2))
    assert op_entry_point(torch.ops.aten.add) is torch.ops.aten.add  # not an OpOverload: called as itself
    with gpukit.measure(device="cpu", record=False) as r:
        c = torch.add(a, b, alpha=2)
    assert torch.equal(c, a + 2 * b) and r.peak == round_up(4 * 4)


def test_no_compile_warning_without_torch_compile_or_outside_a_block(compiled_calls):
    import warnings

    backend, seen = compiled_calls
    f = torch.compile(lambda t: t.sin().cos(), backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gpukit.measure(device="cpu", record=False):
            torch.ones(4).sin().cos()
        f(torch.ones(4))
    assert [w for w in caught if w.category is gpukit.CompileRanEagerWarning] == []
    assert seen == {"compiled": 1, "ran": 1}            # outside a block, torch.compile compiles as ever


@asks_each_mode
def test_after_a_block_torch_compile_compiles_the_code_it_ran_eagerly_in_it(compiled_calls):
    """Dynamo files a skip on the code of each frame it declines (ConvertFrameReturn's default, applied to the
    code): without gpukit undoing it at the block's end, every nn.Sequential compiled later would run eagerly."""
    backend, seen = compiled_calls
    x = torch.randn(4, 16)
    compiled = torch.compile(torch.nn.Sequential(torch.nn.Linear(16, 16)), backend=backend)
    compiled(x)
    assert seen == {"compiled": 1, "ran": 1}
    with pytest.warns(gpukit.CompileRanEagerWarning):
        with gpukit.measure(device="cpu", record=False):
            compiled(x)
            torch.compile(torch.nn.Sequential(torch.nn.Linear(16, 16)), backend=backend)(x)
    assert seen == {"compiled": 1, "ran": 1}
    compiled(x)                                                            # its compiled graph, again
    torch.compile(torch.nn.Sequential(torch.nn.Linear(16, 16)), backend=backend)(x)  # a new one: the same graph
    assert seen == {"compiled": 1, "ran": 3}                               # neither ran eagerly


def test_the_cpu_measured_under_fake_tensors_counts_what_they_would_hold():
    """Device: cpu, real and fake. A block of fake CPU tensors measures the bytes the same block takes for real
    (it measured nothing before); tensors on 'meta' beside them are not the CPU's."""
    from gpukit._torch import FakeTensorMode

    def block():
        model = torch.nn.Linear(64, 32)
        model(torch.randn(16, 64)).sum().backward()
        torch.empty(1000, device="meta")

    with gpukit.measure("cpu", record=False) as real:
        block()
    with FakeTensorMode(allow_non_fake_inputs=True), gpukit.measure("cpu", record=False) as fake:
        block()
    assert (fake.peak, fake.delta) == (real.peak, real.delta) and real.peak > 0
