"""Ray Train runs on the shared local cluster: exactly-once through stop/resume and worker faults.

Each fit costs ~30-60 s here, so each test checks several things of one scenario.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from ray_mmbatch.config import Config
from ray_mmbatch.run.rundir import RunDir
from ray_mmbatch.synthetic.generate import generate_dataset

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def bad_parquet(tmp_path_factory):
    out = tmp_path_factory.mktemp("pq_bad")
    manifest = generate_dataset(str(out), 150, "parquet", seed=11, shard_size=60, bad_per_kind=1)
    return out, manifest


def _cfg(data, out: Path, **train) -> Config:
    cfg = Config()
    cfg.data.path, cfg.data.format = str(data), "parquet"
    cfg.budget.max_tokens, cfg.budget.window = 2048, 64
    cfg.train.output_dir = str(out)
    cfg.train.ledger = True
    cfg.train.report_every = 2
    cfg.train.checkpoint_every = 2
    cfg.train.max_steps = 0
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def ledger_rows(out: Path) -> list[dict]:
    """Every ledger record of every rank: step, epoch, batch_id, sample_ids."""
    return [json.loads(ln) for p in sorted((out / RunDir.LEDGER).glob("rank*.jsonl"))
            for ln in p.read_text().splitlines()]


def ledger(out: Path, epoch: int | None = None) -> list[str]:
    return [sid for r in ledger_rows(out) if epoch is None or r["epoch"] == epoch for sid in r["sample_ids"]]


def skipped(out: Path) -> dict[str, str]:
    with open(out / RunDir.SKIPPED) as f:
        return {r["sample_id"]: r["reason"] for r in csv.DictReader(f)}


def assert_exactly_once(out: Path, manifest: dict, epoch: int = 0) -> None:
    trained, skips = ledger(out, epoch), skipped(out)
    dupes = {s for s in trained if trained.count(s) > 1}
    assert not dupes, f"trained more than once: {sorted(dupes)[:5]}"
    assert not set(trained) & set(skips)
    assert sorted(trained + list(skips)) == sorted(manifest["ids"]), "a sample was neither trained nor reported"
    for sid, reason in manifest["bad"].items():
        if sid not in manifest["bad_conditions"]:
            assert skips.get(sid) == reason, (sid, skips.get(sid), reason)
    assert set(manifest["valid_unusual"]) <= set(trained)


def test_stop_and_rerun_same_name_resumes_exactly_once(ray_cluster, bad_parquet, tmp_path):
    """Two workers, two epochs; the run stops at step 3, is re-run with the same name, resumes
    and then a train worker is SIGKILLed at step 7: it restores and finishes. Every sample is
    trained exactly once in each epoch, and no rank starts epoch 1 before epoch 0 is done."""
    from ray_mmbatch.train.trainer import run_training

    data, manifest = bad_parquet
    out = tmp_path / "run"
    first = run_training(_cfg(data, out, num_workers=2, max_steps=3, epochs=2))
    assert first["steps"] == 3
    partial = ledger(out)
    assert partial and len(partial) == len(set(partial))
    # the position records which listing its unit indices count; a re-run over another listing
    # (here: the same files plus one more, elsewhere) stops before training, naming the cause
    from ray_mmbatch.formats.units import listing_digest, read_units
    from ray_mmbatch.train.checkpoint import read_latest_position

    cfg = _cfg(data, out)
    assert read_latest_position(out)["listing"] == listing_digest(read_units(str(data), cfg.data)[0])
    changed = tmp_path / "changed"
    shutil.copytree(data, changed)
    shutil.copy(next(changed.glob("*.parquet")), changed / "train-zz-extra.parquet")  # a train file (splits.py)
    with pytest.raises(ValueError, match="read units changed since the checkpoint"):
        run_training(_cfg(changed, out, num_workers=2, max_steps=0, epochs=2))

    summary = run_training(_cfg(data, out, num_workers=2, max_steps=0, fault_at_step=7, epochs=2))
    assert (out / "fault_drill_done").read_text() == "7", "the fault drill did not fire"
    assert summary["steps"] > 7
    assert_exactly_once(out, manifest, epoch=0)
    assert_exactly_once(out, manifest, epoch=1)
    rows = ledger_rows(out)
    assert {r["epoch"] for r in rows} == {0, 1}
    assert all(r["batch_id"].startswith(f"e{r['epoch']}/") for r in rows)
    assert max(r["step"] for r in rows if r["epoch"] == 0) < min(r["step"] for r in rows if r["epoch"] == 1)
    assert set(partial) <= set(ledger(out, 0))
    # by epochs (no max_steps) the cosine follows the samples done: the run ends at the floor
    last = json.loads((out / RunDir.METRICS).read_text().splitlines()[-1])
    assert last["lr"] < 0.15 * summary["config"]["train"]["lr"], last["lr"]  # the demo's 3e-3, resolved
    batches = [json.loads(ln) for ln in (out / RunDir.BATCHES).read_text().splitlines()]
    assert {b["rank"] for b in batches} == {0, 1}
    assert all(b["real_tokens"] <= 2048 for b in batches)
    assert summary["samples"] == len(ledger(out))
    assert summary["skipped_total"] == len(skipped(out)) > 0
    steps = [json.loads(ln)["step"] for ln in (out / RunDir.METRICS).read_text().splitlines()]
    assert steps == sorted(set(steps)), "metrics of undone steps must be trimmed on restore"


def _kill_one_materialize_worker(stop: threading.Event, killed: list) -> None:
    """SIGKILL the first materialize actor process seen (Ray titles it ray::MapWorker(...))."""
    import psutil

    while not stop.is_set() and not killed:
        for p in psutil.process_iter(["cmdline"]):
            title = " ".join(p.info["cmdline"] or [])
            if title.startswith("ray::MapWorker(MapBatches(MaterializeStage))") and ".submit" in title:
                os.kill(p.pid, signal.SIGKILL)
                killed.append(p.pid)
                return
        time.sleep(0.2)


def test_preprocessing_worker_killed_mid_epoch(ray_cluster, bad_parquet, tmp_path):
    """SIGKILL a materialize actor while batches stream: Ray Data restarts it, the epoch
    finishes and every accepted sample is trained exactly once."""
    from ray_mmbatch.train.trainer import run_training

    data, manifest = bad_parquet
    out = tmp_path / "run"
    stop, killed = threading.Event(), []
    t = threading.Thread(target=_kill_one_materialize_worker, args=(stop, killed), daemon=True)
    t.start()
    try:
        summary = run_training(_cfg(data, out, num_workers=1))
    finally:
        stop.set()
        t.join(5)
    assert killed, "no materialize worker was found to kill"
    assert summary["steps"] > 0
    assert_exactly_once(out, manifest)


def _batches(out: Path) -> list[tuple[str, list[str]]]:
    rows = [json.loads(ln) for ln in (out / RunDir.LEDGER / "rank0.jsonl").read_text().splitlines()]
    return [(r["batch_id"], r["sample_ids"]) for r in rows]


def test_deterministic_training_replays_the_same_batches(ray_cluster, bad_parquet, tmp_path):
    """The stream reaching Train (built in the controller process, split by Train) keeps
    its order in deterministic mode: two runs train the same batches in the same order.
    summary.json says where the data time went (run/datatime.py): every stage took time, the
    steps waited at most their own wall time, and the verdict says whether to add data CPUs."""
    from ray_mmbatch.train.trainer import run_training

    data, _ = bad_parquet
    summary = run_training(_cfg(data, tmp_path / "a", num_workers=1, max_steps=6, checkpoint_every=0))
    run_training(_cfg(data, tmp_path / "b", num_workers=1, max_steps=6, checkpoint_every=0))
    first, second = _batches(tmp_path / "a"), _batches(tmp_path / "b")
    assert len(first) == 6
    assert first == second
    # the plan it set out with (run/plan.py): the demo's lr, the steps given, the rows counted up front
    import pyarrow.parquet as pq

    rows = sum(pq.read_metadata(p).num_rows for p in Path(data).rglob("*.parquet"))
    plan = json.loads((tmp_path / "a" / RunDir.SUMMARY).read_text())["plan"]
    assert (plan["samples_per_epoch"], plan["max_steps"], plan["lr"], plan["tokens_per_step"]) == (rows, 6, 3e-3, 2048)
    assert plan["checkpoints"] == "at the end only" and plan["mode"] == "demo"

    dt = json.loads((tmp_path / "a" / RunDir.SUMMARY).read_text())["data_time"]
    assert dt == json.loads(json.dumps(summary["data_time"]))
    for stage in ("read_s", "measure_s", "plan_s", "materialize_s", "transfer_s", "wait_s", "step_s"):
        assert dt[stage] > 0, (stage, dt)
    assert dt["data_s"] == pytest.approx(sum(dt[k] for k in ("read_s", "measure_s", "plan_s", "materialize_s")),
                                         abs=0.01)
    assert dt["wait_s"] <= dt["step_s"] <= summary["wall_s"]
    assert dt["wait_share"] == pytest.approx(dt["wait_s"] / dt["step_s"], abs=1e-3)
    assert 0 < dt["first_batch_s"] <= dt["wait_s"] and dt["batches"] >= 6  # + rows carrying only skip records
    assert dt["data_cpus"] > 0 and dt["samples_per_data_cpu_s"] == pytest.approx(
        summary["samples"] / dt["data_s"], rel=0.01)
    assert dt["verdict"].startswith("data wait ") and "% of step time" in dt["verdict"]
