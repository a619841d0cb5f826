"""One listing per source per run: what a run's steps (pre-flight, the run plan's count, the listing digest a
resume checks, the pipeline's read, the --filter counts of summary.json, ``inspect``, ``tune``) share.

``with one_listing():`` opens a run's scope. Inside it, the root's kind and file list (``fs.kind``,
``fs.list_files``), each source's read units (``formats.list_units``) and its row count are computed once,
keyed by the location and every data setting (DataConfig's fields, so two sources or two settings never
share an entry), and handed out as copies (a caller that edits a unit dict edits its own). Outside a scope
nothing is kept: each call lists again, as before. The scope ends with the run, so a second run in the same
process (a test, a notebook) lists afresh and sees files added or rewritten in between; scopes nest (an inner
one uses the outer's entries).

The memo lives in a ContextVar of the driver: Ray workers and the Train controller never see it (they are
handed the listing itself: trainer.build_trainer passes the read units to each epoch's dataset), and a thread
the driver starts (formats/arrow.py's listing pool) starts without it, so it lists as outside a scope. A lock
keeps two threads that share a context from listing the same source twice.

Cost: the entries hold the read units (one small dict per row group / shard / record-batch range) for the
run's length; the saving is a listing per step (on an object store: a LIST per folder, a HEAD per root and,
for save_to_disk shards, the record-batch headers: formats/arrow.py). Measured by benchmarks/bench_listing.py.
Pure module: no ray.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import threading
from collections.abc import Callable
from typing import Any

from ray_mmbatch.formats import fs

_MEMO: contextvars.ContextVar[dict | None] = contextvars.ContextVar("ray_mmbatch_listing", default=None)
_LOCK = threading.RLock()


@contextlib.contextmanager
def one_listing():
    """A run's scope: each source is listed once inside it (the module docstring)."""
    if _MEMO.get() is not None:  # nested: the outer run's listing
        yield
        return
    token = _MEMO.set({})
    try:
        yield
    finally:
        _MEMO.reset(token)


def in_one_listing(fn):
    """``fn`` run inside a scope (its own, or the run's it is called in): one call lists each source once."""
    @functools.wraps(fn)
    def scoped(*args, **kwargs):
        with one_listing():
            return fn(*args, **kwargs)
    return scoped


def active() -> bool:
    return _MEMO.get() is not None


def settings_key(data_cfg) -> str:
    """Every data setting, as one string (a memo key part): the listing depends on format, split, filter,
    columns, ...; keying on all of them cannot give one source's listing to another."""
    if data_cfg is None:
        return ""
    fields = dataclasses.asdict(data_cfg) if dataclasses.is_dataclass(data_cfg) else dict(vars(data_cfg))
    return json.dumps(fields, sort_keys=True, default=str)


def remembered(key: tuple, compute: Callable[[], Any], copy: Callable[[Any], Any] = lambda v: v) -> Any:
    """``compute()`` once per key inside a run's scope (``copy`` of the kept value handed out); outside one,
    ``compute()`` every time."""
    memo = _MEMO.get()
    if memo is None:
        return compute()
    with _LOCK:
        if key not in memo:
            memo[key] = compute()
        return copy(memo[key])


def copy_units(value: tuple) -> tuple:
    """(format, units) with each unit dict copied."""
    fmt, units = value
    return fmt, [dict(u) for u in units]


def files(root: str) -> list[str]:
    """``fs.list_files(root)`` (every file under a root), once per run."""
    return remembered(("files", root.rstrip("/")), lambda: fs.list_files(root), list)


def kind(location: str) -> str:
    """``fs.kind(location)`` ('file', 'dir', 'missing', 'other'), once per run."""
    return remembered(("kind", location.rstrip("/") or location), lambda: fs.kind(location))


def check_root(location: str) -> str:
    """``fs.check_root``: the root's kind, DataLocationError naming it when missing; once per run."""
    found = kind(location)
    return fs.check_root(location) if found in ("missing", "other") else found
