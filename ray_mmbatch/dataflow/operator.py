"""``batch_by_token_budget``: the token-budget planner as one operator on ANY ``ray.data.Dataset``.

    ds (one row per sample, with cost columns or a cost_fn)
      -> map_batches(batch_size=window): each window planned on its own (batching/plan.py)
      -> one row per planned batch: the members' values (a list per input column) plus
         batch_id, n_rows, real_tokens, padded_tokens, fill, oversize; rows that hold
         ``input_ids`` get the collated text arrays instead (batching/collate.py layout)

The project's own pipeline (pipeline.py) reads its formats, measures images and carries
under-filled batches across windows with an end-of-stream row; this operator needs none of
that: a user's Dataset (their reader, their tokenizer, text-only LLM data, audio) goes in, a
lazy Dataset of batches comes out (Ray Data's convention: nothing runs until it is consumed).

Guarantees (tests/test_operator.py): every input row in exactly one output row; every batch
within every budget (``max_tokens``, ``max_patches``, ``max_images``, ``max_frames``, ``max_samples``); the
same batches for the same seed and the same input blocks (the plan seed of a window is a
hash of (seed, the window's costs and ids), never of scheduling); a row that cannot fit a
batch even alone raises ``OversizeRowError`` naming the row and the budget it breaks, or,
with ``oversize="skip"``, comes back ALONE in a batch row flagged ``oversize=True`` (that
row breaks the budget: drop it with ``ds.filter(lambda b: not b["oversize"])``).

Carry across windows (``carry`` > 0, the fraction of a window that may be held back):
planning each window alone leaves its last batches under-filled; with carry, the worst of them
wait and are planned again with the next window (batching/carry.py, the built-in path's
planner), and what is still held when the input ends is planned last. The built-in path sees
the end through a marker row its readers append; a user's Dataset has none and Ray Data no
end-of-stream hook, so the carry plan runs as ONE task that iterates the input Dataset itself
(``ds.iter_batches(batch_size=window)``: exact windows, input order kept) and yields the batch
rows window by window, then the flush. Planning is serial there, as in the built-in plan actor;
the input's own stages still run in parallel upstream of it. Without carry (the default for
this operator) every ``map_batches`` window is planned on its own, in parallel.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np

from ray_mmbatch.batching import Budget, OversizeError, SampleCost, plan_batches_arrays
from ray_mmbatch.batching.carry import CarryPlanner, resolve_carry
from ray_mmbatch.batching.plan import as_costs, oversize_mask, resolve_algorithm
from ray_mmbatch.schema import IGNORE_INDEX

BATCH_ID, N_ROWS, REAL_TOKENS, PADDED_TOKENS, FILL, OVERSIZE = (
    "batch_id", "n_rows", "real_tokens", "padded_tokens", "fill", "oversize")
SUM_PATCHES, SUM_IMAGES, SUM_FRAMES = "sum_patches", "sum_images", "sum_frames"
# text rows: these input columns are replaced by the collated arrays (the layout is collate.py's)
TEXT_INPUT_COLUMNS = ("input_ids", "labels", "attention_mask", "position_ids")
TEXT_OUTPUT = {"pack": ("input_ids", "labels", "position_ids", "cu_seqlens", "seq_lens", "max_seqlen",
                        "target_tokens"),
               "pad": ("input_ids", "labels", "attention_mask", "position_ids", "seq_lens", "max_seqlen",
                       "target_tokens")}
ID_COLUMNS = ("sample_id", "id")  # the columns that name a row in an error, when present
OVERSIZE_POLICIES = ("raise", "skip")


class OversizeRowError(OversizeError):
    """A row no batch can hold, even alone (its cost breaks a budget by itself)."""

    def __init__(self, row: str, cost: SampleCost, why: str):
        ValueError.__init__(self, f"batch_by_token_budget: {row} cannot fit any batch alone: {why} "
                                  f"(its cost: tokens={cost.tokens}, patches={cost.patches}, images={cost.images}, "
                                  f"frames={cost.frames}). "
                                  "Truncate or drop it before batching, raise the budget, or pass "
                                  "oversize='skip' to get it back alone in a batch row flagged oversize=True")
        self.index, self.cost, self.why, self.row = -1, cost, why, row


def batch_by_token_budget(ds, *, tokens: str = "tokens", patches: str | None = None, images: str | None = None,
                          mode: str = "pack", max_tokens: int, max_patches: int | None = None,
                          max_images: int | None = None, max_samples: int | None = None, window: int = 2048,
                          seed: int = 0, cost_fn: Callable[[dict[str, np.ndarray]], dict] | None = None,
                          algorithm: str = "", attn_weight: float = 0.0, oversize: str = "raise",
                          pad_id: int = 0, collate: bool | None = None, id_column: str | None = None,
                          carry: float = 0.0, frames: str | None = None, max_frames: int | None = None):
    """Group the rows of ``ds`` into batches under a token budget; one output row per batch (lazy).

    Costs of a row: the columns named by ``tokens`` / ``patches`` / ``images`` / ``frames`` (whole
    numbers; ``patches`` / ``images`` / ``frames`` None = 0), or ``cost_fn(batch) -> {"tokens": array[,
    "patches", "images", "frames"]}`` over a numpy batch of rows (then the column names are not read). With no
    ``tokens`` column, no cost_fn and an ``input_ids`` column, a row costs ``len(input_ids)``.

    Budgets (batching/budget.py): ``mode="pack"``: sum(tokens) <= max_tokens (one packed
    sequence); ``"pad"``: rows * longest <= max_tokens; both: sum(patches) <= max_patches,
    sum(images) <= max_images, sum(frames) <= max_frames (video frames), rows <= max_samples.
    ``algorithm`` names a planner of
    ``ray_mmbatch.batching.ALGORITHMS`` ("" = the mode's default); ``attn_weight`` adds the
    attention term of Budget.

    Each window of ``window`` rows (a ``map_batches`` batch) is planned on its own with a seed
    drawn from ``seed`` and the window's costs and ids: the same input blocks give the same
    batches (a materialized Dataset; over a lazy one, blocks reach the windows in the order
    upstream tasks finish unless ``DataContext.execution_options.preserve_order`` is set).
    Batch order within a window is a seeded permutation (length does not follow the step);
    members keep their input order inside a batch.

    Output row: a column per input column holding the list of the members' values, plus
    ``batch_id`` (str, "<window hash>/<k>"), ``n_rows``, ``real_tokens`` (sum of the token
    costs), ``padded_tokens`` (max_tokens in pack, rows x longest in pad), ``fill``
    (real / padded), ``oversize`` (bool, see below) and ``sum_patches`` / ``sum_images`` /
    ``sum_frames`` when those costs are given.

    Text rows (an ``input_ids`` column of int lists; ``collate=None`` = whenever it is there,
    False keeps plain member lists): ``input_ids`` / ``labels`` / ``attention_mask`` /
    ``position_ids`` are replaced by the collated batch, the layout of batching/collate.py:

    - pack: ``input_ids`` [1, T] (the members concatenated), ``position_ids`` [1, T]
      restarting at 0 per sample, ``cu_seqlens`` [n + 1] = [0, l1, l1 + l2, ...],
      ``labels`` [1, T];
    - pad: ``input_ids`` [n, L] padded with ``pad_id``, ``attention_mask`` bool [n, L],
      ``labels`` [n, L] (IGNORE_INDEX on padding), ``position_ids`` [n, L];
    - both: ``seq_lens`` [n], ``max_seqlen``, ``target_tokens`` (labels that count).

    ``labels`` follow the project's convention (collate.py): ALREADY SHIFTED, labels[t] is
    the target of the logits at t, so a loss is ``cross_entropy(logits, labels,
    ignore_index=-100)`` with no further shift, and each sample's last label is -100 (no
    token learns to predict the next sample of a pack). A row's own ``labels`` column is read
    in the Hugging Face convention (aligned with input_ids, -100 = no loss, unshifted) and
    shifted per sample; without one the labels are the input_ids. A text row's token cost
    must be >= len(input_ids) (else the collated batch could break the budget: an error).

    ``carry`` (0 = off): the fraction of a window whose rows may wait for the next window
    (batching/carry.py; 0.05-0.25 is typical, ``DEFAULT_CARRY`` there is what the built-in
    path uses): windows are then exact ``window``-row slices of the input in input order,
    planned by one task (module docstring), and ids of held rows move to a later batch.

    ``oversize="raise"`` (default): a row that breaks a budget alone raises OversizeRowError
    (a ValueError; it surfaces when the Dataset runs, wrapped by Ray) naming the row (its
    ``id_column`` value, default the ``sample_id`` or ``id`` column when present, else its
    index in its window) and the budget. ``"skip"``: that row comes back alone in a batch row
    with ``oversize=True`` (its padded_tokens = its own cost, so fill stays <= 1); every
    other batch row has ``oversize=False``.
    """
    budget = Budget(max_tokens=int(max_tokens), mode=mode, max_patches=max_patches, max_images=max_images,
                    max_samples=max_samples, attn_weight=float(attn_weight), max_frames=max_frames)
    resolve_algorithm(mode, algorithm)  # an unknown planner fails here, not in a task
    if int(window) != window or window < 1:
        raise ValueError(f"window must be a positive integer, got {window!r}")
    if oversize not in OVERSIZE_POLICIES:
        raise ValueError(f"oversize must be one of {OVERSIZE_POLICIES}, got {oversize!r}")
    if cost_fn is not None and not callable(cost_fn):
        raise TypeError(f"cost_fn must be callable, got {type(cost_fn).__name__}")
    if cost_fn is None:
        if max_patches is not None and patches is None:
            raise ValueError("max_patches needs the patches= column (or a cost_fn that returns 'patches')")
        if max_images is not None and images is None:
            raise ValueError("max_images needs the images= column (or a cost_fn that returns 'images')")
        if max_frames is not None and frames is None:
            raise ValueError("max_frames needs the frames= column (or a cost_fn that returns 'frames')")
    kwargs = {"budget": budget, "tokens": tokens, "patches": patches, "images": images, "frames": frames,
              "seed": int(seed),
              "cost_fn": cost_fn, "algorithm": algorithm, "oversize": oversize, "pad_id": int(pad_id),
              "collate": collate, "id_column": id_column}
    if carry:
        resolve_carry(mode, carry)  # a bad fraction fails here
        import ray.data

        source = ds
        return ray.data.range(1, override_num_blocks=1).map_batches(
            carry_plan, batch_size=None, batch_format="numpy", num_cpus=CARRY_CPUS,
            fn_kwargs={"source": source, "window": int(window), "carry": float(carry), "kwargs": kwargs})
    return ds.map_batches(plan_window, batch_size=int(window), batch_format="numpy", zero_copy_batch=True,
                          fn_kwargs=kwargs)


CARRY_CPUS = 0.25
"""The carry plan task's CPU share: it mostly waits on the input stream it iterates, whose own tasks
need the CPUs (a whole CPU here could leave a one-CPU node with none for them)."""


def carry_plan(_, *, source, window: int, carry: float, kwargs: dict):
    """The carry plan (one task, a generator): exact windows of ``source`` in input order, each
    planned with the rows held from before it, the held rows flushed when ``source`` ends."""
    from ray.data import DataContext

    DataContext.get_current().execution_options.preserve_order = True  # the same input, the same windows
    planner: CarryPlanner = CarryPlanner(kwargs["budget"], kwargs["algorithm"], carry)
    held: dict[str, np.ndarray] | None = None
    n_held = 0
    for win in source.iter_batches(batch_size=window, batch_format="numpy"):
        batch = win if not n_held else {c: _concat(held[c], win[c]) for c in win}
        out = plan_window(batch, planner=planner, held=n_held, **kwargs)
        keep = np.asarray(planner.held, np.int64)
        held, n_held = {c: v[keep] for c, v in batch.items()}, len(keep)
        planner.relabel(range(n_held))
        if out.get(BATCH_ID):
            yield out
    if n_held:
        yield plan_window(held, planner=planner, held=n_held, flush=True, **kwargs)


def _concat(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype == object or b.dtype == object:
        out = np.empty(len(a) + len(b), dtype=object)
        for k, x in enumerate(a):  # element by element: equal-length arrays must not broadcast
            out[k] = x
        for k, x in enumerate(b):
            out[len(a) + k] = x
        return out
    return np.concatenate([a, b])


def token_budget_stats(batches) -> dict[str, Any]:
    """Totals of an output of batch_by_token_budget (a Dataset, or an iterable of its rows):
    batches, rows, real and padded tokens, fill = real / padded, oversize batches. Runs the Dataset."""
    cols = [N_ROWS, REAL_TOKENS, PADDED_TOKENS, OVERSIZE]
    if hasattr(batches, "select_columns"):
        parts = list(batches.select_columns(cols).iter_batches(batch_size=None, batch_format="numpy"))
    else:
        rows = list(batches)
        parts = [{c: np.array([r[c] for r in rows]) for c in cols}] if rows else []
    out = {"batches": 0, "rows": 0, "real_tokens": 0, "padded_tokens": 0, "oversize_batches": 0}
    for p in parts:
        out["batches"] += len(p[N_ROWS])
        out["rows"] += int(np.sum(p[N_ROWS]))
        out["real_tokens"] += int(np.sum(p[REAL_TOKENS]))
        out["padded_tokens"] += int(np.sum(p[PADDED_TOKENS]))
        out["oversize_batches"] += int(np.sum(p[OVERSIZE]))
    out["fill"] = out["real_tokens"] / out["padded_tokens"] if out["padded_tokens"] else 0.0
    return out


# ------------------------------------------------------------------ the task (pure: numpy, no ray)
def plan_window(batch: dict[str, np.ndarray], *, budget: Budget, tokens: str = "tokens", patches: str | None = None,
                images: str | None = None, seed: int = 0, cost_fn=None, algorithm: str = "", oversize: str = "raise",
                pad_id: int = 0, collate: bool | None = None, id_column: str | None = None,
                planner: CarryPlanner | None = None, held: int = 0, flush: bool = False,
                frames: str | None = None) -> dict[str, list]:
    """One window of rows -> its batch rows (what each map_batches task runs; callable without Ray).

    Carry (``carry_plan``): ``planner`` holds items named 0..held-1, the window's first ``held``
    rows (checked when they were new); the rest are new. ``flush``: the input has ended, plan
    everything held too."""
    from ray_mmbatch.dataflow.stages import window_seed

    columns = list(batch)
    n = len(batch[columns[0]]) if columns else 0
    text = ("input_ids" in batch) if collate is None else bool(collate)
    if text and "input_ids" not in batch:
        raise ValueError(f"collate=True needs an input_ids column; the rows have {columns}")
    carried = [c for c in columns if not (text and c in TEXT_INPUT_COLUMNS)]
    t, p, m, f, has_p, has_m, has_f = _window_costs(batch, n, tokens, patches, images, frames, cost_fn)
    out_cols = _output_columns(carried, text, budget.mode, has_p, has_m, has_f)
    out: dict[str, list] = {c: [] for c in out_cols}
    if n == 0:
        return out
    ids = _row_names(batch, id_column)
    key = _window_key(t, p, m, f if has_f else None, ids)
    bad = oversize_mask(t, p, m, budget, f) & (np.arange(n) >= held)
    if bad.any() and oversize == "raise":
        k = int(np.argmax(bad))
        c = SampleCost(int(t[k]), int(p[k]), int(m[k]), int(f[k]))
        raise OversizeRowError(_describe(k, n, ids), c, "; ".join(budget.violations([c.tokens], [c.patches],
                                                                                        [c.images], [c.frames])))
    good = np.flatnonzero(~bad)
    groups: list[list[int]] = []
    plan_seed = window_seed(seed, 0, key)
    if planner is not None:
        new = good[good >= held]
        groups = planner.feed(new.tolist(), t[new], p[new], m[new], seed=plan_seed, frames=f[new]) if len(new) else []
        if flush:
            groups += planner.flush(seed=plan_seed)
    elif len(good):
        plan = plan_batches_arrays(t[good], p[good], m[good], budget, seed=plan_seed, algorithm=algorithm,
                                   frames=f[good])
        groups = [good[g].tolist() for g in plan]
    groups += [[int(k)] for k in np.flatnonzero(bad)]
    return _batch_rows(batch, groups, int(bad.sum()), key, (t, p, m, f), ids, budget, carried, out, text,
                       (has_p, has_m, has_f), pad_id)


def _batch_rows(batch, groups, n_flagged, key, costs, ids, budget, carried, out, text, has, pad_id):
    """The output rows of ``groups`` (row indices into ``batch``; the last ``n_flagged`` are oversize rows)."""
    n_fit = len(groups) - n_flagged
    t, p, m, f = costs
    has_p, has_m, has_f = has
    text_cols = _text_columns(batch, t, ids) if text and groups else None
    for j, g in enumerate(groups):
        idx = np.asarray(g, dtype=np.int64)
        for c in carried:
            out[c].append(_members(batch[c], idx))
        tg = t[idx]
        real = int(tg.sum())
        flagged = j >= n_fit
        padded = real if flagged and budget.mode == "pack" else \
            (budget.max_tokens if budget.mode == "pack" else len(g) * int(tg.max()))
        out[BATCH_ID].append(f"{key}/{j}")
        out[N_ROWS].append(len(g))
        out[REAL_TOKENS].append(real)
        out[PADDED_TOKENS].append(padded)
        out[FILL].append(real / padded if padded else 0.0)
        out[OVERSIZE].append(flagged)
        if has_p:
            out[SUM_PATCHES].append(int(p[idx].sum()))
        if has_m:
            out[SUM_IMAGES].append(int(m[idx].sum()))
        if has_f:
            out[SUM_FRAMES].append(int(f[idx].sum()))
        if text_cols is not None:
            for name, val in _collate_text(text_cols, g, budget.mode, pad_id).items():
                out[name].append(val)
    return out


def _output_columns(carried: list[str], text: bool, mode: str, has_p: bool, has_m: bool,
                    has_f: bool = False) -> list[str]:
    own = [BATCH_ID, N_ROWS, REAL_TOKENS, PADDED_TOKENS, FILL, OVERSIZE]
    own += [SUM_PATCHES] if has_p else []
    own += [SUM_IMAGES] if has_m else []
    own += [SUM_FRAMES] if has_f else []
    own += list(TEXT_OUTPUT[mode]) if text else []
    clash = sorted(set(carried) & set(own))
    if clash:
        raise ValueError(f"batch_by_token_budget: input columns {clash} would clash with the batch columns it adds; "
                         "rename them first (ds.rename_columns)")
    return carried + own


def _window_costs(batch, n, tokens, patches, images, frames, cost_fn):
    """(tokens, patches, images, frames) int64 arrays of a window, and whether patches / images / frames
    were given."""
    roles = ("tokens", "patches", "images", "frames")
    if cost_fn is not None:
        costs = cost_fn(batch)
        if not isinstance(costs, dict) or "tokens" not in costs:
            raise ValueError("cost_fn must return a dict with a 'tokens' array (and optionally 'patches', 'images', "
                             "'frames')")
        src = {k: costs.get(k) for k in roles}
        what = "cost_fn's"
    else:
        src = {"tokens": _column(batch, tokens, "tokens")}
        src.update({role: _column(batch, name, role) if name is not None else None
                    for role, name in (("patches", patches), ("images", images), ("frames", frames))})
        what = "column"
    if np.shape(src["tokens"]) != (n,):
        raise ValueError(f"{what} tokens must hold one number per row ({n} rows), got shape {np.shape(src['tokens'])}")
    t, p, m, f = as_costs(src["tokens"], src["patches"], src["images"], [f"{what} {k}" for k in roles],
                          frames=src["frames"])
    return t, p, m, f, src["patches"] is not None, src["images"] is not None, src["frames"] is not None


def _column(batch, name: str, role: str) -> np.ndarray:
    if name in batch:
        return batch[name]
    if role == "tokens" and "input_ids" in batch:  # text rows: a row costs its length
        return np.fromiter((len(x) for x in batch["input_ids"]), dtype=np.int64, count=len(batch["input_ids"]))
    raise ValueError(f"batch_by_token_budget: no {role} column {name!r} in the rows (columns: {sorted(batch)}); "
                     f"name it with {role}=..., or pass cost_fn")


def _row_names(batch, id_column: str | None) -> np.ndarray | None:
    if id_column is not None:
        if id_column not in batch:
            raise ValueError(f"id_column {id_column!r} is not a column of the rows (columns: {sorted(batch)})")
        return batch[id_column]
    for c in ID_COLUMNS:
        if c in batch:
            return batch[c]
    return None


def _describe(k: int, n: int, ids) -> str:
    where = f"row {k} of its planning window of {n} rows"
    if ids is None:
        return where
    name = ids[k]
    return f"row {name.item() if isinstance(name, np.generic) else name!r} ({where})"


def _window_key(t, p, m, f, ids) -> str:
    """A name for the window from its content: the seed of its plan and the prefix of its batch ids.
    ``f`` (frames) None: not given, and the key is the one a window had before the frames budget."""
    h = hashlib.blake2b(digest_size=8)
    for a in (t, p, m) if f is None else (t, p, m, f):
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    if ids is not None:
        h.update("\x1f".join(str(x) for x in ids).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _members(col: np.ndarray, idx: np.ndarray) -> list:
    sub = col[idx]
    return sub.tolist() if sub.dtype != object and sub.ndim == 1 else list(sub)


def _text_columns(batch, t: np.ndarray, ids) -> dict[str, list]:
    """Per row: input_ids and labels SHIFTED (collate.py's convention); checked against the costs."""
    n = len(t)
    input_ids, labels = [], []
    for k in range(n):
        x = np.asarray(batch["input_ids"][k])
        if x.ndim != 1 or len(x) == 0 or not np.issubdtype(x.dtype, np.integer):
            raise ValueError(f"batch_by_token_budget: {_describe(k, n, ids)} input_ids must be a non-empty list of "
                             f"ints, got shape {x.shape} dtype {x.dtype}")
        if len(x) > t[k]:
            raise ValueError(f"batch_by_token_budget: {_describe(k, n, ids)} has {len(x)} input_ids but a token cost "
                             f"of {int(t[k])}: the cost must cover the ids, else a batch could break max_tokens")
        lab = np.asarray(batch["labels"][k]) if "labels" in batch else x
        if lab.shape != x.shape:
            raise ValueError(f"batch_by_token_budget: {_describe(k, n, ids)} labels {lab.shape} and input_ids "
                             f"{x.shape} differ in shape")
        shifted = np.full(len(x), IGNORE_INDEX, np.int32)
        shifted[:-1] = lab[1:]
        input_ids.append(x.astype(np.int32))
        labels.append(shifted)
    return {"input_ids": input_ids, "labels": labels}


def _collate_text(cols: dict[str, list], members: list[int], mode: str, pad_id: int) -> dict[str, Any]:
    from ray_mmbatch.batching.collate import collate_pack, collate_pad

    empty_patches, empty_grids = np.zeros((0, 1), np.uint8), np.zeros((0, 3), np.int32)
    samples = [{"sample_id": str(k), "input_ids": cols["input_ids"][k], "labels": cols["labels"][k],
                "patches": empty_patches, "grids": empty_grids} for k in members]
    batch = (collate_pack if mode == "pack" else collate_pad)(samples, pad_id)
    return {name: batch[name] for name in TEXT_OUTPUT[mode]}
