"""Guard rails that stop a wrong run early: too many skipped samples, with the likely fix.

A run whose samples are mostly unusable (a wrong ``--image-root``, a wrong column, a
budget smaller than every sample) should stop with a clear message instead of training
on the few that are left. ``skip_fraction_exceeded`` is the rule (checked by the train
loop once ``SKIP_CHECK_MIN_SAMPLES`` samples are seen, or at the end of a smaller
dataset, and by the driver's pre-flight on the first samples); ``explain_skips`` turns
the skip records into the message: top reasons with example ids and details, and where
it can tell, the fix (for ``missing_file``: the folder that does hold those files).
Pure module: no ray, no torch.
"""
from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from ray_mmbatch import schema as S
from ray_mmbatch.data.errors import SkipRecord

SKIP_CHECK_MIN_SAMPLES = 50
"""Samples seen before the skip fraction is judged (a smaller dataset is judged at its end)."""


"""OUTPUT_DIR file rank 0 writes when the guard stops a run: {"seen", "skipped", "step"}."""


class TooManySkipped(RuntimeError):
    """The share of skipped samples passed data.max_skip_fraction; str() is the whole explanation."""


def skip_fraction_exceeded(seen: int, skipped: int, max_fraction: float, at_end: bool = False) -> bool:
    """True when enough samples are seen (or the data ended) and skipped / seen > max_fraction."""
    if max_fraction >= 1.0 or seen <= 0 or (seen < SKIP_CHECK_MIN_SAMPLES and not at_end):
        return False
    return skipped / seen > max_fraction


def explain_skips(records: Iterable[SkipRecord], seen: int, max_fraction: float, data_cfg=None,
                  where: str = "", see_also: str = "skipped.csv lists every one") -> str:
    """The message naming the top reasons of these skip records and their fixes."""
    by_reason: dict[str, list[tuple[str, str]]] = {}
    for rec in records:
        by_reason.setdefault(rec.reason, []).append((rec.sample_id, rec.detail))
    counts = Counter({r: len(v) for r, v in by_reason.items()})
    total = sum(counts.values())
    lines = [f"{total} of {seen} samples ({100 * total / max(seen, 1):.0f}%){where} were skipped, more than "
             f"--max-skip-fraction {max_fraction:g}; stopping instead of training on the rest."]
    for reason, n in counts.most_common(3):
        ex = ", ".join(f"{sid} ({d})" if d else sid for sid, d in by_reason[reason][:3])
        lines.append(f"  {reason}: {n}  e.g. {ex}")
    hints = [h for reason, _ in counts.most_common(3) for h in [hint_for(reason, by_reason[reason], data_cfg)] if h]
    lines += [f"  fix: {h}" for h in hints]
    lines.append(f"  ({see_also}; --max-skip-fraction 1 trains anyway)")
    return "\n".join(lines)


def _missing_file_hint(examples: list[tuple[str, str]], data_cfg) -> str:
    refs = [d for _, d in examples if d and " is not a regular file" not in d and ": " not in d][:20]
    root = _image_root(data_cfg)
    found = find_image_folder(refs, root) if refs and root else None
    if found:
        return f"those images are in {found}: pass --image-root {found}"
    if root:
        return (f"image paths are looked up under {root} (--image-root); none of the missing ones was "
                "found in the folders around it")
    return "the image files the records name do not exist"


# reason -> the likely fix: a fixed sentence, or a function of (examples, data_cfg) -> sentence ("" = none)
HINTS: dict[str, str | Callable[[list[tuple[str, str]], Any], str]] = {
    S.SKIP_MISSING_FILE: _missing_file_hint,
    S.SKIP_PATH_OUTSIDE_ROOT: "image paths must be relative and inside --image-root (absolute paths and '..' are "
                              "refused)",
    S.SKIP_OVERSIZE: "samples fit no batch alone: raise --max-tokens / --max-patches, or --oversize truncate",
    S.SKIP_TOO_MANY_IMAGES: "samples hold more images than --max-images allows: raise it",
    S.SKIP_PLACEHOLDER_MISMATCH: "the records' <image> placeholders do not match their images (check the text "
                                 "column and the image token)",
    S.SKIP_EMPTY_TEXT: "no assistant text to train on: check --text-column (and --set text.train_on_prompt=true "
                       "for text without roles)",
    S.SKIP_FILE_TOO_LARGE: "image files / tar members over data.max_file_bytes: raise it (--set "
                           "data.max_file_bytes=N) if they are real",
    S.SKIP_UNREADABLE_FILE: lambda _, d: (f"files that do not read as {d.format} (--format): check the path and that "
                                          "the files are whole") if d is not None else "",
    S.SKIP_MALFORMED_RECORD: lambda _, d: (f"records do not have the expected shape: check --text-column "
                                           f"({d.text_column}), --image-column ({d.image_column}) and --format "
                                           f"({d.format})") if d is not None else "",
}


def hint_for(reason: str, examples: list[tuple[str, str]], data_cfg=None) -> str:
    """The likely fix for one skip reason (HINTS), from its details and the data settings."""
    hint = HINTS.get(reason, "")
    return hint(examples, data_cfg) if callable(hint) else hint


def _image_root(data_cfg) -> str:
    if data_cfg is None or not data_cfg.path:
        return ""
    if data_cfg.image_root:
        return data_cfg.image_root
    path = data_cfg.path
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def find_image_folder(refs: list[str], root: str, depth: int = 2) -> str | None:
    """The folder near ``root`` (below it, or below its parent) under which most ``refs`` exist."""
    root = os.path.abspath(root)
    candidates = []
    for base in dict.fromkeys([root, os.path.dirname(root)]):
        for cur, dirs, _ in os.walk(base):
            if cur[len(base):].count(os.sep) >= depth:
                dirs[:] = []
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            if os.path.abspath(cur) != root:
                candidates.append(cur)
    best, best_n = None, 0
    for c in candidates:
        n = sum(os.path.isfile(os.path.join(c, r)) for r in refs)
        if n > best_n:
            best, best_n = c, n
    return best if best_n >= max(1, len(refs) // 2) else None
