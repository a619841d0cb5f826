"""Pool sizes from the cluster and the resource pre-flight (pools.py), on node lists as ray.nodes() gives them."""
from __future__ import annotations

import pytest

from ray_mmbatch.config import Config, apply_overrides
from ray_mmbatch.dataflow.pools import ResourceError, alive_nodes, check_fits, pool_sizes


def _nodes(*specs) -> list[dict]:
    """ray.nodes()-shaped entries: (address, resources, alive)."""
    return alive_nodes([{"NodeID": f"{i:02d}" * 14, "NodeManagerAddress": a, "Resources": r, "Alive": alive}
                        for i, (a, r, alive) in enumerate(specs)])


HEAD = ("10.0.0.1", {"CPU": 0.0}, True)


def _cfg(**data) -> Config:
    cfg = Config()
    cfg.train.num_workers = 2
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def test_auto_pools_grow_with_the_data_nodes_and_leave_dead_nodes_out():
    cfg = _cfg(data_resource="preprocess")
    sizes = {}
    for cpus in (4, 8, 16):
        nodes = _nodes(HEAD, ("10.0.0.2", {"CPU": float(cpus), "preprocess": float(cpus)}, True),
                       ("10.0.0.3", {"CPU": 4.0}, True),  # the train node: not for preprocessing
                       ("10.0.0.4", {"CPU": 64.0, "preprocess": 64.0}, False))  # gone
        s = pool_sizes(cfg, nodes)
        check_fits(cfg, nodes, s)
        assert s.auto and s.slots == cpus
        assert s.measure[1] + s.materialize[1] <= max(2, cpus - 1)  # read + plan keep a slot
        assert s.materialize[1] >= s.measure[1]  # decode is most of the work
        sizes[cpus] = s
    assert sizes[4].measure[0] == sizes[4].materialize[0] == 1
    assert sizes[16].materialize[1] > sizes[8].materialize[1] > sizes[4].materialize[1]
    assert sizes[16].measure == (2, 3) and sizes[16].materialize == (2, 11)


def test_without_a_data_resource_the_train_workers_share_is_left_out():
    nodes = _nodes(("n", {"CPU": 8.0}, True))
    s = pool_sizes(_cfg(), nodes)
    assert s.slots == 6 and s.measure == (2, 2) and s.materialize == (2, 2)


def test_explicit_pools_that_cannot_be_placed_fail_naming_need_offer_and_flag():
    cfg = _cfg(data_resource="preprocess", preprocess_workers=2)
    nodes = _nodes(HEAD, ("10.0.0.2", {"CPU": 3.0, "preprocess": 3.0}, True), ("10.0.0.3", {"CPU": 2.0}, True))
    sizes = pool_sizes(cfg, nodes)
    assert not sizes.auto and sizes.measure == sizes.materialize == (2, 2)
    with pytest.raises(ResourceError) as e:
        check_fits(cfg, nodes, sizes)
    msg = str(e.value)
    assert "4.25 CPU slots" in msg and "offers 3" in msg and "10.0.0.2 (01010101): CPU 3, preprocess 3" in msg
    assert "--preprocess-workers" in msg
    check_fits(cfg, nodes, pool_sizes(_cfg(data_resource="preprocess"), nodes))  # auto fits: 1 + 1


def test_train_workers_that_cannot_be_placed_fail():
    cfg = _cfg()
    cfg.train.use_gpu, cfg.train.num_workers = True, 4
    nodes = _nodes(("gpu", {"CPU": 16.0, "GPU": 2.0}, True))
    with pytest.raises(ResourceError, match="4 Train workers need 1 CPU and 1 GPU each; only 2 fit"):
        check_fits(cfg, nodes, pool_sizes(cfg, nodes))


def test_auto_is_the_default_and_a_number_pins():
    cfg = Config()
    assert cfg.data.preprocess_workers is None
    assert apply_overrides(cfg, {"data.preprocess_workers": "6"}).data.preprocess_workers == 6
    assert apply_overrides(cfg, {"data.preprocess_workers": "auto"}).data.preprocess_workers is None


def test_train_workers_go_only_where_their_resource_is():
    """--train-resource: a Train worker needs one unit of it, so the free CPUs of other nodes do not count."""
    cfg = _cfg(data_resource="preprocess")
    cfg.train.worker_resource = "train"
    data = ("10.0.0.2", {"CPU": 8.0, "preprocess": 8.0}, True)
    one_slot = _nodes(HEAD, data, ("10.0.0.3", {"CPU": 4.0, "train": 1.0}, True))
    with pytest.raises(ResourceError,
                       match=r"one 'train' \(--train-resource\) each; only 1 fit .*CPU 4, preprocess 0, train 1"):
        check_fits(cfg, one_slot, pool_sizes(cfg, one_slot))
    two = _nodes(HEAD, data, ("10.0.0.3", {"CPU": 4.0, "train": 2.0}, True))
    check_fits(cfg, two, pool_sizes(cfg, two))
    cfg.train.worker_resource = ""  # without it the same cluster fits: the data node has CPUs to spare
    check_fits(cfg, one_slot, pool_sizes(cfg, one_slot))


def test_a_small_epoch_runs_each_pool_on_one_actor_and_a_pinned_size_stays():
    """At most SMALL_EPOCH samples (the listing's count): 1 + 1 actors, whatever the cluster offers; more, or
    an unknown count (WebDataset shards), sizes as before; --preprocess-workers N is never overridden."""
    from ray_mmbatch.dataflow.pools import SMALL_EPOCH

    nodes = _nodes(("n", {"CPU": 16.0}, True))
    small = pool_sizes(_cfg(), nodes, samples=SMALL_EPOCH)
    assert small.auto and small.measure == small.materialize == (1, 1)
    check_fits(_cfg(), nodes, small)
    for samples in (SMALL_EPOCH + 1, None):
        assert pool_sizes(_cfg(), nodes, samples=samples) == pool_sizes(_cfg(), nodes)
    assert pool_sizes(_cfg(), nodes).measure[0] == 2
    pinned = pool_sizes(_cfg(preprocess_workers=3), nodes, samples=10)
    assert pinned.measure == pinned.materialize == (3, 3) and not pinned.auto


def test_the_listing_counts_an_epoch_without_reading_images(tmp_path):
    """formats/units.listed_rows: Parquet and LLaVA counts come from the listing; WebDataset shards give None
    (exact) or SHARD_ROWS each; a blend gives its epoch's targets."""
    from ray_mmbatch.config import DataConfig
    from ray_mmbatch.formats.units import SHARD_ROWS, listed_rows, read_units
    from ray_mmbatch.synthetic.generate import generate_dataset

    for fmt, n in (("parquet", 40), ("llava", 30), ("webdataset", 20)):
        generate_dataset(str(tmp_path / fmt), n, fmt, seed=1, shard_size=10, workers=1)
        reader = read_units(str(tmp_path / fmt), DataConfig(path=str(tmp_path / fmt)))
        if fmt == "webdataset":
            assert listed_rows(reader) is None and listed_rows(reader, exact=False) == 2 * SHARD_ROWS
        else:
            assert listed_rows(reader) == n
    blend = apply_overrides(Config(), {"data.sources": [{"path": str(tmp_path / "parquet"), "weight": 1.0},
                                                        {"path": str(tmp_path / "llava"), "weight": 1.0}],
                                       "data.epoch_samples": 50}).data
    assert listed_rows(read_units("", blend)) == 50
