"""How plan() ranks the recipes that fit, as a practitioner would: costs within the estimate's resolution are a tie
that PyTorch alone wins; a recipe many times slower than the fastest, or hungry for host memory, never silently
above LoRA; 16-bit weights without a float32 copy named for what they lose, and after autocast. Small transformers
models built from configs (nothing downloaded); plans for CUDA are predicted on this CPU's fake tensors."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch

from gpukit.cards import card
from gpukit.estimate import CONTEXT_ALLOWANCE
from gpukit.lessons.data import digit_tokens_batch
from gpukit.lessons.models import GPTConfig, TinyGPT
from gpukit.plan import DEFAULT_CARD, NEEDS, Candidate, Host, Techniques, plan
from gpukit.plan.candidates import LOST_UPDATES, NUMERICS_NAMES
from gpukit.step import resolve_loss
from test_plan_bounds import search_for

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
RANKING = sys.modules["gpukit.plan.ranking"]


def rows_by(p, **wanted):
    """The predicted rows whose candidate has the fields ``wanted`` (``optimizer=..., accumulate=...``)."""
    return [r for r in p.rows if r.need is not None
            and all(getattr(r.candidate, k) == v for k, v in wanted.items())]


# -- ties go to PyTorch alone -------------------------------------------------------------------------------------


def bert():
    # 1.2 M parameters: AdamW's state is 7 MB more than AdamW8bit's, several of the allocator's 2 MiB segments (at
    # 64 wide the difference, 1 MB, fell inside one segment once CUDA's dropout kept its 1-byte mask)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=128, hidden_size=256, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=512, max_position_embeddings=128, num_labels=2)
    return transformers.BertForSequenceClassification(config)


def sentences(n=16, length=128):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (n, length), generator=g)
    mask = torch.ones_like(ids)
    mask[::2, -32:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 2, (n,), generator=g)}


BERT = (bert, lambda p: torch.optim.AdamW(p), sentences)


def test_a_tie_in_cost_goes_to_plain_pytorch_adamw_before_bitsandbytes_8bit_adamw():
    """Device: none (a T4's rules, fake tensors). A BERT classifier on a T4, under the budget its AdamW8bit step needs:
    plain AdamW fits only with 2 micro-batches, estimated 1-2% dearer (the weights read again), which the estimate
    cannot resolve; AdamW with accumulation is chosen, and its ranking cell says why."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed here")
    search = search_for(BERT, "cuda", precisions=("float32",), checkpointing=False, loss=resolve_loss("model"),
                        card=card("t4"), allowance=CONTEXT_ALLOWANCE)
    eight = search.evaluate(Candidate("AdamW8bit (bitsandbytes)"))
    plain = search.evaluate(Candidate("yours: AdamW"))
    p = plan(*BERT, eight.need, card="t4", loss="model", alternatives=0, verify=False, techniques=Techniques(
        precisions=("float32",), accumulate=[1, 2], checkpointing=False, offload=False, lora=False))
    choice = p.choice
    assert plain.need > p.budget  # the premise: AdamW alone does not fit, its 8-bit version does...
    assert choice.candidate.optimizer == "yours: AdamW" and choice.candidate.accumulate == 2
    fitting8 = rows_by(p, optimizer="AdamW8bit (bitsandbytes)", accumulate=1)[0]
    assert fitting8.fits and fitting8.slowdown < choice.slowdown <= fitting8.slowdown * (1 + RANKING.TIE)  # ...cheaper
    assert choice.libraries == () and fitting8.libraries == ("bitsandbytes",)
    assert choice.ranking == (f"before plain [AdamW8bit (bitsandbytes)], whose cost is within 5%: PyTorch alone "
                              f"first")
    cells = choice.cells(p.budget, p.device)
    assert cells["libraries"] == "PyTorch" and fitting8.cells(p.budget, p.device)["libraries"] == \
        "PyTorch + bitsandbytes"


# -- slow or host-hungry recipes never silently above LoRA -------------------------------------------------------


def llama():
    torch.manual_seed(0)  # 1.2 M parameters and a batch of 16 tokens: the model state is the step's memory
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def text_batch(n=1, length=16):
    ids = torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def llama_plan(budget, **options):
    kwargs = dict(device="cuda", card=replace(DEFAULT_CARD, context_allowance=0), loss="model", verify=False,
                  techniques=Techniques(precisions=("float32",), accumulate=[1], checkpointing=False, offload=False))
    kwargs.update(options)
    return plan(llama, lambda p: torch.optim.AdamW(p), text_batch, budget, **kwargs)


@pytest.fixture(scope="module")
def host_and_lora():
    """A budget where LoRA and the optimizer's state on the host (torchao's, gradients too) fit, the larger of their
    needs; every other full fine-tune needs more (AdamW8bit stepped in backward the least: 2 MiB more)."""
    pytest.importorskip("torchao.optim", reason="torchao is not installed here")
    search = search_for((llama, lambda p: torch.optim.AdamW(p), text_batch), "cuda", precisions=("float32",),
                        accumulate=[1], checkpointing=False, loss=resolve_loss("model"), lora=True)
    host = "AdamW on the host, gradients too (torchao CPUOffloadOptimizer)"
    return max(search.evaluate(Candidate(host)).need,
               search.evaluate(Candidate("yours: AdamW, foreach=False", lora=True)).need)


def test_a_recipe_many_times_slower_than_lora_ranks_after_it_and_says_why(host_and_lora):
    """Device: none (an H100's rules, fake tensors). The host's optimizer fits, tens of times slower than the
    LoRA step (a copy of every weight and gradient over PCIe, a CPU step, for a GPU step of 16 tokens): LoRA is
    chosen, and the host's row says why it comes after; LoRA's numerics say it trains another model."""
    p = llama_plan(host_and_lora, alternatives=3)
    assert p.choice.candidate.lora and not p.choice.candidate.qlora
    assert p.choice.cells(p.budget, p.device)["numerics"].startswith("a different model: ")
    fitting = [r for r in p.rows if r.fits and r.need is not None]
    host = [r for r in fitting if "on the host" in r.candidate.optimizer]
    assert host and all(fitting.index(r) > fitting.index(p.choice) for r in host)
    for r in host:
        assert r.slowdown > RANKING.SLOW * max(p.choice.slowdown, 1.0)
        assert r.ranking.startswith("after every recipe that is not slow or hungry for host memory: ")
        assert f"the fastest fitting recipe's cost (over {RANKING.SLOW:g}x)" in r.ranking
    assert RANKING.TYPICAL_HOST_MEMORY == 12_700_000_000  # Colab's host, when the plan is told of none


def test_a_recipe_that_needs_more_host_memory_than_a_typical_host_ranks_after_lora(host_and_lora, monkeypatch):
    """Device: none. The same plan, its host optimizer's speed not counted against it (a slowness factor too large
    to matter): on a host smaller than its host peak (the typical host taken at 1 MB here) it still comes after
    LoRA, saying why; told that the host has enough (``Host.memory``), it comes first, as the only full fine-tune."""
    monkeypatch.setattr(RANKING, "SLOW", 1e9)
    monkeypatch.setattr(RANKING, "TYPICAL_HOST_MEMORY", 10**6)
    small = llama_plan(host_and_lora, alternatives=1)
    assert small.choice.candidate.lora
    host = [r for r in small.rows if r.fits and r.need is not None and "on the host" in r.candidate.optimizer]
    assert host and all(r.host_peak > 10**6 for r in host)
    for r in host:
        assert "over the 976.56 KiB of Colab's host, a typical one; plan(host=Host(memory=...)) says yours" \
            in r.ranking
    roomy = llama_plan(host_and_lora, alternatives=0, host=Host(memory="1GB"))
    assert "on the host" in roomy.choice.candidate.optimizer and roomy.choice.ranking == ""


# -- 16-bit weights without a float32 copy ------------------------------------------------------------------------


def gpt_case(batch: int = 32):
    x, y = digit_tokens_batch(batch)
    return (lambda: TinyGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2))), (lambda: (x.clone(), y.clone()))


@pytest.mark.parametrize("precision, amp, bits, optimizer", [
    ("bf16 weights", "bf16", 8, lambda p: torch.optim.AdamW(p)),
    ("half", "fp16", 11, lambda p: torch.optim.SGD(p, lr=0.1)),  # (half is tried with optimizers without an eps)
])
def test_sixteen_bit_weights_say_small_updates_are_lost_and_rank_after_autocast(precision, amp, bits, optimizer):
    """Device: cpu. Weights stored in bfloat16 (float16) with no float32 copy lose every update below 2^-8 (2^-11)
    of the weight: their numerics say so and name the remedies, and where autocast fits too, autocast ranks first,
    although the 16-bit weights need less memory at the same estimated cost (the order the plan gave before)."""
    make_model, make_batch = gpt_case()
    p = plan(make_model, optimizer, make_batch, "1GB", device="cpu", alternatives=3, verify=False,
             techniques=Techniques(precisions=(amp, precision), accumulate=[1], checkpointing=False,
                                   implementations=False, lora=False))
    weights, autocast = rows_by(p, precision=precision)[0], rows_by(p, precision=amp)[0]
    assert weights.fits and autocast.fits and weights.need < autocast.need and weights.slowdown == autocast.slowdown
    assert p.choice is autocast and p.rows.index(weights) > p.rows.index(autocast)
    assert autocast.ranking == "" and weights.ranking.startswith(  # its place is not its cost's: it says why
        "the whole model trained, its training changed (16-bit weights without a float32 copy lose small updates")
    assert f"such as {autocast.candidate.label} [{autocast.candidate.optimizer}], whose cost is not lower" \
        in weights.ranking
    assert weights.numerics == LOST_UPDATES and NUMERICS_NAMES[LOST_UPDATES] == "small updates lost"
    cell = weights.cells(p.budget, p.device)["numerics"]
    assert cell.startswith(f"small updates lost: ") and f"an update below 2^-{bits} of its weight is lost" in cell
    assert f"has {bits} significant bits" in cell and "float32 master weights under autocast" in cell
    if precision == "bf16 weights":
        assert "torchao.optim.AdamW8bit(..., bf16_stochastic_round=True)" in cell and "torchao.optim._AdamW" in cell


def test_torchaos_stochastic_rounding_is_where_the_note_says():
    """Device: cpu. The remedy the bfloat16 weights' note names exists in the torchao installed here."""
    optim = pytest.importorskip("torchao.optim", reason="torchao is not installed here")
    import inspect

    for name in ("AdamW8bit", "_AdamW"):
        assert "bf16_stochastic_round" in inspect.signature(getattr(optim, name)).parameters


# -- the table's columns ------------------------------------------------------------------------------------------


def test_the_columns_say_what_they_hold_on_each_device():
    """Device: cpu and cuda plans (fake tensors). A CUDA plan's need is reserved memory plus the context
    allowance, a CPU plan's the allocated peak: the column and the head line say which; the budget minus it, the
    step times and the libraries have columns named for them."""
    make_model, make_batch = gpt_case(8)
    for device, column in (("cpu", "needs (allocated at peak)"), ("cuda", "needs (reserved + context)")):
        p = plan(make_model, lambda q: torch.optim.AdamW(q), make_batch, "10GB", device=device, alternatives=0,
                 verify=False, techniques=Techniques(precisions=("float32",), accumulate=[1], checkpointing=False,
                                                     implementations=False, lora=False))
        frame = p.frame()
        assert NEEDS[device] == column and list(frame.columns) == [
            "techniques", "optimizer", "verdict", column, "budget - needs", "step time, estimated (x plain step)",
            "step time, measured (x plain step)", "numerics", "libraries", "ranking", "how needs were found"]
        row = p.choice
        cells = row.cells(p.budget, device)
        assert cells[column] == frame[column][0] and cells["budget - needs"] != "-"
        head = repr(p).splitlines()[0]
        assert f"{column} = " in head
        if device == "cuda":
            assert row.need == row.reserved + p.allowance and "context allowance" in head
        else:
            assert row.need == row.peak and "allocated at the peak" in head
