"""Big JSON lists and JSON Lines read in bounded memory (issue 33): the streamed listing (formats/json_stream.py)
gives byte ranges that together hold every record exactly once, with the ids of the whole-file parse."""
from __future__ import annotations

import io
import json
import logging
import tracemalloc
from pathlib import Path

import pytest

from ray_mmbatch import schema as S
from ray_mmbatch.config import DataConfig
from ray_mmbatch.formats import json_stream, llava
from ray_mmbatch.formats.units import count_samples, read_units

CONV = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]
NASTY = ['[x] ]] [[', '{"not": "a record"}, {', 'quote \\" and \\\\ backslash', 'é漢字🙂 split me', ',\n,\t,']


def records(n: int = 40) -> list:
    out = []
    for i in range(n):
        rec = {"conversations": [{"from": "human", "value": NASTY[i % len(NASTY)] * (i % 4 + 1)},
                                 {"from": "gpt", "value": f"answer {i} ü"}]}
        if i % 3:
            rec["id"] = f"r{i}" if i % 2 else f"ü-{i}"
        out.append(rec)
    return out


def expected_id(i: int, rec) -> str:
    return f"data.json:{i}#{rec['id']}" if "id" in rec else f"data.json:{i}"


def write_list(path: Path, recs: list, sep: str = ",\n  ") -> bytes:
    text = ("\n [" + sep.join(json.dumps(r, ensure_ascii=i % 2 == 0) for i, r in enumerate(recs)) + "\n]\n")
    path.write_bytes(text.encode())
    return path.read_bytes()


def read_all(units: list[dict]) -> list[dict]:
    rows = []
    for unit in units:
        rows += llava.read_unit(unit, DataConfig())
    return rows


@pytest.mark.parametrize("block", [1, 5, 64])
def test_json_list_across_tiny_blocks_gives_every_record_once(tmp_path, block):
    recs = records()
    raw = write_list(tmp_path / "data.json", recs)
    units = llava.file_units(str(tmp_path / "data.json"), str(tmp_path), chunk=7, block=block)
    assert len(units) == 6 and [u["rows"] for u in units] == [7] * 5 + [5]
    assert [u["row_offset"] for u in units] == list(range(0, 40, 7))
    assert all(u["offset"] + u["length"] <= units[k + 1]["offset"] for k, u in enumerate(units[:-1]))
    rows = read_all(units)
    assert [r[S.SAMPLE_ID] for r in rows] == [expected_id(i, r) for i, r in enumerate(recs)]
    assert all(r[S.READ_ERROR] == "" for r in rows)
    got = [json.loads(r[S.CONVERSATIONS])[0]["value"] for r in rows]
    assert got == [r["conversations"][0]["value"] for r in recs]  # non-ASCII and escapes decoded whole
    for u in units:  # each unit is a byte range holding exactly its records
        part = json.loads("[" + raw[u["offset"]:u["offset"] + u["length"]].decode() + "]")
        assert part == recs[u["row_offset"]:u["row_offset"] + u["rows"]]
    assert llava.count(units, DataConfig()) == 40
    assert llava.file_units(str(tmp_path / "data.json"), str(tmp_path), chunk=7, block=block) == units


def test_default_listing_matches_the_whole_file_parse(tmp_path):
    recs = records(1500)
    write_list(tmp_path / "data.json", recs, sep=",")
    units, read_fn, kwargs = read_units(str(tmp_path), DataConfig())
    # a small file is cut into at least MIN_UNITS units of FINE_CHUNK records (one task per preprocessing actor)
    assert [u["rows"] for u in units] == [llava.FINE_CHUNK] * (1500 // llava.FINE_CHUNK) + [1500 % llava.FINE_CHUNK]
    assert "records" not in units[0]  # no record text travels in a unit
    rows = read_all(units)
    assert [r[S.SAMPLE_ID] for r in rows] == [expected_id(i, r) for i, r in enumerate(recs)]
    assert count_samples(str(tmp_path), DataConfig()) == 1500


def test_unit_records_cut_small_files_finer_and_keep_chunk_for_large_ones():
    assert [llava.unit_records(n) for n in (0, 1, 3000, 8192, 8193, 16384, 16385, 20000, 65536, 665_000)] == \
        [128, 128, 128, 128, 128, 256, 256, 256, 1024, 1024]
    for n in (3000, 20000, 665_000):  # MIN_UNITS units or more, between FINE_CHUNK and CHUNK records each
        per = llava.unit_records(n)
        assert -(-n // per) >= llava.MIN_UNITS or per in (llava.FINE_CHUNK, llava.CHUNK)
        assert per == llava.CHUNK or -(-n // (2 * per)) < llava.MIN_UNITS  # no finer than needed


@pytest.mark.parametrize("lines", [False, True])
@pytest.mark.parametrize("n", [700, 9000])
def test_merged_fine_spans_equal_a_listing_at_the_merged_size(tmp_path, lines, n):
    """The default listing lists at FINE_CHUNK and merges spans: byte for byte the units a listing at
    unit_records(n) records gives (the bytes between records, commas or newlines, come along)."""
    recs = records(n)
    name = "data.jsonl" if lines else "data.json"
    if lines:
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    else:
        write_list(tmp_path / name, recs, sep=",\n ")
    merged = llava.file_units(str(tmp_path / name), str(tmp_path))
    direct = llava.file_units(str(tmp_path / name), str(tmp_path), chunk=llava.unit_records(n))
    assert merged == direct
    assert sum(u["rows"] for u in merged) == n and len(merged) == -(-n // llava.unit_records(n))


def test_listing_reads_in_blocks_and_holds_only_offsets(tmp_path):
    recs = [{"id": i, "conversations": [{"from": "gpt", "value": "x" * 900}]} for i in range(4000)]
    raw = write_list(tmp_path / "data.json", recs)  # ~3.8 MB
    block = 64 * 1024

    class Reads(io.FileIO):
        biggest = 0

        def read(self, n=-1):
            Reads.biggest = max(Reads.biggest, n)
            return super().read(n)

    tracemalloc.start()
    with Reads(tmp_path / "data.json") as f:
        listing = json_stream.list_array(f, "data.json", 256, block=block)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert 0 < Reads.biggest <= block
    assert peak < len(raw) / 4, (peak, len(raw))  # never the whole file (nor its records) at once
    assert listing.records == 4000 and not listing.error
    assert all(isinstance(v, int) for s in listing.spans for v in (s.offset, s.length, s.first, s.count))
    assert len(listing.spans) == 16


@pytest.mark.parametrize("block", [1, 3, 1 << 20])
def test_json_lines_blank_lines_and_a_bad_line(tmp_path, block):
    recs = records(25)
    lines = [json.dumps(r, ensure_ascii=False) for r in recs]
    lines.insert(10, "   ")
    lines.insert(4, "")
    lines.insert(20, "{not json ü")
    (tmp_path / "data.jsonl").write_bytes(("\r\n".join(lines)).encode())  # CRLF, no newline at the end
    units = llava.file_units(str(tmp_path / "data.jsonl"), str(tmp_path), chunk=4, block=block)
    assert [u["rows"] for u in units] == [4] * 6 + [2] and llava.count(units, DataConfig()) == 26
    rows = read_all(units)
    ids = [r[S.SAMPLE_ID] for r in rows]
    good = [r for r in rows if not r[S.READ_ERROR]]
    bad = [r for r in rows if r[S.READ_ERROR]]
    assert len(ids) == len(set(ids)) == 26 and ids[0] == "data.jsonl:0" and ids[1] == "data.jsonl:1#r1"
    assert [r[S.SAMPLE_ID] for r in bad] == ["data.jsonl:18"]
    assert bad[0][S.READ_ERROR].startswith(S.SKIP_MALFORMED_RECORD) and "not json" in bad[0][S.READ_ERROR]
    assert [json.loads(r[S.CONVERSATIONS])[1]["value"] for r in good] == [f"answer {i} ü" for i in range(25)]


def test_repeated_ids_in_json_lines_warn_once(tmp_path, caplog):
    ids = ["x", "x", 1, "1", "y", "x"]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps({"id": i, "conversations": CONV}) for i in ids))
    with caplog.at_level(logging.WARNING, logger="ray_mmbatch.formats"):
        llava.file_units(str(tmp_path / "data.jsonl"), str(tmp_path), chunk=2, block=3)
    warnings = [r.getMessage() for r in caplog.records if "share their id" in r.getMessage()]
    assert len(warnings) == 1 and "5 records" in warnings[0] and "'x' x3" in warnings[0]


@pytest.mark.parametrize("cut", [-1, -2, -3, -9])
def test_truncated_json_keeps_every_record_before_the_break(tmp_path, cut):
    recs = records(12)
    raw = write_list(tmp_path / "data.json", recs).rstrip()
    (tmp_path / "data.json").write_bytes(raw[:cut])
    units = llava.file_units(str(tmp_path / "data.json"), str(tmp_path), chunk=5, block=16)
    rows = read_all(units)
    kept = 12 if cut >= -2 else 11  # "}\n]" ends the file: -3 cuts the last record
    assert [r[S.SAMPLE_ID] for r in rows[:-1]] == [expected_id(i, r) for i, r in enumerate(recs[:kept])]
    assert all(r[S.READ_ERROR] == "" for r in rows[:-1])
    tail = rows[-1]
    assert tail[S.SAMPLE_ID] == "data.json:unreadable-tail"
    assert tail[S.READ_ERROR].startswith(S.SKIP_MALFORMED_RECORD) and "truncated?" in tail[S.READ_ERROR]
    assert f"the {kept} record(s) before it are read" in tail[S.READ_ERROR]
    assert llava.count(units, DataConfig()) == len(rows)


def test_garbage_inside_and_after_the_list(tmp_path):
    (tmp_path / "data.json").write_text('[{"id": "a", "conversations": []} {"id": "b"}]')
    rows = read_all(llava.file_units(str(tmp_path / "data.json"), str(tmp_path)))
    assert [r[S.SAMPLE_ID] for r in rows] == ["data.json:0#a", "data.json:unreadable-tail"]
    assert "byte 34" in rows[1][S.READ_ERROR] and "expected ',' or ']'" in rows[1][S.READ_ERROR]
    (tmp_path / "data.json").write_text('[{"id": "a", "conversations": []}] trailing')
    rows = read_all(llava.file_units(str(tmp_path / "data.json"), str(tmp_path)))
    assert [r[S.SAMPLE_ID] for r in rows] == ["data.json:0#a", "data.json:unreadable-tail"]
    assert "after the list's closing ']' at byte 35" in rows[1][S.READ_ERROR]


def test_empty_list_and_refused_top_levels(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(" [ \n ] \n")
    assert llava.file_units(str(path), str(tmp_path)) == []
    for text, message in (('{"id": 1, "conversations": []}', r"expected a JSON list of records, got dict"),
                          ('"hello"', r"got str"), ("", r"is empty"), ("nope", r"not valid JSON: Expecting value"),
                          ('{"a": 1}\n{"a": 2}\n', r"JSON Lines.*name it data\.jsonl")):
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            llava.file_units(str(path), str(tmp_path))


def test_a_huge_top_level_object_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('{"a": "' + "x" * 5000 + '"}')
    with pytest.raises(ValueError, match="expected a JSON list of records, got an object"):
        llava.file_units(str(path), str(tmp_path), block=256)


def test_a_unit_over_a_changed_file_is_one_skipped_row(tmp_path):
    recs = records(10)
    write_list(tmp_path / "data.json", recs)
    units = llava.file_units(str(tmp_path / "data.json"), str(tmp_path), chunk=4)
    (tmp_path / "data.json").write_text("[]")
    rows = llava.read_unit(units[1], DataConfig())
    assert [r[S.SAMPLE_ID] for r in rows] == ["data.json:4-7"]
    assert rows[0][S.READ_ERROR].startswith(S.SKIP_UNREADABLE_FILE)


def test_the_one_open_image_read_agrees_with_the_checked_path(tmp_path):
    """llava._local_bytes (open + fstat + read, the folder's real path cached) serves only plain regular files
    under the root and leaves every other reference to the checked path; what it serves is what that path
    reads. Each kind of reference: a file, a nested one, one through a symlinked folder inside the root, a
    symlinked file, a folder symlink and a '..' out of the root, a missing file, a FIFO, a folder, a file
    over max_bytes, an absolute path, '.', a NUL."""
    import os

    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a" / "b").mkdir(parents=True)
    outside.mkdir()
    for p, data in ((root / "x.jpg", b"x" * 10), (root / "a" / "b" / "y.jpg", b"y" * 20),
                    (outside / "z.jpg", b"z" * 30), (root / "big.jpg", b"b" * 5000)):
        p.write_bytes(data)
    (root / "inner").symlink_to(root / "a")
    (root / "out").symlink_to(outside)
    (root / "link.jpg").symlink_to(root / "x.jpg")
    (root / "escape.jpg").symlink_to(outside / "z.jpg")
    os.mkfifo(root / "pipe.jpg")
    served = {"x.jpg": b"x" * 10, "a/b/y.jpg": b"y" * 20, "inner/b/y.jpg": b"y" * 20, "./x.jpg": b"x" * 10}
    refused = ["link.jpg", "escape.jpg", "out/z.jpg", "../outside/z.jpg", "a/../../outside/z.jpg", "missing.jpg",
               "a/missing.jpg", "pipe.jpg", "a", "big.jpg", str(root / "x.jpg"), ".", "", "x\x00.jpg", 7]
    for ref in list(served) + refused:
        assert llava._local_bytes(ref, str(root), 1000) == served.get(ref), ref
        location, err, _ = llava._locate(ref, str(root))  # the checked path (no archive in this root)
        checked = llava._read_image(location, ref, 1000) if location is not None else (b"", err)
        assert llava._image_bytes(ref, str(root), 1000) == checked, ref  # the same answer either way
        if ref in served or ref == "link.jpg":  # a symlink inside the root is read, by the checked path
            assert checked == (served.get(ref, b"x" * 10), ""), ref
        else:
            assert checked[0] == b"" and checked[1], ref  # refused with a reason
