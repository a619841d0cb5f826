"""The held-out split (``--eval-split F``): a sample is held out when a hash of its id falls below F.

A hash, not a draw: the split is the same in every run, resume and epoch, on every worker,
whatever the read order or the shuffle, and a sample id that is held out is never trained
(the training read drops it, the evaluation read keeps only such rows). Rows that stand for a
file that could not be read (``read_error`` set) stay with training, which reports them. Over a
blend by weight, a sample's copies (``id~k``) share its side, and the held-out side is read
once per sample, without the blend's weights (they shape training epochs, not the eval mean).
"""
from __future__ import annotations

import hashlib
import re

import numpy as np

SPLITS = ("train", "eval")
_SALT = b"ray_mmbatch/eval-split/v1"


_COPY = re.compile(r"~\d+$")  # a blend's extra copy of a sample: id~k (formats/sources.py)


def held_out_score(sample_id: str) -> float:
    """A uniform number in [0, 1) from the id alone (blake2b); a blend's copies (``id~k``) score as
    their sample, so every copy of a sample falls on the same side of the split."""
    base = _COPY.sub("", str(sample_id))
    h = hashlib.blake2b(base.encode("utf-8", "surrogatepass"), digest_size=8, key=_SALT)
    return int.from_bytes(h.digest(), "little") / 2.0**64


def held_out(sample_ids, fraction: float) -> np.ndarray:
    """Per id: is it held out at ``fraction``?"""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"eval split must be a fraction in [0, 1), got {fraction!r}")
    return np.fromiter((held_out_score(s) < fraction for s in sample_ids), dtype=bool, count=len(sample_ids))


def keep_mask(split: tuple[str, float] | None, sample_ids, read_errors) -> np.ndarray | None:
    """Rows of a read table that belong to ``split`` = (name, fraction); None = keep all."""
    if split is None or not split[1]:
        return None if split is None or split[0] == "train" else np.zeros(len(sample_ids), bool)
    name, fraction = split
    if name not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
    out = held_out(sample_ids, fraction) & np.array([not e for e in read_errors], dtype=bool)
    return out if name == "eval" else ~out


def train_split(data_cfg) -> tuple[str, float] | None:
    """The split the training read keeps: ('train', F) with --eval-split F on the training data."""
    return ("train", float(data_cfg.eval_split)) if data_cfg.eval_split and not data_cfg.eval_data else None


def has_eval(data_cfg) -> bool:
    return bool(data_cfg.eval_data or data_cfg.eval_split)


def eval_source(cfg):
    """(a copy of cfg reading the held-out set, the split its read keeps): --eval-data whole, else
    the --eval-split side of --data. Not shuffled: the order does not change a mean."""
    import copy

    ev = copy.deepcopy(cfg)
    ev.data.shuffle = "none"
    if cfg.data.eval_data:
        from ray_mmbatch.formats.sources import parse_location
        from ray_mmbatch.formats.splits import HELD_OUT

        path, extra = parse_location(cfg.data.eval_data)  # FOLDER#split=validation, FOLDER#config=NAME
        ev.data.path, ev.data.eval_data, ev.data.eval_split = path, "", 0.0
        ev.data.split = extra.get("split") or HELD_OUT  # a Hub-style folder: its validation split, else test
        ev.data.sources = [{"path": path, "config": extra["config"]}] if extra.get("config") else []
        if ev.data.sources:
            ev.data.path = ""
        return ev, None
    if ev.data.sources:  # a blend's weights shape training epochs; the held-out set is read once, whole
        from ray_mmbatch.formats.sources import without_weights

        ev.data = without_weights(ev.data)
    return ev, ("eval", float(cfg.data.eval_split))
