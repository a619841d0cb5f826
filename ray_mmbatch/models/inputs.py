"""A batch as the iterators yield it (numpy, from Ray Data or local_batches) -> torch on a device.

``batch_to_torch`` is what the train step does before the forward; ``as_torch`` is what each
model's ``forward`` does first, so ``model(batch)`` takes a batch straight from
``ray_mmbatch.local_batches`` or a Ray Data iterator (no conversion by hand).
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn as nn

# Token-index arrays go to int64 on the device (embedding / CE want long); the
# copy is made after the transfer so the host->device bytes stay int32.
_LONG_KEYS = ("input_ids", "labels", "position_ids")


def batch_to_torch(batch: dict, device: torch.device | str, non_blocking: bool = True) -> dict:
    """numpy arrays -> tensors on ``device`` (pinned staging on CUDA); other values pass through."""
    device = torch.device(device)
    pin = device.type == "cuda"
    out = {}
    for key, value in batch.items():
        if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
            with warnings.catch_warnings():
                # Arrays decoded from a Ray block are read-only; we never write
                # into these tensors, so sharing the buffer is safe.
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.from_numpy(np.ascontiguousarray(value))
            if pin:
                tensor = tensor.pin_memory()
            tensor = tensor.to(device, non_blocking=non_blocking and pin)
            out[key] = tensor.long() if key in _LONG_KEYS else tensor
        elif isinstance(value, np.generic):
            out[key] = value.item()
        else:
            out[key] = value
    return out


def as_torch(batch: dict, module: nn.Module) -> dict:
    """``batch`` with its numpy arrays moved to ``module``'s device (a torch batch passes unchanged)."""
    if not any(isinstance(v, np.ndarray) for v in batch.values()):
        return batch
    param = next(module.parameters(), None)
    return batch_to_torch(batch, param.device if param is not None else "cpu")
