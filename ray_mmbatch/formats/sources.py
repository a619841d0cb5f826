"""Several datasets in one run (``data.sources``, ``--data`` repeated): one listing, one stream.

Each source is a mapping with ``path`` and optionally ``name``, ``weight`` and any data setting
of its own (``format``, ``image_root``, ``image_column``, ``text_column``, ``id_column``, ...):
the run's DataConfig with those fields replaced. The read units of all sources form one
listing (source after source, each in its own sorted order), so the data position, the unit
shuffle and the shuffle buffer work across sources as over one dataset; a unit is read with
its own source's format and settings, and every sample id gets its source's name in front
(``name:id``), so two sources may share ids and skips are reported per source.

On the command line: ``--data PATH`` repeated, ``PATH#WEIGHT`` to give a weight (ms-swift's
``dataset#N`` style), ``PATH#split=NAME`` / ``PATH#config=NAME`` for a split or a config of a Hub-style
folder (formats/splits.py). A folder of configs is one source per config.

Blend by weight (when any source has a ``weight``; then every source needs one): as Mosaic
Streaming's ``proportion``, a source's weight is its share of every epoch's samples, and an
epoch holds as many samples as the sources together (``data.epoch_samples`` otherwise). A
source's count c = round(N x weight / sum of weights) (largest remainders, so they add to N);
with n rows it gives each row c // n copies and c % n rows one more, chosen by the smallest
seeded hash scores of (seed, epoch, source, row) — a source above its size is up-sampled (every
row at least once, then a seeded choice of repeats), one below it down-sampled (a seeded subset
that changes per epoch). The counts are exact, decided per row from the header listing alone
(``BlendPlan``), so every read task knows its rows' copies without seeing the others, and a
resumed epoch makes the same choice. A row's copies are consecutive virtual rows of its unit
(the data position counts them apart); the k-th extra copy's id ends in ``~k``. Rows that stand
for an unreadable file are kept once (they are reported, not trained).
Pure module.
"""
from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import PurePosixPath
from typing import Any

SOURCE = "source"  # the read unit's source index (in the unit dicts of a multi-source listing)
ID_SEP = ":"


def blended(data_cfg) -> bool:
    """Is this a blend by weight (any source with a weight; then all need one)?"""
    given = [isinstance(e, dict) and "weight" in e for e in data_cfg.sources]
    if any(given) and not all(given):
        missing = [k for k, g in enumerate(given) if not g]
        raise ValueError(f"data.sources{missing}: no weight, while other sources have one: give every source a "
                         "weight (its share of each epoch), or none (each sample once per epoch)")
    return bool(given) and all(given)


def without_weights(data_cfg):
    """A copy of ``data_cfg`` that reads every sample of every source once (no blend): what the
    held-out set and ``inspect`` read, whatever shares training epochs draw."""
    out = copy.deepcopy(data_cfg)
    out.sources = [{k: v for k, v in e.items() if k != "weight"} if isinstance(e, dict) else e
                   for e in out.sources]
    out.epoch_samples = 0
    return out


@dataclasses.dataclass(frozen=True)
class Source:
    name: str
    data: Any  # DataConfig of this source (sources cleared)
    weight: float


_SUFFIX = re.compile(r"#(split|config)=([^#]*)$|#([0-9.eE+-]+)$")


def parse_location(value: str) -> tuple[str, dict[str, Any]]:
    """'PATH#config=NAME#split=NAME#WEIGHT' (each part optional, any order) -> (PATH, {config, split, weight})."""
    path, extra = str(value), {}
    while True:
        m = _SUFFIX.search(path)
        if not m:
            return path, extra
        if m.group(3) is not None:
            extra.setdefault("weight", float(m.group(3)))
        else:
            extra.setdefault(m.group(1), m.group(2))
        path = path[:m.start()]


def parse_data_flag(values: list[str]) -> dict[str, Any]:
    """``--data`` given once or several times -> the data overrides: one path (with its split), or a sources
    list (``PATH#WEIGHT``, ms-swift's ``dataset#N`` style; ``#split=NAME``, ``#config=NAME``)."""
    parsed = [parse_location(v) for v in values]
    if len(parsed) == 1 and set(parsed[0][1]) <= {"split"}:
        path, extra = parsed[0]
        return {"data.path": path, **({"data.split": extra["split"]} if "split" in extra else {})}
    return {"data.sources": [{"path": path, **extra} for path, extra in parsed]}


def _default_name(path: str) -> str:
    p = PurePosixPath(str(path).rstrip("/"))
    return (p.stem if p.suffix in (".json", ".parquet", ".tar", ".jsonl") else p.name) or "source"


def data_sources(data_cfg) -> list[Source]:
    """The run's sources: ``data.sources`` resolved (names unique, settings checked), or the one ``data.path``."""
    from ray_mmbatch.formats.splits import expand

    data_cfg = expand(data_cfg)  # folders of configs: one source per config (formats/splits.py)
    if not data_cfg.sources:
        return [Source("", data_cfg, 1.0)]
    if data_cfg.path:
        raise ValueError("data: give either data.path (--data once) or data.sources (--data repeated / a list "
                         f"under data.sources in --config), not both (path {data_cfg.path!r})")
    fields = {f.name for f in dataclasses.fields(data_cfg)} - {"sources"}
    out, names = [], set()
    for k, entry in enumerate(data_cfg.sources):
        if isinstance(entry, str):
            entry = {"path": entry}
        if not isinstance(entry, dict) or not entry.get("path"):
            raise ValueError(f"data.sources[{k}]: expected a mapping with a path, got {entry!r}")
        bad = sorted(set(entry) - fields - {"name", "weight", "config"})
        if bad:
            raise ValueError(f"data.sources[{k}]: unknown settings {bad}; a source takes name, weight and any of "
                             f"{sorted(fields)}")
        weight = float(entry.get("weight", 1.0))
        if not weight > 0:
            raise ValueError(f"data.sources[{k}]: weight must be > 0, got {entry.get('weight')!r}")
        name = str(entry.get("name") or _default_name(entry["path"]))
        if ID_SEP in name:
            raise ValueError(f"data.sources[{k}]: name {name!r} must not contain {ID_SEP!r}")
        base, n = name, 2
        while name in names:  # two folders called "train": train, train-2
            name, n = f"{base}-{n}", n + 1
        names.add(name)
        cfg = copy.deepcopy(data_cfg)
        cfg.sources = []
        for key, value in entry.items():
            if key in fields:
                setattr(cfg, key, value)
        out.append(Source(name, cfg, weight))
    return out


def by_source(sample_ids, reasons=None) -> dict[str, dict[str, int]]:
    """Per source name: {"samples": n} and, with ``reasons`` (a skip reason per id, "" = kept),
    {"skipped": n, <reason>: n, ...}. For a multi-source run's ids."""
    out: dict[str, dict[str, int]] = {}
    for k, sid in enumerate(sample_ids):
        rec = out.setdefault(source_of(sid), {"samples": 0, "skipped": 0})
        rec["samples"] += 1
        reason = reasons[k] if reasons is not None else ""
        if reason:
            rec["skipped"] += 1
            rec[reason] = rec.get(reason, 0) + 1
    return out


class BlendPlan:
    """Per-source row counts and epoch targets (module docstring); ``for_epoch`` gives what read
    tasks need: per source (copies every row gets, score threshold below which a row gets one more)."""

    def __init__(self, rows: list[int], weights: list[float], epoch_samples: int = 0, seed: int = 0):
        import numpy as np

        self.rows, self.seed = [int(n) for n in rows], int(seed)
        total = int(epoch_samples) or sum(self.rows)
        share = np.asarray(weights, float) / float(np.sum(weights))
        exact = share * total
        counts = np.floor(exact).astype(np.int64)
        for k in np.argsort(-(exact - counts), kind="stable")[: total - int(counts.sum())]:
            counts[k] += 1  # largest remainders: the counts add up to the epoch's size
        for k, (n, c) in enumerate(zip(self.rows, counts)):
            if c and not n:
                raise ValueError(f"data.sources[{k}] has no rows but a weight: nothing to draw its share from")
        self.targets = [int(c) for c in counts]
        self._epochs: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (seed, epoch) -> for_epoch

    def scores(self, source: int, epoch: int, rows, seed: int | None = None):
        """A seeded uint64 score per row of a source (``seed``: the run's train.seed, default the plan's)."""
        import numpy as np

        from ray_mmbatch.batching.shuffle import position_hash

        seed = self.seed if seed is None else int(seed)
        return position_hash(np.asarray(rows, np.int64), seed * 1_000_003 + source, epoch)

    def for_epoch(self, epoch: int, seed: int | None = None) -> list[tuple[int, int]]:
        """Per source: (base copies, threshold): a row gets base + (score < threshold) copies."""
        import numpy as np

        seed = self.seed if seed is None else int(seed)
        key = (seed, int(epoch))
        if key not in self._epochs:
            out = []
            for k, (n, c) in enumerate(zip(self.rows, self.targets)):
                base, extra = (c // n, c % n) if n else (0, 0)
                if extra == 0:
                    out.append((base, 0))
                    continue
                s = np.sort(self.scores(k, epoch, np.arange(n), seed))
                out.append((base, int(s[extra]) if extra < n else 2**64 - 1))
            self._epochs[key] = out
        return self._epochs[key]


def source_of(sample_id: str) -> str:
    """The source name of a multi-source sample id ('' for a single-source one)."""
    name, sep, _ = str(sample_id).partition(ID_SEP)
    return name if sep and "/" not in name else ""
