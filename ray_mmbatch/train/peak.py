"""What a training step really takes: ``measure_peak`` runs two real optimizer steps (train/step.py) at the budget
on a synthetic all-target text pack, the model built as a run builds it, and reports the peak, to set beside
train/memory.py's estimate (``ray-mmbatch plan --measure``, benchmarks/bench_memory.py).

CUDA: the allocator's peak (``torch.cuda.max_memory_allocated``) over the steps. CPU: the growth of the process's
peak RSS (VmHWM, reset through /proc/self/clear_refs; psutil sampling where that file is missing), with glibc's
mmap threshold pinned at 64 KiB so that RSS follows the live tensors: by default glibc raises the threshold to
32 MiB after the first large free and keeps freed heap resident: the tiny-model runs of RESULTS.md then read up
to 34 % above their live tensors. A 256-token step runs first, outside the measure, so that one-time costs
(thread pools, kernels' buffers, lazy imports) are no part of a step. No Ray here.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

#: tokens per sample of the synthetic pack (attention cost is per sample; the estimate's masks are per batch)
SYNTHETIC_SAMPLE_TOKENS = 1024


# --- measuring -------------------------------------------------------------------------------------------------

def _hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def malloc_returns_memory() -> None:
    """glibc: every allocation of 64 KiB or more its own mapping, unmapped when freed, so that RSS follows the live
    tensors (by default the threshold grows to 32 MiB after the first large free, and freed heap stays resident)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 64 * 1024)   # M_MMAP_THRESHOLD (setting it stops glibc's dynamic threshold)
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux /proc/self/clear_refs 5), so the next peak is a block's own; False
    where the kernel does not offer it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssPeak:
    """Peak RSS growth over a block (``.growth``, bytes): VmHWM reset through /proc/self/clear_refs (Linux), else psutil
    sampling."""

    def __enter__(self):
        import psutil

        self._proc = psutil.Process()
        self.base = self._proc.memory_info().rss
        self._exact = reset_peak_rss() and _hwm_bytes() is not None
        self._peak, self._stop = self.base, False
        if not self._exact:
            import threading

            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop:
            self._peak = max(self._peak, self._proc.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop = True
        if self._exact:
            self._peak = _hwm_bytes()
        else:
            self._thread.join()
        self.growth = max(0, self._peak - self.base)


def synthetic_pack(tokens: int, vocab: int, avoid: set[int], seed: int = 0,
                   sample_tokens: int = SYNTHETIC_SAMPLE_TOKENS) -> dict:
    """A text-only pack of ``tokens`` tokens, every one a target, in samples of ``sample_tokens``; numpy, as the
    Train workers receive it (batching/collate.py layout)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(10, max(11, min(vocab, 1000)), tokens).astype(np.int64)
    ids[np.isin(ids, list(avoid))] = 10
    lens = [min(sample_tokens, tokens - s) for s in range(0, tokens, sample_tokens)]
    labels = np.roll(ids, -1)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    labels[cu[1:] - 1] = ids[0]  # each sample's last position still a target (all-target worst case)
    return {"mode": "pack", "input_ids": ids[None], "labels": labels[None],
            "position_ids": np.concatenate([np.arange(n) for n in lens])[None].astype(np.int64),
            "cu_seqlens": cu, "max_seqlen": int(max(lens)), "seq_lens": np.array(lens, np.int32),
            "real_tokens": tokens, "target_tokens": tokens}


def _one_step(cfg, backend, ids: dict, batch: dict, dev, steps: int = 1) -> None:
    """Build the model as a run does (create_model, freeze / LoRA), its optimizer, and take ``steps`` steps."""
    from ray_mmbatch.models.trainable import configure_trainable
    from ray_mmbatch.train.step import batch_to_torch, build_optimizer, optimizer_step

    model = backend.create_model(cfg, ids)
    configure_trainable(model, cfg)
    model = model.to(dev)
    train_cfg = dataclasses.replace(cfg.train, lr=cfg.train.lr or 1e-5)  # unset: the fine-tune default's
    optimizer, scheduler = build_optimizer(model, train_cfg, 10)
    for _ in range(steps):
        optimizer_step(model, [batch_to_torch(batch, dev)], optimizer, scheduler, train_cfg, dev)


def measure_peak(cfg, steps: int = 2, device: str | None = None) -> dict[str, Any]:
    """Peak memory of ``steps`` optimizer steps (train/step.py) at the budget, on a synthetic all-target text pack:
    {"device", "peak_bytes", "tokens"}. The model is built as a run builds it (create_model, freeze / LoRA).
    CUDA: the allocator's peak; CPU: the growth of peak RSS from before the model is built. A 256-token step
    runs first, outside the measure: the process's one-time costs (thread pools, kernels' buffers, lazy imports)
    are no part of a step's memory."""
    import torch

    from ray_mmbatch.models import configure, get_backend, token_ids

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cpu":
        malloc_returns_memory()
    cfg = configure(cfg)
    ids = token_ids(cfg)
    backend = get_backend(cfg)
    avoid = {ids["image_token_id"], ids["pad_id"]}
    vocab = ids["vocab_size"]
    batch = synthetic_pack(int(cfg.budget.max_tokens), vocab, avoid)
    torch.manual_seed(cfg.train.seed)
    _one_step(cfg, backend, ids, synthetic_pack(min(256, batch["real_tokens"]), vocab, avoid), dev)  # one-time costs
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    with RssPeak() as rss:
        _one_step(cfg, backend, ids, batch, dev, steps)
    peak = torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else rss.growth
    return {"device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
            "peak_bytes": int(peak), "tokens": int(cfg.budget.max_tokens),
            "method": "torch.cuda.max_memory_allocated" if dev.type == "cuda" else
            ("VmHWM growth" if rss._exact else "RSS sampling") + f" (pid {os.getpid()})"}
