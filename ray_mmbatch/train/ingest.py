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

Exactly-once resume (``DataState``): the samples trained so far, all ranks, as the built-in
loop keeps them (data/position.py: finished read units + rows done of units in flight, a few
bytes a sample). Pass it to ``iter_batches(state=...)``, call ``state.save(checkpoint_dir)`` on
every rank after the optimizer step (it gathers the ranks' new positions; rank 0 writes), and on
restore ``DataState.load(checkpoint_dir)``: batches already trained are passed over, batches
partly trained have those samples masked out of the loss (the rebuilt stream plans its own
batches). ``datasets(cfg, state=...)`` also leaves the trained rows out of the read.

Left to the built-in loop (train/loop.py): the skip guard and the run folder's records.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ray_mmbatch import schema as S
from ray_mmbatch.config import Config


class DataState:
    """Which samples this run has trained, all ranks (exactly-once resume; module docstring).

    ``DataState(saved)`` from a ``state_dict()``; ``save(dir)`` / ``DataState.load(dir)`` keep it
    as ``data_state.json`` in a checkpoint directory."""

    FILE = "data_state.json"

    def __init__(self, state: dict[str, Any] | None = None):
        from ray_mmbatch.data.position import DataPosition

        self.position = DataPosition.from_state(state)
        self._new: list[tuple[int, np.ndarray, np.ndarray]] = []  # this rank's, since the last state_dict

    def add(self, epoch: int, positions, unit_rows) -> None:
        pos, rows = np.asarray(positions, np.int64), np.asarray(unit_rows, np.int64)
        if len(pos):
            self.position.add(epoch, pos, rows)
            self._new.append((int(epoch), pos, rows))

    def trained(self, epoch: int, positions) -> np.ndarray:
        """Per position: already trained (in the restored state or by this rank since)."""
        return self.position.contains(epoch, np.asarray(positions, np.int64))

    def state_dict(self) -> dict[str, Any]:
        """The position of every rank (a collective under torch.distributed: call it on every rank)."""
        from ray_mmbatch.train.loop import all_gather_lists

        mine, self._new = self._new, []
        for epoch, pos, rows in all_gather_lists(mine):
            self.position.add(epoch, pos, rows)  # our own again: adding a position twice changes nothing
        return self.position.state_dict()

    def save(self, directory) -> dict[str, Any]:
        """Every rank calls it (it gathers, as ``state_dict``); rank 0 writes ``data_state.json`` into
        ``directory`` (its checkpoint directory). Returns the state."""
        import json
        from pathlib import Path

        import torch.distributed as dist

        state = self.state_dict()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            (Path(directory) / self.FILE).write_text(json.dumps(state))
        return state

    @classmethod
    def load(cls, directory) -> DataState:
        """The state saved in ``directory`` (a fresh one if it holds none)."""
        import json
        from pathlib import Path

        f = Path(directory) / cls.FILE
        return cls(json.loads(f.read_text())) if f.is_file() else cls()


def datasets(cfg: Config, epochs: int | None = None, state: DataState | dict | None = None) -> dict[str, Any]:
    """The batch streams of ``cfg``, one per epoch (``TorchTrainer(datasets=...)``), named for ``iter_batches``;
    ``state``: a resumed run's DataState (or its state_dict): the rows it trained are not read again."""
    from ray_mmbatch.dataflow.pipeline import batch_dataset, set_deterministic
    from ray_mmbatch.formats.units import read_units
    from ray_mmbatch.models import configure, token_ids
    from ray_mmbatch.run.defaults import resolve_defaults

    cfg = configure(resolve_defaults(cfg))  # train.epochs left to the mode: 1 for the built-in model, 3 for --model
    set_deterministic(cfg.train.deterministic)
    pad_id = token_ids(cfg)["pad_id"]
    n = epochs if epochs is not None else max(1, cfg.train.epochs)
    position = state.position.state_dict() if isinstance(state, DataState) else state
    reader = read_units(cfg.data.path, cfg.data)  # one listing for every epoch's stream (formats/listing.py)
    return {S.epoch_dataset_name(e): batch_dataset(cfg, pad_id, position=position, epoch=e, reader=reader)
            for e in range(n)}


def data_config(preserve_order: bool = False):
    """``TorchTrainer(dataset_config=...)``: split without dropping rows (one row = one planned batch)."""
    from ray.train import DataConfig

    from ray_mmbatch.train.trainer import LosslessDataConfig

    options = DataConfig.default_ingest_options()
    options.preserve_order = preserve_order
    return LosslessDataConfig(execution_options=options)


def _next_batch(rows, epoch: int, state: DataState | None) -> dict[str, Any] | None:
    """The next row of this rank's stream that still holds samples to train, decoded; None at the end."""
    from ray_mmbatch.batching.collate import decode_batch
    from ray_mmbatch.batching.layout import mask_samples
    from ray_mmbatch.data.errors import decode_skips

    for row in rows:
        if state is not None:  # a reported skip is done too: a resumed run does not report it again
            records = decode_skips(row[S.BATCH_SKIPPED][0])
            state.add(epoch, [r.position for r in records], [r.unit_rows for r in records])
        if not int(row[S.BATCH_N_SAMPLES][0]):  # rows with only skip records carry no batch
            continue
        batch = decode_batch(bytes(row[S.BATCH_PAYLOAD][0]))
        if state is not None:
            pos = np.asarray(row[S.BATCH_POSITIONS][0], np.int64)
            unit_rows = np.asarray(row[S.BATCH_POSITION_UNIT_ROWS][0], np.int64)
            keep = ~state.trained(epoch, pos)
            if not keep.any():
                continue  # trained before the restore
            if not keep.all():
                batch = mask_samples(batch, keep)
            state.add(epoch, pos[keep], unit_rows[keep])
        return batch
    return None


def iter_batches(epoch: int = 0, device=None, lockstep: bool = True, stall_timeout_s: float = 1800.0,
                 state: DataState | None = None) -> Iterator[dict[str, Any]]:
    """This worker's batches of epoch ``epoch`` as torch dicts on ``device`` (default: Ray Train's);
    DataStalled (train/stall.py) when no batch comes for ``stall_timeout_s``. ``state``: a
    DataState that records what is yielded and passes over what it already holds (resume)."""
    import ray.train
    import ray.train.torch

    from ray_mmbatch.models.inputs import batch_to_torch
    from ray_mmbatch.train.stall import guarded
    from ray_mmbatch.train.step import Lockstep

    device = device or ray.train.torch.get_device()
    # a thread keeps pulling this rank's split while the rank waits in a collective: the split's
    # coordinator can then move on (a plain iterator here hung both ranks at the end of the stream)
    rows = guarded(ray.train.get_dataset_shard(S.epoch_dataset_name(epoch)).iter_batches(
        batch_size=1, batch_format="numpy", prefetch_batches=2), stall_timeout_s)
    # the patch size is the model's, unknown here: a rank that never had a batch takes the others'
    steps = Lockstep(device) if lockstep else None
    while True:
        batch = _next_batch(rows, epoch, state)
        if steps is not None:
            batch, _ = steps.join(batch)
        if batch is None:
            return
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
