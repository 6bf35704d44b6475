#!/usr/bin/env python3
"""Lists the longest non-test functions of the workspace crates, or fails when one is too long.

    scripts/long-fns.py                              # the 20 longest, longest first
    scripts/long-fns.py --top 50
    scripts/long-fns.py --max 150                    # exits 1, listing each one over 150 lines
    scripts/long-fns.py --under actors/src --max 120 # only the files under actors/src

Each line reads `LINES  path:line  name`. LINES counts the function's lines from the one
holding `fn` to the one holding its closing brace, both included (doc comments and
attributes above it are not counted). Every `fn` item with a body is measured: free
functions, methods in `impl` blocks, trait default methods, and functions nested in other
functions (which are then counted inside their parent as well).

Test code is left out: files named `tests.rs` or `*_tests.rs`, `tests/` folders, items
under `#[cfg(test)]` (a `mod x { .. }` block, or `mod x;` and its file), and functions
marked `#[test]` (or `#[tokio::test]` and the like). The workspace crates are the members
of the root Cargo.toml; `target/` and hidden folders are skipped. `--under PATH` (relative
to the repository root, repeatable) keeps only the files under one of those paths (a
folder, or a single file).

Brace matching runs on the source with comments (nested block comments too), string
literals (escaped, byte, C and raw ones with any number of `#`) and char literals such as
'{' blanked out, so braces inside them do not count. Lifetimes and labels ('a, 'outer:) are
told from char literals by the closing quote. Macro-generated functions are not seen.
"""

import argparse
import os
import re
import sys
import tomllib
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rust_source import blank  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
FN = re.compile(r"\bfn\s+(r#)?([A-Za-z_][A-Za-z0-9_]*)")
MOD_DECL = re.compile(r"\bmod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;")
TEST_ATTR = re.compile(r"^\s*(?:[A-Za-z_][A-Za-z0-9_]*\s*::\s*)*test\s*(?:\(.*\))?\s*$", re.S)
CFG_TEST = re.compile(r"^\s*cfg\s*\(\s*(?:all\s*\(\s*)?test\b", re.S)


def match_brace(src: str, i: int) -> int:
    """`src[i]` is `{`: the offset of its closing brace (or the end)."""
    depth = 0
    for j in range(i, len(src)):
        if src[j] == "{":
            depth += 1
        elif src[j] == "}":
            depth -= 1
            if not depth:
                return j
    return len(src) - 1


def item_end(src: str, i: int) -> tuple[int, bool]:
    """From `i` (inside an item's header), the offset where the item ends: its closing brace,
    or the `;` of a body-less item. The flag says whether it has a braced body."""
    depth = 0
    for j in range(i, len(src)):
        c = src[j]
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif depth == 0 and c == ";":
            return j, False
        elif depth == 0 and c == "{":
            return match_brace(src, j), True
    return len(src) - 1, False


def attributes(src: str):
    """Each outer attribute `#[..]`: (start, end past its `]`, its content)."""
    for m in re.finditer(r"#\s*\[", src):
        depth, j = 1, m.end()
        while j < len(src) and depth:
            depth += {"[": 1, "]": -1}.get(src[j], 0)
            j += 1
        yield m.start(), j, src[m.end() : j - 1]


def test_ranges(src: str) -> tuple[list[tuple[int, int]], list[str], bool]:
    """The spans of test-only items, the names of `#[cfg(test)] mod x;` files, and whether
    the whole file is test-only (`#![cfg(test)]`)."""
    spans, mods = [], []
    whole = re.search(r"#\s*!\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]", src) is not None
    for start, end, content in attributes(src):
        if src[start + 1 : start + 2].strip() == "!":
            continue
        if not (CFG_TEST.match(content) or TEST_ATTR.match(content)):
            continue
        # the item the attribute is on: skip any further attributes, then to its end
        j = end
        while True:
            m = re.compile(r"\s*#\s*\[").match(src, j)
            if not m:
                break
            depth, j = 1, m.end()
            while j < len(src) and depth:
                depth += {"[": 1, "]": -1}.get(src[j], 0)
                j += 1
        stop, _ = item_end(src, j)
        decl = MOD_DECL.match(src[j:stop + 1].strip())
        if decl and CFG_TEST.match(content):
            mods.append(decl.group(1))
        spans.append((start, stop))
    return spans, mods, whole


def containers(src: str) -> list[tuple[int, int, str]]:
    """The `impl` and `trait` blocks: (body start, body end, the type or trait's name)."""
    found = []
    for m in re.finditer(r"\b(impl|trait)\b", src):
        prev = src[: m.start()].rstrip()
        # `impl Trait` in argument or return position is not a block
        if prev and prev[-1] not in "};]{" and not prev.endswith(("pub", "unsafe", ")")):
            continue
        j = m.end()
        brace = None
        depth = 0
        for k in range(j, len(src)):
            c = src[k]
            if c in "([":
                depth += 1
            elif c in ")]":
                depth -= 1
            elif depth == 0 and c == ";":
                break
            elif depth == 0 and c == "{":
                brace = k
                break
        if brace is None:
            continue
        header = src[j:brace]
        header = re.split(r"\bwhere\b", header)[0]
        if m.group(1) == "impl":
            header = strip_generics(header)
            header = re.split(r"\bfor\b", header)[-1]
        names = IDENT.findall(strip_generics(header))
        names = [x for x in names if x not in ("dyn", "unsafe", "pub", "crate", "mut", "const")]
        name = names[-1] if names else "?"
        found.append((brace, match_brace(src, brace), name))
    return found


def strip_generics(s: str) -> str:
    """`s` without anything inside angle brackets (`->` arrows are not brackets)."""
    out, depth = [], 0
    s = s.replace("->", "  ")
    for c in s:
        if c == "<":
            depth += 1
        elif c == ">":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(c)
    return "".join(out)


def functions(path: Path, rel: str):
    """Each non-test function of one file: (lines, rel:line, name)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    src = blank(text)
    spans, _, whole = test_ranges(src)
    if whole:
        return
    boxes = containers(src)
    for m in FN.finditer(src):
        at = m.start()
        if any(a <= at <= b for a, b in spans):
            continue
        end, body = item_end(src, m.end())
        if not body:
            continue
        first = src.count("\n", 0, at) + 1
        last = src.count("\n", 0, end) + 1
        inside = [b for b in boxes if b[0] < at < b[1]]
        name = m.group(2)
        if inside:
            name = f"{max(inside, key=lambda b: b[0])[2]}::{name}"
        yield last - first + 1, f"{rel}:{first}", name


def test_module_files(path: Path) -> list[Path]:
    """The files of the `#[cfg(test)] mod x;` declarations of one file."""
    src = blank(path.read_text(encoding="utf-8", errors="replace"))
    _, mods, _ = test_ranges(src)
    if path.name in ("mod.rs", "lib.rs", "main.rs"):
        here = path.parent
    else:
        here = path.parent / path.stem
    out = []
    for name in mods:
        out += [here / f"{name}.rs", here / name / "mod.rs"]
    return out


def crate_files() -> list[Path]:
    """The non-test .rs files of the workspace's member crates."""
    manifest = tomllib.loads((ROOT / "Cargo.toml").read_text())
    members = [(ROOT / m).resolve() for m in manifest["workspace"]["members"]]
    files = []
    for member in members:
        for dirpath, dirnames, filenames in os.walk(member):
            here = Path(dirpath)
            dirnames[:] = sorted(
                d
                for d in dirnames
                if d not in ("target", "tests")
                and not d.startswith(".")
                and (here / d).resolve() not in members
            )
            for f in sorted(filenames):
                if f.endswith(".rs") and f != "tests.rs" and not f.endswith("_tests.rs"):
                    files.append(here / f)
    skip = set()
    for f in files:
        skip.update(p.resolve() for p in test_module_files(f))
    return [f for f in files if f.resolve() not in skip]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=20, help="how many to print (default 20)")
    ap.add_argument(
        "--max", type=int, help="exit 1, listing every non-test function over MAX lines"
    )
    ap.add_argument(
        "--under",
        action="append",
        default=[],
        metavar="PATH",
        help="only the files under PATH (relative to the repository root; repeatable)",
    )
    args = ap.parse_args()

    unders = []
    for u in args.under:
        path = (ROOT / u).resolve()
        if not path.exists():
            ap.error(f"--under {u}: no such file or folder under {ROOT}")
        unders.append(path)

    def wanted(f: Path) -> bool:
        f = f.resolve()
        return not unders or any(f == u or u in f.parents for u in unders)

    found = []
    for f in crate_files():
        if wanted(f):
            found += functions(f, f.relative_to(ROOT).as_posix())
    found.sort(key=lambda x: (-x[0], x[1]))

    def show(rows):
        for lines, where, name in rows:
            print(f"{lines:5}  {where}  {name}")

    if args.max is not None:
        over = [r for r in found if r[0] > args.max]
        if over:
            print(f"{len(over)} non-test function(s) over {args.max} lines:")
            show(over)
            return 1
        print(f"no non-test function over {args.max} lines ({len(found)} measured)")
        return 0
    show(found[: args.top])
    return 0


if __name__ == "__main__":
    sys.exit(main())
