"""The run settings that depend on the mode: the demo's, or a real fine-tune's when ``--model`` names a checkpoint.

The fields of ``TrainConfig`` below default to None ('auto'; ``output_dir`` to '') so a value the user gave
(a flag, ``--set``, a ``--config`` file) is told apart from one left to its mode. ``resolve_defaults(cfg)``
fills each one left, and records in ``train.defaults_from`` where the value came from. It runs once at the
config edge (``cli.config_from_args``); the library's own entry points (``run_training``, ``ingest.datasets``)
call it again for a ``Config()`` built in Python, where it finds nothing left to fill on a resolved config.

=================  ===========  =======================================================================
setting            demo         fine-tune (``--model``)
=================  ===========  =======================================================================
lr                 3e-3         full 1e-5 (LLaMA-Factory qwen2_5vl_full_sft.yaml; TRL SFTConfig: 2e-5),
                                LoRA / QLoRA 1e-4 (LLaMA-Factory qwen2_5vl_lora_sft.yaml; ms-swift)
warmup             10 steps     10 % of the run (warmup_ratio 0.1, LLaMA-Factory's VLM SFT examples)
length             60 steps     3 whole epochs (max_steps 0; num_train_epochs 3.0 there, HF's default)
checkpoints        every 20     every 25 % of the run and at the end (a save_steps below 1 in HF)
output_dir         runs/demo    runs/<the checkpoint folder's name>
=================  ===========  =======================================================================

The demo keeps its own settings: tests and docs depend on them. Pure module: no ray, no torch.
"""
from __future__ import annotations

from pathlib import PurePosixPath

from ray_mmbatch.config import Config

DEMO = "demo"
FULL = "full fine-tune"
LORA = "LoRA fine-tune"

_LLAMA_FACTORY = "LLaMA-Factory examples/train_{}/qwen2_5vl_{}_sft.yaml"

#: field -> {mode: (value, source)}
DEFAULTS: dict[str, dict[str, tuple[object, str]]] = {
    "lr": {
        DEMO: (3e-3, "the built-in model, trained from scratch"),
        FULL: (1e-5, f"{_LLAMA_FACTORY.format('full', 'full')} learning_rate; TRL SFTConfig's default is 2e-5"),
        LORA: (1e-4, f"{_LLAMA_FACTORY.format('lora', 'lora')} learning_rate; ms-swift's Qwen2-VL LoRA examples"),
    },
    "max_steps": {
        DEMO: (60, "a short run"),
        FULL: (0, "whole epochs, as LLaMA-Factory's and ms-swift's SFT examples run"),
    },
    "epochs": {
        DEMO: (1, ""),
        FULL: (3, "num_train_epochs 3.0 of LLaMA-Factory's Qwen2.5-VL SFT examples (HF TrainingArguments' default)"),
    },
    "warmup_steps": {
        DEMO: (10, ""),
        FULL: (0, "warm-up by warmup_ratio"),
    },
    "warmup_ratio": {
        DEMO: (0.0, "warm-up by warmup_steps"),
        FULL: (0.1, "warmup_ratio 0.1 of LLaMA-Factory's Qwen2.5-VL full and LoRA SFT examples"),
    },
    "checkpoint_every": {
        DEMO: (20, ""),
        FULL: (0.25, "a share of the run, as HF TrainingArguments reads a save_steps below 1: 4 checkpoints"),
    },
}


def mode(cfg: Config) -> str:
    """DEMO (the built-in model), LORA (--lora-rank, --qlora) or FULL (every other fine-tune of a checkpoint)."""
    if not cfg.model.path:
        return DEMO
    return LORA if cfg.model.lora_rank > 0 or cfg.model.qlora else FULL


def checkpoint_name(path: str) -> str:
    """The checkpoint folder's name: 'Qwen2-VL-2B-Instruct' of '/ckpts/Qwen2-VL-2B-Instruct/' or 's3://b/m/'."""
    return PurePosixPath(path.split("://", 1)[-1].replace("\\", "/").rstrip("/")).name or "model"


def default_for(field_name: str, run_mode: str) -> tuple[object, str]:
    """(value, source) of ``train.<field_name>`` in ``run_mode``; LoRA shares a full fine-tune's but its lr."""
    table = DEFAULTS[field_name]
    return table.get(run_mode) or table[FULL]


def resolve_defaults(cfg: Config) -> Config:
    """Fill every train setting left to its mode (None, or '' for output_dir), in place; return ``cfg``.

    ``cfg.train.defaults_from`` gets {field: "<mode> default: <source>"} for each one filled. A value the user set is
    never touched. A user's warmup_steps (> 0) alone wins over the mode's warmup_ratio (HF's rule), and a
    user's warmup_ratio alone turns off the demo's warmup_steps. Idempotent."""
    t, run_mode = cfg.train, mode(cfg)
    if t.warmup_ratio is None and t.warmup_steps:  # the user's warm-up steps: no ratio on top
        t.warmup_ratio = 0.0
        t.defaults_from["warmup_ratio"] = "off: warmup_steps is set"
    if t.warmup_steps is None and t.warmup_ratio:  # the user's warm-up ratio: no demo steps on top
        t.warmup_steps = 0
        t.defaults_from["warmup_steps"] = "off: warmup_ratio is set"
    for name in DEFAULTS:
        if getattr(t, name) is None:
            value, source = default_for(name, run_mode)
            setattr(t, name, value)
            t.defaults_from[name] = f"{run_mode} default" + (f": {source}" if source else "")
    if not t.output_dir:
        t.output_dir = f"runs/{checkpoint_name(cfg.model.path)}" if cfg.model.path else "runs/demo"
        t.defaults_from["output_dir"] = f"{run_mode} default" + (": named after the checkpoint" if cfg.model.path
                                                                 else "")
    return cfg


def by_mode(key: str) -> str | None:
    """The default of a setting left to the mode ("section.field"), as ``--help`` and the flags page state it
    ("auto: demo 0.003, full fine-tune 1e-05, LoRA fine-tune 0.0001"); None for every other setting."""
    section, _, name = key.partition(".")
    if section != "train":
        return None
    if name == "output_dir":
        return "auto: runs/demo, or runs/<checkpoint folder name> with --model"
    if name not in DEFAULTS:
        return None
    values = {m: default_for(name, m)[0] for m in (DEMO, FULL, LORA)}
    if values[LORA] == values[FULL]:
        return f"auto: demo {values[DEMO]!r}, fine-tune {values[FULL]!r}"
    return "auto: " + ", ".join(f"{m} {v!r}" for m, v in values.items())
