"""What trains (models/trainable.py, issue 27): --freeze parts on the built-in model and a real HF
Qwen2-VL, counts per setting, frozen weights bit-identical after optimizer steps; LoRA through peft:
only adapter weights train, the exported adapter reloads with PeftModel and, merged, gives the
trained model's logits; the merge in place too."""
from __future__ import annotations

import pytest
import torch

from ray_mmbatch import local_batches
from ray_mmbatch.config import Config
from ray_mmbatch.models import configure, get_backend, token_ids
from ray_mmbatch.models import trainable as T
from ray_mmbatch.synthetic.generate import generate_dataset


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("trainable_data")
    generate_dataset(str(d), 24, "parquet", seed=3, workers=1)
    return str(d)


def _cfg(data: str, model_path: str = "", **model) -> Config:
    cfg = Config()
    cfg.data.path, cfg.data.format = data, "parquet"
    cfg.budget.max_tokens, cfg.budget.window = 1024, 24
    cfg.model.path = model_path
    for k, v in model.items():
        setattr(cfg.model, k, v)
    return configure(cfg)


def _model(cfg: Config):
    torch.manual_seed(0)
    return get_backend(cfg).create_model(cfg, token_ids(cfg))


def _image_batches(cfg: Config, n: int = 3) -> list[dict]:
    batches = [b for b in local_batches(cfg, limit=8) if len(b["patches"])]
    assert len(batches) >= n
    return batches[:n]


def _train(model, cfg: Config, batches: list[dict], lr: float = 1e-2) -> None:
    from ray_mmbatch.train.step import build_optimizer, optimizer_step

    cfg.train.lr, cfg.train.warmup_steps, cfg.train.grad_clip = lr, 0, 0.0
    opt, sched = build_optimizer(model, cfg.train, 100)
    for b in batches:
        optimizer_step(model, [b], opt, sched, cfg.train, "cpu")


def _reloads_to(adapter_dir, data: str, qwen: str, batch: dict, want: torch.Tensor):
    """The exported adapter on a fresh base gives ``want`` (within 1e-5 of its scale) both ways: PEFT's
    PeftModel.from_pretrained merged, and trainable.load_adapter; returns the load_adapter model."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    scale = float(want.abs().max())
    peft_model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(qwen), str(adapter_dir))
    fresh = _model(_cfg(data, qwen)).eval()
    fresh.hf_model.load_state_dict(peft_model.merge_and_unload().state_dict())
    reloaded = _model(_cfg(data, qwen)).eval()
    T.load_adapter(reloaded, adapter_dir)
    with torch.no_grad():
        assert float((fresh(batch) - want).abs().max()) <= 1e-5 * scale
        assert float((reloaded(batch) - want).abs().max()) <= 1e-5 * scale
    return reloaded


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from tests.hf_checkpoints import make_qwen_checkpoint

    return str(make_qwen_checkpoint(tmp_path_factory.mktemp("qwen_ck"), "qwen2_vl"))


@pytest.mark.parametrize("hf", [False, True], ids=["builtin", "qwen2_vl"])
def test_parts_partition_the_model_and_freeze_counts(data, qwen, hf):
    cfg = _cfg(data, qwen if hf else "")
    model = _model(cfg)
    parts = T.part_parameters(model)
    sizes = {k: sum(p.numel() for _, p in v) for k, v in parts.items()}
    assert all(sizes.values()), sizes  # each part holds parameters
    total = T.param_counts(model)["total_params"]
    assert sum(sizes.values()) == total  # a partition: nothing counted twice, nothing left out
    names = {k: [n for n, _ in v] for k, v in parts.items()}
    if hf:
        assert all(".visual." in n and ".merger." not in n for n in names["vision"])
        assert all(".visual.merger." in n for n in names["projector"])
        assert any("lm_head" in n for n in names["language"]) and any("embed_tokens" in n for n in names["language"])
    else:
        assert all(n.startswith("vision.") for n in names["vision"] + names["projector"])
        assert {n.split(".")[1] for n in names["projector"]} == {"merge_norm", "projector"}
    for choice in ("vision", "projector", "language", "vision,projector"):
        m = _model(cfg)
        T.freeze(m, choice)
        want = total - sum(sizes[p] for p in choice.split(","))
        assert T.param_counts(m) == {"trainable_params": want, "total_params": total}
    with pytest.raises(ValueError, match="unknown part"):
        T.parse_parts("vision,llm")
    m = _model(cfg)
    cfg.model.freeze = "vision,projector,language"
    with pytest.raises(ValueError, match="leaves no parameter"):
        T.configure_trainable(m, cfg)


def test_frozen_weights_stay_bit_identical(data):
    cfg = _cfg(data, freeze="vision,projector")
    model = _model(cfg)
    T.configure_trainable(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train(model, cfg, _image_batches(cfg))
    frozen = {n for k in ("vision", "projector") for n, _ in T.part_parameters(model)[k]}
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, before[n]), n
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n not in frozen)


def test_lora_trains_adapters_only_and_the_exported_adapter_reloads(data, qwen, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    cfg = _cfg(data, qwen, lora_rank=4, lora_alpha=8.0)
    model = _model(cfg)
    base_counts = T.param_counts(model)
    T.configure_trainable(model, cfg)
    counts = T.param_counts(model)
    lora = [n for n, p in model.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n for n in lora)
    assert all(".visual." not in n for n in lora)  # default targets: the language model only
    assert counts["total_params"] > base_counts["total_params"] > 10 * counts["trainable_params"]
    batches = _image_batches(cfg)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    _train(model, cfg, batches, lr=5e-2)
    assert all(torch.equal(p, base_before[n]) for n, p in model.named_parameters() if "lora_" not in n)
    model.eval()
    with torch.no_grad():
        want = model(batches[0])
        start = _model(_cfg(data, qwen)).eval()(batches[0])
    assert (want - start).abs().max() > 1e-3  # the adapter changed the model

    d = T.export_adapter(model, tmp_path / "adapter", qwen)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in d.iterdir()}
    peft_model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(qwen), str(d))
    merged = peft_model.merge_and_unload()
    fresh = _model(_cfg(data, qwen)).eval()
    fresh.hf_model.load_state_dict(merged.state_dict())
    scale = float(want.abs().max())  # merged weights round differently in fp32: 1e-5 of the logits' scale
    with torch.no_grad():
        assert float((fresh(batches[0]) - want).abs().max()) <= 1e-5 * scale
        T.merge_lora(model)  # --merge-lora: folded in place, the LoRA layers gone
        assert not any("lora_" in n for n, _ in model.named_parameters())
        assert float((model(batches[0]) - want).abs().max()) <= 1e-5 * scale


def test_check_config_refuses_at_start():
    cfg = Config()
    cfg.model.freeze = "vit"
    with pytest.raises(ValueError, match="unknown part"):
        T.check_config(cfg)
    cfg = Config()
    cfg.model.merge_lora = True
    with pytest.raises(ValueError, match="needs a LoRA run"):
        T.check_config(cfg)
    cfg.model.lora_rank, cfg.train.fsdp = 8, True
    with pytest.raises(ValueError, match="--merge-lora with --fsdp"):
        T.check_config(cfg)


def test_lora_with_gradient_checkpointing_trains_the_adapters(data, qwen):
    """Non-reentrant activation checkpointing: the adapters get gradients though the embeddings are frozen."""
    cfg = _cfg(data, qwen, lora_rank=4, gradient_checkpointing=True)
    model = _model(cfg)
    T.configure_trainable(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    _train(model, cfg, _image_batches(cfg, 1), lr=5e-2)
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if "lora_B" in n)


def test_qlora_is_refused_at_start_naming_why():
    """No CUDA and no bitsandbytes on this machine: --qlora stops at start with every reason."""
    cfg = Config()
    cfg.model.qlora = True
    with pytest.raises(ValueError, match="--qlora refused") as err:
        T.check_config(cfg)
    text = str(err.value)
    assert "--lora-rank" in text and "built-in model" in text and "CUDA" in text
    assert ("bitsandbytes is not installed" in text) == (__import__("importlib").util.find_spec("bitsandbytes") is None)
    cfg.model.lora_rank, cfg.model.path, cfg.train.fsdp = 8, "/ckpt", True
    with pytest.raises(ValueError) as err:
        T.check_config(cfg)
    assert "FSDP2" in str(err.value) and "--lora-rank" not in str(err.value)


def test_lora_modules_to_save_train_in_full_and_travel_in_the_adapter(data, qwen, tmp_path):
    """--lora-modules-to-save lm_head (peft's modules_to_save): the head trains in full beside the adapters,
    the embeddings stay frozen, the exported adapter carries the head and reloads through PeftModel and
    load_adapter to the trained logits; not asked, the adapter holds LoRA weights only."""
    from safetensors.torch import load_file

    cfg = _cfg(data, qwen, lora_rank=4, lora_alpha=8.0, lora_modules_to_save="lm_head")
    model = _model(cfg)
    T.configure_trainable(model, cfg)
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "hf_model.lm_head.weight" in trains and all("lora_" in n or "lm_head" in n for n in trains)
    batches = _image_batches(cfg)
    head, embed = (model.hf_model.lm_head.weight.detach().clone(),
                   model.hf_model.get_input_embeddings().weight.detach().clone())
    _train(model, cfg, batches, lr=5e-2)
    assert not torch.equal(model.hf_model.lm_head.weight, head)
    assert torch.equal(model.hf_model.get_input_embeddings().weight, embed)
    model.eval()
    with torch.no_grad():
        want = model(batches[0])

    d = T.export_adapter(model, tmp_path / "adapter", qwen)
    keys = set(load_file(str(d / "adapter_model.safetensors")))
    assert "base_model.model.lm_head.weight" in keys and all("lora_" in k or "lm_head" in k for k in keys)
    reloaded = _reloads_to(d, data, qwen, batches[0], want)
    assert {n for n, p in reloaded.named_parameters() if p.requires_grad} == trains

    plain = _model(_cfg(data, qwen, lora_rank=4))
    T.configure_trainable(plain, _cfg(data, qwen, lora_rank=4))
    assert all("lora_" in k for k in T.lora_state_dict(plain))  # by default: LoRA weights only


def test_lora_modules_to_save_refusals():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(10, 4)
            self.proj = torch.nn.Linear(4, 4)
            self.lm_head = torch.nn.Linear(4, 10, bias=False)
            self.lm_head.weight = self.embed_tokens.weight

    cfg = Config()
    cfg.model.lora_modules_to_save = "lm_head"
    with pytest.raises(ValueError, match="shares its weights with 'embed_tokens'"):
        T.modules_to_save(Tied(), cfg.model)
    cfg.model.lora_modules_to_save = "lm_head,embed_tokens"
    assert T.modules_to_save(Tied(), cfg.model) == ["lm_head", "embed_tokens"]
    cfg.model.lora_modules_to_save = "wte"
    with pytest.raises(ValueError, match="matches no module"):
        T.modules_to_save(Tied(), cfg.model)


def test_adapter_of_a_gathered_state_dict_keeps_the_modules_to_save(data, qwen):
    """FSDP's export gathers the state dict relative to the HF model (no hf_model. prefix): the adapter
    built from it holds the same keys as from the model itself."""
    cfg = _cfg(data, qwen, lora_rank=4, lora_modules_to_save="lm_head")
    model = _model(cfg)
    T.configure_trainable(model, cfg)
    gathered = {k.removeprefix("hf_model."): v for k, v in model.state_dict().items()}
    assert set(T.lora_state_dict(model, gathered)) == set(T.lora_state_dict(model))
    assert "base_model.model.lm_head.weight" in T.lora_state_dict(model, gathered)


def test_lora_under_bf16_autocast_and_grad_accumulation(data, qwen):
    """bf16 autocast (--precision bf16) with 2 micro-batches per step: only the adapters move, the loss
    stays finite, the weights stay fp32 (the step's normalization itself: tests/test_step.py)."""
    from ray_mmbatch.train.step import build_optimizer, optimizer_step

    cfg = _cfg(data, qwen, lora_rank=4)
    cfg.train.precision, cfg.train.lr, cfg.train.warmup_steps, cfg.train.grad_clip = "bf16", 5e-2, 0, 0.0
    model = _model(cfg)
    T.configure_trainable(model, cfg)
    batches = _image_batches(cfg, 3)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora_b = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    opt, sched = build_optimizer(model, cfg.train, 10)
    out = optimizer_step(model, batches[:2], opt, sched, cfg.train, "cpu")
    out = optimizer_step(model, [batches[2], batches[0]], opt, sched, cfg.train, "cpu")
    assert torch.isfinite(torch.tensor(float(out["loss"])))
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert all(not torch.equal(p, lora_b[n]) for n, p in model.named_parameters() if n in lora_b)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast: the weights stay fp32


def test_dora_rslora_on_all_linear_layers_reload_and_merge(data, qwen, tmp_path):
    """--lora-dora --lora-rslora --lora-targets all-linear: adapters on the vision tower too, DoRA's
    magnitudes train, and the exported adapter (PeftModel, merged), load_adapter and the in-place merge
    all give the trained logits."""
    from safetensors.torch import load_file

    cfg = _cfg(data, qwen, lora_rank=4, lora_alpha=8.0, lora_dora=True, lora_rslora=True,
               lora_targets="all-linear")
    model = _model(cfg)
    T.configure_trainable(model, cfg)
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(".visual." in n for n in trains) and any("lora_magnitude_vector" in n for n in trains)
    both = _model(_cfg(data, qwen, lora_rank=4, lora_targets="vision,projector,language"))
    T.configure_trainable(both, _cfg(data, qwen, lora_rank=4, lora_targets="vision,projector,language"))
    assert {n for n in trains if "magnitude" not in n} == {n for n, p in both.named_parameters() if p.requires_grad}
    assert model.lora_config.use_rslora and model.lora_config.use_dora
    batches = _image_batches(cfg)
    _train(model, cfg, batches, lr=5e-2)
    model.eval()
    with torch.no_grad():
        want = model(batches[0])
        start = _model(_cfg(data, qwen)).eval()(batches[0])
    assert (want - start).abs().max() > 1e-3
    scale = float(want.abs().max())

    d = T.export_adapter(model, tmp_path / "adapter", qwen)
    assert any("lora_magnitude_vector" in k for k in load_file(str(d / "adapter_model.safetensors")))
    _reloads_to(d, data, qwen, batches[0], want)
    with torch.no_grad():
        T.merge_lora(model)
        assert float((model(batches[0]) - want).abs().max()) <= 1e-5 * scale
