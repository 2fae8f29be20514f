"""Size of the shipped code at a git revision, and how many files each operation touches.

    python dev/surface_stats.py [REV ...]          # default: HEAD

Shipped code is every ``*.py`` under ``rlinfer_*/src`` and ``conformance/src``; an operation
"touches" a shipped file when its name occurs there. Figures for ``docs/design.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
from collections import Counter

SHIPPED = re.compile(r"^(rlinfer_[a-z]+|conformance)/src/.*\.py$")
OPERATIONS = ("reset_prefix_cache", "update_weights", "release_memory", "pause_generation", "abort")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


@dataclasses.dataclass
class Stats:
    """Figures of one revision."""

    rev: str
    files: int
    lines_per_package: Counter[str]
    files_per_operation: Counter[str]


def stats(rev: str) -> Stats:
    files = [f for f in git("ls-tree", "-r", "--name-only", rev).splitlines() if SHIPPED.match(f)]
    lines: Counter[str] = Counter()
    touched: Counter[str] = Counter()
    for path in files:
        text = git("show", f"{rev}:{path}")
        lines[path.split("/", 1)[0]] += text.count("\n")
        for op in OPERATIONS:
            if re.search(rf"\b\w*{op}\b", text):
                touched[op] += 1
    return Stats(rev, len(files), lines, touched)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("revs", nargs="*", default=["HEAD"])
    for rev in parser.parse_args().revs:
        s = stats(rev)
        print(f"{s.rev}: {s.files} files, {s.lines_per_package.total()} lines")
        for package, n in sorted(s.lines_per_package.items()):
            print(f"  {package:16s} {n:6d}")
        print("  files per operation: " + ", ".join(f"{k} {v}" for k, v in s.files_per_operation.items()))


if __name__ == "__main__":
    main()
