"""Which tokens train, for every family, derived independently of the project's code (issue 36).

For each family's tiny checkpoint and one sample -- a system turn, three questions, three answers, two
images (one in the first question, one inside the second) -- the positions the data path trains
(hf.config_from_checkpoint -> measure_batch -> materialize_sample: ``labels != -100``, shifted) must be
exactly the assistant turns as the checkpoint's OWN chat template and HF's processor give them
(tests/targets_reference.py, no project code): render the conversation up to each answer with
``add_generation_prompt=True`` and through it, expand the image placeholders into the processor's
blocks for this sample, tokenize; the difference is the turn. The ids of the whole sample must be the
processor's, too, so the positions are comparable one to one (image tokens, tiles and split views
included).

What trains, per family (the last field of ``FAMILIES``): the answer, any text the template writes
between the generation prompt and the answer (LLaVA-1.5's and SmolVLM's space after ``ASSISTANT:`` / ``Assistant:``,
LLaVA-OneVision's ``\\n``: the model writes them at inference, right after the prompt) and the
end-of-turn token (``<|im_end|>``, ``<end_of_turn>``, ``<turn|>``, ``<end_of_utterance>``), which the model must
learn to stop on. NOT trained: the whitespace the template writes after the turn (``\\n`` after the
end-of-turn token; LLaVA-1.5's trailing ``' '``). That is the project's rule (ray_mmbatch/data/text/
template.py: a span ends at the render through the turn less trailing whitespace; a token is a target
when it starts in a span): generation stops at the end-of-turn token, so the newline after it is
never sampled and predicting it teaches nothing used. Others train that newline: TRL's training
templates (trl/chat_templates/qwen2_vl_training.jinja, gemma3_training.jinja,
smolvlm_training.jinja) put it inside ``{% generation %}`` and LLaMA-Factory's qwen2_vl template
labels ``{{content}}<|im_end|>\\n`` -- one token per turn more than here, shown exactly below
(``test_trl_placement_trains_the_newline_too``).

LLaVA-1.5's template (llava-hf's, tests/chat_templates.LLAVA) writes no end-of-turn or EOS token at all,
so nothing that stops generation is trained for it, here or by HF: its own ``{% generation %}`` block
(``content + ' '``) makes ``return_assistant_tokens_mask`` mark the token that holds the trailing
space as well -- mid-conversation the first token of the next ``USER:`` (``' U'``), at the end a lone
``' '`` -- which the project does not train (``test_llavas_own_generation_blocks``).

``{% generation %}``: of the tiny checkpoints' templates only LLaVA-1.5's has blocks. For every other
family a copy of its template with blocks around the answer and the end-of-turn token
(targets_reference.with_generation_blocks; it renders the same text) makes HF's mask mark exactly the
derived positions. The controls (``test_the_check_fails_on_wrong_targets``) train one user token more,
or leave the end-of-turn token out, and the check must fail.

The templates are the tiny checkpoints' (tests/chat_templates.py, tests/hf_*_checkpoint.py): Qwen3-VL's
checkpoint carries Qwen2-VL's template, SmolVLM and Idefics3 both SmolVLM's.

Fast: no Ray, no model forward; each checkpoint is built once (module-scoped fixture).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from ray_mmbatch import schema as S
from tests import chat_templates
from tests import targets_reference as R

# id: (checkpoint maker, processor family, template family for with_generation_blocks, what trains: (the text
# before the answer, the text after it (the end-of-turn token), what follows the turn untrained))
FAMILIES = {
    "qwen2_vl": (("qwen", "qwen2_vl"), "qwen2_vl", "qwen", ("", "<|im_end|>", "\n")),
    "qwen2_5_vl": (("qwen", "qwen2_5_vl"), "qwen2_5_vl", "qwen", ("", "<|im_end|>", "\n")),
    "qwen3_vl": (("qwen", "qwen3_vl"), "qwen3_vl", "qwen", ("", "<|im_end|>", "\n")),
    "qwen3_vl_moe": (("qwen", "qwen3_vl_moe"), "qwen3_vl", "qwen", ("", "<|im_end|>", "\n")),
    "llava": (("llava",), "llava", None, (" ", "", " ")),
    "llava_onevision": (("llava_onevision",), "llava_onevision", "llava_onevision", ("\n", "<|im_end|>", "\n")),
    "internvl": (("internvl",), "internvl", "internvl", ("", "<|im_end|>", "\n")),
    "gemma3": (("gemma3",), "gemma3", "gemma3", ("", "<end_of_turn>", "\n")),
    "gemma4": (("gemma4",), "gemma4", "gemma4", ("", "<turn|>", "\n")),
    "smolvlm": (("idefics3", "smolvlm", True), "smolvlm", "smolvlm", (" ", "<end_of_utterance>", "\n")),
    "idefics3": (("idefics3", "idefics3", False), "idefics3", "smolvlm", (" ", "<end_of_utterance>", "\n")),
    # Qwen3.5: the think block only on the turn after the last user turn, whose generation prompt opens it
    # (derived from HF's mask on a marked copy of the template, _qwen3_5_turns: the template is not incremental)
    "qwen3_5": (("qwen3_5",), "qwen3_vl", None, (("", "", "\n</think>\n\n"), "<|im_end|>", "\n")),
    # Mistral 3: the answer and </s> right after [/INST], nothing after the turn (HF's mask: test_models_mistral3)
    "mistral3": (("mistral3",), "mistral3", None, ("", "</s>", "")),
    # GLM-4.5V's template: an empty think block before every answer, no end-of-turn token (the next <|user|> ends it)
    "glm4v": (("glm4v",), "glm4v", None, ("\n<think></think>\n", "", "")),
}
MARKED = [f for f, spec in FAMILIES.items() if spec[2] is not None]


def _make(maker: tuple, d):
    if maker[0] == "qwen":
        from tests.hf_checkpoints import make_qwen_checkpoint

        return make_qwen_checkpoint(d, maker[1])
    if maker[0] == "llava":
        from tests.hf_llava_checkpoint import make_llava_checkpoint

        return make_llava_checkpoint(d)
    if maker[0] == "llava_onevision":
        from tests.hf_llava_onevision_checkpoint import make_llava_onevision_checkpoint

        return make_llava_onevision_checkpoint(d)
    if maker[0] == "internvl":
        from tests.hf_internvl_checkpoint import make_internvl_checkpoint

        return make_internvl_checkpoint(d)
    if maker[0] == "gemma3":
        from tests.hf_gemma3_checkpoint import make_gemma3_checkpoint

        return make_gemma3_checkpoint(d)
    if maker[0] == "gemma4":
        from tests.hf_gemma4_checkpoint import make_gemma4_checkpoint

        return make_gemma4_checkpoint(d)
    if maker[0] == "glm4v":
        from tests.hf_glm4v_checkpoint import make_glm4v_checkpoint

        return make_glm4v_checkpoint(d)
    if maker[0] == "qwen3_5":
        from tests.hf_checkpoints import make_qwen3_5_checkpoint

        return make_qwen3_5_checkpoint(d)
    if maker[0] == "mistral3":
        from tests.hf_mistral3_checkpoint import make_mistral3_checkpoint

        return make_mistral3_checkpoint(d)
    from tests.hf_idefics3_checkpoint import make_idefics3_checkpoint

    return make_idefics3_checkpoint(d, maker[1], splitting=maker[2])


def _qwen3_5_marked() -> str:
    """Qwen3.5's template (tests/hf_checkpoints.QWEN3_5) with ``{% generation %}`` blocks around what an assistant
    message writes after its generation-prompt cue: after ``<think>\\n`` on the turns after the last user turn
    (the think block's rest, the answer, ``<|im_end|>``), after the role line on the earlier ones (the answer,
    ``<|im_end|>``); the newline after the turn outside. It renders the same text (checked below)."""
    from tests.hf_checkpoints import QWEN3_5

    old = ("{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content + '\\n</think>\\n\\n' + content }}"
           "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}{{- '<|im_end|>\\n' }}")
    new = ("{{- '<|im_start|>' + message.role + '\\n<think>\\n' }}{% generation %}"
           "{{- reasoning_content + '\\n</think>\\n\\n' + content + '<|im_end|>' }}{% endgeneration %}"
           "{%- else %}{{- '<|im_start|>' + message.role + '\\n' }}{% generation %}{{- content + '<|im_end|>' }}"
           "{% endgeneration %}{%- endif %}{{- '\\n' }}")
    assert QWEN3_5.count(old) == 1
    return QWEN3_5.replace(old, new)


def _qwen3_5_turns(processor) -> R.Derived:
    """The assistant turns of the sample as HF's ``return_assistant_tokens_mask`` marks them on _qwen3_5_marked
    (HF's processor ids; each run of marked positions one turn, the whitespace token after it its tail)."""
    ids, positions = R.assistant_mask_positions(processor, R.messages(R.pil_images()), _qwen3_5_marked())
    ids, runs = list(ids), []
    for p in positions:
        if runs and p == runs[-1][-1] + 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    tok = processor.tokenizer
    turns = [R.Turn(r[0], ids[r[0]:r[-1] + 1], [ids[r[-1] + 1]] if not tok.decode(ids[r[-1] + 1:r[-1] + 2]).strip()
                    else []) for r in runs]
    return R.Derived(ids, turns)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> SimpleNamespace(ckpt, processor, derived, ids, labels), each made once per module, when first
    asked for."""
    from types import SimpleNamespace

    cache = {}

    def get(family: str):
        if family not in cache:
            maker, model_type, _, _ = FAMILIES[family]
            ckpt = _make(maker, tmp_path_factory.mktemp(family))
            processor = R.hf_processor(ckpt, model_type)
            ids, labels = R.project_sample(ckpt)
            derived = _qwen3_5_turns(processor) if family == "qwen3_5" else \
                R.derive_turns(processor, R.messages(), R.pil_images())
            cache[family] = SimpleNamespace(ckpt=ckpt, processor=processor, ids=ids, labels=labels, derived=derived)
        return cache[family]

    return get


def _decode(b, ids) -> str:
    return b.processor.tokenizer.decode(list(ids))


# ------------------------------------------------------------------ 1. the data path trains exactly the turns
@pytest.mark.parametrize("family", FAMILIES)
def test_trained_tokens_are_the_assistant_turns(built, family):
    b = built(family)
    d = b.derived
    # the sample is what it should be: images expanded to many tokens, three answers
    config = json.loads((b.ckpt / "config.json").read_text())
    image_id = config.get("image_token_id", config.get("image_token_index"))  # the model's image feature token
    assert len(R.PICS) >= 2 and len(d.turns) == len(R.ANSWERS) >= 2
    assert int((np.asarray(d.ids) == image_id).sum()) > 2 * len(R.PICS)
    R.check_targets(b.ids, b.labels, d)  # the project's ids are the processor's; its targets the turns
    before, after, untrained = FAMILIES[family][3]
    befores = before if isinstance(before, tuple) else (before,) * len(R.ANSWERS)  # per turn where they differ
    assert [_decode(b, t.ids) for t in d.turns] == [x + a + after for x, a in zip(befores, R.ANSWERS)]
    assert [_decode(b, t.tail) for t in d.turns] == [untrained] * len(d.turns)
    # the untrained whitespace really is in the sample, right after each turn (merged into the next
    # token where the tokenizer merges it: LLaVA-1.5's ' ' + 'USER')
    for t in d.turns:
        follows = _decode(b, d.ids[t.start + len(t.ids):t.start + len(t.ids) + 1])
        assert follows.startswith(untrained) and (t.start + len(t.ids)) not in R.trained_positions(b.labels)


# ------------------------------------------------------------------ 2. HF's return_assistant_tokens_mask agrees
def test_only_llavas_template_has_generation_blocks():
    """Which tiny checkpoints' templates mark ``{% generation %}``: LLaVA-1.5's only (its hub template has them)."""
    from tests.hf_gemma3_checkpoint import GEMMA3
    from tests.hf_gemma4_checkpoint import GEMMA4
    from tests.hf_idefics3_checkpoint import SMOLVLM
    from tests.hf_internvl_checkpoint import INTERNVL
    from tests.hf_llava_onevision_checkpoint import ONEVISION

    has = {name: "{% generation %}" in t for name, t in [
        ("LLAVA", chat_templates.LLAVA), ("QWEN2_VL", chat_templates.QWEN2_VL), ("ONEVISION", ONEVISION),
        ("INTERNVL", INTERNVL), ("GEMMA3", GEMMA3), ("GEMMA4", GEMMA4), ("SMOLVLM", SMOLVLM)]}
    assert has == {"LLAVA": True, "QWEN2_VL": False, "ONEVISION": False, "INTERNVL": False, "GEMMA3": False,
                   "GEMMA4": False, "SMOLVLM": False}


def _mask(b, template: str) -> list[int]:
    ids, positions = R.assistant_mask_positions(b.processor, R.messages(R.pil_images()), template)
    assert list(ids) == b.derived.ids  # HF's processor path gives the same ids
    return positions


def _renders_as(b, template: str) -> None:
    """The marked copy renders every prefix of the conversation as the original does."""
    tok, msgs = b.processor.tokenizer, R.messages()
    for i in range(1, len(msgs) + 1):
        for prompt in (False, True):
            want = tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=prompt)
            assert tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=prompt,
                                           chat_template=template) == want


@pytest.mark.parametrize("family", MARKED)
def test_generation_blocks_mark_the_trained_tokens(built, family):
    """Blocks around the answer and the end-of-turn token: HF's mask is exactly the derived turns, and so the
    project's targets (checked against the same positions above)."""
    b = built(family)
    template = R.with_generation_blocks(b.processor.tokenizer.chat_template, FAMILIES[family][2])
    _renders_as(b, template)
    assert _mask(b, template) == b.derived.positions == R.trained_positions(b.labels)


@pytest.mark.parametrize("family", MARKED)
def test_trl_placement_trains_the_newline_too(built, family):
    """TRL's training templates end the block after the newline that follows the end-of-turn token: their mask
    is the derived turns plus exactly that newline, one token per turn."""
    b = built(family)
    template = R.with_generation_blocks(b.processor.tokenizer.chat_template, FAMILIES[family][2],
                                        through_newline=True)
    _renders_as(b, template)
    tails = [t.start + len(t.ids) for t in b.derived.turns]
    assert [len(t.tail) for t in b.derived.turns] == [1] * len(tails)
    assert sorted(_mask(b, template)) == sorted(b.derived.positions + tails)
    assert {_decode(b, [b.derived.ids[p]]) for p in tails} == {"\n"}


def test_llavas_own_generation_blocks(built):
    """LLaVA-1.5's block is ``content + ' '``; HF marks every token overlapping it, so the token holding that
    trailing space is marked too: ``' U'`` of the next ``USER:`` mid-conversation, the last ``' '`` at the
    end -- one token after each derived turn, none of them an answer's. Everything else agrees."""
    b = built("llava")
    template = b.processor.tokenizer.chat_template
    assert "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}" in template
    mask, derived = set(_mask(b, template)), b.derived
    after = [t.start + len(t.ids) for t in derived.turns]
    assert set(derived.positions) <= mask and sorted(mask - set(derived.positions)) == after
    assert [_decode(b, [derived.ids[p]]) for p in after] == [" U", " U", " "]


def test_qwen3_5_marked_renders_as_the_template_and_the_derivation_is_not_incremental(built):
    """The marked copy renders every prefix as Qwen3.5's template does; the prefix derivation (derive_turns) cannot
    serve it: the render up to the first answer with the generation prompt opens a think block the whole
    conversation's render does not have there."""
    b = built("qwen3_5")
    tok, msgs, marked = b.processor.tokenizer, R.messages(), _qwen3_5_marked()
    for i in range(2, len(msgs) + 1):  # every prefix holding a user turn (the template refuses the others)
        for prompt in (False, True):
            want = tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=prompt)
            assert tok.apply_chat_template(msgs[:i], tokenize=False, add_generation_prompt=prompt,
                                           chat_template=marked) == want
    with pytest.raises(AssertionError, match="turn 2: the answer does not start at a token boundary"):
        R.derive_turns(b.processor, R.messages(), R.pil_images())


# ------------------------------------------------------------------ 3. the check can fail
def _one_user_token_more(b) -> tuple[np.ndarray, int]:
    """The labels with the first question's word "picture" trained too."""
    first = b.derived.turns[0].start
    at = max(p for p in range(first) if _decode(b, [b.derived.ids[p]]).strip() == "picture")
    labels = b.labels.copy()
    labels[at - 1] = b.ids[at]
    return labels, at


def _end_of_turn_dropped(b) -> tuple[np.ndarray, int]:
    """The labels without the first turn's last token (its end-of-turn token; LLaVA-1.5 has none: the '.')."""
    turn = b.derived.turns[0]
    at = turn.start + len(turn.ids) - 1
    labels = b.labels.copy()
    labels[at - 1] = S.IGNORE_INDEX
    return labels, at


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("control", ["one_user_token_more", "end_of_turn_dropped"])
def test_the_check_fails_on_wrong_targets(built, family, control):
    b = built(family)
    R.check_targets(b.ids, b.labels, b.derived)  # the real labels pass
    if control == "one_user_token_more":
        labels, at = _one_user_token_more(b)
        match = rf"trained but not an assistant turn: \[{at}\]; not trained: \[\]"
    else:
        labels, at = _end_of_turn_dropped(b)
        eot = FAMILIES[family][3][1]
        assert _decode(b, [b.ids[at]]) == (eot or ".")
        match = rf"trained but not an assistant turn: \[\]; not trained: \[{at}\]"
    with pytest.raises(AssertionError, match=match):
        R.check_targets(b.ids, labels, b.derived)


def _reference_turns(b, tmp_path, family: str) -> R.Derived:
    """tests/targets_reference.py's video case for ``family`` in the reference interpreter (HF's video processors
    need torchvision; the session's one, tests/reference_server.py): the derived turns of the conversation with
    R.video_clip() as HF's processor gives them."""
    from tests import reference_server

    reference_server.reference_python()  # skips (fails under RAY_MMBATCH_REQUIRE_REFERENCE=1) where there is none
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(R.video_clip())
    reference_server.run("tests.targets_reference:main", b.ckpt, clip, tmp_path / "derived.json", family)
    got = json.loads((tmp_path / "derived.json").read_text())
    return R.Derived(got["ids"], [R.Turn(*t) for t in got["turns"]])


def test_gemma4_trained_tokens_with_a_video_are_the_assistant_turns(built, tmp_path):
    """Gemma 4 with a clip in the second question (the tiny checkpoint's template renders ``<|video|>`` for a video
    part, as the published one does): the sample's ids are HF's Gemma4Processor's with its own video processor
    reading the clip (each sampled frame's ``mm:ss`` and soft-token block, run in the reference interpreter:
    torchvision), and the trained tokens exactly the assistant turns derived from them."""
    b = built("gemma4")
    derived = _reference_turns(b, tmp_path, "gemma4")
    ids, labels = R.project_sample(b.ckpt, video=True)
    video_id = b.processor.tokenizer.convert_tokens_to_ids("<|video|>")
    assert int((np.asarray(derived.ids) == video_id).sum()) > 4 * 10  # 4 frames of many soft tokens
    R.check_targets(ids, labels, derived)
    assert [_decode(b, t.ids) for t in derived.turns] == [a + "<turn|>" for a in R.ANSWERS]
    labels[derived.turns[1].start - 2] = ids[derived.turns[1].start - 1]  # the control: one user token more
    with pytest.raises(AssertionError, match="trained but not an assistant turn"):
        R.check_targets(ids, labels, derived)


def test_glm4v_trained_tokens_with_a_clip_are_the_assistant_turns(built, tmp_path):
    """GLM-4.5V's template with a clip in a user turn (alone: GLM trains no sample with both an image and a clip):
    the sample's ids are HF's Glm4vProcessor's with the checkpoint's own video processor reading the clip (an image
    block of <|image|> tokens and its second per temporal patch; the data path writes <|video|> in the frames, the
    adapter gives the model <|image|> there: compared as the model sees them), and the trained tokens exactly the
    assistant turns derived from them."""
    b = built("glm4v")
    derived = _reference_turns(b, tmp_path, "glm4v")
    ids, labels = R.project_sample(b.ckpt, clip_only=True)
    tok = b.processor.tokenizer
    video_id, image_id = (tok.convert_tokens_to_ids(t) for t in ("<|video|>", "<|image|>"))
    assert int((ids == video_id).sum()) == 3 * 4 and not (ids == image_id).any()  # 6 frames at 3 fps: 3 x 2 x 2
    ids = np.where(ids == video_id, image_id, ids)
    R.check_targets(ids, labels, derived)
    assert [_decode(b, t.ids) for t in derived.turns] == ["\n<think></think>\n" + a for a in R.ANSWERS]
    labels[derived.turns[1].start - 2] = ids[derived.turns[1].start - 1]  # the control: one user token more
    with pytest.raises(AssertionError, match="trained but not an assistant turn"):
        R.check_targets(ids, labels, derived)
