"""Text (data/text.py moved to data/text/template.py; the split along its seams follows)."""
from __future__ import annotations

from ray_mmbatch.data.text.template import (
    SHIPPED_TOKENIZER,
    ChatTemplateError,
    TextSkip,
    encode_conversations,
    image_token_id,
    load_tokenizer,
    special_ids,
    tokenizer_for,
    uses_template,
)

__all__ = ["SHIPPED_TOKENIZER", "ChatTemplateError", "TextSkip", "encode_conversations", "image_token_id",
           "load_tokenizer", "special_ids", "tokenizer_for", "uses_template"]
