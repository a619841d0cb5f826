"""``ray-mmbatch train | inspect | prepare | tune | report | verify-packing``, and the flags they share.

Each subcommand is a module of ``ray_mmbatch/commands`` with ``main(argv, prog)``; the
``jobs/*.py`` scripts call the same ``main`` (for ``ray job submit --working-dir .``).
Each flag sets a config field and flags override --config; config.py names a field's flag
where the field is declared, and the help text of a flag is the docstring of the field it
sets, so ``--help`` and ``config.py`` never disagree. ``--config``, ``--set`` and ``--verbose``
set no one field and live here.
"""
from __future__ import annotations

import argparse
import ast
import functools
import importlib
import inspect
import sys
from typing import Any

from ray_mmbatch.config import Config, absolute_locations, cli_flags, load_config

# flag -> "section.field": the flags config.py declares on its fields (config.flag)
FLAGS: dict[str, str] = cli_flags()


def _field_doc(section_cls: type, name: str) -> str:
    """The docstring written under a dataclass field (config.py's convention), with the registry lists it names
    (``{backends}``, ``{video_families}``) filled in: ``--help`` and the flags page both read it here."""
    doc = _field_docs(section_cls).get(name, "")
    for placeholder, listing in REGISTRY_LISTS.items():
        if placeholder in doc:  # filled on demand: the video list imports every backend (the built-in one: torch)
            doc = doc.replace(placeholder, ", ".join(f"'{name}'" for name in listing()))
    return doc


def _backends() -> list[str]:
    from ray_mmbatch.models import REGISTRY

    return list(REGISTRY)


def _video_families() -> list[str]:
    from ray_mmbatch.models import video_model_types

    return video_model_types()


#: placeholders a config docstring may hold -> the registry's names that replace them (so the lists never drift)
REGISTRY_LISTS = {"{backends}": _backends, "{video_families}": _video_families}


@functools.cache
def _field_docs(section_cls: type) -> dict[str, str]:
    """{field: its docstring} of a config section, parsed once (every parser build reads them all)."""
    tree = ast.parse(inspect.getsource(section_cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                docs[node.target.id] = str(nxt.value.value)
    return docs


def add_config_flags(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    from ray_mmbatch.run.defaults import by_mode

    defaults = Config()
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML config (sections image/text/budget/model/"
                        "train/data); command-line flags override it")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override any config field, e.g. --set model.mlp_ratio=2")
    for flag, key in FLAGS.items():
        section, field = key.split(".")
        if only and section not in only and key not in only:  # a section, or one "section.field"
            continue
        sec = getattr(defaults, section)
        default = getattr(sec, field)
        doc = _field_doc(type(sec), field).replace("%", "%%")  # argparse formats help with %
        extra = {"nargs": "?", "const": "true"} if isinstance(default, bool) else {}
        if key == "data.path":  # --data repeated: several sources (formats/sources.py), PATH or PATH#WEIGHT
            extra = {"action": "append"}
            doc += "; repeat it for several datasets trained together, each PATH or PATH#WEIGHT"
        shown = by_mode(key) or repr(default)  # a setting left to the mode: its values per mode (run/defaults.py)
        parser.add_argument(flag, dest=key, default=None, metavar=type(default).__name__.upper() if
                            default is not None else "VALUE", help=f"{doc} (default: {shown})", **extra)


def add_console_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true",
                        help="show Ray's own console output too (worker start-up, Ray Data plans, Train reports); "
                             "Ray's log files under /tmp/ray/session_*/logs keep it either way")


def config_from_args(args: argparse.Namespace) -> Config:
    overrides: dict[str, Any] = {k: v for k, v in vars(args).items() if "." in k and v is not None}
    if isinstance(overrides.get("data.path"), list):
        from ray_mmbatch.formats.sources import parse_data_flag

        overrides.update(parse_data_flag(overrides.pop("data.path")))
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key.strip()] = value
    from ray_mmbatch.run.defaults import resolve_defaults  # the settings left to the mode: demo or fine-tune

    return resolve_defaults(absolute_locations(load_config(args.config, overrides)))



# subcommand -> (module under ray_mmbatch.commands, one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train", "train on token-budget batches with Ray Train (no --data: a demo run)"),
    "inspect": ("inspect_data", "read and measure a dataset: skip reasons, token / image percentiles"),
    "prepare": ("prepare_data", "generate a synthetic image-text dataset (optionally with bad samples)"),
    "tune": ("tune_budget", "search batch budgets with Ray Tune for the best tokens/s under a memory limit"),
    "report": ("report", "write report.html / report.json for a training run's output dir"),
    "verify-packing": ("verify_packing", "check that packed batches give each sample's own loss"),
    "plan": ("plan_memory", "estimate peak memory per GPU for the run's settings, item by item (--measure: measure)"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: ray-mmbatch COMMAND [flags]   (ray-mmbatch COMMAND --help for its flags)", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The ``ray-mmbatch`` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"ray-mmbatch: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"ray_mmbatch.commands.{COMMANDS[name][0]}")
    rc = module.main(rest, prog=f"ray-mmbatch {name}")
    return rc if isinstance(rc, int) else 0  # prepare returns its summary
