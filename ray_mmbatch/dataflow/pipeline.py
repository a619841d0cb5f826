"""The Ray Data graph of the training data path: read -> measure -> plan -> materialize.

::

    read_raw (read.py)               RAW rows, bytes only, each with its read position (unit, row),
                                     units in the epoch's seeded order (--shuffle); + one end-of-stream
                                     row when the plan stage shuffles or carries. Resume: units the epoch
                                     finished are not read, done rows of units in flight are dropped
                                     as they are read (data/position.py), so none is measured or decoded
      .map_batches(MeasureStage)     token ids, grids, costs, skip_reason; oversize policy applied.
                                     The measured row (image bytes included) waits in a payload
                                     holder (payloads.py); a LIGHT row goes on: id, costs, read
                                     position (~100 bytes, all Arrow)
      .map_batches(CarryPlanStage,   one PLAN row per batch (ids, payload keys: Arrow lists); light rows
                   one actor)        through a seeded shuffle buffer (batching/shuffle.py), windows of
                                     `budget.window` samples, under-filled batches held back into the
                                     next window (see below). No pixel passes through it
      .map_batches(MaterializeStage, one BATCH row per batch: fetch the payloads, decode + resize +
                   per block)        patchify + collate; blocks of MATERIALIZE_ROWS batches, which Train's
                                     split hands to the ranks as they ask

The stage objects and their pure glue live in stages.py (local.py runs the same ones in
one process); the end-of-stream row in formats/end_of_stream.py; where measured rows wait, in
payloads.py; the data check (inspect job), in inspection.py. `budget.carry = 0` with
`--shuffle units|none` plans every window on its own with a stateless task (plan_rows) and no end row. Fill per
window size, with and without carry: benchmarks/bench_packing.py (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import warnings
from typing import Any

import ray

from ray_mmbatch.config import Config
from ray_mmbatch.dataflow.pools import PLAN_CPUS
from ray_mmbatch.dataflow.stages import (
    CarryPlanStage,
    MaterializeStage,
    MeasureStage,
    blend_strata,
    epoch_unit_order,
    plan_rows,
    shuffle_buffer_size,
    uses_plan_actor,
)

MATERIALIZE_ROWS = 4  # planned batches per materialize task, and per block Train's split hands a rank


def stage_args(cfg: Config) -> dict[str, Any]:
    """Resources for CPU preprocessing stages (cluster: a custom resource pins them to CPU nodes)."""
    if cfg.data.data_resource:
        return {"resources": {cfg.data.data_resource: 0.001}}
    return {}


def _pool(size: tuple[int, int]):
    """An actor pool of (min, max) actors (pools.py sizes them from the cluster). The pools start
    at min, not 1: Ray Data's autoscaler grows a pool only once tasks queue up, which with a few
    large tasks (a read unit, a window's batches) it rarely saw: the whole pass ran on one actor."""
    return ray.data.ActorPoolStrategy(min_size=size[0], max_size=size[1])


def pools_for(cfg: Config, check: bool = False, samples: int | None = None):
    """The pool sizes for the connected cluster (pools.py); without a running Ray, the auto sizes of
    an empty cluster. ``check``: raise pools.ResourceError when they cannot be placed (the driver's
    pre-flight). A stream rebuilt after a node loss does not check: the node may be coming back,
    and a stream that never gets its actors ends at data.stall_timeout_s (train/stall.py).
    ``samples``: the epoch's sample count where it is known: a small epoch runs on one actor a pool."""
    from ray_mmbatch.dataflow.pools import alive_nodes, check_fits, pool_sizes

    nodes = alive_nodes(ray.nodes()) if ray.is_initialized() else []
    sizes = pool_sizes(cfg, nodes, samples)
    if check and nodes:
        check_fits(cfg, nodes, sizes)
    return sizes


def measured_dataset(cfg: Config, epoch: int = 0, end_marker: bool = False, done=None, payloads=None,
                     reader: tuple | None = None, pools=None):
    """read -> measure (-> oversize policy). One MEASURED row per sample read (+ the end row if asked).

    Every epoch reads its units (row groups / shards / chunks) in the order ``data.shuffle`` draws
    from (train.seed, epoch) (stages.epoch_unit_order). ``done`` (data.position.EpochPosition):
    what this epoch trained already, left out at read.
    ``payloads``: LIGHT rows out, the measured rows left in that store (see MeasureStage).
    """
    from ray_mmbatch.data.split import train_split
    from ray_mmbatch.dataflow.read import read_raw
    from ray_mmbatch.formats.units import for_epoch, listed_rows, read_units

    reader = for_epoch(reader or read_units(cfg.data.path, cfg.data), cfg.train.seed, epoch)  # a blend's copies
    order = epoch_unit_order(reader, cfg.data, cfg.train.seed, epoch)
    ds = read_raw(cfg.data.path, cfg.data, order=order, end_marker=end_marker, done=done, reader=reader,
                  split=train_split(cfg.data),  # --eval-split: the held-out ids are never read for training
                  timed=True)  # each row's share of its unit's read seconds (timing.py)
    return ds.map_batches(  # batch_size=None: one task per read block (MeasureStage.__call__ says why)
        MeasureStage, batch_size=None, batch_format="numpy",
        fn_constructor_args=(cfg.image, cfg.text, cfg.budget, payloads, cfg.data.measure_batch),
        compute=_pool((pools or pools_for(cfg, samples=listed_rows(reader))).measure),
        **stage_args(cfg),
    )


def batch_dataset(cfg: Config, pad_id: int, position: dict | None = None, epoch: int = 0,
                  return_payloads: bool = False, reader: tuple | None = None, samples: int | None = None):
    """The whole data path of one epoch for training: one BATCH row per planned batch.

    ``position`` (resume) is a checkpoint's data position (data.position.DataPosition's
    state_dict): what this epoch trained is left out as it is read, so a resumed run
    measures and decodes none of it and re-plans only what is left, whatever window
    boundaries Ray Data draws. Epoch e reads its units in a seeded order, mixes the samples in
    a seeded shuffle buffer (``data.shuffle``, batching/shuffle.py) and plans with seeds of its
    own; batch ids start with ``e{epoch}/``. ``return_payloads``: return
    (dataset, the payload store) to read the holders' ``stats()`` after the pass. ``reader``: the run's
    listing (formats/units.read_units), when the caller listed already (trainer.build_trainer does, once).
    ``samples``: the epoch's sample count when the caller counted it (else the listing's, where it has one):
    an epoch of at most pools.SMALL_EPOCH samples runs each pool on one actor.
    """
    from ray_mmbatch.data.position import DataPosition
    from ray_mmbatch.dataflow.payloads import RayPayloads
    from ray_mmbatch.formats.units import check_listing, listed_rows, listing_digest, read_units

    done = DataPosition.from_state(position).epochs.get(epoch)
    stateful = uses_plan_actor(cfg.budget, cfg.data)  # the plan stage shuffles or carries
    reader = reader or read_units(cfg.data.path, cfg.data)
    check_listing(position, listing_digest(reader[0]), cfg.data.path)  # the indices must mean the same units
    # measured rows wait in holder actors that live as long as this dataset; over the cap they spill (payloads.py)
    pools = pools_for(cfg, samples=listed_rows(reader) if samples is None else samples)
    payloads = RayPayloads(holders=max(1, pools.measure[1]), recent=max(1024, cfg.budget.window),
                           cap_bytes=cfg.data.payload_memory_mb * 2**20,
                           spill_dir=cfg.data.payload_spill_dir or None,
                           **stage_args(cfg))
    measured = measured_dataset(cfg, epoch, end_marker=stateful, done=done, payloads=payloads, reader=reader,
                                pools=pools)
    if stateful:  # one actor: one shuffle buffer and carry, fed the windows in stream order
        with warnings.catch_warnings():
            # Ray Data lets actor tasks run out of order by default; the carry needs windows in
            # the order they were submitted (stream order). Ray 2.60 takes this actor option only
            # through **ray_remote_args, which it flags as deprecated (pyproject pins ray < 2.64).
            warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
            plans = measured.map_batches(
                # batch_size=None: one measured block per call, planned as soon as it comes (the
                # actor cuts its own windows, growing from stages.FIRST_WINDOW): a batch_size of a
                # window would hold the first plan until a whole window was measured
                CarryPlanStage, batch_size=None, batch_format="numpy",
                fn_constructor_args=(cfg.budget, cfg.train.seed, epoch, shuffle_buffer_size(cfg.data),
                                     blend_strata(reader), cfg.data.shuffle_ramp),
                num_cpus=PLAN_CPUS,
                compute=ray.data.ActorPoolStrategy(size=1),
                allow_out_of_order_execution=False, **stage_args(cfg))
    else:
        plans = measured.map_batches(
            plan_rows, batch_size=cfg.budget.window, batch_format="numpy",
            fn_args=(cfg.budget, cfg.train.seed, epoch), num_cpus=PLAN_CPUS, **stage_args(cfg))
    # A plan task emits one block per window (hundreds of batches); a map task takes whole
    # blocks, so without this one materialize actor would decode a whole window while the
    # others idle. Blocks of MATERIALIZE_ROWS plan rows spread it over the pool as it streams.
    plans = plans.repartition(target_num_rows_per_block=MATERIALIZE_ROWS)
    ds = plans.map_batches(
        MaterializeStage, batch_size=None, batch_format="numpy",
        fn_constructor_args=(cfg.image, cfg.budget, pad_id, payloads),
        compute=_pool(pools.materialize),
        **stage_args(cfg))
    # Its blocks hold MATERIALIZE_ROWS batches, and Train's split hands out whole blocks: small
    # enough that no rank starves (streaming, no barrier). No repartition to one batch per block
    # after it: an actor op cannot fuse with the task op a repartition is, so that ran one Ray
    # task per block, and cost the 6,000-sample pass a quarter of its CPU (9 s of 38 wall,
    # benchmarks/RESULTS.md, issue 34).
    return (ds, payloads) if return_payloads else ds


def warm_up_ray_data() -> list:
    """Ask for Ray Data's own actors now (its stats actor, autoscaling coordinator, actor location tracker:
    each a worker process that imports Ray Data), without waiting: a run's first dataset starts them
    anyway, as the streaming executor starts; asked for when the driver connects, they start while it
    checks the data and builds the model. They are named, get-if-exists actors, so Ray Data finds these.
    Best effort: a Ray release that moved them only loses the head start (pyproject pins ray < 2.64).
    Returns the actor handles it got."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )
        from ray.data._internal.execution.node_trackers.actor_location import get_or_create_actor_location_tracker
        from ray.data._internal.stats import get_or_create_stats_actor
    except ImportError:
        return []
    handles = []
    for start in (get_or_create_stats_actor, get_or_create_autoscaling_coordinator,
                  get_or_create_actor_location_tracker):
        try:
            handles.append(start())
        except Exception:  # noqa: BLE001 - a head start only; the executor creates (and reports) them itself
            pass
    return handles


def set_deterministic(deterministic: bool) -> None:
    """Deterministic mode: preserve order so windows, plans and batch ids repeat run to run."""
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = bool(deterministic)
