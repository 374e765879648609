"""The code blocks of README.md and docs/*.md, in one place for every test that runs or checks them.

A block is found by its page and a marker, a piece of text only that block of the page holds, so
a block can move within its page, or text around it change, without its tests losing it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```[ \t]*$", re.S | re.M)


@dataclass(frozen=True, kw_only=True, slots=True)
class Block:
    page: str  # relative to the repository: "README.md", "docs/cli.md"
    lang: str  # the fence's language, "" when none
    source: str
    line: int  # of the first line of code, 1-based


def pages() -> list[str]:
    """README.md and every page under docs/, relative to the repository."""
    return ["README.md", *(p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "docs").glob("*.md")))]


def blocks(page: str | None = None) -> list[Block]:
    """Every fenced code block of ``page``, or of every page when None."""
    out = []
    for name in [page] if page is not None else pages():
        text = (ROOT / name).read_text()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start(2)) + 1
            out.append(Block(page=name, lang=m.group(1), source=m.group(2), line=line))
    return out


def block(page: str, marker: str, lang: str = "python") -> str:
    """The source of the one ``lang`` block of ``page`` that contains ``marker``."""
    found = [b.source for b in blocks(page) if b.lang == lang and marker in b.source]
    if len(found) != 1:
        raise LookupError(f"{page}: {len(found)} {lang} blocks contain {marker!r}; expected exactly one")
    return found[0]


def code(page: str, marker: str) -> object:
    """The python block of ``page`` holding ``marker``, compiled under its page's name and line,
    so a traceback from ``exec`` points into the page."""
    b = next(b for b in blocks(page) if b.lang == "python" and b.source == block(page, marker))
    return compile("\n" * (b.line - 1) + b.source, str(ROOT / page), "exec")
