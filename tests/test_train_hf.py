"""Ray Train on a user's Hugging Face checkpoint (a tiny random Qwen2-VL): train, stop, resume, export.

Two workers on the shared local cluster, with DDP and with FSDP2 (gloo on CPU). The run stops
at step 2, is re-run with the same output dir and resumes (model, optimizer and data position
restored) to step 4; every sample trained is trained once, and its checkpoints hold the trainable
weights only. DDP runs with ``--freeze vision`` and
``--eval-split 0.25 --eval-every 2`` (the held-out loss at steps 2 and 4, its ids never trained):
OUTPUT_DIR/model is a Hugging Face checkpoint that ``from_pretrained`` loads, whose vision
encoder equals the starting checkpoint's while the rest moved. FSDP2 runs LoRA
(``--lora-rank 4``): OUTPUT_DIR/adapter is a PEFT adapter gathered from the shards that
``PeftModel.from_pretrained`` loads on the starting checkpoint, and only adapter weights trained.
"""
from __future__ import annotations

import json

import pytest
import torch

from ray_mmbatch.config import Config
from ray_mmbatch.run.rundir import RunDir
from ray_mmbatch.synthetic.generate import generate_dataset
from ray_mmbatch.train import checkpoint as ckpt
from tests.hf_checkpoints import make_qwen_checkpoint

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_hf_qwen2_vl_trains_resumes_and_exports(ray_cluster, tmp_path, fsdp):
    from transformers import AutoModelForImageTextToText

    from ray_mmbatch.train.trainer import run_training

    ck = make_qwen_checkpoint(tmp_path / "ck", "qwen2_vl", initializer_range=0.02)
    generate_dataset(str(tmp_path / "data"), 60, "parquet", seed=9, shard_size=30)
    out = tmp_path / "run"

    def cfg(max_steps: int) -> Config:
        c = Config()
        c.model.path = str(ck)
        c.data.path, c.data.format = str(tmp_path / "data"), "parquet"
        c.budget.max_tokens, c.budget.window = 1024, 32
        c.train.num_workers, c.train.max_steps = 2, max_steps
        c.train.checkpoint_every = c.train.report_every = 2
        c.train.ledger, c.train.lr, c.train.warmup_steps = True, 1e-3, 1
        c.train.output_dir = str(out)
        c.train.fsdp = fsdp  # FSDP2 over gloo: sharded checkpoints per rank, full weights gathered to export
        if fsdp:
            c.model.lora_rank, c.model.lora_alpha = 4, 8.0
        else:
            c.model.freeze = "vision"
            c.data.eval_split, c.train.eval_every = 0.25, 2  # held out by id hash, evaluated on both ranks
        return c

    first = run_training(cfg(2))
    assert first["steps"] == 2
    summary = run_training(cfg(4))
    assert summary["steps"] == 4
    rows = [json.loads(ln) for p in sorted((out / RunDir.LEDGER).glob("rank*.jsonl"))
            for ln in p.read_text().splitlines()]
    assert {r["step"] for r in rows} == {1, 2, 3, 4}
    trained = [s for r in rows for s in r["sample_ids"]]
    assert trained and len(trained) == len(set(trained)), "a sample was trained twice across the resume"
    losses = [json.loads(ln)["loss"] for ln in (out / RunDir.METRICS).read_text().splitlines()]
    assert all(0 < x < 20 for x in losses)
    assert (summary["config"]["image"]["patch_size"] == 14
            and summary["config"]["text"]["image_token"] == "<|image_pad|>")

    # the checkpoints hold the trainable weights only (the frozen ones are rebuilt from ck at the restart)
    last = max((p.parent for p in out.rglob(ckpt.STATE)), key=lambda d: ckpt.load_state(d)["step"])
    if fsdp:
        from torch.distributed.checkpoint import FileSystemReader

        index = FileSystemReader(str(last)).read_metadata().state_dict_metadata
        keys = {k[len("model."):] for k in index if k.startswith("model.")}
        assert keys and all("lora_" in k for k in keys), sorted(keys)[:5]
    else:
        keys = set(torch.load(last / ckpt.MODEL, weights_only=True))
        assert not {k for k in keys if ".visual." in k and ".merger." not in k}, "a frozen weight was saved"
        assert {k for k in keys if ".visual.merger." in k} and {k for k in keys if "language_model" in k}
    record = ckpt.load_state(last)[ckpt.WEIGHTS]
    assert record["keys"] == len(keys) and record["frozen"]["elements"] > 0

    start = AutoModelForImageTextToText.from_pretrained(ck)
    assert 0 < summary["trainable_params"] < summary["total_params"]
    if fsdp:  # LoRA: the adapter, gathered from the shards, loads on the starting checkpoint
        from peft import PeftModel

        assert not (out / "model").exists()
        peft_model = PeftModel.from_pretrained(start, str(out / "adapter"))
        lora = {n: p for n, p in peft_model.named_parameters() if "lora_B" in n}
        assert lora and any(p.abs().max() > 0 for p in lora.values()), "lora_B starts at 0: it never trained"
        assert summary["trainable_params"] < summary["total_params"] / 10
        return
    evals = [json.loads(ln) for ln in (out / RunDir.EVAL).read_text().splitlines()]
    assert [e["step"] for e in evals] == [2, 4] and all(0 < e["eval_loss"] < 20 for e in evals)
    assert summary["eval_loss"] == pytest.approx(evals[-1]["eval_loss"])
    assert evals[0]["eval_loss"] != evals[1]["eval_loss"]  # the model trained in between
    held = [i for ln in (out / RunDir.EVAL_IDS).read_text().splitlines() for i in json.loads(ln)["ids"]]
    first_eval = held[: evals[0]["eval_samples"]]  # the first run's ranks; the resumed run adds them again
    assert len(first_eval) == len(set(first_eval)) == evals[0]["eval_samples"] > 0  # each on one rank, once
    assert set(held) == set(first_eval) and not set(held) & set(trained)  # the same split, never trained
    exported = AutoModelForImageTextToText.from_pretrained(out / "model")
    moved = {n for (n, a), (_, b) in zip(exported.named_parameters(), start.named_parameters())
             if not torch.equal(a, b)}
    assert moved, "the exported model equals the starting checkpoint: nothing was trained or exported"
    assert not {n for n in moved if ".visual." in n and ".merger." not in n}, "a frozen vision weight moved"
    assert {n for n in moved if ".visual.merger." in n}, "the projector trains with --freeze vision"
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "config.json"):
        assert (out / "model" / name).is_file(), name
