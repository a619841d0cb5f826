"""jobs/verify_packing.py and ray_mmbatch.local_batches on a tiny random Qwen2-VL checkpoint.

The job runs the real data path in-process (local_batches: read, measure through the
checkpoint's chat template, plan, decode, collate) and compares every target token's loss
in the planned batch with the same sample alone; a model fed the naive way (positions not
restarting per sample, so attention leaks across samples) must be flagged.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from ray_mmbatch.batching.collate import collate_pack, collate_pad
from ray_mmbatch.batching.layout import split_batch
from ray_mmbatch.synthetic.generate import generate_dataset
from tests.hf_checkpoints import make_qwen_checkpoint


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    ck = make_qwen_checkpoint(root / "ck", "qwen2_vl")
    generate_dataset(str(root / "data"), 36, "parquet", seed=5, shard_size=36)
    return ck, root / "data"


@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_verify_packing_job_passes_on_a_real_checkpoint(qwen_run, mode, capsys):
    import jobs.verify_packing as job

    ck, data = qwen_run
    rc = job.main(["--model", str(ck), "--data", str(data), "--mode", mode, "--max-tokens", "2048",
                   "--batches", "2", "--device", "cpu"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0, report
    assert report["ok"] and report["mode"] == [mode]
    assert report["batches"] == 2 and report["target_tokens"] > 100
    assert report["max_abs_diff"] < 1e-4
    if mode == "pack":
        assert report["samples"] > 2  # a real pack, not one sample per batch


def _break_isolation(model) -> None:
    """Positions that do not restart per sample: HF sees one long sequence, attention crosses samples."""
    import torch

    good = model._adapter

    def leaky(batch):
        kwargs = good(batch)
        if "position_ids" in kwargs and batch["mode"] == "pack":
            pos = kwargs["position_ids"].clone()
            pos[0] = torch.arange(pos.shape[-1])  # text positions run on: no sample boundary left
            kwargs["position_ids"] = pos
        return kwargs

    model._adapter = leaky


def test_verify_flags_a_feed_that_leaks_across_samples(qwen_run):
    from ray_mmbatch import hf, local_batches
    from ray_mmbatch.models import token_ids
    from ray_mmbatch.run.verify import verify

    ck, data = qwen_run
    cfg = hf.config_from_checkpoint(str(ck))
    cfg.data.path, cfg.budget.max_tokens = str(data), 2048
    model = hf.load_model(str(ck))
    _break_isolation(model)
    report = verify(model, local_batches(cfg, limit=2), token_ids(cfg)["pad_id"])
    assert not report["ok"] and report["max_abs_diff"] > 0.05, report


@pytest.fixture(scope="module")
def trained_adapter(qwen_run, tmp_path_factory):
    """A LoRA adapter as a run exports it, its lora_B drawn at random (PEFT starts it at 0, which would
    leave the model as the base and the check unable to fail on the adapter)."""
    import torch

    from ray_mmbatch import hf
    from ray_mmbatch.config import ModelConfig
    from ray_mmbatch.models import trainable as T

    ck, _ = qwen_run
    model = hf.load_model(str(ck))
    T.add_lora(model, ModelConfig(lora_rank=4, lora_alpha=8.0, lora_targets="language,projector"))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    return T.export_adapter(model, tmp_path_factory.mktemp("adapter") / "adapter", str(ck)), model


def test_verify_packing_with_an_adapter_compares_its_gradients(qwen_run, trained_adapter, capsys):
    """--adapter puts a finished run's adapter on --model: the loss check runs on that model, and the
    gradients of the LoRA weights (every one, A and B) match between the packed batch and each sample alone."""
    import jobs.verify_packing as job

    ck, data = qwen_run
    adapter, trained = trained_adapter
    rc = job.main(["--model", str(ck), "--adapter", str(adapter), "--data", str(data), "--mode", "pack",
                   "--max-tokens", "2048", "--batches", "2", "--device", "cpu"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["ok"], report
    assert report["max_abs_diff"] < 1e-4 and report["samples"] > 2
    n_lora = sum(1 for n, _ in trained.named_parameters() if "lora_" in n)
    assert report["grads"]["params"] == n_lora and report["grads"]["min_norm"] > 0
    assert report["grads"]["max_rel_diff"] < 1e-4
    assert report["lora"] == {"adapter": str(adapter), "r": 4, "alpha": 8.0, "targets": report["lora"]["targets"]}


def test_an_adapter_loads_as_trained_and_a_leaky_feed_fails_its_gradients(qwen_run, trained_adapter, tmp_path):
    import shutil

    import torch

    from ray_mmbatch import hf, local_batches
    from ray_mmbatch.models import token_ids
    from ray_mmbatch.models import trainable as T
    from ray_mmbatch.run.verify import verify

    ck, data = qwen_run
    adapter, trained = trained_adapter
    cfg = hf.config_from_checkpoint(str(ck))
    cfg.data.path, cfg.budget.max_tokens = str(data), 2048
    batch = next(iter(local_batches(cfg, limit=1)))
    base, model = hf.load_model(str(ck)), hf.load_model(str(ck))
    T.load_adapter(model, adapter)
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
    with torch.no_grad():
        want, got, plain = (m.eval().target_ce(m_batch) for m, m_batch in
                            ((trained, _torch(batch)), (model, _torch(batch)), (base, _torch(batch))))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)       # the adapter's weights, all of them
    assert (got - plain).abs().max() > 0.05                         # and they change the model

    _break_isolation(model)
    report = verify(model, local_batches(cfg, limit=2), token_ids(cfg)["pad_id"], grads=True)
    assert not report["ok"] and not report["grads"]["ok"] and report["grads"]["max_rel_diff"] > 1e-2, report

    from safetensors.torch import load_file, save_file

    short = tmp_path / "short"
    shutil.copytree(adapter, short)
    weights = load_file(str(short / T.LORA_FILE))
    weights.pop(sorted(weights)[0])
    save_file(weights, str(short / T.LORA_FILE))
    with pytest.raises(ValueError, match=r"does not fit this model: missing 1 "):
        T.load_adapter(hf.load_model(str(ck)), short)


def _torch(batch):
    from ray_mmbatch.train.step import batch_to_torch

    return batch_to_torch(batch, "cpu")


def test_lora_flags_put_fresh_adapters_on_the_model_verified(qwen_run, capsys):
    """--lora-rank as in training: lora_B starts at 0, yet the gradients of B are not 0 and are compared."""
    import jobs.verify_packing as job

    ck, data = qwen_run
    rc = job.main(["--model", str(ck), "--lora-rank", "4", "--data", str(data), "--mode", "pad",
                   "--max-tokens", "2048", "--batches", "1", "--device", "cpu"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["ok"], report
    assert report["grads"]["ok"] and report["grads"]["min_norm"] > 0 and report["lora"]["adapter"] is None


def test_a_flag_the_checkpoint_contradicts_is_one_line_and_exit_2(qwen_run, capsys):
    """As train refuses it (exit 2), not a traceback with exit 1, which means 'packing is not exact'."""
    import jobs.verify_packing as job

    ck, data = qwen_run
    rc = job.main(["--model", str(ck), "--patch-size", "16", "--data", str(data), "--batches", "1", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "contradicts the checkpoint" in err and "--patch-size" in err, err
    assert job.main(["--model", str(ck), "--adapter", str(ck), "--lora-rank", "4", "--data", str(data)]) == 2
    assert "leave out --lora-rank" in capsys.readouterr().err


def test_local_batches_cover_every_sample_once_within_budget(qwen_run):
    from ray_mmbatch import hf, local_batches

    ck, data = qwen_run
    cfg = hf.config_from_checkpoint(str(ck))
    cfg.data.path, cfg.budget.max_tokens = str(data), 1024
    seen, skipped = [], []
    for item in local_batches(cfg, with_skips=True):
        if "skipped" in item:
            skipped += [s.sample_id for s in item["skipped"]]
            continue
        seen += list(item["sample_ids"])
        assert item["input_ids"].shape == (1, int(item["real_tokens"]))
        assert int(item["real_tokens"]) <= 1024
    assert len(seen) == len(set(seen)) and not set(seen) & set(skipped)
    assert len(seen) + len(skipped) == 36


@pytest.mark.parametrize("collate", [collate_pack, collate_pad])
def test_split_batch_inverts_collate(collate):
    rng = np.random.default_rng(0)
    samples = []
    for i, (n, grids) in enumerate([(7, []), (12, [[1, 2, 4]]), (5, [[1, 2, 2], [1, 4, 2]])]):
        labels = rng.integers(0, 50, n).astype(np.int32)
        labels[-1] = -100
        p = int(sum(np.prod(g) for g in grids))
        samples.append({"sample_id": f"s{i}", "input_ids": rng.integers(0, 50, n).astype(np.int32),
                        "labels": labels, "patches": rng.integers(0, 255, (p, 12)).astype(np.uint8),
                        "grids": np.array(grids, np.int32).reshape(-1, 3)})
    batch = collate(samples, pad_id=0)
    back = split_batch(batch)
    assert [s["sample_id"] for s in back] == ["s0", "s1", "s2"]
    for a, b in zip(samples, back):
        for key in ("input_ids", "labels", "patches", "grids"):
            np.testing.assert_array_equal(a[key], b[key])
    again = collate(back, pad_id=0)
    for key in ("input_ids", "labels", "patches", "image_grid_thw", "position_ids"):
        np.testing.assert_array_equal(batch[key], again[key])
