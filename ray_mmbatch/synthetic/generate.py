"""Synthetic image-text datasets in the formats users already have (Parquet, WebDataset, LLaVA).

Mixture (per good sample, drawn from ``np.random.default_rng([seed, index])``):

    35%  caption       one image + a short caption (~10-40 tokens); the human turn is
                       "<image>" alone (LLaVA-pretrain style) or "<image>\\n<instruction>"
    30%  conversation  one image + 2-150 Q/A turns about its shapes, colours, positions,
                       sizes, count, background and rendered words (~50 to ~3,000 tokens)
    10%  document      one white page 1000-3000 px per side with a title and lines of text
    10%  multi_image   2-6 images (long side 16-512 px) + questions across them
    15%  text_only     arithmetic / word questions, 1-30 turns, no image

Scenes have long sides log-uniform in 16-1024 px and aspect 1:4..4:1; modes
RGB 55% / L 15% / RGBA 15% / P 15%; RGB and L are JPEG 60% of the time, else
PNG. Every image of a sample has one ``<image>`` in the first human turn.

Sample ``i`` is a function of (seed, i) only, so shards are generated in
parallel (``multiprocessing`` spawn pool, one task per shard) and the output
is byte-identical run to run. Bad samples (synthetic/bad_samples.py) are spread
evenly among the good ones. Cost: a few ms of CPU per good sample, dominated by
documents (drawing and encoding big pages); figures in benchmarks/RESULTS.md
("Data generation").

The format writers (one shard each) are in synthetic/shard_writers.py.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os

import numpy as np

from ray_mmbatch import schema
from ray_mmbatch.synthetic import bad_samples
from ray_mmbatch.synthetic.draw import (
    COLOURS,
    EncodedImage,
    Sample,
    draw_document,
    draw_scene,
    encode,
    random_document,
    random_scene,
    visible_lines,
)
from ray_mmbatch.synthetic.shard_writers import WRITERS, manifest_ids

MIXTURE = (("caption", 0.35), ("conversation", 0.30), ("document", 0.10), ("multi_image", 0.10),
           ("text_only", 0.15))
FORMATS = ("parquet", "webdataset", "llava")
PARQUET_STYLES = ("conversations", "caption")
IMG = schema.IMAGE_PLACEHOLDER


# ------------------------------------------------------------------ texts
def _shape_phrase(s) -> str:
    return f"a {s.size} {s.colour} {s.shape}"


def caption(scene) -> str:
    parts = [f"{_shape_phrase(s)} at the {s.position}" for s in scene.shapes]
    text = "; ".join(parts)
    text = f"{text[0].upper()}{text[1:]} on a {scene.background} {scene.bg_colour} background"
    if scene.words:
        text += f", with the words \"{' '.join(scene.words)}\" written at the bottom"
    return text + "."


def _scene_qa(rng, scene) -> tuple[str, str]:
    s = scene.shapes[int(rng.integers(len(scene.shapes)))]
    n = len(scene.shapes)
    pick = int(rng.integers(8))
    if pick == 0:
        return f"What colour is the {s.shape} at the {s.position}?", f"It is {s.colour}."
    if pick == 1:
        return f"Where is the {s.colour} {s.shape}?", f"The {s.colour} {s.shape} is at the {s.position}."
    if pick == 2:
        return "How many shapes are there?", f"There {'is' if n == 1 else 'are'} {n} shape{'s' * (n != 1)}."
    if pick == 3:
        return "What does the background look like?", f"It is a {scene.background} {scene.bg_colour} background."
    if pick == 4:
        said = " ".join(scene.words)
        return "Is any text written in the image?", (f"Yes, it says \"{said}\"." if said else "No, there is no text.")
    if pick == 5:
        return f"How big is the {s.colour} {s.shape}?", f"It is {s.size}."
    if pick == 6:
        other = list(COLOURS)[int(rng.integers(len(COLOURS)))]
        present = any(t.colour == other for t in scene.shapes)
        return f"Is there a {other} shape?", (("Yes." if present else "No.")
                                              + f" The shapes are {', '.join(t.colour for t in scene.shapes)}.")
    return "Describe the image in detail.", caption(scene)


def _turns(rng, lo: int, hi: int) -> int:
    return int(np.exp(rng.uniform(np.log(lo), np.log(hi + 1))))


def _scene_image(rng, long_lo=16, long_hi=1024) -> tuple[object, EncodedImage]:
    scene = random_scene(rng, long_lo, long_hi)
    r = rng.random()
    mode = "RGB" if r < 0.55 else "L" if r < 0.70 else "RGBA" if r < 0.85 else "P"
    fmt = "JPEG" if mode in ("RGB", "L") and rng.random() < 0.6 else "PNG"
    return scene, EncodedImage(encode(draw_scene(scene), mode, fmt), "jpg" if fmt == "JPEG" else "png")


def _caption_sample(rng, sid):
    scene, image = _scene_image(rng)
    human = IMG if rng.random() < 0.5 else f"{IMG}\nWrite a short caption for this picture."
    return [{"from": "human", "value": human}, {"from": "gpt", "value": caption(scene)}], [image]


def _conversation_sample(rng, sid):
    scene, image = _scene_image(rng)
    conv = [{"from": "system", "value": "You are a careful assistant who describes pictures."}] \
        if rng.random() < 0.3 else []
    for t in range(_turns(rng, 2, 150)):
        q, a = _scene_qa(rng, scene)
        conv += [{"from": "human", "value": f"{IMG}\n{q}" if t == 0 else q}, {"from": "gpt", "value": a}]
    return conv, [image]


def _document_sample(rng, sid):
    doc = random_document(rng)
    fmt = "PNG" if rng.random() < 0.4 else "JPEG"  # JPEG encodes a page ~3x faster than PNG
    image = EncodedImage(encode(draw_document(doc), "L", fmt), "png" if fmt == "PNG" else "jpg")
    shown = visible_lines(doc)
    conv = [{"from": "human", "value": f"{IMG}\nWhat is the title of this page?"},
            {"from": "gpt", "value": f"The title is \"{' '.join(doc.title).title()}\"."}]
    for _ in range(_turns(rng, 1, 12)):
        if rng.random() < 0.3 or shown == 0:
            conv += [{"from": "human", "value": "How many lines of text are below the title?"},
                     {"from": "gpt", "value": f"There are {shown} lines."}]
        else:
            k = int(rng.integers(shown))
            conv += [{"from": "human", "value": f"Read line {k + 1}."},
                     {"from": "gpt", "value": " ".join(doc.lines[k])}]
    return conv, [image]


def _multi_image_sample(rng, sid):
    n = int(rng.integers(2, 7))
    scenes, images = zip(*[_scene_image(rng, 16, 512) for _ in range(n)])
    first = f"{IMG}\n" * n
    conv = [{"from": "human", "value": first + "How many images are there?"},
            {"from": "gpt", "value": f"There are {n} images."}]
    for _ in range(_turns(rng, 1, 8)):
        k = int(rng.integers(n))
        s = scenes[k].shapes[0]
        if rng.random() < 0.5:
            conv += [{"from": "human", "value": f"Describe image {k + 1}."},
                     {"from": "gpt", "value": caption(scenes[k])}]
        else:
            which = [i + 1 for i, sc in enumerate(scenes) if any(t.shape == s.shape for t in sc.shapes)]
            conv += [{"from": "human", "value": f"Which images contain a {s.shape}?"},
                     {"from": "gpt", "value": "Images " + ", ".join(map(str, which)) + "."}]
    return conv, list(images)


def _text_only_sample(rng, sid):
    conv = []
    for _ in range(_turns(rng, 1, 30)):
        a, b = (int(x) for x in rng.integers(0, 1000, 2))
        pick = int(rng.integers(3))
        if pick == 0:
            conv += [{"from": "human", "value": f"What is {a} + {b}?"},
                     {"from": "gpt", "value": f"{a} + {b} = {a + b}."}]
        elif pick == 1:
            w = list(COLOURS)[int(rng.integers(len(COLOURS)))]
            conv += [{"from": "human", "value": f"Spell \"{w}\" backwards."}, {"from": "gpt", "value": w[::-1]}]
        else:
            conv += [{"from": "human", "value": f"Which is larger, {a} or {b}?"},
                     {"from": "gpt", "value": f"{max(a, b)} is larger." if a != b else "They are equal."}]
    return conv, []


BUILDERS = {"caption": _caption_sample, "conversation": _conversation_sample, "document": _document_sample,
            "multi_image": _multi_image_sample, "text_only": _text_only_sample}


def make_good_sample(index: int, seed: int) -> Sample:
    """Good sample ``index``: its category and content depend only on (seed, index)."""
    rng = np.random.default_rng([seed, index])
    r, edge = rng.random(), 0.0
    category = MIXTURE[-1][0]
    for name, share in MIXTURE:
        edge += share
        if r < edge:
            category = name
            break
    sid = f"s{index:07d}"
    conv, images = BUILDERS[category](rng, sid)
    return Sample(sid, conv, images, category=category)


# ------------------------------------------------------------ orchestration
def plan_entries(samples: int, seed: int, fmt_key: str, bad_per_kind: int) -> list[tuple]:
    """The written order: good ("good", i) with bad ("bad", kind, k) spread evenly among them."""
    bad = [("bad", kind, k) for k in range(bad_per_kind) for kind in bad_samples.kinds_for(fmt_key)]
    good = [("good", i) for i in range(samples)]
    out, gi = [], 0
    for j, entry in enumerate(bad):
        upto = (j + 1) * samples // (len(bad) + 1)
        out += good[gi:upto]
        gi = upto
        out.append(entry)
    return out + good[gi:]


def _build(entry: tuple, seed: int, fmt_key: str) -> Sample:
    if entry[0] == "good":
        return make_good_sample(entry[1], seed)
    return bad_samples.make_bad_sample(entry[1], entry[2], seed, fmt_key)


def _shard_task(args) -> dict:
    out, fmt, style, seed, shard, n_shards, entries = args
    fmt_key = "caption" if fmt == "parquet" and style == "caption" else fmt
    batch = [_build(e, seed, fmt_key) for e in entries]
    info = WRITERS[fmt_key](out, shard, n_shards, batch)
    info["categories"] = [s.category for s in batch]
    info["expected"] = [(s.expected, s.unusual) for s in batch]
    return info


def _counted(info: dict, progress) -> dict:
    if progress is not None:
        progress.update(len(info["categories"]))
    return info


def generate_dataset(out: str, samples: int, fmt: str, seed: int = 0, shard_size: int = 1000,
                     workers: int = 2, bad_per_kind: int = 0, parquet_style: str = "conversations",
                     progress=None) -> dict:
    """Write a dataset under ``out`` and return its manifest (also written to out/manifest.json).

    Manifest: format, parquet_style, samples (good ones), seed, shard_size, paths
    (relative to ``out``), ids (every sample id a reader must yield, in written
    order), mixture (count per category), bad ({id: expected skip reason}),
    bad_conditions ({id: when the reason applies}), valid_unusual ([ids]).
    ``progress`` (run/progress.Progress): its total is set, and it counts each shard's samples as it is written.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    if parquet_style not in PARQUET_STYLES:
        raise ValueError(f"parquet_style must be one of {PARQUET_STYLES}, got {parquet_style!r}")
    if samples < 0 or shard_size < 1 or workers < 1 or bad_per_kind < 0:
        raise ValueError("samples, bad_per_kind >= 0 and shard_size, workers >= 1 required")
    os.makedirs(out, exist_ok=True)
    fmt_key = "caption" if fmt == "parquet" and parquet_style == "caption" else fmt
    entries = plan_entries(samples, seed, fmt_key, bad_per_kind)
    chunks = [entries[i:i + shard_size] for i in range(0, len(entries), shard_size)] or [[]]
    tasks = [(out, fmt, parquet_style, seed, i, len(chunks), c) for i, c in enumerate(chunks)]
    if progress is not None:
        progress.total = len(entries)
    if workers > 1 and len(tasks) > 1:
        # spawn, not fork: callers (tests, drivers) may hold a Ray connection whose threads must not be forked.
        with mp.get_context("spawn").Pool(min(workers, len(tasks))) as pool:
            infos = [_counted(info, progress) for info in pool.imap(_shard_task, tasks, chunksize=1)]
    else:
        infos = [_counted(_shard_task(t), progress) for t in tasks]
    paths = [p for info in infos for p in info["paths"]]
    if fmt == "llava":
        paths = [WRITERS["llava_index"](out, infos)]
    ids = manifest_ids(fmt, infos)
    manifest = {"format": fmt, "parquet_style": parquet_style if fmt == "parquet" else None,
                "samples": samples, "seed": seed, "shard_size": shard_size, "paths": paths, "ids": ids,
                "mixture": {c: 0 for c, _ in MIXTURE}, "bad": {}, "bad_conditions": {}, "valid_unusual": []}
    cats = [c for info in infos for c in info["categories"]]
    exps = [e for info in infos for e in info["expected"]]
    for sid, cat, (expected, unusual) in zip(ids, cats, exps):
        if cat in manifest["mixture"]:
            manifest["mixture"][cat] += 1
        elif unusual:
            manifest["valid_unusual"].append(sid)
        else:
            manifest["bad"][sid] = expected
            if expected == schema.SKIP_TOO_MANY_IMAGES:
                manifest["bad_conditions"][sid] = (
                    f"only under budget.max_images < {bad_samples.TOO_MANY_IMAGES_N}; valid otherwise")
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    return manifest


def tree_digest(root: str) -> dict[str, str]:
    """sha256 of every regular file under ``root`` (relative path -> hex), for determinism checks."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return dict(sorted(out.items()))
