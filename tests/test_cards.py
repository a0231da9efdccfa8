"""gpukit.cards: the GPU cards' figures, each with its source, and looking a card up by name.

Device: none, data only (no GPU is used or pretended)."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from gpukit.cards import CARDS, FIGURES, Card, card

ROOT = Path(__file__).resolve().parent.parent
KEYS = ["t4", "l4", "a10g", "a100-40gb", "a100-80gb", "h100", "h200"]
DATA_SHEET_FIGURES = [f for f in FIGURES if f != "torch_total_memory"]  # torch's figure is no data sheet's


def test_the_cards_are_the_seven_keyed_by_their_lower_case_keys():
    assert list(CARDS) == KEYS
    for key, c in CARDS.items():
        assert c.key == key == key.lower()


@pytest.mark.parametrize("key", KEYS)
def test_every_card_has_every_field_and_each_figure_its_source(key):
    c = CARDS[key]
    assert set(FIGURES) <= {f.name for f in dataclasses.fields(Card)}
    for f in dataclasses.fields(Card):
        assert hasattr(c, f.name)
    for text in (c.name, c.memory_text, c.bandwidth_text):
        assert isinstance(text, str) and text
    for figure in DATA_SHEET_FIGURES:
        if getattr(c, figure) is not None:
            assert c.sources[figure].startswith("https://"), f"{key}.{figure}: its source is a URL"
    # the figures the cards all have
    for figure in ("memory_bytes", "memory_bandwidth", "compute_capability", "fp16_tflops", "fp32_tflops"):
        assert getattr(c, figure) is not None, f"{key}.{figure}"
    if c.torch_total_memory is not None:
        assert c.sources["torch_total_memory"]
    assert set(c.sources) <= set(FIGURES), "sources are keyed by figure field"


def test_sources_are_read_only_and_not_part_of_equality():
    t4 = card("t4")
    with pytest.raises(TypeError):
        t4.sources["fp32_tflops"] = "elsewhere"
    with pytest.raises(dataclasses.FrozenInstanceError):
        t4.fp32_tflops = 1.0
    assert hash(t4) == hash(dataclasses.replace(t4, sources={}))


@pytest.mark.parametrize("key", KEYS)
def test_the_marketed_strings_give_the_figures_in_si_units(key):
    """memory_bytes is the sheet's GB read as 10**9 bytes; memory_bandwidth its GB/s or TB/s as SI."""
    c = CARDS[key]
    gigabytes = re.match(r"([\d.]+)\s*GB\b", c.memory_text)
    assert gigabytes, c.memory_text
    assert c.memory_bytes == int(gigabytes[1]) * 10**9
    rate = re.match(r"([\d,.]+)\+?\s*(GB|TB)/s", c.bandwidth_text)
    assert rate, c.bandwidth_text
    assert c.memory_bandwidth == pytest.approx(float(rate[1].replace(",", "")) * {"GB": 1e9, "TB": 1e12}[rate[2]])


@pytest.mark.parametrize("key", KEYS)
def test_bf16_tensor_cores_exactly_from_compute_capability_8_0(key):
    c = CARDS[key]
    assert c.bf16_tensor_cores == (c.compute_capability >= (8, 0))
    assert (c.bf16_tflops is not None) == c.bf16_tensor_cores
    assert (torch.bfloat16 in c.fast_dtypes()) == c.bf16_tensor_cores
    assert torch.float16 in c.fast_dtypes()
    assert torch.float32 not in c.fast_dtypes()


def test_the_t4_has_no_bf16_tensor_cores_and_no_fused_bf16_attention():
    t4 = card("T4")
    assert t4.compute_capability == (7, 5)
    assert not t4.bf16_tensor_cores
    assert t4.bf16_tflops is None and t4.bf16_sparse_tflops is None
    assert t4.fast_dtypes() == (torch.float16,)
    assert not t4.flash_attention
    assert t4.efficient_attention_dtypes == (torch.float16, torch.float32)


@pytest.mark.parametrize("key", ["l4", "a10g", "a100-40gb", "a100-80gb", "h100", "h200"])
def test_sm80_and_later_have_flash_attention_and_bf16_efficient_attention(key):
    c = CARDS[key]
    assert c.flash_attention
    assert set(c.efficient_attention_dtypes) == {torch.float16, torch.float32, torch.bfloat16}
    assert c.fast_dtypes() == (torch.bfloat16, torch.float16)


def test_attention_follows_the_compute_capability_bounds_not_the_card():
    """sdp_utils.cpp: flash from sm80, memory-efficient from sm50 (bfloat16 from sm80); both up to sm121."""
    t4 = card("t4")
    assert not dataclasses.replace(t4, compute_capability=(7, 0)).flash_attention
    assert dataclasses.replace(t4, compute_capability=(8, 0)).flash_attention
    assert dataclasses.replace(t4, compute_capability=(12, 1)).flash_attention
    assert not dataclasses.replace(t4, compute_capability=(13, 0)).flash_attention
    assert dataclasses.replace(t4, compute_capability=(3, 7)).efficient_attention_dtypes == ()
    assert dataclasses.replace(t4, compute_capability=(6, 1)).fast_dtypes() == ()


@pytest.mark.parametrize("key", KEYS)
def test_dense_tflops_are_below_the_sparse_figures(key):
    c = CARDS[key]
    for dense, sparse in ((c.fp16_tflops, c.fp16_sparse_tflops), (c.bf16_tflops, c.bf16_sparse_tflops)):
        if sparse is not None:
            assert dense is not None and dense < sparse
            assert dense == pytest.approx(sparse / 2), "2:4 sparsity doubles the dense figure"


@pytest.mark.parametrize("key", KEYS)
def test_tensor_cores_outrun_fp32(key):
    c = CARDS[key]
    assert c.fp16_tflops > c.fp32_tflops
    if c.bf16_tflops is not None:
        assert c.bf16_tflops == c.fp16_tflops


def test_figures_agree_with_each_other():
    t4, l4, a10g, a40, a80, h100, h200 = (CARDS[k] for k in KEYS)
    assert h200.memory_bytes > h100.memory_bytes == a80.memory_bytes > a40.memory_bytes
    assert h200.memory_bandwidth > h100.memory_bandwidth > a80.memory_bandwidth > a40.memory_bandwidth
    assert a10g.memory_bandwidth > t4.memory_bandwidth and a10g.memory_bandwidth > l4.memory_bandwidth
    assert l4.memory_bytes == a10g.memory_bytes > t4.memory_bytes
    # the same chip, other memory: the same throughput
    for same in ((a40, a80), (h100, h200)):
        assert {(c.fp16_tflops, c.bf16_tflops, c.fp32_tflops, c.compute_capability) for c in same} == {
            (same[0].fp16_tflops, same[0].bf16_tflops, same[0].fp32_tflops, same[0].compute_capability)}
    assert h100.fp16_tflops > a80.fp16_tflops > a10g.fp16_tflops > l4.fp16_tflops > t4.fp16_tflops
    assert t4.fp16_tflops > t4.fp32_tflops
    # what torch reports is less than the marketed memory (the driver's and ECC's shares)
    for c in CARDS.values():
        if c.torch_total_memory is not None:
            assert 0.9 * c.memory_bytes < c.torch_total_memory < c.memory_bytes


def test_the_t4_total_memory_is_the_one_test_t4_fits_the_lessons_in():
    source = (ROOT / "tests" / "test_t4.py").read_text()
    found = re.search(r"^T4_BYTES\s*=\s*([\d_]+)\s*\*\s*MiB", source, re.M)
    assert found, "tests/test_t4.py sets T4_BYTES = <MiB> * MiB"
    assert card("t4").torch_total_memory == int(found[1]) * 2**20


def test_the_halved_figures_say_so():
    for key in ("l4", "h100", "h200"):
        c = CARDS[key]
        assert "halved" in c.sources["fp16_tflops"] and "halved" in c.sources["bf16_tflops"]
    assert "A10" in CARDS["a10g"].sources["fp32_tflops"]  # the A10G's figures are the A10 sheet's, and say so


@pytest.mark.parametrize("name, key", [
    ("t4", "t4"), ("T4", "t4"), ("Tesla T4", "t4"), (" t4 ", "t4"),
    ("L4", "l4"), ("NVIDIA L4", "l4"),
    ("A10G", "a10g"), ("NVIDIA A10G", "a10g"),
    ("a100-40gb", "a100-40gb"), ("A100 40GB", "a100-40gb"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("a100-80gb", "a100-80gb"), ("A100-80GB", "a100-80gb"), ("a100 80gb", "a100-80gb"), ("A100 80 GB", "a100-80gb"),
    ("a100_80gb", "a100-80gb"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("h100", "h100"), ("H100", "h100"), ("H100 SXM", "h100"), ("NVIDIA H100 80GB HBM3", "h100"),
    ("h200", "h200"), ("H200", "h200"), ("NVIDIA H200", "h200"), ("H200 141GB", "h200"),
])
def test_lookups_by_several_spellings(name, key):
    assert card(name) is CARDS[key]


@pytest.mark.parametrize("name", ["", "a100", "A10", "H100 PCIe", "NVIDIA A100 80GB PCIe", "H100 NVL", "v100",
                                  "t4x", None, 4, 8.0, b"t4", ["t4"]])
def test_bad_names_raise_value_error_listing_the_keys(name):
    with pytest.raises(ValueError) as raised:
        card(name)
    message = str(raised.value)
    for key in KEYS:
        assert key in message
