"""Plain-text tables for the terminal."""

from __future__ import annotations

import math


def fmt(value, digits: int = 2) -> str:
    """Numbers with ``digits`` decimals (thousands separated), None/NaN as '-', rest as str."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def format_table(headers: list[str], rows: list[list]) -> str:
    """Right-aligned columns (the first left-aligned), cells through ``fmt``."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(str(h))
              for i, h in enumerate(headers)]

    def line(row):
        first, rest = row[0], row[1:]
        return "  ".join([str(first).ljust(widths[0])]
                         + [str(c).rjust(w) for c, w in zip(rest, widths[1:])])

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])
