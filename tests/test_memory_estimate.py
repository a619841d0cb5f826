"""The memory estimate (train/memory.py, ``ray-mmbatch plan``): exact parameter counts, items that follow the
settings as their formulas say, and the command end to end."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from ray_mmbatch.config import Config
from ray_mmbatch.models import trainable as T
from ray_mmbatch.train import memory as M


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from tests.hf_checkpoints import make_qwen_checkpoint

    return str(make_qwen_checkpoint(tmp_path_factory.mktemp("qwen_ck"), "qwen2_vl"))


def _cfg(path: str = "", **model) -> Config:
    cfg = Config()
    cfg.model.path = path
    for k, v in model.items():
        setattr(cfg.model, k, v)
    return cfg


def _real(cfg):
    from ray_mmbatch.models import configure, get_backend, token_ids

    cfg = configure(cfg)
    model = get_backend(cfg).create_model(cfg, token_ids(cfg))
    T.configure_trainable(model, cfg)
    return model


@pytest.mark.parametrize("kind", ["builtin", "qwen2_vl"])
@pytest.mark.parametrize("lora", [0, 8])
def test_parameter_counts_equal_the_real_model(kind, lora, qwen):
    """Counted on the meta device = sum(p.numel()) of the model a run builds; language / vision as trainable.py
    splits them; LoRA's A and B counted as trainable only."""
    cfg = _cfg(qwen if kind == "qwen2_vl" else "", lora_rank=lora)
    spec = M.model_spec(cfg)
    model = _real(cfg)
    parts = T.part_parameters(model)
    lora_params = sum(p.numel() for part in parts.values() for n, p in part if "lora_" in n)
    assert spec.total_params == sum(p.numel() for p in model.parameters()) - lora_params
    assert spec.vision_params == sum(p.numel() for part in ("vision", "projector") for _, p in parts[part]) > 0
    assert spec.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert (lora_params > 0) == bool(lora) and (spec.trainable_params == lora_params if lora else True)


@pytest.mark.parametrize("maker", ["hf_llava_checkpoint.make_llava_checkpoint",
                                   "hf_gemma3_checkpoint.make_gemma3_checkpoint"])
def test_other_families_count_exactly(maker, tmp_path):
    """LLaVA (CLIP tower + projector) and Gemma 3 (SigLIP, tied embeddings): the same exact counts."""
    import importlib

    module, fn = maker.split(".")
    cfg = _cfg(str(getattr(importlib.import_module(f"tests.{module}"), fn)(tmp_path / "ck")))
    spec = M.model_spec(cfg)
    model = _real(cfg)
    parts = T.part_parameters(model)
    assert spec.total_params == sum(p.numel() for p in model.parameters())
    assert spec.vision_params == sum(p.numel() for part in ("vision", "projector") for _, p in parts[part]) > 0
    assert spec.vision is not None and spec.text.layers == 2 and spec.block_params > 0


def test_lora_shrinks_gradients_and_optimizer_and_fsdp_divides_by_workers(qwen):
    full = M.model_spec(_cfg(qwen))
    lora = M.model_spec(_cfg(qwen, lora_rank=8))
    st = M.Settings(tokens=2048, targets=2048)

    def item(spec, settings, name):
        return next(i.bytes for i in M.estimate(spec, settings) if i.name.startswith(name))

    for name, per_param in (("gradients", 4), ("optimizer", 8)):
        assert item(full, st, name) == full.trainable_params * per_param
        assert item(lora, st, name) == lora.trainable_params * per_param < item(full, st, name) / 10
        sharded = dataclasses.replace(st, fsdp=True, workers=4)
        assert item(full, sharded, name) == pytest.approx(item(full, st, name) / 4)
    # weights under FSDP: the shard plus the root unit and two blocks gathered
    sharded = dataclasses.replace(st, fsdp=True, workers=4)
    assert item(full, sharded, "weights") == pytest.approx(
        full.total_params * 4 / 4 + (full.root_params + 2 * full.block_params) * 4)
    assert 0 < full.block_params < full.root_params < full.total_params


def test_activations_follow_checkpointing_precision_and_budget(qwen):
    spec = M.model_spec(_cfg(qwen))
    st = M.Settings(tokens=4096, targets=4096)

    def acts(settings):
        return next(i.bytes for i in M.estimate(spec, settings) if i.name == "activations (language)")

    t = spec.text
    per_layer = M.layer_bytes_per_token(t, bf16=False, kv_repeated=True)
    assert per_layer == 16 * t.hidden + 4 * (4 * t.hidden + 2 * t.hidden + 4 * t.intermediate)
    assert acts(st) == 4096 * (t.layers * per_layer + 12 * t.hidden)
    assert acts(dataclasses.replace(st, tokens=8192)) == 2 * acts(st)
    assert acts(dataclasses.replace(st, checkpointing=True)) == 4096 * (t.layers * 4 * t.hidden + per_layer
                                                                         + 12 * t.hidden)
    assert acts(dataclasses.replace(st, bf16=True)) < acts(st)
    logits = {i.name: i.bytes for i in M.estimate(spec, dataclasses.replace(st, targets=100))}["logits chunk"]
    assert logits == 3 * 100 * spec.vocab * 4
    assert {i.name: i.bytes for i in M.estimate(spec, st)}["logits chunk"] == 3 * 1024 * spec.vocab * 4


def test_qlora_counts_its_linear_weights_in_four_bits(qwen):
    spec = M.model_spec(_cfg(qwen, lora_rank=8, qlora=True))
    lin = sum(m.weight.numel() for n, m in _real(_cfg(qwen)).named_modules()
              if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head"))
    assert spec.quantized_params == lin
    weights = M.estimate(spec, M.Settings(tokens=1024, targets=1024))[0]
    assert weights.bytes == pytest.approx((spec.total_params - lin) * 4 + lin * 0.516)


def test_plan_command_end_to_end(tmp_path, capsys):
    """The built-in model at a small budget: the table, the JSON, and a measured peak beside the estimate."""
    from ray_mmbatch import cli

    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--max-tokens", "512", "--measure", "--json", str(out), "--precision", "fp32"]) == 0
    text = capsys.readouterr().out
    for name in ("weights", "gradients", "optimizer", "activations (language)", "logits chunk", "total (estimate)",
                 "measured peak"):
        assert name in text
    report = json.loads(out.read_text())
    assert report["total_bytes"] == pytest.approx(sum(i["bytes"] for i in report["items"]))
    assert report["settings"]["tokens"] == 512 and report["measured"]["peak_bytes"] > 0
    assert report["params"]["total"] == report["params"]["language"] + report["params"]["vision"]
    # one process cannot measure FSDP's sharding: refused, not measured as if unsharded
    assert cli.main(["plan", "--max-tokens", "512", "--fsdp", "--num-workers", "2", "--measure"]) == 2


def test_the_estimate_and_measure_modules_import_no_ray():
    code = ("import sys, ray_mmbatch.train.memory, ray_mmbatch.train.peak; "
            "assert 'ray' not in sys.modules, 'imports ray'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-1500:]
