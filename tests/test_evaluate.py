"""The held-out set (data/split.py, train/evaluate.py, issue 27): the split is a stable hash of the
sample id, disjoint from training, each held-out sample on exactly one rank; the eval loss from
packed batches equals the mean over every target token of each sample run alone."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_mmbatch import local_batches
from ray_mmbatch.batching.collate import collate_pad
from ray_mmbatch.batching.layout import split_batch
from ray_mmbatch.config import Config
from ray_mmbatch.data.split import held_out, held_out_score
from ray_mmbatch.models import configure, get_backend, token_ids
from ray_mmbatch.synthetic.generate import generate_dataset
from ray_mmbatch.train.evaluate import evaluate


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval_data")
    manifest = generate_dataset(str(d), 60, "parquet", seed=8, shard_size=15, workers=1)
    return str(d), manifest


def _cfg(path: str, model_path: str = "", mode: str = "pack") -> Config:
    cfg = Config()
    cfg.data.path, cfg.data.format = path, "parquet"
    cfg.data.eval_split = 0.3
    cfg.budget.mode, cfg.budget.max_tokens, cfg.budget.window = mode, 2048, 32
    cfg.model.path = model_path
    return configure(cfg)


def _ids(batches) -> list[str]:
    return [str(s) for b in batches for s in b["sample_ids"]]


def test_split_is_a_stable_hash_disjoint_from_training(data):
    path, manifest = data
    cfg = _cfg(path)
    ev = _ids(local_batches(cfg, split="eval"))
    tr = _ids(local_batches(cfg, split="train"))
    assert ev and tr and not set(ev) & set(tr)
    assert sorted(ev + tr) == sorted(manifest["ids"])  # no broken rows in this set: everything is somewhere
    assert set(ev) == {s for s in manifest["ids"] if held_out_score(s) < 0.3}
    assert 0.1 < len(ev) / len(manifest["ids"]) < 0.5
    # the ranks' shares (read units rank, rank + world, ...): each held-out sample on exactly one rank
    shares = [_ids(local_batches(cfg, split="eval", shard=(r, 2))) for r in range(2)]
    assert all(shares) and sorted(shares[0] + shares[1]) == sorted(ev)
    # stable: a hash of the id alone, not of the order, seed or epoch
    cfg.train.seed = 5
    assert sorted(_ids(local_batches(cfg, split="eval"))) == sorted(ev)
    assert held_out(["a", "b"], 0.0).tolist() == [False, False]
    with pytest.raises(ValueError, match="fraction"):
        held_out(["a"], 1.0)
    with pytest.raises(ValueError, match="needs --eval-data or --eval-split"):
        no_eval = _cfg(path)
        no_eval.data.eval_split = 0.0
        next(local_batches(no_eval, split="eval"))


def test_eval_data_is_read_whole(data, tmp_path):
    path, _ = data
    other = generate_dataset(str(tmp_path / "ev"), 12, "parquet", seed=2, workers=1)
    cfg = _cfg(path)
    cfg.data.eval_data = str(tmp_path / "ev")
    assert sorted(_ids(local_batches(cfg, split="eval"))) == sorted(other["ids"])
    assert len(_ids(local_batches(cfg, split="train"))) == 60  # --eval-data: nothing held out of --data


@pytest.mark.parametrize("hf", [False, True], ids=["builtin", "qwen2_vl"])
def test_packed_eval_loss_equals_each_sample_alone(data, tmp_path, hf):
    path, _ = data
    ck = ""
    if hf:
        from tests.hf_checkpoints import make_qwen_checkpoint

        ck = str(make_qwen_checkpoint(tmp_path / "ck", "qwen2_vl"))
    cfg = _cfg(path, ck)
    ids = token_ids(cfg)
    torch.manual_seed(0)
    model = get_backend(cfg).create_model(cfg, ids)
    out = evaluate(model, cfg, rank=0, world=1, device="cpu")
    batches = list(local_batches(cfg, split="eval"))
    assert max(len(b["sample_ids"]) for b in batches) > 1  # packed: several samples share a row
    ce, n = 0.0, 0
    with torch.no_grad():
        for b in batches:
            for sample in split_batch(b):
                s_ce, s_n = model(collate_pad([sample], ids["pad_id"]), loss_only=True)
                ce, n = ce + float(s_ce), n + int(s_n)
    assert out["eval_target_tokens"] == n and out["eval_samples"] == len(out["ids"]) == len(_ids(batches))
    assert out["eval_loss"] == pytest.approx(ce / n, rel=1e-5)
    assert np.isfinite(out["eval_loss"]) and model.training  # evaluation leaves the model in train mode


def test_eval_cache_keeps_the_batches_after_the_first_pass_within_its_cap(data):
    from ray_mmbatch.train.evaluate import EvalCache

    path, _ = data
    cfg = _cfg(path)
    ids = token_ids(cfg)
    torch.manual_seed(0)
    model = get_backend(cfg).create_model(cfg, ids)
    first = evaluate(model, cfg, rank=0, world=1, device="cpu")
    caches = {}
    for cap_mb, reads in ((64, 1), (0, 3), (1e-4, 3)):  # kept; never kept; over the cap: read each time
        cache = caches[cap_mb] = EvalCache(cap_mb)
        outs = [evaluate(model, cfg, rank=0, world=1, device="cpu", cache=cache) for _ in range(3)]
        assert (cache.passes, cache.reads) == (3, reads), cap_mb
        assert all(o == first for o in outs)  # the same loss, counts and ids from kept batches
    torch.nn.init.normal_(next(model.parameters()))  # kept batches, new weights: a new loss
    again = evaluate(model, cfg, rank=0, world=1, device="cpu", cache=caches[64])
    assert caches[64].reads == 1 and again["eval_loss"] != first["eval_loss"] and again["ids"] == first["ids"]
