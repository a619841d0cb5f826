"""Run logs survive a process killed mid-append; real corruption is not hidden."""
import json

import pytest

from ray_mmbatch.run.rundir import read_jsonl, write_jsonl


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
    from ray_mmbatch import schema as S
    from ray_mmbatch.run.rundir import RunWriter, read_jsonl

    w = RunWriter(tmp_path, "stopped.json")
    (tmp_path / S.RUN_METRICS).write_text('{"step": 99}\n')  # an earlier run in this dir
    w.apply([("trim", 0)])
    assert not (tmp_path / S.RUN_METRICS).exists()
    w.apply([("append", "metrics", {"step": s}) for s in (2, 4)]
            + [("append", "batches", {"step": s, "rank": r}) for s in (1, 2, 3, 4) for r in (1, 0)]
            + [("append", "ledger/rank1", {"step": 3, "sample_ids": ["a"]}),
               ("append", "skipped", {"step": 3, "sample_id": "x", "reason": "decode_error: bad"})])
    w.apply([("trim", 2), ("append", "metrics", {"step": 3})])  # restored to step 2, then step 3 again
    assert [r["step"] for r in read_jsonl(tmp_path / S.RUN_METRICS)] == [2, 3]
    assert [r["step"] for r in read_jsonl(tmp_path / S.RUN_BATCHES)] == [1, 1, 2, 2]
    assert read_jsonl(tmp_path / S.RUN_LEDGER / "rank1.jsonl") == []
    assert [r["sample_id"] for r in read_jsonl(tmp_path / S.RUN_SKIP_LOG)] == ["x"]  # merged by id later
    w.apply([("stopped", {"seen": 50, "skipped": 40, "step": 3})])
    assert json.loads((tmp_path / "stopped.json").read_text())["skipped"] == 40
    with pytest.raises(ValueError, match="unknown run event"):
        w.apply([("rename", "x")])
