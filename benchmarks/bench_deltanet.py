"""What the exact packed path through Qwen3.5's Gated DeltaNet layers costs, against the padded batch (issue 45).

Question: a packed row of T tokens (4k, 16k) made of samples of mixed lengths; its DeltaNet layers must start
every sample from a zero state (models/deltanet.py: HF's own layer forward on the samples as segments, those of
one 64-token chunk count batched). How long does that take against the same samples as a right-padded batch
(pad mode: HF's forward on [B, Lmax]), and against HF's forward over the row as one sequence (what packing would
cost with no isolation at all: wrong, but the floor)?

Method (one process, CPU, fp32, ``torch.set_num_threads(--threads)``, default 1; figures are the process's CPU
time, ``time.process_time``, so that the shared machine's load does not stretch them):

    a random Qwen3.5 (tests/hf_checkpoints.make_qwen3_5_checkpoint at the benchmark's width: text 256 wide,
    4 layers = 3 Gated DeltaNet + 1 full attention, DeltaNet 2 key heads / 4 value heads of 64, as the published
    models' 1 : 2 key : value heads and head dim 128 halved; initializer_range 0.02)
    samples: lengths drawn log-uniform in [--min-len, --max-len] (seed) until the row holds T tokens (the last
    one cut to fit), token ids random; the same samples in every mode
    layer:  one DeltaNet layer on random hidden states [1, T, 256]: forward + backward of the output's sum
            exact      segmented_forward with the row's boundaries (the project's pack mode)
            per-sample the same, every sample its own call (no chunk-count groups): what grouping saves
            one-seq    HF's forward over the row as one sequence (leaks across samples)
            pad        HF's forward on the samples padded to the longest, [B, Lmax, 256]
    model:  the whole model, a train step's forward + backward (HFModel.forward loss_only, sum of target CE):
            pack (exact) vs pad (collate_pack / collate_pad of the same samples, every token a target)
    each figure: the median CPU time of --repeats runs after one warm-up

Run: ``python benchmarks/bench_deltanet.py --tokens 4096,16384`` (figures: benchmarks/RESULTS.md,
"Qwen3.5: the exact DeltaNet path against pad (issue 45)").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: tests/

WIDTH = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
         "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "linear_key_head_dim": 64,
         "linear_value_head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4}


def sample_lengths(total: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while sum(out) < total:
        out.append(int(np.exp(rng.uniform(np.log(lo), np.log(hi)))))
    out[-1] -= sum(out) - total
    return [n for n in out if n > 0]


def timed(fn, repeats: int) -> float:
    """The median CPU time of the process over ``repeats`` calls of ``fn`` after one warm-up (CPU, not wall: the
    shared machine's other jobs stretch wall time several-fold; with one thread it is the compute itself)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def layer_figures(layer, lengths: list[int], hidden: int, repeats: int) -> dict[str, float]:
    from ray_mmbatch.models import deltanet

    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    torch.manual_seed(0)
    row = torch.randn(1, bounds[-1], hidden)
    padded = torch.zeros(len(lengths), max(lengths), hidden)
    for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        padded[j, :b - a] = row[0, a:b]
    hf = type(layer).forward

    def step(fn, x):
        def run():
            x.grad = None
            fn(x.requires_grad_()).sum().backward()
        return run

    def per_sample(x):
        return torch.cat([hf(layer, x[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])], dim=1)

    deltanet.ensure([layer])
    with torch.no_grad():  # the timed paths compute what they claim: exact = each sample alone; one-seq leaks
        alone = per_sample(row)
        assert (layer(row, **{deltanet.SEGMENTS: tuple(bounds)}) - alone).abs().max() < 1e-4
        assert len(lengths) == 1 or (hf(layer, row) - alone).abs().max() > 1e-3

    return {"exact": timed(step(lambda x: layer(x, **{deltanet.SEGMENTS: tuple(bounds)}), row), repeats),
            "per-sample": timed(step(per_sample, row), repeats),
            "one-seq": timed(step(lambda x: hf(layer, x), row), repeats),
            "pad": timed(step(lambda x: hf(layer, x), padded), repeats)}


def model_figures(model, lengths: list[int], vocab: int, repeats: int) -> dict[str, float]:
    from ray_mmbatch.batching.collate import collate_pack, collate_pad
    from ray_mmbatch.train.step import batch_to_torch

    rng = np.random.default_rng(1)
    samples = []
    for i, n in enumerate(lengths):
        ids = rng.integers(10, vocab, n).astype(np.int32)
        labels = np.append(ids[1:], -100).astype(np.int32)
        samples.append({"sample_id": f"s{i}", "input_ids": ids, "labels": labels,
                        "patches": np.zeros((0, 3 * 16 * 16), np.uint8), "grids": np.zeros((0, 3), np.int32)})
    out = {}
    for mode, collate in (("pack", collate_pack), ("pad", collate_pad)):
        batch = batch_to_torch(collate(samples, 0), "cpu")

        def run(batch=batch):
            model.zero_grad(set_to_none=True)
            loss, _ = model(batch, loss_only=True)
            loss.backward()
        out[mode] = timed(run, repeats)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="4096,16384", help="packed row lengths T")
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model-tokens", default="",
                   help="row lengths T of the whole-model step too (comma list; default none)")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from ray_mmbatch.config import Config
    from ray_mmbatch.models import deltanet, qwen3_5, token_ids
    from tests.hf_checkpoints import make_qwen3_5_checkpoint

    results = {"args": vars(args), "rows": []}
    with tempfile.TemporaryDirectory(prefix="bench_deltanet_") as tmp:
        path = make_qwen3_5_checkpoint(tmp, initializer_range=0.02, text=WIDTH)
        cfg = Config()
        cfg.model.path = str(path)
        qwen3_5.configure(cfg)
        model = qwen3_5.create_model(cfg, token_ids(cfg)).train()
        layer = next(m for m in model.modules() if deltanet.is_deltanet(m))
        vocab = model.hf_model.config.text_config.vocab_size
        for total in (int(t) for t in args.tokens.split(",")):
            lengths = sample_lengths(total, args.min_len, args.max_len, args.seed)
            row = {"tokens": total, "samples": len(lengths), "longest": max(lengths),
                   "pad_tokens": len(lengths) * max(lengths),
                   "chunk_groups": len({-(-n // deltanet.CHUNK) for n in lengths}),
                   "layer_s": layer_figures(layer, lengths, WIDTH["hidden_size"], args.repeats)}
            if str(total) in args.model_tokens.split(","):
                row["model_s"] = model_figures(model, lengths, vocab, args.repeats)
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
    print(_table(results["rows"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


def _table(rows: list[dict]) -> str:
    lines = ["| T | samples (longest) | pad batch | DeltaNet layer fwd+bwd: exact / per-sample / one-seq / pad "
             "(CPU ms) "
             "| exact / pad | model step: pack / pad (CPU s) | pack / pad |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lay, mod = r["layer_s"], r.get("model_s")
        model = f"{mod['pack']:.2f} / {mod['pad']:.2f} | {mod['pack'] / mod['pad']:.2f}" if mod else "- | -"
        lines.append(f"| {r['tokens']} | {r['samples']} ({r['longest']}) | {r['samples']} x {r['longest']} = "
                     f"{r['pad_tokens']} | {lay['exact'] * 1e3:.0f} / {lay['per-sample'] * 1e3:.0f} / "
                     f"{lay['one-seq'] * 1e3:.0f} / {lay['pad'] * 1e3:.0f} | {lay['exact'] / lay['pad']:.2f} "
                     f"| {model} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
