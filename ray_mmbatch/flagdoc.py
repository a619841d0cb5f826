"""The flags reference page (docs ``reference/flags.md``), generated from ``config.py`` and the commands' parsers.

Every config field is listed under its section with the docstring written beneath it in config.py,
its default and the flag that sets it (or the ``--set section.field=`` that reaches it); every flag a
command adds beyond the config (``inspect --throughput``, ``tune --max-tokens-grid`` ...) is listed from
that command's own argparse parser. ``scripts/docs_hooks.py`` writes the page at every docs build, so
the page cannot drift from the code: ``--help``, the page and config.py share one source.
``python -m ray_mmbatch.flagdoc`` prints it.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re

from ray_mmbatch.config import Config

_SECTION_ORDER = ("data", "budget", "model", "train", "text", "image")
_SHARED = ("config", "set", "verbose")  # on the page's first table
_SECTION_TITLES = {"data": "Data", "budget": "Budget", "model": "Model", "train": "Run (training)",
                   "text": "Text", "image": "Image"}


def _md(text: str) -> str:
    """One table cell from a docstring: one line, RST ``code`` as Markdown `code`, pipes escaped."""
    text = " ".join(line.strip() for line in text.strip().splitlines())
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    return text.replace("|", "\\|")


def _default(value) -> str:
    if value == "" or value == ():
        return "`''`" if value == "" else "`()`"
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"`{text}`".replace("|", "\\|")


def config_rows() -> dict[str, list[tuple[str, str, str, str]]]:
    """{section: [(flag or '', 'section.field', default, doc)]} for every field of Config, in declaration order."""
    from ray_mmbatch.cli import _field_doc
    from ray_mmbatch.run.defaults import by_mode

    cfg = Config()
    out: dict[str, list[tuple[str, str, str, str]]] = {}
    for section in dataclasses.fields(Config):
        sec = getattr(cfg, section.name)
        rows = []
        for f in dataclasses.fields(sec):
            key = f"{section.name}.{f.name}"
            mode_default = by_mode(key)  # a setting left to the mode: --help's text (run/defaults.py)
            rows.append((f.metadata.get("flag", ""), key,
                         f"`{mode_default}`" if mode_default else _default(getattr(sec, f.name)),
                         _md(_field_doc(type(sec), f.name))))
        out[section.name] = rows
    return out


#: a default a command's help states itself ("(default: cuda if any)"): what holds wherever the page is read
_STATED_DEFAULT = re.compile(r"\(default: ([^()]*)\)")


def command_default(action: argparse.Action, help_text: str) -> str:
    """A command flag's default as ``--help`` states it: the help's own "(default: ...)" text where it has one
    (``verify-packing --device``'s parser default is this machine's, ``cuda if any`` is everyone's), else the
    parser's default; '' for none, "required" for a required flag."""
    if action.required:
        return "required"
    stated = _STATED_DEFAULT.search(help_text)
    if stated:
        return f"`{stated.group(1).strip()}`".replace("|", "\\|")
    if action.default in (None, argparse.SUPPRESS) or not action.option_strings:
        return ""
    return _default(action.default)


def command_rows(name: str) -> tuple[str, list[tuple[str, str, str]], tuple[str, ...]]:
    """(summary, [(flags, default, help)] of the flags command ``name`` adds beyond the config, config sections)."""
    from ray_mmbatch.cli import COMMANDS

    module_name, summary = COMMANDS[name]
    module = importlib.import_module(f"ray_mmbatch.commands.{module_name}")
    parser: argparse.ArgumentParser = module.build_parser(prog=f"ray-mmbatch {name}")
    rows, sections = [], set()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.dest in _SHARED:
            continue
        if "." in action.dest:  # a config field: on the sections' tables
            sections.add(action.dest.split(".")[0])
            continue
        flags = ", ".join(f"`{o}`" for o in action.option_strings) or f"`{action.dest.upper()}`"
        help_text = (action.help or "").replace("%%", "%")
        default = command_default(action, help_text)
        if action.choices:
            help_text += f" (one of: {', '.join(map(str, action.choices))})"
        rows.append((flags, default, _md(help_text)))
    return summary, rows, tuple(s for s in _SECTION_ORDER if s in sections)


def render() -> str:
    """The whole page, Markdown."""
    from ray_mmbatch.cli import COMMANDS

    cfg_rows = config_rows()
    lines = [
        "# Every flag",
        "",
        "Every setting of a run, generated from `ray_mmbatch/config.py` when the docs are built (the same text",
        "as `--help`). A setting is set, from lowest to highest precedence, by its default, a `--config FILE.yaml`",
        "shaped like the sections below (`budget: {max_tokens: 8192}`), a flag, or `--set section.field=value`,",
        "which reaches every field, also those without a flag of their own.",
        "",
        "```text",
        "ray-mmbatch train --config best.yaml --max-tokens 8192 --set model.mlp_ratio=2",
        "```",
        "",
        "| flag | what |",
        "|---|---|",
        "| `--config` FILE.yaml | YAML file of the sections below; flags override it |",
        "| `--set` SECTION.FIELD=VALUE | any field, e.g. `--set data.payload_memory_mb=4096` (repeatable) |",
        "| `--verbose` | show Ray's own console output too (train, inspect, tune) |",
        "",
        "Sections: " + ", ".join(f"[{_SECTION_TITLES[s]}](#{s})" for s in _SECTION_ORDER)
        + "; commands: " + ", ".join(f"[{c}](#cmd-{c})" for c in COMMANDS) + ".",
        "",
    ]
    for name in _SECTION_ORDER:
        sec_cls = type(getattr(Config(), name))
        doc = inspect.getdoc(sec_cls) or ""
        lines += [f"## {_SECTION_TITLES[name]} {{#{name}}}", "", _md(doc).replace("\\|", "|"), "",
                  "| flag | key | default | what |", "|---|---|---|---|"]
        for flag, key, default, what in cfg_rows[name]:
            lines.append(f"| {f'`{flag}`' if flag else ''} | `{key}` | {default} | {what} |")
        lines.append("")
    lines += ["## Commands", "",
              "The flags each command has besides the config sections it takes.", ""]
    for name in COMMANDS:
        summary, rows, sections = command_rows(name)
        lines += [f"### ray-mmbatch {name} {{#cmd-{name}}}", "", summary[0].upper() + summary[1:] + ".", ""]
        if sections:
            lines += ["Takes the flags of: " + ", ".join(f"[{_SECTION_TITLES[s].lower()}](#{s})" for s in sections)
                      + ".", ""]
        if rows:
            lines += ["| flag | default | what |", "|---|---|---|"]
            lines += [f"| {f} | {d} | {w} |" for f, d, w in rows]
            lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render())
