#!/usr/bin/env python3
"""Import cycles among the files of a Rust crate.

Usage: scripts/import-cycles.py [--allow FILE]... CRATE_SRC   (e.g. actors/src)

Builds the graph of which .rs file uses which: a path that starts with `crate::`,
`super::` or `self::` (in a `use` item, braces expanded, or anywhere in the code)
points at the deepest module of it that has a file (`foo.rs`, `foo/mod.rs`, or a
`#[path]` one); a file's inline modules (`mod tests { .. }`) belong to it. A parent
naming its own children (`mod x;`, `pub use x::Item;`) is the module tree, not an
edge. Prints every cycle (a strongly connected component of more than one file) with
its files and the paths that make each edge, and exits 1 when there is one.

`--allow FILE` (a path as printed, relative to CRATE_SRC) accepts the cycles that
contain FILE: for a cycle documented as known, not to be used for new ones.
Standard library only.
"""

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rust_source import blank as strip  # noqa: E402

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def expand_use(tree):
    """The paths of a use tree: `a::{b, c::{d as e, *}}` -> a::b, a::c::d, a::c."""
    tree = re.sub(r"\s+as\s+" + IDENT, "", tree)
    tree = re.sub(r"\s+", "", tree)
    paths = []

    def walk(prefix, s):
        depth, start, parts = 0, 0, []
        for k, ch in enumerate(s):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                parts.append(s[start:k])
                start = k + 1
        parts.append(s[start:])
        for p in parts:
            if not p:
                continue
            b = p.find("{")
            if b >= 0:
                head = p[:b].rstrip(":")
                inner = p[b + 1 : p.rfind("}")]
                walk(prefix + [x for x in head.split("::") if x], inner)
            else:
                segs = [x for x in p.split("::") if x and x != "*"]
                if len(segs) > 1 and segs[-1] == "self":
                    segs = segs[:-1]
                paths.append(prefix + segs)

    walk([], tree)
    return paths


class Crate:
    def __init__(self, src):
        self.src = src
        self.files = {}  # module path (tuple) -> file (relative to src)
        root = "lib.rs" if os.path.exists(os.path.join(src, "lib.rs")) else "main.rs"
        self.add((), root)

    def add(self, modpath, rel):
        """Registers the file of `modpath` and, recursively, its `mod x;` children."""
        self.files[modpath] = rel
        raw = open(os.path.join(self.src, rel), encoding="utf-8").read()
        text = strip(raw)
        base = os.path.dirname(rel)
        name = os.path.basename(rel)
        if name not in ("lib.rs", "main.rs", "mod.rs"):
            base = os.path.join(base, name[:-3])
        for m in re.finditer(
            r'((?:#\[[^\]]*\]\s*)*)(?:pub(?:\([^)]*\))?\s+)?mod\s+(' + IDENT + r")\s*;", text
        ):
            attrs, child = m.group(1), m.group(2)
            p = None
            if "#[path" in (attrs or ""):
                # strip() blanked the string: read it from the raw text at that line
                line = text.count("\n", 0, m.start(2))
                near = "\n".join(raw.split("\n")[max(0, line - 3) : line + 1])
                found = re.findall(r'#\[path\s*=\s*"([^"]*)"\]', near)
                p = found[-1] if found else None
            if p is not None:
                where = os.path.normpath(os.path.join(os.path.dirname(rel), p))
            elif os.path.exists(os.path.join(self.src, base, child + ".rs")):
                where = os.path.join(base, child + ".rs")
            else:
                where = os.path.join(base, child, "mod.rs")
            if os.path.exists(os.path.join(self.src, where)):
                self.add(modpath + (child,), where)

    def resolve(self, segs):
        """The file of the deepest module of `segs` (a module path) that has one."""
        for k in range(len(segs), -1, -1):
            f = self.files.get(tuple(segs[:k]))
            if f is not None:
                return f
        return None

    def uses(self, modpath, rel):
        """(file used, the path as written) for each crate/super/self path in `rel`."""
        text = strip(open(os.path.join(self.src, rel), encoding="utf-8").read())
        # inline modules: the module path at each offset
        inline = []  # (start, end, name)
        for m in re.finditer(r"\bmod\s+(" + IDENT + r")\s*\{", text):
            depth, j = 1, m.end()
            while j < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            inline.append((m.end(), j, m.group(1)))

        def module_at(pos):
            inner = [name for (s, e, name) in inline if s <= pos < e]
            return modpath + tuple(inner)

        found = []

        def take(pos, segs, shown):
            here = module_at(pos)
            if segs[0] == "crate":
                target = list(segs[1:])
            elif segs[0] in ("super", "self"):
                cur = list(here)
                k = 0
                while k < len(segs) and segs[k] in ("super", "self"):
                    if segs[k] == "super":
                        if not cur:
                            return
                        cur.pop()
                    k += 1
                target = cur + list(segs[k:])
            else:
                return
            f = self.resolve(target)
            if f is not None and f != rel:
                found.append((f, shown))

        spans = []
        for m in re.finditer(r"\buse\s+([^;]*);", text):
            spans.append((m.start(), m.end()))
            for segs in expand_use(m.group(1)):
                if segs:
                    take(m.start(), segs, "::".join(segs))
        for m in re.finditer(r"\b(crate|super|self)((?:\s*::\s*" + IDENT + r")+)", text):
            if any(s <= m.start() < e for s, e in spans):
                continue
            segs = [m.group(1)] + [x for x in re.split(r"\s*::\s*", m.group(2)) if x]
            take(m.start(), segs, "::".join(segs))
        return found


def cycles(graph):
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def main(argv):
    allow, args = set(), []
    it = iter(argv)
    for a in it:
        if a == "--allow":
            allow.add(os.path.normpath(next(it, "")))
        elif a in ("-h", "--help"):
            print(__doc__)
            return 0
        else:
            args.append(a)
    if len(args) != 1 or not os.path.isdir(args[0]):
        print("usage: scripts/import-cycles.py [--allow FILE]... CRATE_SRC", file=sys.stderr)
        return 2
    crate = Crate(args[0])
    graph, why = {}, {}
    for modpath, rel in sorted(crate.files.items()):
        graph.setdefault(rel, set())
        for f, shown in crate.uses(modpath, rel):
            graph[rel].add(f)
            why.setdefault((rel, f), []).append(shown)
    bad = 0
    for comp in cycles(graph):
        allowed = sorted(allow.intersection(comp))
        members = set(comp)
        tag = f" (allowed by {', '.join(allowed)})" if allowed else ""
        print(f"cycle of {len(comp)} files{tag}:")
        for f in comp:
            for g in sorted(graph[f] & members):
                paths = sorted(set(why[(f, g)]))
                more = f" (+{len(paths) - 3})" if len(paths) > 3 else ""
                print(f"  {f} -> {g}: {', '.join(paths[:3])}{more}")
        if not allowed:
            bad += 1
    if bad:
        print(f"{bad} import cycle(s) among the files of {args[0]}")
        return 1
    print(f"no import cycles among the {len(crate.files)} files of {args[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
