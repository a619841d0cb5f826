"""data/text/ with the real shipped tokenizer and a foreign HF tokenizer built in tmp_path."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_mmbatch import schema as S
from ray_mmbatch.data.text.conversations import TextSkip
from ray_mmbatch.data.text.encoder import encode_conversations
from ray_mmbatch.data.text.tokenizer import SHIPPED_TOKENIZER, load_tokenizer, special_ids


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def enc1(tok, conv, n_images=0, **kw):
    (result,) = encode_conversations([conv], [n_images], tok, **kw)
    return result


def decoded(tok, ids) -> str:
    return tok.decode(np.asarray(ids).tolist(), skip_special_tokens=False)


def turn(role, text):
    return {"from": role, "value": text}


VS_PAD_VE = S.VISION_START + S.IMAGE_PAD + S.VISION_END


def test_shipped_tokenizer_files_and_specials(tok):
    assert sum(p.stat().st_size for p in SHIPPED_TOKENIZER.iterdir()) < 1_000_000
    assert 3500 <= len(tok) <= 4200
    ids = special_ids(tok)
    assert set(ids) == set(S.SPECIAL_TOKENS) and len(set(ids.values())) == len(S.SPECIAL_TOKENS)
    assert tok.pad_token == S.PAD_TOKEN and load_tokenizer("") is tok  # cached per path
    # common caption words are single tokens (the corpus covers the demo vocabulary)
    assert len(tok(" red circle in the upper left corner", add_special_tokens=False).input_ids) == 7


def test_template_and_answer_mask(tok):
    conv = [turn("system", "Be brief."), turn("human", "What colour?"), turn("gpt", "Red."),
            turn("human", "Shape?"), turn("gpt", "A circle.")]
    ids, target = enc1(tok, conv)
    assert ids.dtype == np.int32 and target.dtype == np.uint8 and len(ids) == len(target)
    assert decoded(tok, ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat colour?<|im_end|>\n"
                                 "<|im_start|>assistant\nRed.<|im_end|>\n<|im_start|>user\nShape?<|im_end|>\n"
                                 "<|im_start|>assistant\nA circle.<|im_end|>\n")
    assert decoded(tok, ids[target == 1]) == "Red.<|im_end|>A circle.<|im_end|>"
    ids2, target2 = enc1(tok, conv, train_on_prompt=True)
    np.testing.assert_array_equal(ids2, ids)
    assert target2.all()


def test_role_content_keys_and_caption(tok):
    a = enc1(tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    b = enc1(tok, [turn("human", "Hi"), turn("gpt", "Hello")])
    np.testing.assert_array_equal(a[0], b[0])
    ids, target = enc1(tok, [turn("gpt", "a red circle")])
    assert decoded(tok, ids[target == 1]) == "a red circle<|im_end|>"


def test_placeholders_mark_image_slots_only_in_user_turns_with_images(tok):
    ids, target = enc1(tok, [turn("human", "<image> left, <image> right?"), turn("gpt", "Both <image>.")], 2)
    assert decoded(tok, ids) == (f"<|im_start|>user\n{VS_PAD_VE} left, {VS_PAD_VE} right?<|im_end|>\n"
                                 "<|im_start|>assistant\nBoth <image>.<|im_end|>\n")
    pad = special_ids(tok)[S.IMAGE_PAD]
    assert (ids == pad).sum() == 2 and not target[ids == pad].any()
    # a user <image> without an image is a sample that lost its image: skipped, never trained as text
    r = enc1(tok, [turn("human", "<image> hi"), turn("gpt", "ok")], 0)
    assert isinstance(r, TextSkip) and r.reason == S.SKIP_PLACEHOLDER_MISMATCH
    ids, _ = enc1(tok, [turn("human", "hi"), turn("gpt", "<image> is how LLaVA marks one")], 0)
    assert (ids == pad).sum() == 0 and "<image> is how" in decoded(tok, ids)


def test_missing_placeholders_are_inserted(tok):
    ids, _ = enc1(tok, [turn("human", "Describe."), turn("gpt", "Two cats.")], 2)
    assert decoded(tok, ids).startswith(f"<|im_start|>user\n{VS_PAD_VE}{VS_PAD_VE}\nDescribe.<|im_end|>")
    ids, _ = enc1(tok, [turn("system", "sys"), turn("gpt", "A dog.")], 1)  # no user turn: one is added
    assert decoded(tok, ids) == (f"<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\n{VS_PAD_VE}<|im_end|>\n"
                                 "<|im_start|>assistant\nA dog.<|im_end|>\n")


def test_placeholder_mismatch(tok):
    r = enc1(tok, [turn("human", "<image><image>"), turn("gpt", "x")], 1)
    assert isinstance(r, TextSkip) and r.reason == S.SKIP_PLACEHOLDER_MISMATCH
    r = enc1(tok, [turn("human", "<image>"), turn("gpt", "x")], 3)
    assert r.reason == S.SKIP_PLACEHOLDER_MISMATCH


def test_special_token_strings_in_data_stay_plain_text(tok):
    nasty = "".join(S.SPECIAL_TOKENS) + " <image> <|im_start|>assistant\n"
    # in the user turn <image> is the one real slot; in system/gpt turns it is plain text
    conv = [turn("system", nasty), turn("human", nasty.replace("<image>", "") + "<image>"), turn("gpt", nasty)]
    ids, target = enc1(tok, conv, 1)
    sp = special_ids(tok)
    counts = {name: int((ids == i).sum()) for name, i in sp.items()}
    assert counts == {S.PAD_TOKEN: 0, S.EOS_TOKEN: 0, S.IM_START: 3, S.IM_END: 3,
                      S.VISION_START: 1, S.VISION_END: 1, S.IMAGE_PAD: 1}
    assert not np.isin(ids, tok.all_special_ids)[target == 1][:-1].any()  # only the closing <|im_end|>
    assert decoded(tok, ids[target == 1]) == nasty + S.IM_END


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=("Cs",)), min_size=1, max_size=60))
def test_any_unicode_round_trips(text):
    tok = load_tokenizer()
    ids, target = enc1(tok, [turn("gpt", text)])
    assert tok.decode(ids[target == 1][:-1].tolist()) == text


def test_bad_text_reasons(tok):
    cases = [
        ("not a list", S.SKIP_MALFORMED_RECORD),
        ([["from", "gpt"]], S.SKIP_MALFORMED_RECORD),
        ([{"from": "gpt"}], S.SKIP_MALFORMED_RECORD),
        ([turn("robot", "x")], S.SKIP_MALFORMED_RECORD),
        ([turn("gpt", "bad \ud800 surrogate")], S.SKIP_TEXT_ENCODING),
        ([turn("gpt", 42)], S.SKIP_TEXT_ENCODING),
        ([turn("gpt", None)], S.SKIP_TEXT_ENCODING),
        ([turn("human", "question only")], S.SKIP_EMPTY_TEXT),
        ([turn("human", "q"), turn("gpt", "")], S.SKIP_EMPTY_TEXT),
        ([], S.SKIP_EMPTY_TEXT),
    ]
    results = encode_conversations([c for c, _ in cases] + [[turn("gpt", "fine")]], [0] * (len(cases) + 1), tok)
    assert [getattr(r, "reason", None) for r in results] == [r for _, r in cases] + [None]


def test_batched_equals_one_by_one(tok):
    k = [i % 2 for i in range(20)]
    convs = [[turn("human", f"Question {i}" + " <image>" * k[i]), turn("gpt", f"Answer number {i}.")]
             for i in range(20)]
    batched = encode_conversations(convs, k, tok)
    for c, n, (ids, target) in zip(convs, k, batched):
        ids1, target1 = enc1(tok, c, n)
        np.testing.assert_array_equal(ids, ids1)
        np.testing.assert_array_equal(target, target1)


def test_foreign_hf_tokenizer_gets_missing_specials(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(["a red circle and a blue square"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[UNK]", "[PAD]", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]").save_pretrained(str(tmp_path))
    other = load_tokenizer(str(tmp_path))
    assert other is not load_tokenizer()
    assert all(t in other.get_vocab() for t in S.SPECIAL_TOKENS) and other.pad_token is not None
    assert special_ids(other)[S.IM_START] == other.get_vocab()["<|im_start|>"]  # kept its own id
    ids, target = enc1(other, [turn("human", "<image> what <|image_pad|>?"), turn("gpt", "a red circle")], 1)
    assert (ids == special_ids(other)[S.IMAGE_PAD]).sum() == 1
    assert other.decode(ids.tolist()) == (f"<|im_start|>user\n{VS_PAD_VE} what <|image_pad|>?<|im_end|>\n"
                                          "<|im_start|>assistant\na red circle<|im_end|>\n")
