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

What a checkpoint holds of the model (``checkpoint_weights``): when every parameter trains, the
whole state dict. When some do not (a LoRA run, ``--freeze``), only the parameters that train
(``requires_grad``) and the persistent buffers: a LoRA run's checkpoint is its adapter weights, a
few MB of a 7B model, not the 15 GB base. The frozen weights are not saved because they are
rebuilt at every start exactly as before: read from the same ``--model`` checkpoint, or (the
built-in model) drawn from ``torch.manual_seed(--seed)`` before the model is built, then LoRA
injected, then the checkpoint loaded on top. Buffers are kept: the checkpoint cannot tell one
derived from the config (the HF rotary ``inv_freq``, non-persistent anyway and so never in a state
dict) from running state that training moves (a BatchNorm's statistics), and they are small.
``state.json`` then records, under ``weights``, the saved key count and a fingerprint of the frozen
weights (elements, sum, sum of absolute values, of squares, in float64); a restore refuses, naming
why, a checkpoint whose keys are not exactly what the model trains (other ``--lora-*`` /
``--freeze`` / model) or whose frozen weights differ (another ``--model`` or ``--seed``), instead of
silently putting adapters on another base. A full checkpoint (every key) still loads into a model
with frozen parts. The sharded (FSDP) layout does the same through train/fsdp.py.
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from ray_mmbatch.run.rundir import RunDir

STATE = "state.json"
MODEL = "model.pt"
WEIGHTS = "weights"           # state.json: what the model file holds when parameters are frozen (docstring)
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
    atomic_torch_save(checkpoint_weights(model), d / MODEL)
    atomic_torch_save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, d / "optim.pt")
    write_state(d, with_weights_record(model, state))
    return d


def frozen_keys(model: torch.nn.Module) -> set[str]:
    """State-dict keys of the parameters that do not train (tied aliases included): not checkpointed."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def checkpoint_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of ``model``: its state dict less the frozen parameters (module docstring)."""
    sd, frozen = model.state_dict(), frozen_keys(model)
    if not frozen:
        return sd
    out = OrderedDict((k, v) for k, v in sd.items() if k not in frozen)
    out._metadata = getattr(sd, "_metadata", None)  # the modules' versions, as load_state_dict reads them
    return out


def frozen_fingerprint(model: torch.nn.Module) -> dict[str, float]:
    """Elements, sum, sum of |w|, sum of w^2 (float64) over the frozen parameters, each tensor once.

    Under FSDP (DTensor shards) every rank must call it: the ranks' sums are all-reduced."""
    acc = torch.zeros(4, dtype=torch.float64)
    shard_device = None
    for p in model.parameters():
        if p.requires_grad:
            continue
        t = p.detach()
        if hasattr(t, "to_local"):  # a DTensor: this rank's shard
            t = t.to_local()
            shard_device = t.device
        for chunk in t.reshape(-1).split(1 << 24):  # bounded float64 copies, whatever the tensor's size
            c = chunk.double()
            acc += torch.stack([torch.tensor(float(c.numel()), dtype=torch.float64, device=c.device),
                                c.sum(), c.abs().sum(), (c * c).sum()]).cpu()
    if shard_device is not None:  # the process group's device: the shards'
        import torch.distributed as dist

        acc = acc.to(shard_device)
        dist.all_reduce(acc)
        acc = acc.cpu()
    n, s, a, q = acc.tolist()
    return {"elements": int(n), "sum": s, "abs_sum": a, "sq_sum": q}


def with_weights_record(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` plus, when parameters are frozen, what the model file holds (``weights``); every rank calls it.

    The record is the same at every checkpoint of a run (the frozen weights never change), so it is
    made at the first one (every rank at once: the fingerprint is a collective under FSDP) and kept
    on the model, not recomputed over all frozen weights at every save."""
    record = getattr(model, "_ray_mmbatch_weights_record", None)
    if record is None:
        frozen = frozen_keys(model)
        record = {} if not frozen else {"saved": "trainable", "keys": len(model.state_dict()) - len(frozen),
                                        "frozen_keys": len(frozen), "frozen": frozen_fingerprint(model)}
        model._ray_mmbatch_weights_record = record
    return {**state, WEIGHTS: record} if record else state


def check_saved_keys(saved: set[str], model_keys: set[str], frozen: set[str], where) -> bool:
    """True when the checkpoint holds the trainable keys only, False when every key; else a ValueError naming why."""
    if saved == model_keys:
        return False
    want = model_keys - frozen
    if saved == want:
        return True
    missing, extra = sorted(want - saved), sorted(saved - model_keys)
    raise ValueError(
        f"checkpoint {where} does not hold the weights this model trains: {len(saved)} keys saved, the model trains "
        f"{len(want)} (+{len(frozen)} frozen, rebuilt at start); missing {len(missing)} {missing[:3]}, unexpected "
        f"{len(extra)} {extra[:3]}. Resume with the settings it was saved with (--model, --lora-rank / "
        "--lora-targets, --freeze)")


def check_frozen(record: dict | None, model: torch.nn.Module, where) -> None:
    """The frozen weights the model was rebuilt with are those the checkpoint trained on (``weights`` record)."""
    if not record:
        return
    saved, now = record["frozen"], frozen_fingerprint(model)
    close = (saved["elements"] == now["elements"]
             and all(abs(saved[k] - now[k]) <= 1e-6 * (saved["abs_sum"] if k == "sum" else abs(saved[k])) + 1e-12
                     for k in ("sum", "abs_sum", "sq_sum")))
    if not close:
        raise ValueError(f"checkpoint {where} holds only the trained weights, and the frozen weights this model was "
                         f"built with are not those it trained on (saved {saved}, now {now}): resume with the same "
                         "--model (and its files unchanged) and the same --seed")


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
    return all((d / f).is_file() for f in (MODEL, "optim.pt"))


def load_state(directory: str | Path) -> dict[str, Any]:
    """``state.json`` of a checkpoint folder: a local path or a bucket URI (train.storage)."""
    from ray_mmbatch.formats import fs

    return json.loads(fs.read_bytes(fs.join(str(directory), STATE)))


def load_checkpoint(directory: str | Path, model: torch.nn.Module, optimizer=None, scheduler=None) -> dict[str, Any]:
    d = Path(directory)
    if is_sharded(d):
        raise ValueError(f"{d} is a sharded (FSDP) checkpoint: shard the model, then train.fsdp.load_sharded")
    if not is_complete(d):
        raise FileNotFoundError(f"{d} is not a complete checkpoint ({MODEL}, optim.pt, {STATE})")
    state = load_state(d)
    record = state.pop(WEIGHTS, None)
    saved = torch.load(d / MODEL, map_location="cpu", weights_only=True)
    frozen = frozen_keys(model)
    if check_saved_keys(set(saved), set(model.state_dict()), frozen, d):
        check_frozen(record, model, d)
        missing, _ = model.load_state_dict(saved, strict=False)
        assert set(missing) == frozen, sorted(set(missing) ^ frozen)[:5]
    else:
        model.load_state_dict(saved)
    if optimizer is not None:
        opt = torch.load(d / "optim.pt", map_location="cpu", weights_only=False)
        optimizer.load_state_dict(opt["optimizer"])
        if scheduler is not None:
            scheduler.load_state_dict(opt["scheduler"])
    return state


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


def publish_export(output_dir: str | Path, storage: str, run_name: str) -> list[str]:
    """Copy the run's exports (OUTPUT_DIR/model, OUTPUT_DIR/adapter, as rank 0 wrote them on its node) into
    ``<storage>/<run_name>/``, beside the run's checkpoints; return the locations written.

    Rank 0 exports on its own node's disk; on a cluster that disk goes with the node (``ray down``), while
    ``--storage`` is a bucket or a folder every node mounts (the multi-node check makes sure, run/cluster.py).
    Nothing to do without an explicit ``storage`` (the export is then already where the checkpoints are)."""
    from ray_mmbatch.formats import fs

    if not storage:
        return []
    import pyarrow.fs as pafs

    written = []
    for name in (RunDir.EXPORT, RunDir.ADAPTER):
        src = Path(output_dir) / name
        if not src.is_dir():
            continue
        dest = fs.join(fs.join(storage, run_name), name)
        filesystem, path = fs.split(dest)
        if not fs.is_uri(dest) and os.path.realpath(src) == os.path.realpath(path):
            continue  # --storage is OUTPUT_DIR's parent: already there
        filesystem.create_dir(path, recursive=True)
        pafs.copy_files(str(src.resolve()), path, source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=filesystem)
        written.append(dest)
    return written
