"""gpukit.SimulatedCuda and on_card: torch.cuda's memory calls answered on a CPU, snapshots memory_viz reads, and a
block run at a card's sizes on fake tensors. Device: cpu, every test (the simulated card stands for a CUDA one)."""

from __future__ import annotations

import inspect
import pickle
import re

import pytest
import torch

import gpukit
from gpukit.allocator import CachingAllocator, cpu_device
from gpukit.cards import card
from gpukit.counter import LEDGER, allocated_size
from gpukit.lessons.claims import ClaimFailed, claim, measured_on
from gpukit.oncard import on_card
from gpukit.simulated import SimulatedCuda, simulated_cuda

MiB = 2**20


@pytest.fixture
def cuda():
    c = SimulatedCuda("t4")
    yield c
    c.close()


def test_tensors_made_after_the_card_are_on_it_and_those_before_are_the_hosts(cuda):
    """Device: cpu (a simulated T4). Allocated bytes are the allocator's blocks: a small tensor's bytes rounded to
    512, exactly; a tensor that existed before the card is not on it, and its death changes nothing."""
    assert cuda.memory_allocated() == 0 and cuda.memory_reserved() == 0
    a = torch.empty(1000)                                   # 4,000 B -> one 4,096 B block
    assert cuda.memory_allocated() == allocated_size(4000) == 4096
    assert cuda.memory_reserved() == 2 * MiB                # the small pool's first segment
    b = torch.empty(3 * MiB // 4)                           # 3 MiB: a 20 MiB segment of the large pool, split
    assert cuda.memory_allocated() == 4096 + 3 * MiB
    assert cuda.memory_reserved() == 22 * MiB
    del a
    assert cuda.memory_allocated() == 3 * MiB and cuda.memory_reserved() == 22 * MiB  # the block stays cached
    cuda.empty_cache()
    assert cuda.memory_reserved() == 20 * MiB                # the empty small segment went back to the driver
    assert cuda.max_memory_allocated() == 4096 + 3 * MiB
    cuda.reset_peak_memory_stats()
    assert cuda.max_memory_allocated() == 3 * MiB
    del b
    free, total = cuda.mem_get_info()
    assert total == card("t4").torch_total_memory and free == total - cuda.memory_reserved() - 2**30


def test_a_tensor_of_the_host_is_not_placed():
    """Device: cpu. Data loaded before the card exists is the host's, as a data set in host memory is on a GPU."""
    data = torch.randn(256, 256)
    c = SimulatedCuda("t4")
    try:
        assert c.memory_allocated() == 0
        x = data[:10] * 2  # a new tensor: on the card
        assert c.memory_allocated() == allocated_size(10 * 256 * 4)
        del data
        assert c.memory_allocated() == allocated_size(10 * 256 * 4)
        del x
    finally:
        c.close()


def test_a_tensor_another_thread_makes_is_the_hosts(cuda):
    """Device: cpu. The card holds what the thread that made it runs: a tensor made by another thread (a
    DataLoader's pin-memory thread, a widget's callback) is the host's and never placed, alive or freed."""
    import threading

    made = []
    worker = threading.Thread(target=lambda: made.append(torch.empty(256, 256)))
    worker.start()
    worker.join()
    assert made[0].numel() == 256 * 256 and cuda.memory_allocated() == 0
    here = torch.empty(256, 256)                            # this thread's: on the card
    assert cuda.memory_allocated() == 256 * 256 * 4
    made.clear()
    assert cuda.memory_allocated() == 256 * 256 * 4
    del here


def test_a_training_step_peak_is_the_one_measure_reports(cuda):
    """Device: cpu. The card's peak over a step is the CPU counter's (measure()) over the same step, from the same
    start: both count each tensor's block."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    step()
    start = cuda.memory_allocated()
    cuda.reset_peak_memory_stats()
    with gpukit.measure("cpu", record=False) as report:
        step()
    assert cuda.max_memory_allocated() == start + report.peak
    assert cuda.memory_allocated() == start + report.delta == start


def test_the_summary_names_the_simulated_card_and_fits_a_screen(cuda):
    """Device: cpu. memory_summary() is torch's table, titled with the simulated card; abbreviated, under 30 lines."""
    keep = torch.empty(1024)
    text = cuda.memory_summary(abbreviated=True)
    lines = text.splitlines()
    assert "simulated T4" in lines[1] and len(lines) <= 30
    assert len({len(line) for line in lines}) == 1  # the frame stays whole
    assert "Allocated memory" in text
    del keep


def test_the_out_of_memory_error_says_it_is_simulated(cuda):
    """Device: cpu. A block that needs more than a T4 holds fails with CUDA's message, marked as simulated."""
    with pytest.raises(torch.OutOfMemoryError) as err:
        with on_card(cuda):
            x = torch.empty(16 * 2**30, dtype=torch.uint8)  # 16 GiB, more than the T4's 14.58 GiB
            del x
    text = str(err.value)
    assert text.startswith("[a simulated NVIDIA T4") and "no GPU ran this" in text
    assert "CUDA out of memory. Tried to allocate 16.00 GiB. GPU 0 has a total capacity of 14.58 GiB" in text
    assert cuda.memory_allocated() == 0  # the block's tensors left the card with it
    assert cuda.memory_stats()["num_ooms"] == 1


def test_on_card_places_a_step_as_predict_does(cuda):
    """Device: cpu (a simulated T4, fake tensors). A steady training step run in on_card reaches the peak
    predict(card="t4") gives for it: the same step on the same fake tensors, under the same CUDA rules, counted in
    the allocator's blocks (all under 1 MiB here, so rounded to 512 as the counter rounds)."""
    from gpukit.estimate import default_step, predict

    make_model = lambda: torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    make_opt = lambda p: torch.optim.Adam(p)
    make_batch = lambda: (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    predicted = predict(make_model, make_opt, make_batch, card="t4")
    with on_card(cuda) as run:
        model = make_model()
        opt = make_opt(model.parameters())
        batch = make_batch()
        default_step(model, opt, batch)  # the warm-up predict runs too
        cuda.reset_peak_memory_stats()
        default_step(model, opt, batch)
    assert run.simulated and run.made_up == {}
    assert cuda.max_memory_allocated() == predicted.peak
    assert predicted.workspaces > 0  # the cuBLAS workspaces of both threads are part of both
    assert cuda.memory_allocated() == 0


def test_a_prediction_inside_a_card_run_is_refused_by_name_and_one_on_another_thread_waits_for_it(cuda):
    """Device: cpu (a simulated T4, fake tensors). predict(), predict_offload() and plan() inside an on_card() block
    are refused, naming themselves, and the block goes on as before; on_card() inside a prediction's step too. A
    prediction on another thread waits for the block to end, then gives what it gives alone."""
    import threading

    from gpukit.estimate import predict
    from gpukit.offload import predict_offload

    make_model = lambda: torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    make_opt = lambda p: torch.optim.Adam(p)
    make_batch = lambda: (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    alone = predict(make_model, make_opt, make_batch, card="t4").peak
    got = {}
    other = threading.Thread(target=lambda: got.update(peak=predict(make_model, make_opt, make_batch, card="t4").peak))
    with on_card(cuda):
        x = torch.ones(1024, 1024)
        other.start()
        for what, call in (("predict()", lambda: predict(make_model, make_opt, make_batch, card="t4")),
                           ("predict_offload()", lambda: predict_offload(make_model, make_opt, make_batch)),
                           ("plan()", lambda: gpukit.plan(make_model, make_opt, make_batch, "4GB", verify=False))):
            with pytest.raises(RuntimeError, match=rf"^{re.escape(what)} cannot run inside an on_card\(\) block"):
                call()
        other.join(timeout=0.5)
        assert other.is_alive() and not got  # waiting for the block to end
        assert cuda.memory_allocated() == 4 * 2**20 and (x + 1).shape == x.shape  # the block goes on
    other.join(timeout=60)
    assert got == {"peak": alone}

    def step(model, optimizer, batch):
        with on_card(cuda):
            pass

    with pytest.raises(RuntimeError, match=r"on_card\(\) cannot run inside predict\(\)"):
        predict(make_model, make_opt, make_batch, step, card="t4")
    assert predict(make_model, make_opt, make_batch, card="t4").peak == alone


def test_inside_a_card_run_the_card_is_read_up_to_date(cuda):
    """Device: cpu (a simulated T4, fake tensors). A fake tensor deleted inside on_card() has left the card when the
    next line reads it, as on a GPU: memory_allocated() right after a `del` is the smaller figure."""
    with on_card(cuda):
        x = torch.empty(2**20)                                  # 4 MiB
        assert cuda.memory_allocated() == 4 * MiB
        del x
        assert cuda.memory_allocated() == 0
        assert cuda.max_memory_allocated() == 4 * MiB


def test_a_card_run_with_a_host_places_only_the_gpus_side(cuda):
    """Device: cpu (a simulated T4; its GPU side on meta, the host the CPU, all fake). A layer kept on the host and the
    batch made there are not on the card; what moves to meta is, labels included (their values, which a meta tensor
    does not hold, are not read); the host's half-gigabyte table is nowhere in the card's figures."""
    gpu = torch.device("meta")
    with on_card(cuda, gpu=gpu):
        table = torch.nn.EmbeddingBag(2**19, 256, mode="mean")          # 512 MiB, on the host
        net = torch.nn.Linear(256, 10).to(gpu)
        ids, labels = torch.randint(2**19, (64, 8)), torch.randint(10, (64,))
        on_card_before = cuda.memory_allocated()
        loss = torch.nn.functional.cross_entropy(net(table(ids).to(gpu)), labels.to(gpu))
        loss.backward()
        assert table.weight.grad.device.type == "cpu" and net.weight.grad.device.type == "meta"
        del loss
        peak = cuda.max_memory_allocated()
    assert on_card_before == allocated_size(256 * 10 * 4) + allocated_size(10 * 4)   # the Linear's weights only
    assert 0 < peak < 64 * MiB and cuda.memory_allocated() == 0    # the Linear's step and cuBLAS's workspaces
    with pytest.raises(ValueError, match="'cpu' or 'meta'"):
        with on_card(cuda, gpu="cuda"):
            pass


def test_a_card_run_with_a_host_runs_the_cards_kernels_on_its_gpu_side(cuda):
    """Device: cpu (a simulated T4; its GPU side on meta). On meta PyTorch itself takes the math attention, which keeps
    the (batch, heads, queries, keys) matrix for backward; a T4 takes the memory-efficient kernel, which does not.
    The step's peak on the card is the same whether the GPU side stands on the CPU or on meta: to the byte."""
    def step(device):
        cuda.empty_cache()
        with on_card(cuda, gpu=device):
            qkv = torch.nn.Linear(64, 3 * 64).to(device)
            opt = torch.optim.AdamW(qkv.parameters(), fused=True)   # fused: meta is no fused device to torch
            x = torch.randn(8, 512, 64, device=device)
            cuda.reset_peak_memory_stats()
            q, k, v = qkv(x).view(8, 512, 3, 4, 16).permute(2, 0, 3, 1, 4)      # (batch, 4 heads, queries, 16)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
            out.sum().backward()
            opt.step()
            return cuda.max_memory_allocated()

    matrix = 8 * 4 * 512 * 512 * 4                    # the float32 (batch, heads, queries, keys) matrix
    on_cpu, on_meta = step("cpu"), step("meta")
    assert on_meta == on_cpu < matrix, (on_cpu, on_meta, matrix)


def test_values_read_inside_a_card_run_are_made_up_and_counted(cuda):
    """Device: cpu. loss.item() on fake tensors reads a healthy step's value, and the run says how many were."""
    with on_card(cuda) as run:
        loss = torch.randn(8, 8).square().mean()
        value = loss.item()
    assert value == 0.0 and run.made_up == {"float": 1}
    assert "made up" in repr(run)


def test_on_card_with_torch_cuda_runs_the_block_for_real():
    """Device: cpu. Given torch.cuda (what a GPU machine passes), the block runs as written: real tensors."""
    with on_card(torch.cuda) as run:
        x = torch.ones(3) * 2
    assert not run.simulated and x.sum().item() == 6.0


def test_bad_arguments_are_refused_with_what_is_allowed(cuda):
    """Device: cpu."""
    with pytest.raises(ValueError, match="device 0"):
        cuda.memory_allocated("cuda:1")
    with pytest.raises(ValueError, match="device 0"):
        cuda.max_memory_allocated("cpu")
    with pytest.raises(ValueError, match="'all', 'state' or None"):
        cuda.memory._record_memory_history("everything")
    with pytest.raises(ValueError, match="max_entries"):
        cuda.memory._record_memory_history(max_entries=0)
    with pytest.raises(TypeError, match="torch.cuda .* or a gpukit.SimulatedCuda"):
        with on_card("t4"):
            pass
    with pytest.raises(ValueError, match="t4"):
        SimulatedCuda("no such card")
    with pytest.raises(TypeError):
        SimulatedCuda(16)


def test_a_new_card_replaces_the_old_one_which_then_refuses_calls():
    """Device: cpu. One simulated card per process, as one CUDA device 0."""
    first = SimulatedCuda("t4")
    second = SimulatedCuda("h100")
    try:
        assert simulated_cuda() is second and cpu_device() is second._device
        with pytest.raises(RuntimeError, match="replaced"):
            first.memory_allocated()
        assert second.get_device_properties().total_memory == card("h100").torch_total_memory or \
            second.get_device_properties().total_memory == card("h100").memory_bytes
    finally:
        second.close()
    assert simulated_cuda() is None and not LEDGER.active
    assert cpu_device() is not second._device


def test_a_snapshot_written_here_opens_in_pytorchs_memory_viz(cuda, tmp_path):
    """Device: cpu. _dump_snapshot writes torch's pickle: torch.cuda._memory_viz reads it (its text views and the
    HTML page memory_viz opens), every live block's frames point at the line that made it, and each free follows an
    allocation of the same block."""
    from torch.cuda import _memory_viz

    cuda.memory._record_memory_history(max_entries=10_000)
    model = torch.nn.Linear(32, 32)
    line = inspect.currentframe().f_lineno + 1
    out = model(torch.randn(16, 32))
    loss = out.sum()
    loss.backward()
    path = tmp_path / "step.pickle"
    cuda.memory._dump_snapshot(str(path))
    cuda.memory._record_memory_history(enabled=None)
    snap = pickle.loads(path.read_bytes())
    events = snap["device_traces"][0]
    assert events and {e["action"] for e in events} >= {"alloc", "free_requested", "free_completed",
                                                          "segment_alloc"}
    for e in events:  # the fields memory_viz reads of each event
        assert {"action", "addr", "size", "stream", "frames"} <= set(e)
    allocated = set()
    for e in events:
        if e["action"] == "alloc":
            allocated.add(e["addr"])
        elif e["action"] == "free_completed":
            assert e["addr"] in allocated
            allocated.discard(e["addr"])
    live = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert sum(b["size"] for b in live) == cuda.memory_allocated()
    made_here = [b for b in live if any(f["filename"] == __file__ and f["line"] == line for f in b["frames"])]
    assert [b["requested_size"] for b in made_here] == [out.untyped_storage().nbytes()]  # the output, still live
    assert all(f["filename"] != gpukit.simulated.__file__ for b in live for f in b["frames"])
    assert "Summary of segments" in _memory_viz.segsum(snap)
    assert "entries" in _memory_viz.trace(snap)
    assert "snapshot.pickle" in _memory_viz.trace_plot(snap)
    # The flame graphs' lines (memory_viz's own formatter downloads flamegraph.pl: the lines are kept instead).
    flame = _memory_viz.memory(snap, format_flamegraph=lambda lines: lines)
    assert f"test_simulated.py:{line}:" in flame


def test_recording_keeps_the_last_entries_and_stops(cuda):
    """Device: cpu. max_entries keeps the newest events, as PyTorch's ring buffer; enabled=None stops recording."""
    cuda.memory._record_memory_history(max_entries=4)
    xs = [torch.empty(100) for _ in range(5)]
    events = cuda.memory._snapshot()["device_traces"][0]
    assert len(events) == 4 and all(e["action"] == "alloc" for e in events)
    cuda.memory._record_memory_history(enabled=None)
    del xs
    assert cuda.memory._snapshot()["device_traces"][0] == []


def test_the_timeline_plot_draws_the_snapshot_peak(cuda):
    """Device: cpu. gpukit.plots.snapshot_timeline's peak is the largest sum of live allocations along the trace."""
    import matplotlib

    matplotlib.use("Agg")
    from gpukit.plots import snapshot_timeline

    cuda.memory._record_memory_history()
    a = torch.empty(1000)
    b = torch.empty(3000)
    del a
    c = torch.empty(500)
    snap = cuda.memory._snapshot()
    cuda.memory._record_memory_history(enabled=None)
    ax = snapshot_timeline(snap)
    assert "12.00 KiB" not in ax.get_legend().get_texts()[0].get_text()
    assert "15.62 KiB" in ax.get_legend().get_texts()[0].get_text()  # 4,000 + 12,000 B live together
    del b, c
    with pytest.raises(ValueError, match="_record_memory_history"):
        snapshot_timeline({"segments": [], "device_traces": [[]]})


def test_the_timeline_plot_draws_the_allocations_it_summarizes(cuda):
    """Device: cpu. Past max_elements the smaller allocations are one grey band on top of the largest ones, as
    memory_viz draws them: the drawn areas reach the peak, and a step made of small allocations alone is not blank."""
    import matplotlib

    matplotlib.use("Agg")
    from gpukit.plots import snapshot_timeline

    cuda.memory._record_memory_history()
    big = torch.empty(4000)
    small = [torch.empty(1000) for _ in range(3)]  # 4,000 B each: summarized beside the 16,000 B one
    snap = cuda.memory._snapshot()
    cuda.memory._record_memory_history(enabled=None)
    ax = snapshot_timeline(snap, max_elements=1)
    top = max(path.vertices[:, 1].max() for c in ax.collections for path in c.get_paths())
    assert "27.34 KiB" in ax.get_legend().get_texts()[0].get_text()  # 16,000 + 3 x 4,000 B live together
    assert top * 1024 == pytest.approx(28_000)
    del big, small


def test_claims_print_a_sentence_or_fail_naming_the_claim(capsys, cuda, monkeypatch):
    """Device: cpu; torch.cuda answers as on a machine without a GPU (on one it names the GPU: the next test)."""
    claim(2 > 1, "two is more than one")
    assert capsys.readouterr().out == "✓ two is more than one\n"
    with pytest.raises(ClaimFailed, match="one is more than two"):
        claim(1 > 2, "one is more than two")
    with pytest.raises(TypeError):
        claim(True, 3)
    assert "simulated for an NVIDIA T4 on this CPU" in measured_on(cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no GPU" in measured_on(torch.cuda)


def test_a_gpu_is_named_as_torch_names_it(monkeypatch):
    """Device: cpu; a T4 stood in for by torch.cuda's answers. Its name as torch gives it ("Tesla T4"), in brackets:
    no article to get wrong."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    assert measured_on(torch.cuda) == "measured on this GPU (Tesla T4)"
    with pytest.raises(TypeError):
        measured_on("cuda")


def test_dropout_in_a_card_run_keeps_the_fused_kernels_bool_mask_and_on_the_cpu_the_noise(cuda):
    """Device: cpu (a simulated T4: a block of fake tensors in on_card, then the same lines on real CPU tensors placed
    on it). On the card F.dropout in training takes CUDA's fused native_dropout (aten/src/ATen/native/Dropout.cpp,
    is_fused_kernel_acceptable): its output and a bool mask, kept for backward, 1 byte an element. The CPU runs the
    composite: its output and a float32 noise tensor, 4 bytes an element. What the call leaves allocated says which."""
    n = 2**20

    def dropout_leaves():
        h = torch.randn(n, requires_grad=True)
        before = cuda.memory_allocated()
        out = torch.nn.functional.dropout(h, 0.1)
        grown = cuda.memory_allocated() - before
        del out
        return grown

    with on_card(cuda):
        on_card_run = dropout_leaves()
    assert on_card_run == n * 4 + n * 1
    assert dropout_leaves() == n * 4 + n * 4
