"""The project's batches inside a user's own Ray Train loop.

    from ray.train.torch import TorchTrainer
    from ray_mmbatch.train import ingest

    datasets = ingest.datasets(cfg)                 # one Dataset per epoch: one row per planned batch
    def loop(config):
        model = ray.train.torch.prepare_model(my_model)
        for batch in ingest.iter_batches(epoch=0):  # torch, on this worker's device, in lockstep
            ce_sum, n_target = model(batch, loss_only=True)      # the project's model contract, or:
            out = hf_model(**ingest.to_hf_inputs(batch, model))  # the HF forward kwargs
            (ce_sum / ingest.target_normalizer([batch])).backward()
    TorchTrainer(loop, datasets=datasets, dataset_config=ingest.data_config(), ...).fit()

``data_config`` splits each stream across the workers without dropping a row (Ray Train's
default equal split would drop up to world-1 planned batches, i.e. whole batches of samples).
``iter_batches`` keeps the ranks in lockstep: a rank that has run out of batches while another
still has one gets a copy of its last batch with no targets (no loss, no gradient, but it joins
DDP's all-reduce), so every rank makes the same number of steps; rows that carry only skip
records are passed over. ``target_normalizer`` is the loss normalizer across gradient
accumulation and ranks: the target tokens of this step's micro-batches summed over all ranks
(train/step.py says why a per-micro-batch mean is wrong).

Left to the built-in loop (train/loop.py): exactly-once resume of the data position, the skip
guard, and the run folder's records.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ray_mmbatch import schema as S
from ray_mmbatch.config import Config


def datasets(cfg: Config, epochs: int | None = None) -> dict[str, Any]:
    """The batch streams of ``cfg``, one per epoch (``TorchTrainer(datasets=...)``), named for ``iter_batches``."""
    from ray_mmbatch.dataflow.pipeline import batch_dataset, set_deterministic
    from ray_mmbatch.models import configure, token_ids

    cfg = configure(cfg)
    set_deterministic(cfg.train.deterministic)
    pad_id = token_ids(cfg)["pad_id"]
    n = epochs if epochs is not None else max(1, cfg.train.epochs)
    return {S.epoch_dataset_name(e): batch_dataset(cfg, pad_id, epoch=e) for e in range(n)}


def data_config(preserve_order: bool = False):
    """``TorchTrainer(dataset_config=...)``: split without dropping rows (one row = one planned batch)."""
    from ray.train import DataConfig

    from ray_mmbatch.train.trainer import LosslessDataConfig

    options = DataConfig.default_ingest_options()
    options.preserve_order = preserve_order
    return LosslessDataConfig(execution_options=options)


def _any_rank(flag: bool, device) -> bool:
    from ray_mmbatch.train.step import all_reduce

    return all_reduce([float(flag)], device, op="max")[0] > 0


def iter_batches(epoch: int = 0, device=None, lockstep: bool = True,
                 stall_timeout_s: float = 1800.0) -> Iterator[dict[str, Any]]:
    """This worker's batches of epoch ``epoch`` as torch dicts on ``device`` (default: Ray Train's);
    DataStalled (train/stall.py) when no batch comes for ``stall_timeout_s``."""
    import ray.train
    import ray.train.torch

    from ray_mmbatch.batching.collate import decode_batch
    from ray_mmbatch.batching.layout import filler_batch, zero_target
    from ray_mmbatch.models.inputs import batch_to_torch
    from ray_mmbatch.train.stall import guarded

    device = device or ray.train.torch.get_device()
    # a thread keeps pulling this rank's split while the rank waits in a collective: the split's
    # coordinator can then move on (a plain iterator here hung both ranks at the end of the stream)
    rows = guarded(ray.train.get_dataset_shard(S.epoch_dataset_name(epoch)).iter_batches(
        batch_size=1, batch_format="numpy", prefetch_batches=2), stall_timeout_s)
    last = None
    while True:
        batch = None
        for row in rows:
            if int(row[S.BATCH_N_SAMPLES][0]):  # rows with only skip records carry no batch
                batch = decode_batch(bytes(row[S.BATCH_PAYLOAD][0]))
                break
        if lockstep and not _any_rank(batch is not None, device):
            return
        if batch is None:
            if not lockstep:
                return
            patch_dim = int(np.asarray(last["patches"]).shape[1]) if last is not None else 3 * 14 * 14
            batch = zero_target(last if last is not None else filler_batch(patch_dim))
        else:
            last = batch
        yield batch_to_torch(batch, device)


def to_hf_inputs(batch: dict[str, Any], model) -> dict[str, Any]:
    """The HF model's forward kwargs for this batch (the family's adapter: mRoPE position ids,
    mm_token_type_ids, normalized pixel_values, ...; ``use_cache=False``). No ``labels``: the
    batch's labels are already shifted for next-token loss (batching/collate.py), an HF model
    would shift them again; take the loss from ``model(batch, loss_only=True)`` instead."""
    from ray_mmbatch.models.inputs import as_torch

    bare = getattr(model, "module", model)
    if not hasattr(bare, "forward_inputs"):
        raise TypeError(f"{type(bare).__name__} is not a Hugging Face model of ray_mmbatch (hf.load_model): "
                        "call it on the batch itself, model(batch, loss_only=True)")
    return bare.forward_inputs(as_torch(batch, bare))


def target_normalizer(micro_batches: list[dict[str, Any]], device=None) -> float:
    """The target tokens of this optimizer step's micro-batches, summed over all ranks:
    divide each micro-batch's summed CE by it (times the world size under DDP, which averages)."""
    from ray_mmbatch.train.step import all_reduce, count_targets

    device = device or (micro_batches[0]["labels"].device if micro_batches and
                        isinstance(micro_batches[0].get("labels"), torch.Tensor) else "cpu")
    return max(all_reduce([float(sum(count_targets(b) for b in micro_batches))], device)[0], 1.0)
