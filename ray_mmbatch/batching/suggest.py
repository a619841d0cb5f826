"""Budgets suggested from a dataset's measured costs (``ray-mmbatch inspect`` ends with them).

For each budget that a single sample can break on its own (``--max-tokens``; ``--max-frames`` when the
data holds video), a few candidate values, each with the number of samples that would be oversize at it
(no batch can hold them alone: ``--oversize truncate`` cuts their text, ``skip`` drops them), judged by
the planner's own rule (``plan.oversize_mask``, the attention term included):

* ``fits_all``: the smallest round value (a multiple of ``STEP``) that holds every sample, the one
  recommended: no sample is cut or skipped;
* ``p99``: the round value at the 99th percentile, for a dataset whose few longest samples would
  otherwise set a budget far above the rest (the count says what it costs);
* ``current``: the value the run is configured with now.

A round value, not the exact maximum: GPU kernels and memory plans like multiples of 1,024 tokens, and
a budget that equals the longest sample packs that sample alone. Pure numpy, O(n) per candidate.
"""
from __future__ import annotations

import math

import numpy as np

from ray_mmbatch.batching.budget import Budget
from ray_mmbatch.batching.plan import oversize_mask

STEP = {"max_tokens": 1024, "max_frames": 8}
"""Candidates are rounded up to multiples of these."""


def _round_up(x: float, step: int) -> int:
    return max(step, int(math.ceil(x / step)) * step)


def suggest_budgets(tokens, frames, budget_cfg) -> dict[str, list[dict]]:
    """{"max_tokens": [...], "max_frames": [...] (only when a sample has frames)}; each candidate is
    {"value", "oversize", "why"}, ``fits_all`` first. ``tokens`` / ``frames``: per usable sample."""
    import copy

    tokens = np.asarray(tokens, dtype=np.int64)
    frames = np.zeros(len(tokens), np.int64) if frames is None else np.asarray(frames, dtype=np.int64)
    if not len(tokens):
        return {}
    zeros = np.zeros(len(tokens), np.int64)
    base = copy.copy(budget_cfg)
    base.max_patches = base.max_images = base.max_frames = None  # one budget at a time

    def oversize(key: str, value: int) -> int:
        one = copy.copy(base)
        if key == "max_tokens":
            one.max_tokens = value
        else:
            one.max_tokens, one.max_frames = np.iinfo(np.int64).max, value
        return int(oversize_mask(tokens, zeros, zeros, Budget.from_config(one), frames).sum())

    weight = float(budget_cfg.attn_weight or 0.0)
    cost = tokens + weight * tokens.astype(np.float64) ** 2 if weight else tokens
    out: dict[str, list[dict]] = {}
    for key, values, current in (("max_tokens", cost, budget_cfg.max_tokens),
                                 ("max_frames", frames, budget_cfg.max_frames)):
        if key == "max_frames" and not frames.any():
            continue
        step = STEP[key]
        fits_all = _round_up(float(np.max(values)), step)
        p99 = _round_up(float(np.percentile(values, 99)), step)
        rows = [{"value": fits_all, "oversize": oversize(key, fits_all), "why": "fits_all"}]
        if p99 != fits_all:
            rows.append({"value": p99, "oversize": oversize(key, p99), "why": "p99"})
        if current is not None and int(current) not in (fits_all, p99):
            rows.append({"value": int(current), "oversize": oversize(key, int(current)), "why": "current"})
        out[key] = rows
    return out


def format_suggestions(suggested: dict[str, list[dict]], samples: int) -> str:
    """One line per budget: ``--max-tokens 4096 (0 of 300 samples oversize); p99: 3072 (4 oversize) ...``."""
    words = {"fits_all": "", "p99": "at p99 ", "current": "now "}
    lines = []
    for key, rows in suggested.items():
        flag = "--" + key.replace("_", "-")
        first, rest = rows[0], rows[1:]
        line = f"{flag} {first['value']} ({first['oversize']} of {samples} samples oversize)"
        line += "".join(f"; {words[r['why']]}{r['value']}: {r['oversize']} oversize" for r in rest)
        lines.append(line)
    return "\n".join(lines)
