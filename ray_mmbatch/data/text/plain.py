"""The plain format (``text.chat_template=plain``, or a tokenizer without a chat template)::

    <|im_start|>{role}\\n{content}<|im_end|>\\n          role: system | user | assistant
    target mask:  0 ....... 0  1 ... 1   1      0     (assistant turns; all 0 for system/user)

an image slot is ``<|vision_start|>{image_token}<|vision_end|>``.

Imports conversations only (DataEncoder for type checkers); the encoder imports this module,
never the other way. Pure: no ray, no torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ray_mmbatch import schema as S
from ray_mmbatch.data.text.conversations import ASSISTANT, USER

if TYPE_CHECKING:
    from ray_mmbatch.data.text.encoder import DataEncoder


def plain_pieces(turns: list[tuple[str, str]], has_images: bool, train_on_prompt: bool, enc: DataEncoder):
    """[(token id | text str, target, has trainable content)] in sequence order."""
    sp = enc.special
    frame = int(train_on_prompt)
    out: list[tuple[int | str, int, bool]] = []
    for role, content in turns:
        target = 1 if (role == ASSISTANT or train_on_prompt) else 0
        out += [(sp[S.IM_START], frame, False), (f"{role}\n", frame, False)]
        parts = content.split(S.IMAGE_PLACEHOLDER) if (has_images and role == USER) else [content]
        for j, part in enumerate(parts):
            if j:
                out += [(sp[S.VISION_START], 0, False), (enc.image_id, 0, False), (sp[S.VISION_END], 0, False)]
            if part:
                out.append((part, target, bool(target)))
        out += [(sp[S.IM_END], target, False), ("\n", frame, False)]
    return out
