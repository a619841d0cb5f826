"""Checkpoints survive a full disk and a crash mid-save: the previous one stays usable."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ray_mmbatch.train import checkpoint as ckpt


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def _opt(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    sched.step()
    return opt, sched


def test_round_trip_restores_model_optimizer_and_state(tmp_path):
    m = _model(0)
    opt, sched = _opt(m)
    ckpt.save_checkpoint(tmp_path / "a", m, opt, sched, {"step": 5, "position": {"epochs": {"0": "xy"}}})
    m2 = _model(1)
    opt2, sched2 = _opt(m2)
    state = ckpt.load_checkpoint(tmp_path / "a", m2, opt2, sched2)
    assert state == {"step": 5, "position": {"epochs": {"0": "xy"}}}
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]


SAVE_WITH_FULL_DISK = textwrap.dedent("""
    import resource, signal, sys, torch
    sys.path.insert(0, {root!r})
    from ray_mmbatch.train import checkpoint as ckpt
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # writes past the limit fail with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
    torch.manual_seed(0)
    m = torch.nn.Linear(512, 512)                        # ~1 MB of weights: cannot fit
    opt = torch.optim.AdamW(m.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    try:
        ckpt.save_checkpoint({target!r}, m, opt, sched, {{"step": 9, "position": None}})
    except (OSError, RuntimeError) as e:
        print("save failed:", type(e).__name__)
        sys.exit(3)
""")


def test_storage_full_during_save_keeps_previous_checkpoint(tmp_path):
    m = _model(0)
    opt, sched = _opt(m)
    ckpt.save_checkpoint(tmp_path / "good", m, opt, sched, {"step": 4, "position": {"epochs": {"0": "a"}}})
    ckpt.write_latest(tmp_path, str(tmp_path / "good"), {"step": 4, "position": {"epochs": {"0": "a"}}})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = SAVE_WITH_FULL_DISK.format(root=root, target=str(tmp_path / "new"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stdout + r.stderr       # the save really failed for lack of space
    assert not ckpt.is_complete(tmp_path / "new")
    with pytest.raises(FileNotFoundError):
        ckpt.load_checkpoint(tmp_path / "new", _model(2))
    m2 = _model(3)
    assert ckpt.load_checkpoint(tmp_path / "good", m2)["step"] == 4
    assert ckpt.read_latest_position(tmp_path) == {"epochs": {"0": "a"}}


def test_crash_between_files_leaves_no_checkpoint_that_looks_complete(tmp_path):
    """A process killed after model.pt but before state.json: state.json is written last
    and by rename, so the directory is never taken for a checkpoint."""
    m = _model(0)
    opt, sched = _opt(m)
    ckpt.save_checkpoint(tmp_path / "prev", m, opt, sched, {"step": 2, "position": None})
    code = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
        from ray_mmbatch.train import checkpoint as ckpt
        real = ckpt._atomic_write_bytes
        def die(path, data):                      # the process dies as state.json is about to be written
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt._atomic_write_bytes = die
        m = torch.nn.Linear(8, 8); opt = torch.optim.AdamW(m.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        ckpt.save_checkpoint({str(tmp_path / 'torn')!r}, m, opt, sched, {{"step": 3}})
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == -9
    assert (tmp_path / "torn" / "model.pt").exists()
    assert not ckpt.is_complete(tmp_path / "torn")
    assert ckpt.load_checkpoint(tmp_path / "prev", _model(1))["step"] == 2


def test_read_latest_position_prefers_the_checkpoint_ray_restores(tmp_path):
    m = _model(0)
    opt, sched = _opt(m)
    run = tmp_path / "storage" / "run"
    ckpt.save_checkpoint(run / "checkpoint_b", m, opt, sched, {"step": 8, "position": {"epochs": {"0": "s1s2"}}})
    (run / "checkpoint_manager_snapshot.json").write_text(json.dumps(
        {"latest_checkpoint_result": {"checkpoint_dir_name": "checkpoint_b"}}))
    ckpt.write_latest(tmp_path, "older", {"step": 4, "position": {"epochs": {"0": "s1"}}})
    assert ckpt.read_latest_position(tmp_path, run) == {"epochs": {"0": "s1s2"}}
    assert ckpt.read_latest_position(tmp_path, tmp_path / "nowhere") == {"epochs": {"0": "s1"}}
    assert ckpt.read_latest_position(tmp_path / "empty") is None


# ---------------------------------------------------------------- frozen parameters (LoRA, --freeze)
def _trainable_run(lora: bool, seed: int = 0):
    """What train_loop_per_worker does at start: seed, build, configure_trainable, optimizer."""
    import dataclasses

    from ray_mmbatch.config import Config, ImageConfig, ModelConfig, TrainConfig
    from ray_mmbatch.models.builtin import build_model
    from ray_mmbatch.models.trainable import configure_trainable
    from ray_mmbatch.train.step import build_optimizer

    cfg = Config()
    cfg.model = ModelConfig(d_model=64, n_layers=2, n_heads=2, vision_d_model=32, vision_layers=1, vision_heads=2,
                            attention="sdpa")
    cfg.model = dataclasses.replace(cfg.model, lora_rank=4, lora_alpha=8.0) if lora else \
        dataclasses.replace(cfg.model, freeze="vision,projector")
    cfg.image = ImageConfig(patch_size=4, merge_size=2)
    cfg.train = TrainConfig(lr=1e-2, warmup_steps=0, grad_clip=1.0, precision="fp32", seed=seed)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cfg.image, 300, 5, 0)
    configure_trainable(model, cfg)
    opt, sched = build_optimizer(model, cfg.train, 10)
    return model, opt, sched, cfg


def _batches() -> list[dict]:
    import numpy as np

    from ray_mmbatch.batching.collate import collate_pack

    rng = np.random.default_rng(0)

    def sample(n_text: int, n_images: int) -> dict:
        ids = np.concatenate([np.full(n_images, 5), rng.integers(10, 300, n_text)]).astype(np.int32)
        labels = np.full(len(ids), -100, np.int32)
        labels[n_images:-1] = ids[n_images + 1:]
        return {"sample_id": str(rng.integers(10**9)), "input_ids": ids, "labels": labels,
                "patches": rng.integers(0, 256, (4 * n_images, 48), dtype=np.uint8),
                "grids": np.tile(np.array([[1, 2, 2]], np.int32), (n_images, 1))}

    return [collate_pack([sample(9, 1), sample(6, 2)], 0), collate_pack([sample(7, 1), sample(5, 0)], 0),
            collate_pack([sample(8, 2)], 0)]


def _step(model, opt, sched, cfg, batch) -> None:
    from ray_mmbatch.train.step import optimizer_step

    optimizer_step(model, [batch], opt, sched, cfg.train, "cpu")


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "freeze_vision"])
def test_frozen_parameters_are_left_out_and_a_restart_resumes_exactly(tmp_path, lora):
    """A LoRA run's checkpoint is the adapter weights (+ buffers); restarting as train_loop_per_worker does
    (same seed, same LoRA settings, then the checkpoint) gives bit-identical weights and logits."""
    batches = _batches()
    model, opt, sched, cfg = _trainable_run(lora)
    for b in batches[:2]:
        _step(model, opt, sched, cfg, b)
    ckpt.save_checkpoint(tmp_path / "c", model, opt, sched, {"step": 2, "position": None})
    _step(model, opt, sched, cfg, batches[2])                  # the uninterrupted run goes on

    saved = torch.load(tmp_path / "c" / ckpt.MODEL, weights_only=True)
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(saved) == trains                                # the built-in model has no buffers
    if lora:
        assert all("lora_" in k for k in saved)
        assert any(v.abs().max() > 0 for k, v in saved.items() if "lora_B" in k)   # it trained
    else:
        assert not any(k.startswith("vision.") for k in saved) and any(k.startswith("decoder.") for k in saved)
    full = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    size = (tmp_path / "c" / ckpt.MODEL).stat().st_size
    if lora:
        assert size < full / 10, (size, full)
    state = json.loads((tmp_path / "c" / ckpt.STATE).read_text())
    assert state[ckpt.WEIGHTS]["keys"] == len(saved) and state[ckpt.WEIGHTS]["frozen"]["elements"] > 0

    again, opt2, sched2, _ = _trainable_run(lora)              # the restart after a crash
    assert ckpt.load_checkpoint(tmp_path / "c", again, opt2, sched2) == {"step": 2, "position": None}
    _step(again, opt2, sched2, cfg, batches[2])
    for (n, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), n
    model.eval(), again.eval()
    with torch.no_grad():
        assert torch.equal(model(batches[0]), again(batches[0]))


def test_restore_refuses_other_keys_or_another_base(tmp_path):
    model, opt, sched, cfg = _trainable_run(lora=True)
    _step(model, opt, sched, cfg, _batches()[0])
    ckpt.save_checkpoint(tmp_path / "c", model, opt, sched, {"step": 1})
    other_seed, *_ = _trainable_run(lora=True, seed=1)          # the base drawn from another --seed
    with pytest.raises(ValueError, match="frozen weights this model was built with"):
        ckpt.load_checkpoint(tmp_path / "c", other_seed)
    frozen_only, *_ = _trainable_run(lora=False)               # other settings: other trained keys
    with pytest.raises(ValueError, match=r"missing \d+ .*unexpected \d+ .*--lora-rank"):
        ckpt.load_checkpoint(tmp_path / "c", frozen_only)
    full = torch.nn.Sequential(torch.nn.Linear(4, 4))          # a full checkpoint still loads with frozen parts
    ckpt.save_checkpoint(tmp_path / "full", full, *_opt_for(full), {"step": 1})
    assert set(torch.load(tmp_path / "full" / ckpt.MODEL, weights_only=True)) == {"0.weight", "0.bias"}
    assert ckpt.WEIGHTS not in json.loads((tmp_path / "full" / ckpt.STATE).read_text())
    frozen = torch.nn.Sequential(torch.nn.Linear(4, 4))
    frozen[0].bias.requires_grad_(False)
    ckpt.load_checkpoint(tmp_path / "full", frozen)
    assert torch.equal(frozen[0].weight, full[0].weight) and torch.equal(frozen[0].bias, full[0].bias)


def _opt_for(model):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def test_buffers_are_kept_with_the_trainable_weights(tmp_path):
    """Buffers may be running state training moves (BatchNorm): saved beside the trainable weights."""
    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
        m[0].requires_grad_(False)
        return m

    m = build()
    opt, sched = _opt_for(m)
    m(torch.randn(16, 8)).sum().backward()
    opt.step()
    ckpt.save_checkpoint(tmp_path / "c", m, opt, sched, {"step": 1})
    assert set(torch.load(tmp_path / "c" / ckpt.MODEL, weights_only=True)) == {
        "1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked", "2.weight", "2.bias"}
    m2 = build()
    ckpt.load_checkpoint(tmp_path / "c", m2, *_opt_for(m2))
    for (n, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), n
    assert m2[1].num_batches_tracked == 1
