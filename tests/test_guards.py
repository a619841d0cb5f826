"""Guard rails: a run whose samples are mostly skipped stops with its reasons and the fix;
the pre-flight check names each problem in one line before any cluster work."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ray_mmbatch.config import Config
from ray_mmbatch.data.errors import SkipRecord
from ray_mmbatch.run.guards import SKIP_CHECK_MIN_SAMPLES, explain_skips, find_image_folder, skip_fraction_exceeded
from ray_mmbatch.run.preflight import PreflightError, preflight
from ray_mmbatch.synthetic.generate import generate_dataset

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def llava_images_beside(tmp_path_factory):
    """A LLaVA set whose image paths are relative to images/ next to the JSON (so the default
    --image-root, the JSON's folder, finds none of them); the text-only samples still read."""
    out = tmp_path_factory.mktemp("llava_beside")
    generate_dataset(str(out), 56, "llava", seed=3)
    index = out / "data.json"
    records = json.loads(index.read_text())
    n_images = 0
    for r in records:
        if "image" in r:
            refs = r["image"] if isinstance(r["image"], list) else [r["image"]]
            refs = [x.removeprefix("images/") for x in refs]
            r["image"] = refs if isinstance(r["image"], list) else refs[0]
            n_images += 1
    index.write_text(json.dumps(records))
    assert n_images > len(records) / 2
    return index, out / "images"


def _cfg(path, **data) -> Config:
    cfg = Config()
    cfg.data.path = str(path)
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


def test_the_rule():
    assert not skip_fraction_exceeded(SKIP_CHECK_MIN_SAMPLES - 1, SKIP_CHECK_MIN_SAMPLES - 1, 0.5)  # too few yet
    assert skip_fraction_exceeded(SKIP_CHECK_MIN_SAMPLES - 1, 40, 0.5, at_end=True)  # a small dataset, whole
    assert skip_fraction_exceeded(100, 51, 0.5) and not skip_fraction_exceeded(100, 50, 0.5)
    assert not skip_fraction_exceeded(100, 100, 1.0)  # 1 = never stop


def test_explanation_names_reasons_examples_and_the_folder(tmp_path):
    (tmp_path / "pics" / "a").mkdir(parents=True)
    for name in ("x.jpg", "y.jpg"):
        (tmp_path / "pics" / "a" / name).write_bytes(b"jpg")
    assert find_image_folder(["a/x.jpg", "a/y.jpg"], str(tmp_path)) == str(tmp_path / "pics")
    cfg = _cfg(tmp_path / "data.json", format="llava")
    text = explain_skips([SkipRecord("s1", "missing_file", "a/x.jpg"), SkipRecord("s2", "missing_file", "a/y.jpg"),
                          SkipRecord.of("s3", "corrupt_image: truncated")], 4, 0.5, cfg.data)
    assert "3 of 4 samples (75%)" in text and "missing_file: 2  e.g. s1 (a/x.jpg)" in text
    assert f"--image-root {tmp_path / 'pics'}" in text and "corrupt_image: 1" in text


def test_preflight_stops_a_llava_set_without_its_image_root(llava_images_beside):
    index, images = llava_images_beside
    with pytest.raises(PreflightError) as e:
        preflight(_cfg(index))
    msg = str(e.value)
    assert "missing_file" in msg and f"pass --image-root {images}" in msg
    seen = preflight(_cfg(index, image_root=str(images)))  # the fix works
    assert seen["format"] == "llava" and seen["skipped"] < seen["samples_checked"] / 2


@pytest.mark.parametrize("setup, expect", [
    (lambda d: _cfg(d / "nowhere"), "does not exist"),
    (lambda d: _cfg(d / "empty"), "holds no"),
    (lambda d: _cfg(d / "data.json", image_root=str(d / "nope")), "is not a folder"),
])
def test_preflight_failures_are_one_line(tmp_path, setup, expect):
    (tmp_path / "empty").mkdir()
    (tmp_path / "data.json").write_text("[]")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(PreflightError, match=expect) as e:
        preflight(setup(tmp_path))
    assert "\n" not in str(e.value)


def test_preflight_stops_on_a_file_that_does_not_read(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(PreflightError, match="does not read as parquet|unreadable_file"):
        preflight(_cfg(tmp_path / "bad.parquet"))


def test_preflight_names_a_tokenizer_that_does_not_load(tmp_path, llava_images_beside):
    index, images = llava_images_beside
    cfg = _cfg(index, image_root=str(images))
    cfg.text.tokenizer = str(tmp_path / "no_tokenizer")
    with pytest.raises(PreflightError, match="^model: tokenizer"):
        preflight(cfg)


def test_train_command_exits_nonzero_before_any_cluster_work(llava_images_beside, tmp_path):
    index, images = llava_images_beside
    r = subprocess.run([str(BIN / "ray-mmbatch"), "train", "--data", str(index), "--output-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"--image-root {images}" in r.stderr and "missing_file" in r.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.ray
@pytest.mark.slow
def test_training_stops_when_the_stream_is_mostly_skipped(ray_cluster, llava_images_beside, tmp_path):
    """No pre-flight (run_training directly): the train loop's guard stops it, the driver explains."""
    from ray_mmbatch.run.guards import TooManySkipped
    from ray_mmbatch.train.trainer import run_training

    index, images = llava_images_beside
    cfg = _cfg(index)
    cfg.budget.max_tokens, cfg.budget.window = 2048, 64
    cfg.train.output_dir, cfg.train.max_steps, cfg.train.report_every = str(tmp_path / "run"), 0, 1
    with pytest.raises(TooManySkipped, match=f"--image-root {images}"):
        run_training(cfg)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "missing_file" in summary["stopped"] and summary["checkpoint"] is None


@pytest.mark.ray
@pytest.mark.slow
def test_inspect_reads_it_all_and_warns_with_the_fix(llava_images_beside, tmp_path):
    index, images = llava_images_beside
    r = subprocess.run([str(BIN / "ray-mmbatch"), "inspect", "--data", str(index), "--json", str(tmp_path / "s.json")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["samples_read"] == 56 and summary["skipped"]["missing_file"] > 28
    assert "[inspect] warning:" in r.stderr and f"--image-root {images}" in r.stderr


def test_every_hint_names_a_real_reason_and_says_something(tmp_path):
    from ray_mmbatch import schema as S
    from ray_mmbatch.run.guards import HINTS, hint_for

    reasons = {v for k, v in vars(S).items() if k.startswith("SKIP_")}
    assert set(HINTS) <= reasons, set(HINTS) - reasons
    cfg = _cfg(tmp_path / "data.json", format="llava")
    for reason in HINTS:
        assert hint_for(reason, [("s", "a/x.jpg")], cfg.data), reason
    assert hint_for("corrupt_image", [], cfg.data) == ""  # no fix to suggest: the file itself is broken
