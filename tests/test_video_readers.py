"""Video in the readers: LLaVA-Video-178K JSON records, WebDataset shards, Parquet / Arrow (HF ``Video`` columns
and ``{"type": "video"}`` message parts). Real clips (synthetic/video.encode_clip: mp4, webm, mkv) are written
as files, tar members and HF-feature tables, read through each format's own listing and ``read_unit``; each row's
media are the files' bytes, in the order of the ``<image>`` / ``<video>`` placeholders, with their refs; a video
without a placeholder gets ``<video>``; bad paths are skipped with their reason. No Ray.
"""
from __future__ import annotations

import io
import json
import tarfile
import types
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from ray_mmbatch import formats
from ray_mmbatch import schema as S
from ray_mmbatch.config import DataConfig
from ray_mmbatch.formats import layouts
from ray_mmbatch.synthetic.video import clip_frames, encode_clip

IMG, VID = S.IMAGE_PLACEHOLDER, S.VIDEO_PLACEHOLDER


def _picture(fmt: str, colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 56), colour).save(buf, format=fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def media() -> dict[str, bytes]:
    """Distinct clips and pictures (so an order mistake shows): a.mp4 b.webm c.mkv d.mp4 e.webm, p.png q.jpg."""
    out = {f"{name}.{box}": encode_clip(clip_frames(8, 48, 64, seed=seed), fps=10, container=box)
           for seed, (name, box) in enumerate((("a", "mp4"), ("b", "webm"), ("c", "mkv"), ("d", "mp4"), ("e", "webm")))}
    out.update({"p.png": _picture("PNG", (200, 20, 20)), "q.jpg": _picture("JPEG", (20, 20, 200))})
    assert len(set(out.values())) == len(out)
    return out


def _read(location: Path, **settings) -> tuple[str, dict[str, dict]]:
    """(format, {sample id: RAW row}) of a dataset, listed and read as a reader task reads it."""
    cfg = DataConfig(path=str(location), **settings)
    fmt, units = formats.list_units(str(location), cfg)
    rows = [r for u in units for r in formats.FORMATS[fmt].read_unit(u, cfg)]
    assert all(list(r) == list(S.RAW_COLUMNS) for r in rows)
    return fmt, {r[S.SAMPLE_ID]: r for r in rows}


def _turns(row: dict) -> list[dict]:
    return json.loads(row[S.CONVERSATIONS])


def _human(row: dict) -> list[str]:
    return [t["value"] for t in _turns(row) if t["from"] == "human"]


def h(text: str) -> dict:
    return {"from": "human", "value": text}


def g(text: str) -> dict:
    return {"from": "gpt", "value": text}


# ------------------------------------------------------------------------------------------ LLaVA JSON
@pytest.fixture()
def llava_root(tmp_path: Path, media) -> Path:
    root = tmp_path / "llava"
    (root / "clips").mkdir(parents=True)
    (root / "pics").mkdir()
    for name in ("a.mp4", "b.webm", "c.mkv", "d.mp4"):
        (root / "clips" / name).write_bytes(media[name])
    for name in ("p.png", "q.jpg"):
        (root / "pics" / name).write_bytes(media[name])
    (tmp_path / "outside.mp4").write_bytes(media["a.mp4"])  # there, but out of the root: never read
    with zipfile.ZipFile(root / "Z.zip", "w") as z:  # M4-Instruct style: Z/e.webm packed in Z.zip
        z.writestr("Z/e.webm", media["e.webm"])
    records = [
        {"id": "one", "video": "clips/a.mp4", "conversations": [h(f"{VID}\nWhat happens?"), g("A square moves.")]},
        {"id": "two", "videos": ["clips/b.webm", "clips/c.mkv"], "conversations": [h(f"{VID}\n{VID}\nCompare."),
                                                                                   g("Different colours.")]},
        {"id": "mixed", "image": "pics/p.png", "video": "clips/a.mp4",
         "conversations": [h(f"{VID}\nthen {IMG}\nSame colours?"), g("No.")]},
        {"id": "interleaved", "images": ["pics/p.png", "pics/q.jpg"], "videos": ["clips/b.webm", "clips/d.mp4"],
         "conversations": [h(f"{IMG}{VID}\nFirst pair?"), g("Yes."), h(f"{VID} and {IMG}: second pair?"), g("No.")]},
        {"id": "loose", "image": "pics/p.png", "videos": ["clips/a.mp4", "clips/b.webm"],
         "conversations": [h(f"{IMG}{IMG}{VID}\nThree?"), g("Yes.")]},
        {"id": "next", "video": "clips/c.mkv", "conversations": [h(f"{IMG}\nDescribe the clip."), g("Moving.")]},
        {"id": "bare", "video": "clips/a.mp4",
         "conversations": [{"from": "system", "value": "Be brief."}, h("What happens?"), g("It moves.")]},
        {"id": "bare_mixed", "image": "pics/q.jpg", "video": "clips/b.webm",
         "conversations": [h("Compare."), g("Ok.")]},
        {"id": "gone", "video": "clips/nope.mp4", "conversations": [h(f"{VID}\nWhat?"), g("?")]},
        {"id": "out", "video": "../outside.mp4", "conversations": [h(f"{VID}\nWhat?"), g("?")]},
        {"id": "zipped", "video": "Z/e.webm", "conversations": [h(f"{VID}\nWhat?"), g("Packed.")]},
        {"id": "photo", "image": "pics/p.png", "conversations": [h("No placeholder here."), g("Red.")]},
        {"id": "badfield", "video": 5, "conversations": [h("x"), g("y")]},
    ]
    (root / "data.json").write_text(json.dumps(records))
    return root


def _llava_rows(root: Path, **settings) -> dict[str, dict]:
    fmt, rows = _read(root, **settings)
    assert fmt == "llava"
    return {sid.split("#", 1)[1]: r for sid, r in rows.items()}


def test_llava_video_records_read_their_files_in_placeholder_order(llava_root, media):
    rows = _llava_rows(llava_root)
    assert rows["one"][S.READ_ERROR] == ""
    assert rows["one"][S.IMAGES] == [media["a.mp4"]]
    assert rows["one"][S.IMAGE_REFS] == ["clips/a.mp4"]
    assert _turns(rows["one"]) == [h(f"{VID}\nWhat happens?"), g("A square moves.")]
    assert rows["two"][S.IMAGES] == [media["b.webm"], media["c.mkv"]]
    assert rows["two"][S.IMAGE_REFS] == ["clips/b.webm", "clips/c.mkv"]
    # both kinds: images fill the <image> slots, videos the <video> ones, across turns
    assert rows["mixed"][S.IMAGES] == [media["a.mp4"], media["p.png"]]
    assert rows["mixed"][S.IMAGE_REFS] == ["clips/a.mp4", "pics/p.png"]
    assert rows["interleaved"][S.IMAGES] == [media[n] for n in ("p.png", "b.webm", "d.mp4", "q.jpg")]
    assert rows["interleaved"][S.IMAGE_REFS] == ["pics/p.png", "clips/b.webm", "clips/d.mp4", "pics/q.jpg"]
    assert _human(rows["interleaved"]) == [f"{IMG}{VID}\nFirst pair?", f"{VID} and {IMG}: second pair?"]
    # a video written as <image> (LLaVA-NeXT exports) is kept as it is; an <image> past the images takes a video
    assert rows["loose"][S.IMAGES] == [media[n] for n in ("p.png", "a.mp4", "b.webm")]
    assert rows["next"][S.IMAGES] == [media["c.mkv"]]
    assert _human(rows["next"]) == [f"{IMG}\nDescribe the clip."]
    # a video archived in Z.zip under the root
    assert rows["zipped"][S.READ_ERROR] == ""
    assert rows["zipped"][S.IMAGES] == [media["e.webm"]]


def test_llava_video_without_a_placeholder_gets_one_first_in_the_first_human_turn(llava_root, media):
    rows = _llava_rows(llava_root)
    assert _turns(rows["bare"]) == [{"from": "system", "value": "Be brief."}, h(f"{VID}\nWhat happens?"),
                                    g("It moves.")]
    assert rows["bare"][S.IMAGES] == [media["a.mp4"]]
    assert _human(rows["bare_mixed"]) == [f"{IMG}{VID}\nCompare."]
    assert rows["bare_mixed"][S.IMAGES] == [media["q.jpg"], media["b.webm"]]
    # images only: exactly as before (the measure stage's placeholder rule places them)
    assert _human(rows["photo"]) == ["No placeholder here."]
    assert rows["photo"][S.IMAGES] == [media["p.png"]]


def test_llava_bad_video_paths_are_skipped_with_their_reason(llava_root, media):
    rows = _llava_rows(llava_root)
    assert rows["gone"][S.READ_ERROR] == f"{S.SKIP_MISSING_FILE}: clips/nope.mp4"
    assert rows["gone"][S.IMAGES] == [] and rows["gone"][S.IMAGE_REFS] == ["clips/nope.mp4"]
    assert rows["out"][S.READ_ERROR] == f"{S.SKIP_PATH_OUTSIDE_ROOT}: ../outside.mp4"
    assert rows["out"][S.IMAGES] == []
    assert rows["badfield"][S.READ_ERROR] == f"{S.SKIP_MALFORMED_RECORD}: video field is int"
    small = _llava_rows(llava_root, max_file_bytes=len(media["a.mp4"]) - 1)
    assert small["one"][S.READ_ERROR].startswith(f"{S.SKIP_FILE_TOO_LARGE}: clips/a.mp4: ")
    assert small["one"][S.IMAGES] == []


# ------------------------------------------------------------------------------------------ WebDataset
def _tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture()
def shard_root(tmp_path: Path, media) -> Path:
    root = tmp_path / "wds"
    conv = {"conversations": [h(f"{VID}\nand {IMG}\nCompare."), g("Different.")]}
    messages = {"messages": [{"role": "user", "content": [{"type": "video"}, {"type": "video"},
                                                          {"type": "text", "text": "Same clip?"}]},
                             {"role": "assistant", "content": "No."}]}
    _tar(root / "shard-000.tar", [
        ("cap.mp4", media["a.mp4"]), ("cap.txt", b"a square moving"),
        ("conv.jpg", media["q.jpg"]), ("conv.webm", media["b.webm"]), ("conv.json", json.dumps(conv).encode()),
        ("two.mkv", media["c.mkv"]), ("two.1.mov", media["d.mp4"]), ("two.json", json.dumps(messages).encode()),
        ("clip.avi", media["e.webm"]), ("clip.json", json.dumps({"caption": "a clip"}).encode()),
        ("pic.png", media["p.png"]), ("pic.txt", b"red"),
    ])
    return root


def test_webdataset_video_members_are_media_with_video_placeholders(shard_root, media):
    fmt, rows = _read(shard_root)
    assert fmt == "webdataset"
    rel = "shard-000.tar"
    assert all(r[S.READ_ERROR] == "" for r in rows.values()), {k: r[S.READ_ERROR] for k, r in rows.items()}
    cap = rows[f"{rel}/cap"]
    assert cap[S.IMAGES] == [media["a.mp4"]] and cap[S.IMAGE_REFS] == [f"{rel}/cap.mp4"]
    assert _turns(cap) == [h(VID), g("a square moving")]  # no --caption-prompt: the video alone asks
    conv = rows[f"{rel}/conv"]  # the <video> comes first in the text: the webm first, whatever the member order
    assert conv[S.IMAGES] == [media["b.webm"], media["q.jpg"]]
    assert conv[S.IMAGE_REFS] == [f"{rel}/conv.webm", f"{rel}/conv.jpg"]
    two = rows[f"{rel}/two"]
    assert two[S.IMAGES] == [media["c.mkv"], media["d.mp4"]]
    assert two[S.IMAGE_REFS] == [f"{rel}/two.mkv", f"{rel}/two.1.mov"]
    assert _human(two) == [f"{VID}{VID}Same clip?"]
    clip = rows[f"{rel}/clip"]
    assert clip[S.IMAGES] == [media["e.webm"]] and _turns(clip) == [h(VID), g("a clip")]
    pic = rows[f"{rel}/pic"]  # an image caption: as before
    assert pic[S.IMAGES] == [media["p.png"]] and _turns(pic) == [g("red")]


def test_webdataset_caption_prompt_follows_the_video_placeholder(shard_root, media):
    _, rows = _read(shard_root, caption_prompt="Describe.")
    assert _turns(rows["shard-000.tar/cap"]) == [h(f"{VID}Describe."), g("a square moving")]
    assert _turns(rows["shard-000.tar/pic"]) == [h(f"{IMG}Describe."), g("red")]


# ------------------------------------------------------------------------------------------ Parquet / Arrow
def _part(kind: str, text: str | None = None, index: int | None = None) -> dict:
    return {"index": index, "text": text, "type": kind}


@pytest.fixture()
def hf_messages(tmp_path: Path, media):
    """HF messages + ``images`` list<Image> + ``videos`` list<Video> (bytes embedded, as push_to_hub writes them);
    returns (the embedded Dataset, files folder, the media names each row must read, in order)."""
    import datasets
    from datasets import Dataset, Features, List, Value, Video
    from datasets import Image as HFImage
    from datasets.table import embed_table_storage

    files = tmp_path / "files"
    files.mkdir()
    for name, data in media.items():
        (files / name).write_bytes(data)
    part = {"index": Value("int64"), "text": Value("string"), "type": Value("string")}
    features = Features({"messages": List({"role": Value("string"), "content": List(part)}),
                         "images": List(HFImage()), "videos": List(Video())})

    def row(images, videos, *parts):
        return {"images": [str(files / n) for n in images], "videos": [str(files / n) for n in videos],
                "messages": [{"role": "user", "content": list(parts)},
                             {"role": "assistant", "content": [_part("text", "An answer.")]}]}

    spec = [  # (record, the media in placeholder order, the user text)
        (row([], ["a.mp4"], _part("video"), _part("text", "What happens?")), ["a.mp4"], f"{VID}What happens?"),
        (row(["p.png"], ["b.webm"], _part("text", "Look: "), _part("image"), _part("text", " then "), _part("video")),
         ["p.png", "b.webm"], f"Look: {IMG} then {VID}"),
        (row(["q.jpg"], ["c.mkv"], _part("video"), _part("image"), _part("text", "Same?")), ["c.mkv", "q.jpg"],
         f"{VID}{IMG}Same?"),
        (row([], [], _part("text", "Hello")), [], "Hello"),
        (row([], ["a.mp4", "d.mp4"], _part("video", index=1), _part("text", "vs"), _part("video", index=0)),
         ["d.mp4", "a.mp4"], f"{VID}vs{VID}"),
    ]
    datasets.disable_progress_bars()
    ds = Dataset.from_list([r for r, _, _ in spec], features=features)
    ds = ds.with_format("arrow").map(embed_table_storage, batched=True).with_format(None)
    return ds, files, [(names, text) for _, names, text in spec]


@pytest.mark.parametrize("fmt", ["parquet", "arrow"])
def test_hf_messages_video_parts_and_video_column_in_placeholder_order(tmp_path, hf_messages, media, fmt):
    ds, _, expected = hf_messages
    root = tmp_path / "hub"
    if fmt == "parquet":
        root.mkdir()
        ds.to_parquet(str(root / "train-00000-of-00001.parquet"))
        rel = "train-00000-of-00001.parquet"
    else:
        ds.save_to_disk(str(root))
        rel = "data-00000-of-00001.arrow"
    cfg = DataConfig(path=str(root))
    got, units = formats.list_units(str(root), cfg)
    assert got == fmt
    assert units[0]["read_as"] == "messages [{role, content}] + images list<Image> + videos list<Video>"
    _, rows = _read(root)
    assert len(rows) == len(expected)
    for i, (names, text) in enumerate(expected):
        row = rows[f"{rel}:{i}"]
        assert row[S.READ_ERROR] == "", row[S.READ_ERROR]
        assert row[S.IMAGES] == [media[n] for n in names], i
        assert row[S.IMAGE_REFS] == names, i
        assert _human(row) == [text], i


def test_parquet_video_path_column_reads_under_the_image_root(tmp_path, media):
    root = tmp_path / "caps"
    (root / "clips").mkdir(parents=True)
    (root / "clips" / "a.mp4").write_bytes(media["a.mp4"])
    pq.write_table(pa.table({"caption": ["a moving square", "lost"], "video": ["clips/a.mp4", "clips/nope.mp4"]}),
                   root / "caps.parquet")
    _, rows = _read(root, image_root=str(root))
    assert rows["caps.parquet:0"][S.READ_ERROR] == ""
    assert rows["caps.parquet:0"][S.IMAGES] == [media["a.mp4"]]
    assert rows["caps.parquet:0"][S.IMAGE_REFS] == ["clips/a.mp4"]
    assert _turns(rows["caps.parquet:0"]) == [h(VID), g("a moving square")]
    assert rows["caps.parquet:1"][S.READ_ERROR] == f"{S.SKIP_MISSING_FILE}: clips/nope.mp4"
    assert rows["caps.parquet:1"][S.IMAGES] == []
    _, rootless = _read(root)  # no --image-root: named, never guessed
    assert rootless["caps.parquet:0"][S.READ_ERROR].startswith(f"{S.SKIP_MISSING_FILE}: video 'clips/a.mp4' has no "
                                                               "bytes; set --image-root")


def test_video_column_choice():
    conv = pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))
    video = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    cfg = types.SimpleNamespace(text_column="conversations", image_column="images", id_column="id")
    cols = layouts.choose(pa.schema([("conversations", conv), ("videos", pa.list_(video))]), cfg)
    assert (cols.video, cols.video_kind, cols.image) == ("videos", "list<Video>", "")
    # a default-named column that holds no video (an id number) is not a video column, and not an error
    cols = layouts.choose(pa.schema([("conversations", conv), ("images", pa.list_(video)), ("video", pa.int64())]),
                          cfg)
    assert (cols.image, cols.video) == ("images", "")
    # a video column stands in for the image column: a URL column beside it is not refused
    cols = layouts.choose(pa.schema([("conversations", conv), ("url", pa.string()), ("video", video)]), cfg)
    assert (cols.video, cols.video_kind) == ("video", "Video")
    named = types.SimpleNamespace(**vars(cfg), video_column="clip")
    with pytest.raises(layouts.LayoutError, match="video column 'clip'"):
        layouts.choose(pa.schema([("conversations", conv), ("clip", pa.int64())]), named)
    off = types.SimpleNamespace(**vars(cfg), video_column="")
    assert layouts.choose(pa.schema([("conversations", conv), ("videos", pa.list_(video))]), off).video == ""


# ------------------------------------------------------------------------------------------ text
def test_video_placeholder_stays_plain_text_for_the_encoder():
    """Unrewritten by the measure stage, <video> is text: the placeholder rule counts <image> only."""
    from ray_mmbatch.data.text.conversations import conversation_turns
    from ray_mmbatch.data.text.encoder import encode_conversations
    from ray_mmbatch.data.text.tokenizer import load_tokenizer

    conv = [h(f"{VID}\nWhat happens?"), g("It moves.")]
    assert conversation_turns(conv, 0) == [("user", f"{VID}\nWhat happens?"), ("assistant", "It moves.")]
    assert conversation_turns(conv, 1)[0] == ("user", f"{IMG}\n{VID}\nWhat happens?")
    tok = load_tokenizer("", "auto")
    [(ids, _)] = encode_conversations([conv], [0], tok)
    assert VID in tok.decode([int(i) for i in ids])


# ------------------------------------------------------------------------------------------ decode
@pytest.mark.parametrize("shape,size", [((20, 224, 320), (168, 252)), ((3, 16, 192), (28, 196)),
                                        ((2, 57, 91), (112, 168)), ((4, 480, 640), (224, 308)),
                                        ((1, 224, 320), (224, 308)), ((2, 300, 200), (168, 200))])
def test_resize_frames_channels_last_equals_hf_contiguous_layout(shape, size):
    """resize_frames hands torch the frames channels last (no layout copies, issue 46); HF's torchvision backend
    makes them contiguous [n, 3, H, W] first. Same uint8 bicubic antialias pixels either way: down, up, one side
    only, noise and flat areas."""
    import numpy as np
    import torch

    from ray_mmbatch.data.video import resize_frames

    rng = np.random.default_rng(sum(shape) + sum(size))
    frames = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    frames[:, : shape[1] // 2] //= 64  # flat bands beside the noise
    frames[:, : shape[1] // 2] *= 85
    hf = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    hf = torch.nn.functional.interpolate(hf, size=list(size), mode="bicubic", align_corners=False, antialias=True)
    ours = resize_frames(frames, *size)
    assert ours.flags.c_contiguous and ours.shape == (shape[0], *size, 3)
    assert np.array_equal(ours, hf.permute(0, 2, 3, 1).numpy())
