"""Text: the tokenizer, the two conversation formats, image slots and the target mask.

Two formats (``TextConfig.chat_template``):

* **template** (``auto`` and the tokenizer has a chat template: a user's checkpoint):
  the checkpoint's own Jinja template renders the messages; the vocabulary is untouched.
* **plain** (``plain``, or no chat template: the shipped tokenizer): ``<|im_start|>{role}``
  turns, assistant turns are targets.

Either way every image has ONE image token (materialize expands it to the image's token
count), ``<image>`` is an image slot only in user turns of samples that have images, and
special tokens come only from the format, never from data.

Modules, each importing only those listed before it:

* ``tokenizer``: load_tokenizer (one tokenizer per format, cached), uses_template, special_ids
* ``conversations``: the roles and the placeholder rule, TextSkip
* ``plain``: the plain format's pieces
* ``template``: the chat template format (renders, layouts per conversation shape), ChatTemplateError
* ``encoder``: encode_conversations, image_token_id, tokenizer_for

Code in this repository imports from those modules; the names below are the package's
public API. Pure package: transformers / tokenizers / jinja2 + numpy, no ray, no torch.
"""
from __future__ import annotations

from ray_mmbatch.data.text.conversations import TextSkip
from ray_mmbatch.data.text.encoder import encode_conversations, image_token_id, tokenizer_for
from ray_mmbatch.data.text.tokenizer import load_tokenizer

__all__ = ["TextSkip", "encode_conversations", "image_token_id", "load_tokenizer", "tokenizer_for"]
