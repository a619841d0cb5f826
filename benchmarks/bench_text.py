"""Text encoding: plain format vs a checkpoint's own chat template, samples/s on one core.

Question: what does going through the chat template (data/text/template.py: rendered once per
conversation shape, sentinels for text, one batched Rust call) cost against the plain
format? Conversations: the generated mixture (synthetic/generate.py ``make_good_sample``:
captions, 2-150-turn conversations, documents, multi-image, text-only), encoded with
``encode_conversations`` in batches of ``--batch`` as measure_batch does. Tokenizers:
the shipped one (plain) and the same vocabulary saved as a checkpoint with the
Qwen2-VL and LLaVA-1.5 templates (tests/chat_templates.py). "cold" = the first pass
over the set in a fresh process state (every new shape rendered), "warm" = a second
pass (shapes cached, as in a long-running measure actor). Outputs are checked: every
sample encodes (no skip), one image token per image.

    python benchmarks/bench_text.py --samples 2000
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import chat_templates  # noqa: E402

from ray_mmbatch.config import TextConfig  # noqa: E402
from ray_mmbatch.data.text.encoder import encode_conversations, image_token_id, tokenizer_for  # noqa: E402
from ray_mmbatch.data.text.tokenizer import SHIPPED_TOKENIZER  # noqa: E402
from ray_mmbatch.synthetic.generate import make_good_sample  # noqa: E402


def checkpoint(template: str, extra=()) -> str:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(SHIPPED_TOKENIZER))
    tok.add_tokens(list(extra), special_tokens=True)
    tok.chat_template = template
    path = tempfile.mkdtemp(prefix="bench_text_")
    tok.save_pretrained(path)
    return path


def run(cfg: TextConfig, convs: list, n_images: list[int], batch: int) -> tuple[float, int]:
    tok = tokenizer_for(cfg)
    image_id = image_token_id(tok, cfg)
    t0 = time.perf_counter()
    tokens = 0
    for s in range(0, len(convs), batch):
        out = encode_conversations(convs[s:s + batch], n_images[s:s + batch], tok, image_token=cfg.image_token)
        for r, k in zip(out, n_images[s:s + batch]):
            assert not isinstance(r, Exception), r
            assert int((r[0] == image_id).sum()) == k
            tokens += len(r[0])
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args()
    samples = [make_good_sample(i, 0) for i in range(args.samples)]
    convs = [s.conversations for s in samples]
    n_images = [len(s.images) for s in samples]
    turns = np.array([len(c) for c in convs])
    print(f"{len(convs)} conversations, turns mean {turns.mean():.1f} max {turns.max()}, "
          f"images {sum(n_images)}, batch {args.batch}")
    cfgs = {"plain (shipped)": TextConfig(),
            "template Qwen2-VL": TextConfig(tokenizer=checkpoint(chat_templates.QWEN2_VL)),
            "template LLaVA-1.5": TextConfig(tokenizer=checkpoint(chat_templates.LLAVA, ["<image>"]),
                                             image_token="<image>")}
    print(f"{'format':22} {'pass':5} {'s':>7} {'samples/s':>10} {'tokens/s':>10}")
    for name, cfg in cfgs.items():
        for label in ("cold", "warm"):
            dt, tokens = run(cfg, convs, n_images, args.batch)
            print(f"{name:22} {label:5} {dt:7.2f} {len(convs) / dt:10.0f} {tokens / dt:10.0f}")


if __name__ == "__main__":
    main()
