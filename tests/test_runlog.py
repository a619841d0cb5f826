"""Run logs survive a process killed mid-append; real corruption is not hidden."""
import json

import pytest

from ray_mmbatch.run.rundir import RunDir, read_jsonl, write_jsonl


def test_torn_last_line_is_dropped_and_complete_records_kept(tmp_path):
    p = tmp_path / "batches.rank0.jsonl"
    write_jsonl(p, [{"step": 1}, {"step": 2}])
    with open(p, "a") as f:
        f.write('{"step": 3, "sample_ids": ["a", "b"')   # SIGKILL mid-write
    assert read_jsonl(p) == [{"step": 1}, {"step": 2}]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_a_bad_line_before_the_end_raises_with_its_place(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"m.jsonl:2"):
        read_jsonl(p)


def test_the_driver_writes_the_ranks_events_and_a_restore_undoes_later_steps(tmp_path):
    """runlog.RunWriter: appends in arrival order, trim to the restored step (skip records kept),
    trim(0) clears an old run's logs, 'stopped' writes the guard's file."""
    from ray_mmbatch.run.rundir import RunWriter, read_jsonl

    w = RunWriter(tmp_path)
    (tmp_path / RunDir.METRICS).write_text('{"step": 99}\n')  # an earlier run in this dir
    w.apply([("trim", 0)])
    assert not (tmp_path / RunDir.METRICS).exists()
    w.apply([("append", "metrics", {"step": s}) for s in (2, 4)]
            + [("append", "batches", {"step": s, "rank": r}) for s in (1, 2, 3, 4) for r in (1, 0)]
            + [("append", "ledger/rank1", {"step": 3, "sample_ids": ["a"]}),
               ("append", "skipped", {"step": 3, "sample_id": "x", "reason": "decode_error: bad"})])
    w.apply([("trim", 2), ("append", "metrics", {"step": 3})])  # restored to step 2, then step 3 again
    assert [r["step"] for r in read_jsonl(tmp_path / RunDir.METRICS)] == [2, 3]
    assert [r["step"] for r in read_jsonl(tmp_path / RunDir.BATCHES)] == [1, 1, 2, 2]
    assert read_jsonl(tmp_path / RunDir.LEDGER / "rank1.jsonl") == []
    assert [r["sample_id"] for r in read_jsonl(tmp_path / RunDir.SKIP_LOG)] == ["x"]  # merged by id later
    w.apply([("stopped", {"seen": 50, "skipped": 40, "step": 3})])
    assert json.loads((tmp_path / "stopped.json").read_text())["skipped"] == 40
    with pytest.raises(ValueError, match="unknown run event"):
        w.apply([("rename", "x")])


def test_skip_records_have_one_text_form_and_round_trip():
    from ray_mmbatch.data.errors import SampleSkip, SkipRecord, decode_skips, encode_skips
    from ray_mmbatch.schema import parse_skip, skip_text

    rec = SkipRecord.of("a/1", "corrupt_image: truncated: at byte 9", 7, 50)
    assert (rec.reason, rec.detail, rec.position, rec.unit_rows) == ("corrupt_image", "truncated: at byte 9", 7, 50)
    assert rec.text == "corrupt_image: truncated: at byte 9" and parse_skip(rec.text) == (rec.reason, rec.detail)
    assert skip_text("empty_text") == "empty_text" == SampleSkip("empty_text").skip_reason()  # never "x: x"
    assert decode_skips(encode_skips([rec, SkipRecord("b", "oversize")])) == [rec, SkipRecord("b", "oversize")]
    assert decode_skips(encode_skips([])) == []
