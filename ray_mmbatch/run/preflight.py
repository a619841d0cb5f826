"""Pre-flight check on the driver, before any cluster work: each failure is one clear line.

In order, each step only when the one before passed:

1. the data path resolves and its format is what it looks like (``readers.resolve_files``),
2. the first read unit reads (a Parquet file opens, the LLaVA JSON parses, a tar lists),
3. the first ``PREFLIGHT_SAMPLES`` samples measure: their images exist and their headers
   read; when more than ``data.max_skip_fraction`` of them are skipped the run stops here
   with the top reasons and the likely fix (``guards.explain_skips``),
4. the tokenizer and the model settings load (``models.configure`` reads a checkpoint's
   config.json / processor files; ``models.token_ids`` loads the tokenizer).

Runs in-process without Ray (the readers' read units and the pure measure step the
pipeline runs); it reads the first read unit(s) and image headers only, a second or two.
"""
from __future__ import annotations

import copy

from ray_mmbatch import schema as S
from ray_mmbatch.config import Config
from ray_mmbatch.data.errors import SkipRecord
from ray_mmbatch.run.guards import explain_skips, skip_fraction_exceeded

PREFLIGHT_SAMPLES = 64


class PreflightError(RuntimeError):
    """One failed check; str() is the line to print."""


class TooManySkippedAtStart(PreflightError):
    """The first samples are mostly skipped; str() names the reasons and the fix (guards.explain_skips)."""


def preflight(cfg: Config, samples: int = PREFLIGHT_SAMPLES) -> dict:
    """Check the run's data, tokenizer and model before any cluster work; raise PreflightError.

    Returns what it saw: {"format", "files", "samples_checked", "skipped", "tokens_per_sample" (the mean over
    the samples kept, for the run plan's estimate; None when none was)}.
    """
    from ray_mmbatch.formats.splits import expand
    from ray_mmbatch.formats.units import resolve_files

    try:
        cfg.data = expand(cfg.data)  # a folder of configs becomes one source per config, for the whole run
    except (OSError, ValueError) as e:
        raise PreflightError(f"data: {e}") from None
    d = cfg.data
    if d.sources:  # several datasets (formats/sources.py): each checked as a run of its own
        from ray_mmbatch.formats.sources import data_sources

        try:
            sources = data_sources(d)
        except ValueError as e:
            raise PreflightError(str(e)) from None
        seen = []
        for src in sources:
            one = copy.deepcopy(cfg)
            one.data = src.data
            try:
                seen.append(preflight(one, samples))
            except PreflightError as e:
                raise PreflightError(f"source {src.name!r}: {e}") from None
        return {"format": "+".join(sorted({r["format"] for r in seen})), "files": sum(r["files"] for r in seen),
                "samples_checked": sum(r["samples_checked"] for r in seen),
                "skipped": sum(r["skipped"] for r in seen), "sources": [s.name for s in sources],
                "tokens_per_sample": _mean_tokens(seen),
                "read_as": [f"{s.name}: {line}" for s, r in zip(sources, seen) for line in r["read_as"]]}
    d = cfg.data
    if not d.path:
        raise PreflightError("data: no --data given")
    try:
        fmt, files = resolve_files(d.path, d.format, d.split)
    except (OSError, ValueError) as e:
        raise PreflightError(f"data: {e}") from None
    if fmt == "llava" and d.image_root:
        from ray_mmbatch.formats import fs

        try:
            is_dir = fs.kind(d.image_root) == "dir"  # a local folder or a bucket prefix
        except OSError as e:
            raise PreflightError(f"data: --image-root: {e}") from None
        if not is_dir:
            raise PreflightError(f"data: --image-root {d.image_root!r} is not a folder")

    cfg = configure_run(cfg)

    rows, read_as = _first_rows(cfg, samples, fmt)
    reasons = [SkipRecord.of(r[S.SAMPLE_ID], r[S.SKIP_REASON]) for r in rows if r[S.SKIP_REASON]]
    seen = len(rows)
    at_end = seen < samples  # the whole (small) dataset was read
    if skip_fraction_exceeded(seen, len(reasons), d.max_skip_fraction, at_end=at_end):
        raise TooManySkippedAtStart(explain_skips(
            reasons, seen, d.max_skip_fraction, d, where=" checked before the run",
            see_also="ray-mmbatch inspect reads and counts them all"))
    kept = [r[S.TOKENS] for r in rows if not r[S.SKIP_REASON]]  # the run plan's steps estimate (run/plan.py)
    return {"format": fmt, "files": len(files), "samples_checked": seen, "skipped": len(reasons), "read_as": read_as,
            "tokens_per_sample": sum(kept) / len(kept) if kept else None}


def configure_run(cfg: Config) -> Config:
    """A copy of ``cfg`` configured as ``train`` configures it (``models.configure``: the checkpoint's tokenizer,
    chat template, image and video processor settings), its tokenizer loaded once to check it; PreflightError
    with one line when the checkpoint or tokenizer does not load or a flag contradicts it. Every command that
    measures (inspect, tune, plan, verify-packing) builds its config here, so it measures with the model."""
    from ray_mmbatch.models import configure, token_ids

    try:
        cfg = configure(copy.deepcopy(cfg))
        token_ids(cfg)
    except ValueError as e:  # a flag the checkpoint contradicts, a model_type without a backend: its own line
        raise PreflightError(f"model: {_one_line(e, with_type=False)}") from None
    except Exception as e:  # a checkpoint dir that is not one, a tokenizer that does not load
        what = f"model {cfg.model.path!r}" if cfg.model.path else f"tokenizer {cfg.text.tokenizer or '(built-in)'!r}"
        raise PreflightError(f"model: {what} does not load: {_one_line(e)}") from None
    return cfg


def _first_rows(cfg: Config, n: int, fmt: str) -> tuple[list[dict], list[str]]:
    """(the first ``n`` samples read and measured in-process: the pure measure step over the
    readers' own read units, header reads only, no decode; how the data is read: formats.read_as)."""
    import pyarrow as pa

    from ray_mmbatch.data.measure import VideoRefused, fit_batch_to_budget, measure_batch
    from ray_mmbatch.data.text.encoder import tokenizer_for
    from ray_mmbatch.formats import read_as
    from ray_mmbatch.formats.units import read_units

    try:
        units, read_fn, kwargs = read_units(cfg.data.path, cfg.data)
        lines = read_as(fmt, units, cfg.data)
        rows: list[dict] = []
        for unit in units:
            rows += read_fn(pa.Table.from_pylist([dict(unit, end=False)]), **kwargs).to_pylist()
            if len(rows) >= n:
                break
    except Exception as e:
        raise PreflightError(f"data: {cfg.data.path} does not read as {fmt}: {_one_line(e)}") from None
    rows = rows[:n]
    if not rows:
        return [], lines
    batch = {k: [r[k] for r in rows] for k in rows[0]}
    try:
        measured = measure_batch(batch, cfg.image, tokenizer_for(cfg.text), cfg.text)
    except VideoRefused as e:  # a video for a family that takes none: name the family
        from ray_mmbatch.models import backend_name

        family = checkpoint_family(cfg)
        raise PreflightError(f"model: {family} ({backend_name(cfg.model)} backend) takes no video: "
                             f"{_one_line(e)}") from None
    measured = fit_batch_to_budget(measured, cfg.budget)
    return [{S.SAMPLE_ID: measured[S.SAMPLE_ID][i], S.SKIP_REASON: measured[S.SKIP_REASON][i],
             S.TOKENS: int(measured[S.TOKENS][i])} for i in range(len(measured[S.SAMPLE_ID]))], lines


def _mean_tokens(seen: list[dict]) -> float | None:
    """The sources' mean tokens per kept sample, each weighted by the samples it kept."""
    weighted = [(r["tokens_per_sample"], r["samples_checked"] - r["skipped"]) for r in seen if r["tokens_per_sample"]]
    kept = sum(n for _, n in weighted)
    return sum(m * n for m, n in weighted) / kept if kept else None


def checkpoint_family(cfg: Config) -> str:
    """The model family a run trains, as a person names it: the checkpoint's model_type, or 'the built-in model'."""
    if not cfg.model.path:
        return "the built-in model"
    from ray_mmbatch.models import checkpoint_model_type

    try:
        return checkpoint_model_type(cfg.model.path)
    except (OSError, ValueError):
        return cfg.model.path


def _one_line(e: BaseException, with_type: bool = True) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(e).__name__}: {first}" if with_type else first
