"""Dataset layouts (formats/layouts.py, issue 33) over the open VLM SFT collections as their publishers write
them (tests/layout_fixtures.py: HF ``datasets`` features, ``embed_table_storage`` + ``to_parquet``, Hub file
names): the layout is told from the schema alone, every row is read once with its image bytes in the order
they are attached, the measured token ids are the chat template's own rendering of the same dialogue as HF
messages (targets: exactly the assistant turns), bad rows are skipped with their reason and counted while the
rows beside them keep their data, and a mixed run trains every sample exactly once (in-process and on Ray).
"""
from __future__ import annotations

import json
from collections import Counter

import chat_templates
import layout_fixtures as F
import numpy as np
import pyarrow.parquet as pq
import pytest

from ray_mmbatch import formats, local_batches
from ray_mmbatch import schema as S
from ray_mmbatch.config import Config, DataConfig, ImageConfig, TextConfig
from ray_mmbatch.data.measure import measure_batch
from ray_mmbatch.data.text.encoder import image_token_id, tokenizer_for
from ray_mmbatch.formats import layouts
from ray_mmbatch.formats.units import count_samples, read_units

NAMES = ["cauldron", "finevision", "llava_onevision", "pixmo_docs", "pixmo_cap", "messages", "local_paths"]
IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, F.Written]:
    return F.write_all(tmp_path_factory.mktemp("layouts"))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> TextConfig:
    """The shipped tokenizer saved as a checkpoint with Qwen2-VL's chat template (images in place)."""
    from transformers import PreTrainedTokenizerFast

    from ray_mmbatch.data.text.tokenizer import SHIPPED_TOKENIZER

    path = tmp_path_factory.mktemp("qwen_tok")
    tok = PreTrainedTokenizerFast.from_pretrained(str(SHIPPED_TOKENIZER))
    tok.chat_template = chat_templates.QWEN2_VL
    tok.save_pretrained(str(path))
    return TextConfig(tokenizer=str(path))


def _cfg(w: F.Written, **kw) -> DataConfig:
    return DataConfig(path=str(w.data), **{**w.settings, **kw})


def _read(w: F.Written, cfg: DataConfig | None = None) -> tuple[list[dict], list[dict]]:
    """(units, RAW rows) of a fixture, read as a reader task reads them."""
    cfg = cfg or _cfg(w)
    fmt, units = formats.list_units(str(w.data), cfg)
    assert fmt == "parquet"
    return units, [r for u in units for r in formats.FORMATS[fmt].read_unit(u, cfg)]


def own_ids(tok, messages) -> list[int]:
    """The template's own ids: render the HF messages, tokenize the whole string."""
    return tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=True).input_ids


def _answers(messages) -> list[str]:
    return ["".join(p["text"] for p in m["content"]) for m in messages if m["role"] == "assistant"]


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


def _measure(rows: list[dict], text_cfg: TextConfig) -> list[dict]:
    batch = {c: [r[c] for r in rows] for c in S.RAW_COLUMNS}
    out = measure_batch(batch, ImageConfig(), tokenizer_for(text_cfg), text_cfg)
    return [{c: out[c][i] for c in out} for i in range(len(rows))]


# ------------------------------------------------------------------ (a) the layout, from the schema alone
@pytest.mark.parametrize("name", NAMES)
def test_layout_is_chosen_from_the_schema(written, name):
    w = written[name]
    schema = pq.read_schema(w.file)
    assert b"huggingface" in schema.metadata  # written by datasets' own writer, its features beside the data
    cols = layouts.choose(schema, DataConfig())  # no flags: the schema says which it is
    assert cols.describe == w.describe
    units, _ = _read(w)
    assert len(units) == (len(w.rows) + 1) // 2  # two rows per row group: several read units per file
    assert all(u["error"] == "" and u["read_as"] == w.describe for u in units)
    if name in ("llava_onevision", "pixmo_docs", "pixmo_cap"):  # ONE nullable struct, found without --image-column
        assert cols.image == "image" and cols.image_kind == "Image"
    if name == "pixmo_docs":  # named explicitly, the same reading as found by default
        assert layouts.choose(schema, DataConfig(text_column="questions")) == cols
        assert _read(w, _cfg(w, text_column="questions"))[1] == _read(w)[1]
    if name == "llava_onevision":
        assert cols.id == "id"


# ------------------------------------------------------------------ (b) every row once, bytes in order
@pytest.mark.parametrize("name", NAMES)
def test_every_row_is_read_once_with_its_images_in_order(written, name):
    w = written[name]
    _, rows = _read(w)
    assert [r[S.SAMPLE_ID] for r in rows] == [w.sample_id(i) for i in range(len(w.rows))]
    for r, want in zip(rows, w.rows):
        if want.bad:  # skipped with the layout's reason; its neighbours below keep their data
            assert r[S.READ_ERROR].startswith(want.bad + ":"), r
            assert r[S.IMAGES] == []
            continue
        assert r[S.READ_ERROR] == "", r
        assert r[S.IMAGES] == want.images  # the publisher's bytes, untouched, in the order they are attached
        assert len(r[S.IMAGE_REFS]) == len(want.images)


def test_cauldron_texts_become_turns_with_the_images_before_the_first_user_text(written):
    w = written["cauldron"]
    _, rows = _read(w)
    table = pq.read_table(w.file)
    for r, texts, images in zip(rows, table.column("texts").to_pylist(), table.column("images").to_pylist()):
        if r[S.READ_ERROR]:
            continue
        want = []
        for k, pair in enumerate(texts):  # no newline: the placeholders sit right before the user text
            want += [{"from": "human", "value": ("<image>" * len(images) if k == 0 else "") + pair["user"]},
                     {"from": "gpt", "value": pair["assistant"]}]
        assert json.loads(r[S.CONVERSATIONS]) == want
    assert rows[2][S.READ_ERROR] == "malformed_record: texts[1] has no assistant text"


def test_llava_onevision_text_only_row_has_no_image_and_ids_keep_the_data_id(written):
    _, rows = _read(written["llava_onevision"])
    assert rows[1][S.SAMPLE_ID].endswith("#text_2") and rows[1][S.IMAGES] == [] and rows[1][S.READ_ERROR] == ""
    assert rows[0][S.IMAGE_REFS] == [f"{rows[0][S.SAMPLE_ID]}#0"]  # path null as shipped: the ref is the row's


# ------------------------------------------------------------------ (c) ids = the chat template's rendering
@pytest.mark.parametrize("name", NAMES)
def test_token_ids_are_the_chat_templates_rendering_and_targets_the_answers(written, qwen, name):
    w = written[name]
    _, rows = _read(w)
    tok = tokenizer_for(qwen)
    image_id = image_token_id(tok, qwen)
    im_end = tok.convert_tokens_to_ids(IM_END)
    for row, want in zip(_measure(rows, qwen), w.rows):
        if want.bad:
            assert row[S.SKIP_REASON].startswith(want.bad) and int(row[S.TOKENS]) == 0
            continue
        assert row[S.SKIP_REASON] == "", row[S.SKIP_REASON]
        ids, target = np.asarray(row[S.TEXT_IDS]), np.asarray(row[S.TEXT_TARGET])
        assert ids.tolist() == own_ids(tok, want.messages), row[S.SAMPLE_ID]
        assert int((ids == image_id).sum()) == len(want.images) == int(row[S.N_IMAGES])
        # the trained tokens are exactly the assistant turns: one run per answer, its text and <|im_end|>
        runs = _runs(target == 1)
        assert [tok.decode(ids[a:b].tolist()) for a, b in runs] == [a + IM_END for a in _answers(want.messages)]
        assert all(ids[b - 1] == im_end and tok.decode(ids[:a].tolist()).endswith("<|im_start|>assistant\n")
                   for a, b in runs)


def test_caption_without_a_prompt_is_the_image_alone_in_the_user_turn(written, qwen):
    w = written["pixmo_cap"]
    _, rows = _read(w, _cfg(w, caption_prompt=""))
    captions = pq.read_table(w.file).column("caption").to_pylist()
    assert [json.loads(r[S.CONVERSATIONS]) for r in rows] == [[{"from": "gpt", "value": c}] for c in captions]
    tok = tokenizer_for(qwen)
    for row, cap in zip(_measure(rows, qwen), captions):
        assert row[S.SKIP_REASON] == ""
        assert np.asarray(row[S.TEXT_IDS]).tolist() == own_ids(tok, [F.user(F.IMG), F.assistant(cap)])


def test_messages_images_follow_the_order_their_parts_name(written, qwen):
    from ray_mmbatch.data.image import image_grid, probe_image

    w = written["messages"]
    _, rows = _read(w)
    stored = [im["bytes"] for im in pq.read_table(w.file).column("images").to_pylist()[0]]
    assert rows[0][S.IMAGES] == [stored[1], stored[0]] != stored  # part index 1 comes first in the dialogue
    cfg = ImageConfig()
    grids = [list(image_grid(*probe_image(b, cfg), cfg, n_images=2)) for b in (stored[1], stored[0])]
    assert np.asarray(_measure(rows[:1], qwen)[0][S.GRIDS]).tolist() == grids  # costs follow that order too


# ------------------------------------------------------------------ FineVision's ratings: --filter
def test_finevision_filter_keeps_the_rated_rows_and_counts_the_rest(written):
    w = written["finevision"]
    cfg = _cfg(w, filter="relevance_min >= 4")
    units, rows = _read(w, cfg)
    kept = [w.sample_id(i) for i, r in enumerate(w.rows) if r.kept]
    assert [r[S.SAMPLE_ID] for r in rows] == kept  # ids keep the row's place in its file
    assert sum(u["filtered"] for u in units) == len(w.rows) - len(kept) == 3  # the null rating fails too
    assert sum(u["rows"] for u in units) == len(kept) == count_samples(str(w.data), cfg)
    by_id = dict(zip([w.sample_id(i) for i in range(len(w.rows))], w.rows))
    for r in rows:
        want = by_id[r[S.SAMPLE_ID]]
        assert r[S.IMAGES] == want.images and r[S.READ_ERROR].startswith(want.bad)
    both = _read(w, _cfg(w, filter="relevance_min >= 4 and formatting_min >= 6"))[1]
    assert both == []
    # a collection without the filter's column is refused at start, naming it
    cauldron = written["cauldron"]
    with pytest.raises(ValueError, match="no column 'relevance_min' for --filter"):
        _read(cauldron, _cfg(cauldron, filter="relevance_min >= 4"))


# ------------------------------------------------------------------ Dataset.to_parquet of local files
def test_local_image_paths_are_read_under_the_image_root_only(written, tmp_path):
    w = written["local_paths"]
    stored = pq.read_table(w.file).column("images").to_pylist()
    assert all(im["bytes"] is None and im["path"].startswith("/") for ims in stored for im in ims)
    _, rows = _read(w)  # --image-root: the folder that holds them
    assert [r[S.IMAGES] for r in rows] == [r.images for r in w.rows]
    assert [r[S.IMAGE_REFS] for r in rows] == [[im["path"] for im in ims] for ims in stored]
    _, outside = _read(w, _cfg(w, image_root=str(tmp_path)))
    assert all(r[S.READ_ERROR].startswith(S.SKIP_PATH_OUTSIDE_ROOT + ":") and r[S.IMAGES] == [] for r in outside)
    assert stored[0][0]["path"] in outside[0][S.READ_ERROR]
    _, unset = _read(w, _cfg(w, image_root=""))
    assert all(r[S.READ_ERROR].startswith(S.SKIP_MISSING_FILE + ":") and "--image-root" in r[S.READ_ERROR]
               for r in unset)
    # an absolute path that leaves the root through '..' or a symlink is outside; one with a NUL is malformed
    from ray_mmbatch.formats.parquet import _image_from_path

    root = tmp_path / "root"
    (root / "in").mkdir(parents=True)
    (tmp_path / "secret.png").write_bytes(b"x")
    (root / "in" / "link.png").symlink_to(tmp_path / "secret.png")
    for ref in (f"{root}/in/../../secret.png", f"{root}/in/link.png"):
        data, err = _image_from_path(ref, str(root), 1 << 20)
        assert data == b"" and err.startswith(S.SKIP_PATH_OUTSIDE_ROOT + ":"), (ref, err)
    data, err = _image_from_path(f"{root}/in/a\x00.png", str(root), 1 << 20)
    assert data == b"" and err.startswith(S.SKIP_MALFORMED_RECORD + ":"), err
    (root / "in" / "ok.png").write_bytes(b"png bytes")
    assert _image_from_path(f"{root}/in/../in/ok.png", str(root), 1 << 20) == (b"png bytes", "")
    fresh = F.write_local_paths(tmp_path / "lp", F.write_images(tmp_path / "photos"))
    (tmp_path / "photos" / "tall.png").unlink()  # gone since the table was written
    _, rows = _read(fresh)
    assert rows[0][S.READ_ERROR].startswith(S.SKIP_MISSING_FILE) and rows[0][S.IMAGES] == []
    assert rows[1][S.READ_ERROR] == "" and rows[1][S.IMAGES] == fresh.rows[1].images


# ------------------------------------------------------------------ URLs only: refused at start
def test_url_only_collection_is_refused_at_start_naming_the_download(tmp_path):
    F.write_url_only(tmp_path)
    for list_them in (lambda c: formats.list_units(str(tmp_path), c), lambda c: read_units(str(tmp_path), c)):
        with pytest.raises(ValueError, match=r"'image_url' holds image URLs.*[Dd]ownload"):
            list_them(DataConfig(path=str(tmp_path)))
    # the way out it names: the text alone
    _, units = formats.list_units(str(tmp_path), DataConfig(path=str(tmp_path), image_column=""))
    assert units and all(u["error"] == "" for u in units)


# ------------------------------------------------------------------ (d) a mixed run: every sample once
def _mixed(written, qwen) -> tuple[Config, dict[str, str]]:
    """All the collections as sources of one run (FineVision filtered); -> (config, {expected id: bad reason})."""
    cfg = Config()
    cfg.text = qwen
    cfg.budget.max_tokens, cfg.budget.window = 1024, 8
    expected = {}
    for name in NAMES:
        w = written[name]
        entry = {"path": str(w.data), "name": name, **w.settings}
        if name == "finevision":
            entry["filter"] = "relevance_min >= 4"
        cfg.data.sources.append(entry)
        expected.update({f"{name}:{w.sample_id(i)}": r.bad for i, r in enumerate(w.rows)
                         if r.kept or name != "finevision"})
    return cfg, expected


def _messages_of(written) -> dict[str, list]:
    return {f"{name}:{written[name].sample_id(i)}": r.messages for name in NAMES
            for i, r in enumerate(written[name].rows)}


def test_mixed_collections_train_every_sample_exactly_once(written, qwen):
    cfg, expected = _mixed(written, qwen)
    messages = _messages_of(written)
    tok = tokenizer_for(qwen)
    image_id = image_token_id(tok, qwen)
    trained, skipped = [], {}
    for batch in local_batches(cfg, with_skips=True):
        if "skipped" in batch:
            skipped.update({r.sample_id: r.reason for r in batch["skipped"]})
            continue
        cu = np.asarray(batch["cu_seqlens"])
        ids, labels = np.asarray(batch["input_ids"]).reshape(-1), np.asarray(batch["labels"]).reshape(-1)
        for k, sid in enumerate(str(s) for s in batch["sample_ids"]):
            trained.append(sid)
            seg, lab = ids[cu[k]:cu[k + 1]], labels[cu[k]:cu[k + 1]]
            # the trained sequence is the template's rendering, each image's one token expanded in place
            keep = np.concatenate([[True], ~((seg[1:] == image_id) & (seg[:-1] == image_id))])
            assert seg[keep].tolist() == own_ids(tok, messages[sid]), sid
            assert tok.decode(lab[lab >= 0].tolist()) == "".join(a + IM_END for a in _answers(messages[sid]))
    assert len(trained) == len(set(trained)) and not set(trained) & set(skipped)
    assert sorted(trained + list(skipped)) == sorted(expected)  # filtered rows are neither
    assert skipped == {sid: bad for sid, bad in expected.items() if bad}
    assert Counter(skipped.values()) == {S.SKIP_MALFORMED_RECORD: 2, S.SKIP_MISSING_FILE: 1}


@pytest.mark.ray
def test_mixed_collections_through_ray_every_sample_once(ray_cluster, written, qwen):
    from ray_mmbatch.batching.collate import decode_batch
    from ray_mmbatch.data.errors import decode_skips
    from ray_mmbatch.dataflow.pipeline import batch_dataset
    from ray_mmbatch.models import configure, token_ids

    cfg, expected = _mixed(written, qwen)
    cfg = configure(cfg)
    trained, skipped = [], {}
    for row in batch_dataset(cfg, token_ids(cfg)["pad_id"]).iter_rows():
        skipped.update({r.sample_id: r.reason for r in decode_skips(row[S.BATCH_SKIPPED])})
        if int(row[S.BATCH_N_SAMPLES]):
            trained += [str(s) for s in decode_batch(bytes(row[S.BATCH_PAYLOAD]))["sample_ids"]]
    assert len(trained) == len(set(trained)) and not set(trained) & set(skipped)
    assert sorted(trained + list(skipped)) == sorted(expected)
    assert skipped == {sid: bad for sid, bad in expected.items() if bad}
