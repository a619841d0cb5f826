"""The open VLM SFT collections as their publishers write them, small (tests/test_layouts.py, issue 33).

Each ``write_*`` builds a HF ``datasets.Dataset`` with the collection's features (``Image()``, ``List(Image())``,
``Sequence({...})``, its exact column names and types) from real image files written with Pillow (JPEG and
PNG, different sizes), embeds the images as ``push_to_hub`` does (``embed_table_storage``: bytes in, path cut
to the basename) unless the collection ships otherwise, and writes ``Dataset.to_parquet`` to a path named as
the Hub names files (``<config>/train-00000-of-00001.parquet`` or ``data/train-00000-of-00001.parquet``),
two rows per row group so a file is several read units. Beside the file it returns what a reader must get
for every row, built from the source data alone: the image bytes in the order they are attached, and the
dialogue as the HF messages a chat template renders (images as ``{"type": "image"}`` parts where they go),
or the skip reason of a bad row. No ray, no product code.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

SHARD = "train-00000-of-00001.parquet"
IMG = {"type": "image"}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def user(*parts) -> dict:
    return {"role": "user", "content": [text(p) if isinstance(p, str) else p for p in parts]}


def assistant(t: str) -> dict:
    return {"role": "assistant", "content": [text(t)]}


@dataclasses.dataclass
class Row:
    images: list[bytes]          # attached in this order
    messages: list | None        # the dialogue as HF messages (None: a bad row)
    bad: str = ""                # the schema.SKIP_* reason a bad row is read with
    user_id: str | None = None   # the row's own id (the "id" column)
    kept: bool = True            # passes the fixture's --filter


@dataclasses.dataclass
class Written:
    name: str
    data: Path                   # what --data points at
    file: Path
    rows: list[Row]
    describe: str                # Columns.describe of the file's schema under the fixture's settings
    settings: dict = dataclasses.field(default_factory=dict)  # DataConfig fields the collection is read with

    @property
    def rel(self) -> str:
        return self.file.relative_to(self.data).as_posix()

    def sample_id(self, i: int) -> str:
        uid = self.rows[i].user_id
        return f"{self.rel}:{i}" + (f"#{uid}" if uid else "")


def write_images(folder: Path) -> dict[str, Path]:
    """Real image files: JPEG and PNG of different sizes and contents."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, size, colour in (("red.jpg", (64, 48), "red"), ("tall.png", (30, 90), "green"),
                               ("blue.jpg", (120, 80), "blue"), ("square.png", (56, 56), "orange"),
                               ("wide.jpg", (160, 40), "purple")):
        im = Image.new("RGB", size, colour)
        ImageDraw.Draw(im).ellipse((2, 2, size[0] // 2, size[1] // 2), fill="white")
        out[name] = folder / name
        im.save(out[name], "JPEG" if name.endswith(".jpg") else "PNG")
    return out


def _write(path: Path, records: list[dict], features, embed: bool = True) -> Path:
    import datasets
    from datasets import Dataset
    from datasets.table import embed_table_storage

    datasets.disable_progress_bars()
    ds = Dataset.from_list(records, features=features)
    if embed:  # what push_to_hub does to every shard before it uploads it
        ds = ds.with_format("arrow").map(embed_table_storage, batched=True).with_format(None)
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.to_parquet(str(path), batch_size=2)
    return path


def _b(p: Path) -> bytes:
    return p.read_bytes()


def _s(p: Path | None) -> str | None:
    return None if p is None else str(p.resolve())


def write_cauldron(root: Path, im: dict[str, Path]) -> Written:
    """HuggingFaceM4/the_cauldron: ``images`` list of Image, ``texts`` list<{user, assistant, source}>."""
    from datasets import Features, Image, List, Value

    pair = {"user": Value("string"), "assistant": Value("string"), "source": Value("string")}
    features = Features({"images": List(Image()), "texts": List(pair)})

    def t(u, a):
        return {"user": u, "assistant": a, "source": "chartqa"}

    spec = [
        (["blue.jpg", "tall.png"], [t("Which chart shows more sales?", "The left one."),
                                    t("By how much?", "About 20%.")]),
        (["red.jpg"], [t("What colour is the box?\nAnswer briefly.", "Red.")]),
        (["square.png"], [t("Q1?", "A1."), t("Q2?", None)]),  # bad: an entry without its assistant
        (["wide.jpg"], [t(" Read the title. ", "Quarterly revenue")]),
    ]
    rows = []
    for names, texts in spec:
        if any(p["assistant"] is None for p in texts):
            rows.append(Row([], None, "malformed_record"))
            continue
        msgs = []
        for k, p in enumerate(texts):
            msgs += [user(*([IMG] * len(names) if k == 0 else []), p["user"]), assistant(p["assistant"])]
        rows.append(Row([_b(im[n]) for n in names], msgs))
    file = _write(root / "chartqa" / SHARD, [{"images": [_s(im[n]) for n in names], "texts": texts}
                                             for names, texts in spec], features)
    return Written("cauldron", root / "chartqa", file, rows, "texts [{user, assistant}] + images list<Image>")


def write_finevision(root: Path, im: dict[str, Path]) -> Written:
    """HuggingFaceM4/FineVision: Cauldron ``texts`` (no source in the pairs), a ``source`` column and ratings."""
    from datasets import Features, Image, List, Value

    features = Features({"images": List(Image()), "texts": List({"user": Value("string"),
                                                                 "assistant": Value("string")}),
                         "source": Value("string"), "relevance_ratings": List(Value("int64")),
                         "relevance_min": Value("int64"), "formatting_min": Value("int64")})
    spec = [  # (images, pairs, relevance ratings, relevance_min)
        (["red.jpg"], [("Describe the chart.", "A red bar chart.")], [5, 4], 4),
        (["blue.jpg", "square.png"], [("Compare.", "Blue is wider.")], [2, 5], 2),
        (["tall.png", None], [("What is it?", "A column.")], [5], 5),  # bad: a null image inside the list
        (["wide.jpg"], [("Title?", "None.")], [3], 3),
        (["square.png"], [("Shape?", "Square.")], [], None),  # no rating: a null fails the filter
        (["tall.png", "red.jpg"], [("First?", "Green."), ("Second?", "Red.")], [4, 4], 4),
    ]
    records, rows = [], []
    for names, pairs, ratings, low in spec:
        records.append({"images": [_s(im[n]) if n else None for n in names],
                        "texts": [{"user": u, "assistant": a} for u, a in pairs], "source": "CoSyn_400k_chart",
                        "relevance_ratings": ratings, "relevance_min": low, "formatting_min": 5})
        kept = low is not None and low >= 4
        if None in names:
            rows.append(Row([], None, "missing_file", kept=kept))
            continue
        msgs = []
        for k, (u, a) in enumerate(pairs):
            msgs += [user(*([IMG] * len(names) if k == 0 else []), u), assistant(a)]
        rows.append(Row([_b(im[n]) for n in names], msgs, kept=kept))
    file = _write(root / "CoSyn_400k_chart" / SHARD, records, features)
    return Written("finevision", root / "CoSyn_400k_chart", file, rows,
                   "texts [{user, assistant}] + images list<Image>")


def write_llava_onevision(root: Path, im: dict[str, Path]) -> Written:
    """lmms-lab/LLaVA-OneVision-Data: ONE nullable ``image`` per row (bytes, path null), ``conversations``."""
    from datasets import Features, Image, List, Value

    features = Features({"id": Value("string"), "image": Image(),
                         "conversations": List({"from": Value("string"), "value": Value("string")}),
                         "data_source": Value("string")})

    def c(*turns):
        return [{"from": r, "value": v} for r, v in turns]

    spec = [
        ("ai2d_1", "red.jpg", c(("human", "<image>\nWhich label is the sun?"), ("gpt", "B")),
         [user(IMG, "Which label is the sun?"), assistant("B")]),
        ("text_2", None, c(("human", "What is 2+2?"), ("gpt", "4"), ("human", "And 3+3?"), ("gpt", "6")),
         [user("What is 2+2?"), assistant("4"), user("And 3+3?"), assistant("6")]),
        ("ai2d_3", "tall.png", c(("human", "Look: <image>\nWhat is at the top?"), ("gpt", "A cloud.")),
         [user("Look: ", IMG, "What is at the top?"), assistant("A cloud.")]),
    ]
    records = [{"id": i, "image": {"bytes": _b(im[n]), "path": None} if n else None, "conversations": conv,
                "data_source": "ai2d(cauldron,llava_format)"} for i, n, conv, _ in spec]
    rows = [Row([_b(im[n])] if n else [], msgs, user_id=i) for i, n, _, msgs in spec]
    config = root / "ai2d(cauldron,llava_format)"
    file = _write(config / SHARD, records, features, embed=False)  # shipped with bytes in and no path
    return Written("llava_onevision", config, file, rows,
                   "conversations [{from, value}] + image Image (one per row, nullable)")


def write_pixmo_docs(root: Path, im: dict[str, Path]) -> Written:
    """allenai/pixmo-docs: ``image`` + ``image_id``, ``questions`` a Sequence of {question, answer} dicts
    (stored by ``datasets`` as a struct of two lists)."""
    from datasets import Features, Image, Sequence, Value

    features = Features({"image": Image(), "image_id": Value("string"),
                         "questions": Sequence({"question": Value("string"), "answer": Value("string")})})
    spec = [
        ("blue.jpg", ["What is the highest bar?", "What is its value?"], ["March", "42"]),
        ("wide.jpg", ["What is the title?"], ["Sales"]),
        ("square.png", ["Q1?", "Q2?"], ["A1."]),  # bad: unequal lists
        ("tall.png", ["How many rows?", "Which is last?", "Any totals?"], ["3", "Row C", "No."]),
    ]
    records = [{"image": _s(im[n]), "image_id": f"chart_{k}", "questions": {"question": q, "answer": a}}
               for k, (n, q, a) in enumerate(spec)]
    rows = []
    for n, qs, ans in spec:
        if len(qs) != len(ans):
            rows.append(Row([], None, "malformed_record"))
            continue
        msgs = []
        for k, (q, a) in enumerate(zip(qs, ans)):
            msgs += [user(*([IMG] if k == 0 else []), q), assistant(a)]
        rows.append(Row([_b(im[n])], msgs))
    file = _write(root / "charts" / SHARD, records, features)
    return Written("pixmo_docs", root / "charts", file, rows,
                   "questions {question[], answer[]} + image Image (one per row, nullable)")


CAPTION_PROMPT = "Describe the image."


def write_pixmo_cap(root: Path, im: dict[str, Path], prompt: str = CAPTION_PROMPT) -> Written:
    """PixMo-Cap style with the images downloaded: ``image`` + ``caption`` (+ ``transcripts``)."""
    from datasets import Features, Image, List, Value

    features = Features({"image": Image(), "caption": Value("string"), "transcripts": List(Value("string"))})
    spec = [("red.jpg", "A red rectangle with a white circle in its corner."),
            ("wide.jpg", "A long purple banner."), ("square.png", "An orange square.")]
    records = [{"image": _s(im[n]), "caption": cap, "transcripts": [cap.lower()]} for n, cap in spec]
    rows = [Row([_b(im[n])], [user(IMG, *([prompt] if prompt else [])), assistant(cap)]) for n, cap in spec]
    file = _write(root / "data" / SHARD, records, features)
    return Written("pixmo_cap", root, file, rows, "caption (string) + image Image (one per row, nullable)",
                   {"caption_prompt": prompt})


def write_messages(root: Path, im: dict[str, Path]) -> Written:
    """HF messages (HuggingFaceH4/llava-instruct-mix-vsft): an image part's ``index`` points into ``images``."""
    from datasets import Features, Image, List, Value

    part = {"index": Value("int64"), "text": Value("string"), "type": Value("string")}
    features = Features({"images": List(Image()),
                         "messages": List({"role": Value("string"), "content": List(part)})})

    def p_img(k):
        return {"index": k, "text": None, "type": "image"}

    def p_txt(t):
        return {"index": None, "text": t, "type": "text"}

    def m(role, *parts):
        return {"role": role, "content": list(parts)}

    spec = [  # (images as stored, messages, the images in the order the parts name them)
        (["red.jpg", "tall.png"],
         [m("user", p_img(1), p_txt("What is in this picture?")), m("assistant", p_txt("A tall green shape.")),
          m("user", p_txt("And in this one? "), p_img(0)), m("assistant", p_txt("A red box."))],
         ["tall.png", "red.jpg"]),
        (["blue.jpg"], [m("user", p_img(0), p_txt("Colour?")), m("assistant", p_txt("Blue."))], ["blue.jpg"]),
        ([], [m("user", p_txt("Hello")), m("assistant", p_txt("Hi, how can I help?"))], []),
    ]
    records = [{"images": [_s(im[n]) for n in names], "messages": msgs} for names, msgs, _ in spec]
    rows = []
    for _, msgs, order in spec:
        hf = [{"role": x["role"], "content": [IMG if q["type"] == "image" else text(q["text"])
                                              for q in x["content"]]} for x in msgs]
        rows.append(Row([_b(im[n]) for n in order], hf))
    file = _write(root / "data" / SHARD, records, features)
    return Written("messages", root, file, rows, "messages [{role, content}] + images list<Image>")


def write_local_paths(root: Path, photos: dict[str, Path]) -> Written:
    """``Dataset.to_parquet`` of a dataset built from local image files: ``bytes`` null, ``path`` absolute."""
    from datasets import Features, Image, List, Value

    features = Features({"images": List(Image()),
                         "conversations": List({"from": Value("string"), "value": Value("string")})})
    spec = [(["red.jpg", "tall.png"], "<image>\n<image>\nCompare them.", "The first is red.",
             [user(IMG, IMG, "Compare them."), assistant("The first is red.")]),
            (["square.png"], "What shape?<image>", "A square.", [user("What shape?", IMG), assistant("A square.")])]
    records = [{"images": [_s(photos[n]) for n in names],
                "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
               for names, q, a, _ in spec]
    rows = [Row([_b(photos[n]) for n in names], msgs) for names, _, _, msgs in spec]
    file = _write(root / "data" / SHARD, records, features, embed=False)
    return Written("local_paths", root, file, rows, "conversations [{from, value}] + images list<Image>",
                   {"image_root": str(photos["red.jpg"].parent)})


def write_url_only(root: Path) -> Path:
    """allenai/pixmo-cap as shipped: image URLs, no image bytes."""
    from datasets import Features, List, Value

    features = Features({"image_url": Value("string"), "caption": Value("string"),
                         "transcripts": List(Value("string")), "image_sha256": Value("string")})
    records = [{"image_url": f"https://example.com/{k}.jpg", "caption": f"caption {k}", "transcripts": [],
                "image_sha256": f"{k:064x}"} for k in range(3)]
    return _write(root / "data" / SHARD, records, features, embed=False)


WRITERS = {"cauldron": write_cauldron, "finevision": write_finevision, "llava_onevision": write_llava_onevision,
           "pixmo_docs": write_pixmo_docs, "pixmo_cap": write_pixmo_cap, "messages": write_messages}


def write_all(base: Path) -> dict[str, Written]:
    """Every collection above under ``base`` (the embedded ones from one set of images, the local-path one
    from its own photo folder)."""
    images = write_images(base / "source_images")
    out = {name: fn(base / name, images) for name, fn in WRITERS.items()}
    out["local_paths"] = write_local_paths(base / "local_paths", write_images(base / "photos"))
    return out
