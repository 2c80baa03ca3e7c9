"""A report as a list of blocks, rendered to Markdown or to a static HTML page.

Blocks: ``Heading(level, text)``, ``Para(text)``, ``Table(headers, rows)``,
``Image(path, alt)`` (path relative to the report). Cells go through ``table.fmt``.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from heron.bench.table import fmt


@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Para:
    text: str


@dataclass(frozen=True)
class Table:
    headers: list[str]
    rows: list[list]


@dataclass(frozen=True)
class Image:
    path: str
    alt: str


def _md_cell(value) -> str:
    return fmt(value).replace("|", "\\|")


def to_markdown(blocks: list) -> str:
    out = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append(f"{'#' * b.level} {b.text}")
        elif isinstance(b, Para):
            out.append(b.text)
        elif isinstance(b, Table):
            out.append("\n".join(
                ["| " + " | ".join(b.headers) + " |",
                 "|" + "|".join(["---"] + ["---:"] * (len(b.headers) - 1)) + "|"]
                + ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows]))
        elif isinstance(b, Image):
            out.append(f"![{b.alt}]({b.path})")
        else:
            raise TypeError(f"unknown report block {b!r}")
    return "\n\n".join(out) + "\n"


_CSS = ("body{font-family:sans-serif;max-width:1000px;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;"
        "padding:3px 8px;text-align:right}td:first-child,th:first-child{text-align:left}"
        "img{max-width:100%}code{background:#f4f4f4}")


def _inline(text: str) -> str:
    """Escape, then turn `code` spans into <code>."""
    parts = html.escape(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def to_html(blocks: list, title: str) -> str:
    body = []
    for b in blocks:
        if isinstance(b, Heading):
            body.append(f"<h{b.level}>{_inline(b.text)}</h{b.level}>")
        elif isinstance(b, Para):
            body.append(f"<p>{_inline(b.text)}</p>")
        elif isinstance(b, Table):
            head = "".join(f"<th>{html.escape(h)}</th>" for h in b.headers)
            rows = "".join("<tr>" + "".join(f"<td>{_inline(fmt(c))}</td>" for c in row)
                           + "</tr>" for row in b.rows)
            body.append(f"<table><tr>{head}</tr>{rows}</table>")
        elif isinstance(b, Image):
            body.append(f'<p><img src="{html.escape(b.path)}" alt="{html.escape(b.alt)}"></p>')
        else:
            raise TypeError(f"unknown report block {b!r}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title><style>{_CSS}</style></head><body>\n" + "\n".join(body)
            + "\n</body></html>\n")
