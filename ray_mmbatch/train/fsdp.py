"""FSDP2 (``fully_shard``) for models that do not fit one GPU, and their sharded checkpoints.

Units: every rank keeps 1/world of each parameter (and of its gradient and AdamW
state); a unit's full parameters exist only while that unit runs::

    root unit    embeddings, vision tower + projector, final norm, head   gathered at the
                 (everything not in a block below)                        root's forward,
                                                                          freed after backward
    block 0      one decoder block   gathered for its forward, freed, gathered again for its
    block 1      ...                 backward, gradient reduce-scattered right after it
    ...

Peak parameter memory = params/world + root unit + about two blocks. Traffic per
rank and step: two all-gathers and one reduce-scatter of each block, about
3 x params x (world-1)/world bytes, against DDP's one all-reduce (2 x): 1.5x DDP,
the price of holding 1/world of the model. With gradient accumulation the
reduce-scatter runs after every micro-batch: keeping unsharded gradients to the
last one instead would hold a full gradient copy, which is what FSDP avoids.

Why the vision tower stays in the root unit: a rank whose batch has no image does
not run the vision blocks (the model keeps them in the graph through a zero-weight
sum of their parameters instead), while a rank with images does. FSDP pairs its
collectives by order across ranks, so a unit that one rank runs and another skips
gathers on one side only: DTensor errors or hangs. Units are therefore the blocks
every rank runs every step: the decoder layers. Vision towers are small next to
the LM (Qwen2-VL-7B: 0.7 B of 8.3 B), so this costs a few GB at most. The model's
backend (models/) names both: ``fsdp_units(model)`` and ``vision_modules(model)``.

Checkpoint layout, one folder once Ray Train has merged every rank's upload::

    .metadata        rank 0   DCP index of every slice, written after all shards
    __0_0.distcp     rank 0   its slices of the parameters and optimizer state
    __1_0.distcp     rank 1   ...   (DCP's per-rank names: the uploads never collide)
    scheduler.pt     rank 0
    state.json       rank 0, last: the checkpoint is complete (checkpoint.is_complete)

With frozen parameters (LoRA, ``--freeze``) the model part holds only the trainable parameters
and the buffers, as train/checkpoint.py does unsharded (its docstring: why, and the checks on
restore): DCP's index names the keys saved, checked before anything is read.

Every rank calls every function here (they are collectives). Pure torch, no Ray.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ray_mmbatch.models import backend_of, outermost_blocks
from ray_mmbatch.train import checkpoint as ckpt


def shard_units(model: nn.Module, backend: ModuleType | None = None) -> list[nn.Module]:
    """The modules that get their own FSDP unit, outermost first, in model order.

    ``backend`` (the models/ backend that built the model; default ``models.backend_of(model)``)
    names them: its ``fsdp_units``, refused if one lies inside its ``vision_modules`` (those
    stay in the root unit: module docstring). A model no backend built: the entries of every
    ``nn.ModuleList`` (the usual layer stack).
    """
    backend = backend if backend is not None else backend_of(model)
    if backend is None:
        in_list = {id(m) for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst}
        return outermost_blocks(model, lambda m: id(m) in in_list)
    units = list(backend.fsdp_units(model))
    vision = {id(m) for part in backend.vision_modules(model) for m in part.modules()}
    inside = [type(u).__name__ for u in units if id(u) in vision]
    if inside:
        raise ValueError(f"backend {getattr(backend, 'NAME', backend)!r} names FSDP units inside its vision "
                         f"modules ({inside}): a rank whose batch has no image would skip their collectives; "
                         "they belong to the root unit")
    return units


def shard_model(model: nn.Module, device: torch.device | str, mixed_precision: torch.dtype | None = None,
                units: Iterable[nn.Module] | None = None, backend: ModuleType | None = None) -> nn.Module:
    """``fully_shard`` each unit (``shard_units(model, backend)`` unless given), then the root; returns the model.

    Every rank must hold the same weights beforehand (same seed, or the same
    checkpoint): FSDP keeps each rank's slice of its own copy and broadcasts
    nothing. The model may sit on the CPU: each unit moves to ``device`` as it is
    sharded, so the whole model never has to fit there. ``mixed_precision`` (bf16):
    parameters are gathered and computed in it, gradients reduced in fp32, the
    optimizer keeps fp32 shards; run the step under autocast too (step.py's
    precision 'auto' on CUDA / 'bf16'), as the model builds some fp32 inputs itself.
    The forward contract is unchanged: ``model(batch, loss_only=True)``, batch a dict
    (FSDP walks dicts and leaves non-tensors alone).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("shard_model needs an initialized process group (Ray Train makes one)")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)   # the device mesh uses the current device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = (MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
              if mixed_precision is not None else MixedPrecisionPolicy())
    for unit in shard_units(model, backend) if units is None else units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def save_sharded(directory: str | Path, model: nn.Module, optimizer, scheduler, state: dict[str, Any]) -> Path:
    """Every rank, each with its OWN local ``directory``: its slices there (layout above).

    Rank 0's directory also gets ``.metadata``, ``scheduler.pt`` and, last,
    ``state.json``. Returns once every rank's part is written.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)    # sharded (DTensor) views, nothing gathered
    frozen = ckpt.frozen_keys(model)
    model_sd = {k: v for k, v in model_sd.items() if k not in frozen}  # the trainable weights and buffers
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp.FileSystemWriter(str(d)))
    state = ckpt.with_weights_record(model, state)                       # a collective with frozen shards
    if dist.get_rank() == 0:
        ckpt.atomic_torch_save({"scheduler": scheduler.state_dict() if scheduler is not None else None},
                               d / ckpt.SCHEDULER)
        ckpt.write_state(d, state)
    dist.barrier()
    return d


def load_sharded(directory: str | Path, model: nn.Module, optimizer=None, scheduler=None) -> dict[str, Any]:
    """Every rank: restore a sharded model (and optimizer, scheduler) from the merged folder; returns state.json.

    The model must already be sharded (``shard_model``) with the same world size
    layout as saved, or another: DCP reshards on load.
    """
    d = Path(directory)
    if not (ckpt.is_sharded(d) and ckpt.is_complete(d)):
        raise FileNotFoundError(f"{d} is not a complete sharded checkpoint ({ckpt.SHARDED_INDEX}, every shard, "
                                f"{ckpt.SCHEDULER}, {ckpt.STATE})")
    reader = dcp.FileSystemReader(str(d))
    state = ckpt.load_state(d)
    record = state.pop(ckpt.WEIGHTS, None)
    saved_keys = {k[len("model."):] for k in reader.read_metadata().state_dict_metadata if k.startswith("model.")}
    if optimizer is None:
        model_sd, optim_sd = get_model_state_dict(model), None
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)   # a fresh optimizer gets its state made first
    frozen = ckpt.frozen_keys(model)
    partial = ckpt.check_saved_keys(saved_keys, set(model_sd), frozen, d)
    if partial:  # the trainable weights only, on the frozen ones the model was rebuilt with
        ckpt.check_frozen(record, model, d)
        model_sd = {k: v for k, v in model_sd.items() if k not in frozen}
    sd = {"model": model_sd} if optim_sd is None else {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, storage_reader=reader)
    options = StateDictOptions(strict=not partial)
    if optim_sd is None:
        set_model_state_dict(model, sd["model"], options=options)
    else:
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=options)
    if scheduler is not None:
        saved = torch.load(d / ckpt.SCHEDULER, map_location="cpu", weights_only=False)["scheduler"]
        if saved is not None:
            scheduler.load_state_dict(saved)
    return state


def full_state_dict(model: nn.Module, prefix: str = "") -> dict[str, torch.Tensor] | None:
    """The full (unsharded) state dict on rank 0, on the CPU; None on other ranks. Every rank calls it.

    Parameters are gathered one at a time, so no device holds the whole model.
    ``prefix`` keeps only the keys under it, stripped: the backend's ``state_prefix(model)``
    gives what its ``export(..., state_dict=...)`` wants.
    """
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
