"""Train the small byte-level BPE tokenizer shipped in ray_mmbatch/assets/tokenizer.

Why a tokenizer of our own: nothing can be downloaded from model hubs, tests must be
hermetic, and a 4k vocabulary keeps the demo model's embedding small. Byte-level
BPE (GPT-2 style) so that ANY Unicode text encodes; no unknown token exists.

Corpus (text this repository owns, written to scripts/tokenizer_corpus.txt, beside this
script and out of the wheel, so the tokenizer can be re-trained bit for bit): sentences
generated with a fixed seed from colour / shape / object / position / document / instruction vocabularies
(the words the demo data and real captions use), a few paragraphs of prose written
for this file, numbers, and the repo's own Python sources and Markdown docs.

    python scripts/train_tokenizer.py                  # train from the committed corpus
    python scripts/train_tokenizer.py --rebuild-corpus # regenerate the corpus first

Training takes ~1.5 s on one core; tokenizer.json is ~260 kB, the corpus ~500 kB.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ray_mmbatch import schema as S

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "ray_mmbatch" / "assets"
OUT_DIR = ASSETS / "tokenizer"
CORPUS = ROOT / "scripts" / "tokenizer_corpus.txt"
VOCAB_SIZE = 4096

COLOURS = ("red green blue yellow orange purple pink brown black white gray grey cyan magenta teal navy maroon "
           "olive lime gold silver beige violet indigo turquoise crimson scarlet amber ivory tan khaki coral "
           "salmon lavender mint emerald ruby sapphire charcoal cream peach plum rose").split()
SHADES = "light dark pale bright deep vivid dull muted faded glossy matte shiny transparent striped dotted".split()
SHAPES = ("circle square triangle star rectangle ellipse oval hexagon pentagon octagon diamond rhombus heart "
          "cross arrow crescent ring spiral line curve polygon cube sphere cylinder cone pyramid trapezoid "
          "parallelogram semicircle dot grid wave zigzag").split()
OBJECTS = ("cat dog bird horse cow sheep car truck bus bicycle motorcycle train boat airplane tree flower house "
           "building bridge road river mountain lake beach cloud sky sun moon table chair sofa bed lamp window "
           "door book cup bottle plate bowl fork knife spoon phone laptop keyboard screen clock bag umbrella "
           "shoe hat shirt ball kite fence sign bench person man woman child girl boy face hand street city "
           "forest field garden kitchen room office desk paper pencil camera coffee astronaut rocket").split()
POSITIONS = ("left right top bottom center middle corner edge upper lower above below beside behind in front of "
             "near next to inside outside between around across along").split()
SIZES = "small large big tiny huge medium little enormous thin thick wide narrow tall short long".split()
DOC_WORDS = ("page document invoice receipt table column row header footer title paragraph line chart graph axis "
             "legend figure caption label total amount date number price quantity item name address signature "
             "report form field section chapter summary note list bullet font text letter word").split()
VERBS = ("is are shows contains depicts has holds sits stands lies appears looks rotates moves overlaps touches "
         "surrounds points faces reads says counts draws describes lists answers explains").split()
QUESTIONS = (
    "What colour is the {shape}?", "How many {shape}s are there?", "Where is the {obj} in the image?",
    "Describe the image.", "Describe this picture in detail.", "What is written on the {doc}?",
    "Is the {shape} {colour}?", "What shape is in the {pos} of the image?", "Which object is {pos} the {obj}?",
    "Read the text in the image.", "What is the {doc} about?", "Can you list every {colour} object?",
    "Please summarize the {doc}.", "What is the total on this {doc}?", "Compare the two images.",
    "What is the difference between the first and the second image?", "Count the {colour} {shape}s.",
)
PROSE = """\
A picture is worth a thousand words, but a language model only reads tokens. Each image is cut into
square patches, neighbouring patches are merged, and every merged block becomes one token in the sequence.
The text around the image tells the model what to look at: a question, an instruction, or a caption.
Training batches are filled up to a token budget so that no compute is wasted on padding.
When a sample is too long for any batch, the end of its text is cut and the images are kept whole.
Bad files are never dropped in silence; every skipped sample is counted with its reason.
The assistant answers briefly and precisely. The user asks about colours, shapes, positions and sizes.
There is a small red circle in the upper left corner and a large blue square near the bottom right.
The document has a title at the top, a table with three columns in the middle and a signature at the bottom.
Thank you! Sure, here is a detailed description of the image. I am not sure; the text is too small to read.
Yes. No. Maybe. The answer is two. The answer is none. There are several objects on a white background.
"""


def generated_sentences(rng: random.Random, n: int) -> list[str]:
    """Seeded captions, questions and answers over the demo vocabulary."""
    out = []
    for _ in range(n):
        c, sh, o, p, sz, d, v = (rng.choice(COLOURS), rng.choice(SHAPES), rng.choice(OBJECTS), rng.choice(POSITIONS),
                                 rng.choice(SIZES), rng.choice(DOC_WORDS), rng.choice(VERBS))
        shade = rng.choice(SHADES)
        q = rng.choice(QUESTIONS).format(shape=sh, obj=o, doc=d, colour=c, pos=p)
        k = rng.randint(0, 9999)
        out.append(rng.choice((
            f"A {sz} {c} {sh} {v} in the {p} of the image.",
            f"The {obj_or(o, sh, rng)} is {shade} {c}, {p} a {sz} {rng.choice(OBJECTS)}.",
            f"{q} {rng.choice(('The', 'A', 'One'))} {c} {sh}.",
            f"There are {rng.randint(2, 12)} {c} {sh}s and {rng.randint(1, 9)} {rng.choice(COLOURS)} {o}s.",
            f"{d.capitalize()} {k}: {rng.choice(DOC_WORDS)} {rng.randint(1, 500)}.{rng.randint(0, 99):02d}",
            f"{q}",
            f"The image {v} a {shade} {c} {o} {p} a {rng.choice(COLOURS)} {rng.choice(SHAPES)}.",
        )))
    return out


def obj_or(o: str, sh: str, rng: random.Random) -> str:
    return o if rng.random() < 0.5 else sh


def repo_text() -> list[str]:
    """The repo's own sources and docs (code identifiers and English)."""
    parts = []
    for pattern in ("ray_mmbatch/**/*.py", "scripts/*.py", "jobs/*.py", "*.md", "docs/*.md"):
        for path in sorted(ROOT.glob(pattern)):
            parts.append(path.read_text(encoding="utf-8", errors="replace"))
    return parts


def build_corpus() -> str:
    rng = random.Random(0)
    lines = [PROSE] * 5 + generated_sentences(rng, 6_000)
    lines += [" ".join(str(rng.randint(0, 100_000)) for _ in range(12)) for _ in range(300)]
    lines += repo_text()
    return "\n".join(lines) + "\n"


def train(corpus: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=list(S.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer)
    return tok


def save(tok: Tokenizer, out_dir: Path) -> None:
    """Save as a Hugging Face tokenizer directory (AutoTokenizer.from_pretrained loads it)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=S.PAD_TOKEN, eos_token=S.EOS_TOKEN,
                                 model_max_length=1 << 20)
    named = {S.PAD_TOKEN, S.EOS_TOKEN}
    hf.add_special_tokens({"extra_special_tokens": [t for t in S.SPECIAL_TOKENS if t not in named]})
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out_dir))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rebuild-corpus", action="store_true", help="regenerate tokenizer_corpus.txt first")
    ap.add_argument("--out", default=str(OUT_DIR))
    args = ap.parse_args()
    if args.rebuild_corpus or not CORPUS.exists():
        CORPUS.write_text(build_corpus(), encoding="utf-8")
    tok = train(CORPUS.read_text(encoding="utf-8"))
    save(tok, Path(args.out))
    print(f"vocab {tok.get_vocab_size()} -> {args.out} (corpus {CORPUS.stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
