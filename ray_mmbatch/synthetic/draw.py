"""Learnable synthetic pictures: coloured shapes on backgrounds, and document pages.

A picture is first a *spec* (plain data drawn from an rng), then pixels. The
spec is what the texts describe (colour, shape, position, size, count, the
rendered words), so a model can learn the mapping from pixels to words.

Cost: a scene is drawn at <= 1024 px on its long side; a document page (1000-3000 px
per side, white with black lines of text) costs about ten scenes, dominated by
rendering the text and the zlib/JPEG encode (benchmarks/RESULTS.md, "Data generation"). Noise backgrounds
are low-resolution noise upscaled, so they stay cheap and compressible.

Pure module: Pillow and numpy only.
"""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw, ImageFont

SHAPES = ("circle", "square", "triangle", "star", "diamond", "hexagon", "cross", "ring")
COLOURS = {
    "red": (220, 30, 30), "green": (30, 160, 60), "blue": (30, 70, 220), "yellow": (240, 220, 30),
    "orange": (245, 140, 20), "purple": (130, 40, 170), "pink": (240, 120, 180), "cyan": (30, 200, 210),
    "brown": (120, 70, 30), "black": (10, 10, 10), "white": (250, 250, 250), "gray": (128, 128, 128),
}
# 3x3 grid cells: name -> (x, y) centre as a fraction of the picture.
POSITIONS = {
    "top-left": (1 / 6, 1 / 6), "top": (0.5, 1 / 6), "top-right": (5 / 6, 1 / 6),
    "left": (1 / 6, 0.5), "center": (0.5, 0.5), "right": (5 / 6, 0.5),
    "bottom-left": (1 / 6, 5 / 6), "bottom": (0.5, 5 / 6), "bottom-right": (5 / 6, 5 / 6),
}
SIZES = {"small": 0.07, "medium": 0.11, "large": 0.16}  # radius as a fraction of the shorter side
BACKGROUNDS = ("solid", "gradient", "noise")
WORDS = (
    "apple", "river", "stone", "cloud", "tiger", "piano", "lemon", "rocket", "garden", "silver",
    "window", "candle", "forest", "planet", "bridge", "mirror", "anchor", "violin", "desert", "harbor",
    "pepper", "marble", "falcon", "meadow", "copper", "orbit", "canyon", "velvet", "glacier", "lantern",
)


@dataclass
class EncodedImage:
    """An image file as written: its bytes and file extension (jpg, png, or a hostile one)."""
    data: bytes
    ext: str


@dataclass
class Sample:
    """One generated sample before a format writer stores it.

    ``conversations`` is a list of {"from", "value"} for good samples; hostile
    kinds may put anything there. ``overrides`` lets a hostile kind replace
    what one format writes (documented in generate.py's writers).
    """
    sample_id: str
    conversations: object
    images: list[EncodedImage]
    category: str = ""
    expected: str = ""
    """Skip reason the pipeline must report for this sample ("" = usable)."""
    unusual: bool = False
    """Hostile but valid: must be used, not skipped."""
    overrides: dict = field(default_factory=dict)


@dataclass
class ShapeSpec:
    shape: str
    colour: str
    position: str
    size: str


@dataclass
class SceneSpec:
    """One picture of shapes; every field is something a text can talk about."""
    width: int
    height: int
    background: str
    bg_colour: str
    bg_colour2: str
    shapes: list[ShapeSpec]
    words: list[str] = field(default_factory=list)
    noise_seed: int = 0


@dataclass
class DocumentSpec:
    """A white page: a title line then body lines of words (learnable: read the title, count lines)."""
    width: int
    height: int
    title: list[str]
    lines: list[list[str]]


def random_side_pair(rng: np.random.Generator, long_lo: int, long_hi: int) -> tuple[int, int]:
    """(width, height) with the long side log-uniform in [long_lo, long_hi] and aspect 1:4..4:1."""
    long_side = int(np.exp(rng.uniform(np.log(long_lo), np.log(long_hi))))
    ratio = float(np.exp(rng.uniform(np.log(1.0), np.log(4.0))))  # long / short, 1..4
    short_side = max(1, int(round(long_side / ratio)))
    return (long_side, short_side) if rng.random() < 0.5 else (short_side, long_side)


def random_scene(rng: np.random.Generator, long_lo: int = 16, long_hi: int = 1024) -> SceneSpec:
    width, height = random_side_pair(rng, long_lo, long_hi)
    colour_names = list(COLOURS)
    bg, bg2 = rng.choice(len(colour_names), size=2, replace=False)
    n_shapes = int(rng.integers(1, 5))
    cells = rng.choice(len(POSITIONS), size=n_shapes, replace=False)
    shapes = []
    for cell in cells:
        colour = colour_names[int(rng.integers(len(colour_names)))]
        while colour in (colour_names[bg], colour_names[bg2]):  # keep shapes visible
            colour = colour_names[int(rng.integers(len(colour_names)))]
        shapes.append(ShapeSpec(SHAPES[int(rng.integers(len(SHAPES)))], colour,
                                list(POSITIONS)[int(cell)], list(SIZES)[int(rng.integers(len(SIZES)))]))
    words = []
    if min(width, height) >= 96 and rng.random() < 0.35:
        words = [WORDS[int(i)] for i in rng.integers(len(WORDS), size=int(rng.integers(1, 3)))]
    return SceneSpec(width, height, BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))],
                     colour_names[bg], colour_names[bg2], shapes, words, int(rng.integers(2**31)))


def random_document(rng: np.random.Generator) -> DocumentSpec:
    width = int(rng.integers(1000, 2300))
    height = int(min(3000, width * rng.uniform(1.0, 1.42)))
    title = [WORDS[int(i)] for i in rng.integers(len(WORDS), size=int(rng.integers(2, 5)))]
    n_lines = int(rng.integers(8, 40))
    lines = [[WORDS[int(i)] for i in rng.integers(len(WORDS), size=int(rng.integers(3, 9)))]
             for _ in range(n_lines)]
    return DocumentSpec(width, height, title, lines)


@lru_cache(maxsize=64)
def font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def _polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if shape == "triangle":
        angles, radii = np.array([-90, 30, 150]), [r] * 3
    elif shape == "diamond":
        angles, radii = np.array([-90, 0, 90, 180]), [r] * 4
    elif shape == "hexagon":
        angles, radii = np.arange(6) * 60.0, [r] * 6
    else:  # star
        angles, radii = np.arange(10) * 36.0 - 90, [r if i % 2 == 0 else r * 0.45 for i in range(10)]
    rad = np.deg2rad(angles)
    return [(cx + rr * np.cos(a), cy + rr * np.sin(a)) for a, rr in zip(rad, radii)]


def _background(spec: SceneSpec) -> Image.Image:
    c1, c2 = COLOURS[spec.bg_colour], COLOURS[spec.bg_colour2]
    if spec.background == "solid":
        return Image.new("RGB", (spec.width, spec.height), c1)
    if spec.background == "gradient":
        # A 2-pixel image stretched by bilinear resize is a gradient at the cost of one resize.
        two = Image.new("RGB", (2, 1))
        two.putpixel((0, 0), c1)
        two.putpixel((1, 0), c2)
        return two.resize((spec.width, spec.height), Image.BILINEAR)
    # Low-resolution noise upscaled: cheap to make, compresses like a photo would not.
    noise_rng = np.random.default_rng(spec.noise_seed)
    base = np.array(c1, dtype=np.int16) + noise_rng.integers(-40, 41, size=(12, 12, 3))
    small = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8), "RGB")
    return small.resize((spec.width, spec.height), Image.BILINEAR)


def draw_scene(spec: SceneSpec) -> Image.Image:
    img = _background(spec)
    draw = ImageDraw.Draw(img)
    short = min(spec.width, spec.height)
    for s in spec.shapes:
        fx, fy = POSITIONS[s.position]
        cx, cy, r = fx * spec.width, fy * spec.height, max(1.0, SIZES[s.size] * short)
        fill = COLOURS[s.colour]
        box = (cx - r, cy - r, cx + r, cy + r)
        if s.shape == "circle":
            draw.ellipse(box, fill=fill)
        elif s.shape == "ring":
            draw.ellipse(box, outline=fill, width=max(1, int(r / 3)))
        elif s.shape == "square":
            draw.rectangle(box, fill=fill)
        elif s.shape == "cross":
            w = r / 3
            draw.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fill)
            draw.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fill)
        else:
            draw.polygon(_polygon(s.shape, cx, cy, r), fill=fill)
    if spec.words:
        size = max(8, short // 10)
        draw.text((short * 0.05, spec.height - size * 1.4), " ".join(spec.words), fill=(0, 0, 0),
                  font=font(size), stroke_width=1, stroke_fill=(255, 255, 255))
    return img


def draw_document(spec: DocumentSpec) -> Image.Image:
    img = Image.new("L", (spec.width, spec.height), 255)
    draw = ImageDraw.Draw(img)
    margin, body = spec.width // 12, max(12, spec.width // 60)
    y = margin
    draw.text((margin, y), " ".join(spec.title).title(), fill=0, font=font(body * 2))
    y += body * 4
    for line in spec.lines:
        if y + body > spec.height - margin:
            break
        draw.text((margin, y), " ".join(line), fill=30, font=font(body))
        y += int(body * 1.6)
    return img


def visible_lines(spec: DocumentSpec) -> int:
    """How many body lines actually fit on the page (texts must not describe cut-off lines)."""
    margin, body = spec.width // 12, max(12, spec.width // 60)
    room = spec.height - margin - (margin + body * 4) - body
    return max(0, min(len(spec.lines), room // int(body * 1.6) + 1))


def encode(img: Image.Image, mode: str, fmt: str, quality: int = 85) -> bytes:
    """Convert to ``mode`` (RGB, RGBA, L, P) and encode as ``fmt`` (JPEG or PNG).

    PNG uses compress_level=1: the files are test data, and encode time, not
    size, is what bounds generating 10,000 samples in under a minute.
    """
    if fmt == "JPEG" and mode not in ("RGB", "L", "CMYK"):
        raise ValueError(f"JPEG cannot hold mode {mode}; use PNG")
    if mode == "P":
        img = img.convert("RGB").quantize(colors=64, method=Image.Quantize.FASTOCTREE)
    elif mode == "RGBA":
        img = img.convert("RGBA")
        img.putalpha(230)
    elif img.mode != mode:
        img = img.convert(mode)
    buf = io.BytesIO()
    if fmt == "JPEG":
        img.save(buf, format="JPEG", quality=quality)
    else:
        img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()
