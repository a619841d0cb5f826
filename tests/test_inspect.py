"""The data check over a LLaVA dataset with every kind of bad sample: counts add up, every
bad sample is reported with its reason, and materialize matches measure for every good one."""
from __future__ import annotations

import pytest

from ray_mmbatch.config import Config
from ray_mmbatch.synthetic.generate import generate_dataset

pytestmark = pytest.mark.ray


def test_inspect_llava_with_bad_samples(ray_cluster, tmp_path):
    from ray_mmbatch.dataflow.inspection import inspect_dataset

    manifest = generate_dataset(str(tmp_path / "llava"), 120, "llava", seed=5, shard_size=40, bad_per_kind=1)
    assert len({r for r in manifest["bad"].values()}) >= 10
    cfg = Config()
    cfg.data.path, cfg.data.format = str(tmp_path / "llava"), "llava"
    s = inspect_dataset(cfg)
    assert s["samples_read"] == len(manifest["ids"])
    assert s["samples_ok"] + s["samples_skipped"] == s["samples_read"]
    assert s["length_mismatch"] == 0
    expected: dict[str, int] = {}
    for sid, reason in manifest["bad"].items():
        if sid not in manifest["bad_conditions"]:   # too_many_images is valid without an image budget
            expected[reason] = expected.get(reason, 0) + 1
    assert s["skipped"] == expected
    for reason, ids in s["skipped_examples"].items():
        assert all(manifest["bad"][i] == reason for i in ids)
    assert s["samples_ok"] == len(manifest["ids"]) - sum(expected.values())
    assert s["tokens"]["max"] >= s["tokens"]["p50"] > 0
    assert s["image_tokens"]["max"] > 0 and s["patches"]["max"] > 0
    assert set(s["images_per_sample"]) >= {"0", "1"}
    assert s["samples_per_s"] > 0


def test_inspect_headers_only_finds_all_but_pixel_damage(ray_cluster, tmp_path):
    """--decode off (the default above 50,000 samples) reads image headers only: the same counts, except that
    images whose pixel data is cut short (header fine) are found only when decoding."""
    from ray_mmbatch.dataflow.inspection import inspect_dataset
    from ray_mmbatch.schema import SKIP_CORRUPT_IMAGE

    manifest = generate_dataset(str(tmp_path / "llava"), 60, "llava", seed=6, shard_size=30, bad_per_kind=1)
    cfg = Config()
    cfg.data.path, cfg.data.format = str(tmp_path / "llava"), "llava"
    on, off = inspect_dataset(cfg, "on"), inspect_dataset(cfg, "off")
    assert (on["pixels_decoded"], off["pixels_decoded"]) == (True, False)
    assert inspect_dataset(cfg)["pixels_decoded"]  # auto: a small set is decoded
    corrupt = on["skipped"].pop(SKIP_CORRUPT_IMAGE)
    assert corrupt == sum(1 for r in manifest["bad"].values() if r == SKIP_CORRUPT_IMAGE) > 0
    assert SKIP_CORRUPT_IMAGE not in off["skipped"] and off["skipped"] == on["skipped"]
    assert off["samples_ok"] == on["samples_ok"] + corrupt and off["tokens"]["sum"] >= on["tokens"]["sum"]


# Ray 2.60's warning (actor_pool_map_operator.py) on a dataset of one block and a pool of min size 2
RAY_MIN_ACTORS_WARNING = ("The minimum number of concurrent actors for 'MapBatches(read_with_position)->Project->"
                          "MapBatches(InspectStage)' is set to 2, but the operator only received 1 input(s). This "
                          "means that the operator can launch at most 1 task(s), and won't fully utilize the "
                          "available concurrency.")


def test_inspect_command_shows_progress_and_no_ray_scheduling_warning(ray_cluster, tmp_path, capsys, recwarn,
                                                                     monkeypatch):
    """The real command on one row group (one block for a pool of 2 actors: Ray warns): progress lines with
    done / total on stderr, the JSON summary alone on stdout, Ray's scheduling UserWarning nowhere."""
    import json
    import re

    from ray_mmbatch.commands import inspect_data
    from ray_mmbatch.run import raylogs

    monkeypatch.setattr(raylogs, "_filter_stderr", lambda: None)  # keep pytest's fd 2 (the command pipes it)
    monkeypatch.setattr(raylogs, "_state", dict(raylogs._state))
    monkeypatch.setenv("RAY_MMBATCH_QUIET", "1")
    assert re.match(raylogs.RAY_USER_WARNINGS[0], RAY_MIN_ACTORS_WARNING)  # the filter still names Ray's text
    forwarded = [f"/x/actor_pool_map_operator.py:551: UserWarning: {RAY_MIN_ACTORS_WARNING}", "  warnings.warn(",
                 "/x/mine.py:3: UserWarning: your own"]
    assert raylogs.filter_lines(forwarded) == forwarded[2:]
    generate_dataset(str(tmp_path / "d"), 40, "parquet", seed=3, shard_size=40, workers=1)
    rc = inspect_data.main(["--data", str(tmp_path / "d" / "train-00000-of-00001.parquet"),
                            "--progress-every", "0.5"])
    out = capsys.readouterr()
    assert rc == 0
    assert json.loads(out.out)["samples_read"] == 40
    assert re.search(r"^\[inspect\] 40/40 samples \(100\.0%\)  [\d.]+ samples/s  \d\d:\d\d elapsed, eta 00:00$",
                     out.err, re.M), out.err
    assert "concurrent actors" not in out.err + out.out
    assert not [w for w in recwarn.list if "concurrent actors" in str(w.message)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two families whose costs differ from the built-in model's: a Qwen2-VL with a 64-token pixel cap and a
    LLaVA-1.5 (one fixed square, its own chat template)."""
    from tests.hf_checkpoints import make_qwen_checkpoint
    from tests.hf_llava_checkpoint import make_llava_checkpoint

    root = tmp_path_factory.mktemp("inspect_ckpts")
    return {"qwen2_vl": make_qwen_checkpoint(root / "qwen2_vl", "qwen2_vl"),
            "llava": make_llava_checkpoint(root / "llava")}


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_inspect_measures_with_the_model_that_train_plans_with(ray_cluster, tmp_path, capsys, monkeypatch,
                                                               checkpoints, family):
    """``inspect --model CKPT`` (and ``--set model.path=CKPT``) gives the per-sample figures the training path
    plans for that checkpoint (local_batches: the same configure, measure and plan as a Ray run), not the
    built-in model's; it names the model and ends with suggested budgets that hold every sample."""
    import json

    from ray_mmbatch import local_batches
    from ray_mmbatch.commands import inspect_data
    from ray_mmbatch.run import raylogs

    monkeypatch.setattr(raylogs, "_filter_stderr", lambda: None)
    monkeypatch.setattr(raylogs, "_state", dict(raylogs._state))
    monkeypatch.setenv("RAY_MMBATCH_QUIET", "1")
    generate_dataset(str(tmp_path / "d"), 40, "llava", seed=7, shard_size=40)
    ckpt = str(checkpoints[family])
    data = ["--data", str(tmp_path / "d"), "--max-tokens", "100000", "--decode", "off"]
    reports = {}
    for name, flags in (("builtin", []), ("model", ["--model", ckpt]), ("set", ["--set", f"model.path={ckpt}"])):
        assert inspect_data.main(data + flags + ["--json", str(tmp_path / f"{name}.json")]) == 0
        reports[name] = json.loads((tmp_path / f"{name}.json").read_text())
    err = capsys.readouterr().err
    cfg = Config()
    cfg.data.path, cfg.model.path, cfg.budget.max_tokens = str(tmp_path / "d"), ckpt, 100000
    planned = {}
    for b in local_batches(cfg):
        planned.update(zip(b["sample_ids"], (int(n) for n in b["seq_lens"])))
    model, builtin = reports["model"], reports["builtin"]
    assert reports["set"]["tokens"] == model["tokens"] and reports["set"]["model"] == model["model"]
    assert model["model"]["model_type"] == family and builtin["model"]["backend"] == "builtin"
    assert model["samples_ok"] == len(planned) == 40
    assert model["tokens"]["sum"] == sum(planned.values()) != builtin["tokens"]["sum"]
    assert (model["tokens"]["min"], model["tokens"]["max"]) == (min(planned.values()), max(planned.values()))
    fits = model["suggested_budgets"]["max_tokens"][0]
    assert fits["why"] == "fits_all" and fits["oversize"] == 0 and fits["value"] >= max(planned.values())
    assert fits["value"] - 1024 < max(planned.values())  # the smallest multiple of 1,024 that holds them all
    assert f"[inspect] suggested: --max-tokens {fits['value']} (0 of 40 samples oversize)" in err


def test_suggested_budgets_count_what_each_value_leaves_oversize():
    """The candidates by the planner's own oversize rule: tokens (with the attention term) and frames."""
    import numpy as np

    from ray_mmbatch.batching.suggest import format_suggestions, suggest_budgets
    from ray_mmbatch.config import BudgetConfig

    tokens = np.array([100] * 98 + [3000, 9000])
    frames = np.array([0] * 90 + [16] * 9 + [70])
    got = suggest_budgets(tokens, frames, BudgetConfig(max_tokens=2048, max_frames=32))
    assert got["max_tokens"] == [{"value": 9216, "oversize": 0, "why": "fits_all"},
                                 {"value": 3072, "oversize": 1, "why": "p99"},
                                 {"value": 2048, "oversize": 2, "why": "current"}]
    assert got["max_frames"] == [{"value": 72, "oversize": 0, "why": "fits_all"},
                                 {"value": 24, "oversize": 1, "why": "p99"},
                                 {"value": 32, "oversize": 1, "why": "current"}]
    assert "max_frames" not in suggest_budgets(tokens, None, BudgetConfig())
    weighted = suggest_budgets(tokens, None, BudgetConfig(max_tokens=2048, attn_weight=0.001))["max_tokens"]
    assert weighted[0]["value"] == 90112 and weighted[0]["oversize"] == 0  # 9000 + 0.001 * 9000**2 = 90,000
    assert format_suggestions(got, 100).splitlines()[0] == \
        "--max-tokens 9216 (0 of 100 samples oversize); at p99 3072: 1 oversize; now 2048: 2 oversize"
