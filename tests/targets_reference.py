"""Which tokens of a sample train, derived WITHOUT the project's code (tests/test_targets.py uses it).

Everything here is HF's: the checkpoint's tokenizer and chat template (``apply_chat_template``), its
image processor and the family's ``*Processor`` class, whose ``__call__`` expands each image
placeholder of the rendered text into the image's block (``text_replacement_offsets`` names each
replacement) and tokenizes the result; ``processor.apply_chat_template(...,
return_assistant_tokens_mask=True)`` for templates with ``{% generation %}`` blocks.

``derive_turns``: for each assistant message i, render ``messages[:i]`` with
``add_generation_prompt=True`` (P) and ``messages[:i + 1]`` (F), expand both with the images the
full sample gives them and tokenize: the tokens of F beyond those of P are that turn's, less the
whitespace the template writes after the turn (``Turn.tail``: the ``\\n`` after an end-of-turn
token, LLaVA-1.5's ``' '``), which is not trained (tests/test_targets.py says why). The image blocks
come from processing the WHOLE sample once: a prefix holding fewer images would get other blocks
where the count of images in a sample decides a block's size (LLaVA-OneVision: anyres tiles for
one image, the base tile only for several).

The processors load here without torchvision (see ../shared/notes/model-families.md): the
families whose processor carries a video processor (Qwen2/2.5/3-VL, LLaVA-OneVision, InternVL,
SmolVLM) are built from the image processor and the tokenizer with the video processor left out
(``_without_video``: HF's class check for it needs torchvision; images never reach it). SmolVLM's
processor also insists on ``num2words``, which only its video prompts use: a stand-in is set while
it is built. LLaVA-1.5's tiny checkpoint has no processor_config.json: the processor gets
config.json's patch size and feature strategy as llava-hf's processor_config.json gives them.
"""
from __future__ import annotations

import io
import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from PIL import Image

from ray_mmbatch import schema as S

# ------------------------------------------------------------------ the sample
# one system turn, three questions and three answers, two images (one in the first question, one in the
# middle of the second); the answers have no whitespace at their ends, so any whitespace after a turn
# is the template's
PICS = [(60, 40, 1), (30, 70, 2)]  # (w, h, seed)
CONVERSATION = [  # as data gives it (LLaVA style)
    {"from": "system", "value": "Answer briefly."},
    {"from": "human", "value": "<image>\nWhat is in the first picture?"},
    {"from": "gpt", "value": "A red stripe on noise."},
    {"from": "human", "value": "Compare it with <image> please."},
    {"from": "gpt", "value": "The second one is taller."},
    {"from": "human", "value": "Which is brighter?"},
    {"from": "gpt", "value": "The first."},
]
ANSWERS = [t["value"] for t in CONVERSATION if t["from"] == "gpt"]
# the same conversation with a clip in place of the second picture (families whose template renders video)
VIDEO_CONVERSATION = [dict(t, value=t["value"].replace("with <image>", "with <video>")) for t in CONVERSATION]
# and without the first picture: GLM-4.1V trains no sample with both an image and a video (models/glm4v.py)
CLIP_ONLY_CONVERSATION = [dict(t, value=t["value"].replace("<image>\n", "")) for t in VIDEO_CONVERSATION]


def video_clip() -> bytes:
    """A 2.3 s clip of 23 frames at 10 fps, H.264 with B-frames (synthetic/video.py)."""
    from ray_mmbatch.synthetic.video import clip_frames, encode_clip

    return encode_clip(clip_frames(23, 48, 64, 1), fps=10, bframes=2)


def _text(t: str) -> dict:
    return {"type": "text", "text": t}


def messages(images: list | None = None, video: bool = False, clip_only: bool = False) -> list[dict]:
    """The same conversation as the chat template's messages (``images``: PIL images put into the image parts,
    as processor.apply_chat_template loads them; ``video``: VIDEO_CONVERSATION's, a video part second;
    ``clip_only``: CLIP_ONLY_CONVERSATION's, no picture first)."""
    pics = iter(images or [])

    def image() -> dict:
        return {"type": "image", "image": next(pics)} if images else {"type": "image"}

    first = [] if clip_only else [image()]
    return [{"role": "system", "content": [_text("Answer briefly.")]},
            {"role": "user", "content": [*first, _text("What is in the first picture?")]},
            {"role": "assistant", "content": [_text(ANSWERS[0])]},
            {"role": "user", "content": [_text("Compare it with "), {"type": "video"} if video else image(),
                                         _text(" please.")]},
            {"role": "assistant", "content": [_text(ANSWERS[1])]},
            {"role": "user", "content": [_text("Which is brighter?")]},
            {"role": "assistant", "content": [_text(ANSWERS[2])]}]


def png_images() -> list[bytes]:
    out = []
    for w, h, seed in PICS:
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
        out.append(buf.getvalue())
    return out


def pil_images() -> list[Image.Image]:
    return [Image.open(io.BytesIO(b)).convert("RGB") for b in png_images()]


# ------------------------------------------------------------------ the project's side (the code under test)
def project_sample(path, video: bool = False, clip_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) of the sample as the data path gives them to the model: the checkpoint's config
    (hf.config_from_checkpoint) -> measure_batch -> materialize_sample (image tokens expanded, labels shifted);
    ``video``: VIDEO_CONVERSATION with video_clip() second; ``clip_only``: CLIP_ONLY_CONVERSATION, the clip alone."""
    from ray_mmbatch import hf
    from ray_mmbatch.data.materialize import materialize_sample
    from ray_mmbatch.data.measure import measure_batch
    from ray_mmbatch.data.text.encoder import tokenizer_for

    cfg = hf.config_from_checkpoint(str(path))
    pics = [video_clip()] if clip_only else png_images()[:1] + [video_clip()] if video else png_images()
    conversation = CLIP_ONLY_CONVERSATION if clip_only else VIDEO_CONVERSATION if video else CONVERSATION
    raw = {S.SAMPLE_ID: ["s"], S.CONVERSATIONS: [json.dumps(conversation)], S.IMAGES: [pics],
           S.IMAGE_REFS: [[f"{j}.png" for j in range(len(pics))]], S.READ_ERROR: [""]}
    measured = measure_batch(raw, cfg.image, tokenizer_for(cfg.text), cfg.text)
    assert not measured[S.SKIP_REASON][0], measured[S.SKIP_REASON][0]
    sample = materialize_sample({c: measured[c][0] for c in measured}, cfg.image)
    return np.asarray(sample["input_ids"]), np.asarray(sample["labels"])


def trained_positions(labels) -> list[int]:
    """Positions whose token is a target: labels are shifted (labels[p] is the target at p + 1)."""
    return [int(p) + 1 for p in np.flatnonzero(np.asarray(labels) != S.IGNORE_INDEX)]


# ------------------------------------------------------------------ HF's processors
_VIDEO_PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                     "qwen3_vl": "Qwen3VLProcessor", "llava_onevision": "LlavaOnevisionProcessor",
                     "internvl": "InternVLProcessor", "smolvlm": "SmolVLMProcessor", "glm4v": "Glm4vProcessor"}


def _without_video(cls):
    class Processor(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    Processor.__name__ = Processor.__qualname__ = cls.__name__
    return Processor


@contextmanager
def _num2words_stand_in():
    import transformers.models.smolvlm.processing_smolvlm as smolvlm

    saved = smolvlm.num2words
    smolvlm.num2words = smolvlm.num2words or str
    try:
        yield
    finally:
        smolvlm.num2words = saved


def hf_processor(path, model_type: str):
    """The family's HF processor for the checkpoint at ``path`` (its tokenizer, chat template, PIL image
    processor and processor_config.json settings)."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    path = Path(path)
    if model_type == "gemma4":  # its image processor settings sit in processor_config.json only
        from tests.hf_gemma4_checkpoint import gemma4_processor

        return gemma4_processor(path)
    if model_type == "mistral3":  # PixtralProcessor, built without torchvision
        from tests.hf_mistral3_checkpoint import pixtral_processor

        return pixtral_processor(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    images = AutoImageProcessor.from_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())
    extra = {}
    if (path / "processor_config.json").exists():
        extra = {k: v for k, v in json.loads((path / "processor_config.json").read_text()).items()
                 if k != "processor_class"}
    if model_type == "llava":
        return transformers.LlavaProcessor(
            image_processor=images, tokenizer=tok, chat_template=tok.chat_template,
            patch_size=config["vision_config"]["patch_size"],
            vision_feature_select_strategy=config["vision_feature_select_strategy"], num_additional_image_tokens=1)
    if model_type == "gemma3":
        return transformers.Gemma3Processor(image_processor=images, tokenizer=tok, chat_template=tok.chat_template,
                                            **extra)
    if model_type == "idefics3":
        return transformers.Idefics3Processor(image_processor=images, tokenizer=tok, chat_template=tok.chat_template,
                                              **extra)
    if model_type == "internvl":
        tok.video_token = "<video>"  # InternVL3-hf tokenizers name one; the tiny one has none (no video here)
    cls = _without_video(getattr(transformers, _VIDEO_PROCESSORS[model_type]))
    with _num2words_stand_in():
        # SmolVLM's apply_chat_template reads the video processor's frame sampling defaults: none
        no_video = SimpleNamespace(num_frames=None, fps=None)
        return cls(image_processor=images, tokenizer=tok, video_processor=no_video, chat_template=tok.chat_template,
                   **extra)


# ------------------------------------------------------------------ the derivation
@dataclass
class Turn:
    start: int  # first token of the turn in the full sample's ids
    ids: list[int]  # the turn's tokens: what trains
    tail: list[int]  # whitespace tokens the template writes after the turn (when the render ends there)

    @property
    def positions(self) -> list[int]:
        return list(range(self.start, self.start + len(self.ids)))


@dataclass
class Derived:
    ids: list[int]  # the processor's ids of the whole sample
    turns: list[Turn]

    @property
    def positions(self) -> list[int]:
        return [p for t in self.turns for p in t.positions]


def derive_turns(processor, msgs: list[dict], images: list, videos: list | None = None) -> Derived:
    """The assistant turns' tokens in the processor's ids of the whole sample (module docstring); ``videos``: paths
    of the clips of the messages' video parts (HF's video processor reads and samples them itself)."""
    tok = processor.tokenizer
    full = tok.apply_chat_template(msgs, tokenize=False)
    out = processor(text=full, images=[images] if images else None, add_special_tokens=False,
                    return_text_replacement_offsets=True, **({"videos": videos} if videos else {}))
    ids = list(out["input_ids"][0])
    blocks = {kind: [r["replacement"] for r in out["text_replacement_offsets"][0] if r["type"] == kind]
              for kind in ("image", "video")}
    assert len(blocks["image"]) == len(images) and len(blocks["video"]) == len(videos or [])

    def tokens(text: str) -> list[int]:
        n, v = text.count(processor.image_token), text.count(processor.video_token) if videos else 0
        (expanded,), _ = processor.get_text_with_replacements([text], blocks["image"][:n], blocks["video"][:v])
        return tok(expanded, add_special_tokens=False).input_ids

    assert tokens(full) == ids  # the blocks spliced into the text are the processor's ids
    turns = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = tokens(tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=True))
        through = tokens(tok.apply_chat_template(msgs[:i + 1], tokenize=False))
        assert ids[:len(before)] == before, f"turn {i}: the answer does not start at a token boundary"
        turn, tail = through[len(before):], []
        while turn and not tok.decode(turn[-1:]).strip():
            tail[:0] = [turn.pop()]
        assert ids[len(before):len(before) + len(turn)] == turn, f"turn {i}: not where the whole sample has it"
        turns.append(Turn(len(before), turn, tail))
    return Derived(ids, turns)


def check_targets(ids, labels, derived: Derived) -> None:
    """Raises AssertionError unless ``labels`` train exactly the derived turns (as the next tokens of ``ids``)."""
    ids, labels = np.asarray(ids), np.asarray(labels)
    assert ids.tolist() == derived.ids, "the sample's ids are not the processor's"
    at = np.flatnonzero(labels != S.IGNORE_INDEX)
    assert (labels[at] == ids[at + 1]).all(), "labels are not the next tokens"
    trained, want = set(trained_positions(labels)), set(derived.positions)
    extra, missing = sorted(trained - want), sorted(want - trained)
    assert not extra and not missing, f"trained but not an assistant turn: {extra}; not trained: {missing}"


# ------------------------------------------------------------------ {% generation %} blocks
def assistant_mask_positions(processor, msgs_with_images: list[dict], chat_template: str) -> list[int]:
    """Positions HF's ``return_assistant_tokens_mask`` marks (every token overlapping a generation block), on the
    processor's own ids of the sample (images expanded)."""
    out = processor.apply_chat_template(msgs_with_images, chat_template=chat_template, tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True)
    return out["input_ids"][0], [p for p, m in enumerate(out["assistant_masks"][0]) if m]


# Each family's template source: the edits that open a capture ``m`` of a message's output right after its
# generation-prompt cue (``{% set m %}``, whitespace control as the template has it), and the text before which
# the message's output ends (where the capture closes and is written out).
_LOOP_END = "{% endfor %}{% if add_generation_prompt %}"


def _open(header: str, dash: str = "") -> tuple[str, str]:
    return header, header + f"{{%{dash} set m {dash}%}}"


_MARKS = {
    "qwen": ([_open("<|im_start|>{{ message['role'] }}\n")], _LOOP_END),
    "llava_onevision": ([_open("{{'<|im_start|>' + message['role'] + ' '}}")], _LOOP_END),
    "internvl": ([_open("{{'<|im_start|>' + message['role'] + '\n'}}")], _LOOP_END),
    "gemma3": ([_open("(first_user_prefix if loop.first else \"\") }}\n", "-")],
               "{%- endfor -%}\n{%- if add_generation_prompt -%}"),
    "gemma4": ([_open("{{- '<|turn>' + role + '\n' -}}\n", "-")], "{%- endfor -%}\n{%- if add_generation_prompt -%}"),
    # "Assistant:" is the cue: the colon goes before the capture, the space after it is the model's to write
    "smolvlm": ([("{{message['role'] | capitalize}}", "{{message['role'] | capitalize}}{{':'}}{% set m %}"),
                 ("{{': ' + message['content']}}", "{{' ' + message['content']}}"),
                 ("{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}",
                  "{% if message['content'][0]['type'] != 'image' %}{{' '}}{% endif %}")], _LOOP_END),
}


def with_generation_blocks(template: str, family: str, through_newline: bool = False) -> str:
    """A copy of ``template`` with each assistant message's output after its generation-prompt cue -- the answer
    and the end-of-turn token -- in a ``{% generation %}`` block; ``through_newline``: the newline the template
    writes after the end-of-turn token inside it too (TRL's training templates place it so). Other messages
    render as before; the copy renders the same text (the tests check it)."""
    edits, end = _MARKS[family]
    for old, new in edits:
        assert template.count(old) == 1, (family, old)
        template = template.replace(old, new)
    assert template.count(end) == 1, (family, end)
    dash = "-" if end.startswith("{%-") else ""
    inside = "m" if through_newline else "m.rstrip('\\n')"
    close = (f"{{%{dash} endset {dash}%}}{{% if message['role'] == 'assistant' %}}{{% generation %}}"
             f"{{{{ {inside} }}}}{{% endgeneration %}}{{{{ m[({inside}) | length:] }}}}"
             f"{{% else %}}{{{{ m }}}}{{% endif %}}")
    return template.replace(end, close + end)


def main(checkpoint: str, clip: str, out: str, family: str = "gemma4") -> None:
    """The reference interpreter's half of test_targets' video cases (HF's video processors need torchvision): the
    turns of messages(video=True) as the family's processor, with the checkpoint's own video processor, gives them
    for the first picture and the clip at ``clip`` (GLM-4.1V, ``family`` glm4v: Glm4vProcessor on the clip alone,
    messages(clip_only=True)), written to ``out`` as JSON."""
    from transformers import AutoVideoProcessor

    videos = AutoVideoProcessor.from_pretrained(checkpoint)
    if family == "glm4v":
        from transformers import AutoImageProcessor, AutoTokenizer, Glm4vProcessor

        tok = AutoTokenizer.from_pretrained(checkpoint)
        processor = Glm4vProcessor(image_processor=AutoImageProcessor.from_pretrained(checkpoint), tokenizer=tok,
                                   video_processor=videos, chat_template=tok.chat_template)
        derived = derive_turns(processor, messages(video=True, clip_only=True), [], [clip])
    else:
        from tests.hf_gemma4_checkpoint import gemma4_processor

        derived = derive_turns(gemma4_processor(checkpoint, videos), messages(video=True), pil_images()[:1], [clip])
    Path(out).write_text(json.dumps({"ids": [int(i) for i in derived.ids],
                                     "turns": [[t.start, t.ids, t.tail] for t in derived.turns]}))


if __name__ == "__main__":
    import sys

    from tests.video_reference import _with_pyav_ffmpeg

    _with_pyav_ffmpeg()  # torchcodec, HF's loader for a path, on PyAV's FFmpeg
    main(*sys.argv[1:5])
