"""Streamed listing of big JSON lists and JSON Lines files: byte ranges of records, in bounded memory.

A LLaVA-style index can be one 20 GB JSON list (MAmmoTH-VL) or 10M JSON lines (Cambrian). Nothing here
loads a whole file: ``list_array`` / ``list_lines`` read it once in blocks of ``block`` bytes and keep
only one ``Span`` (byte offset, byte length, first record index, record count) per ``chunk`` records;
a worker then reads its span alone (``read_span``: seek + read) and parses it (``array_records`` /
``line_records``).

JSON list: each block is decoded as latin-1, so character i of the window is byte i of the file and
offsets stay byte offsets; multi-byte UTF-8 text only ever sits inside JSON strings, whose delimiters
(``"`` and ``\\``) are ASCII, so the C scanner of ``json`` finds the same record boundaries it would
find in the decoded text. A record is scanned from its first byte; one cut by the end of the window
is scanned again once the next block is in (memory: the largest record plus a few blocks). Between
records only whitespace and one comma may stand. Cost: O(file bytes), one pass of json's C scanner
over every byte plus a few Python steps per record (figures: benchmarks/RESULTS.md, "Big LLaVA
JSON / JSON Lines start-up", measured by benchmarks/bench_startup_json.py).

JSON Lines: record boundaries are line starts (numpy finds every newline of a block); blank lines
(whitespace only) are not records, as before. Nothing is parsed unless ids are counted (below):
a line that is not JSON is found by the worker that reads it.

A file that breaks off (truncated, a bad record, something after the closing ``]``) keeps every
record before the break: ``Listing.error`` says what is wrong at which byte and ``Listing.tail``
is that byte; the caller turns it into one skipped row. A top level that is not a list is refused
(``ValueError`` naming the file, the type found, and ``.jsonl`` when it holds one record per line).

Repeated ids (``IdTally``): an 8-byte hash per record id and the names of the first KEEP_NAMES ids,
so a warning can say how many records repeat an id, with examples, without holding every id.
Benchmark: benchmarks/bench_startup_json.py. Pure module: no ray.
"""
from __future__ import annotations

import json
import re
from array import array
from dataclasses import dataclass

import numpy as np

from ray_mmbatch.formats import fs

BLOCK = 16 * 2**20
KEEP_NAMES = 100_000
_WS = re.compile(r"[ \t\n\r]*")
_SEP = re.compile(r"[ \t\n\r]*,[ \t\n\r]*")  # the usual case between two records
_SCAN = json.JSONDecoder().scan_once
_BOM = b"\xef\xbb\xbf"
_WS_BYTES = np.frombuffer(b" \t\r\x0b\x0c", np.uint8)
_EXACT_END = frozenset('{["')  # values whose last character closes them ("15" may be "1500.5" cut by a block)


@dataclass(frozen=True)
class Span:
    """``count`` records, the first with index ``first``, in bytes [offset, offset + length) of the file."""
    offset: int
    length: int
    first: int
    count: int


@dataclass
class Listing:
    spans: list[Span]
    records: int
    error: str = ""  # "" or why the file is not read on from byte ``tail``
    tail: int = -1


class IdTally:
    """How many records share their id with another, in bounded memory (8 bytes a record)."""

    def __init__(self) -> None:
        self._hashes = array("q")
        self._names: dict[int, str] = {}

    def add(self, uid) -> None:
        if isinstance(uid, bool) or not isinstance(uid, (str, int)) or str(uid) == "":
            return
        name = str(uid)
        h = hash(name)
        self._hashes.append(h)
        if len(self._names) < KEEP_NAMES:
            self._names.setdefault(h, name)

    def repeated(self, examples: int = 5) -> tuple[int, int, list[tuple[str, int]]]:
        """(records whose id repeats, ids repeated, up to ``examples`` (id, times) in first-seen order)."""
        if not self._hashes:
            return 0, 0, []
        values, counts = np.unique(np.frombuffer(self._hashes, np.int64), return_counts=True)
        many = counts > 1
        if not many.any():
            return 0, 0, []
        times = dict(zip(values[many].tolist(), counts[many].tolist()))
        shown = [(name, times[h]) for h, name in self._names.items() if h in times][:examples]
        return int(counts[many].sum()), int(many.sum()), shown


class _Window:
    """A latin-1 window over a byte stream: character i is byte ``base + i`` of the file."""

    def __init__(self, stream, block: int) -> None:
        self.stream, self.block = stream, block
        self.text, self.base, self.pos, self.eof = "", 0, 0, False

    def more(self) -> bool:
        if self.eof:
            return False
        data = self.stream.read(self.block)
        if not data:
            self.eof = True
            return False
        self.text = self.text[self.pos:] + bytes(data).decode("latin-1")
        self.base += self.pos
        self.pos = 0
        return True

    def at(self) -> int:
        return self.base + self.pos

    def next_char(self) -> str:
        """The next character that is not whitespace (the window moved to it), "" at the end of the file."""
        while True:
            self.pos = _WS.match(self.text, self.pos).end()
            if self.pos < len(self.text):
                return self.text[self.pos]
            if not self.more():
                return ""

    def value(self, limit: int = 0):
        """The JSON value at the window's position (moved past it); JSONDecodeError with a file byte offset.
        ``limit`` > 0: give up (JSONDecodeError "longer than ...") once the value passes that many bytes."""
        while True:
            if limit and len(self.text) - self.pos > limit:
                raise json.JSONDecodeError(f"longer than {limit:,} bytes", "", self.at())
            try:
                obj, end = _SCAN(self.text, self.pos)
                if self.text[self.pos] in _EXACT_END or end < len(self.text) - 32 or self.eof:
                    self.pos = end
                    return obj
                self.more()
                continue
            except StopIteration as exc:
                msg, pos = "Expecting value", exc.value
            except json.JSONDecodeError as exc:  # only (msg, pos) kept: the exception holds the window
                msg, pos = exc.msg, exc.pos
            cut = pos >= len(self.text) - 16 or msg.startswith("Unterminated string")
            if not (cut and self.more()):  # a record cut by the window: read on, scan it again
                raise json.JSONDecodeError(msg, "", self.base + pos)


def _true_id(obj, window: _Window, start: int):
    """The record's id; a non-ASCII one is decoded again as UTF-8 (the window holds latin-1)."""
    uid = obj.get("id") if isinstance(obj, dict) else None
    if isinstance(uid, str) and not uid.isascii():
        raw = window.text[start - window.base:window.pos].encode("latin-1")
        uid = json.loads(raw.decode("utf-8", "surrogateescape")).get("id")
    return uid


def _kind(c: str) -> str:
    return {"{": "an object", '"': "a string", "t": "true", "f": "false", "n": "null"}.get(
        c, "a number" if c in "-0123456789" else f"{c!r}")


def _refuse(window: _Window, location: str, c: str) -> None:
    """The top level is not a list: say what it is (one record per line: name the .jsonl)."""
    if c == "":
        raise ValueError(f"{location} is empty: expected a JSON list of records")
    try:
        first = window.value(limit=window.block)
    except json.JSONDecodeError as exc:
        if exc.msg.startswith("longer than"):  # a huge top-level value: not read to its end
            raise ValueError(f"{location}: expected a JSON list of records, got {_kind(c)}") from None
        raise ValueError(f"{location} is not valid JSON: {exc.msg} at byte {exc.pos}") from None
    more = window.next_char()
    if isinstance(first, dict) and more == "{":
        stem = location.rstrip("/").rsplit("/", 1)[-1].rsplit(".", 1)[0]
        raise ValueError(f"{location} holds one JSON record per line (JSON Lines), not one JSON list: "
                         f"name it {stem}.jsonl")
    if more:
        raise ValueError(f"{location} is not valid JSON: extra data at byte {window.at()}")
    raise ValueError(f"{location}: expected a JSON list of records, got {type(first).__name__}")


def list_array(stream, location: str, chunk: int, block: int = BLOCK, ids: IdTally | None = None) -> Listing:
    """Spans of ``chunk`` records of the JSON list in ``stream`` (read once, in blocks)."""
    w = _Window(stream, block)
    w.more()
    if w.text.startswith(_BOM.decode("latin-1")):
        w.pos = len(_BOM)
    c = w.next_char()
    if c != "[":
        _refuse(w, location, c)
    w.pos += 1
    spans: list[Span] = []
    index, start0, end = 0, -1, -1

    def listing(error: str = "", tail: int = -1) -> Listing:
        if index:  # the open span
            first = (index - 1) // chunk * chunk
            spans.append(Span(start0, end - start0, first, index - first))
        return Listing(spans, index, error, tail)

    c = w.next_char()
    if c == "]":
        w.pos += 1
    while c != "]":
        start = w.at()
        try:
            obj = w.value()
        except json.JSONDecodeError as exc:
            cut = w.eof and (exc.pos >= w.base + len(w.text) - 16 or exc.msg.startswith("Unterminated string"))
            return listing(f"record {index} at byte {start} is not valid JSON ({exc.msg} at byte {exc.pos}"
                           + ("; the file ends inside it: truncated?)" if cut else ")"), start)
        if index % chunk == 0:
            if index:
                spans.append(Span(start0, end - start0, index - chunk, chunk))
            start0 = start
        end = w.at()
        if ids is not None:
            ids.add(_true_id(obj, w, start))
        index += 1
        m = _SEP.match(w.text, w.pos)
        if m and m.end() < len(w.text):  # fast path: ", " then the next record in the window
            w.pos = m.end()
            c = w.text[w.pos]
            if c == "]":
                return listing(f"a comma before the closing ']' at byte {w.at()}", w.at())
            continue
        c = w.next_char()
        if c == ",":
            w.pos += 1
            c = w.next_char()
            if c == "]":
                return listing(f"a comma before the closing ']' at byte {w.at()}", w.at())
            if c == "":
                return listing(f"the file ends at byte {w.at()} before the list's closing ']' (truncated?)", w.at())
        elif c == "]":
            w.pos += 1
        elif c == "":
            return listing(f"the file ends at byte {w.at()} before the list's closing ']' (truncated?)", w.at())
        else:
            return listing(f"not valid JSON from byte {w.at()} on (expected ',' or ']' after record {index - 1})",
                           w.at())
    if w.next_char():
        return listing(f"extra data after the list's closing ']' at byte {w.at()}", w.at())
    return listing()


def list_lines(stream, chunk: int, block: int = BLOCK, ids: IdTally | None = None) -> Listing:
    """Spans of ``chunk`` records of the JSON Lines file in ``stream``; blank lines are not records."""
    spans: list[Span] = []
    index, base, pending, start0 = 0, 0, b"", -1
    first = True
    while True:
        new = stream.read(block)
        eof = not new
        data = pending + bytes(new)
        if first and data.startswith(_BOM):
            data, base = data[len(_BOM):], len(_BOM)
        first = False
        arr = np.frombuffer(data, np.uint8)
        ends = np.flatnonzero(arr == 10)
        done = int(ends[-1]) + 1 if len(ends) else 0
        starts = np.concatenate(([0], ends[:-1] + 1)) if len(ends) else ends
        if eof and done < len(data):  # the last line has no newline
            starts, ends, done = np.append(starts, done), np.append(ends, len(data)), len(data)
        if len(starts):
            blank = (ends == starts) | np.isin(arr[np.minimum(starts, max(len(data) - 1, 0))], _WS_BYTES)
            for k in np.flatnonzero(blank).tolist():  # few: only lines that start with whitespace
                blank[k] = not data[starts[k]:ends[k]].strip()
            keep = ~blank
            rec_starts, rec_ends = starts[keep], ends[keep]
            if ids is not None:
                _line_ids(data, rec_starts, rec_ends, ids)
            for k in range((-index) % chunk, len(rec_starts), chunk):
                at = base + int(rec_starts[k])
                if index + k:
                    spans.append(Span(start0, at - start0, index + k - chunk, chunk))
                start0 = at
            index += len(rec_starts)
        base += done
        pending = data[done:]
        if eof:
            break
    if index:  # the open span runs to the end of the file
        first = (index - 1) // chunk * chunk
        spans.append(Span(start0, base - start0, first, index - first))
    return Listing(spans, index)


def _line_ids(data: bytes, starts, ends, ids: IdTally) -> None:
    text = data.decode("latin-1")
    for s, e in zip(starts.tolist(), ends.tolist()):
        try:
            obj, _ = _SCAN(text, _WS.match(text, s).end())
        except (StopIteration, json.JSONDecodeError):
            continue  # the worker reports the line
        uid = obj.get("id") if isinstance(obj, dict) else None
        if isinstance(uid, str) and not uid.isascii():
            try:
                uid = json.loads(data[s:e].decode("utf-8", "surrogateescape")).get("id")
            except (ValueError, AttributeError):
                continue
        ids.add(uid)


# ------------------------------------------------------------------ one span, on a worker
def read_span(location: str, offset: int, length: int) -> bytes:
    """Bytes [offset, offset + length) of a local file or URI: one seek, one read."""
    with fs.open_random_access(location) as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise OSError(f"{location}: {len(data):,} bytes at byte {offset:,}, expected {length:,} (file changed?)")
    return bytes(data)


def array_records(data: bytes) -> list:
    """The records of a span of a JSON list (records with commas and whitespace between them)."""
    return json.loads("[" + data.decode("utf-8", "surrogateescape") + "]")


def line_records(data: bytes) -> list:
    """The records of a span of JSON Lines, blank lines left out; a line that is not JSON is a
    ``json.JSONDecodeError`` in its place (its ``doc`` the line's text)."""
    out = []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        text = line.decode("utf-8", "surrogateescape")
        try:
            out.append(json.loads(text))
        except json.JSONDecodeError as exc:
            out.append(exc)
    return out
