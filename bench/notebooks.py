"""The notebook suite: how long each notebook takes to run under nbval, and whether it passes.

Each notebook runs in its own pytest process, with the options pyproject.toml gives pytest
(nbval-lax over the current environment), as `python3 kit.py test` runs them; the time is
the whole process's wall time, kernel start included. Writes bench/out/notebooks.csv.

    python3 kit.py bench notebooks
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from results import write_csv

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def run_notebook(path: Path) -> dict:
    env = dict(os.environ, MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", str(path.relative_to(ROOT))], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|error)", done.stdout)}
    return {"notebook": path.stem, "seconds": round(seconds, 1), "passed": done.returncode == 0,
            "cells_passed": counts.get("passed", 0), "cells_failed": counts.get("failed", 0) + counts.get("error", 0)}


def main() -> list[dict]:
    rows = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        row = run_notebook(path)
        rows.append(row)
        print(f"{row['notebook']:<32}{row['seconds']:8.1f} s   {'passed' if row['passed'] else 'FAILED'}"
              f"  ({row['cells_passed']} cells passed, {row['cells_failed']} failed)", flush=True)
    write_csv("notebooks.csv", rows)
    return rows


def summary(rows: list[dict]) -> list[str]:
    slowest = max(rows, key=lambda r: r["seconds"])
    failed = [r["notebook"] for r in rows if not r["passed"]]
    return [f"notebooks: {len(rows) - len(failed)}/{len(rows)} passed under nbval in "
            f"{sum(r['seconds'] for r in rows):.0f} s (slowest {slowest['notebook']}, {slowest['seconds']:.0f} s)"
            + (f"; FAILED: {', '.join(failed)}" if failed else "")]


if __name__ == "__main__":
    main()
