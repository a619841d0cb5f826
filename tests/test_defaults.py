"""Settings left to the mode (run/defaults.py) and the run's plan (run/plan.py): the demo keeps its own, a
``--model`` checkpoint gets a fine-tune's, anything the user sets wins; the first lines of a run and
summary.json state the plan. No Ray cluster: the one run here stops before training."""
from __future__ import annotations

import argparse
import json
import math
from types import SimpleNamespace

import pytest
import yaml

from ray_mmbatch.cli import add_config_flags, config_from_args
from ray_mmbatch.config import Config, apply_overrides, flatten
from ray_mmbatch.run.defaults import DEMO, FULL, LORA, checkpoint_name, mode, resolve_defaults
from ray_mmbatch.run.plan import make_plan, plan_lines

MODE_FIELDS = ("lr", "max_steps", "epochs", "warmup_steps", "warmup_ratio", "checkpoint_every", "output_dir")


def _parse(argv):
    p = argparse.ArgumentParser()
    add_config_flags(p)
    return config_from_args(p.parse_args(argv))


def _train(cfg):
    return {k: getattr(cfg.train, k) for k in MODE_FIELDS}


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ckpts" / "Qwen2-VL-2B-Instruct"
    d.mkdir(parents=True)
    return d


def test_the_demo_keeps_its_settings():
    cfg = _parse([])
    assert _train(cfg) == {"lr": 3e-3, "max_steps": 60, "epochs": 1, "warmup_steps": 10, "warmup_ratio": 0.0,
                           "checkpoint_every": 20, "output_dir": "runs/demo"}
    assert mode(cfg) == DEMO and set(cfg.train.defaults_from) == set(MODE_FIELDS)
    assert _train(resolve_defaults(Config())) == _train(cfg)  # a Config() built in Python: the same


def test_a_checkpoint_gets_a_fine_tunes_settings_with_their_sources(ckpt):
    full = _parse(["--model", str(ckpt)])
    assert mode(full) == FULL
    assert _train(full) == {"lr": 1e-5, "max_steps": 0, "epochs": 3, "warmup_steps": 0, "warmup_ratio": 0.1,
                            "checkpoint_every": 0.25, "output_dir": "runs/Qwen2-VL-2B-Instruct"}
    src = full.train.defaults_from
    assert "qwen2_5vl_full_sft.yaml" in src["lr"] and "TRL" in src["lr"] and "warmup_ratio 0.1" in src["warmup_ratio"]
    assert "num_train_epochs 3.0" in src["epochs"] and "named after the checkpoint" in src["output_dir"]

    lora = _parse(["--model", str(ckpt), "--lora-rank", "8"])
    assert mode(lora) == LORA and lora.train.lr == 1e-4 and "qwen2_5vl_lora_sft.yaml" in lora.train.defaults_from["lr"]
    assert _train(lora) == {**_train(full), "lr": 1e-4}
    qlora = Config()
    qlora.model.path, qlora.model.qlora = str(ckpt), True
    assert mode(qlora) == LORA and resolve_defaults(qlora).train.lr == 1e-4
    same = _parse(["--set", f"model.path={ckpt}"])  # --set model.path is --model
    assert _train(same) == _train(full)


def test_a_value_the_user_sets_wins_flag_set_and_config_file(ckpt, tmp_path):
    # the demo's own values, given explicitly with a checkpoint, stay (None, not the value, means "left")
    cfg = _parse(["--model", str(ckpt), "--lr", "0.003", "--max-steps", "60", "--checkpoint-every", "20",
                  "--output-dir", "runs/demo"])
    assert (cfg.train.lr, cfg.train.max_steps, cfg.train.checkpoint_every, cfg.train.output_dir) == \
        (3e-3, 60, 20, "runs/demo")
    assert not {"lr", "max_steps", "checkpoint_every", "output_dir"} & set(cfg.train.defaults_from)
    assert cfg.train.epochs == 3 and cfg.train.warmup_ratio == 0.1  # the rest still the fine-tune's

    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"train": {"lr": 2e-5, "epochs": 1, "output_dir": "out/x"}}))
    cfg = _parse(["--config", str(tmp_path / "run.yaml"), "--model", str(ckpt)])
    assert (cfg.train.lr, cfg.train.epochs, cfg.train.output_dir, cfg.train.max_steps) == (2e-5, 1, "out/x", 0)
    assert _parse(["--config", str(tmp_path / "run.yaml"), "--model", str(ckpt), "--lr", "5e-6"]).train.lr == 5e-6

    # warm-up: the user's steps turn the mode's ratio off, the user's ratio turns the demo's steps off (HF's rule)
    steps = _parse(["--model", str(ckpt), "--set", "train.warmup_steps=50"]).train
    assert (steps.warmup_steps, steps.warmup_ratio) == (50, 0.0)
    ratio = _parse(["--set", "train.warmup_ratio=0.05"]).train
    assert (ratio.warmup_steps, ratio.warmup_ratio) == (0, 0.05)
    assert _parse(["--model", str(ckpt), "--lr", "auto"]).train.lr == 1e-5  # 'auto' leaves it to the mode


def test_the_output_folder_is_named_after_the_checkpoint(ckpt):
    assert _parse(["--model", f"{ckpt}/"]).train.output_dir == "runs/Qwen2-VL-2B-Instruct"
    assert checkpoint_name("s3://bucket/models/llava-1.5-7b-hf/") == "llava-1.5-7b-hf"
    assert checkpoint_name("C:\\ckpts\\gemma-3-4b-it") == "gemma-3-4b-it"


def test_resolved_settings_survive_the_workers_rebuild_and_a_second_resolve(ckpt):
    cfg = _parse(["--model", str(ckpt), "--lora-rank", "4"])
    again = apply_overrides(Config(), flatten(cfg.to_dict()))  # as train/loop.py rebuilds it on a worker
    assert _train(again) == _train(cfg) and again.train.defaults_from == cfg.train.defaults_from
    assert _train(resolve_defaults(again)) == _train(cfg)


def test_warm_up_by_ratio_of_steps_and_of_samples():
    torch = pytest.importorskip("torch")
    from ray_mmbatch.config import TrainConfig
    from ray_mmbatch.train.step import Progress, build_optimizer, lr_by_progress

    # by epochs: the first 10 % of the samples warm up from 0, the cosine spans the other 90 %
    assert lr_by_progress(0, 0, 0.0, warmup_share=0.1) == 0.0
    assert lr_by_progress(5, 0, 0.05, warmup_share=0.1) == pytest.approx(0.5)
    assert lr_by_progress(9, 0, 0.1, warmup_share=0.1) == pytest.approx(1.0)
    assert lr_by_progress(50, 0, 0.55, warmup_share=0.1) == pytest.approx(0.55)  # half-way down to the 0.1 floor
    assert lr_by_progress(99, 0, 1.0, warmup_share=0.1) == pytest.approx(0.1)
    assert lr_by_progress(3, 4, 0.5, warmup_share=0.1) == 1.0  # warmup_steps wins

    model = torch.nn.Linear(2, 2)
    progress = Progress()
    opt, sched = build_optimizer(model, TrainConfig(lr=1e-5, warmup_steps=0, warmup_ratio=0.1), 1000, progress)
    seen = []
    for value in (0.02, 0.1, 1.0):
        progress.value = value
        opt.step()
        sched.step()
        seen.append(opt.param_groups[0]["lr"])
    assert seen == pytest.approx([2e-6, 1e-5, 1e-6])
    # by steps: 10 % of max_steps 25 is 3 warm-up steps (rounded up)
    opt, sched = build_optimizer(model, TrainConfig(lr=1e-5, warmup_steps=0, warmup_ratio=0.1), 25)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([1e-5 / 3, 2e-5 / 3, 1e-5, 1e-5])


def _runner(checkpoint_every, max_steps=0, planned=100):
    from ray_mmbatch.train.loop import Runner

    cfg = Config()
    cfg.train.checkpoint_every, cfg.train.max_steps = checkpoint_every, max_steps
    r = SimpleNamespace(cfg=cfg, step=0, samples_seen=0, planned_samples=planned)
    r._share_mark = lambda: Runner._share_mark(r)
    r.checkpoint_mark = r._share_mark()
    return r, lambda: Runner._checkpoint_due(r)


def test_checkpoints_at_each_share_of_the_run_short_of_the_end():
    # by epochs: the samples seen over those planned; 8 samples a step, 100 planned -> 13 steps
    r, due = _runner(0.25)
    at = []
    while r.samples_seen < 100:
        r.step, r.samples_seen = r.step + 1, min(100, r.samples_seen + 8)
        if due():
            at.append(r.samples_seen)
    assert at == [32, 56, 80]  # past 25 %, 50 %, 75 %; the end checkpoints anyway (train/loop.py)
    r, due = _runner(0.25, max_steps=10)  # by steps
    assert [s for s in range(1, 11) if (setattr(r, "step", s) or due())] == [3, 5, 8]
    r, due = _runner(20)
    assert [s for s in range(1, 61) if (setattr(r, "step", s) or due())] == [20, 40, 60]
    r, due = _runner(0)
    assert not any(setattr(r, "step", s) or due() for s in range(1, 61))


def test_the_plan_states_samples_steps_lr_and_tokens(ckpt):
    cfg = _parse(["--model", str(ckpt), "--max-tokens", "2048", "--grad-accum", "2", "--num-workers", "2"])
    plan = make_plan(cfg, 1000, 400.0, sampled=64)
    # 2048 / 400 = 5.12 samples a batch, x 2 micro-batches x 2 ranks = 20.48 samples a step
    assert plan["steps_per_epoch_estimate"] == math.ceil(1000 / 20.48) == 49
    assert plan["tokens_per_step"] == 2048 * 2 * 2 and plan["epochs"] == 3 and plan["max_steps"] == 0
    assert plan["lr"] == 1e-5 and plan["lr_end"] == pytest.approx(1e-6) and plan["warmup_ratio"] == 0.1
    assert plan["checkpoints"] == "every 25% of the run and at the end"
    assert plan["output_dir"] == "runs/Qwen2-VL-2B-Instruct" and "qwen2_5vl_full_sft" in plan["defaults_from"]["lr"]
    text = "\n".join(plan_lines(plan, cfg))
    for part in ("1,000 samples per epoch", "3 epochs", "about 49 optimizer steps per epoch (147 in 3)",
                 "an estimate", "mean of the first 64 samples read", "learning rate 1e-05", "first 10% of the samples",
                 "cosine decay to 1e-06",
                 "8,192 tokens per optimizer step", "--max-tokens 2048 x --grad-accum 2 x --num-workers 2"):
        assert part in text, (part, text)
    json.dumps(plan)  # summary.json holds it

    mine = _parse(["--model", str(ckpt), "--lr", "3e-5", "--max-steps", "40"])
    plan = make_plan(mine, 1000, None)
    assert plan["steps_per_epoch_estimate"] is None and plan["warmup_steps"] == 4
    text = "\n".join(plan_lines(plan, mine))
    assert "learning rate 3e-05 (set by you)" in text and "warm-up over 4 steps" in text and "at step 40" in text
    assert "40 optimizer steps" in text and "an estimate" not in text


def test_plan_counts_the_samples_up_front_less_the_held_out_share(tmp_path):
    from ray_mmbatch.synthetic.generate import generate_dataset
    from ray_mmbatch.train.trainer import run_plan

    generate_dataset(str(tmp_path / "d"), 40, "parquet", seed=1, shard_size=20, workers=1)
    cfg = _parse(["--data", str(tmp_path / "d")])
    assert run_plan(cfg)["samples_per_epoch"] == 40
    assert run_plan(_parse(["--data", str(tmp_path / "d"), "--eval-split", "0.25"]))["samples_per_epoch"] == 30
    assert run_plan(_parse(["--data", str(tmp_path / "nowhere")]))["samples_per_epoch"] is None


def test_train_with_a_checkpoint_states_its_plan_first(tmp_path, monkeypatch, capsys):
    """``train --model CKPT`` as the README has it: the plan's lines come before training, with the fine-tune's
    settings, the output folder is named after the checkpoint, and run_training gets the plan for summary.json
    (run_training itself is stubbed: no Ray here; test_train.py checks summary.json's plan of a real run)."""
    pytest.importorskip("transformers")
    from ray_mmbatch.commands.train import main
    from ray_mmbatch.synthetic.generate import generate_dataset
    from tests.hf_checkpoints import make_qwen_checkpoint

    ck = make_qwen_checkpoint(tmp_path / "my-qwen", "qwen2_vl")
    generate_dataset(str(tmp_path / "d"), 24, "parquet", seed=2, shard_size=24, workers=1)
    got = {}

    def run_training(cfg, plan=None):
        got.update(cfg=cfg, plan=plan)
        return {"steps": 0}

    monkeypatch.setattr("ray_mmbatch.train.trainer.run_training", run_training)
    monkeypatch.chdir(tmp_path)
    assert main(["--model", str(ck), "--data", str(tmp_path / "d"), "--max-tokens", "1024"]) == 0
    out = capsys.readouterr().out
    plan, cfg = got["plan"], got["cfg"]
    assert cfg.train.output_dir == "runs/my-qwen" and cfg.train.lr == 1e-5 and cfg.train.epochs == 3
    assert plan["samples_per_epoch"] == 24 and plan["mode"] == FULL and plan["tokens_per_sample_estimate"] > 0
    first = out.index("[train] plan (full fine-tune): 24 samples per epoch (counted up front) x 3 epochs")
    assert first < out.index("[train] training -> " + str(tmp_path / "runs" / "my-qwen"))
    assert f"about {plan['steps_per_epoch_estimate']} optimizer steps per epoch" in out
    assert plan["tokens_per_sample_from"] == 24 and "mean of the first 24 samples read" in out
    assert "learning rate 1e-05" in out and "1,024 tokens per optimizer step" in out


def test_a_saved_config_leaves_the_modes_settings_to_the_run_that_loads_it(ckpt, tmp_path):
    """tune's best.yaml (save_config) of a demo run, then `train --config best.yaml --model CKPT`: the fine-tune's
    settings, not the demo's 3e-3 / 60 steps as if the user had set them; what the user set stays set."""
    from ray_mmbatch.config import save_config

    demo = _parse(["--max-tokens", "8192", "--epochs", "2"])
    save_config(demo, tmp_path / "best.yaml")
    saved = yaml.safe_load((tmp_path / "best.yaml").read_text())["train"]
    assert saved["lr"] is None and saved["output_dir"] == "" and saved["epochs"] == 2 and "defaults_from" not in saved
    cfg = _parse(["--config", str(tmp_path / "best.yaml"), "--model", str(ckpt)])
    assert (cfg.train.lr, cfg.train.max_steps, cfg.train.epochs, cfg.budget.max_tokens) == (1e-5, 0, 2, 8192)
    assert cfg.train.output_dir == "runs/Qwen2-VL-2B-Instruct"


def test_help_and_the_flags_page_state_each_modes_default():
    """A setting left to the mode shows its values per mode in --help and on the flags page, never 'None'."""
    from ray_mmbatch.commands import train
    from ray_mmbatch.flagdoc import config_rows
    from ray_mmbatch.run.defaults import by_mode

    assert by_mode("train.lr") == "auto: demo 0.003, full fine-tune 1e-05, LoRA fine-tune 0.0001"
    assert by_mode("train.epochs") == "auto: demo 1, fine-tune 3"
    assert by_mode("budget.max_tokens") is None and by_mode("train.seed") is None
    help_text = " ".join(train.build_parser().format_help().split())
    assert "(default: auto: demo 0.003, full fine-tune 1e-05, LoRA fine-tune 0.0001)" in help_text
    assert "(default: None)" not in help_text.split("--max-steps")[1].split("--epochs")[0]
    rows = {key: default for _, key, default, _ in config_rows()["train"]}
    assert rows["train.lr"] == f"`{by_mode('train.lr')}`" and rows["train.output_dir"].startswith("`auto: runs/demo")
