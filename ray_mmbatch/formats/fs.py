"""Where data lives: plain paths and any URI pyarrow's filesystems know (s3://, gs://, abfs://, hdfs://, file://).

A location is a string: a local path, or ``scheme://bucket/key``. ``split`` gives the
(pyarrow filesystem, path inside it), cached per scheme and bucket so a worker builds
one S3 client, not one per file. Credentials and endpoints come the standard way:
pyarrow reads ``AWS_ACCESS_KEY_ID`` / ``AWS_PROFILE`` / instance roles, and
``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``) for S3-compatible stores (MinIO,
Ceph, R2); nothing here asks for keys.

Listing (``list_files``) is recursive, sorted by the path relative to the root (the
same order on every filesystem), and leaves out hidden entries (any part starting
with "."; macOS ``._*`` AppleDouble files among them). ``check_root`` fails at start
with a message naming the URI when the root is missing or cannot be listed.
Pure module: pyarrow, no ray.
"""
from __future__ import annotations

import functools
import os
import posixpath
import stat as stat_mod
from urllib.parse import urlparse

import pyarrow.fs as pafs


class DataLocationError(FileNotFoundError):
    """The dataset root (or image root) is missing, or cannot be listed (names the URI and why)."""


def is_uri(location: str) -> bool:
    scheme = urlparse(location).scheme
    return len(scheme) > 1 and scheme != "file"  # "C:" is a drive letter, file:// is local


def local_path(location: str) -> str:
    """file:///x -> /x; plain paths unchanged."""
    return urlparse(location).path if location.startswith("file://") else location


@functools.lru_cache(maxsize=32)
def _filesystem(scheme: str, netloc: str) -> pafs.FileSystem:
    fs, _ = pafs.FileSystem.from_uri(f"{scheme}://{netloc}")
    return fs


def split(location: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a location."""
    if not is_uri(location):
        return pafs.LocalFileSystem(), os.path.abspath(local_path(location))
    u = urlparse(location)
    return _filesystem(u.scheme, u.netloc), f"{u.netloc}{u.path}".rstrip("/")


def join(root: str, rel: str) -> str:
    return posixpath.join(root.rstrip("/"), rel) if is_uri(root) else os.path.join(local_path(root), rel)


def dirname(location: str) -> str:
    return posixpath.dirname(location.rstrip("/")) if is_uri(location) else \
        os.path.dirname(os.path.abspath(local_path(location)))


def relative(location: str, root: str) -> str:
    """The location relative to the root, "/"-separated (the id prefix of its samples)."""
    if is_uri(location):
        return location[len(root.rstrip("/")) + 1:] if location.startswith(root.rstrip("/") + "/") \
            else posixpath.basename(location)
    rel = os.path.relpath(os.path.abspath(local_path(location)), os.path.abspath(local_path(root)))
    return rel.replace(os.sep, "/")


def _hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split("/") if part not in ("", "."))


def _access_error(location: str, exc: Exception) -> DataLocationError:
    return DataLocationError(f"cannot read {location!r}: {exc}")


def kind(location: str) -> str:
    """'file', 'dir', 'missing' or 'other' (FIFO, device, socket: never opened). Local paths follow symlinks."""
    if not is_uri(location):
        try:
            mode = os.stat(local_path(location)).st_mode
        except (OSError, ValueError):  # ValueError: NUL in the path
            return "missing"
        return "file" if stat_mod.S_ISREG(mode) else "dir" if stat_mod.S_ISDIR(mode) else "other"
    fs, path = split(location)
    try:
        info = fs.get_file_info(path)
    except OSError as exc:
        raise _access_error(location, exc) from None
    return {pafs.FileType.File: "file", pafs.FileType.Directory: "dir",
            pafs.FileType.NotFound: "missing"}.get(info.type, "other")


def size(location: str) -> int:
    """Bytes of a regular file (stat, nothing read)."""
    if not is_uri(location):
        return os.stat(local_path(location)).st_size
    fs, path = split(location)
    return int(fs.get_file_info(path).size or 0)


def check_root(location: str) -> str:
    """The root's kind ('file' or 'dir'); DataLocationError naming the URI if missing or unreadable."""
    found = kind(location)
    if found == "missing":
        raise DataLocationError(f"dataset path {location!r} does not exist")
    if found == "other":
        raise DataLocationError(f"dataset path {location!r} is not a file or folder")
    return found


def list_files(root: str, exts: tuple[str, ...] | None = None) -> list[str]:
    """Every non-hidden entry under ``root`` (recursively) whose name ends with one of ``exts``, sorted by
    relative path. Local entries that are not regular files (FIFOs, dangling links) are listed, never
    opened: the reader reports them. Raises DataLocationError when the root cannot be listed."""
    found = []
    if not is_uri(root):
        base = os.path.abspath(local_path(root))
        try:
            for dirpath, dirnames, files in os.walk(base, onerror=_raise):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                found += [os.path.join(dirpath, f) for f in files if not f.startswith(".")]
        except OSError as exc:
            raise _access_error(root, exc) from None
    else:
        fs, path = split(root)
        try:
            infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        except OSError as exc:
            raise _access_error(root, exc) from None
        prefix = root.split("://", 1)[0] + "://"
        found = [prefix + i.path for i in infos if i.type != pafs.FileType.Directory]
    out = [(relative(f, root), f) for f in found if exts is None or f.lower().endswith(exts)]
    return [f for rel, f in sorted(out) if not _hidden(rel)]


def _raise(exc: OSError) -> None:
    raise exc


def open_input(location: str, max_bytes: int | None = None):
    """A readable binary stream (local: only a regular file is opened; a FIFO would block forever)."""
    if not is_uri(location):
        if kind(location) != "file":
            raise OSError(f"{location} is not a regular file")
        return open(local_path(location), "rb")
    fs, path = split(location)
    return fs.open_input_stream(path)


def open_random_access(location: str):
    """A seekable file (Parquet footers, row groups)."""
    if not is_uri(location):
        if kind(location) != "file":
            raise OSError(f"{location} is not a regular file")
        return pafs.LocalFileSystem().open_input_file(os.path.abspath(local_path(location)))
    fs, path = split(location)
    return fs.open_input_file(path)


def read_bytes(location: str) -> bytes:
    with open_input(location) as f:
        return f.read()
