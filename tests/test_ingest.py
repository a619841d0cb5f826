"""A user's own Ray Train loop fed by the project's batches (train/ingest.py, issue 25): two DDP
workers, every sample once, the same number of steps on every rank, the loss normalized over ranks;
and the HF forward kwargs of a packed batch drive the transformers model to each sample's CE alone."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from ray_mmbatch.config import Config, apply_overrides, flatten
from ray_mmbatch.synthetic.generate import generate_dataset


def _user_loop(config: dict) -> None:
    """What a user writes: their model, their optimizer, ingest.iter_batches."""
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    from ray_mmbatch.models import get_backend, token_ids
    from ray_mmbatch.train import ingest

    cfg = apply_overrides(Config(), flatten(config["cfg"]))
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(get_backend(cfg).create_model(cfg, token_ids(cfg)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, steps, norms = [], 0, []
    for batch in ingest.iter_batches(epoch=0):
        ce_sum, n_target = model(batch, loss_only=True)
        norm = ingest.target_normalizer([batch])
        (ce_sum * dist.get_world_size() / norm).backward()  # DDP averages over ranks
        opt.step()
        opt.zero_grad()
        ids += [str(s) for s in batch["sample_ids"]]
        steps, norms = steps + 1, norms + [norm]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"ids": ids, "steps": steps, "norms": norms})
    if dist.get_rank() == 0:
        with open(config["out"], "w") as f:
            json.dump(everyone, f)
    ray.train.report({"steps": steps})


@pytest.mark.ray
@pytest.mark.slow
def test_a_users_train_loop_gets_every_sample_once_in_lockstep(ray_cluster, tmp_path):
    from ray import cloudpickle
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_mmbatch.train import ingest

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import a test module
    manifest = generate_dataset(str(tmp_path / "d"), 90, "parquet", seed=4, shard_size=30, workers=1)
    cfg = Config()
    cfg.data.path, cfg.data.format = str(tmp_path / "d"), "parquet"
    cfg.budget.max_tokens, cfg.budget.window = 2048, 32
    out = tmp_path / "ranks.json"
    TorchTrainer(_user_loop, train_loop_config={"cfg": cfg.to_dict(), "out": str(out)},
                 scaling_config=ScalingConfig(num_workers=2), datasets=ingest.datasets(cfg, epochs=1),
                 dataset_config=ingest.data_config()).fit()
    ranks = json.loads(out.read_text())
    trained = [sid for r in ranks for sid in r["ids"]]
    assert len(trained) == len(set(trained)), "a sample reached two ranks"
    assert sorted(trained) == sorted(manifest["ids"]), "a sample was lost"  # no broken samples in this set
    assert ranks[0]["steps"] == ranks[1]["steps"] > 0  # lockstep: DDP would hang otherwise
    assert ranks[0]["norms"] == ranks[1]["norms"]  # one normalizer per step, over both ranks


def _resumable_loop(config: dict) -> None:
    """A user's loop with exactly-once resume: DataState in the checkpoint, a crash after step 2."""
    import tempfile

    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    from ray_mmbatch.models import get_backend, token_ids
    from ray_mmbatch.train import ingest

    cfg = apply_overrides(Config(), flatten(config["cfg"]))
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(get_backend(cfg).create_model(cfg, token_ids(cfg)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    restored = ray.train.get_checkpoint()
    attempt = 2 if restored else 1
    if restored:
        with restored.as_directory() as d:
            state = ingest.DataState.load(d)
    else:
        state = ingest.DataState()
    ids, step = [], 0
    for batch in ingest.iter_batches(epoch=0, state=state):
        ce_sum, _ = model(batch, loss_only=True)
        (ce_sum * dist.get_world_size() / ingest.target_normalizer([batch])).backward()
        opt.step()
        opt.zero_grad()
        ids += [str(s) for s in batch["sample_ids"]]
        step += 1
        if attempt == 1 and step == 2:
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, ids)
            with tempfile.TemporaryDirectory() as d:
                saved = state.save(d)  # every rank: it gathers the ranks' positions; rank 0 writes
                if dist.get_rank() == 0:
                    with open(config["out"] + ".1", "w") as f:
                        json.dump({"ids": [i for r in everyone for i in r], "state": saved}, f)
                ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d)
                                 if dist.get_rank() == 0 else None)
            raise RuntimeError("preempted after the checkpoint of step 2")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ids)
    if dist.get_rank() == 0:
        with open(config["out"] + ".2", "w") as f:
            json.dump([i for r in everyone for i in r], f)
    ray.train.report({"step": step})


@pytest.mark.ray
@pytest.mark.slow
def test_a_users_loop_resumes_exactly_once_with_data_state(ray_cluster, tmp_path):
    from ray import cloudpickle
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_mmbatch.train import ingest

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    manifest = generate_dataset(str(tmp_path / "d"), 120, "parquet", seed=5, shard_size=30, workers=1)
    cfg = Config()
    cfg.data.path, cfg.data.format = str(tmp_path / "d"), "parquet"
    cfg.budget.max_tokens, cfg.budget.window = 1024, 32
    out = str(tmp_path / "ids")
    TorchTrainer(_resumable_loop, train_loop_config={"cfg": cfg.to_dict(), "out": out},
                 scaling_config=ScalingConfig(num_workers=2), datasets=ingest.datasets(cfg, epochs=1),
                 dataset_config=ingest.data_config(),
                 run_config=RunConfig(storage_path=str(tmp_path / "ray"),
                                      failure_config=FailureConfig(max_failures=1))).fit()
    first = json.loads(open(out + ".1").read())
    second = json.loads(open(out + ".2").read())
    assert len(first["ids"]) > 0 and len(second) > 0
    assert not set(first["ids"]) & set(second), "a sample trained before the checkpoint was trained again"
    both = first["ids"] + second
    assert len(both) == len(set(both)) and sorted(both) == sorted(manifest["ids"]), "a sample lost or repeated"

    # a rebuilt run: datasets(cfg, state=...) leaves the trained rows out of the read itself
    resumed = ingest.datasets(cfg, epochs=1, state=ingest.DataState(first["state"]))
    from ray_mmbatch import schema as S
    from ray_mmbatch.batching.collate import decode_batch

    left = [str(s) for row in resumed[S.epoch_dataset_name(0)].iter_rows() if int(row[S.BATCH_N_SAMPLES])
            for s in decode_batch(bytes(row[S.BATCH_PAYLOAD]))["sample_ids"]]
    assert sorted(left) == sorted(set(manifest["ids"]) - set(first["ids"]))


def test_hf_forward_on_the_kwargs_equals_each_sample_alone_through_hf(tmp_path):
    """to_hf_inputs drives the transformers model itself: ``hf_model(**kwargs)`` on a packed batch of 10
    samples gives, at every target token, the CE of that sample run alone through HF's standard forward
    (input_ids, attention_mask of ones, its own pixel_values / image_grid_thw; family_harness.reference_ce),
    within TOL nats; the same row fed without the kwargs' position ids (one long sequence) misses by far."""
    import torch.nn.functional as F

    from ray_mmbatch import hf, local_batches
    from ray_mmbatch import schema as S
    from ray_mmbatch.models.hf_common import normalize_patches
    from ray_mmbatch.train import ingest
    from tests.family_harness import TOL, reference_ce
    from tests.hf_checkpoints import make_qwen_checkpoint

    path = make_qwen_checkpoint(tmp_path / "ckpt", "qwen2_vl")
    generate_dataset(str(tmp_path / "d"), 10, "parquet", seed=6, workers=1)
    cfg = hf.config_from_checkpoint(str(path))
    cfg.data.path, cfg.data.format = str(tmp_path / "d"), "parquet"
    model = hf.load_model(str(path)).eval()
    batch = next(iter(local_batches(cfg, limit=1)))
    assert batch["mode"] == "pack" and len(batch["sample_ids"]) > 1 and len(batch["image_grid_thw"])
    kwargs = ingest.to_hf_inputs(batch, model)
    assert "labels" not in kwargs and kwargs["use_cache"] is False
    labels = torch.as_tensor(batch["labels"][0], dtype=torch.long)
    at = labels != S.IGNORE_INDEX
    with torch.no_grad():
        logits = model.hf_model(**kwargs).logits[0]  # the transformers model, not the project's forward
        ours = F.cross_entropy(logits[at].float(), labels[at], reduction="none")
        ids, cu = torch.as_tensor(batch["input_ids"][0], dtype=torch.long), batch["cu_seqlens"]
        grids = torch.as_tensor(batch["image_grid_thw"], dtype=torch.long)
        starts = np.concatenate([[0], np.cumsum([int(g.prod()) for g in grids])])
        refs = []
        for i in range(len(batch["sample_ids"])):
            a, b = int(cu[i]), int(cu[i + 1])
            images = {}
            mine = np.flatnonzero(batch["image_sample_index"] == i)
            if len(mine):
                rows = np.concatenate([np.arange(starts[k], starts[k + 1]) for k in mine])
                images = {"pixel_values": normalize_patches(torch.as_tensor(batch["patches"][rows]),
                                                            cfg.image.image_mean, cfg.image.image_std,
                                                            cfg.image.temporal_patch_size),
                          "image_grid_thw": grids[mine],
                          "mm_token_type_ids": (ids[a:b] == model.hf_model.config.image_token_id).int()[None]}
            refs.append(reference_ce(model.hf_model, labels[a:b], ids[a:b], **images))
        reference = torch.cat(refs)
        assert ours.shape == reference.shape and len(reference) == int(batch["target_tokens"])
        assert float((ours - reference).abs().max()) < TOL
        flat = {k: v for k, v in kwargs.items() if k != "position_ids"}  # the control: HF's own M-RoPE of
        flat["mm_token_type_ids"] = (ids == model.hf_model.config.image_token_id).int()[None]  # one long sequence
        naive = F.cross_entropy(model.hf_model(**flat).logits[0][at].float(), labels[at], reduction="none")
        assert float((naive - reference).abs().max()) > 100 * TOL
    with pytest.raises(TypeError, match="loss_only"):
        ingest.to_hf_inputs(batch, torch.nn.Linear(2, 2))
