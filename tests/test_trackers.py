"""--report-to tensorboard,wandb,mlflow (run/trackers.py), with the real libraries, all on this machine.

W&B offline (WANDB_MODE=offline, WANDB_DIR in tmp_path), MLflow in a ``file:`` store
(MLFLOW_ALLOW_FILE_STORE=true), TensorBoard event files in OUTPUT_DIR/tensorboard; each is
read back with its own reader (EventAccumulator, MlflowClient, the offline run's .wandb log).
"""
from __future__ import annotations

import csv
import json
import math
import struct
import sys
from pathlib import Path

import pytest

from ray_mmbatch.config import Config
from ray_mmbatch.run.rundir import RunDir, read_jsonl
from ray_mmbatch.run.trackers import TRACKERS, TrackerError, TrackerSink, check_trackers, tracker_names


def need_trackers(*names: str) -> None:
    """Skip this test unless these trackers' packages are installed (only the tests that use one ask:
    the tests of a missing tracker run whatever is installed). "tensorboard": the reader; the writer may be
    tensorboardX, which ray[tune] always installs."""
    for name in names:
        pytest.importorskip(name)


@pytest.fixture
def tracker_env(tmp_path, monkeypatch):
    need_trackers("wandb", "mlflow", "tensorboard")
    (tmp_path / "wandb").mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_PROJECT", "ray_mmbatch_tests")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return tmp_path


# ------------------------------------------------------------------ readers
def tb_scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard shows them (purged points left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / RunDir.TENSORBOARD), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tb_hparams(out: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(out / RunDir.TENSORBOARD))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    return set(plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams)


def mlflow_runs(root: Path) -> list:
    """Every run of the MLflow store MLFLOW_TRACKING_URI points to."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def mlflow_run(root: Path):
    from mlflow.tracking import MlflowClient

    runs = mlflow_runs(root)
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return MlflowClient(), runs[0]


def wandb_records(root: Path) -> list:
    """The records of the one offline W&B run under ``root``/wandb (WANDB_DIR)."""
    (path,) = wandb_run_files(root / "wandb")
    return read_wandb_log(path)


def wandb_run_files(wandb_dir: Path) -> list[Path]:
    """The .wandb log of every offline W&B run under WANDB_DIR ``wandb_dir``."""
    return sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb"))


def wandb_run_record(records):
    """The run's own record (name, group, project, ...) among an offline run's records."""
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")


def read_wandb_log(path: Path, wait_s: float = 60.0) -> list:
    """An offline W&B run's .wandb file is a LevelDB-style log (7-byte file header, then 32 KiB blocks
    of records: crc32, length, type, protobuf bytes); its records, in order, once its last one is the run's
    exit record. ``run.finish()`` can return before W&B's service process has written the file out (seen
    on the loaded CI machine: the steps after a restore were not on disk yet), so the file is read again
    until the exit record is in, for up to ``wait_s``; then what is there."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        records = _wandb_log_records(path)
        if (records and records[-1].WhichOneof("record_type") == "exit") or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _wandb_log_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the rest of a block too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            out.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return out


def wandb_history(records) -> list[dict]:
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return rows


def wandb_updates(records, kind: str) -> dict:
    out: dict = {}
    for r in records:
        if r.WhichOneof("record_type") == kind:
            out.update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in getattr(r, kind).update})
        if r.WhichOneof("record_type") == "run" and kind == "config":
            out.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
    return out


# ------------------------------------------------------------------ the sink on a sequence of events
def _metrics(step: int, loss: float, **extra) -> tuple:
    rec = {"step": step, "loss": loss, "lr": 1e-3 * step, "tokens_per_s": 1000.0 + step, "padded_tokens_per_s": 1100.0,
           "samples_per_s": 10.0, "fill": 0.9, "step_time_s": 0.5, "data_wait_frac": 0.05, "peak_mem_mb": 512.0,
           "initial_loss": 3.0, "final": False, "progress": None, "aborted": "", "total_samples": 10 * step, **extra}
    return ("append", "metrics", rec)


def _skip(step: int, sid: str, reason: str) -> tuple:
    return ("append", "skipped", {"step": step, "sample_id": sid, "reason": reason, "detail": "x"})


def test_sink_logs_config_metrics_skips_and_survives_a_restore(tracker_env, tmp_path):
    """Events as the driver drains them (a fresh start, reports, a restore to step 4, reports
    again with an eval loss): every tracker has the config, every metric by step and the skip
    counts; TensorBoard shows the re-reported step 6 only, MLflow keeps both in its history,
    W&B logs both rows at their step."""
    out = tmp_path / "run"
    cfg = Config()
    cfg.train.lr, cfg.train.report_to = 0.0123, "tensorboard,wandb,mlflow"
    sink = TrackerSink(check_trackers(cfg.train.report_to), out, cfg.to_dict(), "unit")
    sink.apply([("trim", 0), _skip(1, "a", "corrupt_image"), ("append", "batches", {"step": 1, "rank": 0}),
                _metrics(2, 3.0), _metrics(4, 2.5)])
    sink.apply([_skip(5, "b", "missing_image"), _metrics(6, 2.0)])
    sink.apply([("trim", 4), _skip(5, "b", "missing_image"), _skip(6, "c", "missing_image"),
                _metrics(6, 1.9, eval_loss=2.2), _metrics(8, 1.5, final=True)])
    sink.close()

    # TensorBoard: the restore's purge hides the first step 6
    tb = tb_scalars(out)
    assert tb["loss"] == [(2, 3.0), (4, 2.5), (6, pytest.approx(1.9)), (8, 1.5)]
    assert tb["eval_loss"] == [(6, pytest.approx(2.2))]
    assert {"lr", "tokens_per_s", "fill", "data_wait_frac", "peak_mem_mb", "step_time_s", "total_samples"} <= set(tb)
    assert not {"final", "progress", "aborted", "step"} & set(tb)
    assert tb["skipped_total"] == [(2, 1.0), (4, 1.0), (6, 3.0), (8, 3.0)]  # "b" sent twice, counted once
    assert tb["skipped/missing_image"][-1] == (8, 2.0) and tb["skipped/corrupt_image"][-1] == (8, 1.0)
    assert {"train.lr", "budget.max_tokens", "train.report_to"} <= tb_hparams(out)

    # MLflow: params, the metric history with both step-6 values, the latest value, the restore tag
    client, run = mlflow_run(tmp_path)
    assert run.data.params["train.lr"] == "0.0123" and run.data.params["budget.max_tokens"] == "4096"
    history = [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, "loss"),
                                                 key=lambda m: (m.step, m.timestamp))]
    assert [s for s, _ in history] == [2, 4, 6, 6, 8] and history[-1] == (8, 1.5)
    assert run.data.metrics["loss"] == 1.5 and run.data.metrics["eval_loss"] == pytest.approx(2.2)
    assert run.data.metrics["skipped_total"] == 3.0
    assert run.data.tags["ray_mmbatch.restored_to_step"] == "4" and run.info.status == "FINISHED"

    # W&B: the config, one history row per report with its step, the summary
    records = wandb_records(tmp_path)
    rows = wandb_history(records)
    assert [(r["step"], r["loss"]) for r in rows] == [(2, 3.0), (4, 2.5), (6, 2.0), (6, pytest.approx(1.9)),
                                                        (8, 1.5)]
    assert rows[3]["eval_loss"] == pytest.approx(2.2) and rows[-1]["skipped_total"] == 3.0
    assert {"lr", "tokens_per_s", "fill", "data_wait_frac", "peak_mem_mb"} <= set(rows[0])
    config = wandb_updates(records, "config")
    assert config["train"]["lr"] == 0.0123 and config["budget"]["max_tokens"] == 4096
    assert wandb_updates(records, "summary")["restored_to_step"] == 4


def test_tensorboardx_writes_the_same_files(tmp_path, monkeypatch):
    """Without the tensorboard package the writer is tensorboardX (ray[tune] installs it): same tags, same purge."""
    need_trackers("tensorboard")  # the reader
    monkeypatch.setitem(TRACKERS, "tensorboard", (("tensorboardX",), "pip install tensorboard"))
    sink = TrackerSink(("tensorboard",), tmp_path, Config().to_dict(), "tbx")
    assert sink.trackers["tensorboard"].module.__name__ == "tensorboardX"
    sink.apply([("trim", 0), _metrics(2, 3.0), _metrics(4, 2.5), _metrics(6, 2.0)])
    sink.apply([("trim", 4), _metrics(6, 1.5)])
    sink.close()
    assert tb_scalars(tmp_path)["loss"] == [(2, 3.0), (4, 2.5), (6, 1.5)]
    assert "train.lr" in tb_hparams(tmp_path)


# ------------------------------------------------------------------ not installed / unknown
def test_a_tracker_not_installed_names_the_pip_install(monkeypatch):
    monkeypatch.setitem(TRACKERS, "wandb", (("ray_mmbatch_no_such_tracker_module",), "pip install wandb"))
    with pytest.raises(TrackerError, match=r"--report-to wandb: not installed .*Install it with: pip install wandb"):
        check_trackers("tensorboard,wandb")
    with pytest.raises(TrackerError, match="unknown tracker; choose from tensorboard, wandb, mlflow"):
        check_trackers(("comet",))
    assert check_trackers("none") == () and tracker_names(" TensorBoard, mlflow ,") == ("tensorboard", "mlflow")


def test_an_mlflow_store_that_does_not_open_fails_at_start(tmp_path, monkeypatch):
    """MLflow 3 refuses a file: store unless MLFLOW_ALLOW_FILE_STORE=true: said at start, not mid-run."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    mlflow = pytest.importorskip("mlflow")

    if int(mlflow.__version__.split(".")[0]) < 3:
        pytest.skip("MLflow 2 opens a file: store as it is")
    with pytest.raises(TrackerError, match="--report-to mlflow: the tracking store .*MLFLOW_ALLOW_FILE_STORE"):
        check_trackers("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert check_trackers("mlflow") == ("mlflow",)


def test_cli_refuses_a_missing_tracker_before_any_work(tmp_path):
    """A real missing module: a wandb.py on PYTHONPATH whose import fails, as an uninstalled one does."""
    import os
    import subprocess

    (tmp_path / "shadow").mkdir()
    (tmp_path / "shadow" / "wandb.py").write_text("raise ImportError('No module named wandb')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "shadow")}
    r = subprocess.run([sys.executable, "-c", "import sys; from ray_mmbatch.cli import main; sys.exit(main())",
                        "train", "--data", str(tmp_path / "none"),
                        "--report-to", "tensorboard,wandb", "--output-dir", str(tmp_path / "out")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--report-to wandb: not installed" in r.stderr and "pip install wandb" in r.stderr
    assert "ray.init" not in r.stderr and not (tmp_path / "out").exists()  # nothing ran


# ------------------------------------------------------------------ one real run
def _train_loop_keeping_each_ranks_weights(config: dict) -> None:
    """The project's train_loop_per_worker, but every rank saves the parameters it holds when its step
    loop ends (OUTPUT_DIR/rank_weights/rank<r>.pt): the run itself records rank 0's only (its export).
    Runs in the Train workers (pickled by value: they cannot import a test module)."""
    import torch

    from ray_mmbatch.train import loop

    run = loop.Runner.run

    def run_and_keep(self) -> None:
        run(self)
        d = Path(self.cfg.train.output_dir) / "rank_weights"
        d.mkdir(parents=True, exist_ok=True)
        bare = getattr(self.model, "module", self.model)
        torch.save({n: p.detach().cpu().clone() for n, p in bare.named_parameters()}, d / f"rank{self.rank}.pt")

    loop.Runner.run = run_and_keep
    try:
        loop.train_loop_per_worker(config)
    finally:
        loop.Runner.run = run


@pytest.mark.ray
@pytest.mark.slow
def _video_shard(path, ck) -> None:
    """A WebDataset shard of 6 clips (KEY.mp4 + KEY.json with a <video> turn), and the checkpoint's video
    processor (fps sampling), so the training run below takes video samples too."""
    import io
    import tarfile

    from ray_mmbatch.synthetic.video import clip_frames, encode_clip

    (ck / "video_preprocessor_config.json").write_text(json.dumps({
        "video_processor_type": "Qwen2VLVideoProcessor", "do_sample_frames": True, "fps": 4.0, "min_frames": 2,
        "max_frames": 8, "size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 16 * 28 * 28}}))
    with tarfile.open(path, "w") as tar:
        for k in range(6):
            record = json.dumps({"id": f"vid{k}", "conversations": [
                {"from": "human", "value": "<video>\nWhat moves?"}, {"from": "gpt", "value": f"A square, {k}."}]})
            for name, data in ((f"vid{k}.mp4", encode_clip(clip_frames(6 + 2 * k, 40, 56, k), fps=6)),
                               (f"vid{k}.json", record.encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_train_command_reports_every_step_to_all_three(ray_cluster, tracker_env, tmp_path, monkeypatch):
    """`ray-mmbatch train --report-to tensorboard,mlflow,wandb` with a held-out set and a worker killed
    after step 7: the restore to step 4's checkpoint reports step 6 again. Every tracker has the loss
    of every reported step and the eval loss where there is one; TensorBoard shows what
    metrics.jsonl keeps, MLflow and W&B step 6 twice.

    The same run carries two more end-to-end checks. A blend of two datasets (--data A#0.6 --data B#0.4:
    B up-sampled, its copies id~k, A down-sampled) with --ledger: summary.json's per-source trained counts
    and shares are the ledger's, its per-source skips skipped.csv's, after the restore's trim. LoRA on a tiny
    Qwen2-VL under DDP (--lora-rank 4 --num-workers 2, restored from a checkpoint that holds the adapters
    only): both ranks end with bit-identical adapters, which moved, and base weights bit-identical to the
    checkpoint's; OUTPUT_DIR/adapter holds exactly those adapters and reloads with PeftModel.from_pretrained
    (merged) and load_adapter to the trained model's logits."""
    from collections import Counter

    pytest.importorskip("peft")
    import torch
    from ray import cloudpickle
    from safetensors.torch import load_file

    from ray_mmbatch import local_batches
    from ray_mmbatch.commands.train import main
    from ray_mmbatch.formats.sources import source_of
    from ray_mmbatch.models import trainable as T
    from ray_mmbatch.synthetic.generate import generate_dataset
    from ray_mmbatch.train import checkpoint as ckpt
    from tests.hf_checkpoints import make_qwen_checkpoint
    from tests.test_trainable import _cfg, _model, _reloads_to

    ck = make_qwen_checkpoint(tmp_path / "ck", "qwen2_vl", initializer_range=0.02)
    data, extra, out = tmp_path / "data", tmp_path / "extra", tmp_path / "run"
    generate_dataset(str(data), 96, "parquet", seed=3, shard_size=48, bad_per_kind=1)
    generate_dataset(str(extra), 32, "webdataset", seed=5, shard_size=16, workers=1)
    _video_shard(extra / "shard-video.tar", ck)  # clips beside the images: video trains under LoRA + DDP too
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the wrapper below runs in the workers
    monkeypatch.setattr("ray_mmbatch.train.loop.train_loop_per_worker", _train_loop_keeping_each_ranks_weights)
    rc = main(["--model", str(ck), "--lora-rank", "4", "--lora-alpha", "8", "--num-workers", "2", "--lr", "1e-3",
               "--data", f"{data}#0.6", "--data", f"{extra}#0.4", "--ledger",
               "--output-dir", str(out), "--max-tokens", "1024", "--window", "32",
               "--max-steps", "8", "--report-every", "2", "--checkpoint-every", "4", "--set", "train.fault_at_step=7",
               "--eval-split", "0.2", "--eval-every", "4", "--verbose", "--report-to", "tensorboard,mlflow,wandb"])
    assert rc == 0 and (out / RunDir.FAULT_DRILL).exists()
    records = read_jsonl(out / RunDir.METRICS)  # after the restore's trim
    kept = [(r["step"], r["loss"]) for r in records]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    assert [s for s, _ in evals] == [4, 8]
    assert [s for s, _ in kept] == [2, 4, 6, 8] and all(math.isfinite(v) for _, v in kept)
    summary = json.loads((out / RunDir.SUMMARY).read_text())
    skipped = summary["skipped_total"]
    assert skipped > 0

    tb = tb_scalars(out)
    assert tb["loss"] == [(s, pytest.approx(v)) for s, v in kept]
    assert tb["eval_loss"] == [(s, pytest.approx(v)) for s, v in evals]
    assert tb["skipped_total"][-1] == (8, skipped) and {"lr", "tokens_per_s", "fill", "peak_mem_mb"} <= set(tb)

    client, run = mlflow_run(tmp_path)
    history = sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert [s for s, _, _ in history] == [2, 4, 6, 6, 8]  # step 6 before the fault and again after the restore
    assert [(s, v) for i, (s, _, v) in enumerate(history) if i != 2] == [(s, pytest.approx(v)) for s, v in kept]
    assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval_loss")) == \
        [(s, pytest.approx(v)) for s, v in evals]
    assert run.data.params["train.max_steps"] == "8" and run.info.status == "FINISHED"
    assert run.info.run_name == "run" and run.data.tags["ray_mmbatch.restored_to_step"] == "4"

    rows = wandb_history(wandb_records(tmp_path))
    assert [r["step"] for r in rows] == [2, 4, 6, 6, 8]
    assert [(r["step"], r["loss"]) for i, r in enumerate(rows) if i != 2] == [(s, pytest.approx(v)) for s, v in kept]
    assert [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r] == [(s, pytest.approx(v)) for s, v in evals]

    # the blend: summary.json's per-source counts are the ledger's (ids are source:id, copies source:id~k)
    ledger = [sid for p in sorted((out / RunDir.LEDGER).glob("rank*.jsonl")) for r in read_jsonl(p)
              for sid in r["sample_ids"]]
    assert len(ledger) == len(set(ledger)) == summary["samples"] > 0
    per = Counter(source_of(s) for s in ledger)
    copies = [s for s in ledger if "~" in s]  # the up-sampled source's second copies count to it
    assert copies and {source_of(s) for s in copies} == {"extra"}
    sources = summary["sources"]
    assert set(sources) == set(per) == {"data", "extra"}  # both sources trained
    assert any("shard-video.tar/vid" in s for s in ledger), "no clip trained"
    for name, weight in (("data", 0.6), ("extra", 0.4)):
        assert sources[name]["weight"] == weight and sources[name]["trained"] == per[name]
        assert sources[name]["trained_share"] == pytest.approx(per[name] / len(ledger))
    with open(out / RunDir.SKIPPED) as f:
        skip_ids = [r["sample_id"] for r in csv.DictReader(f)]
    assert Counter(source_of(s) for s in skip_ids) == {n: v["skipped"] for n, v in sources.items() if v["skipped"]}
    assert sum(v["skipped"] for v in sources.values()) == skipped

    # LoRA under DDP: the checkpoint restored holds the adapters only; what each rank holds at the end,
    # the export, the reload
    last = max((p.parent for p in out.rglob(ckpt.STATE)), key=lambda d: ckpt.load_state(d)["step"])
    saved = torch.load(last / ckpt.MODEL, weights_only=True)
    assert saved and all("lora_" in k for k in saved), sorted(saved)[:5]
    ranks = [torch.load(out / "rank_weights" / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    lora = [n for n in ranks[0] if "lora_" in n]
    assert lora and set(ranks[0]) == set(ranks[1])
    assert all(torch.equal(ranks[0][n], ranks[1][n]) for n in lora), "the ranks' adapters differ"
    assert any(ranks[0][n].abs().max() > 0 for n in lora if "lora_B" in n), "lora_B starts at 0: it never trained"
    cfg = _cfg(str(data), str(ck), lora_rank=4, lora_alpha=8.0)
    trained = _model(cfg)
    T.configure_trainable(trained, cfg)
    start = {n: p.detach().clone() for n, p in trained.named_parameters()}
    assert set(ranks[0]) == set(start)
    for n in ranks[0]:  # the frozen base: the checkpoint's, bit for bit, on both ranks
        if "lora_" not in n:
            assert torch.equal(ranks[0][n], start[n]) and torch.equal(ranks[1][n], start[n]), n
    assert not trained.load_state_dict(ranks[1], strict=False).unexpected_keys  # rank 1's (buffers: the start's)
    exported = load_file(str(out / RunDir.ADAPTER / "adapter_model.safetensors"))
    held = T.lora_state_dict(trained)
    assert set(exported) == set(held) and all(torch.equal(exported[k], held[k]) for k in held)
    batch = next(b for b in local_batches(cfg, limit=8) if len(b["patches"]))
    with torch.no_grad():
        want = trained.eval()(batch)
        assert (want - _model(_cfg(str(data), str(ck))).eval()(batch)).abs().max() > 0  # the adapters act
    _reloads_to(out / RunDir.ADAPTER, str(data), str(ck), batch, want)
