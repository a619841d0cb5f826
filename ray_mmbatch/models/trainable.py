"""What trains: frozen parts (``--freeze``) and LoRA adapters (``--lora-rank``), for every backend.

Parts of a VLM, named as LLaMA-Factory / ms-swift name them (``freeze_vision_tower``,
``--freeze_vit`` / ``--freeze_aligner`` / ``--freeze_llm``)::

    vision     the vision encoder            built-in: vision (embed, blocks)
                                              HF: vision_tower / visual / vision_model, less the projector
    projector  the merger / projector into   built-in: vision.merge_norm + vision.projector
               the language model            HF: multi_modal_projector, visual.merger (+ Qwen3-VL's
                                              deepstack mergers), connector (Idefics3), embed_vision
                                              (Gemma 4)
    language   the language model with its   every other parameter (embeddings, decoder, norm, head)
               embeddings and head

``--freeze`` takes any subset; a frozen parameter has ``requires_grad=False`` (the optimizer
never sees it, DDP and FSDP2 reduce no gradient for it) and stays bit-identical.

LoRA (``--lora-rank R``) goes through ``peft``: LoRA layers are injected in place
(``peft.inject_adapter_in_model``) into every ``nn.Linear`` of the parts in ``--lora-targets``
(default ``language``; ``language,vision,projector`` any subset, or explicit module-name
suffixes such as ``q_proj,v_proj``), and every other parameter is frozen: the adapter holds
the LoRA weights only. ``--freeze`` then has nothing left to freeze but may still be given.
``export_adapter`` writes a PEFT adapter directory that ``PeftModel.from_pretrained(base, dir)``
loads on the checkpoint the run started from (``load_adapter`` puts one back on the project's model,
for ``verify-packing --adapter``); ``merged_state_dict`` folds the adapters into
the base weights (``--merge-lora``: a full HF checkpoint).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

PARTS = ("vision", "projector", "language")
ALL_LINEAR = ("all", "all-linear")  # --lora-targets: every part (peft's / ms-swift's all-linear, LLaMA-Factory's all)
LORA_FILE = "adapter_model.safetensors"
# HF attribute paths (on the ForConditionalGeneration) of each part, first match wins per path
_HF_VISION = ("model.vision_tower", "model.visual", "model.vision_model", "vision_tower", "visual", "vision_model")
_HF_PROJECTOR = ("model.multi_modal_projector", "model.visual.merger", "model.visual.deepstack_merger_list",
                 "model.connector", "model.embed_vision", "multi_modal_projector", "visual.merger", "connector",
                 "embed_vision")


def parse_parts(text: str, what: str = "--freeze") -> tuple[str, ...]:
    """'vision,projector' -> ('vision', 'projector'); unknown names raise, naming the choices."""
    names = tuple(dict.fromkeys(p.strip() for p in str(text or "").split(",") if p.strip()))
    bad = [n for n in names if n not in PARTS]
    if bad:
        raise ValueError(f"{what}: unknown part(s) {bad}; choose from {list(PARTS)}")
    return names


def _get(root: nn.Module, path: str) -> nn.Module | None:
    m: Any = root
    for name in path.split("."):
        m = getattr(m, name, None)
        if m is None:
            return None
    return m if isinstance(m, nn.Module) else None


def part_parameters(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """(name, parameter) of each part of the project's model (under DDP: of ``model.module``)."""
    bare = getattr(model, "module", model)
    if hasattr(bare, "hf_model"):
        root, prefix = bare.hf_model, "hf_model."
        vision = [m for m in (_get(root, p) for p in _HF_VISION) if m is not None]
        projector = [m for m in (_get(root, p) for p in _HF_PROJECTOR) if m is not None]
    else:  # the built-in model
        root, prefix = bare, ""
        vision = [bare.vision]
        projector = [bare.vision.merge_norm, bare.vision.projector]
    proj_ids = {id(p) for m in projector for p in m.parameters()}
    vis_ids = {id(p) for m in vision for p in m.parameters()} - proj_ids
    out: dict[str, list[tuple[str, nn.Parameter]]] = {k: [] for k in PARTS}
    for name, p in root.named_parameters():
        part = "projector" if id(p) in proj_ids else "vision" if id(p) in vis_ids else "language"
        out[part].append((prefix + name, p))
    return out


def freeze(model: nn.Module, parts) -> int:
    """Freeze the named parts; returns the number of parameters (elements) frozen."""
    groups = part_parameters(model)
    n = 0
    for part in parse_parts(",".join(parts) if not isinstance(parts, str) else parts):
        for _, p in groups[part]:
            if p.requires_grad:
                p.requires_grad_(False)
                n += p.numel()
    return n


def param_counts(model: nn.Module) -> dict[str, int]:
    """trainable_params / total_params (elements; under FSDP2 the logical, unsharded sizes)."""
    seen, total, trainable = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return {"trainable_params": int(total and trainable), "total_params": int(total)}


def _lora_config(cfg_model, model: nn.Module):
    from peft import LoraConfig

    groups = part_parameters(model)
    words = [w.strip() for w in str(cfg_model.lora_targets or "language").split(",") if w.strip()]
    words = [p for w in words for p in (PARTS if w in ALL_LINEAR else (w,))]
    parts = [w for w in words if w in PARTS]
    suffixes = [w for w in words if w not in PARTS]
    bare = getattr(model, "module", model)
    root, prefix = (bare.hf_model, "hf_model.") if hasattr(bare, "hf_model") else (bare, "")
    in_parts = {name[len(prefix):].rsplit(".", 1)[0] for part in (parts or PARTS) for name, _ in groups[part]}
    saved = modules_to_save(root, cfg_model)
    targets = sorted(name for name, m in root.named_modules()
                     if isinstance(m, nn.Linear) and name in in_parts and not name.endswith("head")
                     and (not suffixes or name.split(".")[-1] in suffixes)
                     and not any(name == s or name.startswith(s + ".") for s in saved))
    if not targets:
        raise ValueError(f"--lora-targets {cfg_model.lora_targets!r} matches no nn.Linear layer of the model")
    return LoraConfig(r=int(cfg_model.lora_rank), lora_alpha=float(cfg_model.lora_alpha),
                      lora_dropout=float(cfg_model.lora_dropout), target_modules=targets, bias="none",
                      modules_to_save=saved or None, use_dora=bool(getattr(cfg_model, "lora_dora", False)),
                      use_rslora=bool(getattr(cfg_model, "lora_rslora", False))), root


def modules_to_save(root: nn.Module, cfg_model) -> list[str]:
    """The full module names ``--lora-modules-to-save`` asks for (by name or last name part), checked:
    each must match, and a weight tied to another module (tie_word_embeddings) needs that module listed
    too (PEFT reloads each as its own copy)."""
    words = [w.strip() for w in str(getattr(cfg_model, "lora_modules_to_save", "") or "").split(",") if w.strip()]
    if not words:
        return []
    names = [n for n, _ in root.named_modules() if n]
    out = []
    for w in words:
        hit = [n for n in names if n == w or n.split(".")[-1] == w]
        hit = [n for n in hit if not any(n.startswith(o + ".") for o in hit)]  # the outermost
        if not hit:
            raise ValueError(f"--lora-modules-to-save {w!r} matches no module of the model (e.g. lm_head, "
                             "embed_tokens)")
        out += [n for n in hit if n not in out]
    owners: dict[int, list[str]] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    for name in out:
        for p in root.get_submodule(name).parameters():
            others = [o for o in owners.get(id(p), []) if not any(o == s or o.startswith(s + ".") for s in out)]
            if others:
                raise ValueError(f"--lora-modules-to-save {name!r} shares its weights with {others[0]!r} "
                                 "(tied embeddings): list both, so the adapter carries both copies")
    return out


def _saved_prefixes(bare: nn.Module) -> tuple[str, ...]:
    """State-dict prefixes of the modules trained in full beside a LoRA adapter (on ``bare``)."""
    config = getattr(bare, "lora_config", None)
    prefix = "hf_model." if hasattr(bare, "hf_model") else ""
    return tuple(prefix + m + "." for m in (getattr(config, "modules_to_save", None) or ()))


def _adapter_trains(bare: nn.Module, name: str) -> bool:
    """Does parameter ``name`` train in a LoRA run: a LoRA weight or part of a module to save."""
    return "lora_" in name or name.startswith(_saved_prefixes(bare))


def add_lora(model: nn.Module, cfg_model) -> Any:
    """Inject LoRA layers (peft) and freeze everything else; returns the LoraConfig (kept on the model)."""
    try:
        from peft import inject_adapter_in_model
    except ImportError as e:
        raise ImportError("--lora-rank needs peft: pip install 'ray_mmbatch[lora]' (or pip install peft)") from e
    config, root = _lora_config(cfg_model, model)
    saved = config.modules_to_save
    config.modules_to_save = None  # trained in place here (requires_grad); the exported config names them
    inject_adapter_in_model(config, root)
    config.modules_to_save = saved
    bare = getattr(model, "module", model)
    bare.lora_config = config
    for name, p in bare.named_parameters():
        p.requires_grad_(_adapter_trains(bare, name))
    return config


def check_config(cfg) -> None:
    """At start, before any Ray work: the settings are valid and what they need is installed."""
    parse_parts(cfg.model.freeze)
    if int(cfg.model.lora_rank) < 0:
        raise ValueError(f"--lora-rank must be >= 0, got {cfg.model.lora_rank}")
    if cfg.model.qlora:
        check_qlora(cfg)
    if int(cfg.model.lora_rank) == 0:
        if cfg.model.merge_lora:
            raise ValueError("--merge-lora needs a LoRA run (--lora-rank R)")
        return
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ImportError("--lora-rank needs peft: pip install 'ray_mmbatch[lora]' (or pip install peft)") from None
    if cfg.model.merge_lora and cfg.train.fsdp:
        raise ValueError("--merge-lora with --fsdp is not supported (the merge needs the full weights on one "
                         "rank): export the adapter, then PeftModel.from_pretrained(base, OUTPUT_DIR/adapter)"
                         ".merge_and_unload()")


def check_qlora(cfg) -> None:
    """--qlora runs only where it can: a LoRA run on an HF checkpoint, a CUDA GPU, bitsandbytes, no FSDP.
    Each refusal names why (the driver calls it before any Ray work)."""
    why = []
    if int(cfg.model.lora_rank) <= 0:
        why.append("it trains LoRA adapters on the 4-bit base: give --lora-rank R")
    if not cfg.model.path:
        why.append("it quantizes a Hugging Face checkpoint (--model DIR); the built-in model is trained from scratch")
    if not (cfg.train.use_gpu and torch.cuda.is_available()):
        why.append("4-bit NF4 layers run on CUDA only: train with --use-gpu on a machine with an NVIDIA GPU "
                   f"(here: use_gpu={cfg.train.use_gpu}, CUDA available={torch.cuda.is_available()})")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        why.append("bitsandbytes is not installed: pip install bitsandbytes")
    if cfg.train.fsdp:
        why.append("sharding 4-bit layers with FSDP2 is not supported here: use DDP (no --fsdp)")
    if cfg.model.merge_lora:
        why.append("--merge-lora would fold adapters into 4-bit weights: export the adapter and merge it into the "
                   "full-precision checkpoint afterwards")
    if why:
        raise ValueError("--qlora refused: " + "; ".join(why))


def configure_trainable(model: nn.Module, cfg) -> dict[str, int]:
    """Apply cfg.model.freeze and cfg.model.lora_rank to a freshly built model; the counts after."""
    if int(cfg.model.lora_rank) > 0:
        add_lora(model, cfg.model)
    if cfg.model.freeze:
        freeze(model, cfg.model.freeze)
    counts = param_counts(model)
    if counts["trainable_params"] == 0:
        raise ValueError(f"--freeze {cfg.model.freeze!r} leaves no parameter to train")
    return counts


def lora_state_dict(model: nn.Module, state_dict: dict | None = None) -> dict[str, torch.Tensor]:
    """The LoRA weights under PEFT's adapter key names (``base_model.model.<path>.lora_A.weight``)."""
    bare = getattr(model, "module", model)
    sd = state_dict if state_dict is not None else bare.state_dict()
    prefix = "hf_model." if hasattr(bare, "hf_model") else ""
    # --lora-modules-to-save: PEFT keeps them as <module>.weight (keys relative to the HF model: a
    # gathered FSDP state dict comes without the prefix)
    saved = tuple(p.removeprefix(prefix) for p in _saved_prefixes(bare))
    out = {}
    for k, v in sd.items():
        k = k[len(prefix):] if k.startswith(prefix) else k
        if "lora_" not in k and not k.startswith(saved):
            continue
        out["base_model.model." + k.replace(".default", "")] = v.detach().cpu().contiguous()
    return out


def export_adapter(model: nn.Module, directory, base_path: str = "", state_dict: dict | None = None) -> Path:
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) of the trained LoRA."""
    from safetensors.torch import save_file

    bare = getattr(model, "module", model)
    config = bare.lora_config
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    config.base_model_name_or_path = base_path or None
    config.save_pretrained(str(d))
    save_file(lora_state_dict(model, state_dict), str(d / LORA_FILE), metadata={"format": "pt"})
    (d / "README.md").write_text("LoRA adapter trained with ray_mmbatch: PeftModel.from_pretrained(base, this_dir)\n"
                                 + json.dumps({"base": base_path, "r": config.r, "alpha": config.lora_alpha}) + "\n")
    return d


def load_adapter(model: nn.Module, directory) -> Any:
    """Put a PEFT LoRA adapter directory (``export_adapter``'s, or PEFT's own ``save_pretrained`` on the
    same HF model) on a freshly built model, as a LoRA run has it: the adapter's layers injected where its
    ``target_modules`` say, its weights loaded (every one, no other: a mismatch raises, naming keys), every
    other parameter frozen. Returns the LoraConfig (kept on the model, as ``add_lora`` does)."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:
        raise ImportError("an adapter needs peft: pip install 'ray_mmbatch[lora]' (or pip install peft)") from e
    from safetensors.torch import load_file

    d = Path(directory)
    if not (d / LORA_FILE).is_file():
        raise FileNotFoundError(f"{d} is not a PEFT adapter directory ({LORA_FILE} + adapter_config.json)")
    config = LoraConfig.from_pretrained(str(d))
    bare = getattr(model, "module", model)
    if hasattr(bare, "lora_config"):
        raise ValueError("the model already carries LoRA adapters (--lora-rank): load an adapter on the base alone")
    root = bare.hf_model if hasattr(bare, "hf_model") else bare
    saved = list(config.modules_to_save or ())
    config.modules_to_save = None  # loaded in place (the modules' own weights), as a LoRA run trains them
    inject_adapter_in_model(config, root)
    config.modules_to_save = saved or None
    want = {k for k in root.state_dict() if "lora_" in k or k.startswith(tuple(m + "." for m in saved))}
    got = {}
    for key, value in load_file(str(d / LORA_FILE)).items():  # base_model.model.<path>.lora_A.weight
        parts = key.removeprefix("base_model.model.").split(".")
        at = next((i for i, p in enumerate(parts) if p.startswith("lora_")), None)
        if at is not None:
            parts.insert(at + 1, "default")  # the module's adapter name: <path>.lora_A.default.weight
        got[".".join(parts)] = value
    if set(got) != want:
        missing, extra = sorted(want - set(got)), sorted(set(got) - want)
        raise ValueError(f"adapter {d} does not fit this model: missing {len(missing)} {missing[:3]}, unexpected "
                         f"{len(extra)} {extra[:3]} (another base model?)")
    root.load_state_dict(got, strict=False)
    bare.lora_config = config
    for name, p in bare.named_parameters():
        p.requires_grad_(_adapter_trains(bare, name))
    return config


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA layer into its base layer (in place) and put the base layers back."""
    from peft.tuners.lora import LoraLayer

    bare = getattr(model, "module", model)
    for name, module in list(bare.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            parent = bare.get_submodule(parent_name) if parent_name else bare
            setattr(parent, child, module.get_base_layer())
    if hasattr(bare, "lora_config"):
        del bare.lora_config
    return model
