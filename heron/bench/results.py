"""Result records: one JSON object per benchmark run, with a ``kind`` the report dispatches on.

Every record has ``kind`` ("throughput" | "latency" | "serve"), ``machine`` and ``config``;
the rest depends on the kind (see the module that produces it).
"""

from __future__ import annotations

import json
from pathlib import Path

KINDS = ("throughput", "latency", "serve")


def compact(record: dict) -> dict:
    """The record without per-request data (``requests`` lists inside ``results`` rows)."""
    rows = record.get("results")
    if not isinstance(rows, list):
        return record
    return record | {"results": [{k: v for k, v in row.items() if k != "requests"}
                                 for row in rows]}


def emit(record: dict, json_out: str | None) -> None:
    """Print the record (without per-request data) as one JSON line and, if asked, write
    all of it to ``json_out``."""
    if record.get("kind") not in KINDS:
        raise ValueError(f"record kind must be one of {KINDS}, got {record.get('kind')!r}")
    print(json.dumps(compact(record), separators=(",", ":")), flush=True)
    if json_out:
        path = Path(json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")


def load(path: str | Path) -> dict:
    """Read one result file; a clear ValueError if it is not a heron bench record."""
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"result file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(record, dict) or record.get("kind") not in KINDS:
        raise ValueError(f"{path} is not a heron bench result (needs 'kind' in {KINDS})")
    record["_source"] = path.name
    return record
