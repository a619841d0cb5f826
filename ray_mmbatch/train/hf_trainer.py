"""``transformers.Trainer`` inside Ray Train, fed the project's token-budget batches.

Ray's documented pattern runs the HF Trainer inside ``TorchTrainer``'s train function. Fed a
Ray Dataset the usual way it breaks on token-budget batches: the iterator has no ``len``
(ray#51521), accelerate shards an IterableDataset a second time across ranks (each rank
already holds its own split) or dispatches it from rank 0, the default collator batches rows
that are already batches, a rank with fewer batches than another hangs DDP, and the Trainer's
loss is a per-micro-batch mean (wrong with packed batches of unequal target counts). Here:

    from transformers import TrainingArguments
    from ray_mmbatch.train.hf_trainer import BatchStream, TokenBudgetTrainer

    def train_func(config):                       # inside TorchTrainer(datasets=ingest.datasets(cfg), ...)
        model = hf.load_model(path)               # or any module: model(batch, loss_only=True) -> (ce_sum, n)
        args = TrainingArguments(output_dir=..., max_steps=N, gradient_accumulation_steps=4, report_to="none")
        TokenBudgetTrainer(model=model, args=args, train_dataset=BatchStream(epochs=2)).train()

- ``BatchStream``: an IterableDataset whose items ARE batches, each pass one epoch of this
  rank's stream (``ingest.iter_batches``: torch on the worker's device, ranks in lockstep);
  after the last epoch a pass yields nothing and the Trainer stops. ``max_steps`` is then a
  cap (the Trainer needs one without a ``len``; the LR schedule runs to it): the number of
  steps is fixed only as the stream is planned.
- ``TokenBudgetTrainer``: the DataLoader passes each batch through as it is (no second
  sharding, no collator, no worker processes: the split lives in this process); the loss of a
  micro-batch is its summed token CE over the target tokens of the whole optimizer step, all
  micro-batches and all ranks (``ingest.target_normalizer``), times the world size (DDP
  averages gradients) — the built-in loop's normalization (train/step.py), so the gradients
  and the logged loss equal the built-in loop's on the same batches
  (tests/test_hf_trainer.py). A stream that ends inside an accumulation group is padded with
  zero-target copies of its last batch (the Trainer would otherwise never step those
  gradients); the epoch ends at the next pull.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer

BatchSource = Callable[[int], Iterable[dict[str, Any]]]


def _one(batch):
    return batch


class BatchStream(IterableDataset):
    """Each ``iter()`` is the next epoch's batches of this rank (``batches(epoch)``; default
    ``ingest.iter_batches(epoch, **iter_kwargs)``); after ``epochs`` passes, empty."""

    def __init__(self, epochs: int = 1, batches: BatchSource | None = None, start_epoch: int = 0, **iter_kwargs):
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        self.epochs, self.epoch = int(epochs), int(start_epoch)
        self._batches = batches
        self._iter_kwargs = iter_kwargs

    def __iter__(self):
        epoch = self.epoch
        if epoch >= self.epochs:
            return
        self.epoch += 1
        if self._batches is not None:
            yield from self._batches(epoch)
        else:
            from ray_mmbatch.train import ingest

            yield from ingest.iter_batches(epoch=epoch, **self._iter_kwargs)


class TokenBudgetTrainer(Trainer):
    """transformers.Trainer on the project's batches (module docstring): pass-through loader,
    the loss normalized over the step's target tokens on all ranks, accumulation groups closed
    at the end of the stream."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_is_scaled_for_ga = True  # compute_loss divides by the whole step's targets already

    def get_train_dataloader(self) -> DataLoader:
        if not isinstance(self.train_dataset, BatchStream):
            raise TypeError(f"TokenBudgetTrainer trains on a BatchStream (its items are whole batches), got "
                            f"{type(self.train_dataset).__name__}")
        return DataLoader(self.train_dataset, batch_size=None, collate_fn=_one, num_workers=0)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        from ray_mmbatch.batching.layout import zero_target
        from ray_mmbatch.train import ingest

        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if not batches:  # the stream has ended (on every rank: they run in lockstep)
            self.control.should_epoch_stop = True
            return [], None
        if len(batches) < num_batches:  # ends inside a group: close it so the optimizer steps
            batches += [zero_target(batches[-1])] * (num_batches - len(batches))  # (the next call ends the epoch)
        return batches, torch.tensor(ingest.target_normalizer(batches, device), device=device)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        ce_sum, _ = model(inputs, loss_only=True)
        if num_items_in_batch is None:  # evaluation: the batch's own mean
            from ray_mmbatch.train.step import count_targets

            loss = ce_sum / max(count_targets(inputs), 1)
        else:
            loss = ce_sum * self.accelerator.num_processes / num_items_in_batch
        return (loss, None) if return_outputs else loss
