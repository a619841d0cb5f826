"""The per-batch budget: one small object that says whether a batch is too big.

Modelled on lhotse's ``SamplingConstraint`` / ``TokenConstraint``: it holds the
limits plus a running state (``add`` / ``exceeded`` / ``reset``), and it is the
single source of truth for the budget arithmetic. Every planner in this package
and every test checks batches with the same formulas defined here::

    pack:  sum(t) + w * sum(t**2)          <= max_tokens
    pad:   rows * (L + w * L**2), L=max(t) <= max_tokens
    both:  sum(patches) <= max_patches, sum(images) <= max_images,
           sum(frames) <= max_frames, rows <= max_samples

``w`` is ``attn_weight`` (0 = plain token count). Sums of token counts are kept
as Python ints so the check is exact; only the ``w`` term is floating point.
With w > 0 the pack planners keep a 1e-9 relative margin (``token_capacity``),
so a batch landing exactly on max_tokens may be split rather than risk a
rounding overshoot.
Cost of every check: O(1) on the running state, O(n) on an explicit batch.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MODES = ("pack", "pad")

# Planners that sum floating-point per-sample costs (attn_weight > 0) compare
# against a capacity this much smaller, so rounding in a long running sum can
# never let a batch pass the planner yet fail the exact check below.
_FLOAT_SLACK = 1e-9


class OversizeError(ValueError):
    """A sample cannot fit any batch, even alone. The pipeline's oversize policy
    (truncate / skip) must run before planning; the planner never drops or
    squeezes a sample silently."""

    def __init__(self, index: int, cost: SampleCost, why: str):
        self.index = int(index)
        self.cost = cost
        self.why = why
        super().__init__(f"sample {self.index} cannot fit any batch alone: {cost} ({why})")


@dataclass(frozen=True)
class SampleCost:
    """What one sample costs: LM sequence length, vision patches, image count, video frames."""

    tokens: int
    patches: int = 0
    images: int = 0
    frames: int = 0


@dataclass
class Budget:
    """Limits of one batch plus a running state for incremental (greedy) use."""

    max_tokens: int
    mode: str = "pack"
    max_patches: int | None = None
    max_images: int | None = None
    max_samples: int | None = None
    attn_weight: float = 0.0
    # after attn_weight so positional Budget(...) calls written before it keep their meaning
    max_frames: int | None = None
    # running state of the batch being built (add / exceeded / reset)
    n: int = field(default=0, compare=False)
    sum_tokens: int = field(default=0, compare=False)
    sum_sq_tokens: int = field(default=0, compare=False)
    longest: int = field(default=0, compare=False)
    sum_patches: int = field(default=0, compare=False)
    sum_images: int = field(default=0, compare=False)
    sum_frames: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"budget mode must be one of {MODES}, got {self.mode!r}")
        if int(self.max_tokens) != self.max_tokens or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        for name in ("max_patches", "max_images", "max_frames", "max_samples"):
            v = getattr(self, name)
            if v is not None and (int(v) != v or v <= 0):
                raise ValueError(f"{name} must be None or a positive integer, got {v!r}")
        if not (math.isfinite(self.attn_weight) and self.attn_weight >= 0):
            raise ValueError(f"attn_weight must be a finite number >= 0, got {self.attn_weight!r}")

    @classmethod
    def from_config(cls, cfg: Any) -> Budget:
        """Build from ``config.BudgetConfig`` (planner-only fields are ignored)."""
        return cls(max_tokens=cfg.max_tokens, mode=cfg.mode, max_patches=cfg.max_patches,
                   max_images=cfg.max_images, max_samples=cfg.max_samples,
                   attn_weight=float(cfg.attn_weight), max_frames=getattr(cfg, "max_frames", None))

    # ------------------------------------------------------------ arithmetic
    def row_cost(self, length: int) -> float:
        """Token cost of one padded row of ``length`` (pad mode, per row)."""
        return length + self.attn_weight * length * length if self.attn_weight else length

    def token_cost(self, sum_tokens: int, sum_sq_tokens: int, n: int, longest: int) -> float:
        """The number compared with max_tokens, from a batch's aggregates."""
        if self.mode == "pack":
            return sum_tokens + self.attn_weight * sum_sq_tokens if self.attn_weight else sum_tokens
        return n * self.row_cost(longest)

    def violations(self, tokens: Sequence[int], patches: Sequence[int] | None = None,
                   images: Sequence[int] | None = None, frames: Sequence[int] | None = None) -> list[str]:
        """Exact check of an explicit batch: the list of broken limits ([] = fits)."""
        t = [int(x) for x in tokens]
        cost = self.token_cost(sum(t), sum(x * x for x in t), len(t), max(t, default=0))
        out = []
        if cost > self.max_tokens:
            out.append(f"tokens cost {cost} > {self.max_tokens}")
        p = sum(int(x) for x in patches) if patches is not None else 0
        m = sum(int(x) for x in images) if images is not None else 0
        f = sum(int(x) for x in frames) if frames is not None else 0
        if self.max_patches is not None and p > self.max_patches:
            out.append(f"patches {p} > {self.max_patches}")
        if self.max_images is not None and m > self.max_images:
            out.append(f"images {m} > {self.max_images}")
        if self.max_frames is not None and f > self.max_frames:
            out.append(f"frames {f} > {self.max_frames}")
        if self.max_samples is not None and len(t) > self.max_samples:
            out.append(f"samples {len(t)} > {self.max_samples}")
        return out

    def fits_alone(self, cost: SampleCost) -> bool:
        return not self.violations([cost.tokens], [cost.patches], [cost.images], [cost.frames])

    # ------------------------------------------------ vectorized planner helpers
    def token_sizes(self, tokens: np.ndarray) -> np.ndarray:
        """Per-sample additive pack-mode cost: int64 when exact, float64 with attn_weight."""
        t = np.asarray(tokens, dtype=np.int64)
        if not self.attn_weight:
            return t
        tf = t.astype(np.float64)
        return tf + self.attn_weight * tf * tf

    def token_capacity(self) -> float | int:
        """Capacity a planner compares summed ``token_sizes`` with (see _FLOAT_SLACK)."""
        return self.max_tokens if not self.attn_weight else self.max_tokens * (1.0 - _FLOAT_SLACK)

    def pad_rows_cap(self, lengths: np.ndarray) -> np.ndarray:
        """Most rows a pad batch whose longest row is ``lengths[k]`` may hold (exact)."""
        rc = np.asarray(lengths, dtype=np.float64)
        rc = rc + self.attn_weight * rc * rc if self.attn_weight else rc
        with np.errstate(divide="ignore"):
            cap = np.where(rc > 0, np.floor(self.max_tokens / np.maximum(rc, 1e-300)), np.inf)
        big = self.max_samples if self.max_samples is not None else np.iinfo(np.int64).max // 4
        cap = np.minimum(cap, big).astype(np.int64)
        # floor(B / c) * c can round above B for float c; step down where it does.
        over = cap * rc > self.max_tokens
        cap[over] -= 1
        return cap

    # --------------------------------------------------- running-state API
    def add(self, cost: SampleCost) -> None:
        t = int(cost.tokens)
        self.n += 1
        self.sum_tokens += t
        self.sum_sq_tokens += t * t
        self.longest = max(self.longest, t)
        self.sum_patches += int(cost.patches)
        self.sum_images += int(cost.images)
        self.sum_frames += int(cost.frames)

    def current_cost(self) -> float:
        return self.token_cost(self.sum_tokens, self.sum_sq_tokens, self.n, self.longest)

    def exceeded(self) -> bool:
        """True when the running batch breaks any limit."""
        return bool(self.current_cost() > self.max_tokens
                    or (self.max_patches is not None and self.sum_patches > self.max_patches)
                    or (self.max_images is not None and self.sum_images > self.max_images)
                    or (self.max_frames is not None and self.sum_frames > self.max_frames)
                    or (self.max_samples is not None and self.n > self.max_samples))

    def reset(self) -> None:
        self.n = self.sum_tokens = self.sum_sq_tokens = self.longest = 0
        self.sum_patches = self.sum_images = self.sum_frames = 0

    def padded_cost(self) -> int:
        """Compute tokens the running batch occupies (schema.BATCH_PADDED_TOKENS):
        the whole budget for pack (a packed batch is one max_tokens sequence slot),
        rows * longest for pad. 0 for an empty batch."""
        if self.n == 0:
            return 0
        return int(self.max_tokens) if self.mode == "pack" else self.n * self.longest

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            if k not in {f.name for f in dataclasses.fields(self)}:
                raise KeyError(f"unknown Budget field {k!r}")
            setattr(self, k, v)
        self.__post_init__()

    def limits(self) -> Budget:
        """A copy with the same limits and an empty running state."""
        return Budget(self.max_tokens, self.mode, self.max_patches, self.max_images,
                      self.max_samples, self.attn_weight, self.max_frames)


def max_tokens_alone(budget: Any) -> int:
    """Largest sequence length T with T + attn_weight * T**2 <= max_tokens (a Budget or BudgetConfig):
    the longest sample that fits a batch alone (measure-time fitting truncates to it)."""
    m, w = int(budget.max_tokens), float(budget.attn_weight or 0.0)
    if w <= 0:
        return m
    t = int((-1 + math.sqrt(1 + 4 * w * m)) / (2 * w))
    while t + w * t * t > m:  # float rounding at the boundary
        t -= 1
    while (t + 1) + w * (t + 1) ** 2 <= m:
        t += 1
    return max(t, 0)
