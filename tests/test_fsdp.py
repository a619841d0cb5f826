"""FSDP2 on two CPU processes (gloo): the math of one unsharded process, exact resume from sharded checkpoints.

One spawn runs every distributed scenario (two interpreters importing torch cost
most of the time) and leaves its findings in files; the tests below read them.
Rank 0's batches hold images where rank 1's hold none, so the ranks run different
parts of the model: the case that decides which modules may be FSDP units.
"""
from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from ray_mmbatch import models
from ray_mmbatch.batching.collate import collate_pack
from ray_mmbatch.config import Config, ImageConfig, ModelConfig, TrainConfig
from ray_mmbatch.models import backend_of, hf_common, qwen_vl
from ray_mmbatch.models.builtin import build_model
from ray_mmbatch.models.hf_common import HFModel
from ray_mmbatch.schema import IGNORE_INDEX
from ray_mmbatch.train import checkpoint as ckpt
from ray_mmbatch.train import fsdp
from ray_mmbatch.train.step import build_optimizer, optimizer_step
from tests.hf_checkpoints import QWEN_MODEL_TYPES

WORLD, VOCAB, IMAGE_ID, PAD_ID, PS = 2, 300, 5, 0, 4
MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, vision_d_model=16, vision_layers=2, vision_heads=2,
                    attention="sdpa")
IMAGE = ImageConfig(patch_size=PS, merge_size=2)
TRAIN = TrainConfig(lr=1e-3, warmup_steps=1, grad_clip=1.0, precision="fp32")   # grad norm ~2: clipping acts
STATE = {"step": 2, "consumed": ["0:a", "0:b"]}


def new_model(seed: int = 0):
    return build_model(MODEL, IMAGE, VOCAB, IMAGE_ID, PAD_ID, seed=seed)


def lora_model(seed: int = 0):
    """As a LoRA run starts: the seeded base, then the adapters (their lora_A drawn from the same stream)."""
    from ray_mmbatch.models.trainable import add_lora

    model = new_model(seed)
    add_lora(model, dataclasses.replace(MODEL, lora_rank=4, lora_alpha=8.0))
    return model


def merge_rank_dirs(tmp: Path, prefix: str, merged: Path) -> None:
    """Rank 0 copies every rank's folder into one, as Ray Train's upload merges them."""
    merged.mkdir()
    for r in range(WORLD):
        for f in sorted((tmp / f"{prefix}{r}").iterdir()):
            assert not (merged / f.name).exists(), f"rank {r} would overwrite {f.name}"
            shutil.copy(f, merged / f.name)


def sample(rng: np.random.Generator, n_text: int, n_images: int) -> dict:
    """Images first (one token per 2x2-patch image), then text; every text token after the first is a target."""
    ids = np.concatenate([np.full(n_images, IMAGE_ID), rng.integers(10, VOCAB, n_text)]).astype(np.int32)
    labels = np.full(len(ids), IGNORE_INDEX, np.int32)
    labels[n_images:-1] = ids[n_images + 1:]
    return {"sample_id": str(rng.integers(10**9)), "input_ids": ids, "labels": labels,
            "patches": rng.integers(0, 256, (4 * n_images, 3 * PS * PS), dtype=np.uint8),
            "grids": np.tile(np.array([[1, 2, 2]], np.int32), (n_images, 1))}


def step_batches() -> list[list[dict]]:
    """batches[step][rank]: rank 0 with images, rank 1 text only (steps 0 and 2), different target counts."""
    rng = np.random.default_rng(0)
    return [[collate_pack([sample(rng, 9, 1), sample(rng, 6, 2)], PAD_ID), collate_pack([sample(rng, 5, 0)], PAD_ID)],
            [collate_pack([sample(rng, 7, 1)], PAD_ID), collate_pack([sample(rng, 8, 1), sample(rng, 4, 0)], PAD_ID)],
            [collate_pack([sample(rng, 6, 1)], PAD_ID), collate_pack([sample(rng, 11, 0)], PAD_ID)]]


def _worker(rank: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=WORLD)
    try:
        _scenarios(rank, Path(tmp))
    finally:
        dist.destroy_process_group()


def _scenarios(rank: int, tmp: Path) -> None:
    batches = step_batches()
    out: dict = {"units": [type(u).__name__ for u in fsdp.shard_units(new_model())]}
    model = fsdp.shard_model(new_model(), "cpu")
    out["full_before"] = fsdp.full_state_dict(model)
    opt, sched = build_optimizer(model, TRAIN, 10)
    out["steps"] = [optimizer_step(model, [batches[s][rank]], opt, sched, TRAIN, "cpu") for s in (0, 1)]
    out["full_after"] = fsdp.full_state_dict(model)

    # each rank saves into its own directory; rank 0 then merges them as Ray Train's upload does
    fsdp.save_sharded(tmp / f"rank{rank}", model, opt, sched, STATE)
    out["lr_saved"] = sched.get_last_lr()
    if rank == 0:
        merge_rank_dirs(tmp, "rank", tmp / "merged")
    dist.barrier()
    out["continued"] = optimizer_step(model, [batches[2][rank]], opt, sched, TRAIN, "cpu")
    out["full_continued"] = fsdp.full_state_dict(model)

    fresh = fsdp.shard_model(new_model(seed=1), "cpu")          # other weights: the load must replace them
    opt2, sched2 = build_optimizer(fresh, TRAIN, 10)
    out["state"] = fsdp.load_sharded(tmp / "merged", fresh, opt2, sched2)
    out["lr_restored"] = sched2.get_last_lr()
    out["resumed"] = optimizer_step(fresh, [batches[2][rank]], opt2, sched2, TRAIN, "cpu")
    out["full_resumed"] = fsdp.full_state_dict(fresh)

    # LoRA: the sharded checkpoint holds the adapter weights only; a restart (the same seeded base, LoRA
    # injected again, then the checkpoint) continues exactly; another base is refused
    lora = fsdp.shard_model(lora_model(), "cpu")
    opt4, sched4 = build_optimizer(lora, TRAIN, 10)
    for s in (0, 1):
        optimizer_step(lora, [batches[s][rank]], opt4, sched4, TRAIN, "cpu")
    fsdp.save_sharded(tmp / f"lora{rank}", lora, opt4, sched4, STATE)
    if rank == 0:
        merge_rank_dirs(tmp, "lora", tmp / "lora_merged")
    dist.barrier()
    out["lora_continued"] = optimizer_step(lora, [batches[2][rank]], opt4, sched4, TRAIN, "cpu")
    out["lora_full_continued"] = fsdp.full_state_dict(lora)
    again = fsdp.shard_model(lora_model(), "cpu")
    opt5, sched5 = build_optimizer(again, TRAIN, 10)
    out["lora_state"] = fsdp.load_sharded(tmp / "lora_merged", again, opt5, sched5)
    out["lora_resumed"] = optimizer_step(again, [batches[2][rank]], opt5, sched5, TRAIN, "cpu")
    out["lora_full_resumed"] = fsdp.full_state_dict(again)
    try:
        fsdp.load_sharded(tmp / "lora_merged", fsdp.shard_model(lora_model(seed=1), "cpu"))
        out["lora_other_base"] = ""
    except ValueError as e:
        out["lora_other_base"] = str(e)

    bf16 = fsdp.shard_model(new_model(), "cpu", mixed_precision=torch.bfloat16)
    out["bf16_param_dtype"] = str(next(bf16.parameters()).dtype)   # the fp32 shards the optimizer sees
    opt3, sched3 = build_optimizer(bf16, TRAIN, 10)
    out["bf16_step"] = optimizer_step(bf16, [batches[0][rank]], opt3, sched3,
                                      dataclasses.replace(TRAIN, precision="bf16"), "cpu")
    torch.save(out, tmp / f"out{rank}.pt")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict, dict]:
    tmp = tmp_path_factory.mktemp("fsdp")
    mp.spawn(_worker, args=(str(tmp),), nprocs=WORLD, join=True)
    return tmp, torch.load(tmp / "out0.pt", weights_only=False), torch.load(tmp / "out1.pt", weights_only=False)


@pytest.fixture(scope="module")
def reference() -> dict:
    """The same steps in one unsharded process, each step's micro-batches = every rank's batch of that step."""
    batches = step_batches()
    model = new_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt, sched = build_optimizer(model, TRAIN, 10)
    steps = [optimizer_step(model, batches[s], opt, sched, TRAIN, "cpu") for s in (0, 1)]
    return {"before": before, "steps": steps, "after": {k: v.clone() for k, v in model.state_dict().items()}}


def assert_state_dicts(got: dict, want: dict, exact: bool) -> None:
    assert got.keys() == want.keys()
    for k in want:
        if exact:
            assert torch.equal(got[k], want[k]), k
        else:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7, msg=k)


@pytest.mark.slow   # shares one spawn of two interpreters: ~25 s on 2 cores
def test_units_are_the_blocks_every_rank_runs(run):
    _, out0, _ = run
    assert out0["units"] == ["DecoderBlock", "DecoderBlock"]       # VisionBlocks stay in the root unit


@pytest.mark.slow   # shares one spawn of two interpreters: ~25 s on 2 cores
def test_two_sharded_steps_equal_one_unsharded_process_on_the_union(run, reference):
    _, out0, out1 = run
    for got, want in zip(out0["steps"], reference["steps"]):
        assert got["n_target"] == want["n_target"]
        assert math.isclose(got["loss"], want["loss"], rel_tol=1e-5)
        assert math.isclose(got["grad_norm"], want["grad_norm"], rel_tol=1e-5)   # the full norm, not a shard's
        assert want["grad_norm"] > TRAIN.grad_clip
    assert [s["loss"] for s in out1["steps"]] == [s["loss"] for s in out0["steps"]]
    assert_state_dicts(out0["full_after"], reference["after"], exact=False)


@pytest.mark.slow   # shares one spawn of two interpreters: ~25 s on 2 cores
def test_full_state_dict_is_the_unsharded_model_on_rank_0_only(run, reference):
    _, out0, out1 = run
    assert_state_dicts(out0["full_before"], reference["before"], exact=True)
    assert all(v.device.type == "cpu" and not isinstance(v, torch.distributed.tensor.DTensor)
               for v in out0["full_before"].values())
    assert out1["full_before"] is None and out1["full_after"] is None


@pytest.mark.slow   # shares one spawn of two interpreters: ~25 s on 2 cores
def test_resume_from_merged_sharded_checkpoint_continues_exactly(run):
    tmp, out0, out1 = run
    names = sorted(p.name for p in (tmp / "merged").iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", ckpt.SCHEDULER, ckpt.STATE]
    for out in (out0, out1):
        assert out["state"] == STATE
        assert out["resumed"]["loss"] == out["continued"]["loss"]
        assert out["resumed"]["lr"] == out["continued"]["lr"]
        assert out["lr_restored"] == out["lr_saved"]
    assert_state_dicts(out0["full_resumed"], out0["full_continued"], exact=True)


@pytest.mark.slow   # shares one spawn of two interpreters: ~25 s on 2 cores
def test_lora_sharded_checkpoint_holds_the_adapter_only_and_resumes_exactly(run):
    tmp, out0, out1 = run
    index = dcp.FileSystemReader(str(tmp / "lora_merged")).read_metadata().state_dict_metadata
    model_keys = {k[len("model."):] for k in index if k.startswith("model.")}
    lora_keys = {k for k in out0["lora_full_continued"] if "lora_" in k}
    assert model_keys == lora_keys and len(model_keys) < len(out0["lora_full_continued"])
    size = {d: sum(f.stat().st_size for f in (tmp / d).glob("*.distcp")) for d in ("merged", "lora_merged")}
    assert size["lora_merged"] < size["merged"] / 4, size   # the adapters and their AdamW state (r 4 on d 32: ~1/5)
    for out in (out0, out1):
        assert out["lora_state"] == STATE                              # the weights record is not handed on
        assert out["lora_resumed"]["loss"] == out["lora_continued"]["loss"]
        assert "frozen weights this model was built with" in out["lora_other_base"]
    assert_state_dicts(out0["lora_full_resumed"], out0["lora_full_continued"], exact=True)
    assert any(v.abs().max() > 0 for k, v in out0["lora_full_resumed"].items() if "lora_B" in k)


@pytest.mark.slow   # shares one spawn of two interpreters: ~25 s on 2 cores
def test_sharded_completeness_needs_every_rank_part(run, tmp_path):
    tmp, _, _ = run
    assert ckpt.is_complete(tmp / "merged") and ckpt.is_sharded(tmp / "merged")
    assert ckpt.load_state(tmp / "merged") == STATE
    assert not ckpt.is_complete(tmp / "rank0")               # rank 1's shard is not there (yet)
    assert not ckpt.is_complete(tmp / "rank1")
    for broken, damage in (("no_state", lambda d: (d / ckpt.STATE).unlink()),
                           ("no_shard", lambda d: (d / "__1_0.distcp").unlink()),
                           ("short_shard", lambda d: (d / "__1_0.distcp").write_bytes(b"x")),
                           ("no_scheduler", lambda d: (d / ckpt.SCHEDULER).unlink())):
        d = tmp_path / broken
        shutil.copytree(tmp / "merged", d)
        damage(d)
        assert not ckpt.is_complete(d), broken
    with pytest.raises(ValueError, match="sharded"):
        ckpt.load_checkpoint(tmp / "merged", new_model())


@pytest.mark.slow   # shares one spawn of two interpreters: ~25 s on 2 cores
def test_mixed_precision_keeps_fp32_shards_and_close_loss(run):
    _, out0, out1 = run
    assert out0["bf16_param_dtype"] == "torch.float32"
    assert out0["bf16_step"]["loss"] == out1["bf16_step"]["loss"]
    assert math.isclose(out0["bf16_step"]["loss"], out0["steps"][0]["loss"], rel_tol=2e-2)


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)


class _VisionBlock(_Layer):
    pass


class _FakeHF(torch.nn.Module):
    """Shaped like a Qwen-VL ``*ForConditionalGeneration``: model.visual (blocks), model.layers."""
    _no_split_modules = ["_Layer", "_VisionBlock"]

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.visual = torch.nn.ModuleList([_VisionBlock(), _VisionBlock()])
        self.model.layers = torch.nn.ModuleList([_Layer(), _Layer(), _Layer()])


def test_hf_units_are_no_split_modules_outside_the_vision_tower():
    hf = _FakeHF()
    model = HFModel(hf, adapter=lambda b: b, vision=lambda h: [h.model.visual])
    assert hf_common.fsdp_units(model) == list(hf.model.layers)
    no_vision = HFModel(hf, adapter=lambda b: b, vision=lambda h: [])
    assert hf_common.fsdp_units(no_vision) == [*hf.model.visual, *hf.model.layers]


def test_the_backend_that_built_the_model_names_units_vision_and_prefix():
    builtin = new_model()
    assert backend_of(builtin) is models.backend_module("builtin")
    assert fsdp.shard_units(builtin) == list(builtin.decoder.blocks)     # VisionBlocks stay in the root unit
    assert backend_of(builtin).vision_modules(builtin) == [builtin.vision]
    assert backend_of(builtin).state_prefix(builtin) == ""

    hf = _FakeHF()
    model = HFModel(hf, adapter=lambda b: b, vision=qwen_vl._vision_modules, backend_name="qwen_vl")
    assert backend_of(model) is qwen_vl and backend_of(torch.nn.Module()) is None
    assert fsdp.shard_units(model) == list(hf.model.layers)
    assert qwen_vl.vision_modules(model) == [hf.model.visual]
    prefix = qwen_vl.state_prefix(model)
    assert {prefix + k for k in hf.state_dict()} == set(model.state_dict())   # what export's save_pretrained gets

    wrong = SimpleNamespace(NAME="wrong", fsdp_units=lambda m: list(m.modules())[1:],
                            vision_modules=lambda m: [m.hf_model.model.visual])
    with pytest.raises(ValueError, match="inside its vision modules"):
        fsdp.shard_units(model, backend=wrong)


@pytest.mark.parametrize("family", [*QWEN_MODEL_TYPES, "llava"])
def test_hf_backends_shard_the_decoder_layers_and_keep_the_vision_tower_in_the_root(family, tmp_path):
    from tests.hf_checkpoints import make_qwen_checkpoint
    from tests.hf_llava_checkpoint import make_llava_checkpoint

    path = make_llava_checkpoint(tmp_path) if family == "llava" else make_qwen_checkpoint(tmp_path, family)
    cfg = Config()
    cfg.model.path = str(path)
    cfg = models.configure(cfg)
    backend = models.get_backend(cfg)
    model = backend.create_model(cfg, models.token_ids(cfg))
    assert backend_of(model) is backend
    names = {id(m): n for n, m in model.named_modules()}
    assert [names[id(u)] for u in fsdp.shard_units(model)] == [f"hf_model.model.language_model.layers.{i}"
                                                              for i in range(2)]
    vision = ["hf_model.model.vision_tower", "hf_model.model.multi_modal_projector"] if family == "llava" \
        else ["hf_model.model.visual"]
    assert [names[id(m)] for m in backend.vision_modules(model)] == vision
    assert backend.state_prefix(model) == "hf_model."


def test_generic_fallback_is_the_module_list_entries():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList([torch.nn.Linear(2, 2)] * 1))
    assert fsdp.shard_units(model) == [model[1][0]]
