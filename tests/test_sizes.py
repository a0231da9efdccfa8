"""Each lesson's sizes come from one table that knows the card (gpukit.lessons.sizes).

Device: cpu. A GPU is stood in for by torch.cuda's answers (its name and memory), as a CUDA build gives them."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gpukit.allocator import cpu_device, reset_cpu_device
from gpukit.cards import card
from gpukit.lessons.sizes import REHEARSE_VAR, SIZES, card_memory, lesson_settings

ROOT = Path(__file__).resolve().parent.parent
# Lessons whose sizes are the same on every device (or that size nothing by the device): no entry in the table.
SAME_EVERYWHERE = {"01_out_of_memory", "09_multi_gpu", "12_data_loading", "13_make_it_fit", "14_fit_a_big_model"}


def settings_cell(name):
    nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
    cell = "".join([c for c in nb["cells"] if c["cell_type"] == "code"][1]["source"])
    assert cell.startswith("# Settings"), name
    return cell


def test_every_lesson_takes_its_sizes_from_the_table_and_none_chooses_them_itself():
    names = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert set(SIZES) | SAME_EVERYWHERE == set(names)
    for name in names:
        cell = settings_cell(name)
        assert "get_device_properties" not in cell, f"{name}: the card is read in one place, gpukit.lessons.sizes"
        if name in SIZES:
            assert f'lesson_settings("{name}")' in cell, name
            # no size picked by the device in the cell: `X = a if DEVICE.type == ... else b` and the like
            chosen = [line for line in cell.splitlines()
                      if re.match(r"[A-Z_, ]+ = .* if .*(DEVICE|GPU|CUDA|is_available).* else ", line)
                      and not line.startswith(("SLACK", "DEVICE"))]  # the allocator's slack, and 06's meta device
            assert chosen == [], f"{name}: {chosen}"
            for size in SIZES[name]["cpu"]:
                assert f"S.{size}" in cell, f"{name}: {size} not taken from the table"


def test_the_tiers_agree_on_what_they_size():
    for name, table in SIZES.items():
        tiers = [t for t in ("gpu", "t4", "h100") if t in table]
        assert tiers in (["gpu"], ["t4", "h100"]), name
        for tier in tiers:
            assert table[tier].keys() == table["cpu"].keys(), (name, tier)


def fake_gpu(monkeypatch, name, total_memory, capability=(8, 0)):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: SimpleNamespace(name=name, total_memory=total_memory,
                                                   major=capability[0], minor=capability[1]))


@pytest.mark.parametrize("name, total_memory, tier, key", [
    ("Tesla T4", 14_930 * 2**20, "t4", "t4"),
    ("NVIDIA A10G", 22_731 * 2**20, "t4", "a10g"),
    ("NVIDIA A100-SXM4-40GB", 40_441 * 2**20, "h100", "a100-40gb"),
    ("NVIDIA H100 80GB HBM3", 81_079 * 2**20, "h100", "h100"),
    ("NVIDIA GeForce RTX 4090", 24_080 * 2**20, "t4", None),  # not in gpukit.cards: sized by its memory
])
def test_a_gpu_gets_the_sizes_of_its_memory(monkeypatch, name, total_memory, tier, key):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # first a machine without a GPU (here or not)
    s = lesson_settings("02_no_grad")
    cpu_batch = SIZES["02_no_grad"]["cpu"]["EVAL_BATCH"]
    assert (s.device.type, s.tier, s.card, s.EVAL_BATCH) == ("cpu", "cpu", None, cpu_batch)
    fake_gpu(monkeypatch, name, total_memory)
    s = lesson_settings("02_no_grad")
    assert s.device.type == "cuda" and s.tier == tier and not s.rehearsal
    assert (s.card.key if s.card else None) == key
    assert s.EVAL_BATCH == SIZES["02_no_grad"][tier]["EVAL_BATCH"]
    assert s.CHANNELS == SIZES["02_no_grad"][tier]["CHANNELS"] and "02_no_grad on cuda" in repr(s)


def test_a_rehearsal_runs_on_the_cpu_with_the_cards_sizes_and_memory(monkeypatch):
    monkeypatch.setenv(REHEARSE_VAR, "t4")
    try:
        s = lesson_settings("07_cpu_offload")
        assert s.device.type == "cpu" and s.rehearsal and s.card is card("t4") and s.tier == "t4"
        assert s.ROWS == 2**20
        assert cpu_device().allocator.total_memory == card_memory(card("t4")) == 14_930 * 2**20
        monkeypatch.setenv(REHEARSE_VAR, "H100")
        assert lesson_settings("07_cpu_offload").ROWS == 2**22
        assert cpu_device().allocator.total_memory == 80 * 10**9
    finally:
        reset_cpu_device()  # the process's simulated GPU as every other test finds it


def test_bad_names_are_refused_with_what_is_allowed(monkeypatch):
    with pytest.raises(ValueError, match="the lessons with sizes are 00_where_memory_goes"):
        lesson_settings("00_where_memory_went")
    s = lesson_settings("00_where_memory_goes")
    with pytest.raises(AttributeError, match="has no size 'DEPTH': it has BATCH, WIDTH"):
        s.DEPTH
    monkeypatch.setenv(REHEARSE_VAR, "v100")
    with pytest.raises(ValueError, match="the cards are t4, l4"):
        lesson_settings("00_where_memory_goes")


def test_a_rehearsal_repeats_timed_steps_fewer_times_and_nothing_else(monkeypatch):
    """A rehearsal shortens only the repetitions of timed steps (REHEARSAL_REPEATS), never below two (the lessons
    take the median of all but the first), says so in the settings it prints, and leaves every other size the
    card's."""
    from gpukit.lessons.sizes import REHEARSAL_REPEATS, shortened

    assert REHEARSAL_REPEATS, "no lesson shortened: this test would check nothing"
    for name, fewer in REHEARSAL_REPEATS.items():
        for tier in [t for t in ("gpu", "t4", "h100") if t in SIZES[name]]:
            for size, (on_card, rehearsed) in shortened(name, tier).items():
                assert 2 <= rehearsed < on_card, (name, size)
    monkeypatch.setenv(REHEARSE_VAR, "t4")
    try:
        s = lesson_settings("05_gradient_checkpointing")
        assert s.TIME_REPEATS == 2 < SIZES["05_gradient_checkpointing"]["gpu"]["TIME_REPEATS"]
        assert (s.WIDTH, s.BATCH) == (SIZES["05_gradient_checkpointing"]["gpu"]["WIDTH"],
                                      SIZES["05_gradient_checkpointing"]["gpu"]["BATCH"])
        assert "repeated fewer times in a rehearsal: TIME_REPEATS" in repr(s)
        assert lesson_settings("00_where_memory_goes").shortened == {}
    finally:
        reset_cpu_device()
    fake_gpu(monkeypatch, "Tesla T4", 14_930 * 2**20, (7, 5))
    monkeypatch.delenv(REHEARSE_VAR)
    s = lesson_settings("03_mixed_precision")  # on the card itself: every repetition
    assert s.SPEED_STEPS == SIZES["03_mixed_precision"]["gpu"]["SPEED_STEPS"] and s.shortened == {}
