"""LLaVA JSON: one ``.json`` list (or ``.jsonl``, one record a line) of records + an image folder.

Record: {"id"?, "image": "rel/path.jpg" | [...] (or "images"), "conversations" | "messages"}
(conversations may also be a JSON string). The record list is read on the driver and
sent as read units of LLAVA_CHUNK records; workers read the image files. A JSON Lines
file named ``.json`` is refused at start with the right extension named; a ``.jsonl``
line that is not JSON is kept as a malformed_record row.

Image paths resolve inside the image root (``data.image_root``, default the JSON's folder;
a local folder or a URI) or are refused unread: absolute paths, ``..`` and symlinks out of
the root (path_outside_root), NUL in the path (malformed_record). Before a file is read its
size is checked (stat) against ``data.max_file_bytes`` (file_too_large), and only regular
files are opened (a FIFO would hang).

Id scheme: ``<file relative to its folder>:<record index>``, plus ``#<id>`` when the record
has one: a repeated user id (common in merged sets; ``1`` and ``"1"`` too) stays two samples
and stays readable. One warning per file names how many records repeat an id, with examples.
Pure module: no ray.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import posixpath

from ray_mmbatch import schema
from ray_mmbatch.formats import fs
from ray_mmbatch.formats.records import conversations_to_json, error, raw_row, safe_text, sample_id

EXTS = (".json", ".jsonl")
INDEX_NAMES = ("data.json", "data.jsonl")
CHUNK = 64
log = logging.getLogger("ray_mmbatch.formats")


def _parse(location: str, text: str) -> list:
    if location.endswith(".jsonl"):
        records = []
        for line in text.splitlines():
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    records.append(f"not JSON: {line[:80]}")  # kept: a row with malformed_record
        return records
    try:
        records = json.loads(text)
    except json.JSONDecodeError as exc:
        first = next((ln for ln in text.splitlines() if ln.strip()), "")
        try:
            one_per_line = isinstance(json.loads(first), dict) and exc.msg.startswith("Extra data")
        except json.JSONDecodeError:
            one_per_line = False
        if one_per_line:
            stem = posixpath.basename(location).rsplit(".", 1)[0]
            raise ValueError(f"{location} holds one JSON record per line (JSON Lines), not one JSON list: "
                             f"name it {stem}.jsonl") from None
        raise ValueError(f"{location} is not valid JSON: {exc}") from None
    if not isinstance(records, list):
        raise ValueError(f"{location}: expected a JSON list of records, got {type(records).__name__}")
    return records


def read_records(files: list[str]) -> list:
    """The records of the one LLaVA JSON / JSONL file."""
    if len(files) != 1:
        raise ValueError(f"LLaVA format reads one JSON file, got {len(files)}: {files[:3]}")
    raw = fs.read_bytes(files[0])
    return _parse(files[0], raw.decode("utf-8", "surrogateescape"))


def _warn_repeated_ids(records: list, rel: str) -> None:
    ids = collections.Counter(str(r["id"]) for r in records if isinstance(r, dict)
                              and isinstance(r.get("id"), (str, int)) and str(r.get("id")) != "")
    repeated = {k: n for k, n in ids.items() if n > 1}
    if repeated:
        examples = ", ".join(f"{safe_text(k)!r} x{n}" for k, n in list(repeated.items())[:5])
        log.warning("%s: %d records share their id with another record (%d ids repeated, e.g. %s); each is "
                    "a sample of its own, told apart by record index: '%s:<index>#<id>'",
                    rel, sum(repeated.values()), len(repeated), examples, rel)


def list_units(files: list[str], root: str, data_cfg) -> list[dict]:
    records = read_records(files)
    rel = fs.relative(files[0], fs.dirname(files[0]))
    _warn_repeated_ids(records, rel)
    image_root = data_cfg.image_root or fs.dirname(files[0])
    return [{"rel": rel, "row_offset": i, "image_root": image_root, "error": "",
             "records": json.dumps(records[i:i + CHUNK], ensure_ascii=True)}
            for i in range(0, len(records), CHUNK)]


def count(units: list[dict], data_cfg) -> int:
    return sum(len(json.loads(u["records"])) for u in units)


# ------------------------------------------------------------------ image files
def resolve_image_path(ref, image_root: str) -> tuple[str | None, str]:
    """(location, "") for a file inside image_root, else (None, read_error). Never opens the file."""
    if not isinstance(ref, str) or not ref:
        return None, error(schema.SKIP_MALFORMED_RECORD, f"image path {ref!r} is not a non-empty string")
    if "\x00" in ref:
        return None, error(schema.SKIP_MALFORMED_RECORD, f"image path {safe_text(ref)!r} holds a NUL")
    if fs.is_uri(image_root):
        norm = posixpath.normpath(ref)
        if ref.startswith("/") or "://" in ref or norm == ".." or norm.startswith("../"):
            return None, error(schema.SKIP_PATH_OUTSIDE_ROOT, ref)
        location = fs.join(image_root, norm)
    else:
        if os.path.isabs(ref):
            return None, error(schema.SKIP_PATH_OUTSIDE_ROOT, ref)
        root = os.path.realpath(fs.local_path(image_root))
        location = os.path.realpath(os.path.join(root, ref))  # resolves '..' and symlinks without opening
        if os.path.commonpath([root, location]) != root:
            return None, error(schema.SKIP_PATH_OUTSIDE_ROOT, ref)
    found = fs.kind(location)
    if found == "missing":
        return None, error(schema.SKIP_MISSING_FILE, ref)
    if found != "file":  # a folder or a FIFO would hang or fail the read
        return None, error(schema.SKIP_MISSING_FILE, f"{ref} is not a regular file")
    return location, ""


def _read_image(location: str, ref: str, max_bytes: int) -> tuple[bytes, str]:
    try:
        n = fs.size(location)
        if max_bytes and n > max_bytes:
            return b"", error(schema.SKIP_FILE_TOO_LARGE, f"{ref}: {n:,} bytes > data.max_file_bytes={max_bytes:,}")
        return fs.read_bytes(location), ""
    except OSError as exc:
        return b"", error(schema.SKIP_MISSING_FILE, f"{ref}: {exc.strerror or exc}")


def llava_row(record, image_root: str, sid: str, max_bytes: int = 0, max_chars: int = 0) -> dict:
    if not isinstance(record, dict):
        return raw_row(sid, read_error=error(schema.SKIP_MALFORMED_RECORD,
                                             f"record is {type(record).__name__}, not an object"))
    conv, err = conversations_to_json(record.get("conversations", record.get("messages")), max_chars)
    field = record.get("image", record.get("images"))
    refs = [] if field is None else [field] if isinstance(field, str) else field
    if not isinstance(refs, list):
        return raw_row(sid, conv,
                       read_error=error(schema.SKIP_MALFORMED_RECORD, f"image field is {type(field).__name__}"))
    ref_strs = [safe_text(r) for r in refs]
    if err:
        return raw_row(sid, conv, image_refs=ref_strs, read_error=err)
    blobs = []
    for ref in refs:
        location, err = resolve_image_path(ref, image_root)
        if not err:
            data, err = _read_image(location, ref, max_bytes)
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
        rows.append(llava_row(record, image_root, sample_id(f"{file_name}:{row_offset + i}", uid),
                              max_bytes, max_chars))
    return rows


def read_unit(unit: dict, data_cfg) -> list[dict]:
    return llava_rows(json.loads(unit["records"]), unit["image_root"], file_name=unit["rel"],
                      row_offset=int(unit["row_offset"]), max_bytes=getattr(data_cfg, "max_file_bytes", 0),
                      max_chars=getattr(data_cfg, "max_text_chars", 0))
