"""transformers.Trainer inside Ray Train on the project's batches (train/hf_trainer.py, issue 25):
on 2 DDP workers with gradient accumulation, the HF Trainer's weights and logged losses equal the
project's own optimizer step (train/step.py) on the same batches; the example runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ray_mmbatch.config import Config, apply_overrides, flatten
from ray_mmbatch.synthetic.generate import generate_dataset

ROOT = Path(__file__).resolve().parents[1]
GRAD_ACCUM = 2


def _both_loops(config: dict) -> None:
    """On each rank: this rank's batches once, then the HF Trainer and the project's step on them."""
    import ray.train
    import ray.train.torch
    import torch.distributed as dist
    from transformers import TrainingArguments

    from ray_mmbatch.models import get_backend, token_ids
    from ray_mmbatch.train import ingest
    from ray_mmbatch.train.hf_trainer import BatchStream, TokenBudgetTrainer
    from ray_mmbatch.train.step import optimizer_step

    cfg = apply_overrides(Config(), flatten(config["cfg"]))
    batches = list(ingest.iter_batches(epoch=0))  # lockstep: the same count on both ranks

    def fresh():
        torch.manual_seed(0)
        return get_backend(cfg).create_model(cfg, token_ids(cfg))

    # the project's own step: SGD, no clipping, groups of GRAD_ACCUM micro-batches
    ours = ray.train.torch.prepare_model(fresh())
    opt = torch.optim.SGD(ours.parameters(), lr=cfg.train.lr)
    our_losses = []
    for k in range(0, len(batches), GRAD_ACCUM):
        out = optimizer_step(ours, batches[k:k + GRAD_ACCUM], opt, None, cfg.train, "cpu")
        our_losses.append(out["loss"])

    theirs = fresh()
    hf_opt = torch.optim.SGD(theirs.parameters(), lr=cfg.train.lr)
    args = TrainingArguments(output_dir=config["out_dir"], max_steps=1000, gradient_accumulation_steps=GRAD_ACCUM,
                             max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                             ddp_find_unused_parameters=False, dataloader_num_workers=0, disable_tqdm=True)
    trainer = TokenBudgetTrainer(model=theirs, args=args, optimizers=(hf_opt, torch.optim.lr_scheduler.LambdaLR(
        hf_opt, lambda step: 1.0)), train_dataset=BatchStream(epochs=1, batches=lambda epoch: iter(batches)))
    trainer.train()
    hf_losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    diff = max(float((a - b).abs().max()) for a, b in zip(ours.module.state_dict().values(),
                                                          theirs.state_dict().values()))
    moved = max(float((a - b).abs().max()) for a, b in zip(fresh().state_dict().values(),
                                                           theirs.state_dict().values()))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"n_batches": len(batches), "hf_steps": trainer.state.global_step,
                                      "ours": our_losses, "hf": hf_losses, "diff": diff, "moved": moved,
                                      "targets": [int(b["target_tokens"]) for b in batches]})
    if dist.get_rank() == 0:
        Path(config["out"]).write_text(json.dumps(everyone))
    ray.train.report({"steps": trainer.state.global_step})


@pytest.mark.ray
@pytest.mark.slow
def test_hf_trainer_in_ray_train_equals_the_projects_step(ray_cluster, tmp_path):
    from ray import cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_mmbatch.train import ingest

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import a test module
    generate_dataset(str(tmp_path / "d"), 80, "parquet", seed=9, shard_size=40, workers=1)
    cfg = Config()
    cfg.data.path, cfg.data.format = str(tmp_path / "d"), "parquet"
    cfg.budget.max_tokens, cfg.budget.window = 1024, 32
    cfg.train.lr, cfg.train.grad_clip = 0.05, 0.0
    out = tmp_path / "ranks.json"
    TorchTrainer(_both_loops, train_loop_config={"cfg": cfg.to_dict(), "out": str(out), "out_dir": str(tmp_path / "t")},
                 scaling_config=ScalingConfig(num_workers=2), datasets=ingest.datasets(cfg, epochs=1),
                 dataset_config=ingest.data_config(),
                 run_config=RunConfig(storage_path=str(tmp_path / "ray"))).fit()
    ranks = json.loads(out.read_text())
    r0 = ranks[0]
    assert ranks[0]["n_batches"] == ranks[1]["n_batches"] >= 3
    # batches of unequal target counts: a per-micro-batch mean would weigh them wrongly
    assert len({t for r in ranks for t in r["targets"]}) > 2
    steps = -(-r0["n_batches"] // GRAD_ACCUM)
    assert r0["hf_steps"] == steps, "the Trainer must step every group, the last partial one too"
    assert len(r0["hf"]) == steps
    for ours, theirs in zip(r0["ours"], r0["hf"]):
        assert theirs == pytest.approx(ours, abs=1e-4)  # logged loss: the mean over all targets of the step
    for r in ranks:
        assert r["moved"] > 1e-3  # it trained
        assert r["diff"] < 1e-5, r  # the same weights: the same gradients, step by step


@pytest.mark.ray
@pytest.mark.slow
def test_example_runs(ray_cluster):
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_trainer_ray_train.py"), "--max-steps", "4"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("HF Trainer in Ray Train:"))
    assert "4 steps on 2 workers" in line, r.stdout


def test_batch_stream_is_one_epoch_per_pass_then_empty():
    from ray_mmbatch.train.hf_trainer import BatchStream

    seen = []
    stream = BatchStream(epochs=2, batches=lambda e: (seen.append(e) or [{"e": e, "k": k} for k in range(3)]))
    assert [b["k"] for b in stream] == [0, 1, 2]
    assert [b["e"] for b in stream] == [1, 1, 1]
    assert list(stream) == [] and seen == [0, 1]
    with pytest.raises(ValueError, match="epochs"):
        BatchStream(epochs=0)
