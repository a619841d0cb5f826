"""MkDocs hooks (mkdocs.yml ``hooks:``): pages generated at every build, so they cannot drift.

- ``reference/flags.md``: every flag and config field, from config.py's docstrings and the commands'
  parsers (``ray_mmbatch/flagdoc.py``).
- ``results.md``: ``benchmarks/RESULTS.md``, every measurement in the order it was taken (the history the
  benchmarks page links).
"""
from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent


def on_files(files, config):
    from ray_mmbatch.flagdoc import render

    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    for path, content in (("reference/flags.md", render()), ("results.md", results)):
        existing = files.get_file_from_path(path)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, path, content=content))
    return files
