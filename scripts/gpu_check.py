#!/usr/bin/env python
"""GPU checks for ray_mmbatch, run whenever a GPU machine is lent (scripts/gpu_check.sh drives it).

    python scripts/gpu_check.py prepare DIR   # CPU side: the tiny checkpoints (steps 2-6) and batches
    python scripts/gpu_check.py run DIR       # GPU side: needs torch + transformers, not Ray

``prepare`` builds a tiny random Qwen2-VL checkpoint (tests/hf_checkpoints.py) and writes the
batches the real data path makes for it (ray_mmbatch.local_batches: read, measure through the
chat template, plan in pack and pad mode, decode, collate) as encoded batch files, so the GPU
side needs neither Ray nor the dataset. ``run`` then does, on cuda:0:

1. NCCL smoke: 2 processes on the one GPU (falls back to 1 if NCCL refuses two ranks on one
   device), DDP + the project's all_reduce helper on device tensors, one optimizer step each;
2. bf16 training of the tiny Qwen2-VL for 20 steps on the packed batches, flash_attention_2
   when flash_attn is installed (else sdpa): real tokens/s and peak GPU memory;
3. verify_packing in bf16 (tolerance 0.05 nats per token: bf16 rounding alone moved CE by
   2e-3 on CPU) and in fp32 with TF32 off (tolerance 1e-4), pack and pad;
4. a tiny InternVL (tests/hf_internvl_checkpoint.py, DIR/internvl): bf16 training for 20 steps
   and verify_packing in bf16, pack and pad (on flash_attention_2 its packed rows carry the
   explicit cu_seq_lens / max_length kwargs, hf_common.varlen_kwargs);
5. a tiny Gemma 3 (tests/hf_gemma3_checkpoint.py, DIR/gemma3; sdpa, its packed rows carry explicit
   per-layer masks, flash-attention is refused for it): the same as 4;
6. a tiny LLaVA-OneVision (tests/hf_llava_onevision_checkpoint.py, DIR/llava_onevision; anyres tiles,
   image_sizes per image and batch_num_images per packed sample): the same as 4.

A tiny SmolVLM (tests/hf_idefics3_checkpoint.py, DIR/smolvlm; image splitting: rows x cols views plus
the global view, row / col tokens in the text) gets the same as 4.

It prints one JSON object per check and a final summary; exit 1 if any check fails.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prepare(out: Path) -> None:
    from ray_mmbatch import local_batches
    from ray_mmbatch.batching.collate import encode_batch
    from ray_mmbatch.hf import config_from_checkpoint
    from ray_mmbatch.synthetic.generate import generate_dataset
    from tests.hf_checkpoints import make_qwen_checkpoint
    from tests.hf_gemma3_checkpoint import make_gemma3_checkpoint
    from tests.hf_idefics3_checkpoint import make_idefics3_checkpoint
    from tests.hf_internvl_checkpoint import make_internvl_checkpoint
    from tests.hf_llava_onevision_checkpoint import make_llava_onevision_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    generate_dataset(str(out / "data"), 240, "parquet", seed=1, shard_size=120)
    cks = [make_qwen_checkpoint(out / "ckpt", "qwen2_vl", initializer_range=0.02),
           make_internvl_checkpoint(out / "internvl" / "ckpt", initializer_range=0.02),
           make_gemma3_checkpoint(out / "gemma3" / "ckpt", initializer_range=0.02, image_size=224, patch=14,
                                  tokens_per_image=64),
           make_llava_onevision_checkpoint(out / "llava_onevision" / "ckpt", initializer_range=0.02)]
    cks.append(make_idefics3_checkpoint(out / "smolvlm" / "ckpt", "smolvlm", initializer_range=0.02, side=128,
                                        patch=16, splitting=True))
    for ck in cks:
        for mode in ("pack", "pad"):
            cfg = config_from_checkpoint(str(ck))
            cfg.data.path, cfg.budget.mode, cfg.budget.max_tokens = str(out / "data"), mode, 4096
            (ck.parent / mode).mkdir(exist_ok=True)
            for i, batch in enumerate(local_batches(cfg, limit=24)):
                batch.pop("batch_id", None)
                (ck.parent / mode / f"{i:03d}.mmb").write_bytes(encode_batch(batch))
    print(json.dumps({"prepared": str(out), "checkpoints": [str(ck) for ck in cks]}))


def _batches(d: Path, mode: str) -> list[dict]:
    from ray_mmbatch.batching.collate import decode_batch

    return [decode_batch(p.read_bytes()) for p in sorted((d / mode).glob("*.mmb"))]


def _model(ck: Path, device: str, attn: str = "auto"):
    from ray_mmbatch.config import Config
    from ray_mmbatch.hf import load_model

    cfg = Config()
    cfg.model.attn_implementation = attn
    cfg.train.use_gpu = device.startswith("cuda")
    return cfg, load_model(str(ck), cfg).to(device)  # load_model fills cfg from the checkpoint


def _nccl_worker(rank: int, world: int, d: str, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    from ray_mmbatch.train.step import all_reduce, build_optimizer, optimizer_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda:0"))
    try:
        cfg, model = _model(Path(d) / "ckpt", "cuda:0")
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
        opt, sched = build_optimizer(model, cfg.train, 10)
        total = all_reduce([1.0, float(rank)], torch.device("cuda:0"))
        batch = _batches(Path(d), "pack")[rank]
        m = optimizer_step(model, [batch], opt, sched, cfg.train, torch.device("cuda:0"))
        results[rank] = {"all_reduce": total, "loss": m["loss"]}
    finally:
        dist.destroy_process_group()


def check_nccl(d: Path) -> dict:
    import socket

    import torch.multiprocessing as mp

    for world in (2, 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        results = mp.Manager().dict()
        try:
            mp.spawn(_nccl_worker, args=(world, str(d), port, results), nprocs=world, join=True)
        except Exception as e:  # NCCL may refuse two ranks on one GPU ("Duplicate GPU detected")
            last = f"{type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}"
            continue
        losses = {r: v["loss"] for r, v in results.items()}
        ok = all(v["all_reduce"] == [float(world), float(sum(range(world)))] for v in results.values())
        same = len({round(v, 6) for v in losses.values()}) == 1  # the loss is global, so every rank agrees
        return {"check": "nccl", "world": world, "ok": ok and same, "losses": losses,
                "note": "" if world == 2 else f"2 ranks on one GPU refused: {last}"}
    return {"check": "nccl", "ok": False, "error": last}


def check_train(d: Path, steps: int = 20, device: str = "cuda:0") -> dict:
    import torch

    from ray_mmbatch.train.step import build_optimizer, optimizer_step

    device = torch.device(device)
    cuda = device.type == "cuda"
    cfg, model = _model(d / "ckpt", str(device))
    cfg.train.precision, cfg.train.warmup_steps = "bf16", 2
    opt, sched = build_optimizer(model, cfg.train, steps)
    batches = _batches(d, "pack")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    losses, real, t_steps = [], 0, 0.0
    for i in range(steps):
        m = optimizer_step(model, [batches[i % len(batches)]], opt, sched, cfg.train, device)
        losses.append(m["loss"])
        if i >= 2:  # the first steps include CUDA / kernel warm-up
            real += m["real_tokens"]
            t_steps += m["time_s"]
    return {"check": "train_bf16", "ok": all(x == x for x in losses) and losses[-1] < losses[0],
            "attn": model.hf_model.config.get_text_config()._attn_implementation, "steps": steps,
            "loss_first_last": [losses[0], losses[-1]], "tokens_per_s": real / max(t_steps, 1e-9),
            "peak_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None}


def check_verify(d: Path, device: str = "cuda:0", precisions=("bf16", "fp32"), name: str = "") -> list[dict]:
    import torch

    from ray_mmbatch.models import token_ids
    from ray_mmbatch.run.verify import verify

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False  # Qwen's patch embedding is a Conv3d
    out = []
    for precision in precisions:
        cfg, model = _model(d / "ckpt", device)
        for mode in ("pack", "pad"):
            r = verify(model, _batches(d, mode)[:6], token_ids(cfg)["pad_id"], device, precision)
            out.append({"check": f"{name}verify_{precision}_{mode}", **r})
    return out


def run(d: Path) -> int:
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 1
    t0 = time.time()
    results = [check_nccl(d), check_train(d), *check_verify(d)]
    if (d / "internvl" / "ckpt").is_dir():  # bf16 only: fp32 exactness is tests/test_models_internvl.py's
        results += [{**check_train(d / "internvl"), "check": "internvl_train_bf16"},
                    *check_verify(d / "internvl", precisions=("bf16",), name="internvl_")]
    else:
        results.append({"check": "internvl", "ok": False, "error": f"{d}/internvl not prepared: rerun prepare"})
    if (d / "gemma3" / "ckpt").is_dir():
        results += [{**check_train(d / "gemma3"), "check": "gemma3_train_bf16"},
                    *check_verify(d / "gemma3", precisions=("bf16",), name="gemma3_")]
    else:
        results.append({"check": "gemma3", "ok": False, "error": f"{d}/gemma3 not prepared: rerun prepare"})
    if (d / "llava_onevision" / "ckpt").is_dir():
        results += [{**check_train(d / "llava_onevision"), "check": "llava_onevision_train_bf16"},
                    *check_verify(d / "llava_onevision", precisions=("bf16",), name="llava_onevision_")]
    else:
        results.append({"check": "llava_onevision", "ok": False,
                        "error": f"{d}/llava_onevision not prepared: rerun prepare"})
    if (d / "smolvlm" / "ckpt").is_dir():
        results += [{**check_train(d / "smolvlm"), "check": "smolvlm_train_bf16"},
                    *check_verify(d / "smolvlm", precisions=("bf16",), name="smolvlm_")]
    else:
        results.append({"check": "smolvlm", "ok": False, "error": f"{d}/smolvlm not prepared: rerun prepare"})
    for r in results:
        print(json.dumps(r))
    summary = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "ok": all(r.get("ok") for r in results), "wall_s": round(time.time() - t0, 1)}
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("prepare", "run"):
        sys.exit(__doc__)
    d = Path(sys.argv[2]).resolve()
    if sys.argv[1] == "prepare":
        prepare(d)
    else:
        sys.exit(run(d))
