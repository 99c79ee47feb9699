"""Draw a committed run's plots from its results files: ``python benchmarks/plot_results.py DIR...``.

The lent GPU machines' benchmark calls skip the plots (no matplotlib there, and no time for it
within a call), so their folders under benchmarks/results/ get ops.png / end_to_end.png here,
from the rows of every results*.json in the folder (a run of two calls has results.json and
results_call2.json), as ``python -m benchmarks`` draws them for a run of its own."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, ops  # noqa: E402


def plot_folder(folder: Path) -> list[Path]:
    rows = []
    for path in sorted(folder.glob("results*.json")):
        rows += json.loads(path.read_text())["rows"]
    if not rows:
        return []
    return common.write_plots(folder, rows, ops.X_KEYS)


def main(argv=None) -> int:
    folders = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    if not folders:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    status = 0
    for folder in folders:
        if not folder.is_dir():
            print(f"{folder}: not a folder", file=sys.stderr)
            status = 2
            continue
        written = plot_folder(folder)
        print(f"{folder}: {', '.join(p.name for p in written) or 'no rows to plot'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
