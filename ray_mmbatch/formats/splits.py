"""Splits and configs of a folder laid out as the Hugging Face Hub and hand-made sets lay datasets out.

Which file is which split is decided as HF ``datasets`` decides it (formats/data_patterns.py, its data-file
patterns reimplemented and tested against the library): ``data/{split}-NNNNN-of-NNNNN*`` shards (custom
splits such as ``train_sft`` keep their name), else a keyword folder (``train/``, ``train2017/``,
``images_val/``), else a keyword in the file name after a separator (``llava_test.parquet``,
``my-dataset.dev.jsonl``, ``cc3m-validation-0000.tar``, ``test_0.jsonl``); a folder with none is read whole,
whatever the split. Reading every file would train on the test and validation splits: ``select`` keeps the
files of the chosen split (``data.split``, ``--split``, default "train"; ``PATH#split=NAME``;
``--eval-data`` reads the validation split, else the test split, else its one custom split named so
(``test_sft``), else a folder's only split, and warns when that is train) and never lists the others to a
reader. A split asked for by an alias (``--split dev``) is the split HF names (validation), unless the
shards gave the folder a split of that very name.

Only data files (DATA_EXTS) decide, so a LLaVA JSON beside ``coco/train2017/*.jpg`` is not outvoted by its
images. In a folder with split names, data files no pattern matches are not read (HF does not read them
either); one warning names them and the other splits' files left out, and ``listing_summary``
(formats/units.py, what ``inspect`` prints) lists them. A ``save_to_disk`` DatasetDict
(``dataset_dict.json``) has one folder per split, as ``load_from_disk`` reads it.

Configs: a folder whose top-level subfolders each hold data files (and are not split or ``data`` folders)
is a dataset of configs (The Cauldron, FineVision, LLaVA-OneVision-Data): ``expand`` makes it one source
per config, named after its folder (brackets and commas included), so configs blend by weight like any
sources (formats/sources.py); ``PATH#config=NAME`` or a source's ``config: NAME`` reads one. Each config
folder is then split by the rules above. Pure module: no ray.
"""
from __future__ import annotations

import copy
import logging
import re
from dataclasses import dataclass

from ray_mmbatch.formats import fs, listing
from ray_mmbatch.formats.data_patterns import (
    DEFAULT_PATTERNS_ALL,
    DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME,
    SPLIT_KEYWORDS,
    candidate,
    data_files,
    data_patterns,
    matcher,
)

log = logging.getLogger("ray_mmbatch.formats")
ALIASES = {kw: split for split, kws in SPLIT_KEYWORDS.items() for kw in kws}
DATA_EXTS = (".parquet", ".arrow", ".tar", ".json", ".jsonl", ".tar.gz", ".tgz")
#: files beside the data that are never a split's data (ray-mmbatch prepare's manifest)
NOT_DATA = ("manifest.json",)
NOT_SPLITS = frozenset({"data"})  # the Hub's data/ folder is not a config
HELD_OUT = "held-out"  # --eval-data's default: the folder's validation split, else its test split
NO_SPLIT = "(no split)"  # left_out's key for the files no pattern matched
_warned: set = set()  # (root, split, files) told once per process: a run lists its data several times


def canonical(name: str) -> str:
    return ALIASES.get(name.lower(), name)


def _dict_splits(files: list[str], rels: list[str]) -> frozenset:
    """The split folders of a save_to_disk DatasetDict (dataset_dict.json at the root), else empty."""
    import json

    marker = [f for f, r in zip(files, rels) if r == "dataset_dict.json"]
    if not marker:
        return frozenset()
    try:
        return frozenset(json.loads(fs.read_bytes(marker[0])).get("splits") or [])
    except (OSError, ValueError, AttributeError):
        return frozenset()


def _is_data(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return rel.lower().endswith(DATA_EXTS) and name not in NOT_DATA


@dataclass(frozen=True)
class Selection:
    """What ``select`` keeps of a folder's listing: the split read and its files, every split found."""
    split: str                   # the split read; "" when the folder names none (then every file is read)
    files: list[str]             # the locations read
    found: dict[str, list[str]]  # split -> its data files (relative), in HF's order; {} when none is named
    unsplit: list[str]           # data files (relative) in no split: not read

    def left_out(self) -> dict[str, list[str]]:
        """{split (or NO_SPLIT): its data files not read}, relative to the folder."""
        read = set(self.found.get(self.split, ()))
        out = {s: [r for r in rels if r not in read] for s, rels in self.found.items() if s != self.split}
        out[NO_SPLIT] = list(self.unsplit)
        return {s: rels for s, rels in out.items() if rels}


def _split_map(files: list[str], rels: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """({split: relative data files} or {} when the folder names no split, [data files in no split])."""
    data = [r for r in rels if _is_data(r)]
    dict_splits = _dict_splits(files, rels)
    if dict_splits:  # a save_to_disk DatasetDict: load_from_disk's one folder per split
        found = {s: [r for r in data if r.split("/", 1)[0] == s] for s in sorted(dict_splits)}
    else:
        patterns = data_patterns(data)
        found = {} if patterns == DEFAULT_PATTERNS_ALL else data_files(data, patterns)
    named = {r for rs in found.values() for r in rs}
    return found, ([r for r in data if r not in named and candidate(r)] if found else [])


def _wanted(split: str, found: dict[str, list[str]]) -> str:
    if split == HELD_OUT:
        for name in ("validation", "test"):
            if name in found:
                return name
        held = [s for s in found if canonical(_first_word(s)) in ("validation", "test")]  # test_sft
        return held[0] if len(held) == 1 else next(iter(found)) if len(found) == 1 else HELD_OUT
    return split if split in found else canonical(split or "train")


def selection(root: str, files: list[str], split: str) -> Selection:
    """The ``Selection`` of ``split`` in a folder's listing (ValueError when the folder has no such split)."""
    rels = [fs.relative(f, root) for f in files]
    found, unsplit = _split_map(files, rels)
    if not found:
        return Selection("", files, {}, [])
    want = _wanted(split, found)
    if want == HELD_OUT:
        raise ValueError(f"{root} holds the splits {counts(found)} (named as HF datasets names them) and none is "
                         f"the one held-out split: name it, --eval-data '{root}#split=NAME'")
    if want not in found:
        raise ValueError(f"{root} holds the splits {counts(found)} (named as HF datasets names them) but no "
                         f"{want!r}: pick one with --split NAME (or PATH#split=NAME)")
    keep = set(found[want])
    return Selection(want, [f for f, r in zip(files, rels) if r in keep], found, unsplit)


def counts(found: dict[str, list[str]]) -> dict[str, int]:
    return {s: len(rels) for s, rels in found.items()}


def found(root: str, files: list[str]) -> dict[str, int]:
    """{split: data files} of a listing ({} when no file names a split)."""
    return counts(_split_map(files, [fs.relative(f, root) for f in files])[0])


def select(root: str, files: list[str], split: str) -> list[str]:
    """The files of ``split`` when the listing names splits; all of them when it names none. Warns once per
    folder and split naming the files left out, and when --eval-data's held-out set is a train split."""
    sel = selection(root, files, split)
    if not sel.split or (root, split, tuple(files)) in _warned:
        return sel.files
    _warned.add((root, split, tuple(files)))
    if split == HELD_OUT and _is_train(sel.split):
        log.warning("%s: --eval-data reads its split %r, the only one there: the evaluation runs on training "
                    "data; give a held-out folder, or PATH#split=NAME", root, sel.split)
    gone = sel.left_out()
    if gone:
        told = "; ".join(f"{s} {len(r)} file(s), e.g. {', '.join(r[:3])}" for s, r in gone.items())
        hint = "; point --data at the files in no split to read them" if NO_SPLIT in gone else ""
        log.warning("%s: reads split %r (%d file(s)), as HF datasets splits this folder; left out: %s. "
                    "--split NAME (or PATH#split=NAME) reads another split%s", root, sel.split, len(sel.files),
                    told, hint)
    return sel.files


def _first_word(split: str) -> str:
    """A custom split's keyword: train_sft -> train, test_gen -> test."""
    return re.split(r"[-._ 0-9]", split, maxsplit=1)[0]


def _is_train(split: str) -> bool:
    """train, training and their custom shards' names (train_sft, train_gen, train_prefs ...)."""
    return canonical(_first_word(split)) == "train"


_SPLIT_DIR = matcher([p for ps in DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME.values() for p in ps])


def configs(root: str, files: list[str] | None = None) -> list[str]:
    """The config folders of a dataset root (sorted), or [] when it is not a folder of configs."""
    if listing.kind(root) != "dir":
        return []
    files = listing.files(root) if files is None else files
    tops: dict[str, int] = {}
    rels = [fs.relative(f, root) for f in files]
    for rel in rels:
        if "/" not in rel:
            if rel.lower().endswith(DATA_EXTS):
                return []  # data at the top: one dataset (its folders are part of it)
            continue
        top = rel.split("/", 1)[0]
        if rel.lower().endswith(DATA_EXTS):
            tops[top] = tops.get(top, 0) + 1
    names = sorted(tops)
    if len(names) < 2 or any(n in NOT_SPLITS or _SPLIT_DIR.match(n + "/x") for n in names):
        return []
    if _dict_splits(files, rels):
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
