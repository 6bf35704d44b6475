"""Rust source as the repository's scripts read it: comments, strings and char literals
blanked, with offsets and line numbers kept (`scripts/long-fns.py`, `scripts/import-cycles.py`)."""

import re

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def blank(text: str) -> str:
    """The source with comments, strings and char literals turned to spaces, newlines kept,
    so that offsets and line numbers still match the original."""
    out = list(text)
    n = len(text)
    i = 0

    def wipe(a: int, b: int) -> None:
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    def ident_before(k: int) -> bool:
        return k > 0 and (text[k - 1].isalnum() or text[k - 1] == "_")

    while i < n:
        c = text[i]
        if c == "/" and text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            wipe(i, j)
            i = j
        elif c == "/" and text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            wipe(i, j)
            i = j
        elif c in "rbc" and not ident_before(i):
            # raw strings r"..", r#".."#, br#".."#, cr".."; byte/C strings b"..", c".."
            m = re.compile(r"(?:br|cr|r)(#*)\"").match(text, i)
            if m:
                close = '"' + m.group(1)
                j = text.find(close, m.end())
                j = n if j < 0 else j + len(close)
                wipe(i, j)
                i = j
            elif text.startswith(('b"', 'c"'), i):
                i = skip_string(text, i + 1, wipe)
            elif text.startswith("b'", i):
                i = skip_char(text, i + 1, wipe)
            else:
                m = IDENT.match(text, i)
                i = m.end()
        elif c == '"':
            i = skip_string(text, i, wipe)
        elif c == "'":
            i = skip_char(text, i, wipe)
        elif c.isalpha() or c == "_":
            i = IDENT.match(text, i).end()
        else:
            i += 1
    return "".join(out)


def skip_string(text: str, i: int, wipe) -> int:
    """`text[i]` opens a "..." string; blanks it and returns the offset past it."""
    j = i + 1
    while j < len(text) and text[j] != '"':
        j += 2 if text[j] == "\\" else 1
    wipe(i, j + 1)
    return j + 1


def skip_char(text: str, i: int, wipe) -> int:
    """`text[i]` is a quote: a char literal ('x', '\\n', '\\u{7b}') is blanked; a lifetime
    or label ('a, 'outer) is left as it is."""
    if text.startswith("\\", i + 1):
        j = text.find("'", i + 3)
        if j < 0:
            return i + 1
        wipe(i, j + 1)
        return j + 1
    if i + 2 < len(text) and text[i + 2] == "'":
        wipe(i, i + 3)
        return i + 3
    return i + 1
