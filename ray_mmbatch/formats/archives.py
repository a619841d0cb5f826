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
formats/fs.open_random_access, so on s3:// a member costs a ranged read, not a download.

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

_open: collections.OrderedDict[str, tuple] = collections.OrderedDict()
_lock = threading.Lock()


def archive_parts(ref: str) -> tuple[str, list[str]] | None:
    """(archive stem, member names to try) for an image path ``A/.../x.jpg``; None for a path with no folder."""
    norm = posixpath.normpath(ref)
    head, sep, rest = norm.partition("/")
    if not sep or head in ("", ".", "..") or not rest:
        return None
    return head, [norm, rest]


def _zip(location: str) -> tuple[zipfile.ZipFile | None, str]:
    """The open archive at ``location`` (cached), or (None, why it cannot be read; cached too)."""
    with _lock:
        if location in _open:
            _open.move_to_end(location)
            return _open[location][0], _open[location][2]
    f = zf = None
    err = ""
    try:
        f = fs.open_random_access(location)
        zf = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        err = "is not a zip file" if isinstance(exc, zipfile.BadZipFile) else f"cannot be opened: {exc}"
        if f is not None:
            f.close()
        f = zf = None
    with _lock:
        _open[location] = (zf, f, err)
        while len(_open) > ZIP_CACHE:
            old_zf, old_f, _ = _open.popitem(last=False)[1]
            if old_zf is not None:
                old_zf.close()
                old_f.close()
    return zf, err


def cached_archives() -> list[str]:
    """The archives this process holds open (or remembers as unreadable), least recently used first."""
    with _lock:
        return list(_open)


def close_all() -> None:
    """Close every cached archive (tests; a process that is done with the data)."""
    with _lock:
        while _open:
            zf, f, _ = _open.popitem()[1]
            if zf is not None:
                zf.close()
                f.close()


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
    zf, why = _zip(location)
    if zf is None:
        return None, error(schema.SKIP_MISSING_FILE, f"{ref}: {stem}.zip {why}")
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
