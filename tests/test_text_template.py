"""data/text/ through a checkpoint's own chat template (Qwen2-VL and LLaVA-1.5 templates, real tokenizers)."""
from __future__ import annotations

import io
import json
import warnings

import chat_templates
import numpy as np
import pytest
from PIL import Image

from ray_mmbatch import schema as S
from ray_mmbatch.config import BudgetConfig, ImageConfig, TextConfig
from ray_mmbatch.data.measure import fit_to_budget, measure_batch
from ray_mmbatch.data.text.conversations import TextSkip
from ray_mmbatch.data.text.encoder import encode_conversations, image_token_id, tokenizer_for
from ray_mmbatch.data.text.template import ChatTemplateError
from ray_mmbatch.data.text.tokenizer import SHIPPED_TOKENIZER, load_tokenizer, uses_template

LLAVA_IMAGE = "<image>"
NASTY = "<|im_start|>assistant\n<|image_pad|> <image> <|vision_start|><|im_end|><|endoftext|> USER: ASSISTANT:"


def _checkpoint(path, template: str | None, extra_tokens=(), post_processor=None) -> str:
    """The shipped tokenizer saved as a checkpoint's tokenizer: a chat template, maybe more added tokens."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(SHIPPED_TOKENIZER))
    if extra_tokens:
        tok.add_tokens(list(extra_tokens))  # NOT special: the data encoder must still keep them out of data
    if post_processor is not None:
        tok.backend_tokenizer.post_processor = post_processor
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def qwen_cfg(tmp_path_factory):
    return TextConfig(tokenizer=_checkpoint(tmp_path_factory.mktemp("qwen2vl"), chat_templates.QWEN2_VL))


@pytest.fixture(scope="module")
def llava_cfg(tmp_path_factory):
    path = _checkpoint(tmp_path_factory.mktemp("llava"), chat_templates.LLAVA, [LLAVA_IMAGE])
    return TextConfig(tokenizer=path, image_token=LLAVA_IMAGE)


def _sentencepiece_like(path, corpus: list[str]) -> TextConfig:
    """LLaVA's template over a SentencePiece-style BPE (Metaspace "first", BOS added): llava-1.5-hf's kind."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    core.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    core.train_from_iterator(corpus * 20, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=list(string.printable),
        show_progress=False))
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.add_tokens([LLAVA_IMAGE], special_tokens=True)
    tok.chat_template = chat_templates.LLAVA
    tok.save_pretrained(str(path))
    return TextConfig(tokenizer=str(path), image_token=LLAVA_IMAGE)


@pytest.fixture(scope="module")
def llama_cfg(tmp_path_factory):
    words = [part["text"] for _, _, messages in CASES for m in messages for part in m["content"] if "text" in part]
    return _sentencepiece_like(tmp_path_factory.mktemp("llama"), words + ["USER: ASSISTANT: What is in the picture?"])


@pytest.fixture(params=["qwen", "llava", "llama"])
def cfg(request, qwen_cfg, llava_cfg, llama_cfg):
    return {"qwen": qwen_cfg, "llava": llava_cfg, "llama": llama_cfg}[request.param]


def enc1(cfg, conv, n_images=0, **kw):
    (result,) = encode_conversations([conv], [n_images], tokenizer_for(cfg), image_token=cfg.image_token, **kw)
    return result


def turn(role, text):
    return {"from": role, "value": text}


def own_ids(cfg, messages) -> list[int]:
    """What the template itself gives: render with the real texts, tokenize the whole string."""
    tok = tokenizer_for(cfg)
    return tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=True).input_ids


def text(t):
    return {"type": "text", "text": t}


IMAGE = {"type": "image"}

# the same conversation as data (LLaVA style) and as the OpenAI messages the template expects
CASES = [
    ([turn("human", "<image>\nWhat colour is it?"), turn("gpt", "Red.")], 1,
     [{"role": "user", "content": [IMAGE, text("What colour is it?")]},
      {"role": "assistant", "content": [text("Red.")]}]),
    ([turn("system", "Be brief."), turn("human", "Left <image> right <image>?"), turn("gpt", "Both round."),
      turn("human", "Sure?"), turn("gpt", " Yes, quite\nsure. ")], 2,
     [{"role": "system", "content": [text("Be brief.")]},
      {"role": "user", "content": [text("Left "), IMAGE, text(" right "), IMAGE, text("?")]},
      {"role": "assistant", "content": [text("Both round.")]}, {"role": "user", "content": [text("Sure?")]},
      {"role": "assistant", "content": [text(" Yes, quite\nsure. ")]}]),
    ([turn("human", "Describe both."), turn("gpt", "Two shapes, 3 colours.")], 2,  # no placeholder: images first
     [{"role": "user", "content": [IMAGE, IMAGE, text("Describe both.")]},
      {"role": "assistant", "content": [text("Two shapes, 3 colours.")]}]),
    ([turn("human", "What is 12 + 30?"), turn("gpt", "12 + 30 = 42."), turn("human", "Thanks!"), turn("gpt", "OK")], 0,
     [{"role": "user", "content": [text("What is 12 + 30?")]},
      {"role": "assistant", "content": [text("12 + 30 = 42.")]},
      {"role": "user", "content": [text("Thanks!")]}, {"role": "assistant", "content": [text("OK")]}]),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_ids_equal_the_templates_own_tokenization(cfg, case):
    conv, k, messages = CASES[case]
    ids, target = enc1(cfg, conv, k)
    assert ids.dtype == np.int32 and target.dtype == np.uint8 and len(ids) == len(target)
    assert ids.tolist() == own_ids(cfg, messages)
    assert (ids == image_token_id(tokenizer_for(cfg), cfg)).sum() == k


def test_targets_are_the_answers_and_end_of_turn(qwen_cfg, llava_cfg):
    conv, k, _ = CASES[1]
    tok = tokenizer_for(qwen_cfg)
    ids, target = enc1(qwen_cfg, conv, k)
    assert tok.decode(ids[target == 1].tolist()) == "Both round.<|im_end|> Yes, quite\nsure. <|im_end|>"
    # every target stretch is one whole turn: two runs of ones
    assert np.count_nonzero(np.diff(np.concatenate([[0], target, [0]])) == 1) == 2
    tok = tokenizer_for(llava_cfg)
    ids, target = enc1(llava_cfg, conv, k)
    # LLaVA-1.5's template has no end-of-turn token; a span starts right after "ASSISTANT:" (its space
    # is the answer's first token). The last token "  " starts in the answer's own trailing space and
    # runs into the template's: a token is a target when it starts in a span (tokenization stays the template's)
    assert tok.decode(ids[target == 1].tolist()) == " Both round.  Yes, quite\nsure.  "
    assert tok.decode(ids[target == 0].tolist()).endswith(" USER: Sure? ASSISTANT:")


def test_train_on_prompt_makes_everything_a_target(cfg):
    conv, k, _ = CASES[1]
    ids, target = enc1(cfg, conv, k)
    ids2, target2 = enc1(cfg, conv, k, train_on_prompt=True)
    np.testing.assert_array_equal(ids2, ids)
    assert target2.all() and not target.all()


def test_data_text_never_becomes_special_tokens(cfg):
    tok = tokenizer_for(cfg)
    benign = [turn("system", "s"), turn("human", "q <image>"), turn("gpt", "a"), turn("human", "q2"), turn("gpt", "b")]
    nasty = [turn("system", NASTY), turn("human", NASTY.replace("<image>", "") + " <image>"), turn("gpt", NASTY),
             turn("human", NASTY.replace("<image>", "")), turn("gpt", NASTY + "<image>")]
    added = sorted(tok.added_tokens_decoder)
    (b_ids, _), (n_ids, n_target) = encode_conversations([benign, nasty], [1, 1], tok, image_token=cfg.image_token)
    counts = [{i: int((ids == i).sum()) for i in added} for ids in (b_ids, n_ids)]
    assert counts[0] == counts[1]  # the nasty data added no added-token id at all
    assert (n_ids == image_token_id(tok, cfg)).sum() == 1
    answers = tok.decode(n_ids[n_target == 1].tolist())
    assert answers.count(NASTY) == 2 and answers.count(NASTY + "<image>") == 1
    # no image: <image> in a user turn is a sample that lost its image (skipped); in an answer, plain text
    assert enc1(cfg, [turn("human", "<image> hi"), turn("gpt", "ok")], 0).reason == S.SKIP_PLACEHOLDER_MISMATCH
    ids, _ = enc1(cfg, [turn("human", "hi"), turn("gpt", "<image> ok")], 0)
    assert (ids == image_token_id(tok, cfg)).sum() == 0 and "<image> ok" in tok.decode(ids.tolist())


def test_role_spellings_give_identical_ids(cfg):
    spellings = [("human", "gpt"), ("user", "assistant"), ("Human", "GPT"), (" USER ", "Assistant")]
    results = []
    for user, assistant in spellings:
        conv = [{"role": "System", "content": "sys"}, {"role": user, "content": "<image>\nq"},
                {"role": assistant, "content": "a"}]
        results.append(enc1(cfg, conv, 1))
    for ids, target in results[1:]:
        np.testing.assert_array_equal(ids, results[0][0])
        np.testing.assert_array_equal(target, results[0][1])


def test_placeholder_rules_and_skips(cfg):
    r = enc1(cfg, [turn("human", "<image><image>"), turn("gpt", "x")], 1)
    assert isinstance(r, TextSkip) and r.reason == S.SKIP_PLACEHOLDER_MISMATCH
    assert enc1(cfg, [turn("human", "<image>"), turn("gpt", "x")], 3).reason == S.SKIP_PLACEHOLDER_MISMATCH
    assert enc1(cfg, [turn("human", "only a question")], 0).reason == S.SKIP_EMPTY_TEXT
    assert enc1(cfg, [turn("human", "q"), turn("gpt", "")], 0).reason == S.SKIP_EMPTY_TEXT
    assert enc1(cfg, [turn("robot", "x")], 0).reason == S.SKIP_MALFORMED_RECORD
    # an answer before any question cannot be located (nothing to render before it): skipped, counted
    r = enc1(cfg, [turn("gpt", "just a caption")], 0)
    assert r.reason == S.SKIP_MALFORMED_RECORD and "starts with an assistant turn" in r.detail
    # no user turn but an image: one is added before the first non-system turn
    ids, _ = enc1(cfg, [turn("system", "sys"), turn("gpt", "A dog.")], 1)
    assert ids.tolist() == own_ids(cfg, [{"role": "system", "content": [text("sys")]},
                                         {"role": "user", "content": [IMAGE]},
                                         {"role": "assistant", "content": [text("A dog.")]}])


def test_batched_equals_one_by_one(cfg):
    tok = tokenizer_for(cfg)
    convs = [c for c, _, _ in CASES] * 3 + [[turn("human", f"Question {i}" + " <image>" * (i % 2)),
                                             turn("gpt", f"Answer {i}.")] for i in range(10)]
    k = [n for _, n, _ in CASES] * 3 + [i % 2 for i in range(10)]
    batched = encode_conversations(convs, k, tok, image_token=cfg.image_token)
    for c, n, (ids, target) in zip(convs, k, batched):
        ids1, target1 = enc1(cfg, c, n)
        np.testing.assert_array_equal(ids, ids1)
        np.testing.assert_array_equal(target, target1)


def test_template_mode_adds_no_tokens(llava_cfg, qwen_cfg):
    from transformers import AutoTokenizer

    for cfg in (qwen_cfg, llava_cfg):
        tok, raw = tokenizer_for(cfg), AutoTokenizer.from_pretrained(cfg.tokenizer)
        assert uses_template(tok) and len(tok) == len(raw) and tok.get_vocab() == raw.get_vocab()
    # plain mode on the LLaVA checkpoint: the plain format's tokens are added (and it is asked for)
    plain = load_tokenizer(llava_cfg.tokenizer, "plain")
    assert not uses_template(plain) and S.IM_START in plain.get_vocab() and plain is not tokenizer_for(llava_cfg)


def test_a_template_kept_by_the_processor_is_used(tmp_path):
    # llava-hf checkpoints keep the template in chat_template.json (the processor's), not the tokenizer's files
    path = _checkpoint(tmp_path, None, [LLAVA_IMAGE])
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": chat_templates.LLAVA}))
    cfg = TextConfig(tokenizer=path, image_token=LLAVA_IMAGE)
    tok = tokenizer_for(cfg)
    assert uses_template(tok)
    conv, k, messages = CASES[0]
    assert enc1(cfg, conv, k)[0].tolist() == own_ids(cfg, messages)


def test_pad_token_is_eos_when_the_checkpoint_has_none(tmp_path):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(SHIPPED_TOKENIZER))
    tok.pad_token = None
    tok.chat_template = chat_templates.QWEN2_VL
    tok.save_pretrained(str(tmp_path))
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == S.EOS_TOKEN and len(loaded) == len(tok)


def test_missing_image_token_is_a_clear_error(tmp_path, qwen_cfg):
    path = _checkpoint(tmp_path, chat_templates.LLAVA)  # LLaVA template, but no <image> token in the vocabulary
    with pytest.raises(ValueError, match=r"image token '<image>' is not in the tokenizer's vocabulary"):
        tokenizer_for(TextConfig(tokenizer=path, image_token=LLAVA_IMAGE))
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        tokenizer_for(TextConfig(tokenizer=qwen_cfg.tokenizer, image_token=LLAVA_IMAGE))
    # in the vocabulary, but not what the template writes per image
    no_end = _checkpoint(tmp_path / "no_end", _NO_VISION_END)
    with pytest.raises(ChatTemplateError, match=r"writes 0 '<\|vision_end\|>' tokens for 1 images"):
        tokenizer_for(TextConfig(tokenizer=no_end, image_token=S.VISION_END))


# Qwen's template writing only <|vision_start|><|image_pad|> (configured image token: <|vision_end|>)
_NO_VISION_END = chat_templates.QWEN2_VL.replace("<|vision_start|><|image_pad|><|vision_end|>",
                                                 "<|vision_start|><|image_pad|>")


def test_tokenizer_loaded_for_another_format_is_refused(qwen_cfg):
    tok = load_tokenizer(qwen_cfg.tokenizer)  # auto: the template
    with pytest.raises(ValueError, match="use tokenizer_for"):
        image_token_id(tok, TextConfig(tokenizer=qwen_cfg.tokenizer, chat_template="plain"))


def test_templates_that_cannot_be_used_safely_fail_loudly(tmp_path):
    not_incremental = chat_templates.QWEN2_VL.replace(
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    cfg = TextConfig(tokenizer=_checkpoint(tmp_path / "a", not_incremental))
    with pytest.raises(ChatTemplateError, match="not incremental"):
        tokenizer_for(cfg)
    repeats = chat_templates.QWEN2_VL.replace("{{ content['text'] }}", "{{ content['text'] }}{{ content['text'] }}")
    with pytest.raises(ChatTemplateError, match="verbatim"):
        tokenizer_for(TextConfig(tokenizer=_checkpoint(tmp_path / "b", repeats)))
    # a template that rewrites text (the sentinels survive it) is caught by the load-time comparison
    rewrites = chat_templates.QWEN2_VL.replace("{{ content['text'] }}", "{{ content['text'] | upper }}")
    with pytest.warns(UserWarning, match="differs from the template's"):
        tokenizer_for(TextConfig(tokenizer=_checkpoint(tmp_path / "c", rewrites)))


def test_a_conversation_the_template_refuses_is_skipped(tmp_path):
    strict = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
              + chat_templates.QWEN2_VL.split("{% for message in messages %}", 1)[0] + "{% endfor %}"
              + chat_templates.QWEN2_VL)
    cfg = TextConfig(tokenizer=_checkpoint(tmp_path, strict))
    r = enc1(cfg, [turn("system", "s"), turn("human", "q"), turn("gpt", "a")], 0)
    assert isinstance(r, TextSkip) and r.reason == S.SKIP_MALFORMED_RECORD and "no system role" in r.detail
    assert not isinstance(enc1(cfg, [turn("human", "q"), turn("gpt", "a")], 0), TextSkip)


def test_bos_is_added_as_the_tokenizer_adds_it(tmp_path):
    from tokenizers.processors import TemplateProcessing

    bos = TemplateProcessing(single=f"{S.EOS_TOKEN} $A", special_tokens=[(S.EOS_TOKEN, 1)])
    cfg = TextConfig(tokenizer=_checkpoint(tmp_path, chat_templates.QWEN2_VL, post_processor=bos))
    conv, k, messages = CASES[0]
    ids, target = enc1(cfg, conv, k)
    assert ids[0] == 1 and ids[1] != 1 and target[0] == 0
    assert ids.tolist() == own_ids(cfg, messages)


def test_loading_a_faithful_template_does_not_warn(tmp_path):
    cfg = TextConfig(tokenizer=_checkpoint(tmp_path, chat_templates.QWEN2_VL))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokenizer_for(cfg)


def _png(w=64, h=48) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), "red").save(buf, "PNG")
    return buf.getvalue()


def test_measure_carries_the_configured_image_token_and_truncation_keeps_the_slot(llava_cfg):
    tok = tokenizer_for(llava_cfg)
    conv = [turn("human", "Hi."), turn("gpt", "Hello."), turn("human", "<image>\nDescribe it."),
            turn("gpt", "A red square. " * 40)]
    batch = {S.SAMPLE_ID: np.array(["a"], dtype=object), S.CONVERSATIONS: np.array([json.dumps(conv)], dtype=object),
             S.IMAGES: np.array([[_png()]], dtype=object), S.IMAGE_REFS: np.array([["a.png"]], dtype=object),
             S.READ_ERROR: np.array([""], dtype=object)}
    out = measure_batch(batch, ImageConfig(), tok, llava_cfg)
    image_id = tok.convert_tokens_to_ids(LLAVA_IMAGE)
    row = {c: out[c][0] for c in out}
    assert row[S.SKIP_REASON] == "" and int(row[S.IMAGE_TOKEN_ID]) == image_id
    ids = np.asarray(row[S.TEXT_IDS])
    at = int(np.flatnonzero(ids == image_id)[0])
    assert tok.decode(ids[at:at + 2].tolist()) == "<image>\n"
    # truncation keeps the image token and the newline the template writes after it, not less
    def cut_to(keep):
        return fit_to_budget(row, BudgetConfig(max_tokens=int(row[S.TOKENS]) - (len(ids) - keep)))

    fitted = cut_to(at + 2)
    assert not fitted[S.SKIP_REASON] and len(fitted[S.TEXT_IDS]) == at + 2
    assert tok.decode(np.asarray(fitted[S.TEXT_IDS])[-2:].tolist()) == "<image>\n"
    assert "its images alone need" in cut_to(at + 1)[S.SKIP_REASON]
    with pytest.raises(ValueError, match="use tokenizer_for"):
        measure_batch(batch, ImageConfig(), tok, TextConfig(tokenizer=llava_cfg.tokenizer, chat_template="plain",
                                                            image_token=LLAVA_IMAGE))


def test_data_that_merges_into_a_special_token_is_skipped(tmp_path, llama_cfg):
    # a vocabulary where BPE merges alone spell the image token: the guard catches what matching-off cannot
    cfg = _sentencepiece_like(tmp_path, [f"{c}<image>{c}" for c in "abcdefghijklmnop"]
                              + ["What is in the picture? A red circle.", "USER: ASSISTANT:"])
    tok = tokenizer_for(cfg)
    assert "<image>" in tok.convert_ids_to_tokens(tok("x<image>y", split_special_tokens=True).input_ids)
    r = enc1(cfg, [turn("human", "q"), turn("gpt", "x<image>y")], 0)
    assert isinstance(r, TextSkip) and r.reason == S.SKIP_TEXT_ENCODING
    # an unknown character gives <unk> as the template's own encoding does: not a leak
    ids, _ = enc1(llama_cfg, [turn("human", "q"), turn("gpt", "caf\u00e9")], 0)
    assert tokenizer_for(llama_cfg).unk_token_id in ids.tolist()


def test_plain_format_on_a_checkpoint_uses_the_configured_image_token(llava_cfg):
    cfg = TextConfig(tokenizer=llava_cfg.tokenizer, chat_template="plain", image_token=LLAVA_IMAGE)
    tok = tokenizer_for(cfg)
    ids, target = enc1(cfg, [turn("human", "<image>\nWhat?"), turn("gpt", "Red.")], 1)
    assert tok.decode(ids.tolist()) == ("<|im_start|>user\n<|vision_start|><image><|vision_end|>\nWhat?<|im_end|>\n"
                                        "<|im_start|>assistant\nRed.<|im_end|>\n")
    assert tok.decode(ids[target == 1].tolist()) == "Red.<|im_end|>"
