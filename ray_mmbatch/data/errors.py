"""Why a sample cannot be used: one exception type carrying a counted reason.

A bad sample is never dropped silently. The code that finds the problem raises a
``SampleSkip`` subclass whose ``reason`` is one of ``schema.SKIP_*``; the stage
that catches it writes ``skip_reason`` as ``"reason: detail"`` (schema.skip_text; read back
with schema.parse_skip, into a schema.SkipRecord from the plan stage on).
Pure module: no ray, no torch.
"""
from __future__ import annotations

from ray_mmbatch.schema import skip_text


class SampleSkip(Exception):
    """A sample-level problem; ``reason`` is a schema.SKIP_* constant, str() is the human detail."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail or reason)
        self.reason = reason
        self.detail = detail

    def skip_reason(self) -> str:
        """The value for the ``skip_reason`` column: ``"reason"`` or ``"reason: detail"`` (schema.skip_text)."""
        return skip_text(self.reason, self.detail)
