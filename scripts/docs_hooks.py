"""MkDocs hooks (mkdocs.yml ``hooks:``): pages generated at every build, so they cannot drift.

- ``reference/flags.md``: every flag and config field, from config.py's docstrings and the commands'
  parsers (``ray_mmbatch/flagdoc.py``).
- ``results.md``: ``benchmarks/RESULTS.md``, every measurement in the order it was taken (the history the
  benchmarks page links).

The pages link a repository file the site serves under another name by its repository path
(``../benchmarks/RESULTS.md#a-heading``), so the link works where ``docs/`` is read on the repository host
too; ``on_page_markdown`` points such a link at the site's copy, its anchor turned from the host's id of
the heading into the site's (tests/test_docs.py checks every relative link resolves in the repository).
"""
from __future__ import annotations

import functools
import posixpath
import re
from pathlib import Path

from markdown.extensions.toc import slugify
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent

#: a repository file outside docs/ -> the path the site serves its copy at
SERVED_AS = {"benchmarks/RESULTS.md": "results.md"}

_LINK = re.compile(r"\]\(([^)\s#]+)(#[^)\s]*)?\)")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def on_files(files, config):
    from ray_mmbatch.flagdoc import render

    pages = {"reference/flags.md": render()}
    pages.update({served: (ROOT / source).read_text() for source, served in SERVED_AS.items()})
    for path, content in pages.items():
        existing = files.get_file_from_path(path)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, path, content=content))
    return files


def on_page_markdown(markdown, page, config, files):
    """Links to a file of ``SERVED_AS`` by its repository path point at the site's copy."""
    page_dir = (Path(config["docs_dir"]) / page.file.src_path).parent

    def repoint(match: re.Match) -> str:
        target = (page_dir / match.group(1)).resolve()
        source = target.relative_to(ROOT).as_posix() if target.is_relative_to(ROOT) else ""
        if source not in SERVED_AS:
            return match.group(0)
        served = posixpath.relpath(SERVED_AS[source], posixpath.dirname(page.file.src_uri) or ".")
        anchor = (match.group(2) or "")[1:]
        if anchor:
            anchor = "#" + site_anchors(source).get(anchor, anchor)  # an unknown one: the strict build reports it
        return f"]({served}{anchor})"

    return _LINK.sub(repoint, markdown)


def headings(text: str) -> list[str]:
    """The Markdown headings of a page (outside fenced code), as written."""
    found, fence = [], None
    for line in text.splitlines():
        opened = _FENCE.match(line)
        if opened and (fence is None or opened.group(1).startswith(fence)):
            fence = opened.group(1) if fence is None else None
            continue
        heading = _HEADING.match(line) if fence is None else None
        if heading:
            found.append(re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)))  # a link: its text
    return found


def github_slug(heading: str) -> str:
    """The id the repository host (GitHub) gives a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    each space a ``-`` (runs are kept: ``a: `--b` `` -> ``a---b``)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def site_anchors(source: str) -> dict[str, str]:
    """{the host's id: the site's id (Python-Markdown's toc)} of each heading of a repository Markdown file."""
    return {github_slug(h): slugify(h.replace("`", ""), "-") for h in headings((ROOT / source).read_text())}
