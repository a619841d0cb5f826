"""Tokenizer loading: a fast HF tokenizer set up for one conversation format, and its special ids.

``load_tokenizer`` loads (and caches per process) the shipped byte-level BPE or a
checkpoint's tokenizer for the template format (the vocabulary untouched) or the plain
format (schema.SPECIAL_TOKENS added); ``uses_template`` says which one a tokenizer was
loaded for. Checking a TextConfig's image token needs the encoder: encoder.tokenizer_for.

The bottom of the text package: imports no other text module. Pure: transformers /
tokenizers, no ray, no torch (the shipped tokenizer loads without AutoTokenizer, which
imports torch).
"""
from __future__ import annotations

import hashlib
import json
import os
import weakref
from pathlib import Path
from typing import Any

from ray_mmbatch import schema as S

SHIPPED_TOKENIZER = Path(__file__).resolve().parents[2] / "assets" / "tokenizer"


def load_tokenizer(path: str = "", chat_template: str = "auto", resolved: str = ""):
    """A fast HF tokenizer (cached per process, path and chat_template).

    Empty path = the byte-level BPE shipped in ray_mmbatch/assets/tokenizer. Template
    mode (``auto`` and the tokenizer has a chat template) adds NOTHING to the vocabulary
    (the checkpoint's embeddings fit it); a missing pad token becomes eos (else unk).
    Plain mode adds the missing schema.SPECIAL_TOKENS (the vocabulary may grow; the
    model reads ``len(tok)``) and a pad token when there is none.

    ``resolved``: what ``resolved_class`` said of this tokenizer where AutoTokenizer loaded it (the driver,
    through ``configure``: TextConfig.tokenizer_class): the class is loaded directly, skipping AutoTokenizer's
    config machinery, which imports torch (~1.7 CPU s a preprocessing actor); loaded otherwise (or
    AutoTokenizer again) when the digest differs.
    """
    if chat_template not in ("auto", "plain"):
        raise ValueError(f"chat_template must be 'auto' or 'plain', got {chat_template!r}")
    from ray_mmbatch.formats.fetch import local_checkpoint  # a tokenizer in a bucket: this node's copy

    key = (str(local_checkpoint(str(path or "")) or SHIPPED_TOKENIZER), chat_template)
    if key not in _LOADED:
        if len(_LOADED) >= 8:
            _LOADED.pop(next(iter(_LOADED)))
        _LOADED[key] = _load_tokenizer(*key, resolved)
    return _LOADED[key]


_TEMPLATE_MODE: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_LOADED: dict[tuple[str, str], Any] = {}  # (path, chat_template) -> tokenizer, per process
_RESOLVED: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # tokenizer -> resolved_class


def resolved_class(tok) -> str:
    """'module:Class:digest' of a tokenizer load_tokenizer loaded from a checkpoint, for ``resolved`` in the
    processes that load it next; '' for the shipped tokenizer, a class outside transformers (remote code)
    and Mistral's own backend: those load as they always do."""
    return _RESOLVED.get(tok, "")


def _name_and_digest(tok) -> str:
    """resolved_class of a tokenizer AutoTokenizer just loaded (before load_tokenizer's own changes)."""
    cls = type(tok)
    if (not getattr(tok, "is_fast", False) or not cls.__module__.startswith("transformers.")
            or "Mistral" in cls.__qualname__ or "." in cls.__qualname__):
        return ""  # a slow tokenizer is refused below, with its own message
    return f"{cls.__module__}:{cls.__qualname__}:{_digest(tok)}"


def _digest(tok) -> str:
    """What the two loads must agree on: the Rust tokenizer (vocabulary, merges, normalizer, pre-tokenizer,
    post-processor, added tokens), the special tokens, the chat template, padding and truncation sides."""
    h = hashlib.blake2b(digest_size=12)
    for part in (tok.backend_tokenizer.to_str(), repr(sorted((k, str(v)) for k, v in tok.special_tokens_map.items())),
                 str(getattr(tok, "chat_template", None)), str(tok.padding_side), str(tok.truncation_side),
                 str(tok.model_max_length)):
        h.update(part.encode("utf-8", "surrogatepass") + b"\x00")
    return h.hexdigest()


def _direct(path: str, resolved: str):
    """The tokenizer class ``resolved`` names, loaded as AutoTokenizer's last step loads it; None when the
    name does not import or the digest differs (then AutoTokenizer loads it)."""
    import importlib

    try:
        module, qualname, digest = resolved.split(":")
        if not module.startswith("transformers."):
            return None
        cls = getattr(importlib.import_module(module), qualname)
        tok = cls.from_pretrained(path, _from_auto=True)
        return tok if _digest(tok) == digest else None
    except Exception:  # noqa: BLE001 - a hint only: AutoTokenizer loads it, and raises what is wrong
        return None


def _load_tokenizer(path: str, chat_template: str, resolved: str = ""):
    from tokenizers import AddedToken

    if os.path.realpath(path) == os.path.realpath(SHIPPED_TOKENIZER):
        # Ours is a plain tokenizer.json: the generic fast class loads it without
        # AutoTokenizer's config machinery, which imports torch (~1.4 s per actor).
        from transformers import PreTrainedTokenizerFast as loader

        tok = loader.from_pretrained(path)
    else:
        tok = _direct(path, resolved) if resolved else None
        if tok is None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path)
            resolved = _name_and_digest(tok)
        _RESOLVED[tok] = resolved
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"{path}: a fast (Rust) tokenizer is required, got {type(tok).__name__}")
    if chat_template == "auto" and not getattr(tok, "chat_template", None):
        tok.chat_template = _processor_chat_template(path)
    template = chat_template == "auto" and bool(tok.chat_template)
    if template:
        if tok.pad_token is None:
            if tok.eos_token is None and tok.unk_token is None:
                raise ValueError(f"{path}: no pad, eos or unk token to pad with (template mode adds no tokens)")
            tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    else:
        vocab = tok.get_vocab()
        missing = [t for t in S.SPECIAL_TOKENS if t not in vocab]
        if missing:
            tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in missing], special_tokens=True)
        if tok.pad_token is None:
            tok.add_special_tokens({"pad_token": S.PAD_TOKEN})
    _TEMPLATE_MODE[tok] = template
    return tok


def _processor_chat_template(path: str) -> str | None:
    """A checkpoint whose template sits with its processor (llava-hf: chat_template.json), not its tokenizer."""
    for name in ("chat_template.json", "processor_config.json"):
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                template = json.load(f).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(template, str) and template:
            return template
    return None


def uses_template(tok) -> bool:
    """Whether conversations go through the tokenizer's own chat template (see load_tokenizer)."""
    mode = _TEMPLATE_MODE.get(tok)
    return bool(getattr(tok, "chat_template", None)) if mode is None else mode


def token_id(tok, token: str) -> int | None:
    """The id of ``token`` as one vocabulary entry, None when the tokenizer has no such token."""
    i = tok.convert_tokens_to_ids(token)
    return None if i is None or tok.convert_ids_to_tokens(int(i)) != token else int(i)


def special_ids(tok) -> dict[str, int]:
    """Token id of every schema.SPECIAL_TOKENS entry this tokenizer has (all of them in plain mode)."""
    ids = {t: token_id(tok, t) for t in S.SPECIAL_TOKENS}
    return {t: i for t, i in ids.items() if i is not None}
