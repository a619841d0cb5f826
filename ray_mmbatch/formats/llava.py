"""LLaVA JSON: one ``.json`` list (or ``.jsonl``, one record a line) of records + an image folder; a folder
of such files (split by name as formats/splits.py splits it) is one dataset, its files read in turn.

Record: {"id"?, "image": "rel/path.jpg" | [...] (or "images"), "video": "rel/clip.mp4" | [...] (or "videos",
LLaVA-Video-178K), "conversations" | "messages"} (conversations may also be a JSON string). A video file is
read like an image file (same root rules, checks and refs) and its bytes are one more media item; a record
holding both kinds has its media in the order of the ``<image>`` / ``<video>`` placeholders of its human
turns (records.place_media: images fill the ``<image>`` slots, videos the ``<video>`` ones; a record with a
video and no placeholder gets them, first in the first human turn). Records of images only are unchanged.
The driver streams the file once (formats/json_stream.py: blocks of 16 MB, never the whole file in memory) and
lists read units of CHUNK records (a smaller file: MIN_UNITS units, ``unit_records``), each a byte range of
the file (offset, length) with its first record index and record count; a worker seeks to its range, reads and
parses only that. A JSON list that breaks off (truncated, a bad record, data after the closing ``]``) keeps
every record before the break and ends in one skipped row ``<file>:unreadable-tail`` (malformed_record, naming
the byte). A JSON Lines file named ``.json`` is refused at start with the right extension named, as is a top
level that is not a list; a ``.jsonl`` line that is not JSON is kept as a malformed_record row; blank lines
are not records.

Image paths resolve inside the image root (``data.image_root``, default the JSON's folder;
a local folder or a URI) or are refused unread: absolute paths, ``..`` and symlinks out of
the root (path_outside_root), NUL in the path (malformed_record). Before a file is read its
size is checked (stat) against ``data.max_file_bytes`` (file_too_large), and only regular
files are opened (a FIFO would hang). A path ``A/x.jpg`` that is not a file there is read from the
archive ``A.zip`` in the root (formats/archives.py); when ``A.tar.gz`` lies there instead, the skip
names it and the command that extracts it, and listing warns once about such archives.

Id scheme: ``<file name>:<record index>`` (a folder of several files: the file relative to the folder),
plus ``#<id>`` when the record has one: a repeated user id (common in merged sets; ``1`` and ``"1"`` too)
stays two samples and stays readable. One warning per file names how many records repeat an id, with examples
(counted while listing: 8 bytes a record; JSON Lines files over IDS_MAX_LINES_BYTES are not
parsed on the driver, so they are not checked and the log says so).
Pure module: no ray.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import posixpath
import stat

from ray_mmbatch import schema
from ray_mmbatch.formats import archives, fs, json_stream
from ray_mmbatch.formats.records import (
    IMAGE,
    VIDEO,
    conversations_to_json,
    error,
    place_media,
    raw_row,
    reorder,
    safe_text,
    sample_id,
)

EXTS = (".json", ".jsonl")
INDEX_NAMES = ("data.json", "data.jsonl")
CHUNK = 1024  # records per read unit at most
FINE_CHUNK, MIN_UNITS = 128, 64  # a small file's units: at least MIN_UNITS of them, of FINE_CHUNK records or more
IDS_MAX_LINES_BYTES = 2**30
CACHE_MIN_BYTES, CACHE_FILES = 64 * 2**20, 2
_listed: dict[tuple, list[dict]] = {}
log = logging.getLogger("ray_mmbatch.formats")


def list_records(location: str, chunk: int = FINE_CHUNK, block: int = json_stream.BLOCK,
                 ids: json_stream.IdTally | None = None) -> json_stream.Listing:
    """The streamed listing of one JSON / JSONL file: spans of ``chunk`` records (ValueError if refused)."""
    with fs.open_input(location) as stream:
        if location.lower().endswith(".jsonl"):
            return json_stream.list_lines(stream, chunk, block, ids)
        return json_stream.list_array(stream, location, chunk, block, ids)


def _warn_repeated_ids(ids: json_stream.IdTally, rel: str) -> None:
    records, repeated, shown = ids.repeated()
    if repeated:
        examples = ", ".join(f"{safe_text(k)!r} x{n}" for k, n in shown)
        log.warning("%s: %d records share their id with another record (%d ids repeated, e.g. %s); each is "
                    "a sample of its own, told apart by record index: '%s:<index>#<id>'",
                    rel, records, repeated, examples, rel)


def _warn_unextracted(image_root: str) -> None:
    tars = archives.unextracted_tars(image_root)
    if tars:
        log.warning("%s holds %d tar archive(s) with no folder of their name (%s): images inside them are not "
                    "read (no random access in a gzip'd tar) and their samples will be skipped as missing_file; "
                    "extract each once, e.g. %s", image_root, len(tars), ", ".join(tars[:5]),
                    archives.extract_command(tars[0], image_root))


def list_units(files: list[str], root: str, data_cfg) -> list[dict]:
    """The units of each JSON / JSONL file in turn (a folder of them is one dataset, formats.resolve). With one
    file, ids start with its name; with several, with its path relative to the dataset root (unique)."""
    for image_root in sorted({data_cfg.image_root or fs.dirname(f) for f in files}):  # once a folder: it lists it
        _warn_unextracted(image_root)
    units = []
    for location in files:
        units += file_units(location, data_cfg.image_root or fs.dirname(location),
                            rel=fs.relative(location, root) if len(files) > 1 else None)
    return units


def unit_records(records: int) -> int:
    """Records per read unit of a file of ``records``: CHUNK, but a smaller file is cut into MIN_UNITS units or more
    (a power of two times FINE_CHUNK records): a read unit is one task on one preprocessing actor, so
    3,000 records in units of 1,024 kept one of two actors idle for a third of the pass."""
    return min(CHUNK, FINE_CHUNK * 2 ** (max(1, records // MIN_UNITS // FINE_CHUNK).bit_length() - 1))


def merge_spans(spans: list, per_span: int, records: int) -> list:
    """Consecutive spans of ``per_span`` records merged into spans of ``unit_records(records)`` (a span's
    bytes run from its first record's start to its last record's end, so the separators between come along)."""
    k = max(1, unit_records(records) // per_span)
    if k == 1:
        return spans
    out = []
    for i in range(0, len(spans), k):
        group = spans[i:i + k]
        last = group[-1]
        out.append(json_stream.Span(group[0].offset, last.offset + last.length - group[0].offset, group[0].first,
                                    sum(s.count for s in group)))
    return out


def file_units(location: str, image_root: str, chunk: int | None = None, block: int = json_stream.BLOCK,
               rel: str | None = None) -> list[dict]:
    """The read units of one JSON / JSONL file: byte ranges of ``chunk`` records (None: ``unit_records`` of the
    file's count) (+ the broken tail's unit); ``rel`` names the file in ids (default: its name).

    A file of CACHE_MIN_BYTES or more is listed once per process while its size and modification time
    stand (the driver lists a dataset several times before the first step: pre-flight, the listing
    digest, the pipeline); the last CACHE_FILES listings are kept (about 50 bytes a unit)."""
    fs_, path = fs.split(location)
    info = fs_.get_file_info(path)
    key = (location, image_root, chunk, block, info.size, info.mtime_ns, rel)
    if (info.size or 0) < CACHE_MIN_BYTES:
        return _file_units(location, image_root, chunk, block, rel)
    if key not in _listed:
        _listed[key] = _file_units(location, image_root, chunk, block, rel)
        while len(_listed) > CACHE_FILES:
            _listed.pop(next(iter(_listed)))
    return [dict(u) for u in _listed[key]]


def _file_units(location: str, image_root: str, chunk: int | None, block: int, rel: str | None = None) -> list[dict]:
    rel = rel or fs.relative(location, fs.dirname(location))
    lines = location.lower().endswith(".jsonl")
    ids = None if lines and fs.size(location) > IDS_MAX_LINES_BYTES else json_stream.IdTally()
    if ids is None:
        log.info("%s: over %d bytes of JSON Lines, so its ids are not checked for repeats on the driver",
                 rel, IDS_MAX_LINES_BYTES)
    listing = list_records(location, chunk or FINE_CHUNK, block, ids)
    spans = listing.spans if chunk else merge_spans(listing.spans, FINE_CHUNK, listing.records)
    if ids is not None:
        _warn_repeated_ids(ids, rel)
    base = {"path": location, "rel": rel, "image_root": image_root, "lines": lines, "error": ""}
    units = [dict(base, offset=s.offset, length=s.length, row_offset=s.first, rows=s.count) for s in spans]
    if listing.error:
        log.warning("%s: %s; the %d records before it are read, the rest is one skipped row", rel, listing.error,
                    listing.records)
        units.append(dict(base, offset=listing.tail, length=0, row_offset=listing.records, rows=1,
                          error=listing.error))
    return units


def count(units: list[dict], data_cfg) -> int:
    return sum(int(u["rows"]) for u in units)


# ------------------------------------------------------------------ image files
def resolve_image_path(ref, image_root: str) -> tuple[str | None, str]:
    """(location, "") for a file inside image_root, else (None, read_error). Never opens the file."""
    location, err, _ = _locate(ref, image_root)
    return location, err


def _locate(ref, image_root: str, what: str = IMAGE) -> tuple[str | None, str, bool]:
    """resolve_image_path's (location, read_error) and whether nothing at all is at that path."""
    if not isinstance(ref, str) or not ref:
        return None, error(schema.SKIP_MALFORMED_RECORD, f"{what} path {ref!r} is not a non-empty string"), False
    if "\x00" in ref:
        return None, error(schema.SKIP_MALFORMED_RECORD, f"{what} path {safe_text(ref)!r} holds a NUL"), False
    if fs.is_uri(image_root):
        norm = posixpath.normpath(ref)
        if ref.startswith("/") or "://" in ref or norm == ".." or norm.startswith("../"):
            return None, error(schema.SKIP_PATH_OUTSIDE_ROOT, ref), False
        location = fs.join(image_root, norm)
    else:
        if os.path.isabs(ref):
            return None, error(schema.SKIP_PATH_OUTSIDE_ROOT, ref), False
        location = _inside(_local_root(image_root), ref)
        if location is None:
            return None, error(schema.SKIP_PATH_OUTSIDE_ROOT, ref), False
    found = fs.kind(location)
    if found == "missing":
        return None, error(schema.SKIP_MISSING_FILE, ref), True
    if found != "file":  # a folder or a FIFO would hang or fail the read
        return None, error(schema.SKIP_MISSING_FILE, f"{ref} is not a regular file"), False
    return location, "", False


@functools.lru_cache(maxsize=64)
def _local_root(image_root: str) -> str | None:
    """The real path of a local image root, None for a URI."""
    return None if fs.is_uri(image_root) else os.path.realpath(fs.local_path(image_root))


def _inside(root: str, rel: str) -> str | None:
    """The real path of ``rel`` under the real folder ``root`` ('..' and symlinks resolved without opening);
    None when it resolves outside the root."""
    real = os.path.realpath(os.path.join(root, rel))
    return real if os.path.commonpath([root, real]) == root else None


_real_dir = functools.lru_cache(maxsize=4096)(_inside)  # a folder's, per process: the one-open read's


def _local_bytes(ref, image_root: str, max_bytes: int) -> bytes | None:
    """The bytes of a plain regular file under a local root with one open + fstat + read (the folder's real
    path cached per process), or None for anything else, which ``_image_bytes``' checks then handle:
    a URI root, an absolute path, a NUL, a '.' / '..' / symlink as the last part (O_NOFOLLOW), a folder
    outside the root, a missing file (archives), a FIFO or folder, a file over ``max_bytes``.
    665k-record inspect, per image: 3 realpath walks + 2 stats + 5 URL parses before (~190 us), one
    open after."""
    root = _local_root(image_root)
    if root is None or not isinstance(ref, str) or not ref or "\x00" in ref or os.path.isabs(ref):
        return None
    parent, name = os.path.split(ref)
    if name in ("", ".", "..") or (folder := _real_dir(root, parent)) is None:
        return None
    try:
        fd = os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (max_bytes and st.st_size > max_bytes):
            return None
        with open(fd, "rb", buffering=0, closefd=False) as f:
            return f.readall()
    except OSError:
        return None
    finally:
        os.close(fd)


def _image_bytes(ref, image_root: str, max_bytes: int, what: str = IMAGE) -> tuple[bytes, str]:
    """(bytes, "") of an image (or video) path: a file under the root, else a member of an archive there."""
    data = _local_bytes(ref, image_root, max_bytes)
    if data is not None:
        return data, ""
    location, err, missing = _locate(ref, image_root, what)
    if location is not None:
        return _read_image(location, ref, max_bytes)
    if missing:  # perhaps packed: A/x.jpg in A.zip (or named in A.tar.gz's skip)
        data, archived_err = archives.read_archived(ref, image_root, max_bytes, resolve_image_path)
        if data is not None:
            return data, ""
        err = archived_err or err
    return b"", err


def _read_image(location: str, ref: str, max_bytes: int) -> tuple[bytes, str]:
    try:
        n = fs.size(location)
        if max_bytes and n > max_bytes:
            return b"", error(schema.SKIP_FILE_TOO_LARGE, f"{ref}: {n:,} bytes > data.max_file_bytes={max_bytes:,}")
        return fs.read_bytes(location), ""
    except OSError as exc:
        return b"", error(schema.SKIP_MISSING_FILE, f"{ref}: {exc.strerror or exc}")


def _media_field(record: dict, names: tuple[str, str]) -> tuple[list, str]:
    """(refs, "") of a record's image / video field (a path or a list of them), or ([], read_error)."""
    field = record.get(names[0], record.get(names[1]))
    refs = [] if field is None else [field] if isinstance(field, str) else field
    if not isinstance(refs, list):
        return [], error(schema.SKIP_MALFORMED_RECORD, f"{names[0]} field is {type(field).__name__}")
    return refs, ""


def llava_row(record, image_root: str, sid: str, max_bytes: int = 0, max_chars: int = 0) -> dict:
    if not isinstance(record, dict):
        return raw_row(sid, read_error=error(schema.SKIP_MALFORMED_RECORD,
                                             f"record is {type(record).__name__}, not an object"))
    conv, err = conversations_to_json(record.get("conversations", record.get("messages")), max_chars)
    images, field_err = _media_field(record, ("image", "images"))
    videos, video_err = _media_field(record, ("video", "videos"))
    if field_err or video_err:
        return raw_row(sid, conv, read_error=field_err or video_err)
    refs, kinds = images + videos, [IMAGE] * len(images) + [VIDEO] * len(videos)
    if not err:
        conv, order = place_media(conv, kinds)
        refs, kinds = reorder(refs, order), reorder(kinds, order)
    ref_strs = [safe_text(r) for r in refs]
    if err:
        return raw_row(sid, conv, image_refs=ref_strs, read_error=err)
    blobs = []
    for ref, kind in zip(refs, kinds):
        data, err = _image_bytes(ref, image_root, max_bytes, kind)
        if err:
            return raw_row(sid, conv, image_refs=ref_strs, read_error=err)
        blobs.append(data)
    return raw_row(sid, conv, blobs, ref_strs)


def llava_rows(records: list, image_root: str, *, file_name: str = "data.json", row_offset: int = 0,
               max_bytes: int = 0, max_chars: int = 0) -> list[dict]:
    """RAW rows for LLaVA records: ids ``<file_name>:<index>[#<id>]``."""
    rows = []
    for i, record in enumerate(records):
        uid = record.get("id") if isinstance(record, dict) else None
        if isinstance(record, json.JSONDecodeError):  # a JSON Lines line that is not JSON
            rows.append(raw_row(f"{file_name}:{row_offset + i}", read_error=error(
                schema.SKIP_MALFORMED_RECORD, f"line is not JSON ({record.msg}): {safe_text(record.doc[:80])}")))
            continue
        rows.append(llava_row(record, image_root, sample_id(f"{file_name}:{row_offset + i}", uid),
                              max_bytes, max_chars))
    return rows


def read_unit(unit: dict, data_cfg) -> list[dict]:
    rel, first, n = unit["rel"], int(unit["row_offset"]), int(unit["rows"])
    if unit["error"]:
        return [raw_row(f"{rel}:unreadable-tail", read_error=error(
            schema.SKIP_MALFORMED_RECORD, f"{rel}: {unit['error']}; the {first} record(s) before it are read"))]
    try:
        data = json_stream.read_span(unit["path"], int(unit["offset"]), int(unit["length"]))
        records = json_stream.line_records(data) if unit["lines"] else json_stream.array_records(data)
        if len(records) != n:
            raise ValueError(f"{len(records)} records where the listing found {n}")
    except (OSError, ValueError) as exc:  # the file changed (or went) since it was listed
        return [raw_row(f"{rel}:{first}-{first + n - 1}", read_error=error(
            schema.SKIP_UNREADABLE_FILE, f"{rel} records {first}..{first + n - 1} (bytes {unit['offset']:,}+"
            f"{unit['length']:,}): {exc}; the file changed since it was listed?"))]
    return llava_rows(records, unit["image_root"], file_name=rel, row_offset=first,
                      max_bytes=getattr(data_cfg, "max_file_bytes", 0),
                      max_chars=getattr(data_cfg, "max_text_chars", 0))
