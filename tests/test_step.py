"""The training step's math: loss normalization over micro-batches and data-parallel ranks.

Reference everywhere: one big batch holding every sample, loss = CE summed over
all targets / number of targets. Accumulation and DDP must reproduce its
gradient; per-micro-batch averaging must not.
"""
from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_model import crop, four_samples, make_sample, make_tokenizer, one_torch_thread, pack, pad, tiny_model  # noqa: F401

from ray_mmbatch import schema as S
from ray_mmbatch.config import TrainConfig
from ray_mmbatch.train.step import (
    accumulate_gradients,
    batch_to_torch,
    build_optimizer,
    lr_lambda,
    optimizer_step,
    token_loss_sum,
)


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def six_samples(tok) -> list[dict]:
    """Target counts differ a lot: 1-word answers next to 10-word ones."""
    return four_samples(tok) + [
        make_sample(tok, "what colour is it", "red", [crop("chelsea", 2, 4, 10, 10)]),
        make_sample(tok, "describe the picture",
                    "a photo of a cat with a red and white cup of coffee here", [crop("chelsea", 4, 4)])]


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def reference_grads(tok, samples) -> tuple[dict, float]:
    model = tiny_model(tok).train()
    ce_sum, n = token_loss_sum(model, batch_to_torch(pack(samples), "cpu"))
    (ce_sum / n).backward()
    return grads(model), float(ce_sum.detach() / n)


def assert_grads_close(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-6, rtol=1e-4, msg=name)


def max_rel_diff(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).norm() / (b[n].norm() + 1e-12)) for n in b)


def micro_batches(tok) -> list[dict]:
    s = six_samples(tok)
    return [pack([s[0], s[1]]), pad([s[4]]), pack([s[5], s[2]]), pad([s[3]])]


def test_accumulation_equals_one_big_batch_and_naive_mean_does_not(tok):
    s = six_samples(tok)
    micro = micro_batches(tok)
    counts = [int((b["labels"] != S.IGNORE_INDEX).sum()) for b in micro]
    assert len(set(counts)) == len(counts), counts          # the case where naive averaging is wrong
    ref, ref_loss = reference_grads(tok, [s[0], s[1], s[4], s[5], s[2], s[3]])

    model = tiny_model(tok).train()
    metrics = accumulate_gradients(model, micro, "cpu")
    assert_grads_close(grads(model), ref)
    assert metrics["n_target"] == sum(counts) and metrics["world_size"] == 1
    assert math.isclose(metrics["loss"], ref_loss, rel_tol=1e-5)

    naive = tiny_model(tok).train()
    for b in micro:
        ce_sum, n = token_loss_sum(naive, batch_to_torch(b, "cpu"))
        (ce_sum / n / len(micro)).backward()
    assert max_rel_diff(grads(naive), ref) > 0.02


def test_zero_target_micro_batch_adds_nothing(tok):
    """The train loop steps a drained rank on a zero-target copy: no loss, no gradient, no NaN."""
    s = six_samples(tok)
    empty = pack([s[0]])
    empty["labels"] = np.full_like(empty["labels"], S.IGNORE_INDEX)
    model = tiny_model(tok).train()
    metrics = accumulate_gradients(model, [empty], "cpu")
    assert metrics["loss"] == 0.0 and metrics["n_target"] == 0
    g = grads(model)       # every parameter gets a (zero) gradient, so DDP's reducer is satisfied
    assert g.keys() == {n for n, _ in model.named_parameters()}
    assert all(torch.count_nonzero(v) == 0 for v in g.values())

    ref, _ = reference_grads(tok, [s[1]])
    model = tiny_model(tok).train()
    accumulate_gradients(model, [empty, pack([s[1]])], "cpu")
    assert_grads_close(grads(model), ref)


def _ddp_worker(rank: int, world: int, init_file: str, per_rank: list[list[dict]], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = torch.nn.parallel.DistributedDataParallel(tiny_model(make_tokenizer()).train())
        metrics = accumulate_gradients(model, per_rank[rank], "cpu")
        torch.save({"grads": grads(model.module), "metrics": metrics}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow   # two spawned interpreters importing torch: ~10 s on 2 cores
def test_ddp_two_ranks_equal_single_process_big_batch(tok, tmp_path):
    s = six_samples(tok)
    per_rank = [[pack([s[0], s[1]]), pad([s[4]])],          # rank 0
                [pack([s[5]]), pad([s[2], s[3]])]]          # rank 1: different target counts
    counts = [sum(int((b["labels"] != -100).sum()) for b in r) for r in per_rank]
    assert counts[0] != counts[1]
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), per_rank, str(tmp_path)), nprocs=2, join=True)
    ref, ref_loss = reference_grads(tok, [s[0], s[1], s[4], s[5], s[2], s[3]])
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        assert_grads_close(out["grads"], ref)
        assert out["metrics"]["n_target"] == sum(counts)
        assert out["metrics"]["local_n_target"] == counts[rank]
        assert math.isclose(out["metrics"]["loss"], ref_loss, rel_tol=1e-5)


def test_bf16_autocast_on_cpu_is_close_to_fp32(tok):
    micro = micro_batches(tok)
    fp32 = accumulate_gradients(tiny_model(tok).train(), micro, "cpu")
    model = tiny_model(tok).train()
    bf16 = accumulate_gradients(model, micro, "cpu", torch.bfloat16)
    assert math.isclose(bf16["loss"], fp32["loss"], rel_tol=0.02)
    assert all(torch.isfinite(g).all() for g in grads(model).values())


def test_batch_to_torch_types_and_read_only_arrays():
    ids = np.frombuffer(np.arange(6, dtype=np.int32).tobytes(), dtype=np.int32).reshape(1, 6)
    assert not ids.flags.writeable
    batch = {"mode": "pack", "input_ids": ids, "labels": ids, "position_ids": ids,
             "cu_seqlens": np.array([0, 6], np.int32), "patches": np.zeros((4, 588), np.uint8),
             "max_seqlen": np.int64(6), "sample_ids": ["a"], "_batch_id": "w/0"}
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error")
        out = batch_to_torch(batch, "cpu")
    assert out["input_ids"].dtype == torch.int64 and out["labels"].dtype == torch.int64
    assert out["cu_seqlens"].dtype == torch.int32 and out["patches"].dtype == torch.uint8
    assert out["max_seqlen"] == 6 and isinstance(out["max_seqlen"], int)
    assert out["mode"] == "pack" and out["sample_ids"] == ["a"] and out["_batch_id"] == "w/0"


def test_optimizer_groups_and_schedule(tok):
    model = tiny_model(tok)
    cfg = TrainConfig(lr=1e-3, weight_decay=0.1, warmup_steps=4)
    opt, sched = build_optimizer(model, cfg, total_steps=20)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    norm_ids = {id(m.weight) for m in model.modules() if "Norm" in type(m).__name__}
    assert norm_ids <= {id(p) for p in no_decay["params"]}
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(1e-3 / 4) and lrs[3] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert lr_lambda(20, 4, 20) == pytest.approx(0.1) and lr_lambda(500, 4, 20) == pytest.approx(0.1)


def test_schedule_by_progress_for_runs_by_epochs(tok):
    """No max_steps: the cosine follows the share of planned samples done, not a step guess."""
    from ray_mmbatch.train.step import Progress, lr_by_progress

    model = tiny_model(tok)
    progress = Progress()
    opt, sched = build_optimizer(model, TrainConfig(lr=1e-3, warmup_steps=2), total_steps=1000, progress=progress)
    lrs = []
    for step in range(12):
        progress.value = step / 10          # 10 steps' worth of samples planned
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))
    assert lrs[-1] == pytest.approx(1e-4)   # the floor once every planned sample is done
    assert lr_by_progress(5, 2, 0.5) == pytest.approx(0.55) and lr_by_progress(5, 2, 3.0) == pytest.approx(0.1)


def test_optimizer_step_updates_and_reports(tok):
    model = tiny_model(tok)
    cfg = TrainConfig(lr=1e-3, warmup_steps=1, grad_clip=1e-3, precision="fp32")
    opt, sched = build_optimizer(model, cfg, total_steps=10)
    before = [p.detach().clone() for p in model.parameters()]
    m = optimizer_step(model, micro_batches(tok), opt, sched, cfg, "cpu")
    assert m["grad_norm"] > 1e-3              # pre-clip norm is reported
    assert set(m) >= {"loss", "n_target", "real_tokens", "time_s", "lr", "grad_norm", "tokens_per_s"}
    assert all(p.grad is None for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="precision"):
        optimizer_step(model, micro_batches(tok), opt, sched, TrainConfig(precision="fp8"), "cpu")


# ------------------------------------------------------------------ learning
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30)}


def colour_batch(tok, rng, n: int, shuffle_images: bool = False) -> dict:
    """n samples 'what colour is it' -> colour word, each with a noisy solid 28x28 image."""
    names = rng.choice(list(COLOURS), size=n)
    images = [np.clip(np.array(COLOURS[c]) + rng.normal(0, 20, (28, 28, 3)), 0, 255).astype(np.uint8)
              for c in names]
    if shuffle_images:
        images = images[1:] + images[:1]
    return pack([make_sample(tok, "what colour is it", c, [im]) for c, im in zip(names, images)])


def test_model_learns_colour_from_the_image(tok):
    rng = np.random.default_rng(0)
    model = tiny_model(tok, seed=1)
    cfg = TrainConfig(lr=3e-3, warmup_steps=10, precision="fp32")
    steps = 150
    opt, sched = build_optimizer(model, cfg, steps)
    start = time.perf_counter()
    losses = [optimizer_step(model, [colour_batch(tok, rng, 16)], opt, sched, cfg, "cpu")["loss"]
              for _ in range(steps)]
    elapsed = time.perf_counter() - start
    model.eval()
    eval_rng = np.random.default_rng(123)
    right, wrong = [], []
    with torch.no_grad():
        for _ in range(4):
            seed = eval_rng.integers(1 << 31)
            for shuffled, out in ((False, right), (True, wrong)):
                b = batch_to_torch(colour_batch(tok, np.random.default_rng(seed), 32, shuffled), "cpu")
                ce, n = token_loss_sum(model, b)
                out.append(float(ce / n))
    right_loss, wrong_loss = float(np.mean(right)), float(np.mean(wrong))
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; eval right {right_loss:.3f} vs shuffled images "
          f"{wrong_loss:.3f}; {steps} steps in {elapsed:.1f}s")
    assert right_loss < 0.1 * losses[0]
    assert right_loss < 0.15
    # ~3/4 of shuffled images show another colour; half the targets are the colour word
    assert wrong_loss > right_loss + 1.0


def _lockstep_worker(rank: int, tmp: str, known: int, dry: int) -> None:
    import json

    import torch.distributed as dist

    from ray_mmbatch.batching.layout import filler_batch
    from ray_mmbatch.train.step import Lockstep

    dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=2)
    def real(k: int) -> dict:
        b = filler_batch(12)
        return b | {"labels": np.zeros_like(b["labels"]), "target_tokens": 2, "sample_ids": [f"s{rank}.{k}"]}

    mine = [real(k) for k in range(3 if rank == 0 else dry)]
    steps, it, log = Lockstep("cpu", known), iter(mine), []
    while True:
        batch, (n,) = steps.join(next(it, None), [1.0])
        if batch is None:
            break
        log.append({"ids": list(batch["sample_ids"]), "targets": int(batch["target_tokens"]),
                    "dim": int(batch["patches"].shape[1]), "ranks": n,
                    "masked": bool((batch["labels"] == -100).all())})
    open(f"{tmp}/rank{rank}.json", "w").write(json.dumps(log))
    dist.destroy_process_group()


@pytest.mark.parametrize("known,dry", [(0, 0), (12, 1)])
def test_lockstep_every_rank_steps_until_none_has_data(tmp_path, known, dry):
    """Rank 0 has 3 batches, rank 1 none (patch size unknown) or 1: both take 3 steps and stop
    together; rank 1 then steps on a zero-target copy of its last batch, or on a filler with
    the patch size rank 0 saw; the sums add both ranks."""
    import json

    mp.spawn(_lockstep_worker, args=(str(tmp_path), known, dry), nprocs=2, join=True)
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["ids"] for s in logs[0]] == [["s0.0"], ["s0.1"], ["s0.2"]] and len(logs[1]) == 3
    assert not any(s["masked"] for s in logs[0])
    assert [s["ids"] for s in logs[1][:dry]] == [["s1.0"]][:dry] and not any(s["masked"] for s in logs[1][:dry])
    ran_dry = logs[1][dry:]
    assert all(s["ids"] == [] and s["targets"] == 0 and s["masked"] and s["dim"] == 12 for s in ran_dry), ran_dry
    assert all(s["ranks"] == 2.0 for log in logs for s in log)
