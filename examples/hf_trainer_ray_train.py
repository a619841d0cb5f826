"""transformers.Trainer inside Ray Train, fed token-budget batches (ray_mmbatch/train/hf_trainer.py).

    python examples/hf_trainer_ray_train.py [--model CKPT_DIR] [--data DIR] [--workers 2] [--max-steps 8]

Generates a small image-text set (unless ``--data`` names one), plans it into packed token-budget
batches with Ray Data (``ingest.datasets``), and runs ``TokenBudgetTrainer`` (a
``transformers.Trainer``) on every Ray Train worker, each fed its own split through a
``BatchStream``: DDP over the workers, gradient accumulation, the loss normalized over all real
target tokens of a step, as the project's own loop does. ``--model`` takes a local Hugging Face
VLM checkpoint (Qwen2/2.5/3-VL, LLaVA); without it the small built-in model trains. Prints the
Trainer's per-step loss and where the trained weights are (the run's checkpoint). Joins the
cluster in RAY_ADDRESS if set, else starts Ray locally.
"""
from __future__ import annotations

import argparse
import json
import tempfile

import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from ray_mmbatch.config import Config, apply_overrides, flatten
from ray_mmbatch.train import ingest


def train_func(config: dict) -> None:
    """One Ray Train worker: the user's model and TrainingArguments, the project's batches."""
    import ray.train
    import torch
    from transformers import TrainingArguments

    from ray_mmbatch.models import get_backend, token_ids
    from ray_mmbatch.train.hf_trainer import BatchStream, TokenBudgetTrainer

    cfg = apply_overrides(Config(), flatten(config["cfg"]))
    torch.manual_seed(cfg.train.seed)
    model = get_backend(cfg).create_model(cfg, token_ids(cfg))  # with --model: the HF checkpoint
    args = TrainingArguments(
        output_dir=config["output_dir"], max_steps=config["max_steps"],  # a cap: the stream decides the end
        gradient_accumulation_steps=cfg.train.grad_accum, learning_rate=cfg.train.lr,
        lr_scheduler_type="constant", max_grad_norm=cfg.train.grad_clip, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=not torch.cuda.is_available(), ddp_find_unused_parameters=False,
        dataloader_num_workers=0, disable_tqdm=True, seed=cfg.train.seed)
    trainer = TokenBudgetTrainer(model=model, args=args, train_dataset=BatchStream(epochs=max(1, cfg.train.epochs)))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    metrics = {"steps": trainer.state.global_step, "losses": json.dumps(losses)}
    with tempfile.TemporaryDirectory() as d:  # the trained weights become the run's checkpoint (rank 0's copy)
        trainer.save_model(d)  # a collective under DDP: every rank calls it, rank 0 writes
        rank0 = ray.train.get_context().get_world_rank() == 0
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d) if rank0 else None)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="local HF checkpoint directory (default: the built-in model)")
    ap.add_argument("--data", default="", help="a dataset directory (default: generate 120 samples)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=2048)
    args = ap.parse_args(argv)

    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)  # RAY_ADDRESS, else local
    ray.data.DataContext.get_current().enable_progress_bars = False
    work = tempfile.mkdtemp(prefix="hf_trainer_example_")
    cfg = Config()
    if args.data:
        cfg.data.path = args.data
    else:
        from ray_mmbatch.synthetic.generate import generate_dataset

        generate_dataset(f"{work}/data", 120, "parquet", seed=0, shard_size=40, workers=1)
        cfg.data.path, cfg.data.format = f"{work}/data", "parquet"
    cfg.model.path = args.model
    cfg.budget.max_tokens, cfg.budget.window = args.max_tokens, 64
    cfg.train.grad_accum, cfg.train.lr, cfg.train.epochs = 2, 1e-3, 1  # set: not left to the mode (run/defaults.py)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"cfg": cfg.to_dict(), "output_dir": f"{work}/trainer", "max_steps": args.max_steps},
        scaling_config=ScalingConfig(num_workers=args.workers),
        datasets=ingest.datasets(cfg, epochs=1), dataset_config=ingest.data_config(),
        run_config=RunConfig(storage_path=f"{work}/ray", name="hf_trainer_example"))
    result = trainer.fit()
    losses = json.loads(result.metrics["losses"])
    print(f"HF Trainer in Ray Train: {result.metrics['steps']} steps on {args.workers} workers; "
          f"loss per step {[round(x, 4) for x in losses]}; weights in {result.checkpoint.path}")
    return result.metrics


if __name__ == "__main__":
    main()
