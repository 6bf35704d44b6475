#!/usr/bin/env python3
"""Writes the tables of the Performance page (book/src/benchmarks.md) from one run of
`refit bench` (its table output, as printed), so that every table is a cut of the same run.

    target/release/refit bench --max-size 512MiB --transports inproc,shm,tcp,file > bench.txt
    scripts/bench-page.py bench.txt "2-core VM, 2026-11-27, commit abc1234, load average 0.6 ..."

The first ```text block after each heading below is replaced; the stamp is the italic line
that opens the Figures section. The prose between the tables is the author's to update.
"""

import re
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "book" / "src" / "benchmarks.md"


def pull_stream(row: str) -> bool:
    """The raw TCP rows of the `refit pull` comparison (1 GiB, the tuning's, the file's)."""
    return transport(row) == "tcp-loopback" and (
        " GiB " in row or "tried" in row or "into a new" in row
    )


# heading -> which rows go in its table
CUTS = {
    "### Shared memory and in-process": lambda r: transport(r).startswith(
        ("memcpy", "inproc", "shm")
    ),
    "### TCP": lambda r: transport(r) in ("tcp", "tcp-loopback") and not pull_stream(r),
    "### `refit pull` and the TCP baseline": lambda r: pull_stream(r)
    or transport(r).startswith(("iperf3", "new file", "new memory", "refit pull", "refit serve")),
    "### Conversions to an engine's layout": lambda r: transport(r).startswith("strategy"),
    "### The file transport": lambda r: transport(r) == "file",
}


def rows(bench: str) -> tuple[str, list[str]]:
    """The header and the rows of a bench table (stderr lines and logs dropped)."""
    lines = bench.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("transport  "))
    table = [l for l in lines[start + 1 :] if l.strip() and not l.startswith(("real", "user", "sys"))]
    table = [l for l in table if re.match(r"^\S", l) and " INFO " not in l]
    return lines[start], table


def transport(row: str) -> str:
    # the transport column is 23 characters wide; longer names push the rest right
    return row[:23].rstrip()


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    header, table = rows(Path(sys.argv[1]).read_text())
    page = PAGE.read_text()
    for heading, keep in CUTS.items():
        at = page.index(heading + "\n")
        open_at = page.index("```text\n", at) + len("```text\n")
        close_at = page.index("```\n", open_at)
        # rows a configuration does not measure (a loaned slot has no steady update) say
        # nothing
        picked = [r for r in table if keep(r) and not re.search(r"\s-\s+-\s+-\s+-\s", r)]
        page = page[:open_at] + "\n".join([header, *picked]) + "\n" + page[close_at:]
    stamp = re.compile(r"^\*2-core VM.*\*$", re.M)
    figures = page.index("## Figures")
    m = stamp.search(page, figures)
    if not m:
        sys.exit("no stamp line after ## Figures")
    run = "`refit bench --max-size 512MiB --transports inproc,shm,tcp,file` (defaults otherwise: `--receivers 1,2,4 --iters 5 --warmup 2 --connect-runs 5 --strategies-size 64MiB --pull-size 1GiB`)"
    line = f"*{sys.argv[2]}: {run}. Every table in this section is a cut of that one run.*"
    page = page[: m.start()] + line + page[m.end() :]
    PAGE.write_text(page)


if __name__ == "__main__":
    main()
