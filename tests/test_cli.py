"""The jobs' flags: every flag sets a config field, flags override --config, --help explains."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from ray_mmbatch.cli import FLAGS, add_config_flags, config_from_args
from ray_mmbatch.config import Config, load_config, save_config

ROOT = Path(__file__).resolve().parents[1]


def _parse(argv):
    p = argparse.ArgumentParser()
    add_config_flags(p)
    return config_from_args(p.parse_args(argv))


def test_flags_override_the_yaml_file(tmp_path):
    cfg = Config()
    cfg.budget.max_tokens, cfg.budget.mode, cfg.train.num_workers = 8192, "pad", 3
    save_config(cfg, tmp_path / "best.yaml")
    got = _parse(["--config", str(tmp_path / "best.yaml"), "--max-tokens", "2048", "--use-gpu",
                  "--max-patches", "100", "--set", "model.mlp_ratio=2"])
    assert got.budget.max_tokens == 2048          # flag wins
    assert got.budget.mode == "pad" and got.train.num_workers == 3   # file kept
    assert got.train.use_gpu is True and got.budget.max_patches == 100 and got.model.mlp_ratio == 2.0
    assert load_config(tmp_path / "best.yaml").budget.max_tokens == 8192


def test_relative_locations_are_resolved_where_the_command_starts(tmp_path, monkeypatch):
    """Ray Train's controller and the data tasks run in other directories: `--data my_data/` must name the
    folder the user sees (the docs' commands found this: train failed with 'dataset path does not exist')."""
    (tmp_path / "my_data").mkdir()
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    got = _parse(["--data", "my_data/", "--data", "my_data#0.5", "--model", "ckpt", "--eval-data", "nowhere/",
                  "--image-root", "s3://bucket/images", "--tokenizer", ""])
    assert [s["path"] for s in got.data.sources] == [str(tmp_path / "my_data"), f"{tmp_path / 'my_data'}"]
    assert got.model.path == str(tmp_path / "ckpt")
    assert got.data.eval_data == "nowhere/"  # does not exist here: left for the preflight to name as written
    assert got.data.image_root == "s3://bucket/images" and got.text.tokenizer == ""
    one = _parse(["--data", "my_data/", "--set", "data.eval_data=my_data#split=validation"])
    assert one.data.path == str(tmp_path / "my_data")
    assert one.data.eval_data == f"{tmp_path / 'my_data'}#split=validation"


def test_every_flag_names_a_real_field_and_typos_fail():
    fields = {f"{s}.{k}" for s, sub in Config().to_dict().items() for k in sub}
    assert set(FLAGS.values()) <= fields
    with pytest.raises(KeyError, match="budget"):
        _parse(["--set", "budget.max_tokenz=5"])


def test_every_config_flag_comes_from_its_field_and_maps_back():
    """The flags `ray-mmbatch train` offers for config fields are exactly those config.py declares on the
    fields (field metadata "flag"), each sets its own field, and config.flag_for names it back."""
    import dataclasses

    from ray_mmbatch.commands.train import build_parser
    from ray_mmbatch.config import cli_flags, flag_for

    declared = {f.metadata["flag"]: f"{s.name}.{f.name}" for s in dataclasses.fields(Config)
                for f in dataclasses.fields(s.default_factory) if "flag" in f.metadata}
    assert FLAGS == cli_flags() == declared and len(declared) > 50
    offered = {a.option_strings[0]: a.dest for a in build_parser()._actions if a.option_strings}
    not_fields = {"-h", "--config", "--set", "--verbose"}
    assert {flag: key for flag, key in offered.items() if flag not in not_fields} == declared
    for flag, key in declared.items():
        assert flag_for(key) == flag
        section, name = key.split(".")
        default = getattr(getattr(Config(), section), name)
        kind = str(next(f.type for f in dataclasses.fields(getattr(Config(), section)) if f.name == name))
        want = (not default) if isinstance(default, bool) else True if kind.startswith("bool") else \
            "x7" if isinstance(default, str) else 7  # bool | None: a tri-state switch (None = the checkpoint's)
        assert want != default
        assert getattr(getattr(_parse([flag, str(want)]), section), name) == want, flag
    assert flag_for("model.mlp_ratio") == "--set model.mlp_ratio"   # a field without a flag
    assert _parse(["--video-sample-frames", "false"]).image.video_sample_frames is False  # not the string 'false'
    assert _parse(["--video-sample-frames", "auto"]).image.video_sample_frames is None


def test_train_help_lists_the_documented_options():
    out = subprocess.run([sys.executable, str(ROOT / "jobs" / "train.py"), "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    for flag in ("--data", "--format", "--mode", "--max-tokens", "--max-patches", "--max-images", "--window",
                 "--d-model", "--num-workers", "--use-gpu", "--max-steps", "--epochs", "--output-dir",
                 "--tokenizer", "--config"):
        assert flag in out
    assert "Token budget per batch" in out   # help text comes from the config field's docstring


SUBCOMMANDS = {"train": "train.py", "inspect": "inspect_data.py", "prepare": "prepare_data.py",
               "tune": "tune_budget.py", "report": "report.py", "verify-packing": "verify_packing.py"}


def test_one_command_line_with_the_jobs_flags():
    """`ray-mmbatch SUB --help` and `python jobs/JOB.py --help` list the same flags; the jobs are thin
    wrappers without sys.path edits (`ray job submit --working-dir .` puts the repo on PYTHONPATH)."""
    import re

    exe = Path(sys.executable).parent / "ray-mmbatch"
    top = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60, check=True).stdout
    for sub, job in SUBCOMMANDS.items():
        assert sub in top
        a = subprocess.run([str(exe), sub, "--help"], capture_output=True, text=True, timeout=120, check=True).stdout
        b = subprocess.run([sys.executable, str(ROOT / "jobs" / job), "--help"], capture_output=True, text=True,
                           timeout=120, check=True).stdout
        flags = lambda text: sorted(set(re.findall(r"(?<![\w-])--[a-z][\w-]*", text)))  # noqa: E731
        assert flags(a) == flags(b) and "--help" in flags(a), sub
        source = (ROOT / "jobs" / job).read_text()
        assert "sys.path" not in source and len(source.splitlines()) < 15
    bad = subprocess.run([str(exe), "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown command" in bad.stderr


def test_quiet_console_drops_ray_noise_and_keeps_the_rest():
    from ray_mmbatch.run.progress import progress_line
    from ray_mmbatch.run.raylogs import filter_lines

    lines = [
        "[2026-12-03 07:55:53,186 E 29506 29537] core_worker.cc:2465: Actor with class name: 'X' and ID: 'e1' "
        "has constructor arguments in the object store and max_restarts > 0.",
        "Reporting training result 1: TrainingReport(checkpoint=None, metrics={'step': 5})",
        "/x/ray/runtime_context.py:468: RayDeprecationWarning: This API is deprecated",
        "Use get_actor_id() instead",
        "  not self.actor_id.is_nil()",
        "UserWarning: your images are tiny",
        "\x1b[33m(raylet)\x1b[0m Task MapWorker(MapBatches(MaterializeStage)).submit failed. There are infinite "
        "retries remaining, so the task will be retried. Error: The actor is temporarily unavailable: IOError: "
        "The actor was restarted",
        "Failed to send resource request for train-1. ... it's safe to ignore this error.",
        "Traceback (most recent call last):", '  File "x.py", line 1, in f', "ray.exceptions.GetTimeoutError: late",
        "Traceback (most recent call last):",
    ]
    assert filter_lines(lines) == ["UserWarning: your images are tiny", "Traceback (most recent call last):"]
    m = {"step": 10, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 12345.0, "fill": 0.991, "data_wait_frac": 0.12,
         "peak_mem_mb": 2048.0}
    line = progress_line(m, 20, 30.0)
    for part in ("step 10/20", "loss 2.500", "lr 1.00e-03", "12.3k tok/s", "fill 99.1%", "data wait 12%",
                 "mem 2.0 GB", "00:30 elapsed", "eta 00:30"):
        assert part in line, (part, line)
    assert "(50.0% of data)" in progress_line({**m, "progress": 0.5}, 0, 30.0)
    assert "eval" not in line and "loss 2.500  eval 2.750  lr" in progress_line({**m, "eval_loss": 2.75}, 20, 30.0)


def test_progress_follows_the_metrics_file(tmp_path):
    import io
    import json

    from ray_mmbatch.run.progress import ProgressPrinter, format_summary

    class Tty(io.StringIO):
        def isatty(self):
            return True

    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")  # an earlier run's line: not shown
    for stream, sep in ((io.StringIO(), "\n"), (Tty(), "\r\033[K")):
        with ProgressPrinter(path, max_steps=10, stream=stream, interval=60) as p:
            with open(path, "a") as f:
                f.write(json.dumps({"step": 5, "loss": 2.0, "lr": 1e-3}) + "\n" + '{"step": 10, "lo')  # half a line
            p.poll()
            with open(path, "a") as f:
                f.write('ss": 1.5}\n')
        out = stream.getvalue()
        assert out.count(sep) == 2 and "step  5/10" in out and "step 10/10  loss 1.500" in out and "loss 9" not in out
        path.write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")
    table = format_summary({"steps": 10, "samples": 50, "skipped": {"missing_file": 2}, "skipped_total": 2,
                           "initial_loss": 9.0, "final_loss": 1.5, "checkpoint": "/x/ck"}, tmp_path)
    assert "missing_file 2" in table and str(tmp_path / "summary.json") in table and "/x/ck" in table
    assert "could not be read" not in table and "eval loss" not in table
    assert "eval loss    2.250 (held out, eval.jsonl)" in format_summary({"steps": 1, "eval_loss": 2.25}, tmp_path)
    assert "adapter" not in table
    (tmp_path / "adapter").mkdir()  # a LoRA run's export
    assert f"adapter      {tmp_path / 'adapter'}" in format_summary({"steps": 1}, tmp_path)
    summary = {"steps": 1, "skipped": {"unreadable_file": 3}, "skipped_total": 3, "skipped_files": 3}
    table = format_summary(summary, tmp_path)
    assert "3 could not be read" in table


def test_train_refuses_settings_that_do_not_go_together_in_one_line(tmp_path, capsys):
    """--qlora here (no CUDA, no --model): one line naming every reason and exit 2, as the other start-up checks
    (it was a traceback with exit 1 from inside the run)."""
    from ray_mmbatch.commands.train import main

    rc = main(["--qlora", "--data", str(tmp_path / "nowhere"), "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and "[train] error: --qlora refused" in err and "--lora-rank" in err, err
    assert "Traceback" not in err
    assert main(["--merge-lora", "--data", str(tmp_path), "--output-dir", str(tmp_path / "run")]) == 2
    assert "--merge-lora needs a LoRA run" in capsys.readouterr().err
