"""What every Hugging Face backend shares: reading a checkpoint's settings (open_checkpoint, pixel_settings,
adopt_setting), loading it, the adapter's text half (text_inputs, image_adapter), the loss-only forward, pixels,
export.

``HFModel`` wraps a transformers ``*ForConditionalGeneration`` so it has the built-in model's
contract: ``forward(batch, loss_only=True) -> (ce_sum fp32, n_target)`` on the dict a Train
worker receives (batching/collate.py layout, as tensors). A backend supplies ``adapter(batch)
-> kwargs`` for the HF base model (``hf_model.model``) and the vision submodules. The loss is
ours, not HF's: our labels are already shifted (labels[t] is the target of position t), and
only target positions go through the LM head, a bounded chunk at a time (models/loss.py), so a
16k-token pack never makes [T, V] logits; normalization across micro-batches and ranks stays
train/step.py's (sum here, divide there).
``use_cache=False`` always: with a cache HF stops detecting packed sequences and attention
crosses samples.

Pixels travel as uint8 patches (data/image/ patchify order) and are normalized here, on the
training device: ``(x / 255 - mean) / std`` per channel, repeated over ``temporal_patch_size``
(a still image is ``temporal`` identical frames), the layout HF's Qwen-VL processors emit.
"""
from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ray_mmbatch.models import HF_STATE_PREFIX
from ray_mmbatch.models.inputs import as_torch
from ray_mmbatch.models.loss import LOSS_CHUNK_TOKENS, target_cross_entropy
from ray_mmbatch.schema import IGNORE_INDEX

# files of a checkpoint dir that describe the tokenizer / processor (copied on export)
_SIDE_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.json", "chat_template.jinja",
               "video_preprocessor_config.json", "generation_config.json")


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def checkpoint_files(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, image processor settings) of a checkpoint dir; the second may be {}.

    The image processor's settings are preprocessor_config.json, or, in checkpoints saved by
    newer processors that write one composite file, processor_config.json's "image_processor".
    """
    root = Path(path)
    processor = read_json(root / "preprocessor_config.json")
    if not processor:
        nested = read_json(root / "processor_config.json").get("image_processor")
        processor = nested if isinstance(nested, dict) else {}
    return read_json(root / "config.json"), processor


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)
    return a == b


def adopt_setting(cfg, key: str, value: Any, source: str, user_may_override: bool = False) -> None:
    """Set config field ``key`` ("section.field") to the checkpoint's ``value``, read from ``source``.

    A field still at its ``Config()`` default takes the checkpoint's value. A field the user
    changed (differs from the default) and that contradicts it is refused with a ValueError
    naming the flag and both values, unless ``user_may_override`` (a free choice such as an image
    resolution bound, where the user's value wins). A user value equal to the default cannot
    be told from an unset one, so it is replaced by the checkpoint's.
    """
    from ray_mmbatch.config import Config, flag_for

    section_name, _, name = key.partition(".")
    section = getattr(cfg, section_name)
    default = getattr(getattr(Config(), section_name), name)
    if isinstance(default, tuple):
        value = tuple(type(default[0])(v) for v in value) if default else tuple(value)
    elif default is not None and not isinstance(value, type(default)):
        value = type(default)(value)
    current = getattr(section, name)
    if not _same(current, default) and not _same(current, value):
        if user_may_override:
            return
        raise ValueError(f"{key} = {current!r} ({flag_for(key)}) contradicts the checkpoint: {source} says "
                         f"{value!r}. Drop the setting (the checkpoint's value is then used) or use a matching "
                         "checkpoint.")
    setattr(section, name, value)


CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIPImageProcessor's defaults (OpenAI CLIP's)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_RESAMPLE_NAMES = {1: "Lanczos", 2: "bilinear", 3: "bicubic"}  # PIL.Image.Resampling values


def open_checkpoint(cfg, name: str, family: str, model_types: tuple[str, ...]):
    """``configure``'s first step for every HF backend: the checkpoint at cfg.model.path, refused when unset or
    of a model_type outside ``model_types``. Returns (path, its transformers config, its image processor
    settings (checkpoint_files), where_model, where_proc) -- the last two name the files in messages."""
    from transformers import AutoConfig

    path = cfg.model.path
    if not path:
        raise ValueError(f"the {name} backend trains a Hugging Face checkpoint: set model.path")
    raw, processor = checkpoint_files(path)
    if raw.get("model_type") not in model_types:
        raise ValueError(f"{path}: model_type {raw.get('model_type')!r} is not {family} ({list(model_types)})")
    hf_cfg = AutoConfig.from_pretrained(path)
    return path, hf_cfg, processor, f"{path}/config.json", f"{path}/preprocessor_config.json"


def pixel_settings(pre: dict[str, Any], where: str, family: str, *, resample: int, mean, std,
                   types: tuple[str, ...] = (), always: tuple[str, ...] = ("do_resize",)) -> dict[str, Any]:
    """The image processor checks every HF backend shares; returns {"image_mean", "image_std"} as the data path
    normalizes with them (data/image/ resizes, rescales by 1/255 and normalizes on the device).

    ``pre``: the processor's settings (checkpoint_files), read from ``where``. Refused: none at all; an
    ``image_processor_type`` outside ``types`` (when given; unset means ``types[0]``); any step in ``always``
    turned off; a ``resample`` other than the data path's (a PIL.Image.Resampling value); a rescale other than
    by 1/255. ``mean`` / ``std``: the processor class's defaults; a scalar counts for every channel; with
    ``do_normalize`` off they are 0 and 1. A key set to null counts as off, as HF's processors read it.
    """
    if not pre:
        raise FileNotFoundError(f"{where}: missing (nor a processor_config.json with an image_processor): "
                                f"the {family} backend takes its pixel settings from it")
    if types:
        kind = str(pre.get("image_processor_type", types[0]))
        if kind not in types:
            raise ValueError(f"{where}: image_processor_type {kind!r}; the {family} backend reproduces "
                             f"{list(types)} only")
    for key in always:
        if not pre.get(key, True):
            raise ValueError(f"{where}: {key}=false; the data path always does it")
    if int(pre.get("resample", resample)) != resample:
        raise ValueError(f"{where}: resample={pre.get('resample')}; only {_RESAMPLE_NAMES.get(resample, resample)} "
                         f"({resample}) matches the data path's resize")
    if not pre.get("do_rescale", True) or not math.isclose(float(pre.get("rescale_factor", 1 / 255)), 1 / 255):
        raise ValueError(f"{where}: pixels must be rescaled by 1/255 (do_rescale, rescale_factor)")
    if not pre.get("do_normalize", True):
        return {"image_mean": (0.0, 0.0, 0.0), "image_std": (1.0, 1.0, 1.0)}
    out = {}
    for key, default in (("image_mean", mean), ("image_std", std)):
        value = pre.get(key, default)
        out[key] = (float(value),) * 3 if isinstance(value, (int, float)) else tuple(float(v) for v in value)
    return out


def video_processor_settings(path: str) -> tuple[dict, str]:
    """The video processor's settings as HF loads them, and the file they came from: processor_config.json's
    "video_processor", else video_preprocessor_config.json, else preprocessor_config.json (HF's fallback)."""
    root = Path(path)
    nested = read_json(root / "processor_config.json").get("video_processor")
    if isinstance(nested, dict) and nested:
        return nested, "processor_config.json video_processor"
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        found = read_json(root / name)
        if found:
            return found, name
    return {}, "the video processor class's defaults"


VIDEO_LOADERS = ("torchcodec", "pyav")  # config.ImageConfig.video_loader
_VIDEO_KEYS = ("do_sample_frames", "fps", "num_frames", "min_frames", "max_frames", "video_processor_type")
UNBOUNDED = 2 ** 31 - 1  # a frame / token bound HF's processor does not have


def has_video_settings(video: dict) -> bool:
    """Whether the checkpoint's video settings are a video processor's (a key only a video processor has), not
    the image processor's preprocessor_config.json that HF falls back to."""
    return any(k in video for k in _VIDEO_KEYS)


def user_set(cfg, key: str) -> bool:
    """Whether config field ``key`` ("section.field") differs from its Config() default (the user set it)."""
    from ray_mmbatch.config import Config

    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name) != getattr(getattr(Config(), section), name)


def adopt_video_settings(cfg, video: dict[str, Any], where: str, family: str, defaults: dict[str, Any]) -> None:
    """What every video family takes from its checkpoint's video processor ``video`` (read from ``where``; keys it
    leaves out: the class's ``defaults``, which name do_sample_frames, fps, num_frames, image_mean, image_std):
    its pixel steps checked as an image processor's are (``pixel_settings``: bicubic, 1/255, convert to RGB;
    do_normalize off = mean 0, std 1), then image.video_sample_frames, video_fps (the user's value wins),
    video_num_frames, video_mean and video_std."""
    if cfg.image.video_loader not in VIDEO_LOADERS:
        raise ValueError(f"--video-loader {cfg.image.video_loader!r}: one of {', '.join(VIDEO_LOADERS)} (how HF's "
                         "loader of that name reads a clip: docs/data.md)")
    get = {k: video.get(k, d) for k, d in defaults.items()}
    # the user's --video-fps / --video-num-frames sample at that rate (HF needs do_sample_frames); a value equal to the
    # checkpoint's is not the user's (configure runs again on a configured Config: what it adopted stays as it was)
    if (cfg.image.video_fps not in (None, get["fps"] if get["fps"] is None else float(get["fps"]))
            or cfg.image.video_num_frames not in (None, get["num_frames"])):
        get["do_sample_frames"] = True
    pixels = pixel_settings(video, where, family, resample=3, mean=defaults["image_mean"], std=defaults["image_std"],
                            always=("do_resize", "do_convert_rgb")) if video else \
        {k: tuple(float(v) for v in defaults[k]) for k in ("image_mean", "image_std")}
    adopt_setting(cfg, "image.video_sample_frames", bool(get["do_sample_frames"]), f"{where} do_sample_frames",
                  user_may_override=True)  # false: every frame (HF's Qwen2-VL class default), the user's choice
    adopt_setting(cfg, "image.video_fps", None if get["fps"] is None else float(get["fps"]), f"{where} fps",
                  user_may_override=True)
    adopt_setting(cfg, "image.video_num_frames", get["num_frames"], f"{where} num_frames", user_may_override=True)
    adopt_setting(cfg, "image.video_mean", pixels["image_mean"], f"{where} image_mean")
    adopt_setting(cfg, "image.video_std", pixels["image_std"], f"{where} image_std")


def checked_token(tok, token_id: int, path: str, field: str = "image_token_id") -> str:
    """The token of config.json's ``field`` = ``token_id`` in the tokenizer ``tok``; it must map back to the id."""
    token = tok.convert_ids_to_tokens(int(token_id))
    if token is None or tok.convert_tokens_to_ids(token) != int(token_id):
        raise ValueError(f"{path}: config.json {field} {token_id} is not a token of the tokenizer "
                         f"{getattr(tok, 'name_or_path', '')}")
    return str(token)


def image_token(tokenizer: str, token_id: int, path: str, field: str = "image_token_id") -> str:
    """checked_token of the tokenizer at ``tokenizer`` (load_tokenizer: cached)."""
    from ray_mmbatch.data.text.tokenizer import load_tokenizer

    return checked_token(load_tokenizer(tokenizer), token_id, path, field)


def freeze(*modules) -> int:
    """requires_grad=False on every weight of ``modules`` (None skipped): weights that never reach the loss, which
    DDP would report unused. Returns how many weights."""
    n = 0
    for module in modules:
        for p in module.parameters() if module is not None else ():
            p.requires_grad_(False)
            n += p.numel()
    return n


def adopt_still_pixels(cfg, pixels: dict[str, Any], where_proc: str, family: str) -> None:
    """What every HF backend of still images adopts alike: temporal_patch_size 1, the processor's mean / std
    (``pixels`` from pixel_settings, read from ``where_proc``); and the checkpoint's own tokenizer unless
    text.tokenizer names one."""
    adopt_setting(cfg, "image.temporal_patch_size", 1, f"{cfg.model.path} ({family}: still images)")
    for key in ("image_mean", "image_std"):
        adopt_setting(cfg, f"image.{key}", pixels[key], f"{where_proc} {key}")
    if not cfg.text.tokenizer:
        cfg.text.tokenizer = cfg.model.path


def resolve_attn_implementation(requested: str, device_type: str) -> str:
    """'auto' -> flash_attention_2 on CUDA with flash_attn installed, else sdpa."""
    if requested != "auto":
        return requested
    if device_type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def load_hf_model(path: str, attn_implementation: str = "auto", device_type: str = "cpu", qlora: bool = False):
    """The checkpoint's ``*ForConditionalGeneration`` in fp32 (autocast does the low precision); ``qlora``:
    its linear layers in 4-bit NF4 through bitsandbytes (double quantization, bf16 compute), the rest in
    fp32, on this process's CUDA device (models/trainable.check_config refuses it anywhere else)."""
    from transformers import AutoModelForImageTextToText

    impl = resolve_attn_implementation(attn_implementation, device_type)
    kwargs = {}
    if qlora:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    from ray_mmbatch.formats.fetch import local_checkpoint  # a bucket's checkpoint: this node's copy

    return AutoModelForImageTextToText.from_pretrained(local_checkpoint(path), dtype=torch.float32,
                                                       attn_implementation=impl, **kwargs)


TOKENIZER_HINT = ("use the checkpoint's tokenizer and its own chat template (text.chat_template='auto'), which adds "
                  "no token; see configure")


def load_checked(cfg, ids: dict, attn_implementation: str | None = None, hint: str = TOKENIZER_HINT):
    """``create_model``'s first half for every HF backend: the checkpoint at cfg.model.path in fp32 on
    this worker's device type, its embeddings checked against the run's tokenizer ``ids``."""
    device_type = "cuda" if cfg.train.use_gpu and torch.cuda.is_available() else "cpu"
    hf = load_hf_model(cfg.model.path, attn_implementation or cfg.model.attn_implementation, device_type,
                       qlora=bool(getattr(cfg.model, "qlora", False)))
    check_token_ids(hf, ids, hint)
    return hf


def wrap(hf_model, cfg, adapter, vision, name: str):
    """``create_model``'s last step for every HF backend: activation checkpointing if asked, then HFModel."""
    if cfg.model.gradient_checkpointing:
        enable_activation_checkpointing(hf_model)
    return HFModel(hf_model, adapter, vision, name)


def check_token_ids(hf_model, ids: dict, hint: str) -> None:
    """The run's tokenizer (``ids`` from models.token_ids) must match the loaded model: the same image
    token id, and no more tokens than the model embeds; ``hint`` says what to do otherwise."""
    if int(ids["image_token_id"]) != int(hf_model.config.image_token_id):
        raise ValueError(f"tokenizer image token id {ids['image_token_id']} != the model's image_token_id "
                         f"{hf_model.config.image_token_id}; {hint}")
    rows = hf_model.get_input_embeddings().num_embeddings
    if int(ids["vocab_size"]) > rows:
        raise ValueError(f"tokenizer has {ids['vocab_size']} tokens but the model embeds {rows}; {hint}")


def enable_activation_checkpointing(hf_model) -> None:
    """Recompute each layer's activations in the backward pass (non-reentrant), by the name this
    transformers version has (``activation_checkpointing_enable`` from v5.2x, before it
    ``gradient_checkpointing_enable``)."""
    kwargs = {"use_reentrant": False}
    if hasattr(hf_model, "activation_checkpointing_enable"):
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def normalize_patches(patches: torch.Tensor, mean, std, temporal: int = 1, rescale64: bool = False) -> torch.Tensor:
    """uint8 [P, 3 * ps * ps] (channel-major patches) -> float32 [P, 3 * temporal * ps * ps].

    Each patch vector becomes (channel, frame, py, px), frames identical: Qwen-VL's
    ``pixel_values`` row layout. ``temporal=1`` gives CLIP-style normalized patches. ``rescale64``: the 1/255
    rescale in float64, rounded once to float32, as HF's PIL processors rescale (their very pixels, not 1 ulp off).
    """
    p = patches.shape[0]
    x = patches.reshape(p, 3, -1)
    x = (x.to(torch.float64) * (1.0 / 255.0)).to(torch.float32) if rescale64 else x.to(torch.float32) * (1.0 / 255.0)
    m = torch.as_tensor(mean, dtype=torch.float32, device=x.device).view(1, 3, 1)
    s = torch.as_tensor(std, dtype=torch.float32, device=x.device).view(1, 3, 1)
    x = (x - m) / s
    if temporal > 1:
        x = x[:, :, None, :].expand(p, 3, temporal, x.shape[-1])
    return x.reshape(p, -1)


def normalize_video_patches(patches: torch.Tensor, mean, std) -> torch.Tensor:
    """uint8 [P, 3 * temporal * ps * ps] (data/video.patchify_video rows) -> float32, as HF's torchvision
    video processors normalize: fused, (x - mean * 255) / (std * 255) on the uint8 values."""
    p = patches.shape[0]
    x = patches.reshape(p, 3, -1).to(torch.float32)
    m = (torch.tensor(tuple(mean)) * (1.0 / (1 / 255))).to(x.device).view(1, 3, 1)
    s = (torch.tensor(tuple(std)) * (1.0 / (1 / 255))).to(x.device).view(1, 3, 1)
    return ((x - m) / s).reshape(p, -1)


def varlen_kwargs(batch: dict, hf_config) -> dict[str, Any]:
    """A packed row's explicit varlen metadata for HF flash attention, {} where it does not apply.

    Pack batches on an attention implementation with "flash" in its name (transformers' own test,
    ``is_flash_attention_requested``; ``hf_config`` is the language model's config) get
    ``cu_seq_lens_q/k`` (collate's int32 ``cu_seqlens``, on the row's device) and
    ``max_length_q/k`` (collate's ``max_seqlen``, a Python int: no device sync). transformers'
    ``_flash_attention_forward`` then runs varlen on them instead of inferring the boundaries from
    position ids (``_is_packed_sequence``, which broke in several releases). Mask-based
    implementations (sdpa, eager, flex) keep taking the boundaries from position ids. A backend
    adds these to its base-model kwargs; they reach the language model's attention calls only.
    """
    impl = str(getattr(hf_config, "_attn_implementation", "") or "")
    if batch.get("mode") != "pack" or "flash" not in impl:
        return {}
    cu = batch["cu_seqlens"]
    cu = cu.to(device=batch["input_ids"].device, dtype=torch.int32) if isinstance(cu, torch.Tensor) else \
        torch.as_tensor(cu, dtype=torch.int32, device=batch["input_ids"].device)
    longest = int(batch["max_seqlen"])
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def text_inputs(batch: dict, text_config) -> dict[str, Any]:
    """The language model's half of a backend's base-model kwargs: ids and position ids; a pad batch its
    [B, L] attention_mask; a pack batch none (the causal mask builder finds the samples from the restarting
    position ids) and, on flash attention, the explicit varlen metadata (varlen_kwargs; ``text_config``:
    the language model's config, read per call)."""
    kwargs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    if batch["mode"] == "pad":
        kwargs["attention_mask"] = batch["attention_mask"]
    elif batch["mode"] == "pack":
        kwargs.update(varlen_kwargs(batch, text_config))
    else:
        raise ValueError(f"unknown batch mode {batch['mode']!r}")
    return kwargs


def image_adapter(text_config, image_inputs: Callable[[torch.Tensor, dict], dict[str, Any]]):
    """``adapter(batch)`` of a backend whose images only add kwargs: text_inputs, plus
    ``image_inputs(patches, batch)`` (pixel_values and the like) when the batch has patches."""

    def adapter(batch: dict) -> dict[str, Any]:
        kwargs = text_inputs(batch, text_config)
        patches = batch.get("patches")
        if patches is not None and patches.shape[0]:
            kwargs.update(image_inputs(patches, batch))
        return kwargs

    return adapter


class HFModel(nn.Module):
    """A transformers VLM with the project's forward contract (see module docstring).

    ``adapter(batch) -> dict`` gives the HF base model's kwargs for one batch;
    ``vision(hf_model) -> list[nn.Module]`` names the vision submodules, kept in the
    autograd graph with zero gradient when a batch has no image (DDP wants every
    parameter used on every rank). ``backend_name``: the registry entry that built it
    (models.backend_of).
    """

    def __init__(self, hf_model: nn.Module, adapter: Callable[[dict], dict[str, Any]],
                 vision: Callable[[nn.Module], list[nn.Module]], backend_name: str = ""):
        super().__init__()
        self.hf_model = hf_model
        self._adapter = adapter
        self._vision = vision
        self.backend_name = backend_name
        self.loss_chunk_tokens = LOSS_CHUNK_TOKENS

    def vision_modules(self) -> list[nn.Module]:
        """The vision submodules (the backend's ``vision``): a batch without images does not run them."""
        return list(self._vision(self.hf_model))

    def forward_inputs(self, batch: dict) -> dict[str, Any]:
        """The kwargs the HF base model gets for this batch (use_cache=False included)."""
        kwargs = self._adapter(batch)
        kwargs["use_cache"] = False
        return kwargs

    def _target_ce(self, hidden: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
        """CE of the target positions only (our labels are already shifted); fp32 even under autocast, the
        logits of at most ``loss_chunk_tokens`` targets at once (models/loss.py)."""
        return target_cross_entropy(self.head(), hidden, labels, reduction, self.loss_chunk_tokens)

    def head(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """hidden -> logits as HF's ``*ForConditionalGeneration`` makes them: ``lm_head``, then the language model's
        ``final_logit_softcapping`` where it has one (Gemma 4: ``cap * tanh(logits / cap)``, HF's order)."""
        lm_head = self.hf_model.lm_head
        cap = getattr(self.hf_model.config.get_text_config(), "final_logit_softcapping", None)
        if not cap:
            return lm_head

        def capped(hidden: torch.Tensor) -> torch.Tensor:
            return torch.tanh(lm_head(hidden) / cap) * cap

        return capped

    def target_ce(self, batch: dict) -> torch.Tensor:
        """fp32 CE of every target token, in sequence order (row-major over the batch): for exactness checks."""
        hidden = self.hf_model.model(**self.forward_inputs(batch)).last_hidden_state
        return self._target_ce(hidden, batch["labels"], "none")

    def forward(self, batch: dict, loss_only: bool = False):
        batch = as_torch(batch, self)  # a batch as local_batches / Ray Data yield it works as is
        hidden = self.hf_model.model(**self.forward_inputs(batch)).last_hidden_state
        patches, videos = batch.get("patches"), batch.get("video_patches")
        if torch.is_grad_enabled() and (patches is None or patches.shape[0] == 0) and (
                videos is None or videos.shape[0] == 0):
            hidden = hidden + 0.0 * sum(p.sum() for m in self.vision_modules() for p in m.parameters())
        if not loss_only:
            return self.head()(hidden)
        labels = batch["labels"]
        return self._target_ce(hidden, labels, "sum"), (labels != IGNORE_INDEX).sum()


STATE_PREFIX = HF_STATE_PREFIX


def tower_and_projector(hf_model) -> list[nn.Module]:
    """The vision modules of LLaVA, InternVL and Gemma 3 models: the vision tower and the multimodal projector."""
    return [hf_model.model.vision_tower, hf_model.model.multi_modal_projector]


def fsdp_units(model: HFModel) -> list[nn.Module]:
    """The transformers model's blocks outside its vision modules, outermost first, in model order.

    Blocks: the classes the model's ``_no_split_modules`` names (its decoder layers, and vision
    blocks, which stay in the root unit); without names, the entries of every ``nn.ModuleList``.
    """
    from ray_mmbatch.models import outermost_blocks

    names = set(getattr(model.hf_model, "_no_split_modules", None) or ())
    if names:
        return outermost_blocks(model, lambda m: type(m).__name__ in names, skip=model.vision_modules())
    in_list = {id(m) for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst}
    return outermost_blocks(model, lambda m: id(m) in in_list, skip=model.vision_modules())


def export_hf(model: nn.Module, cfg, directory, state_dict: dict | None = None) -> Path:
    """save_pretrained of the model + the tokenizer, and the checkpoint's processor files copied.

    ``state_dict``: the full weights with ``hf_model.`` keys stripped (FSDP: gathered on rank 0)."""
    from ray_mmbatch.data.text.encoder import tokenizer_for

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    hf = getattr(model, "module", model)
    hf = getattr(hf, "hf_model", hf)
    hf.save_pretrained(d, state_dict=state_dict)
    tokenizer_for(cfg.text).save_pretrained(d)
    from ray_mmbatch.formats.fetch import local_checkpoint

    src = Path(local_checkpoint(cfg.model.path))
    for name in _SIDE_FILES:
        if (src / name).is_file() and not (d / name).exists():
            shutil.copyfile(src / name, d / name)
    return d


def packed_mask_api(family: str) -> tuple:
    """(and_masks, blockwise_overlay, create_causal_mask, packed_sequence_mask_function, sliding_window_overlay,
    get_block_sequence_ids_for_mask): the transformers mask builders the Gemma backends' packed masks use, the last
    from ``family``'s modeling module (those of 5.25; an older release may lack them: ImportError, naming it)."""
    import importlib

    import transformers

    try:
        from transformers.masking_utils import (
            and_masks,
            blockwise_overlay,
            create_causal_mask,
            packed_sequence_mask_function,
            sliding_window_overlay,
        )
        block_ids = importlib.import_module(f"transformers.models.{family}.modeling_{family}"
                                            ).get_block_sequence_ids_for_mask
    except (ImportError, AttributeError) as e:
        raise ImportError(f"the {family} backend builds packed masks with transformers' masking_utils and {family} "
                          f"(written for 5.25); transformers {transformers.__version__} lacks part of it: {e}"
                          ) from None
    return (and_masks, blockwise_overlay, create_causal_mask, packed_sequence_mask_function, sliding_window_overlay,
            block_ids)
