"""Splits and configs of a folder laid out as the Hugging Face Hub lays datasets out.

A folder from ``huggingface_hub.snapshot_download`` or ``git clone`` holds its splits side by side::

    data/train-00000-of-00002.parquet      split "train"  (push_to_hub's {split}-NNNNN-of-NNNNN)
    data/test-00000-of-00001.parquet       split "test"
    validation/0000.parquet                split "validation" (a folder named after a split)
    train.jsonl                            split "train"  (a file named after a split)
    ai2d(cauldron,llava_format)/train-*    config "ai2d(cauldron,llava_format)", split "train"

Reading every file would train on the test and validation splits. ``select`` keeps the files of the
chosen split (``data.split``, ``--split``, default "train"; ``PATH#split=NAME``; ``--eval-data``
reads the validation split, else the test split, else a folder's only split, unless it names one)
and never lists the others to a reader; a folder with no split names is read whole, as before. Like HF ``datasets``
(its data_files patterns), the keywords are aliases: validation = valid / val / dev, test = testing /
eval / evaluation, train = training; a ``{name}-NNNNN-of-NNNNN`` file keeps its own name (custom
splits such as ``train_sft``). In a folder with split names, files that name no split are not read
(as HF reads it), and a warning names them. A ``save_to_disk`` DatasetDict (``dataset_dict.json``)
has one folder per split. ``data-NNNNN-of-NNNNN.arrow`` (save_to_disk's shards) names no split.

Configs: a folder whose top-level subfolders each hold data files (and are not split or ``data``
folders) is a dataset of configs (The Cauldron, FineVision, LLaVA-OneVision-Data): ``expand``
makes it one source per config, named after its folder (brackets and commas included), so configs
blend by weight like any sources (formats/sources.py); ``PATH#config=NAME`` or a source's
``config: NAME`` reads one. Pure module: no ray.
"""
from __future__ import annotations

import copy
import logging
import re

from ray_mmbatch.formats import fs

log = logging.getLogger("ray_mmbatch.formats")
ALIASES = {"train": "train", "training": "train", "validation": "validation", "valid": "validation",
           "val": "validation", "dev": "validation", "test": "test", "testing": "test", "eval": "test",
           "evaluation": "test"}
DATA_EXTS = (".parquet", ".arrow", ".tar", ".json", ".jsonl", ".tar.gz", ".tgz")
#: files beside the data that are never a split's data (ray-mmbatch prepare's manifest)
NOT_DATA = ("manifest.json",)
_warned: set = set()  # (root, files) told once per process: a run lists its data several times
_SHARDED = re.compile(r"^(?P<split>[A-Za-z0-9_.]+?)-\d+-of-\d+\.")
_KEYWORD = re.compile(r"^(?P<split>[A-Za-z]+)(?:[-._ 0-9]|$)")
NOT_SPLITS = frozenset({"data"})  # save_to_disk's data-NNNNN-of-NNNNN.arrow, the Hub's data/ folder
HELD_OUT = "held-out"  # --eval-data's default: the folder's validation split, else its test split


def canonical(name: str) -> str:
    return ALIASES.get(name.lower(), name)


def split_of(rel: str, dict_splits: frozenset = frozenset()) -> str | None:
    """The split a file belongs to by its path relative to the dataset (or config) root, or None."""
    parts = rel.split("/")
    if dict_splits and len(parts) > 1 and parts[0] in dict_splits:  # a save_to_disk DatasetDict
        return parts[0]
    base = parts[-1]
    m = _SHARDED.match(base)
    if m and m.group("split").lower() not in NOT_SPLITS:
        return canonical(m.group("split"))
    m = _KEYWORD.match(base)
    if m and m.group("split").lower() in ALIASES:
        return ALIASES[m.group("split").lower()]
    for folder in parts[:-1]:
        if folder.lower() in ALIASES:
            return ALIASES[folder.lower()]
    return None


def _dict_splits(root: str, files: list[str]) -> frozenset:
    """The split folders of a save_to_disk DatasetDict (dataset_dict.json at the root), else empty."""
    import json

    marker = [f for f in files if fs.relative(f, root) == "dataset_dict.json"]
    if not marker:
        return frozenset()
    try:
        return frozenset(json.loads(fs.read_bytes(marker[0])).get("splits") or [])
    except (OSError, ValueError, AttributeError):
        return frozenset()


def found(root: str, files: list[str]) -> dict[str, int]:
    """{split: data files} of a listing ({} when no file names a split)."""
    ds = _dict_splits(root, files)
    out: dict[str, int] = {}
    for f in files:
        if f.lower().endswith(DATA_EXTS):
            s = split_of(fs.relative(f, root), ds)
            if s:
                out[s] = out.get(s, 0) + 1
    return dict(sorted(out.items()))


def select(root: str, files: list[str], split: str) -> list[str]:
    """The files of ``split`` when the listing names splits; all of them when it names none."""
    ds = _dict_splits(root, files)
    named = {f: split_of(fs.relative(f, root), ds) for f in files}
    data = [f for f in files if f.lower().endswith(DATA_EXTS)]
    if not any(named[f] for f in data):
        return files
    want = canonical(split or "train")
    if want == HELD_OUT:
        have = found(root, files)
        want = ("validation" if "validation" in have else "test" if "test" in have
                else next(iter(have)) if len(have) == 1 else "validation")  # a folder of one split: that one
    keep = [f for f in files if named[f] == want]
    if not keep:
        have = found(root, files)
        raise ValueError(f"{root} holds the splits {have} (Hub-style file / folder names) but no {want!r}: "
                         f"pick one with --split NAME (or PATH#split=NAME)")
    loose = [fs.relative(f, root) for f in data if not named[f] and f.rsplit("/", 1)[-1] not in NOT_DATA]
    if loose and (root, tuple(loose)) not in _warned:
        _warned.add((root, tuple(loose)))
        log.warning("%s: %d data file(s) name no split and are not read (as HF datasets reads a folder with "
                    "split names), e.g. %s; point --data at them to read them", root, len(loose), loose[:3])
    return keep


def configs(root: str, files: list[str] | None = None) -> list[str]:
    """The config folders of a dataset root (sorted), or [] when it is not a folder of configs."""
    if fs.kind(root) != "dir":
        return []
    files = fs.list_files(root) if files is None else files
    tops: dict[str, int] = {}
    for f in files:
        rel = fs.relative(f, root)
        if "/" not in rel:
            if rel.lower().endswith(DATA_EXTS):
                return []  # data at the top: one dataset (its folders are part of it)
            continue
        top = rel.split("/", 1)[0]
        if rel.lower().endswith(DATA_EXTS):
            tops[top] = tops.get(top, 0) + 1
    names = sorted(tops)
    if len(names) < 2 or any(n.lower() in ALIASES or n.lower() in NOT_SPLITS for n in names):
        return []
    if _dict_splits(root, files):
        return []
    return names


def _with_config(entry: dict, root: str, name: str) -> dict:
    out = {k: v for k, v in entry.items() if k != "config"}
    out["path"] = fs.join(root, name)
    out.setdefault("name", name)
    return out


def expand(data_cfg):
    """``data_cfg`` with every folder of configs made one source per config (a copy when anything changed);
    ``config`` in a source entry (``PATH#config=NAME``) picks one config of its folder."""
    entries = list(data_cfg.sources) if data_cfg.sources else []
    single = not entries
    if single:
        if not data_cfg.path:
            return data_cfg
        entries = [{"path": data_cfg.path}]
    out, changed = [], False
    for entry in entries:
        entry = {"path": entry} if isinstance(entry, str) else dict(entry)
        path = str(entry.get("path") or "")
        if entry.get("config"):
            out.append(_with_config(entry, path, str(entry["config"])))
            changed = True
            continue
        try:
            names = configs(path) if path and not any(c in path for c in "*?") else []
        except OSError:
            names = []
        if names and "weight" in entry:
            raise ValueError(f"{path} is a folder of {len(names)} configs ({', '.join(names[:3])}...): a weight on "
                             "it would not say how to share it among them; give each config its own source "
                             f"(--data '{path}#config=NAME#WEIGHT' or data.sources entries with config: NAME), "
                             "or no weight (each sample once)")
        if names:
            out += [_with_config(entry, path, n) for n in names]
            changed = True
        else:
            out.append(entry)
    if not changed:
        return data_cfg
    cfg = copy.deepcopy(data_cfg)
    cfg.path, cfg.sources = "", out
    return cfg
