"""A checkpoint's tokenizer in the preprocessing actors: the class AutoTokenizer chose on the driver, loaded
directly (no torch import), is the tokenizer AutoTokenizer loads, for the classes real checkpoints name in
their tokenizer_config.json; a hint that does not match falls back to AutoTokenizer."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from chat_templates import QWEN2_VL
from hf_checkpoints import start_checkpoint

from ray_mmbatch.data.text import tokenizer as T

ROOT = Path(__file__).resolve().parents[1]
# what published checkpoints write in tokenizer_config.json over a byte-level BPE like the shipped one: Qwen2-VL /
# Qwen2.5-VL / Qwen3-VL ("Qwen2Tokenizer"), llava-hf's Llama-3-based ones ("LlamaTokenizer": over a ByteLevel
# tokenizer.json AutoTokenizer loads TokenizersBackend instead), and what save_pretrained writes in transformers 5.
# (GemmaTokenizer needs Gemma's own <unk>-bearing vocabulary, which the shipped BPE is not.)
CLASSES = ("Qwen2Tokenizer", "LlamaTokenizer", "TokenizersBackend")
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
CONV = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in it? Ünïcode ✓"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat on a mat."}]}]


def _what(tok) -> dict:
    """What measure reads of a tokenizer."""
    return {"class": type(tok).__name__, "len": len(tok), "pad": tok.pad_token_id, "eos": tok.eos_token_id,
            "template": list(tok.apply_chat_template(CONV, tokenize=True, return_dict=False)),
            "batch": tok(["plain words", "<|image_pad|><|image_pad|> x"], add_special_tokens=False)["input_ids"],
            "specials": sorted(T.special_ids(tok).items())}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name in CLASSES:
        d, _ = start_checkpoint(tmp_path_factory.mktemp(name), SPECIAL, QWEN2_VL)
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["tokenizer_class"] = name
        cfg_path.write_text(json.dumps(cfg))
        out[name] = d
    return out


def test_actor_loads_the_class_autotokenizer_chose_without_torch(checkpoints):
    from transformers import AutoTokenizer

    expected, hints = {}, {}
    for name, d in checkpoints.items():
        auto = T._load_tokenizer(str(d), "auto")  # AutoTokenizer, as the driver's configure loads it
        hints[name] = T.resolved_class(auto)
        assert hints[name].count(":") == 2, hints[name]
        assert type(auto) is type(AutoTokenizer.from_pretrained(str(d)))
        expected[name] = _what(auto)
    # a fresh process, as a preprocessing actor is: every tokenizer from its hint, and torch never imported
    code = (
        "import json, sys\n"
        "from ray_mmbatch.data.text import tokenizer as T\n"
        "from test_tokenizer_load import _what\n"
        "jobs = json.loads(sys.argv[1])\n"
        "out = {n: dict(_what(T.load_tokenizer(p, 'auto', h)), hint=T.resolved_class(T.load_tokenizer(p, 'auto')))\n"
        "       for n, (p, h) in jobs.items()}\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'out': out}))\n")
    jobs = {n: (str(d), hints[n]) for n, d in checkpoints.items()}
    res = subprocess.run([sys.executable, "-c", code, json.dumps(jobs)], capture_output=True, text=True,
                         cwd=ROOT / "tests", env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "PATH": "/usr/bin:/bin"},
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["torch"] is False
    for name in CLASSES:
        want = json.loads(json.dumps(expected[name]))  # tuples as JSON gives them back
        assert {k: v for k, v in got["out"][name].items() if k != "hint"} == want, name
        assert got["out"][name]["hint"] == hints[name]  # loaded directly: the digest matched


def test_a_hint_that_does_not_match_loads_with_autotokenizer(checkpoints):
    d = str(checkpoints["Qwen2Tokenizer"])
    right = T.resolved_class(T._load_tokenizer(d, "auto"))
    module, cls, digest = right.split(":")
    for wrong in (f"{module}:{cls}:{'0' * len(digest)}",  # another tokenizer's digest
                  "transformers.models.gemma.tokenization_gemma:GemmaTokenizer:" + digest,  # another class
                  "os:system:" + digest,  # not a transformers class: never imported from a hint
                  "garbage"):
        tok = T._load_tokenizer(d, "auto", wrong)
        assert T.resolved_class(tok) == right, wrong  # AutoTokenizer loaded it again
        assert _what(tok) == _what(T._load_tokenizer(d, "auto"))


def test_configure_names_the_class_for_a_checkpoint_and_nothing_for_the_shipped_tokenizer(checkpoints):
    from ray_mmbatch.config import Config
    from ray_mmbatch.models import configure

    cfg = configure(Config())
    assert cfg.text.tokenizer == "" and cfg.text.tokenizer_class == ""
    cfg = Config()
    cfg.text.tokenizer = str(checkpoints["TokenizersBackend"])
    cfg = configure(cfg)
    assert cfg.text.tokenizer_class == T.resolved_class(T.load_tokenizer(cfg.text.tokenizer))
    assert cfg.text.tokenizer_class.startswith("transformers.tokenization_utils_tokenizers:TokenizersBackend:")
    right = cfg.text.tokenizer_class
    cfg.text.tokenizer_class = "garbage"  # a stale or edited config: configure names what this process loaded
    assert configure(cfg).text.tokenizer_class == right
