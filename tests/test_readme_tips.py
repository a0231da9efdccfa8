"""docs/source-articles.md's table of the source articles' tips points at the cells that teach them.

The table names notebook sections by number and cells by position ("00: 2. allocated vs reserved (18-24)").
Moving or adding a cell shifts those positions silently; these tests read the notebooks and fail when a
range leaves its notebook or a section number named beside it is not the heading of the cells it names.
No device: the tests read text only.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "source-articles.md"
HEADING = "# Every tip of the source articles"


def tip_rows(page: str) -> list[tuple[str, str, str]]:
    """(tip, notebooks, sections) for each row of the tips table."""
    start = page.index(HEADING)
    end = page.find("\n#", start + len(HEADING))
    rows = []
    for line in page[start:end if end > 0 else None].splitlines():
        if not line.startswith("| ") or line.startswith("| tip ") or line.startswith("| ---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 3, f"a tips row without three columns: {line}"
        rows.append(tuple(cells))
    return rows


def references(notebooks: str, sections: str) -> list[tuple[str, list[str], int, int]]:
    """(notebook prefix, section numbers named, first cell, last cell) for every cell range of one row."""
    named = re.findall(r"`(\d\d)(?:_\w+)?`", notebooks)
    assert named, f"no notebook named in {notebooks!r}"
    refs = []
    for part in re.split(r";\s+", sections):
        if not re.search(r"\(\d+(?:-\d+)?\)", part):
            continue  # "as above": no cells named
        prefix = re.match(r"(\d\d):\s*", part)
        if prefix:
            assert prefix.group(1) in named, f"{part!r} names a notebook the row does not list ({named})"
            notebook, part = prefix.group(1), part[prefix.end():]
        else:
            assert len(named) == 1, f"{part!r}: the row lists {named}; say which one with 'NN:'"
            notebook = named[0]
        label_start = 0
        for found in re.finditer(r"\((\d+)(?:-(\d+))?\)", part):
            label = part[label_start:found.start()]
            numbers = re.findall(r"(?:^|[\s,])(\d+)[a-z]?\.", label)
            first, last = int(found.group(1)), int(found.group(2) or found.group(1))
            refs.append((notebook, numbers, first, last))
            label_start = found.end()
    return refs


def headings(cell: dict) -> list[str]:
    if cell["cell_type"] != "markdown":
        return []
    return [line for line in "".join(cell["source"]).splitlines() if line.startswith("#")]


def section_number(heading: str) -> str | None:
    found = re.match(r"#+\s+(\d+)[a-z]?\.", heading)
    return found.group(1) if found else None


def section_of(cells: list[dict], index: int) -> str:
    """The heading of the section cell ``index`` (from 1) is in: the nearest numbered heading at or before it,
    passing over unnumbered subsections ("### Monitoring") but not an unnumbered section ("## Take-away")."""
    for i in range(index, 0, -1):
        for heading in reversed(headings(cells[i - 1])):
            if section_number(heading) or not heading.startswith("###"):
                return heading
    return ""


def check(notebooks_dir: Path, rows) -> list[str]:
    """What is wrong with the table's references, one line each (none: all good)."""
    paths = {p.name[:2]: p for p in notebooks_dir.glob("*.ipynb")}
    wrong = []
    for tip, notebooks, sections in rows:
        for prefix, numbers, first, last in references(notebooks, sections):
            if prefix not in paths:
                wrong.append(f"{tip}: no notebook {prefix}_*")
                continue
            cells = json.loads(paths[prefix].read_text())["cells"]
            if not 1 <= first <= last <= len(cells):
                wrong.append(f"{tip}: cells ({first}-{last}) outside {paths[prefix].name}'s {len(cells)}")
                continue
            # The section the first cell is in, and those the range opens.
            governing = section_of(cells, first)
            opened = [h for i in range(first + 1, last + 1) for h in headings(cells[i - 1])]
            have = {section_number(h) for h in [governing, *opened]} - {None}
            for number in numbers:
                if number not in have:
                    wrong.append(f"{tip}: {paths[prefix].name} ({first}-{last}) is not in section {number} "
                                 f"(its cells are under {governing!r})")
    return wrong


def test_every_cell_range_of_the_tips_table_is_where_its_section_is():
    rows = tip_rows(PAGE.read_text())
    assert len(rows) >= 20
    assert check(ROOT / "notebooks", rows) == []


def _notebook(tmp_path: Path, *cells: tuple[str, str]) -> Path:
    folder = tmp_path / "notebooks"
    folder.mkdir()
    cells = [{"cell_type": kind, "source": [text], "metadata": {}} for kind, text in cells]
    (folder / "05_lesson.ipynb").write_text(json.dumps({"cells": cells}))
    return folder


@pytest.fixture
def lesson(tmp_path):
    return _notebook(tmp_path, ("markdown", "# 05 · A lesson"), ("markdown", "## 1. First"), ("code", "x = 1"),
                     ("markdown", "## 2. Second"), ("markdown", "### 2a. Part"), ("code", "y = 2"),
                     ("markdown", "### More on it"), ("code", "z = 3"), ("code", "z"),
                     ("markdown", "## Take-away"), ("code", "print(x, y, z)"))


def test_a_range_under_its_section_passes(lesson):
    assert check(lesson, [("tip", "`05_lesson`", "1. first (2-3); 2. second (4-6)")]) == []
    assert check(lesson, [("tip", "`05_lesson`", "2a. (6)")]) == []           # the section governing cell 6
    assert check(lesson, [("tip", "`05_lesson`", "2. (9)")]) == []            # under an unnumbered subsection
    assert check(lesson, [("tip", "`05_lesson`", "all (2-6)")]) == []        # no number: only the range


def test_a_shifted_range_is_caught(lesson):
    # A cell added before section 2 moves it: "2." still pointing at cells 2-3 is under section 1.
    wrong = check(lesson, [("tip", "`05_lesson`", "2. second (2-3)")])
    assert len(wrong) == 1 and "not in section 2" in wrong[0]


def test_a_range_past_the_end_and_an_unknown_notebook_are_caught(lesson):
    assert "outside 05_lesson.ipynb's 11" in check(lesson, [("tip", "`05_lesson`", "2. (4-12)")])[0]
    # An unnumbered section ends the numbered one before it.
    assert "not in section 2" in check(lesson, [("tip", "`05_lesson`", "2. (11)")])[0]
    assert "no notebook 06" in check(lesson, [("tip", "`06_other`", "(1-2)")])[0]


def test_a_part_must_say_which_notebook_when_the_row_names_two():
    with pytest.raises(AssertionError, match="say which one"):
        references("`00_a`, `07_b`", "2. (1-2)")
    assert references("`00_a`, `07_b`", "00: 2. x (1-2); 07: 3.-4. (5-9)") == [
        ("00", ["2"], 1, 2), ("07", ["3"], 5, 9)]
