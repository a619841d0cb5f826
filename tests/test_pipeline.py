"""The Ray Data stages end to end on a local cluster: read -> measure -> plan -> materialize.

Every sample id read arrives exactly once, either in one batch or in the skip lists
(with the reason the generator recorded); every batch is within every budget; the
same run twice gives the same batches in deterministic mode.
"""
from __future__ import annotations

import numpy as np
import pytest

from ray_mmbatch import schema as S
from ray_mmbatch.batching.collate import decode_batch
from ray_mmbatch.config import Config
from ray_mmbatch.data.errors import decode_skips
from ray_mmbatch.synthetic.generate import generate_dataset
from ray_mmbatch.train.trainer import tokenizer_ids

pytestmark = pytest.mark.ray


_DATASETS: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def bad_datasets(tmp_path_factory):
    """Good samples with every kind of broken / hostile sample mixed in, per format (made once)."""
    def make(fmt: str):
        if fmt not in _DATASETS:
            out = tmp_path_factory.mktemp(f"{fmt}_bad")
            _DATASETS[fmt] = out, generate_dataset(str(out), 160, fmt, seed=3, shard_size=50, bad_per_kind=1)
        return _DATASETS[fmt]
    return make


@pytest.fixture(scope="module")
def bad_webdataset(bad_datasets):
    return bad_datasets("webdataset")


def _cfg(path, fmt, **budget) -> Config:
    cfg = Config()
    cfg.data.path, cfg.data.format = str(path), fmt
    cfg.budget.window = 64
    for k, v in budget.items():
        setattr(cfg.budget, k, v)
    return cfg


def _run(cfg: Config, deterministic: bool = True):
    from ray_mmbatch.dataflow.pipeline import batch_dataset, set_deterministic

    set_deterministic(deterministic)
    try:
        return batch_dataset(cfg, tokenizer_ids(cfg)["pad_id"]).take_all()
    finally:
        set_deterministic(True)


def _check_batch(row, cfg: Config) -> dict:
    b = decode_batch(bytes(row[S.BATCH_PAYLOAD]))
    budget = cfg.budget
    n = len(b["sample_ids"])
    assert list(b["sample_ids"]) == list(row[S.BATCH_SAMPLE_IDS])
    lens = b["seq_lens"].astype(np.float64)
    if budget.mode == "pack":
        assert b["input_ids"].shape[0] == 1
        assert b["input_ids"].shape[1] == int(b["seq_lens"].sum())
        assert lens.sum() + budget.attn_weight * (lens ** 2).sum() <= budget.max_tokens
        assert b["cu_seqlens"][-1] == b["input_ids"].shape[1]
    else:
        assert b["input_ids"].shape[0] == n
        assert b["input_ids"].size <= budget.max_tokens
    if budget.max_patches is not None:
        assert len(b["patches"]) <= budget.max_patches
    if budget.max_images is not None:
        assert len(b["image_grid_thw"]) <= budget.max_images
    if budget.max_samples is not None:
        assert n <= budget.max_samples
    assert b["patches"].dtype == np.uint8
    assert int(row[S.BATCH_REAL_TOKENS]) == int(b["seq_lens"].sum())
    return b


@pytest.mark.parametrize("fmt,mode,extra,deterministic", [
    ("webdataset", "pack", {"max_patches": 3000, "max_images": 16}, True),       # default carry
    ("llava", "pad", {"max_samples": 8, "carry": 0.5}, True),
    ("parquet", "pack", {"max_images": 16, "attn_weight": 1e-4, "carry": 0.0}, True),  # stateless plan
    ("parquet", "pad", {"carry": 0.5}, False),  # carry with no order guarantee (end row may come early)
])
def test_every_sample_once_within_budget(ray_cluster, bad_datasets, fmt, mode, extra, deterministic):
    path, manifest = bad_datasets(fmt)
    assert len(set(manifest["bad"].values())) >= 9 and manifest["valid_unusual"]
    cfg = _cfg(path, fmt, mode=mode, max_tokens=2048, **extra)
    rows = _run(cfg, deterministic)
    trained, skipped = [], {}
    for row in rows:
        if int(row[S.BATCH_N_SAMPLES]):
            trained += list(_check_batch(row, cfg)["sample_ids"])
        for rec in decode_skips(row[S.BATCH_SKIPPED]):
            assert rec.sample_id not in skipped, f"{rec.sample_id} reported twice"
            assert rec.position >= 0 and rec.unit_rows > 0, rec  # a resume must know it is done
            skipped[rec.sample_id] = rec.reason
    assert len(trained) == len(set(trained)), "a sample was batched twice"
    assert not set(trained) & set(skipped)
    assert sorted(trained + list(skipped)) == sorted(manifest["ids"]), "a sample was lost"
    for sid, reason in manifest["bad"].items():
        if sid in manifest["bad_conditions"]:
            continue
        assert skipped.get(sid) == reason, (sid, skipped.get(sid), reason)
    too_many = [s for s, r in manifest["bad"].items() if r == S.SKIP_TOO_MANY_IMAGES]
    for sid in too_many:  # 50 images: over max_images=16 in pack mode, fine in pad mode (no image budget)
        assert (sid in skipped) == ("max_images" in extra)
    assert set(manifest["valid_unusual"]) <= set(trained)
    good = set(manifest["ids"]) - set(manifest["bad"])
    assert good <= set(trained) | {s for s, r in skipped.items() if r == S.SKIP_OVERSIZE}


def test_deterministic_mode_repeats_batches(ray_cluster, bad_webdataset):
    path, _ = bad_webdataset
    cfg = _cfg(path, "webdataset", mode="pack", max_tokens=2048)
    first = [(r[S.BATCH_ID], list(r[S.BATCH_SAMPLE_IDS])) for r in _run(cfg)]
    second = [(r[S.BATCH_ID], list(r[S.BATCH_SAMPLE_IDS])) for r in _run(cfg)]
    assert first == second
    assert len({bid for bid, _ in first}) == len(first), "batch ids must be unique"


def test_payload_memory_cap_spills_without_changing_batches(ray_cluster, bad_webdataset):
    """A payload cap far below the data (0.5 MB for ~4 MB of images): the holders spill to
    disk, never hold more than the cap in memory, and the batches are the unbounded run's."""
    from ray_mmbatch.dataflow.pipeline import batch_dataset, set_deterministic

    path, _ = bad_webdataset
    cfg = _cfg(path, "webdataset", mode="pack", max_tokens=2048)
    set_deterministic(True)
    pad_id = tokenizer_ids(cfg)["pad_id"]
    unbounded = [(r[S.BATCH_ID], list(r[S.BATCH_SAMPLE_IDS])) for r in batch_dataset(cfg, pad_id).take_all()]
    cfg.data.payload_memory_mb, cfg.data.measure_batch = 0.5, 8  # puts of ~8 images: some fit, some spill
    ds, payloads = batch_dataset(cfg, pad_id, return_payloads=True)
    bounded = [(r[S.BATCH_ID], list(r[S.BATCH_SAMPLE_IDS])) for r in ds.take_all()]
    assert bounded == unbounded
    stats = payloads.stats()
    assert sum(s["rows_put"] for s in stats) > 100
    assert sum(s["rows_put"] for s in stats) > sum(s["spilled_rows"] for s in stats) > 0, stats
    assert sum(s["spill_reads"] for s in stats) >= sum(s["spilled_rows"] for s in stats)
    assert all(s["peak_held_bytes"] <= s["cap_bytes"] and s["peak_bytes"] <= 1.25 * s["cap_bytes"]
               for s in stats), stats
    assert all(s["held_rows"] == 0 for s in stats), "rows left behind after the pass"


def test_resume_filter_drops_consumed_samples_before_planning(ray_cluster, bad_webdataset):
    from ray_mmbatch.data.position import DataPosition
    from ray_mmbatch.dataflow.pipeline import batch_dataset, set_deterministic

    path, _ = bad_webdataset
    cfg = _cfg(path, "webdataset", mode="pack", max_tokens=2048)
    set_deterministic(True)
    pad_id = tokenizer_ids(cfg)["pad_id"]
    rows = batch_dataset(cfg, pad_id).take_all()
    full = [list(r[S.BATCH_SAMPLE_IDS]) for r in rows]
    consumed = [sid for batch in full[::3] for sid in batch]
    # the data position a checkpoint would hold: epoch 0 trained full[::3], epoch 1 full[1]
    position = DataPosition()
    for epoch, trained in ((0, rows[::3]), (1, rows[1:2])):
        for r in trained:
            n = int(r[S.BATCH_N_SAMPLES])
            position.add(epoch, r[S.BATCH_POSITIONS][:n], r[S.BATCH_POSITION_UNIT_ROWS][:n])
    state = position.state_dict()
    rest = [sid for r in batch_dataset(cfg, pad_id, position=state).take_all() for sid in r[S.BATCH_SAMPLE_IDS]]
    assert consumed and rest
    assert sorted(rest + consumed) == sorted(sid for batch in full for sid in batch)
    assert not set(rest) & set(consumed)
    # epoch 1 has its own record: what epoch 0 trained is all there again
    epoch1 = batch_dataset(cfg, pad_id, position=state, epoch=1).take_all()
    assert all(r[S.BATCH_ID].startswith("e1/") for r in epoch1)
    assert sorted(s for r in epoch1 for s in r[S.BATCH_SAMPLE_IDS]) == sorted(
        set(sid for batch in full for sid in batch) - set(full[1]))


def test_carry_plans_across_windows_in_ray(ray_cluster, bad_webdataset):
    """The carry stage really holds batches back across windows: fewer batches, more fill
    than planning each window on its own, over exactly the same samples."""
    path, _ = bad_webdataset
    plans = {}
    for carry in (0.0, 0.5):
        cfg = _cfg(path, "webdataset", mode="pack", max_tokens=2048, carry=carry)
        cfg.budget.window = 32
        cfg.data.shuffle = "units"  # no buffer: windows of the stream as read, so carry 0 plans each alone
        rows = [r for r in _run(cfg) if int(r[S.BATCH_N_SAMPLES])]
        plans[carry] = (sorted(s for r in rows for s in r[S.BATCH_SAMPLE_IDS]), len(rows),
                        sum(int(r[S.BATCH_REAL_TOKENS]) for r in rows)
                        / sum(int(r[S.BATCH_PADDED_TOKENS]) for r in rows))
    assert plans[0.5][0] == plans[0.0][0]
    assert plans[0.5][1] < plans[0.0][1], plans
    assert plans[0.5][2] > plans[0.0][2]


def test_restarted_carry_actor_fails_loudly(ray_cluster):
    """A plan actor that Ray restarted has lost its carry: it must raise, not go on short."""
    import ray

    from ray_mmbatch.dataflow.stages import CarryPlanStage

    @ray.remote(max_restarts=1, max_task_retries=0)
    class Host:
        def __init__(self):
            self.stage = CarryPlanStage(Config().budget, 0, 0)

        def plan(self, batch):
            return self.stage(batch)

        def pid(self):
            import os
            return os.getpid()

    empty = {S.SAMPLE_ID: np.array([], dtype=object), S.SKIP_REASON: np.array([], dtype=object)}
    host = Host.remote()
    assert ray.get(host.plan.remote(empty))[S.BATCH_ID] == []
    ray.kill(host, no_restart=False)
    with pytest.raises(Exception, match="carry plan actor was restarted"):
        for _ in range(50):  # calls fail with ActorDiedError until the restart is done
            try:
                ray.get(host.plan.remote(empty))
            except ray.exceptions.RayActorError:
                import time
                time.sleep(0.2)


def _trained_order(rows) -> tuple[list[str], list[int]]:
    """(sample ids, read positions) in the order the batches deliver them (positions grow with the listing)."""
    ids, positions = [], []
    for r in rows:
        n = int(r[S.BATCH_N_SAMPLES])
        ids += list(r[S.BATCH_SAMPLE_IDS])
        positions += [int(p) for p in r[S.BATCH_POSITIONS][:n]]
    return ids, positions


@pytest.mark.parametrize("fmt", ["parquet", "llava"])
def test_every_epoch_is_shuffled_by_default_and_seeded(ray_cluster, bad_datasets, fmt):
    """The default order is no trace of the listing in epoch 0 already; the same seed repeats
    it, another epoch or seed changes it; --shuffle none keeps file order (debugging)."""
    from ray_mmbatch.batching.mixing import rank_correlation
    from ray_mmbatch.dataflow.local import local_batches
    from ray_mmbatch.dataflow.pipeline import batch_dataset

    path, _ = bad_datasets(fmt)
    cfg = _cfg(path, fmt, mode="pack", max_tokens=2048)
    pad_id = tokenizer_ids(cfg)["pad_id"]
    ids, pos = _trained_order(_run(cfg))
    assert len(ids) == len(set(ids)) > 100
    assert abs(rank_correlation(pos)) < 0.3, "epoch 0 must not train in listing order"
    if fmt != "parquet":  # the seeds, epochs and modes below are the format's unit order: one format shows them
        return
    assert _trained_order(_run(cfg))[0] == ids  # same seed, data, settings: same order
    epoch1 = _trained_order(batch_dataset(cfg, pad_id, epoch=1).take_all())[0]
    assert sorted(epoch1) == sorted(ids) and epoch1 != ids
    cfg.data.shuffle = "none"
    assert rank_correlation(_trained_order(_run(cfg))[1]) > 0.8  # listing order, mixed only within windows
    # another seed and --shuffle units, in process: the Ray path's order is local_batches' (the next line checks
    # it), and each Ray run here costs a pipeline start
    cfg.data.shuffle = "samples"
    assert [i for b in local_batches(cfg) for i in b["sample_ids"]] == ids
    for seed, shuffle in ((1, "samples"), (0, "units")):
        cfg.train.seed, cfg.data.shuffle = seed, shuffle
        other = [i for b in local_batches(cfg) for i in b["sample_ids"]]
        assert sorted(other) == sorted(ids) and other != ids, (seed, shuffle)


def test_local_batches_follow_the_ray_paths_order(ray_cluster, bad_webdataset):
    """In-process and Ray give the same batches in the same order (shuffled, deterministic mode)."""
    from ray_mmbatch.dataflow.local import local_batches
    from ray_mmbatch.models import configure

    path, _ = bad_webdataset
    cfg = configure(_cfg(path, "webdataset", mode="pack", max_tokens=2048))  # as local_batches and train do
    cfg.data.shuffle_buffer = 48  # smaller than the stream: the swap phase runs, not just the flush
    ray_batches = [list(r[S.BATCH_SAMPLE_IDS]) for r in _run(cfg) if int(r[S.BATCH_N_SAMPLES])]
    local = [list(b["sample_ids"]) for b in local_batches(cfg)]
    assert local == ray_batches


def test_ray_data_actors_asked_for_at_connect_are_the_ones_the_executor_uses(ray_cluster):
    """warm_up_ray_data (called by trainer.connect) starts Ray Data's stats actor, autoscaling coordinator and
    actor location tracker ahead of the first dataset; the executor then finds those (named, get-if-exists)
    instead of starting its own: one of each, alive, after a dataset ran."""
    import ray
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    from ray_mmbatch.dataflow.pipeline import warm_up_ray_data

    names = ("_StatsActor", "_AutoscalingCoordinatorActor", "ActorLocationTracker")

    def alive() -> dict[str, str]:
        rows = [gcs_pb2.ActorTableData.FromString(t)
                for t in state._connect_and_get_accessor().get_actor_table(None, None)]
        live = [r for r in rows if r.class_name in names and r.state == gcs_pb2.ActorTableData.ALIVE]
        assert len(live) == len({r.class_name for r in live}), live  # one of each
        return {r.actor_id.hex(): r.class_name for r in live}

    handles = warm_up_ray_data()
    assert len(handles) == 3  # this Ray has all three where the warm-up looks (else it would only lose time)
    ray.get([h.__ray_ready__.remote() for h in handles], timeout=60)
    assert [h._actor_id.hex() for h in warm_up_ray_data()] == [h._actor_id.hex() for h in handles]  # get-if-exists
    assert ray.data.range(64).map_batches(lambda b: b).count() == 64
    assert alive() == {h._actor_id.hex(): n for h, n in zip(handles, names)}  # the executor used these
