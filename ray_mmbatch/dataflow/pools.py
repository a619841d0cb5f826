"""Preprocessing pools sized from the cluster Ray has, and the resource pre-flight.

``data.preprocess_workers`` unset (``auto``, the default): the measure and materialize
actor pools may grow to the CPU slots the cluster offers for preprocessing, and start
small so they can shrink again when nodes leave::

    slots  = CPU of the nodes offering data.data_resource            (--data-resource set)
           | all CPU - num_workers * cpus_per_worker (Train's share)  (not set)
    usable = slots - TASK_RESERVE (Ray Data's short tasks, the plan actor)
    measure      (min 2, max ceil(usable * MEASURE_SHARE))
    materialize  (min 2, max usable - measure's max)              decode is most of the work
                 (min 1 each where 2 + 2 actors and the plan actor do not fit; max never below min)
    an epoch of at most SMALL_EPOCH samples (the listing's count): 1 + 1, and one payload holder

A small epoch's whole pass is less work than starting a second actor: a worker process's start and
imports cost ~1-1.5 CPU-seconds, measure ~0.5 ms and decode ~2.5 ms a sample (benchmarks/RESULTS.md,
"Training path"), so for 512 samples a second measure actor saves ~0.13 s of work and a second
materialize actor ~0.6 s, against its own start (and on a small machine, the CPU it takes from the rest).

``MEASURE_SHARE``: in the training path measure ran ~3.4 s of CPU against materialize's
~15 s for the same 6,000 samples (benchmarks/RESULTS.md "Training path"), ~1/5 of the work.
An explicit number pins both pools at that size (today's behaviour), and then
``check_fits`` stops the run before any stream starts when the pools, the read and plan
work and the Train workers cannot all be placed, naming what each needs, what each node
offers and the flag to change: a run never waits on resources it will not get.
Pure: takes the node list (``ray.nodes()`` shape), so it is tested without a cluster.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ray_mmbatch.config import Config

#: Share of the preprocessing slots measure may take (tokenize + image headers); the rest decode.
MEASURE_SHARE = 0.2
#: CPU slots auto sizing leaves free for Ray Data's short tasks (from_items, repartition) and the
#: plan actor; the read runs fused into the measure actors.
TASK_RESERVE = 1.25
#: Epochs of at most this many samples (as listed) run each pool on one actor (module header).
SMALL_EPOCH = 512
#: The one plan actor's CPU: planning a window takes milliseconds; it must not hold a whole slot.
PLAN_CPUS = 0.25


class ResourceError(RuntimeError):
    """The run's actors and workers cannot all be placed; str() says what to change."""


@dataclass(frozen=True)
class PoolSizes:
    measure: tuple[int, int]  # (min, max) actors
    materialize: tuple[int, int]
    slots: float  # CPU slots offered to preprocessing
    auto: bool


def alive_nodes(nodes: list[dict[str, Any]]) -> list[dict[str, float]]:
    """``ray.nodes()`` -> the resources of each alive node (name under "node")."""
    out = []
    for n in nodes:
        if n.get("Alive", n.get("alive", True)):
            res = dict(n.get("Resources", n.get("resources", {})))
            res["node"] = str(n.get("NodeID") or n.get("NodeManagerAddress") or len(out))  # unique key
            res["address"] = str(n.get("NodeManagerAddress", "?"))
            out.append(res)
    return out


def _train_cpus(cfg: Config) -> float:
    return cfg.train.num_workers * cfg.train.cpus_per_worker


def preprocess_slots(cfg: Config, nodes: list[dict[str, float]]) -> float:
    """CPU slots the cluster offers to preprocessing (see the module header)."""
    if cfg.data.data_resource:
        return float(sum(n.get("CPU", 0.0) for n in nodes if n.get(cfg.data.data_resource, 0.0) > 0))
    return max(0.0, sum(n.get("CPU", 0.0) for n in nodes) - _train_cpus(cfg))


def pool_sizes(cfg: Config, nodes: list[dict[str, float]], samples: int | None = None) -> PoolSizes:
    """The measure / materialize pool sizes for this cluster (explicit or auto). ``samples``: the epoch's
    sample count where the listing knows it (None: unknown, sized as a large epoch)."""
    slots = preprocess_slots(cfg, nodes)
    fixed = cfg.data.preprocess_workers
    if fixed is not None and int(fixed) > 0:
        n = int(fixed)
        return PoolSizes((n, n), (n, n), slots, auto=False)
    if samples is not None and samples <= SMALL_EPOCH:
        return PoolSizes((1, 1), (1, 1), slots, auto=True)
    usable = max(2, int(slots - TASK_RESERVE))
    floor = 2 if slots >= 4 + PLAN_CPUS else 1  # start at 2 + 2 where the slots hold them
    measure = max(floor, math.ceil(usable * MEASURE_SHARE))
    return PoolSizes((floor, measure), (floor, max(floor, usable - measure)), slots, auto=True)


def _describe(nodes: list[dict[str, float]], *resources: str) -> str:
    parts = []
    for n in nodes:
        extra = "".join(f", {r} {n.get(r, 0):g}" for r in resources if r)
        gpu = f", GPU {n['GPU']:g}" if n.get("GPU") else ""
        name = n["address"] if n["node"] == n["address"] else f"{n['address']} ({n['node'][:8]})"
        parts.append(f"{name}: CPU {n.get('CPU', 0):g}{gpu}{extra}")
    return "; ".join(parts) or "no alive node"


def check_fits(cfg: Config, nodes: list[dict[str, float]], sizes: PoolSizes) -> None:
    """Raise ResourceError when the smallest pools, the read / plan work and the Train workers
    cannot all be placed on this cluster at once."""
    need_pre = sizes.measure[0] + sizes.materialize[0] + PLAN_CPUS
    res = cfg.data.data_resource
    where = f"nodes offering '{res}'" if res else "the cluster"
    fix = ("Lower --preprocess-workers (or leave it unset: auto)" if not sizes.auto
           else f"Give {where} more CPU slots")
    # Train workers first, each on one node (they may share one with preprocessing)
    free = {n["node"]: n.get("CPU", 0.0) for n in nodes}
    gpus = {n["node"]: n.get("GPU", 0.0) for n in nodes}
    tres = cfg.train.worker_resource
    own = {n["node"]: n.get(tres, 0.0) for n in nodes} if tres else {}
    placed = 0
    order = sorted(nodes, key=lambda n: (n.get(res, 0.0) > 0) if res else 0)  # non-data nodes first
    for _ in range(cfg.train.num_workers):
        for n in order:
            name = n["node"]
            if free[name] >= cfg.train.cpus_per_worker and (
                    not cfg.train.use_gpu or gpus[name] >= cfg.train.gpus_per_worker) and (
                    not tres or own[name] >= 1.0):
                free[name] -= cfg.train.cpus_per_worker
                if cfg.train.use_gpu:
                    gpus[name] -= cfg.train.gpus_per_worker
                if tres:
                    own[name] -= 1.0
                placed += 1
                break
    if placed < cfg.train.num_workers:
        gpu = (f" and {cfg.train.gpus_per_worker:g} GPU" if cfg.train.use_gpu else "") + (
            f" and one '{tres}' (--train-resource)" if tres else "")
        raise ResourceError(
            f"{cfg.train.num_workers} Train workers need {cfg.train.cpus_per_worker:g} CPU{gpu} each; "
            f"only {placed} fit on this cluster ({_describe(nodes, res, tres)}). Lower --num-workers or add nodes.")
    pre_free = sum(free[n["node"]] for n in nodes if not res or n.get(res, 0.0) > 0)
    if pre_free < need_pre:
        raise ResourceError(
            f"preprocessing needs {need_pre:g} CPU slots on {where} (measure {sizes.measure[0]} + materialize "
            f"{sizes.materialize[0]} actors + {PLAN_CPUS:g} for the plan actor) after the "
            f"{cfg.train.num_workers} Train workers; it offers {pre_free:g} ({_describe(nodes, res)}). "
            f"{fix}.")
