"""Why a sample cannot be used: one exception type carrying a counted reason.

A bad sample is never dropped silently. The code that finds the problem raises a
``SampleSkip`` subclass whose ``reason`` is one of ``schema.SKIP_*``; the stage
that catches it writes ``skip_reason`` as ``"reason: detail"`` (schema.skip_text; read back
with schema.parse_skip, into a SkipRecord (below) from the plan stage on: BATCH_SKIPPED, the
run's skip log, skipped.csv).
Pure module: no ray, no torch.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from ray_mmbatch.schema import parse_skip, skip_text


class SampleSkip(Exception):
    """A sample-level problem; ``reason`` is a schema.SKIP_* constant, str() is the human detail."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail or reason)
        self.reason = reason
        self.detail = detail

    def skip_reason(self) -> str:
        """The value for the ``skip_reason`` column: ``"reason"`` or ``"reason: detail"`` (schema.skip_text)."""
        return skip_text(self.reason, self.detail)


@dataclass(frozen=True)
class SkipRecord:
    """One sample (or unreadable file) left out, and why; ``position`` / ``unit_rows``: its read
    position (data/position.py), so a resume knows it is done (-1 / 0: none)."""

    sample_id: str
    reason: str
    detail: str = ""
    position: int = -1
    unit_rows: int = 0

    @classmethod
    def of(cls, sample_id: str, text: str, position: int = -1, unit_rows: int = 0) -> SkipRecord:
        """From the column text ("reason: detail")."""
        reason, detail = parse_skip(text)
        return cls(str(sample_id), reason, detail, int(position), int(unit_rows))

    @property
    def text(self) -> str:
        return skip_text(self.reason, self.detail)

    def to_dict(self) -> dict:
        return asdict(self)


def encode_skips(records: list[SkipRecord]) -> str:
    """The BATCH_SKIPPED cell: JSON of the records' fields (a cell holds any number, none included)."""
    return json.dumps([r.to_dict() for r in records])


def decode_skips(cell) -> list[SkipRecord]:
    return [SkipRecord(**d) for d in json.loads(str(cell))]
