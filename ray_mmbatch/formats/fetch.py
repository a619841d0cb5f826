"""A checkpoint folder in a bucket (``--model s3://...``, gs://, abfs://), copied once per node.

``local_checkpoint(location)`` returns a local directory holding the folder's files: a local path
as given; a URI's copy under the cache (``$RAY_MMBATCH_MODEL_CACHE``, default
``~/.cache/ray_mmbatch/models``), in ``<first 16 hex of sha256(uri)>-<folder name>/``. The config
keeps the URI; every place that opens the checkpoint (configure on the driver, a Train worker's
model load, a data actor's tokenizer) asks this function, so each node downloads once, on first
use, whichever process gets there first.

Safe for several processes of one node: each downloads into its own temporary folder beside the
cache entry and renames it into place (one ``rename`` of a directory is atomic; a loser finds the
winner's copy and drops its own). A copy is complete when its ``.complete`` marker is there (written
into the temporary folder last, so a half copy is never renamed into place). A complete copy is
never checked against the bucket again: a changed checkpoint goes under a new URI (or clear the
cache). Cost: one listing plus every file's bytes, once per node; nothing on a hit.
Pure module: pyarrow, no ray.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pyarrow.fs as pafs

from ray_mmbatch.formats import fs

CACHE_ENV = "RAY_MMBATCH_MODEL_CACHE"
COMPLETE = ".complete"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "ray_mmbatch" / "models")


def cache_dir(uri: str) -> Path:
    """The folder a URI's copy lives in (deterministic: the same on every node and process)."""
    digest = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
    name = uri.rstrip("/").rsplit("/", 1)[-1] or "root"
    return cache_root() / f"{digest}-{name}"


def local_checkpoint(location: str) -> str:
    """A local directory with the files at ``location``: itself when local, else the node's cached copy
    (downloaded now if this node has none). Empty stays empty (no checkpoint)."""
    if not location or not fs.is_uri(location):
        return location
    target = cache_dir(location)
    if (target / COMPLETE).is_file():
        return str(target)
    _download(location, target)
    return str(target)


def _download(uri: str, target: Path) -> None:
    filesystem, root = fs.split(uri.rstrip("/"))
    try:
        infos = filesystem.get_file_info(pafs.FileSelector(root, recursive=True))
    except FileNotFoundError:
        infos = []
    except OSError as exc:
        raise fs.DataLocationError(f"model {uri!r}: cannot list it ({exc})") from None
    files = [i for i in infos if i.type == pafs.FileType.File]
    if not files:
        raise fs.DataLocationError(f"model {uri!r}: no checkpoint files there (expected a Hugging Face "
                                   "checkpoint folder: config.json, weights, tokenizer, processor files)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        for info in files:
            rel = info.path[len(root):].lstrip("/")
            dest = tmp / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            with filesystem.open_input_stream(info.path) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, 8 << 20)
        (tmp / COMPLETE).write_text(uri + "\n")
        try:
            os.rename(tmp, target)  # atomic; fails when another process's copy got there first
        except OSError:
            if not (target / COMPLETE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
