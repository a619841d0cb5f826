"""Several datasets in one run (formats/sources.py, issue 27, first part): Parquet, WebDataset and
LLaVA sources with their own settings read as one stream, every sample once, ids unique across
sources that share ids; --data repeated and data.sources in a config; refusals name the source."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from ray_mmbatch import local_batches
from ray_mmbatch.cli import add_config_flags, config_from_args
from ray_mmbatch.config import Config
from ray_mmbatch.formats.sources import data_sources, parse_data_flag, source_of
from ray_mmbatch.formats.units import count_samples, listing_digest, read_units
from ray_mmbatch.synthetic.generate import generate_dataset


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """The same 20 samples (the same ids) as Parquet, WebDataset and LLaVA; the LLaVA images moved away."""
    root = tmp_path_factory.mktemp("sources")
    out = {}
    for fmt in ("parquet", "webdataset", "llava"):
        out[fmt] = generate_dataset(str(root / fmt), 20, fmt, seed=3, shard_size=10, workers=1)
    (root / "elsewhere").mkdir()
    shutil.move(str(root / "llava" / "images"), str(root / "elsewhere" / "images"))  # a source's own image_root
    return root, out


def _cfg(root) -> Config:
    cfg = Config()
    cfg.data.sources = [{"path": str(root / "parquet"), "format": "parquet", "name": "caps"},
                        {"path": str(root / "webdataset")},
                        {"path": str(root / "llava" / "data.json"), "format": "llava",
                         "image_root": str(root / "elsewhere")}]
    cfg.budget.max_tokens, cfg.budget.window = 2048, 16
    return cfg


def test_sources_read_as_one_stream_every_sample_once(three):
    root, manifests = three
    cfg = _cfg(root)
    names = [s.name for s in data_sources(cfg.data)]
    assert names == ["caps", "webdataset", "data"]
    batches = list(local_batches(cfg))
    ids = [str(s) for b in batches for s in b["sample_ids"]]
    assert len(ids) == len(set(ids)) == 60  # the sources share their inner ids; prefixed, none collides
    for name, fmt in zip(names, ("parquet", "webdataset", "llava")):
        assert sorted(i.split(":", 1)[1] for i in ids if source_of(i) == name) == sorted(manifests[fmt]["ids"])
    assert any(len(b["patches"]) for b in batches)  # the LLaVA images were found under its own image_root
    assert count_samples("", cfg.data) == 60
    units = read_units("", cfg.data)[0]
    assert {u["source"] for u in units} == {0, 1, 2}
    one = Config()
    one.data.path = str(root / "parquet")
    assert listing_digest(read_units(one.data.path, one.data)[0]) != listing_digest(units)


def test_data_flag_repeated_and_config_list(three, tmp_path):
    import argparse

    root, _ = three
    p = argparse.ArgumentParser()
    add_config_flags(p)
    p.add_argument("--verbose", action="store_true")
    one = config_from_args(p.parse_args(["--data", "/d/a"]))
    assert one.data.path == "/d/a" and one.data.sources == []
    many = config_from_args(p.parse_args(["--data", "/d/a", "--data", "s3://b/c#0.25"]))
    assert many.data.path == "" and many.data.sources == [{"path": "/d/a"}, {"path": "s3://b/c", "weight": 0.25}]
    assert parse_data_flag(["/d/x#y"]) == {"data.path": "/d/x#y"}  # not a weight: part of the path
    assert parse_data_flag(["/d/x#y", "/d/z"]) == {"data.sources": [{"path": "/d/x#y"}, {"path": "/d/z"}]}
    assert parse_data_flag(["/d/x#split=validation"]) == {"data.path": "/d/x", "data.split": "validation"}
    assert parse_data_flag(["/d/x#config=ai2d(cauldron,llava_format)#split=test#0.5"]) == {"data.sources": [
        {"path": "/d/x", "config": "ai2d(cauldron,llava_format)", "split": "test", "weight": 0.5}]}
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(f"data:\n  sources:\n    - {{path: {root / 'parquet'}, weight: 0.6}}\n"
                         f"    - {{path: {root / 'webdataset'}, name: shards, weight: 0.4}}\n")
    cfg = config_from_args(p.parse_args(["--config", str(yaml_file)]))
    assert [(s.name, s.weight) for s in data_sources(cfg.data)] == [("parquet", 0.6), ("shards", 0.4)]


@pytest.mark.parametrize("sources, match", [
    ([{"format": "parquet"}], "with a path"),
    ([{"path": "/a", "colour": 1}], r"unknown settings \['colour'\]"),
    ([{"path": "/a", "weight": 0}], "weight must be > 0"),
    ([{"path": "/a", "name": "x:y"}], "must not contain"),
])
def test_bad_sources_are_named(sources, match):
    cfg = Config()
    cfg.data.sources = sources
    with pytest.raises(ValueError, match=match):
        data_sources(cfg.data)
    cfg.data.sources, cfg.data.path = [{"path": "/a"}], "/b"
    with pytest.raises(ValueError, match="not both"):
        data_sources(cfg.data)


def test_same_folder_names_get_suffixes_and_preflight_names_a_broken_source(three, tmp_path):
    from ray_mmbatch.run.preflight import PreflightError, preflight

    root, _ = three
    cfg = Config()
    cfg.data.sources = [{"path": str(root / "parquet")}, {"path": str(root / "parquet")}]
    assert [s.name for s in data_sources(cfg.data)] == ["parquet", "parquet-2"]
    assert preflight(_cfg(root))["sources"] == ["caps", "webdataset", "data"]
    broken = _cfg(root)
    broken.data.sources[1]["path"] = str(tmp_path / "missing")
    with pytest.raises(PreflightError, match="source 'missing': data: dataset path .* does not exist"):
        preflight(broken)


@pytest.mark.ray
def test_through_ray_every_sample_once_and_inspect_per_source(ray_cluster, tmp_path):
    from ray_mmbatch import schema as S
    from ray_mmbatch.batching.collate import decode_batch
    from ray_mmbatch.data.errors import decode_skips
    from ray_mmbatch.dataflow.inspection import inspect_dataset
    from ray_mmbatch.dataflow.pipeline import batch_dataset
    from ray_mmbatch.models import configure, token_ids

    bad = generate_dataset(str(tmp_path / "bad"), 30, "parquet", seed=4, shard_size=15, workers=1, bad_per_kind=1)
    good = generate_dataset(str(tmp_path / "good"), 30, "webdataset", seed=4, shard_size=15, workers=1)
    cfg = Config()
    cfg.data.sources = [{"path": str(tmp_path / "bad"), "name": "bad"}, {"path": str(tmp_path / "good")}]
    cfg.budget.max_tokens, cfg.budget.window = 2048, 16
    cfg = configure(cfg)
    trained, skipped = [], []
    for row in batch_dataset(cfg, token_ids(cfg)["pad_id"]).iter_rows():
        skipped += [r.sample_id for r in decode_skips(row[S.BATCH_SKIPPED])]
        if int(row[S.BATCH_N_SAMPLES]):
            trained += [str(s) for s in decode_batch(bytes(row[S.BATCH_PAYLOAD]))["sample_ids"]]
    want = [f"bad:{i}" for i in bad["ids"]] + [f"good:{i}" for i in good["ids"]]
    assert len(trained) == len(set(trained)) and not set(trained) & set(skipped)
    assert sorted(trained + skipped) == sorted(want)
    assert skipped and all(s.startswith("bad:") for s in skipped)
    report = inspect_dataset(cfg)["sources"]
    assert report["good"]["skipped"] == 0 and report["good"]["samples"] == 30
    assert report["bad"]["skipped"] == len(skipped) and report["bad"]["samples"] == len(bad["ids"])
    cfg.data.sources[0]["weight"], cfg.data.sources[1]["weight"] = 0.2, 0.8  # a blend: every sample once still,
    blend = inspect_dataset(cfg)["sources"]  # and what each epoch draws from each source beside it
    assert blend["good"]["samples"] == 30 and blend["bad"]["samples"] == len(bad["ids"])
    total = 30 + len(bad["ids"])
    assert blend["bad"]["epoch_samples"] == round(0.2 * total) and blend["good"]["weight"] == 0.8
    assert blend["bad"]["epoch_samples"] + blend["good"]["epoch_samples"] == total


# ------------------------------------------------------------------ blend by weight
@pytest.fixture(scope="module")
def equal_three(tmp_path_factory):
    root = tmp_path_factory.mktemp("blend")
    for fmt in ("parquet", "webdataset", "llava"):
        generate_dataset(str(root / fmt), 100, fmt, seed=3, shard_size=25, workers=1)
    return root


def _blend(root, epoch_samples: int = 0) -> Config:
    cfg = Config()
    cfg.data.sources = [{"path": str(root / "parquet"), "weight": 0.6},
                        {"path": str(root / "webdataset"), "weight": 0.3},
                        {"path": str(root / "llava"), "weight": 0.1}]
    cfg.data.epoch_samples = epoch_samples
    cfg.budget.max_tokens, cfg.budget.window = 2048, 64
    return cfg


def _base(sample_id: str) -> str:
    return sample_id.rsplit("~", 1)[0]


def _worst_stretch_gap(ids: list[str]) -> int:
    """The largest |count of a source in a fifth of the epoch (60 samples) - its share of 60|."""
    return max(abs(sum(source_of(i) == name for i in ids[f * 60:(f + 1) * 60]) - round(60 * w))
               for f in range(5) for name, w in (("parquet", 0.6), ("webdataset", 0.3), ("llava", 0.1)))


def test_blend_counts_up_and_down_sampling_and_the_mix_of_every_fifth(equal_three):
    from collections import Counter

    cfg = _blend(equal_three)
    epochs = [[str(s) for b in local_batches(cfg, epoch=e) for s in b["sample_ids"]] for e in (0, 1)]
    for ids in epochs:
        assert len(ids) == len(set(ids)) == 300  # the epoch: as many as the sources hold together
        per = Counter(source_of(i) for i in ids)
        assert per == {"parquet": 180, "webdataset": 90, "llava": 30}  # exact shares of 0.6 / 0.3 / 0.1
        up = [_base(i) for i in ids if source_of(i) == "parquet"]
        assert len(set(up)) == 100 and max(Counter(up).values()) == 2  # every sample once, 80 of them twice
        assert _worst_stretch_gap(ids) <= 4  # the mix of every stretch, not just the totals
    # Over seeds: every fifth of the epoch within 4 samples of 60 of each share (0.067; the issue asks
    # 0.1 = 6), and 2-3 on average. A plain random order of these 300 misses by 7-8 (sd 3.8 at 0.6).
    # (Per seed the worst gap is 1-4 with or without the growing buffer, --shuffle-ramp 0 / 0.1:
    # measured over seeds 0-11, RESULTS.md issue 34; so no single seed is asserted at 3.)
    gaps = []
    for seed in range(6):
        cfg.train.seed = seed
        gaps.append(_worst_stretch_gap([str(s) for b in local_batches(cfg) for s in b["sample_ids"]]))
    assert max(gaps) <= 4 and sum(gaps) / len(gaps) <= 3, gaps
    cfg.train.seed = 0
    down = [{i for i in ids if source_of(i) == "llava"} for ids in epochs]
    assert len(down[0]) == 30 and down[0] != down[1]  # a seeded subset, another one each epoch
    again = [str(s) for b in local_batches(cfg, epoch=0) for s in b["sample_ids"]]
    assert again == epochs[0]  # seeded: the same epoch again
    small = [str(s) for b in local_batches(_blend(equal_three, epoch_samples=150)) for s in b["sample_ids"]]
    assert Counter(source_of(i) for i in small) == {"parquet": 90, "webdataset": 45, "llava": 15}
    assert count_samples("", _blend(equal_three).data) == 300


def test_blend_plan_and_weights_given_to_some_sources_only():
    from ray_mmbatch.formats.sources import BlendPlan, blended

    plan = BlendPlan([10, 3, 7], [1.0, 1.0, 1.0])
    assert plan.targets == [7, 7, 6] and sum(plan.targets) == 20  # largest remainders add up to the epoch
    for seed in (0, 1):
        for k, (base, threshold) in enumerate(plan.for_epoch(0, seed)):
            rows = plan.rows[k]
            extra = int((plan.scores(k, 0, range(rows), seed) < threshold).sum()) if threshold else 0
            assert base * rows + extra == plan.targets[k]
    chosen = [set(np.flatnonzero(plan.scores(0, 0, range(10), s) < plan.for_epoch(0, s)[0][1])) for s in (0, 1)]
    assert chosen[0] != chosen[1]  # another seed, another subset of the down-sampled source
    assert plan.for_epoch(0, 0) == plan.for_epoch(0) and plan.for_epoch(0, 1) != plan.for_epoch(0, 0)
    with pytest.raises(ValueError, match="no rows but a weight"):
        BlendPlan([5, 0], [1.0, 1.0])
    cfg = Config()
    cfg.data.sources = [{"path": "/a", "weight": 1.0}, {"path": "/b"}]
    with pytest.raises(ValueError, match=r"data.sources\[1\]: no weight"):
        blended(cfg.data)


@pytest.mark.ray
def test_blend_resumes_exactly_through_ray(ray_cluster, equal_three):
    """A blended epoch stopped half-way and rebuilt from the data position: every planned copy once."""
    import numpy as np

    from ray_mmbatch import schema as S
    from ray_mmbatch.batching.collate import decode_batch
    from ray_mmbatch.data.position import DataPosition
    from ray_mmbatch.dataflow.pipeline import batch_dataset
    from ray_mmbatch.models import configure, token_ids

    cfg = configure(_blend(equal_three))
    pad = token_ids(cfg)["pad_id"]

    def rows(position=None):
        return [r for r in batch_dataset(cfg, pad, position=position).iter_rows() if int(r[S.BATCH_N_SAMPLES])]

    first = rows()
    ids = lambda rs: [str(s) for r in rs for s in decode_batch(bytes(r[S.BATCH_PAYLOAD]))["sample_ids"]]  # noqa: E731
    full = ids(first)
    assert len(full) == len(set(full)) == 300
    half = first[: len(first) // 2]
    done = DataPosition()
    for r in half:
        done.add(0, np.asarray(r[S.BATCH_POSITIONS]), np.asarray(r[S.BATCH_POSITION_UNIT_ROWS]))
    rest = ids(rows(done.state_dict()))
    assert sorted(ids(half) + rest) == sorted(full)  # the same copies, none twice, none lost


def test_eval_split_over_a_blend_holds_out_samples_with_all_their_copies(equal_three):
    """--eval-split on a blend: a sample's copies (id~k) fall on its side of the split, so no copy of a
    held-out sample trains, and the held-out set is read once per sample, without the blend's weights
    (the down-sampled source's held-out samples are all there)."""
    from ray_mmbatch.data.split import held_out

    cfg = _blend(equal_three)
    cfg.data.eval_split = 0.3
    plain = _blend(equal_three)
    for e in plain.data.sources:
        del e["weight"]
    every = [str(s) for b in local_batches(plain) for s in b["sample_ids"]]
    assert len(every) == len(set(every)) == 300
    want = {s for s, h in zip(every, held_out(every, 0.3)) if h}
    evals = [str(s) for b in local_batches(cfg, split="eval") for s in b["sample_ids"]]
    assert sorted(evals) == sorted(want) and not any("~" in s for s in evals)
    assert {source_of(s) for s in evals} == {"parquet", "webdataset", "llava"}
    trained = {_base(str(s)) for e in (0, 1) for b in local_batches(cfg, epoch=e) for s in b["sample_ids"]}
    assert trained and not trained & want  # no copy of a held-out sample trains
    assert trained | want <= set(every)


def test_summary_per_source_counts_trained_and_skipped():
    """summary.json ``sources``: each source's trained samples (from the batch records the loop writes,
    one count per source per batch) and skips (as skipped.csv holds them), by the source names."""
    from ray_mmbatch.train.loop import _per_source
    from ray_mmbatch.train.trainer import source_summary

    cfg = Config()
    cfg.data.sources = [{"path": "/d/caps", "weight": 0.75}, {"path": "/d/ocr.json", "weight": 0.25}]
    batches = [["caps:1", "caps:2~1", "ocr:7"], ["caps:3"], ["ocr:8", "caps:2"]]
    recs = [{"step": k + 1, "n_samples": len(b), "sources": _per_source(b)} for k, b in enumerate(batches)]
    assert recs[0]["sources"] == {"caps": 2, "ocr": 1}
    skipped = {"ocr:9": ("corrupt_image", "x"), "ocr:10": ("missing_file", "y"), "caps:4": ("oversize", "z")}
    out = source_summary(cfg, recs, skipped)
    assert out["caps"] == {"weight": 0.75, "trained": 4, "trained_share": pytest.approx(4 / 6), "skipped": 1,
                           "skipped_by_reason": {"oversize": 1}}
    assert out["ocr"]["trained"] == 2 and out["ocr"]["skipped"] == 2
    assert out["ocr"]["skipped_by_reason"] == {"corrupt_image": 1, "missing_file": 1}


def test_epoch_samples_without_weights_is_refused_not_ignored(three):
    root, _ = three
    cfg = Config()
    cfg.data.path, cfg.data.epoch_samples = str(root / "parquet"), 50  # one dataset, no blend
    with pytest.raises(ValueError, match="--epoch-samples 50: the size of a blended epoch"):
        read_units(cfg.data.path, cfg.data)
    cfg.data.path, cfg.data.sources = "", [{"path": str(root / "parquet")}, {"path": str(root / "webdataset")}]
    with pytest.raises(ValueError, match="needs sources with weights"):
        read_units("", cfg.data)
    cfg.data.sources = [{"path": str(root / f), "weight": 1.0} for f in ("parquet", "webdataset")]
    cfg.data.epoch_samples = -1
    with pytest.raises(ValueError, match="count > 0"):
        read_units("", cfg.data)
    cfg.data.epoch_samples = 50
    assert sum(read_units("", cfg.data)[2]["blend"].targets) == 50
