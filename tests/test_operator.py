"""batch_by_token_budget on a user's own Ray Dataset (dataflow/operator.py): every row once, every
budget held, the collated text layout exact, oversize rows named, the same seed the same batches."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ray_mmbatch
from ray_mmbatch.batching import Budget
from ray_mmbatch.dataflow.operator import OversizeRowError, plan_window, token_budget_stats

ROOT = Path(__file__).resolve().parents[1]
M = -100  # schema.IGNORE_INDEX


def _items(n: int, seed: int = 0, max_tokens: int = 1024) -> list[dict]:
    rng = np.random.default_rng(seed)
    t = np.clip(rng.lognormal(5.0, 0.8, n).astype(int), 1, max_tokens)
    return [{"id": i, "tokens": int(t[i]), "patches": int(rng.integers(0, 300)), "n_img": int(rng.integers(0, 3)),
             "text": f"row {i}"} for i in range(n)]


def _ids(rows, col="id") -> list:
    return sorted(x for r in rows for x in r[col])


# ------------------------------------------------------------------ real Ray
@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_any_dataset_every_row_once_every_budget_held(ray_cluster, mode):
    ray = ray_cluster
    items = _items(700)
    ds = ray.data.from_items(items, override_num_blocks=5)
    out = ray_mmbatch.batch_by_token_budget(ds, tokens="tokens", patches="patches", images="n_img", mode=mode,
                                            max_tokens=1024, max_patches=1500, max_images=8, max_samples=12,
                                            window=128)
    rows = out.take_all()
    assert _ids(rows) == list(range(700))  # exact membership: each id once, none lost, none made up
    budget = Budget(1024, mode, max_patches=1500, max_images=8, max_samples=12)
    by_id = {it["id"]: it for it in items}
    for r in rows:
        assert not r["oversize"]
        # the member columns carry the members' own values, in member order
        assert list(r["tokens"]) == [by_id[i]["tokens"] for i in r["id"]]
        assert list(r["text"]) == [f"row {i}" for i in r["id"]]
        assert budget.violations(r["tokens"], r["patches"], r["n_img"]) == [], r["batch_id"]
        assert r["n_rows"] == len(r["id"])
        assert r["real_tokens"] == sum(r["tokens"])
        assert r["sum_patches"] == sum(r["patches"]) and r["sum_images"] == sum(r["n_img"])
        assert r["padded_tokens"] == (1024 if mode == "pack" else len(r["id"]) * max(r["tokens"]))
        assert r["fill"] == pytest.approx(r["real_tokens"] / r["padded_tokens"])
    assert len({r["batch_id"] for r in rows}) == len(rows)
    stats = token_budget_stats(out)
    assert stats["rows"] == 700 and stats["batches"] == len(rows)
    assert stats["real_tokens"] == sum(it["tokens"] for it in items)
    assert stats["fill"] == pytest.approx(stats["real_tokens"] / sum(r["padded_tokens"] for r in rows))
    assert stats["fill"] > 0.8  # planned, not fixed-size: at most one loose batch per window would not reach this


def test_cost_fn_computes_the_costs(ray_cluster):
    ray = ray_cluster
    words = [" ".join(["w"] * (1 + (i * 37) % 90)) for i in range(300)]
    ds = ray.data.from_items([{"sample_id": f"s{i}", "text": w} for i, w in enumerate(words)], override_num_blocks=3)

    def cost_fn(batch):
        return {"tokens": np.array([len(t.split()) for t in batch["text"]]),
                "images": np.array([len(t) % 3 for t in batch["text"]])}

    rows = ray_mmbatch.batch_by_token_budget(ds, cost_fn=cost_fn, max_tokens=200, max_images=3, window=100).take_all()
    assert _ids(rows, "sample_id") == sorted(f"s{i}" for i in range(300))
    for r in rows:
        lens = [len(t.split()) for t in r["text"]]
        assert r["real_tokens"] == sum(lens) <= 200
        assert r["sum_images"] == sum(len(t) % 3 for t in r["text"]) <= 3
        assert "tokens" not in r  # computed costs are not input columns


def test_text_rows_collate_to_the_hand_computed_layout(ray_cluster):
    ray = ray_cluster
    a, b, c = [11, 12, 13], [21, 22], [31, 32, 33, 34]
    ds = ray.data.from_items([{"id": "a", "input_ids": a}, {"id": "b", "input_ids": b}, {"id": "c", "input_ids": c}],
                             override_num_blocks=1)
    [r] = ray_mmbatch.batch_by_token_budget(ds, max_tokens=9, window=16).take_all()
    assert list(r["id"]) == ["a", "b", "c"] and r["n_rows"] == 3 and r["real_tokens"] == 9
    assert r["input_ids"].tolist() == [[11, 12, 13, 21, 22, 31, 32, 33, 34]]
    assert r["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert r["cu_seqlens"].tolist() == [0, 3, 5, 9]
    assert r["seq_lens"].tolist() == [3, 2, 4] and r["max_seqlen"] == 4
    # shifted (collate.py): labels[t] is the target of the logits at t; each sample's last is -100
    assert r["labels"].tolist() == [[12, 13, M, 22, M, 32, 33, 34, M]]
    assert r["target_tokens"] == 6 and r["padded_tokens"] == 9 and r["fill"] == 1.0

    # the rows' own labels (HF convention: aligned, -100 = no loss) are shifted per sample
    ds = ray.data.from_items([{"id": "a", "input_ids": a, "labels": [M, M, 13]},
                              {"id": "b", "input_ids": b, "labels": [M, 22]}], override_num_blocks=1)
    [r] = ray_mmbatch.batch_by_token_budget(ds, max_tokens=8, window=16).take_all()
    assert r["input_ids"].tolist() == [[11, 12, 13, 21, 22]]
    assert r["labels"].tolist() == [[M, 13, M, 22, M]]
    assert r["cu_seqlens"].tolist() == [0, 3, 5] and r["padded_tokens"] == 8

    # pad: rows padded to the longest with pad_id, attention_mask, labels -100 on padding
    ds = ray.data.from_items([{"id": "a", "input_ids": a}, {"id": "b", "input_ids": b}], override_num_blocks=1)
    [r] = ray_mmbatch.batch_by_token_budget(ds, mode="pad", max_tokens=6, pad_id=7, window=16).take_all()
    assert r["input_ids"].tolist() == [[11, 12, 13], [21, 22, 7]]
    assert r["attention_mask"].tolist() == [[True, True, True], [True, True, False]]
    assert r["labels"].tolist() == [[12, 13, M], [22, M, M]]
    assert r["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    assert r["padded_tokens"] == 6 and r["real_tokens"] == 5


def test_text_rows_many_windows_each_sample_once(ray_cluster):
    ray = ray_cluster
    rng = np.random.default_rng(3)
    items = [{"id": i, "input_ids": rng.integers(1, 1000, int(rng.integers(1, 200))).tolist()} for i in range(400)]
    ds = ray.data.from_items(items, override_num_blocks=4)
    rows = ray_mmbatch.batch_by_token_budget(ds, max_tokens=512, window=64).take_all()
    assert _ids(rows) == list(range(400))
    for r in rows:
        ids = r["input_ids"][0].tolist()
        cu = r["cu_seqlens"].tolist()
        assert len(ids) == cu[-1] == r["real_tokens"] <= 512
        for k, i in enumerate(r["id"]):  # each sample sits whole in its segment, positions restart
            assert ids[cu[k]:cu[k + 1]] == items[i]["input_ids"]
            assert r["position_ids"][0, cu[k]:cu[k + 1]].tolist() == list(range(cu[k + 1] - cu[k]))


def test_a_row_longer_than_max_tokens_is_named(ray_cluster):
    ray = ray_cluster
    items = [{"sample_id": f"s{i}", "tokens": 100} for i in range(20)] + [{"sample_id": "too-long", "tokens": 5000}]
    ds = ray.data.from_items(items, override_num_blocks=1)
    with pytest.raises(Exception) as err:
        ray_mmbatch.batch_by_token_budget(ds, max_tokens=4096, window=64).take_all()
    text = str(err.value)
    assert "'too-long'" in text and "tokens cost 5000 > 4096" in text and "oversize='skip'" in text, text

    rows = ray_mmbatch.batch_by_token_budget(ds, max_tokens=4096, window=64, oversize="skip").take_all()
    flagged = [r for r in rows if r["oversize"]]
    assert [list(r["sample_id"]) for r in flagged] == [["too-long"]]
    assert flagged[0]["real_tokens"] == flagged[0]["padded_tokens"] == 5000
    assert _ids(rows, "sample_id") == sorted(x["sample_id"] for x in items)
    assert all(sum(r["tokens"]) <= 4096 for r in rows if not r["oversize"])


def test_same_seed_same_batches(ray_cluster):
    ray = ray_cluster
    ds = ray.data.from_items(_items(600, seed=5), override_num_blocks=4).materialize()  # fixed input blocks

    def plan(seed):
        rows = ray_mmbatch.batch_by_token_budget(ds, mode="pad", max_tokens=2048, window=150, seed=seed).take_all()
        return sorted((r["batch_id"], tuple(r["id"])) for r in rows)

    first = plan(1)
    assert plan(1) == first
    assert plan(2) != first  # the seed draws each window's batch order
    assert sorted(i for _, ids in plan(2) for i in ids) == list(range(600))


@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_carry_across_windows_every_row_once_fuller_and_seeded(ray_cluster, mode):
    """carry > 0: under-filled batches wait for the next window, the rest held at the end is flushed."""
    ray = ray_cluster
    rng = np.random.default_rng(11)
    items = [{"id": i, "input_ids": rng.integers(1, 1000, int(rng.integers(1, 300))).tolist()} for i in range(1500)]
    ds = ray.data.from_items(items, override_num_blocks=6)

    def run(carry, seed=0):
        return ray_mmbatch.batch_by_token_budget(ds, mode=mode, max_tokens=1024, max_samples=16, window=100,
                                                 carry=carry, seed=seed).take_all()

    alone, carried = run(0.0), run(0.25)
    assert _ids(carried) == list(range(1500))  # held rows come back, the last ones at the flush
    budget = Budget(1024, mode, max_samples=16)
    for r in carried:
        lens = [len(items[i]["input_ids"]) for i in r["id"]]
        assert budget.violations(lens) == [], r["batch_id"]
        if mode == "pack":  # the collated row holds its members whole, a held row's too
            cu = r["cu_seqlens"].tolist()
            for k, i in enumerate(r["id"]):
                assert r["input_ids"][0, cu[k]:cu[k + 1]].tolist() == items[i]["input_ids"]
        else:
            for k, i in enumerate(r["id"]):
                n = len(items[i]["input_ids"])
                assert r["input_ids"][k, :n].tolist() == items[i]["input_ids"] and r["attention_mask"][k].sum() == n
    fill = {name: token_budget_stats(rows)["fill"] for name, rows in (("alone", alone), ("carry", carried))}
    assert fill["carry"] > fill["alone"] + 0.005, fill  # 15 window boundaries each leave loose batches
    assert len(carried) < len(alone)
    # windows are exact slices of the input in input order: the same batches every time, the seed decides
    assert [(r["batch_id"], list(r["id"])) for r in run(0.25)] == [(r["batch_id"], list(r["id"])) for r in carried]
    assert [list(r["id"]) for r in run(0.25, seed=3)] != [list(r["id"]) for r in carried]


def test_carry_rejects_a_bad_fraction_and_skips_oversize_rows(ray_cluster):
    ray = ray_cluster
    with pytest.raises(ValueError, match="carry must be a fraction"):
        ray_mmbatch.batch_by_token_budget(None, max_tokens=10, carry=1.5)
    items = [{"sample_id": f"s{i}", "tokens": 30 + i % 50} for i in range(200)] + [{"sample_id": "big", "tokens": 999}]
    ds = ray.data.from_items(items, override_num_blocks=2)
    rows = ray_mmbatch.batch_by_token_budget(ds, max_tokens=256, window=64, carry=0.2, oversize="skip").take_all()
    assert _ids(rows, "sample_id") == sorted(x["sample_id"] for x in items)
    assert [list(r["sample_id"]) for r in rows if r["oversize"]] == [["big"]]
    with pytest.raises(Exception, match="'big'"):
        ray_mmbatch.batch_by_token_budget(ds, max_tokens=256, window=64, carry=0.2).take_all()


def test_example_runs(ray_cluster):
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "token_budget_text.py"), "--rows", "300"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if " rows -> " in x)
    assert line.startswith("300 rows -> ") and "fill 0." in line, r.stdout
    assert "cu_seqlens [0, " in r.stdout


# ------------------------------------------------------------------ pure (the task without Ray)
def test_package_import_stays_light():
    code = "import sys, ray_mmbatch; ray_mmbatch.batch_by_token_budget; assert 'ray' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_bad_arguments_fail_at_the_call():
    with pytest.raises(ValueError, match="mode"):
        ray_mmbatch.batch_by_token_budget(None, mode="packed", max_tokens=10)
    with pytest.raises(ValueError, match="max_patches needs"):
        ray_mmbatch.batch_by_token_budget(None, max_tokens=10, max_patches=5)
    with pytest.raises(ValueError, match="unknown planner"):
        ray_mmbatch.batch_by_token_budget(None, max_tokens=10, algorithm="nope")
    with pytest.raises(ValueError, match="oversize"):
        ray_mmbatch.batch_by_token_budget(None, max_tokens=10, oversize="drop")


def test_window_errors_name_the_row():
    b = {"id": np.array(["x", "y"]), "tokens": np.array([5, 50])}
    with pytest.raises(OversizeRowError, match=r"row 'y' \(row 1 of its planning window of 2 rows\)"):
        plan_window(b, budget=Budget(10))
    with pytest.raises(ValueError, match="no tokens column 'n_tok'"):
        plan_window(b, budget=Budget(10), tokens="n_tok")
    text = {"id": np.array(["x"]), "tokens": np.array([2]), "input_ids": np.array([[1, 2, 3]])}
    with pytest.raises(ValueError, match="3 input_ids but a token cost of 2"):
        plan_window(text, budget=Budget(10))
    with pytest.raises(ValueError, match="clash"):
        plan_window({"tokens": np.array([1]), "fill": np.array([0.5])}, budget=Budget(10))


def test_frames_column_bounds_the_batches():
    """max_frames (video frames) binds like max_images: 10 clips of 16 frames and 10 tokens plan as
    one batch by tokens, as 5 under max_frames=32; sum_frames reported; a clip alone over it is named."""
    n = 10
    b = {"id": np.arange(n), "tokens": np.full(n, 10), "nf": np.full(n, 16)}
    budget = Budget(1000, max_frames=32)
    out = plan_window(b, budget=budget, frames="nf")
    assert sorted(i for ids in out["id"] for i in ids) == list(range(n))
    assert len(out["batch_id"]) == 5 and out["sum_frames"] == [32] * 5
    assert len(plan_window(b, budget=Budget(1000))["batch_id"]) == 1  # no frames column read: no frame budget
    out = plan_window(b, budget=budget, cost_fn=lambda x: {"tokens": x["tokens"], "frames": x["nf"]})
    assert len(out["batch_id"]) == 5 and "sum_frames" in out
    big = dict(b, nf=np.array([16] * (n - 1) + [40]))
    with pytest.raises(OversizeRowError, match=r"row 9 .*frames 40 > 32.*frames=40"):
        plan_window(big, budget=budget, frames="nf")
    out = plan_window(big, budget=budget, frames="nf", oversize="skip")
    assert [ids for ids, o in zip(out["id"], out["oversize"]) if o] == [[9]]
    with pytest.raises(ValueError, match="max_frames needs the frames= column"):
        ray_mmbatch.batch_by_token_budget(None, max_tokens=10, max_frames=5)


def test_plan_stage_reads_frames_and_defaults_them_to_zero():
    """The built-in plan stage (stages.plan_rows) costs n_frames; rows without the column have none."""
    from ray_mmbatch import schema as S
    from ray_mmbatch.config import BudgetConfig
    from ray_mmbatch.dataflow.stages import LIGHT_COLUMNS, plan_rows

    assert S.N_FRAMES in LIGHT_COLUMNS
    n = 8
    rows = {S.SAMPLE_ID: np.array([f"s{i}" for i in range(n)], dtype=object), S.SKIP_REASON: np.full(n, "", object),
            S.TOKENS: np.full(n, 10), S.PATCHES: np.zeros(n, np.int64), S.N_IMAGES: np.zeros(n, np.int64)}
    cfg = BudgetConfig(max_tokens=1000, max_frames=32)
    assert len(plan_rows(rows, cfg, seed=0, epoch=0)[S.BATCH_ID]) == 1  # no n_frames column: 0 frames each
    out = plan_rows(dict(rows, **{S.N_FRAMES: np.full(n, 16)}), cfg, seed=0, epoch=0)
    assert len(out[S.BATCH_ID]) == 4
    assert sorted(i for g in out[S.BATCH_SAMPLE_IDS] for i in g) == sorted(rows[S.SAMPLE_ID])
