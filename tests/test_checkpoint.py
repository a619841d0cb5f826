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
