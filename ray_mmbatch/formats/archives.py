"""Images packed in archives under the image root: zip members read in place, tar.gz named and refused.

M4-Instruct ships its images as ``<Source>.zip`` beside the JSON, and refers to them as
``<Source>/.../x.jpg``. When such a path is not a file under the image root, ``read_archived``
looks in ``<image root>/<first component>.zip`` for the member ``<Source>/.../x.jpg``, else
``.../x.jpg``, and reads it without extracting anything. The archive passes the rules of a loose
file (formats/llava.resolve_image_path: inside the image root, symlinks included; a regular file);
the member's size in the zip header is checked against data.max_file_bytes before it is read
(file_too_large), and the read stops one byte past that limit whatever the header says. A member
that is not there is missing_file naming archive and member; an archive that is not a zip is
missing_file "A.zip is not a zip file"; the other samples go on.

Each process keeps its last ZIP_CACHE archives open (LRU; the central directory is read once per
archive per process, not per sample). Local and URI image roots alike: the archive is opened with
formats/fs.open_random_access, so on s3:// a member costs a ranged read, not a download. Threads share
the cache: a reader borrows an archive for its read, so an eviction meanwhile closes it only when the
last borrower is done; two threads opening one archive at once keep one copy (the other is closed); "is
not a zip file" is remembered, an error opening it (a network blip) is not, so the next sample retries.

Gzip'd tars (Cambrian's per-source ``A.tar.gz``, MAmmoTH-VL's ``shard_N.tar.gz``, split ``.part-aa``
pieces) have no random access: ``tar_hint`` names the archive of a missing image and the command
that extracts it (the sample is skipped, the archive never read), and ``unextracted_tars`` lists
the archives at the top of an image root that have no folder of their name (for one warning).
Pure module: no ray.
"""
from __future__ import annotations

import collections
import functools
import os
import posixpath
import threading
import zipfile
import zlib

from ray_mmbatch import schema
from ray_mmbatch.formats import fs
from ray_mmbatch.formats.records import error

ZIP_CACHE = 8
TAR_EXTS = (".tar.gz", ".tgz", ".tar")
PART_SUFFIXES = (".part-aa", ".partaa", ".part_aa", ".aa", ".part-00", ".part00", ".00", ".000", ".001")
TOP_SCAN_LIMIT = 100_000  # entries at the top of an image root looked at for unextracted tars

_open: collections.OrderedDict[str, _Archive] = collections.OrderedDict()
_lock = threading.Lock()


def archive_parts(ref: str) -> tuple[str, list[str]] | None:
    """(archive stem, member names to try) for an image path ``A/.../x.jpg``; None for a path with no folder."""
    norm = posixpath.normpath(ref)
    head, sep, rest = norm.partition("/")
    if not sep or head in ("", ".", "..") or not rest:
        return None
    return head, [norm, rest]


class _Archive:
    """One archive as the cache holds it: the open ZipFile and its file, or why it cannot be read; ``users``
    borrowers reading it now; ``evicted``: out of the cache, closed when the last borrower is done."""

    __slots__ = ("zf", "f", "err", "users", "evicted")

    def __init__(self, zf: zipfile.ZipFile | None, f, err: str):
        self.zf, self.f, self.err, self.users, self.evicted = zf, f, err, 0, False

    def close(self) -> None:
        if self.zf is not None:
            self.zf.close()
            self.f.close()


def _open_archive(location: str) -> tuple[_Archive, bool]:
    """(the archive at ``location``, opened or with the reason it cannot be; whether to remember it: an open one
    or one that is not a zip, never an error that may pass)."""
    f = None
    try:
        f = fs.open_random_access(location)
        return _Archive(zipfile.ZipFile(f), f, ""), True
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        if f is not None:
            f.close()
        if isinstance(exc, zipfile.BadZipFile):
            return _Archive(None, None, "is not a zip file"), True
        return _Archive(None, None, f"cannot be opened: {exc}"), False


def _acquire(location: str) -> _Archive:
    """The archive at ``location`` from the cache (opened outside the lock when it is not there), borrowed:
    hand it back with ``_release``."""
    with _lock:
        entry = _open.get(location)
        if entry is not None:
            _open.move_to_end(location)
            entry.users += 1
            return entry
    opened, keep = _open_archive(location)  # slow I/O: not under the lock
    loser = None
    with _lock:
        entry = _open.get(location)
        if entry is not None:  # another thread opened it meanwhile: theirs stays, ours is closed
            _open.move_to_end(location)
            loser, opened = opened, entry
        elif keep:
            _open[location] = opened
            while len(_open) > ZIP_CACHE:
                old = _open.popitem(last=False)[1]
                old.evicted = True
                if old.users == 0:
                    old.close()
        opened.users += 1
    if loser is not None:
        loser.close()
    return opened


def _release(entry: _Archive) -> None:
    with _lock:
        entry.users -= 1
        done = entry.users == 0 and entry.evicted
    if done:
        entry.close()


def cached_archives() -> list[str]:
    """The archives this process holds open (or remembers as not zip files), least recently used first."""
    with _lock:
        return list(_open)


def close_all() -> None:
    """Close every cached archive (tests; a process that is done with the data); one being read closes when
    its reader is done."""
    with _lock:
        entries = list(_open.values())
        _open.clear()
        idle = []
        for entry in entries:
            entry.evicted = True
            if entry.users == 0:
                idle.append(entry)
    for entry in idle:
        entry.close()


def read_archived(ref: str, image_root: str, max_bytes: int, resolve) -> tuple[bytes | None, str]:
    """The bytes of image path ``ref`` from an archive under ``image_root``: (bytes, "") or (None, read_error);
    (None, "") for a path with no folder. ``resolve(path, image_root)`` -> (location | None, read_error) is
    the loose files' rule (formats/llava.resolve_image_path), applied to the archive."""
    parts = archive_parts(ref)
    if parts is None:
        return None, ""
    stem, members = parts
    location, err = resolve(f"{stem}.zip", image_root)
    if location is None:
        if err.startswith(schema.SKIP_PATH_OUTSIDE_ROOT):  # a link out of the root: never opened
            return None, error(schema.SKIP_PATH_OUTSIDE_ROOT, f"{ref}: archive {stem}.zip is outside the image root")
        return None, tar_hint(ref, image_root)
    entry = _acquire(location)
    try:
        return _read_member(entry, ref, stem, members, max_bytes)
    finally:
        _release(entry)


def _read_member(entry: _Archive, ref: str, stem: str, members: list[str], max_bytes: int) -> tuple[bytes | None, str]:
    """The first of ``members`` in the borrowed archive: (bytes, "") or (None, read_error)."""
    zf = entry.zf
    if zf is None:
        return None, error(schema.SKIP_MISSING_FILE, f"{ref}: {stem}.zip {entry.err}")
    for name in members:
        try:
            info = zf.getinfo(name)
        except KeyError:
            continue
        if info.is_dir():
            continue
        detail = f"{stem}.zip member {name}"
        if max_bytes and info.file_size > max_bytes:
            return None, error(schema.SKIP_FILE_TOO_LARGE,
                               f"{detail}: {info.file_size:,} bytes > data.max_file_bytes={max_bytes:,}")
        try:
            with zf.open(info) as member:
                data = member.read(max_bytes + 1) if max_bytes else member.read()
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error, NotImplementedError, RuntimeError) as exc:
            return None, error(schema.SKIP_MISSING_FILE, f"{detail} cannot be read: {exc}")
        if max_bytes and len(data) > max_bytes:
            return None, error(schema.SKIP_FILE_TOO_LARGE, f"{detail}: over data.max_file_bytes={max_bytes:,}")
        return data, ""
    return None, error(schema.SKIP_MISSING_FILE, f"{ref}: not in {stem}.zip (no member {' nor '.join(members)})")


# ------------------------------------------------------------------ gzip'd tars: named, never read
@functools.lru_cache(maxsize=4096)
def _tar_of(image_root: str, stem: str) -> str:
    """The name of the tar archive (or its first part) holding folder ``stem`` of the image root, or ""."""
    for ext in TAR_EXTS:
        for suffix in ("",) + (PART_SUFFIXES if ext != ".tar" else ()):
            name = f"{stem}{ext}{suffix}"
            try:
                if fs.kind(fs.join(image_root, name)) == "file":
                    return name
            except OSError:
                return ""
    return ""


def extract_command(name: str, image_root: str) -> str:
    """The shell command that unpacks tar ``name`` (or the split archive whose first part it is) into the root."""
    root = fs.local_path(image_root) if not fs.is_uri(image_root) else "IMAGE_ROOT"
    flag = "-xf" if name.endswith(".tar") else "-xzf"
    whole = next((name[:-len(s)] for s in PART_SUFFIXES if name.endswith(s)), "")
    if whole:  # split in parts: joined in name order
        return f"cat {root}/{whole}.* | tar {flag} - -C {root}"
    return f"tar {flag} {root}/{name} -C {root}"


def tar_hint(ref: str, image_root: str) -> str:
    """missing_file for ``ref``; when a tar of its first folder lies in the root, naming it and its command."""
    parts = archive_parts(ref)
    name = _tar_of(image_root, parts[0]) if parts else ""
    if not name:
        return error(schema.SKIP_MISSING_FILE, ref)
    return error(schema.SKIP_MISSING_FILE,
                 f"{ref}: its folder is packed in {name}, which is not read (a gzip'd tar has no random "
                 f"access); extract it once: {extract_command(name, image_root)}")


def unextracted_tars(image_root: str) -> list[str]:
    """Tar archives (first parts of split ones) at the top of a local image root with no folder of their name
    (the first TOP_SCAN_LIMIT entries looked at; a URI root is not listed)."""
    if fs.is_uri(image_root):
        return []
    names, found = set(), []
    try:
        with os.scandir(fs.local_path(image_root)) as it:
            for k, entry in enumerate(it):
                if k >= TOP_SCAN_LIMIT:
                    break
                names.add(entry.name)
    except OSError:
        return []
    for name in sorted(names):
        for ext in TAR_EXTS:
            for suffix in ("",) + PART_SUFFIXES:
                if name.endswith(ext + suffix) and (suffix == "" or ext != ".tar"):
                    stem = name[:-len(ext + suffix)]
                    if stem and stem not in names and name not in found:
                        found.append(name)
    return found
