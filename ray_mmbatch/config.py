"""Settings as dataclasses, one docstring per field; YAML files plus CLI overrides.

A config is a nested dataclass (``Config``). ``load_config(path, overrides)``
reads a YAML file shaped like ``Config`` (sections ``image``, ``text``,
``budget``, ``model``, ``train``, ``data``) and then applies ``section.field``
overrides, so ``--config best.yaml --max-tokens 8192`` means the flag wins.
A field that a command-line flag sets names it where it is declared::

    max_tokens: int = flag("--max-tokens", 4096)

``cli_flags()`` collects them (cli.py's flags, each with its field's docstring as help);
every other field is set with ``--set section.field=value``. Pure module: no ray, no torch.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


def flag(name: str, default: Any) -> Any:
    """The default of a field that command-line flag ``name`` sets too (``field`` metadata "flag")."""
    return field(default=default, metadata={"flag": name})


@dataclass
class ImageConfig:
    """Images: decoding limits and the resize family that gives each image its patch grid and token count.

    A ``--model`` checkpoint sets the resize, sizes, mean and std from its preprocessor_config.json."""

    patch_size: int = flag("--patch-size", 14)
    """Side of a square vision patch, in pixels."""
    merge_size: int = flag("--merge-size", 2)
    """Spatial merge: merge_size x merge_size patches become one LM image token."""
    min_pixels: int = flag("--min-pixels", 4 * 28 * 28)
    """Smart resize lower bound on the resized image area (pixels)."""
    max_pixels: int = flag("--max-pixels", 256 * 28 * 28)
    """Smart resize upper bound on the resized image area (pixels); bounds image tokens per image. resize='budget'
    (Gemma 4): the patch budget, max_soft_tokens x pooling_kernel_size**2 patches of patch_size**2 pixels."""
    max_header_pixels: int = 89_478_485
    """Refuse (decompression_bomb) any image whose header says more pixels than this. Pillow's own guard stays on."""
    max_decoded_bytes: int = 256 * 2**20
    """Refuse (decompression_bomb) any image whose decoded pixels would take more bytes than this, judged from
    the header (width x height x bytes per pixel of its mode, 16-bit counted at 4) before decoding: a 157 KB
    16-bit 9000x9000 PNG. The default lets an 8-bit RGB image of max_header_pixels through. 0 = no limit."""
    allowed_formats: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
    """Pillow format names accepted; anything else is skipped as unsupported_format."""
    resize: str = "smart"
    """'smart' (Qwen-VL dynamic resolution: sides multiples of patch_size*merge_size within min/max_pixels,
    exactly as the HF Qwen2-VL processor) or 'fixed' (LLaVA / CLIP: shortest edge to image_size, centre crop
    to image_size x image_size; a fixed number of image tokens) or 'fixed_pad' (LLaVA do_pad: pad to a square
    of the mean colour first, then as 'fixed') or 'tiles' (InternVL: min_tiles..max_tiles image_size tiles in the
    grid closest to the image's aspect, plus a thumbnail tile when more than one, as HF's GotOcr2 processor)
    or 'squash' (Gemma 3: a plain bilinear resize to image_size x image_size, the aspect not kept, no crop)
    or 'anyres' (LLaVA-OneVision: a base tile plus crops of the grid_pinpoints resolution that fits best,
    one padded square tile per image in a sample of several images; tokens from the aspect, see data/image/anyres.py)
    or 'split' (Idefics3 / SmolVLM image splitting: Lanczos to the longest edge max_tiles * image_size, then rows x
    cols image_size views plus a global view) or 'global' (the same without splitting: one image_size view)
    or 'budget' (Gemma 4: the aspect kept, bicubic to sides that are multiples of patch_size*merge_size with an
    area of at most max_pixels, small images scaled up; see data/image/budget.py), 'pixtral' (Mistral 3: sides at
    most image_size, then rounded up to multiples of patch_size*merge_size; see data/image/pixtral.py)
    or 'smart_glm' (GLM-4.1V / 4.5V:
    'smart' with a side under patch_size*merge_size scaled up first and the area counted over temporal_patch_size
    frames, as HF's Glm4vImageProcessor; see data/image/smart.py)."""
    image_size: int = 336
    """resize='fixed' / 'squash' / 'tiles': side of the square image (tile) the vision tower sees (pixels).
    resize='pixtral': the longest edge (HF ``size['longest_edge']``)."""
    min_tiles: int = 1
    """resize='tiles': fewest tiles an image is cut into (the thumbnail not counted; HF ``min_patches``)."""
    max_tiles: int = 12
    """resize='tiles': most tiles an image is cut into (the thumbnail not counted; HF ``max_patches``): bounds
    the image tokens per image at (max_tiles + 1) x tokens per tile. resize='split' / 'global': the longest edge
    images are resized to, in views (HF ``size['longest_edge'] / max_image_size``), so at most max_tiles x
    max_tiles views plus the global one."""
    max_aspect: float = 200.0
    """Images whose long side over short side exceeds this are skipped (extreme_aspect); HF Qwen-VL refuses > 200."""
    fast_decode: bool = flag("--fast-decode", False)
    """Decode big JPEGs at a reduced DCT scale and resize with reducing_gap: faster, but the pixels are no
    longer bit-equal to the checkpoint's HF image processor."""
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    """Per-channel mean the model normalizes pixels with (x / 255 - mean) / std, on the training worker."""
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    """Per-channel std for the same normalization."""
    temporal_patch_size: int = 1
    """Frames per vision patch (Qwen-VL: 2; a still image is repeated over them on the worker)."""
    grid_pinpoints: tuple[int, ...] = ()
    """resize='anyres' (LLaVA-OneVision): the resolutions an image's crops may cover, flat (h1, w1, h2, w2, ...)
    (HF ``image_grid_pinpoints``); each a multiple of image_size."""
    anyres_max: int = 9
    """resize='anyres': HF ``vision_aspect_ratio`` 'anyres_max_N': the crops' features are pooled down to about
    N tiles' worth."""
    anyres_features: int = 0
    """resize='anyres': vision features per tile side (the tower's image_size // patch size; 27 at 384 / 14)."""
    video: str = ""
    """The HF video processor the cost model and pixels follow (data/video.py), named by the model_type it is
    written for ('qwen2_vl' serves qwen2_5_vl too; 'qwen3_vl': the pixel bounds cover the whole clip, timestamps
    in the text; 'llava_onevision'; 'gemma4': each frame an image of the video's own budget, ``mm:ss`` before it;
    'glm4v': GLM's fps sampler over the clip's duration, whole-clip bounds, each temporal patch an image block with
    its second after it).
    A ``--model`` checkpoint of a family that trains on video ({video_families}) sets it, and the
    video_* settings below, from its video_preprocessor_config.json (else preprocessor_config.json, as HF falls
    back). '' = the family takes no video: a video sample stops the run at start, naming the family."""
    video_sample_frames: bool | None = flag("--video-sample-frames", None)
    """HF ``do_sample_frames``: sample frames by video_fps / video_num_frames; false = every frame of the clip
    (Qwen2-VL's processor class default). None = the checkpoint's video processor; a Qwen2-VL / Qwen2.5-VL
    checkpoint that ships no video settings (the published ones) samples as qwen-vl-utils does: 2 fps, 4..768
    frames, 128..768 x 28 x 28 pixels a frame, the per-frame cap on. --video-fps turns sampling on."""
    video_fps: float | None = flag("--video-fps", None)
    """Frames sampled per second of video (HF ``fps``), within video_min_frames..video_max_frames; used when
    video_sample_frames is on and video_num_frames is unset. Setting it turns frame sampling on; the user's
    value wins over the checkpoint's."""
    video_num_frames: int | None = None
    """A fixed number of frames sampled from every clip (HF ``num_frames``; rounded to temporal_patch_size)."""
    video_min_frames: int = flag("--video-min-frames", 4)
    """Fewest frames fps sampling takes from a clip (HF ``min_frames``; LLaVA-OneVision, whose HF sampler has no
    bound, takes it as a floor on its count); the user's value wins over the checkpoint's."""
    video_max_frames: int = flag("--video-max-frames", 768)
    """Most frames fps sampling takes from a clip (HF ``max_frames``; a cap on LLaVA-OneVision's count); the
    user's value wins over the checkpoint's."""
    video_max_duration: float = 300
    """video='glm4v': HF Glm4vVideoProcessor ``max_duration``: a clip longer (in seconds) is sampled at
    max_duration x video_fps frames spread over the whole clip, instead of video_fps frames a second."""
    video_min_pixels: int = 128 * 28 * 28
    """Smart resize lower bound on a frame's area (HF video processor ``size['shortest_edge']``); on the whole
    clip's pixels (frames x area) for video='qwen3_vl' and 'glm4v', as their processors do."""
    video_max_pixels: int = flag("--video-max-pixels", 768 * 28 * 28)
    """Smart resize upper bound on a frame's area (HF video processor ``size['longest_edge']``); on the whole
    clip's pixels for video='qwen3_vl' and 'glm4v'."""
    video_cap_pixels_per_frame: bool = False
    """HF ``cap_pixels_per_frame`` (qwen-vl-utils' rule): each frame is also limited to an even share of
    video_max_tokens tokens' worth of pixels (90 %), floored at 1.05 x video_min_pixels."""
    video_max_tokens: int = flag("--video-max-tokens", 128000)
    """HF ``max_video_tokens`` (qwen-vl-utils' total pixel cap, in tokens): the budget cap_pixels_per_frame shares
    among a clip's frames (Qwen3-VL: a frame's tokens, as its processor has it; LLaVA-OneVision: the clip's
    tokens cap its frame count); the user's value wins over the checkpoint's and turns cap_pixels_per_frame on.
    --video-max-pixels is refused for LLaVA-OneVision (every frame is the tower's square)."""
    video_mean: tuple[float, ...] = ()
    """Per-channel mean for video pixels (the video processor's ``image_mean``); () = image_mean."""
    video_std: tuple[float, ...] = ()
    """Per-channel std for video pixels; () = image_std."""
    video_loader: str = flag("--video-loader", "torchcodec")
    """Which of HF's video loaders a clip is read as (frames are counted as the decoder outputs them in both):
    'torchcodec' (HF's video processors' default for a path, transformers.video_processing_utils.fetch_videos):
    frames turned to their display rotation (a phone's portrait clip stands upright), the rate = frames over the
    clip's span; 'pyav' (transformers.video_utils.load_video's default backend): frames as coded, the header's
    average rate. docs/data.md 'Which loader a clip is read as'."""

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this (patch_size * merge_size)."""
        return self.patch_size * self.merge_size


@dataclass
class TextConfig:
    """Text: the tokenizer, the chat template and which turns are targets."""

    tokenizer: str = flag("--tokenizer", "")
    """Path to a Hugging Face tokenizer directory; empty = the small BPE tokenizer shipped in the package."""
    train_on_prompt: bool = False
    """Also train on user/system tokens (default: only assistant answers are targets)."""
    chat_template: str = flag("--chat-template", "auto")
    """'auto' (the tokenizer's own chat template when it has one, else the plain format) or 'plain'
    (<|im_start|>role ... <|im_end|>, the built-in model's format)."""
    image_token: str = "<|image_pad|>"
    """The token an image slot expands to (one per image token); a checkpoint sets its own (LLaVA: <image>)."""
    video_token: str = ""
    """The token the chat template writes for a video (Qwen-VL ``<|video_pad|>``; one per video in text_ids,
    expanded by materialize); '' = the family takes no video. A ``--model`` checkpoint sets it."""
    family: str = ""
    """The checkpoint's model family as messages name it ('Gemma 4'), set by its backend's configure: a sample in a
    modality the data path does not train (audio) is skipped naming it."""
    image_block: tuple[str, ...] = ()
    """(token, text): the checkpoint's processor writes ``text`` in place of each ``token`` its chat template
    writes for an image, ``text`` holding ``image_token`` once, where the image's tokens go (Gemma 3:
    ('<start_of_image>', '\\n\\n<start_of_image><image_soft_token><end_of_image>\\n\\n')). Replaced in the
    render before tokenizing, so the ids are the processor's. Empty: the template writes ``image_token``."""
    image_break: str = ""
    """Pixtral / Mistral 3 ('[IMG_BREAK]'): the token that closes each row of an image's tokens but the last
    (the last closes with image_block's end token); measure writes one image token per row (data/row_breaks.py)."""
    tokenizer_class: str = ""
    """Set by ``configure`` (not a setting): the class AutoTokenizer chose for ``tokenizer`` and a digest of what
    it loaded ('module:Class:digest'). Preprocessing actors load that class directly, without AutoTokenizer's
    config machinery (which imports torch: ~1.7 CPU s an actor), and fall back to AutoTokenizer when the digest
    differs. '' = AutoTokenizer everywhere."""


@dataclass
class BudgetConfig:
    """Batches: pack or pad, the budgets every batch stays within, and the planner's windows and carry."""

    mode: str = flag("--mode", "pack")
    """'pack' (one packed sequence per batch) or 'pad' (rows padded to the longest)."""
    max_tokens: int = flag("--max-tokens", 4096)
    """Token budget per batch: sum of sequence lengths (pack) or rows x longest (pad)."""
    max_patches: int | None = flag("--max-patches", None)
    """Budget on vision-encoder patches per batch (None = unbounded)."""
    max_images: int | None = flag("--max-images", None)
    """Budget on images per batch (None = unbounded)."""
    max_frames: int | None = flag("--max-frames", None)
    """Most video frames (sampled frames of all videos) per batch; None = no limit. Video tokens already count in
    max_tokens; this bounds the decode and vision-encoder memory of clips."""
    max_samples: int | None = flag("--max-samples", None)
    """Budget on samples per batch (None = unbounded)."""
    attn_weight: float = flag("--attn-weight", 0.0)
    """Attention-cost term: cost = sum(tokens) + attn_weight * sum(tokens**2), checked against max_tokens."""
    algorithm: str = flag("--algorithm", "")
    """Planner algorithm name (batching registry); empty = the measured default for the mode."""
    window: int = flag("--window", 2048)
    """New samples planned together in one planning step of the stream."""
    carry: float | None = flag("--carry", None)
    """Under-filled batches held back into the next window, at most this fraction of the window
    (None = the measured default: pack 0.05, pad 0.10; 0 = plan every window on its own)."""
    oversize: str = flag("--oversize", "truncate")
    """Samples that fit no batch alone: 'truncate' the text to fit, or 'skip' them with a counted reason."""


@dataclass
class ModelConfig:
    """The model: a local Hugging Face checkpoint or the built-in one, attention, and what trains (freeze, LoRA)."""

    path: str = flag("--model", "")
    """A Hugging Face checkpoint directory (config.json + weights + tokenizer + preprocessor_config.json): a local
    folder, or a bucket URI (s3://, gs://, abfs://) that each node copies once into ~/.cache/ray_mmbatch/models
    (RAY_MMBATCH_MODEL_CACHE; formats/fetch.py); empty = the small built-in model, trained from scratch."""
    backend: str = flag("--backend", "auto")
    """Model backend (models/ registry): {backends}; 'auto' = from the checkpoint's model_type."""
    gradient_checkpointing: bool = flag("--gradient-checkpointing", False)
    """Recompute activations in the backward pass (HF models): less memory, ~30% more compute."""
    attn_implementation: str = flag("--attn-implementation", "auto")
    """HF models: 'auto' (flash_attention_2 on CUDA when flash_attn is installed, else sdpa), 'sdpa', 'eager',
    'flash_attention_2'."""
    vocab_size: int = 0
    """0 = taken from the tokenizer."""
    d_model: int = flag("--d-model", 128)
    """Language-model width."""
    n_layers: int = flag("--n-layers", 2)
    """Language-model decoder layers."""
    n_heads: int = flag("--n-heads", 4)
    """Language-model attention heads."""
    vision_d_model: int = flag("--vision-d-model", 96)
    """Vision-encoder width."""
    vision_layers: int = flag("--vision-layers", 1)
    """Vision-encoder layers."""
    vision_heads: int = 4
    """Vision-encoder attention heads."""
    mlp_ratio: float = 4.0
    """MLP hidden size over model width."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    attention: str = flag("--attention", "auto")
    """'sdpa' (block mask, works everywhere), 'flex' (PyTorch flex attention), 'flash' (flash-attn varlen), 'auto'."""
    freeze: str = flag("--freeze", "")
    """Parts that do not train, any of 'vision,projector,language' (models/trainable.py says which modules):
    e.g. 'vision' (LLaMA-Factory's freeze_vision_tower, ms-swift's --freeze_vit)."""
    lora_rank: int = flag("--lora-rank", 0)
    """LoRA rank through peft (0 = off): adapters on every nn.Linear of --lora-targets, everything else frozen."""
    lora_alpha: float = flag("--lora-alpha", 16.0)
    """LoRA scaling numerator (the update is alpha / rank * B @ A)."""
    lora_dropout: float = flag("--lora-dropout", 0.0)
    """Dropout on the LoRA branch's input."""
    lora_targets: str = flag("--lora-targets", "language")
    """Where LoRA goes: parts ('language', 'vision', 'projector', any subset; 'all' or 'all-linear' for all
    three, as peft / ms-swift / LLaMA-Factory name it) and/or module-name suffixes ('q_proj,v_proj'); the LM
    head never."""
    lora_dora: bool = flag("--lora-dora", False)
    """DoRA (peft use_dora; ms-swift --use_dora, LLaMA-Factory use_dora): weight-decomposed LoRA, a learned
    magnitude per output feature beside the low-rank direction update."""
    lora_rslora: bool = flag("--lora-rslora", False)
    """rsLoRA (peft use_rslora): scale the update by alpha / sqrt(rank) instead of alpha / rank."""
    lora_modules_to_save: str = flag("--lora-modules-to-save", "")
    """Modules trained in full beside the adapters and saved in the adapter (peft's modules_to_save,
    ms-swift's --modules_to_save, LLaMA-Factory's additional_target), by name or last name part:
    e.g. 'embed_tokens,lm_head' after adding tokens. Default none: the adapter holds LoRA weights only."""
    qlora: bool = flag("--qlora", False)
    """QLoRA: the HF checkpoint's linear layers in 4-bit NF4 (bitsandbytes) under the LoRA adapters; needs
    --lora-rank, a CUDA GPU (--use-gpu) and bitsandbytes, and is refused at start anywhere else."""
    merge_lora: bool = flag("--merge-lora", False)
    """Export a full HF checkpoint with the adapters folded in (OUTPUT_DIR/model), besides the adapter
    (OUTPUT_DIR/adapter)."""


@dataclass
class TrainConfig:
    """The run: Ray Train workers, steps and epochs, optimizer, precision, checkpoints, evaluation, trackers."""

    num_workers: int = flag("--num-workers", 1)
    """Ray Train workers (data-parallel ranks)."""
    use_gpu: bool = flag("--use-gpu", False)
    """Train on GPUs (one per worker)."""
    cpus_per_worker: float = 1.0
    """CPUs reserved by each Train worker."""
    gpus_per_worker: float = flag("--gpus-per-worker", 1.0)
    """GPUs per Train worker with use_gpu (a fraction shares one GPU, e.g. 0.5 for a 2-worker smoke test)."""
    worker_resource: str = flag("--train-resource", "")
    """Custom Ray resource each Train worker requires (one unit), e.g. 'train' on the nodes meant for training,
    so that on a CPU cluster Train workers never take the data nodes' slots; empty = anywhere (GPU runs are
    placed by their GPUs)."""
    precision: str = flag("--precision", "auto")
    """'auto' (bf16 on GPU, fp32 on CPU), 'bf16', 'fp32'."""
    lr: float | None = flag("--lr", None)
    """Peak AdamW learning rate. None / 'auto' = by mode (run/defaults.py): 3e-3 for the built-in model trained
    from scratch (the demo); with --model 1e-5 for a full fine-tune (LLaMA-Factory's qwen2_5vl_full_sft example;
    TRL's SFTConfig default is 2e-5) and 1e-4 with --lora-rank / --qlora (LLaMA-Factory's qwen2_5vl_lora_sft
    example, ms-swift's Qwen2-VL LoRA examples)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    warmup_steps: int | None = None
    """Linear warm-up steps, then cosine decay to 10% of the peak; when set (> 0) it wins over warmup_ratio, as in
    HF TrainingArguments. None / 'auto' = by mode: 10 for the demo, 0 with --model (warmup_ratio then)."""
    warmup_ratio: float | None = None
    """Linear warm-up over this share of the run (of max_steps, or of the samples when the run goes by epochs),
    then cosine decay over the rest to 10% of the peak. None / 'auto' = by mode: 0 for the demo (warmup_steps),
    0.1 with --model (warmup_ratio of LLaMA-Factory's Qwen2.5-VL full and LoRA SFT examples)."""
    grad_accum: int = flag("--grad-accum", 1)
    """Micro-batches per optimizer step."""
    grad_clip: float = 1.0
    """Max gradient norm (0 = off)."""
    max_steps: int | None = flag("--max-steps", None)
    """Optimizer steps to run; the cosine learning-rate schedule spans them. 0 = run all epochs, and the
    schedule follows the share of the samples done (counted up front from footers / indexes). None / 'auto' =
    by mode: 60 for the demo, 0 (whole epochs) with --model."""
    epochs: int | None = flag("--epochs", None)
    """Passes over the data, one after the other; each re-reads in its own order and re-plans with the
    epoch in the seed. None / 'auto' = by mode: 1 for the demo, 3 with --model (num_train_epochs of
    LLaMA-Factory's Qwen2.5-VL SFT examples and HF TrainingArguments' default)."""
    report_every: int = flag("--report-every", 5)
    """Report metrics every N optimizer steps."""
    eval_every: int = flag("--eval-every", 0)
    """With --eval-split / --eval-data: evaluate every N optimizer steps (0 = at the end only; always at the end)."""
    eval_cache_mb: int = flag("--eval-cache-mb", 1024)
    """Each rank keeps its held-out batches in memory after the first evaluation, up to this size (later ones
    then skip reading, decoding and planning); a larger share is read again each time (0 = never keep)."""
    checkpoint_every: float | None = flag("--checkpoint-every", None)
    """Checkpoint every N optimizer steps; a number below 1 is a share of the run (0.25: at each quarter of
    max_steps, or of the samples by epochs), as HF TrainingArguments reads a save_steps below 1; 0 = only at the
    end (there always). None / 'auto' = by mode: 20 for the demo, 0.25 with --model."""
    max_failures: int = flag("--max-failures", 2)
    """Worker-group restarts allowed (FailureConfig)."""
    seed: int = flag("--seed", 0)
    """Seed for model init, shuffles and plans."""
    deterministic: bool = flag("--deterministic", True)
    """Preserve order through Ray Data so batches are identical run to run (replay / resume by position)."""
    ledger: bool = flag("--ledger", False)
    """Record, per rank, which sample ids were trained (for exactly-once checks)."""
    output_dir: str = flag("--output-dir", "")
    """Where summary.json, metrics, logs and reports go: a local folder (or one every node mounts, for the
    per-rank logs of a multi-node run); checkpoints too unless ``storage`` says otherwise. '' = by mode:
    runs/demo for the demo, runs/<the checkpoint folder's name> with --model."""
    storage: str = flag("--storage", "")
    """Where Ray Train persists checkpoints: a folder every node can reach or a bucket URI (s3://, gs://,
    abfs://; credentials and AWS_ENDPOINT_URL from the environment). '' = OUTPUT_DIR/ray_storage."""
    run_name: str = flag("--run-name", "")
    """Run name (re-running with the same name resumes); empty = output_dir's name."""
    fsdp: bool = flag("--fsdp", False)
    """Shard parameters, gradients and optimizer state over the workers (FSDP2 fully_shard) instead of DDP."""
    export_hf: bool = True
    """HF models: save the trained model in HF format (save_pretrained: model, tokenizer, processor) to
    OUTPUT_DIR/model at the end, on rank 0's node)."""
    report_to: str = flag("--report-to", "")
    """Experiment trackers to log to besides OUTPUT_DIR's files, comma-separated: 'tensorboard' (event files in
    OUTPUT_DIR/tensorboard), 'wandb', 'mlflow' (where WANDB_* / MLFLOW_TRACKING_URI point); '' / 'none' = none.
    The driver logs them, from the records every rank sends it: the config once, then at every report each
    metric of metrics.jsonl and the skip counts, keyed by step (run/trackers.py). Optional installs:
    pip install 'ray_mmbatch[trackers]'; one asked for and missing stops the run at start."""
    fault_at_step: int = 0
    """Fault drill: rank 0 SIGKILLs its own process after this step, once per run dir (0 = off)."""
    defaults_from: dict = field(default_factory=dict)
    """Filled in, not set: {field: where its value came from} for each setting above that was left to its
    mode's default (run/defaults.py resolve_defaults), e.g. {"lr": "full fine-tune default: LLaMA-Factory ..."}."""


@dataclass
class DataConfig:
    """The data: where it is, its format and columns, splits and filters, sample order, the preprocessing pools."""

    path: str = flag("--data", "")
    """Dataset location: a file, folder or glob, as a local path or a URI of any pyarrow filesystem (s3://,
    gs://, abfs://, hdfs://, file://; credentials and AWS_ENDPOINT_URL from the environment); empty = generate
    a demo dataset under output_dir."""
    format: str = flag("--format", "auto")
    """'parquet', 'arrow' (a datasets.save_to_disk folder), 'webdataset', 'llava' or 'auto' (guessed from the path)."""
    image_root: str = flag("--image-root", "")
    """LLaVA format: image folder, a local path or a URI (default: the JSON file's folder)."""
    image_column: str = flag("--image-column", "images")
    """Parquet / Arrow: column with image structs {bytes, path} (or a list of them); with the default, a column
    named ``image`` (one nullable struct per row, LLaVA-OneVision) is taken when there is no ``images``;
    '' = no images (formats/layouts.py)."""
    video_column: str = flag("--video-column", "videos")
    """Parquet / Arrow column of the videos (HF ``Video`` structs {bytes, path}, binary, or paths read under
    --image-root); with the default, ``videos`` then ``video`` when such a column holds videos. '' = no videos."""
    text_column: str = flag("--text-column", "conversations")
    """Parquet / Arrow: the dialogue column; its layout is told from its type: list<{from, value}> (LLaVA),
    list<{role, content}> (HF messages), list<{user, assistant}> (The Cauldron ``texts``), struct<question: list,
    answer: list> (PixMo-Docs ``questions``) or a string (a caption). With the default, the first of
    conversations, messages, texts, questions, caption, txt that the schema holds (formats/layouts.py); a column
    named ``text`` is read only when named (``--text-column text``)."""
    caption_prompt: str = flag("--caption-prompt", "")
    """Caption layouts (a caption / txt column, img2dataset ``KEY.txt``): the user turn's text after the image
    ('' = the image alone); the caption is the answer."""
    split: str = flag("--split", "train")
    """Which split of a folder is read, its files' splits named by HF ``datasets``' own data-file patterns
    (``data/{split}-00000-of-00002.parquet`` shards, custom names such as ``train_sft`` included; a ``train/`` or
    ``train2017/`` folder; ``test_0.jsonl``, ``my-dataset.dev.jsonl``; a save_to_disk DatasetDict); files of
    other splits are never read. ``--data PATH#split=NAME`` / ``--eval-data PATH#split=validation`` pick one per
    dataset (formats/splits.py)."""
    filter: str = flag("--filter", "")
    """Keep only rows whose scalar columns pass this, e.g. "relevance_min >= 4" or "source == 'ai2d' and
    formatting_min >= 3" (==, !=, <, <=, >, >=, in [...]; clauses joined by 'and'). Parquet / Arrow; filtered
    rows are counted per source as filtered (not skipped) and never decoded (formats/filters.py)."""
    id_column: str = flag("--id-column", "id")
    """Parquet: sample id column (missing = derived from file and row)."""
    demo_samples: int = flag("--demo-samples", 600)
    """Samples generated when no dataset is given."""
    data_resource: str = flag("--data-resource", "")
    """Custom Ray resource that preprocessing stages require (e.g. 'preprocess' on CPU nodes); empty = anywhere."""
    preprocess_workers: int | None = flag("--preprocess-workers", None)
    """Actors of each of the measure and materialize pools (1 CPU each); None / 'auto' = sized from the
    cluster: the pools start at 2 and may grow to the CPU slots the nodes offering --data-resource have (or
    the whole cluster's less the Train workers'), measure ~1/5 and materialize the rest; an epoch of at most
    512 samples runs each pool on one actor (pools.py). A number pins both pools at that size; a run whose
    pools cannot be placed stops at start saying why."""
    sources: list = field(default_factory=list)
    """Several datasets trained together (instead of ``path``): a list of mappings, each with ``path`` and
    optionally ``name``, ``weight`` and any data setting of its own (``format``, ``image_root``, the column
    names...). On the command line: ``--data`` repeated, ``PATH`` or ``PATH#WEIGHT``. Sample ids get the
    source's name in front (``name:id``), so two sources may share ids (formats/sources.py)."""
    epoch_samples: int = flag("--epoch-samples", 0)
    """With sources blended by weight: samples per epoch (0 = as many as the sources hold together)."""
    eval_split: float = flag("--eval-split", 0.0)
    """Hold this fraction of --data out of training for evaluation, chosen by a hash of each sample id (stable
    across runs, resumes and epochs; data/split.py). 0 = none."""
    eval_data: str = flag("--eval-data", "")
    """A separate held-out dataset (same forms and format options as --data); overrides --eval-split."""
    shuffle: str = flag("--shuffle", "samples")
    """Sample order of every epoch, the first included, seeded by (train.seed, epoch): 'samples' (the read
    units in a seeded order, then a seeded shuffle buffer of shuffle_buffer samples before planning),
    'units' (the seeded unit order only), 'none' (listing order: for debugging and reproducing).
    batching/shuffle.py draws it; benchmarks/bench_mixing.py measures it."""
    shuffle_buffer: int = flag("--shuffle-buffer", 16384)
    """Samples in the shuffle buffer of --shuffle samples (light rows in the plan actor, ~250 bytes each;
    their image bytes wait in the payload holders meanwhile). Mixing spans about this many samples plus the
    read units around them: raise it for large units or many subsets."""
    shuffle_ramp: float = flag("--shuffle-ramp", 0.1)
    """While the shuffle buffer grows to --shuffle-buffer, this share of the rows read goes on to planning
    (batching/shuffle.py), so the first batch comes after ~32 / ramp samples are measured whatever the
    buffer's size; the first ~buffer / (1 - ramp) samples of an epoch are then mixed over the rows read so
    far. 0 = fill the whole buffer before the first batch (best-mixed start, slowest first batch)."""
    stall_timeout_s: float = flag("--stall-timeout", 1800.0)
    """Stop the run when a Train worker gets no batch for this many seconds (train/stall.py): the message names
    the actors Ray cannot place and the free resources. 0 = wait forever."""
    measure_batch: int = 64
    """Rows per measure call (tokenizer batch)."""
    payload_memory_mb: float = 2048.0
    """Memory for measured samples waiting between measure and materialize (their image bytes), over all
    payload holders of a training stream (payloads.py, plus up to a quarter of it for recently released rows
    kept for retries): beyond it rows spill to local disk under payload_spill_dir, so a slow consumer never
    makes the holders keep an epoch of images in memory. 0 = no bound (never spill)."""
    payload_spill_dir: str = ""
    """Folder for spilled payloads on each holder's node ('' = the system temp folder); deleted at exit."""
    max_file_bytes: int = 64 * 2**20
    """Largest image file / tar member read (bytes; from the tar header or stat, before reading); larger ones
    are skipped as file_too_large. 0 = no limit."""
    max_text_chars: int = 262_144
    """Text characters kept per sample before tokenizing (the rest is cut, so --oversize then truncates or
    skips the sample as for any long one): a 50 MB cell never reaches the tokenizer whole. The default is
    more than a 32k-token budget uses at 8 characters per token (tokenizing it: ~0.1 s, ~40 MB); raise it
    with larger budgets. 0 = no limit."""
    max_skip_fraction: float = flag("--max-skip-fraction", 0.5)
    """Stop the run when more than this share of the samples seen is skipped (judged from 50 samples on,
    or at the end of a smaller dataset; also on the first samples before the run): a wrong --image-root or
    column should fail with its reasons, not train on what is left. 1 = never stop."""


@dataclass
class Config:
    image: ImageConfig = field(default_factory=ImageConfig)
    text: TextConfig = field(default_factory=TextConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def cli_flags() -> dict[str, str]:
    """flag -> "section.field" for every field declared with ``flag(...)``, in Config's order."""
    flags: dict[str, str] = {}
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory):
            name = f.metadata.get("flag")
            if name is None:
                continue
            if name in flags:
                raise ValueError(f"flag {name} is declared twice: {flags[name]} and {section.name}.{f.name}")
            flags[name] = f"{section.name}.{f.name}"
    return flags


def flag_for(key: str) -> str:
    """How a user sets config field ``key`` ("section.field") on the command line: its flag, else ``--set KEY``."""
    return next((name for name, k in cli_flags().items() if k == key), f"--set {key}")


#: Fields where None means "auto" and the word auto sets it back.
AUTO_FIELDS = {"data.preprocess_workers", "train.lr", "train.warmup_steps", "train.warmup_ratio", "train.max_steps",
               "train.epochs", "train.checkpoint_every"}


_ITEM_TYPES = {"int": int, "float": float, "str": str}


def _coerce(value: Any, current: Any, name: str, annotation: str = "") -> Any:
    if name in AUTO_FIELDS and (value is None or (isinstance(value, str) and value.lower() in ("auto", "none"))):
        return None
    if isinstance(current, bool):
        if isinstance(value, str):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"{name}: expected a boolean, got {value!r}")
        return bool(value)
    if isinstance(current, tuple):
        if isinstance(value, str):  # --set image.image_mean=0.5,0.5,0.5
            value = [v.strip() for v in value.split(",") if v.strip()]
        # the items' type from the field's annotation ("tuple[float, ...]"): an empty default tells nothing
        item = annotation.partition("[")[2].partition(",")[0].strip()
        kind = _ITEM_TYPES.get(item) or (type(current[0]) if current else str)
        return tuple(kind(v) for v in value)
    if value is None or current is None:
        if isinstance(value, str) and value.lower() in ("none", "null", "", "auto"):
            return None
        if annotation.startswith("bool") and value is not None:  # bool | None: 'false' is False, not a string
            return _coerce(value, False, name)
        if isinstance(value, str):  # every None-default field is numeric: "3" -> 3, "0.05" -> 0.05
            try:
                return int(value)
            except ValueError:
                try:
                    return float(value)
                except ValueError:
                    return value
        return value
    if isinstance(current, list):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name}: expected a list (a YAML list in --config, or --data repeated), got {value!r}")
        return list(value)
    return type(current)(value)


def apply_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """Set ``section.field`` keys; unknown keys raise with the valid names."""
    for key, value in overrides.items():
        section_name, _, field_name = key.partition(".")
        section = getattr(cfg, section_name, None)
        if section is None or not dataclasses.is_dataclass(section):
            raise KeyError(f"unknown config section {section_name!r} in {key!r}")
        fields = {f.name: f for f in dataclasses.fields(section)}
        if field_name not in fields:
            raise KeyError(f"unknown setting {key!r}; {section_name} has {sorted(fields)}")
        setattr(section, field_name, _coerce(value, getattr(section, field_name), key, str(fields[field_name].type)))
    return cfg


def flatten(d: dict[str, Any]) -> dict[str, Any]:
    return {f"{s}.{k}": v for s, sub in d.items() for k, v in (sub or {}).items()}


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    cfg = Config()
    if path:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping of sections")
        apply_overrides(cfg, flatten(loaded))
    apply_overrides(cfg, overrides or {})
    return cfg


#: fields (and data.sources keys) holding a dataset, checkpoint or tokenizer location
_LOCATION_FIELDS = ("data.path", "data.image_root", "data.eval_data", "model.path", "text.tokenizer", "train.storage")


def _absolute(value: str) -> str:
    """A relative local path that exists here, made absolute (its ``#...`` options kept); anything else as is."""
    if not isinstance(value, str) or not value or "://" in value:
        return value
    base, sep, options = value.partition("#")
    if os.path.isabs(base) or not os.path.exists(base):
        return value
    return os.path.abspath(base) + sep + options


def absolute_locations(cfg: Config) -> Config:
    """Make the relative local paths of ``cfg`` absolute, from the directory the command was started in.

    The driver resolves them: Ray Train's controller, the Train workers and the Ray Data tasks run in other
    working directories, where ``--data my_data/`` would name nothing. A path that does not exist here (a typo,
    or one that only exists on the cluster's nodes) is left as written, for the preflight to name."""
    for key in _LOCATION_FIELDS:
        section, name = key.split(".")
        sec = getattr(cfg, section)
        setattr(sec, name, _absolute(getattr(sec, name)))
    for source in cfg.data.sources:
        if isinstance(source, dict):
            for name in ("path", "image_root", "eval_data"):
                if name in source:
                    source[name] = _absolute(source[name])
    return cfg


def save_config(cfg: Config, path: str | Path) -> None:
    """``cfg`` as YAML, for ``--config``. A train setting its mode filled (``train.defaults_from``) is written as
    auto (null, '' for output_dir), so it is filled again for the run that loads it: tune's best.yaml of a
    demo run must not hand the demo's 3e-3 to a ``--model`` fine-tune as if the user had set it."""
    d = cfg.to_dict()
    for name in d["train"].pop("defaults_from", None) or {}:
        d["train"][name] = "" if name == "output_dir" else None
    for section in d.values():
        for k, v in section.items():
            if isinstance(v, tuple):
                section[k] = list(v)
    Path(path).write_text(yaml.safe_dump(d, sort_keys=False))
