"""An Arrow IPC stream's record batches listed from their message headers, the bodies never fetched.

What listing a ``save_to_disk`` shard on an object store needs: the schema, and per record batch its row
count and byte range (formats/arrow.py's units). An encapsulated IPC message is
``[0xFFFFFFFF] [int32 metadata length] [flatbuffer Message] [body of Message.bodyLength bytes]`` (a stream
written before Arrow 0.15 lacks the 0xFFFFFFFF), and a stream ends with a message of length 0. The walk reads
each header, takes the row count (RecordBatch.length) and the body length from the flatbuffer (parsed here:
a few fields, no generated code), and jumps over the body.

Reads: ranged reads through ``_Window``, a read-ahead that doubles (64 KiB up to 8 MiB) while the headers
lie close together (small batches: one request covers many) and drops back to 64 KiB when a body is
skipped (image batches: one small request per batch). A 4-shard folder of 1,000-row image batches is
listed with a few requests per shard, its bytes a small share of the shard's (benchmarks/bench_listing.py).
Checks: a body that runs past the object's end, or no end-of-stream marker at the end, raise ValueError
(the shard was cut short), as formats/arrow.py's streaming walk does.
Pure module: pyarrow, no ray.
"""
from __future__ import annotations

import struct

import pyarrow as pa

CONTINUATION = 0xFFFFFFFF
SCHEMA, DICTIONARY_BATCH, RECORD_BATCH = 1, 2, 3  # flatbuf MessageHeader union tags
WINDOW_MIN, WINDOW_MAX = 64 << 10, 8 << 20


class _Window:
    """Ranged reads of a random-access file through one read-ahead buffer (module docstring)."""

    def __init__(self, f, whole: bool = False):
        self.f, self.size = f, f.size()
        self.start, self.buf, self.window = 0, memoryview(b""), WINDOW_MIN
        self.requests = self.fetched = 0
        if whole:  # a memory map: the whole file as one zero-copy view
            self._fetch(0, self.size)

    def _fetch(self, pos: int, want: int) -> None:
        self.f.seek(pos)
        self.buf, self.start = memoryview(self.f.read_buffer(want) if want else b""), pos
        self.requests += 1
        self.fetched += len(self.buf)

    def read(self, pos: int, n: int) -> memoryview:
        end = self.start + len(self.buf)
        if not (self.start <= pos and pos + n <= end):
            gap = pos - end
            if self.requests:  # the first read is WINDOW_MIN: a shard's head, its schema and first batch header
                self.window = min(self.window * 2, WINDOW_MAX) if 0 <= gap < self.window else WINDOW_MIN
            self._fetch(pos, min(max(n, self.window), max(0, self.size - pos)))
        return self.buf[pos - self.start: pos - self.start + n]


def _vtable(buf, table: int) -> list[int]:
    """A flatbuffer table's field offsets (0 = field absent)."""
    vt = table - struct.unpack_from("<i", buf, table)[0]
    size = struct.unpack_from("<H", buf, vt)[0]
    return [struct.unpack_from("<H", buf, vt + 4 + 2 * i)[0] for i in range((size - 4) // 2)]


def _scalar(buf, table: int, fields: list[int], i: int, fmt: str, default=0):
    return struct.unpack_from(fmt, buf, table + fields[i])[0] if i < len(fields) and fields[i] else default


def _vector(buf, table: int, fields: list[int], i: int) -> tuple[int, int]:
    """(position of the first element, length) of a table's vector field; (0, 0) when absent."""
    if i >= len(fields) or not fields[i]:
        return 0, 0
    pos = table + fields[i]
    vec = pos + struct.unpack_from("<I", buf, pos)[0]
    return vec + 4, struct.unpack_from("<I", buf, vec)[0]


def parse_message(meta) -> tuple[int, int, int, list[tuple[int, int]] | None]:
    """(header type, body length, rows: RecordBatch.length (0 for others), the record batch's buffers as
    (offset in the body, length), None when they cannot be read alone: compressed, or view types' variadic
    buffers) of a flatbuffer Message."""
    table = struct.unpack_from("<I", meta, 0)[0]
    fields = _vtable(meta, table)
    kind = _scalar(meta, table, fields, 1, "<B")
    body = _scalar(meta, table, fields, 3, "<q")
    rows, buffers = 0, None
    if kind == RECORD_BATCH and len(fields) > 2 and fields[2]:
        pos = table + fields[2]
        header = pos + struct.unpack_from("<I", meta, pos)[0]
        hf = _vtable(meta, header)
        rows = _scalar(meta, header, hf, 0, "<q")
        first, n = _vector(meta, header, hf, 2)
        plain = not (len(hf) > 3 and hf[3]) and not _vector(meta, header, hf, 4)[1]
        buffers = [struct.unpack_from("<qq", meta, first + 16 * k) for k in range(n)] if plain else None
    return kind, body, rows, buffers


def buffer_counts(arrow_schema: pa.Schema) -> list[int]:
    """How many body buffers each top-level column takes in a record batch (as pyarrow writes it: an empty
    batch of that column alone, serialized, tells)."""
    out = []
    for f in arrow_schema:
        one = pa.RecordBatch.from_arrays([pa.array([], type=f.type)], schema=pa.schema([f]))
        msg = memoryview(one.serialize())
        prefix = 8 if struct.unpack_from("<I", msg, 0)[0] == CONTINUATION else 4
        out.append(len(parse_message(msg[prefix:])[3] or []))
    return out


FILE_MAGIC = b"ARROW1"


def walk(f, whole: bool = False):
    """(ipc: "file" (ARROW1 magic) or "stream", schema, [(start byte, end byte, rows)] per record batch,
    dictionary batches?, (requests, bytes fetched)) of the random-access file ``f`` (``whole``: a memory map,
    viewed whole); ValueError when it is cut short or is no IPC stream. The file format's stream starts at
    byte 8 and its footer is not read (only its closing magic is checked)."""
    win = _Window(f, whole)
    ipc = "file" if bytes(win.read(0, len(FILE_MAGIC))) == FILE_MAGIC else "stream"
    if ipc == "file" and bytes(win.read(win.size - len(FILE_MAGIC), len(FILE_MAGIC))) != FILE_MAGIC:
        raise ValueError("no footer (the file does not end with ARROW1): cut short")
    pos, schema, batches, layouts, dicts = (8 if ipc == "file" else 0), None, [], [], False
    while True:
        head = win.read(pos, 8)
        if len(head) < 4:
            raise ValueError(f"cut short: no end-of-stream marker after {len(batches)} record batches "
                             f"({sum(r for _, _, r in batches)} rows); the writer did not finish")
        first = struct.unpack_from("<I", head, 0)[0]
        if first == CONTINUATION:
            if len(head) < 8:
                raise ValueError("cut short inside a message header")
            prefix, length = 8, struct.unpack_from("<i", head, 4)[0]
        else:
            prefix, length = 4, struct.unpack_from("<i", head, 0)[0]
        if length == 0:  # end-of-stream
            break
        if length < 0 or pos + prefix + length > win.size:
            raise ValueError(f"not an Arrow IPC stream, or cut short (a message header of {length} bytes at "
                             f"byte {pos} of {win.size})")
        meta = win.read(pos + prefix, length)
        kind, body, rows, buffers = parse_message(meta)
        end = pos + prefix + length + body
        if end > win.size:
            raise ValueError(f"cut short: record batch {len(batches)} runs to byte {end}, the object holds "
                             f"{win.size}")
        if kind == SCHEMA:
            schema = pa.ipc.read_schema(pa.py_buffer(bytes(win.read(pos, prefix + length))))
        elif kind == DICTIONARY_BATCH:
            dicts = True
        elif kind == RECORD_BATCH:
            if schema is None:
                raise ValueError("a record batch before the schema: not an Arrow IPC stream")
            batches.append((pos, end, int(rows)))
            layouts.append((bytes(win.read(pos, prefix + length)), body, buffers))
        else:
            raise ValueError(f"message type {kind} at byte {pos}: not an Arrow IPC stream")
        pos = end
    if schema is None:
        raise ValueError("no schema message: not an Arrow IPC stream")
    return ipc, schema, batches, dicts, Walked(layouts, win.requests, win.fetched)


class Walked:
    """What else a walk saw: per record batch (its header's bytes, body length, its buffers or None), and the
    requests and bytes it took."""

    def __init__(self, layouts: list, requests: int, fetched: int):
        self.layouts, self.requests, self.fetched = layouts, requests, fetched


def read_columns(f, arrow_schema: pa.Schema, start: int, layout: tuple, columns: list[str]) -> pa.RecordBatch | None:
    """The record batch at ``start`` with only ``columns``' buffers fetched (one ranged read per column; the
    other columns read as zeros and are dropped), or None when its buffers cannot be read alone."""
    import numpy as np

    header, body, buffers = layout
    head = len(header)
    if buffers is None:
        return None
    counts = buffer_counts(arrow_schema)
    if sum(counts) != len(buffers):
        return None
    first = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    whole = np.zeros(head + body, np.uint8)  # untouched pages stay unallocated (calloc)
    whole[:head] = np.frombuffer(header, np.uint8)
    for name in columns:
        k = arrow_schema.get_field_index(name)
        mine = buffers[first[k]:first[k + 1]]
        lo, hi = min((o for o, _ in mine), default=0), max((o + n for o, n in mine), default=0)
        if hi > lo:
            whole[head + lo:head + hi] = np.frombuffer(f.read_at(hi - lo, start + head + lo), np.uint8)
    message = pa.ipc.read_message(pa.py_buffer(whole))
    return pa.ipc.read_record_batch(message, arrow_schema).select(columns)
