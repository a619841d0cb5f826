"""Model backends: one module per family, one registry line each.

A backend module defines::

    NAME                      registry name ("builtin", "qwen_vl", "llava")
    MODEL_TYPES               HF config.json ``model_type`` values it trains (() for builtin)
    VIDEO_MODEL_TYPES         (optional) those of MODEL_TYPES whose checkpoints train on video too
    configure(cfg) -> Config  fill the data path's settings from the checkpoint at cfg.model.path:
                              image cost model (resize, patch/merge size, min/max pixels), pixel
                              normalization, tokenizer and image token; refuse contradicting flags
    create_model(cfg, ids)    -> torch.nn.Module with forward(batch, loss_only=True) ->
                              (ce_sum fp32, n_target) on the dict a Train worker receives
                              (batching/collate.py layout, tensors); its ``backend_name`` is NAME
                              (``backend_of(model)`` finds the backend from the model alone)
    fsdp_units(model)         -> [nn.Module]: the blocks FSDP shards as units of their own, outermost
                              first, in model order: the decoder layers every rank runs every step
                              (train/fsdp.py says why), none inside ``vision_modules``
    vision_modules(model)     -> [nn.Module]: the vision tower (and projector), which a batch without
                              images does not run; FSDP keeps them in its root unit
    state_prefix(model)       -> str: the prefix of the model's state_dict keys that ``export`` wants
                              stripped from a gathered ``state_dict`` ("" builtin, "hf_model." HF)
    export(model, cfg, dir, state_dict=None)
                              the trained model in the family's own format (HF: save_pretrained of
                              model + tokenizer + processor config); state_dict = FSDP's gathered one
                              (the keys under ``state_prefix``, stripped)

So the train loop never names a model class: it asks ``get_backend(cfg)``. The cost model
(image size -> tokens / patches) runs in the data path from the ImageConfig that
``configure`` filled, so measuring needs no torch.
Pure module: no ray, no torch at import.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

REGISTRY: dict[str, str] = {
    "builtin": "ray_mmbatch.models.builtin",
    "qwen_vl": "ray_mmbatch.models.qwen_vl",
    "llava": "ray_mmbatch.models.llava",
    "gemma3": "ray_mmbatch.models.gemma3",
    "internvl": "ray_mmbatch.models.internvl",
    "idefics3": "ray_mmbatch.models.idefics3",
    "llava_onevision": "ray_mmbatch.models.llava_onevision",
    "qwen3_5": "ray_mmbatch.models.qwen3_5",
    "gemma4": "ray_mmbatch.models.gemma4",
    "mistral3": "ray_mmbatch.models.mistral3",
    "glm4v": "ray_mmbatch.models.glm4v",
}


def backend_module(name: str) -> ModuleType:
    if name not in REGISTRY:
        raise ValueError(f"unknown model backend {name!r}; choose one of {sorted(REGISTRY)}")
    return importlib.import_module(REGISTRY[name])


def checkpoint_model_type(path: str) -> str:
    """``model_type`` of an HF checkpoint directory (its config.json; a bucket's: this node's copy, formats/fetch)."""
    from ray_mmbatch.formats.fetch import local_checkpoint

    path = local_checkpoint(path)
    cfg_file = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise FileNotFoundError(f"model path {path!r} is not a directory (expected a local Hugging Face "
                                "checkpoint: config.json, weights, tokenizer, preprocessor_config.json)")
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: no config.json, so not a Hugging Face checkpoint directory")
    try:
        return str(json.loads(cfg_file.read_text())["model_type"])
    except (ValueError, KeyError) as e:
        raise ValueError(f"{cfg_file}: cannot read model_type ({e})") from None


def video_model_types() -> list[str]:
    """Every checkpoint ``model_type`` that trains on video, from the registry (each backend's VIDEO_MODEL_TYPES)."""
    return [t for name in REGISTRY for t in getattr(backend_module(name), "VIDEO_MODEL_TYPES", ())]


def backend_name(model_cfg) -> str:
    """The registry name for this ModelConfig: explicit, builtin without a path, else by model_type."""
    if model_cfg.backend != "auto":
        backend_module(model_cfg.backend)  # validates the name
        return model_cfg.backend
    if not model_cfg.path:
        return "builtin"
    model_type = checkpoint_model_type(model_cfg.path)
    for name in REGISTRY:
        if model_type in getattr(backend_module(name), "MODEL_TYPES", ()):
            return name
    known = {n: list(getattr(backend_module(n), "MODEL_TYPES", ())) for n in REGISTRY}
    raise ValueError(f"{model_cfg.path}: model_type {model_type!r} has no backend; supported: {known}")


def get_backend(cfg) -> ModuleType:
    """The backend module for a Config (see the module docstring for what it defines)."""
    return backend_module(backend_name(cfg.model))


def backend_of(model) -> ModuleType | None:
    """The backend that built ``model`` (its ``backend_name``; under DDP, of ``model.module``); None if none did."""
    name = getattr(getattr(model, "module", model), "backend_name", "")
    return backend_module(name) if name else None


HF_STATE_PREFIX = "hf_model."
"""HFModel's state_dict keys of the transformers model start with this (``save_pretrained`` wants it stripped)."""


def hf_fsdp_units(model) -> list:
    """``fsdp_units`` of every HF backend: hf_common.fsdp_units (imported when called, so that
    configuring a run does not load torch)."""
    from ray_mmbatch.models.hf_common import fsdp_units

    return fsdp_units(model)


def hf_export(model, cfg, directory, state_dict=None):
    """``export`` of every HF backend: save_pretrained of model + tokenizer, the checkpoint's processor
    files copied (hf_common.export_hf; imported when called)."""
    from ray_mmbatch.models.hf_common import export_hf

    return export_hf(model, cfg, directory, state_dict)


def hf_state_prefix(model) -> str:
    """``state_prefix`` of every HF backend: HFModel keeps the transformers model under ``hf_model.``."""
    return HF_STATE_PREFIX


def outermost_blocks(model, is_block, skip=()) -> list:
    """The submodules of ``model`` (not itself) for which ``is_block(module)``, outermost first, in model
    order: a block inside one already taken is not listed. Modules inside ``skip`` are never taken.
    Duck-typed (``.modules()``), so this module imports no torch."""
    skipped = {id(m) for part in skip for m in part.modules()}
    blocks, taken = [], set()
    for module in model.modules():
        if id(module) in taken or module is model or id(module) in skipped or not is_block(module):
            continue
        blocks.append(module)
        taken.update(id(m) for m in module.modules())
    return blocks


def configure(cfg):
    """``cfg`` with its backend's settings applied (a checkpoint's image / text settings); idempotent.

    A checkpoint in a bucket (``--model s3://...``) is read from this node's copy (formats/fetch.py); the
    config keeps the URI (and names it as the tokenizer), so every node opens its own copy."""
    from ray_mmbatch.formats.fetch import local_checkpoint

    uri = cfg.model.path
    local = local_checkpoint(uri)
    if local == uri:
        return _resolve_tokenizer(get_backend(cfg).configure(cfg))
    cfg.model.path = local
    try:
        cfg = get_backend(cfg).configure(cfg)
    finally:
        cfg.model.path = uri
    if cfg.text.tokenizer == local:
        cfg.text.tokenizer = uri
    return _resolve_tokenizer(cfg)


def _resolve_tokenizer(cfg):
    """text.tokenizer_class: which class this process's AutoTokenizer loaded, so that the preprocessing actors
    load it directly (data/text/tokenizer.py); '' when it is not a checkpoint's tokenizer."""
    from ray_mmbatch.data.text.tokenizer import load_tokenizer, resolved_class

    hint, cfg.text.tokenizer_class = cfg.text.tokenizer_class, ""  # a config configured before (a trial's): its hint
    if cfg.text.tokenizer:
        cfg.text.tokenizer_class = resolved_class(load_tokenizer(cfg.text.tokenizer, cfg.text.chat_template, hint))
    return cfg


def token_ids(cfg) -> dict[str, int]:
    """vocab size, image token id and pad id of the run's tokenizer (call after ``configure``)."""
    from ray_mmbatch.data.text.encoder import image_token_id, tokenizer_for

    tok = tokenizer_for(cfg.text)
    return {"vocab_size": len(tok), "image_token_id": image_token_id(tok, cfg.text), "pad_id": int(tok.pad_token_id)}
