"""Run logs survive a process killed mid-append; real corruption is not hidden."""
import pytest

from ray_mmbatch.runlog import read_jsonl, write_jsonl


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
