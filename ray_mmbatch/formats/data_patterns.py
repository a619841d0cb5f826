"""HF ``datasets``' data-file patterns, reimplemented: which files of a folder are which split.

``datasets.data_files.get_data_patterns`` and ``DataFilesDict`` as ``load_dataset(folder)`` runs them (datasets
2.16+ with fsspec >= 2023.12, the branch every current release takes), constant by constant, so that a run
needs no ``datasets`` import; tests/test_split_names.py checks every constant, the glob translation and the
resolution of 30+ Hub folder layouts against the installed library. The groups are tried in HF's order and
the first that matches any file decides the whole folder::

    1. data/{split}-[0-9]x5-of-[0-9]x5*.*     push_to_hub shards under data/: each {split} is a split of
                                              its own (train_sft, train_gen, dev ...): train, validation,
                                              test first, then the others sorted
    2. a keyword as a folder name             **/{kw}/**, **/{kw}[-._ 0-9]*/**, **/*[-._ 0-9]{kw}/**,
                                              **/*[-._ 0-9]{kw}[-._ 0-9]*/**  (train2017/, images_val/)
    3. a keyword in the file name             **/{kw}[-._ 0-9]*, **/*[-._ 0-9]{kw}[-._ 0-9]*
                                              (test_0.jsonl, my-dataset.dev.jsonl, cc3m-train-0000.tar)
    4. nothing named                          {"train": ["**"]}: every file

    keywords   train = train, training; validation = validation, valid, dev, val;
               test = test, testing, eval, evaluation      (case-sensitive, as fsspec's glob is)

Globs follow fsspec's ``glob_translate``: ``*`` stays within one name, ``**`` (a whole component) spans any
number of folders, so a keyword counts at any depth but only whole (``contest.parquet`` and
``trainer_logs/`` name no split). A rule-1 split name that is not ``\\w+(\\.\\w+)*`` is refused, as HF
refuses it. HF's ignored names (README.md, dataset_info.json ...) and hidden or ``__*`` folders are in no
split. HF's two other groups (``**/*.eval`` logs; ``task.toml`` / ``instruction.md``) match no file a
caller here passes (data files only) and are left out. One difference, on purpose: a file two patterns of
one split match is listed once (HF lists it twice). Cost: O(files x patterns) regex matches on names
(one compiled alternation per split), no I/O. Pure module: no ray.
"""
from __future__ import annotations

import re

SPLIT_KEYWORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
                  "test": ("test", "testing", "eval", "evaluation")}
NON_WORDS_CHARS = "-._ 0-9"
KEYWORDS_IN_FILENAME_BASE_PATTERNS = ("**/{keyword}[{sep}]*", "**/*[{sep}]{keyword}[{sep}]*")
KEYWORDS_IN_DIR_NAME_BASE_PATTERNS = ("**/{keyword}/**", "**/{keyword}[{sep}]*/**", "**/*[{sep}]{keyword}/**",
                                      "**/*[{sep}]{keyword}[{sep}]*/**")
SPLIT_PATTERN_SHARDED = "data/{split}-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9]*.*"
DEFAULT_SPLITS = ("train", "validation", "test")


def _by_split(bases: tuple[str, ...]) -> dict[str, list[str]]:
    return {split: [b.format(keyword=k, sep=NON_WORDS_CHARS) for k in SPLIT_KEYWORDS[split] for b in bases]
            for split in DEFAULT_SPLITS}


DEFAULT_PATTERNS_SPLIT_IN_FILENAME = _by_split(KEYWORDS_IN_FILENAME_BASE_PATTERNS)
DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME = _by_split(KEYWORDS_IN_DIR_NAME_BASE_PATTERNS)
DEFAULT_PATTERNS_ALL = {"train": ["**"]}
ALL_DEFAULT_PATTERNS = (DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME, DEFAULT_PATTERNS_SPLIT_IN_FILENAME, DEFAULT_PATTERNS_ALL)
FILES_TO_IGNORE = frozenset({"README.md", "config.json", "dataset_info.json", "dataset_infos.json",
                             "dummy_data.zip", "dataset_dict.json"})
SPLIT_NAME = re.compile(r"^\w+(\.\w+)*$")  # datasets.naming._split_re
# datasets.utils.py_utils.string_to_dict(basename, basename of SPLIT_PATTERN_SHARDED): the split of a shard
_SHARD_SPLIT = re.compile(re.sub(r"{(.+?)}", r"(?P<_\1>.+)", SPLIT_PATTERN_SHARDED.rsplit("/", 1)[1]))


def glob_regex(pattern: str) -> re.Pattern:
    """fsspec's ``glob_translate`` (recursive, hidden names included, "/" the only separator): ``**`` as a whole
    component spans any number of folders (``.*`` at the end), ``*`` and ``?`` stay within one name,
    ``[...]`` is a class (``[!...]`` negated). Matched against paths relative to the folder."""
    parts, out = pattern.split("/"), []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            out.append(".*" if last else "(?:.+/)?")
            continue
        if "**" in part:
            raise ValueError(f"Invalid pattern {pattern!r}: '**' can only be an entire path component")
        out.append(("[^/]+" if last else "[^/]+/") if part == "*" else _name_regex(part) + ("" if last else "/"))
    return re.compile(f"(?s:{''.join(out)})\\Z")


def _name_regex(part: str) -> str:
    out, i = [], 0
    while i < len(part):
        c, i = part[i], i + 1
        if c == "*":
            if not out or out[-1] != "[^/]*":  # consecutive stars are one
                out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            start = i + (part[i:i + 1] == "!")
            j = part.find("]", start + (part[start:start + 1] == "]"))  # "[]...]": the first "]" is a member
            if j < 0:
                out.append(re.escape(c))
                continue
            neg = part[i:i + 1] == "!"
            out.append("[" + ("^" if neg else "") + _class(part[start:j]) + "]")
            i = j + 1
        else:
            out.append(re.escape(c))
    return "".join(out)


def _class(body: str) -> str:
    out, i = [], 0
    while i < len(body):
        if i + 2 < len(body) and body[i + 1] == "-":  # a range a-z
            out.append(re.escape(body[i]) + "-" + re.escape(body[i + 2]))
            i += 3
        else:
            out.append(re.escape(body[i]))
            i += 1
    return "".join(out)


def matcher(patterns: list[str]) -> re.Pattern:
    return re.compile("|".join(f"(?:{glob_regex(p).pattern})" for p in patterns))


_GROUPS = [{split: matcher(ps) for split, ps in group.items()} for group in ALL_DEFAULT_PATTERNS]
_SHARDED = glob_regex(SPLIT_PATTERN_SHARDED.replace("{split}", "*"))


def candidate(rel: str) -> bool:
    """A file HF's resolve_pattern would return for a pattern that names no hidden or ``__`` folder."""
    parts = rel.split("/")
    return (parts[-1] not in FILES_TO_IGNORE and not any(p.startswith("__") for p in parts[:-1])
            and not any(p.startswith(".") and set(p) != {"."} for p in parts))


def data_patterns(rels: list[str]) -> dict[str, list[str]]:
    """``datasets.data_files.get_data_patterns`` on a folder holding ``rels``: {split: its glob patterns}, in
    HF's split order; {} for no file. ValueError for a shard split name HF refuses."""
    rels = [r for r in rels if candidate(r)]
    shards = [r for r in rels if _SHARDED.match(r)]
    if shards:
        found = [_SHARD_SPLIT.search(r.rsplit("/", 1)[-1]) for r in shards]
        names = {m.group("_split") if m else "" for m in found}
        bad = sorted(n for n in names if not SPLIT_NAME.match(n))
        if bad:
            raise ValueError(f"data/{bad[0]}-NNNNN-of-NNNNN: split names must match {SPLIT_NAME.pattern} (as HF "
                             "datasets requires); rename the shards or point --data at them with a glob")
        order = [s for s in DEFAULT_SPLITS if s in names] + sorted(names - set(DEFAULT_SPLITS))
        return {s: [SPLIT_PATTERN_SHARDED.format(split=s)] for s in order}
    for group, matchers in zip(ALL_DEFAULT_PATTERNS, _GROUPS):
        hit = [s for s, m in matchers.items() if any(m.match(r) for r in rels)]
        if hit:
            return {s: list(group[s]) for s in hit}
    return {}


def data_files(rels: list[str], patterns: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """``DataFilesDict`` of ``data_patterns`` (or the ``patterns`` given): {split: the files of ``rels`` its
    patterns match}, each file once, in the order of ``rels``."""
    patterns = data_patterns(rels) if patterns is None else patterns
    out = {}
    for split, ps in patterns.items():
        m = matcher(ps)
        out[split] = [r for r in rels if candidate(r) and m.match(r)]
    return out


