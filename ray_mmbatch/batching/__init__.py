"""Batch-by-token-budget planning (pure: numpy only, no ray, no torch).

    costs -> plan_batches(costs, Budget(...)) -> list of index batches
    a stream of windows -> CarryPlanner(budget).feed(...) / .flush() -> batches
    samples of one batch -> collate_pack / collate_pad -> dict of arrays
    dict of arrays <-> encode_batch / decode_batch (no pickle)
"""
from .budget import Budget, OversizeError, SampleCost
from .carry import CarryPlanner
from .collate import collate_pack, collate_pad, decode_batch, encode_batch
from .plan import ALGORITHMS, DEFAULT_ALGORITHM, plan_batches, plan_batches_arrays
from .stats import batch_fill, plan_stats, plan_stats_arrays

__all__ = [
    "ALGORITHMS", "DEFAULT_ALGORITHM", "Budget", "CarryPlanner", "OversizeError", "SampleCost",
    "batch_fill", "collate_pack", "collate_pad", "decode_batch", "encode_batch",
    "plan_batches", "plan_batches_arrays", "plan_stats", "plan_stats_arrays",
]
