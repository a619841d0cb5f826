"""The run dir's append-only JSONL logs, read back.

A process killed in the middle of an append (the fault the train loop is built to
survive) leaves a torn last line; that line is dropped, never a reason to fail a
restart or a summary. A bad line anywhere else is real corruption and raises.
Pure module.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every complete record of ``path``; [] if it does not exist."""
    p = Path(path)
    if not p.exists():
        return []
    lines = p.read_text().split("\n")
    torn = lines[-1]  # "" when the file ends with a newline, as every complete append does
    out = []
    for i, ln in enumerate(lines[:-1]):
        if ln:
            try:
                out.append(json.loads(ln))
            except ValueError as e:
                raise ValueError(f"{p}:{i + 1}: not JSON ({e})") from None
    if torn:
        try:
            out.append(json.loads(torn))
        except ValueError:
            pass  # cut off mid-write
    return out


def write_jsonl(path: str | Path, records: list[dict[str, Any]]) -> None:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))
