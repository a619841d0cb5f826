"""Conversations: the roles and the placeholder rule, one conversation -> [(role, content)].

Roles are matched in one place (case-insensitively, through schema.canonical_role): LLaVA
human/gpt, OpenAI user/assistant, system. ``<image>`` is an image slot only in user turns
of samples that have images; a conversation that cannot be used raises ``TextSkip``.

Imports no other text module (plain, template and the encoder import this one). Pure:
no ray, no torch.
"""
from __future__ import annotations

from typing import Any

from ray_mmbatch import schema as S
from ray_mmbatch.data.errors import SampleSkip

# the one place roles are matched (case-insensitively): LLaVA human/gpt, OpenAI user/assistant
_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}  # of schema.canonical_role's names
USER, ASSISTANT = "user", "assistant"


class TextSkip(SampleSkip):
    """A conversation that cannot be used; ``reason`` is a schema.SKIP_* constant."""


def conversation_turns(conv: Any, n_images: int, family: str = "") -> list[tuple[str, str]]:
    """Validate one conversation -> [(role, content)] with exactly n_images placeholders in user turns; a user turn
    with an ``<audio>`` slot is refused (unsupported_modality), naming ``family`` (TextConfig.family)."""
    if not isinstance(conv, (list, tuple)):
        raise TextSkip(S.SKIP_MALFORMED_RECORD, f"conversation is {type(conv).__name__}, not a list")
    turns = []
    for i, t in enumerate(conv):
        if not isinstance(t, dict):
            raise TextSkip(S.SKIP_MALFORMED_RECORD, f"turn {i} is {type(t).__name__}, not a dict")
        role_key, content_key = ("from", "value") if "from" in t else ("role", "content")
        if role_key not in t or content_key not in t:
            raise TextSkip(S.SKIP_MALFORMED_RECORD, f"turn {i} needs from/value or role/content, has {sorted(t)}")
        role = _ROLES.get(S.canonical_role(t[role_key]))
        if role is None:
            raise TextSkip(S.SKIP_MALFORMED_RECORD, f"turn {i}: unknown role {t[role_key]!r}")
        content = t[content_key]
        if not isinstance(content, str):
            raise TextSkip(S.SKIP_TEXT_ENCODING, f"turn {i}: content is {type(content).__name__}, not str")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TextSkip(S.SKIP_TEXT_ENCODING, f"turn {i}: {e.reason} at {e.start}") from None
        turns.append((role, content))
    audio = next((i for i, (r, c) in enumerate(turns) if r == USER and S.AUDIO_PLACEHOLDER in c), None)
    if audio is not None:
        raise TextSkip(S.SKIP_UNSUPPORTED_MODALITY, f"audio in turn {audio}: {family or 'this model'} is trained on "
                       "text and images here, not audio")
    # The placeholder rule (one place): user turns hold exactly one <image> per image, or none (then
    # the images go first in the first user turn). More placeholders than images - a sample that lost
    # its image on the way (null column, missing member or field) - is skipped, never trained as text.
    found = sum(c.count(S.IMAGE_PLACEHOLDER) for r, c in turns if r == USER)
    if n_images <= 0 and not found:
        return turns
    if found == 0:  # HF datasets convention: images go first in the first user turn
        slots = S.IMAGE_PLACEHOLDER * n_images
        first_user = next((i for i, (r, _) in enumerate(turns) if r == USER), None)
        if first_user is None:
            at = next((i for i, (r, _) in enumerate(turns) if r != "system"), len(turns))
            turns.insert(at, (USER, slots))
        else:
            turns[first_user] = (USER, slots + "\n" + turns[first_user][1])
    elif found != n_images:
        raise TextSkip(S.SKIP_PLACEHOLDER_MISMATCH, f"{found} {S.IMAGE_PLACEHOLDER} placeholders for {n_images} images")
    return turns
