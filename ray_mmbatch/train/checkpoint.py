"""Checkpoint contents and the data position, written so a crash mid-save never hurts.

A checkpoint directory holds ``model.pt``, ``optim.pt`` (optimizer + scheduler)
and ``state.json`` (step, counters, and the data position). The data position
(data/position.py) says, per epoch and read unit, which rows were trained or
reported: finished units as a bitmap, units in flight as row bitmaps, so its size
follows the units in flight, not the samples. A resumed run leaves exactly those
rows out as it reads and trains every other one, on whatever rank, even if Ray
Data draws its windows differently this time.

Every file is written to a temporary name and renamed, ``state.json`` last: a
directory without ``state.json`` is not a checkpoint, so a save that dies half
way leaves the previous checkpoint the newest usable one. Pure torch, no Ray.

The sharded layout (FSDP, written by train/fsdp.py ``save_sharded``) replaces
``model.pt`` / ``optim.pt`` by DCP's ``.metadata`` plus one ``__<rank>_0.distcp``
per rank and ``scheduler.pt``; it is complete when ``state.json`` is there and
every shard file ``.metadata`` names is there at full length (the ranks' parts
arrive separately, so a missing one must not pass for a checkpoint).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ray_mmbatch.run.rundir import RunDir

STATE = "state.json"
SHARDED_INDEX = ".metadata"   # torch.distributed.checkpoint's index, written by rank 0 after every shard
SCHEDULER = "scheduler.pt"    # sharded layout: the scheduler state (rank 0)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer, scheduler,
                    state: dict[str, Any]) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(model.state_dict(), d / "model.pt")
    atomic_torch_save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, d / "optim.pt")
    write_state(d, state)
    return d


def write_state(directory: str | Path, state: dict[str, Any]) -> None:
    """``state.json``, atomically: call it last, it is what marks the checkpoint complete."""
    _atomic_write_bytes(Path(directory) / STATE, json.dumps(state).encode())


def is_sharded(directory: str | Path) -> bool:
    return (Path(directory) / SHARDED_INDEX).is_file()


def _shards_present(d: Path) -> bool:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(d)).read_metadata().storage_data or {}
    except Exception:  # an unreadable index is an incomplete checkpoint, whatever the reason
        return False
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    return all((d / f).is_file() and (d / f).stat().st_size >= n for f, n in need.items())


def is_complete(directory: str | Path) -> bool:
    d = Path(directory)
    if not (d / STATE).is_file():
        return False
    if is_sharded(d):
        return (d / SCHEDULER).is_file() and _shards_present(d)
    return all((d / f).is_file() for f in ("model.pt", "optim.pt"))


def load_state(directory: str | Path) -> dict[str, Any]:
    """``state.json`` of a checkpoint folder: a local path or a bucket URI (train.storage)."""
    from ray_mmbatch.formats import fs

    return json.loads(fs.read_bytes(fs.join(str(directory), STATE)))


def load_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer=None, scheduler=None) -> dict[str, Any]:
    d = Path(directory)
    if is_sharded(d):
        raise ValueError(f"{d} is a sharded (FSDP) checkpoint: shard the model, then train.fsdp.load_sharded")
    if not is_complete(d):
        raise FileNotFoundError(f"{d} is not a complete checkpoint (model.pt, optim.pt, {STATE})")
    model.load_state_dict(torch.load(d / "model.pt", map_location="cpu", weights_only=True))
    if optimizer is not None:
        opt = torch.load(d / "optim.pt", map_location="cpu", weights_only=False)
        optimizer.load_state_dict(opt["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(opt["scheduler"])
    return load_state(d)


def write_latest(output_dir: str | Path, checkpoint_path: str, state: dict[str, Any]) -> None:
    """Point at the newest complete checkpoint, with its data position (read by the dataset builder)."""
    rec = {"path": checkpoint_path, "step": state.get("step", 0), "position": state.get("position")}
    _atomic_write_bytes(Path(output_dir) / RunDir.LATEST, json.dumps(rec).encode())


def read_latest_position(output_dir: str | Path, run_storage: str | Path | None = None,
                         fallback: bool = True) -> dict | None:
    """The data position (data/position.py state) of the checkpoint a restart will restore; None when none.

    Ray Train restores the newest checkpoint its manager registered
    (``checkpoint_manager_snapshot.json`` in the run's storage, written as it registers);
    we read that one's state. ``fallback``: failing that, our own pointer, which rank 0
    writes right after it reports, so it may be AHEAD of what Ray registered when a
    worker dies in between. A stream must never leave out more than the restored
    checkpoint trained (what it leaves out is never trained again: seen losing 6-11 of
    300 samples when a node died, tests/multinode/node_loss.py), so the stream's filter
    passes ``fallback=False``: behind is safe (the train loop masks what it trained).
    """
    if run_storage is not None:  # a folder or a bucket URI (train.storage)
        from ray_mmbatch.formats import fs

        try:
            root = str(run_storage)
            snap = json.loads(fs.read_bytes(fs.join(root, "checkpoint_manager_snapshot.json")))
            name = snap["latest_checkpoint_result"]["checkpoint_dir_name"]
            return load_state(fs.join(root, name)).get("position")
        except (OSError, ValueError, KeyError, TypeError):
            pass
    if not fallback:
        return None
    try:
        return json.loads((Path(output_dir) / RunDir.LATEST).read_text()).get("position")
    except (OSError, ValueError):
        return None
