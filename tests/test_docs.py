"""The docs are tested: every documented command and snippet runs, and the site builds with warnings as errors.

Each ```bash / ```python block of README.md and docs/*.md runs, page by page, in a fresh working folder
holding generated data under the names the docs use (``WORKSPACE_DATA``) and tiny random Hugging Face
checkpoints under ``checkpoints/<a real checkpoint's name>`` (``CHECKPOINTS``, built when a page names
one). ``ray-mmbatch CMD`` and ``python jobs/X.py`` lines run in this process on the shared local Ray
cluster (a CLI start-up is what most of the time would be otherwise); other lines run in bash. Python
blocks of one page share one namespace and run in order.

The tiny local equivalents, applied to every command: ``--use-gpu`` and ``--data-resource R`` are dropped,
``--num-workers N`` is capped at 2, ``ray job submit [opts] -- CMD`` runs CMD here, and ``ray start / stop / up /
down / dashboard / get-auth-token`` do nothing: the shared local cluster stands in for the cluster they manage.
Directives, HTML comments on the lines right above a fence (docs/contributing.md lists them):

- ``<!-- docs-test: skip REASON -->``: not run (a cloud account, ``pip install``...); the reason is required.
- ``<!-- docs-test: file PATH -->``: the block's text is written to PATH instead (a YAML config).
- ``<!-- docs-test: replace OLD => NEW -->``: OLD replaced by NEW before running (``s3://bucket/x`` => a folder).
- ``<!-- docs-test: exit N -->``: the block's last command must exit with N (a documented refusal).
- ``<!-- docs-test: ran-in PAGE -->``: not run here because PAGE (a docs page, relative to docs/) runs the same
  commands: each command line of the block must be a command line of a block that PAGE runs (checked; ``ray start
  / stop`` lines excepted, they do nothing here).
- ``<!-- docs-test: prints -->``: the output shown in the next (text) block is checked: each of its lines, cut at
  its first ``...``, must begin a line the block's commands print (figures that are exact on any machine).
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RUN_LANGS = {"bash", "sh", "shell", "python", "py"}
DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(\w[\w-]*)\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
MAX_SKIPS = 12  # a few blocks need a cloud, a GPU or a package not installed here: keep them few


@dataclasses.dataclass
class Block:
    page: str
    line: int
    lang: str
    text: str
    skip: str | None = None
    file: str | None = None
    exit: int = 0
    replace: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    prints: bool = False
    ran_in: str | None = None  # with ``ran-in``: the page whose run covers this block's commands
    expected: str = ""  # with ``prints``: the next block's text, the output the page shows

    @property
    def runs(self) -> bool:
        return self.skip is None and self.ran_in is None and (self.file is not None or self.lang in RUN_LANGS)


def doc_pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted(p for p in DOCS.rglob("*.md"))


#: README.md's first block is its two commands (set-up + the demo, set-up + the tests): .ci/run runs the second,
#: quickstart.md runs the demo's job, and re-running the set-up inside the tests it sets up would prove nothing
README_TOP = "the README's two commands: .ci/run runs the test command, quickstart.md the demo's job"


def parse_blocks(text: str, page: str) -> list[Block]:
    """The fenced blocks of a Markdown page with the directives written right above each."""
    blocks: list[Block] = []
    pending: list[tuple[str, str, int]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        m = DIRECTIVE.match(line)
        if m:
            pending.append((m.group(1), m.group(2), i + 1))
            i += 1
            continue
        f = FENCE.match(line)
        if not f:
            if line.strip():
                if pending:
                    raise ValueError(f"{page}:{pending[0][2]}: a docs-test directive must be right above a fence")
            i += 1
            continue
        indent, fence, lang = f.group(1), f.group(2), f.group(3).lower()
        body, i = [], i + 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        block = Block(page, i - len(body), lang, "\n".join(body) + "\n")
        if page == "README.md" and not blocks:
            block.skip = README_TOP
        for name, arg, at in pending:
            if name == "skip":
                if not arg:
                    raise ValueError(f"{page}:{at}: skip needs a reason")
                block.skip = arg
            elif name == "file":
                block.file = arg
            elif name == "exit":
                block.exit = int(arg)
            elif name == "prints":
                block.prints = True
            elif name == "ran-in":
                if not (DOCS / arg).is_file():
                    raise ValueError(f"{page}:{at}: ran-in names no docs page {arg!r}")
                block.ran_in = arg
            elif name == "replace":
                old, sep, new = arg.partition(" => ")
                if not sep:
                    raise ValueError(f"{page}:{at}: replace needs 'OLD => NEW'")
                block.replace.append((old, new))
            else:
                raise ValueError(f"{page}:{at}: unknown docs-test directive {name!r}")
        pending = []
        blocks.append(block)
        i += 1
    if pending:
        raise ValueError(f"{page}:{pending[0][2]}: a docs-test directive with no fence after it")
    for block, shown in zip(blocks, blocks[1:] + [None]):
        if block.prints:
            if shown is None or shown.lang not in ("text", ""):
                raise ValueError(f"{page}:{block.line}: 'prints' needs a text block after its block")
            block.expected = shown.text
    return blocks


def missing_lines(output: str, expected: str) -> list[str]:
    """The lines of ``expected`` (each cut at its first '...') whose words begin no line of ``output``."""
    printed = [line.split() for line in output.splitlines()]
    missing = []
    for line in expected.splitlines():
        words = line.split("...")[0].split()
        if words and not any(p[:len(words)] == words for p in printed):
            missing.append(line)
    return missing


# --- the working folder: the data and checkpoints the docs name ---------------------------------------------

#: folder in the working folder -> (format, samples, seed) generated by synthetic.generate_dataset
WORKSPACE_DATA = {
    "my_data": ("parquet", 64, 1),
    "my_shards": ("webdataset", 64, 2),
    "my_llava": ("llava", 64, 3),
    "my_eval": ("parquet", 16, 4),
}


def _qwen(kind):
    def make(d):
        from tests.hf_checkpoints import make_qwen_checkpoint

        return make_qwen_checkpoint(d, kind)
    return make


def _named(module, fn, **kw):
    def make(d):
        import importlib

        return getattr(importlib.import_module(f"tests.{module}"), fn)(d, **kw)
    return make


#: a real checkpoint's name -> the builder of a tiny random one of its family (tests/hf_*checkpoint*.py)
CHECKPOINTS = {
    "Qwen2-VL-2B-Instruct": _qwen("qwen2_vl"),
    "Qwen2.5-VL-3B-Instruct": _qwen("qwen2_5_vl"),
    "Qwen3-VL-2B-Instruct": _qwen("qwen3_vl"),
    "llava-1.5-7b-hf": _named("hf_llava_checkpoint", "make_llava_checkpoint"),
    "llava-onevision-qwen2-0.5b-ov-hf": _named("hf_llava_onevision_checkpoint", "make_llava_onevision_checkpoint"),
    "InternVL3-1B-hf": _named("hf_internvl_checkpoint", "make_internvl_checkpoint"),
    "gemma-3-4b-it": _named("hf_gemma3_checkpoint", "make_gemma3_checkpoint"),
    "SmolVLM-256M-Instruct": _named("hf_idefics3_checkpoint", "make_idefics3_checkpoint", splitting=True),
}


@pytest.fixture(scope="session")
def docs_assets(tmp_path_factory):
    """Generated datasets (made once) and a cache of tiny checkpoints (made when a page names one)."""
    from ray_mmbatch.synthetic.generate import generate_dataset

    root = tmp_path_factory.mktemp("docs_assets")
    for name, (fmt, n, seed) in WORKSPACE_DATA.items():
        generate_dataset(str(root / name), n, fmt, seed=seed, shard_size=32, workers=1)
    if (root / "my_llava" / "data.json").exists() is False:
        raise AssertionError(f"the LLaVA fixture has no data.json: {sorted(os.listdir(root / 'my_llava'))}")
    (root / "checkpoints").mkdir()
    return root


#: the repo's top-level entries a page's commands use from the repo root (`python benchmarks/...`)
REPO_ENTRIES = ("benchmarks", "examples", "jobs", "scripts", "cluster.yaml", "pyproject.toml")


def _workspace(assets: Path, page_text: str, into: Path) -> Path:
    """The page's working folder: the repo root as a user has it (its scripts), plus the data the docs name."""
    for name in REPO_ENTRIES:
        (into / name).symlink_to(ROOT / name, target_is_directory=(ROOT / name).is_dir())
    for name in WORKSPACE_DATA:
        (into / name).symlink_to(assets / name, target_is_directory=True)
    (into / "checkpoints").mkdir()
    for name, make in CHECKPOINTS.items():
        if f"checkpoints/{name}" in page_text:
            cached = assets / "checkpoints" / name
            if not cached.exists():
                make(cached)
            (into / "checkpoints" / name).symlink_to(cached, target_is_directory=True)
    return into


# --- running a block ------------------------------------------------------------------------------------------

#: `ray X` commands that start, stop or reach a cluster: the shared local cluster stands in for it
CLUSTER_LIFECYCLE = ("start", "stop", "up", "down", "dashboard", "attach", "exec", "status", "get-auth-token")
JOBS = {p.stem for p in (ROOT / "jobs").glob("*.py")} - {"__init__"}  # jobs/X.py runs ray_mmbatch.commands.X


def local_equivalent(argv: list[str]) -> list[str]:
    """The command as it runs on this machine: no GPU, no custom resources, at most 2 Train workers."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--use-gpu":
            i += 1 + (i + 1 < len(argv) and argv[i + 1].lower() in ("true", "false"))
            continue
        if a == "--data-resource":
            i += 2
            continue
        if a == "--num-workers" and i + 1 < len(argv):
            out += [a, str(min(int(argv[i + 1]), 2))]
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def _commands(text: str) -> list[str]:
    """Logical command lines of a shell block: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [ln for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def _in_process(argv: list[str]) -> int | None:
    """Run a ray-mmbatch / jobs command here and return its exit code; None when it is not one."""
    from ray_mmbatch import cli

    head = argv[0].removeprefix(".venv/bin/")
    if head == "ray-mmbatch":
        return _exit_code(lambda: cli.main(local_equivalent(argv[1:])))
    if head in ("python", "python3") and len(argv) > 1 and argv[1].startswith("jobs/"):
        module = Path(argv[1]).stem
        assert module in JOBS, f"{argv[1]} is not one of the jobs {sorted(JOBS)}"
        import importlib

        main = importlib.import_module(f"ray_mmbatch.commands.{module}").main
        return _exit_code(lambda: main(local_equivalent(argv[2:]), prog=argv[1]))
    if argv[0] == "ray" and len(argv) > 1 and argv[1] in CLUSTER_LIFECYCLE:
        return 0  # the shared local cluster stands in for the one these start, stop or reach
    if argv[:3] == ["ray", "job", "submit"] and "--" in argv:
        return _in_process(argv[argv.index("--") + 1:])
    return None


def _exit_code(call) -> int:
    try:
        rc = call()
    except SystemExit as e:  # argparse errors, --help
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return rc if isinstance(rc, int) else 0


def run_shell_block(block: Block, text: str, cwd: Path, env: dict[str, str]) -> int:
    rc, printed = 0, []
    for line in _commands(text):
        words = shlex.split(line, comments=True)
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # FOO=bar cmd
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        if words and words[0] == "export":
            for w in words[1:]:
                key, _, value = w.partition("=")
                env[key] = value
            continue
        if not words:
            continue
        saved = dict(os.environ)
        os.environ.update(env)
        started = time.perf_counter()
        try:
            rc = _in_process(words)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        if rc is None:
            path = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
            proc = subprocess.run(["bash", "-c", line], cwd=cwd, env={**os.environ, **env, "PATH": path},
                                  capture_output=True, text=True, timeout=600)
            rc = proc.returncode
            printed.append(proc.stdout)
            print(proc.stdout[-4000:], proc.stderr[-4000:])
        print(f"[docs] {time.perf_counter() - started:6.1f} s  {block.page}:{block.line}  {line.strip()[:120]}")
        if rc != 0 and block.exit == 0:
            raise AssertionError(f"{block.page}:{block.line}: `{line.strip()}` exited {rc}")
    missing = missing_lines("".join(printed), block.expected) if block.prints else []
    assert not missing, f"{block.page}:{block.line}: the page shows lines the command did not print: {missing}"
    return rc


def run_page(page: Path, tmp: Path, assets: Path, monkeypatch) -> int:
    """Run every runnable block of ``page``; returns how many ran."""
    text = page.read_text()
    work = _workspace(assets, text, tmp)
    monkeypatch.chdir(work)
    monkeypatch.setenv("WANDB_MODE", "offline")
    namespace: dict = {"__name__": "__docs__"}
    env: dict[str, str] = {}
    ran = 0
    for block in parse_blocks(text, page.name):
        if not block.runs:
            continue
        body = block.text
        for old, new in block.replace:
            assert old in body, f"{block.page}:{block.line}: replace {old!r}: not in the block"
            body = body.replace(old, new)
        if block.file is not None:
            target = work / block.file
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(body)
        elif block.lang in ("python", "py"):
            code = compile(body, f"{page.name}:{block.line}", "exec")
            exec(code, namespace)  # noqa: S102 - the documented snippet, run as a user would
        else:
            rc = run_shell_block(block, body, work, env)
            assert rc == block.exit, f"{block.page}:{block.line}: exited {rc}, the docs say {block.exit}"
        ran += 1
    return ran


# --- tests ----------------------------------------------------------------------------------------------------

def test_directives_parse_and_skips_stay_few():
    """Every directive is known and sits above a fence; skips name a reason and stay few."""
    skipped, runnable = [], 0
    for page in doc_pages():
        for block in parse_blocks(page.read_text(), page.name):
            if block.skip is not None:
                skipped.append(f"{block.page}:{block.line}: {block.skip}")
            runnable += block.runs
    assert runnable >= 20, f"only {runnable} runnable blocks: the docs lost their examples?"
    assert len(skipped) <= MAX_SKIPS, "\n".join(skipped)


def test_parser_reads_directives_for_the_next_fence_only():
    text = ("<!-- docs-test: replace s3://b/x => my_data/ -->\n```bash\nray-mmbatch inspect --data s3://b/x\n```\n\n"
            "```python\nprint(1)\n```\n<!-- docs-test: file cfg.yaml -->\n```yaml\na: 1\n```\n"
            "```text\nnot run\n```\n")
    blocks = parse_blocks(text, "t.md")
    assert [(b.lang, b.runs, b.replace, b.file) for b in blocks] == [
        ("bash", True, [("s3://b/x", "my_data/")], None), ("python", True, [], None),
        ("yaml", True, [], "cfg.yaml"), ("text", False, [], None)]
    with pytest.raises(ValueError, match="right above a fence"):
        parse_blocks("<!-- docs-test: skip why -->\nprose\n```bash\nls\n```\n", "t.md")
    with pytest.raises(ValueError, match="needs a reason"):
        parse_blocks("<!-- docs-test: skip -->\n```bash\nls\n```\n", "t.md")


def _command_words(block: Block) -> list[tuple[str, ...]]:
    """A shell block's commands as words (continuations joined, comments dropped), replacements applied."""
    text = block.text
    for old, new in block.replace:
        text = text.replace(old, new)
    return [tuple(shlex.split(line, comments=True)) for line in _commands(text)]


def _lifecycle(words: tuple[str, ...]) -> bool:
    """A ``ray start / stop / up ...`` line: a no-op in these tests (``_in_process``)."""
    return len(words) > 1 and words[0] == "ray" and words[1] in CLUSTER_LIFECYCLE


def test_ran_in_blocks_are_run_by_the_page_they_name():
    """A ``ran-in PAGE`` block is not run twice: each of its commands, word for word, is a command of a block that
    PAGE runs, so that page's run is this block's run."""
    covered = 0
    for page in doc_pages():
        for block in parse_blocks(page.read_text(), page.name):
            if block.ran_in is None:
                continue
            target = DOCS / block.ran_in
            ran = {words for b in parse_blocks(target.read_text(), target.name) if b.runs and b.lang in RUN_LANGS
                   for words in _command_words(b)}
            # `ray start / stop ...` do nothing here (the shared cluster stands in): no page needs to run them
            missing = [" ".join(w) for w in _command_words(block) if w not in ran and not _lifecycle(w)]
            assert not missing, f"{block.page}:{block.line}: not run by {block.ran_in}: {missing}"
            covered += 1
    assert covered >= 3  # the README's tune sweep and local run, quickstart's model block
    bad = "<!-- docs-test: ran-in budgets.md -->\n```bash\nray-mmbatch tune --data elsewhere/ --out x\n```\n"
    (block,) = parse_blocks(bad, "t.md")
    assert not block.runs and _command_words(block)[0] not in {
        w for b in parse_blocks((DOCS / "budgets.md").read_text(), "budgets.md") if b.runs for w in _command_words(b)}
    with pytest.raises(ValueError, match="names no docs page"):
        parse_blocks("<!-- docs-test: ran-in nowhere.md -->\n```bash\nls\n```\n", "t.md")


def test_local_equivalent_of_a_cluster_command():
    argv = ["--data", "s3://b", "--use-gpu", "--num-workers", "8", "--data-resource", "preprocess", "--epochs", "1"]
    assert local_equivalent(argv) == ["--data", "s3://b", "--num-workers", "2", "--epochs", "1"]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in doc_pages()])
def test_documented_examples_run(page, ray_cluster, docs_assets, tmp_path, monkeypatch):
    """Every runnable block of the page runs as documented, on generated data and tiny checkpoints."""
    ran = run_page(ROOT / page, tmp_path, docs_assets, monkeypatch)
    blocks = [b for b in parse_blocks((ROOT / page).read_text(), Path(page).name) if b.runs]
    assert ran == len(blocks)


def test_site_builds_with_warnings_as_errors(tmp_path):
    """`mkdocs build --strict`: a broken internal link or anchor, a page missing from the nav or a docstring
    mkdocstrings cannot render fails the build (and this test)."""
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs, "mkdocs is not installed (scripts/setup.sh installs the dev extra, which has it)"
    proc = subprocess.run([mkdocs, "build", "--strict", "-d", str(tmp_path / "site")], cwd=ROOT,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    flags = (tmp_path / "site" / "reference" / "flags" / "index.html").read_text()
    assert "--max-tokens" in flags and "data.payload_memory_mb" in flags


def test_committed_flags_page_is_current():
    """docs/reference/flags.md (read on GitHub; the site build regenerates it) equals what config.py gives now.
    Regenerate with `python -m ray_mmbatch.flagdoc > docs/reference/flags.md`."""
    from ray_mmbatch.flagdoc import render

    assert (DOCS / "reference" / "flags.md").read_text() == render() + "\n", \
        "docs/reference/flags.md is stale: python -m ray_mmbatch.flagdoc > docs/reference/flags.md"


def test_flags_page_lists_every_field_and_every_flag():
    """The generated page (docs reference/flags.md) holds every config field and every flag of every command."""
    import argparse
    import importlib

    from ray_mmbatch import cli
    from ray_mmbatch.config import Config
    from ray_mmbatch.flagdoc import render

    page = render()
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(getattr(Config(), section.name)):
            assert f"`{section.name}.{f.name}`" in page, f"{section.name}.{f.name} missing"
    for name, (module, _) in cli.COMMANDS.items():
        parser = importlib.import_module(f"ray_mmbatch.commands.{module}").build_parser(prog=name)
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert f"`{option}`" in page, f"ray-mmbatch {name} {option} missing"


# --- help, the flags page, links and the README agree with the code -----------------------------------------

def _command_parsers():
    import importlib

    from ray_mmbatch import cli

    for name, (module, _) in cli.COMMANDS.items():
        yield name, importlib.import_module(f"ray_mmbatch.commands.{module}").build_parser(prog=f"ray-mmbatch {name}")


def _cells(line: str) -> list[str]:
    """A Markdown table row's cells, ``\\|`` kept inside its cell and unescaped."""
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _page_defaults(page: str) -> dict[tuple[str, str], str]:
    """{(command or 'config', flag): the default cell} of every row of the flags page that names a flag."""
    out, where = {}, "config"
    for line in page.splitlines():
        heading = re.match(r"^### ray-mmbatch (\S+)", line)
        if heading:
            where = heading.group(1)
        elif line.startswith("| `--"):
            cells = _cells(line)
            if len(cells) < 3:  # the first table: --config, --set, --verbose
                continue
            default = cells[2] if where == "config" else cells[1]
            for flag in re.findall(r"`(--[\w-]+)`", cells[0]):
                out[(where, flag)] = default
    return out


def _stated_default(help_text: str) -> str | None:
    """The text of the last "(default: ...)" of a help string, parentheses inside it balanced."""
    start = help_text.rfind("(default: ")
    if start < 0:
        return None
    depth, i = 1, start + len("(default: ")
    for j in range(i, len(help_text)):
        depth += {"(": 1, ")": -1}.get(help_text[j], 0)
        if depth == 0:
            return help_text[i:j].strip()
    return None


def test_help_and_flags_page_name_every_backend_and_video_family():
    """`--backend`'s help and the flags page list every backend of the models/ registry, and the page's image.video
    every model_type a backend trains on video: the lists are filled from the registries, so they cannot drift."""
    from ray_mmbatch.flagdoc import render
    from ray_mmbatch.models import REGISTRY, video_model_types

    backends, video = list(REGISTRY), video_model_types()
    assert len(backends) >= 7 and len(video) >= 4, (backends, video)
    parsers = dict(_command_parsers())
    helps = {a.dest: a.help for a in parsers["train"]._actions}
    assert all(f"'{b}'" in helps["model.backend"] for b in backends), helps["model.backend"]
    assert "{" not in helps["model.backend"]
    rows = {_cells(line)[1]: _cells(line)[3] for line in render().splitlines() if line.startswith("| ")
            and len(_cells(line)) == 4 and _cells(line)[1].startswith("`")}
    assert all(f"'{b}'" in rows["`model.backend`"] for b in backends), rows["`model.backend`"]
    assert all(f"'{t}'" in rows["`image.video`"] for t in video), rows["`image.video`"]
    assert not any(re.search(r"\{(backends|video_families)\}", text) for text in rows.values())


def test_flags_page_defaults_agree_with_help(monkeypatch):
    """For every flag of every command, the flags page's default is the one `--help` states: the help's own
    "(default: ...)" text where it has one, else the parser's default; and the page is the same on a machine with
    a GPU (`verify-packing --device` defaults to cuda there) as on one without."""
    import argparse

    import torch

    from ray_mmbatch.flagdoc import render

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    page = render()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert render() == page, "the flags page depends on this machine"
    defaults, checked = _page_defaults(page), 0
    for name, parser in _command_parsers():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings or action.dest in ("set",
                                                                                                     "config"):
                continue
            flag = action.option_strings[-1]
            cell = defaults.get(("config" if "." in action.dest else name, flag))
            if action.dest == "verbose":
                continue  # the page's first table
            assert cell is not None, f"ray-mmbatch {name} {flag}: no row on the flags page"
            stated = _stated_default((action.help or "").replace("%%", "%"))
            if action.required:
                expected = "required"
            elif stated is not None:
                expected = f"`{stated}`"
            else:
                expected = "" if action.default is None else f"`{action.default!r}`"
            if cell.endswith("...`") and stated is not None:  # a long default, cut on the page
                assert stated.startswith(cell[1:-4]), f"ray-mmbatch {name} {flag}: page {cell}, --help {stated}"
            else:
                assert cell == expected, f"ray-mmbatch {name} {flag}: page {cell!r}, --help says {expected!r}"
            checked += 1
    assert checked > 50, checked


def _markdown_links(text: str) -> list[str]:
    """The link targets of a Markdown page's prose (fenced blocks and code spans left out)."""
    prose, fence = [], None
    for line in text.splitlines():
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened.group(2)
        elif fence is not None:
            fence = None if line.strip().startswith(fence) else fence
        else:
            prose.append(line)
    text = re.sub(r"(`+)(?!`).+?(?<!`)\1(?!`)", "", "\n".join(prose), flags=re.S)
    return re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)


def _docs_hooks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_relative_link_resolves_in_the_repository():
    """Every relative link of README.md and docs/ names a file of the repository, so it works where the pages are
    read on the repository host, not only in the built site (a page the site generates, such as its copy of
    benchmarks/RESULTS.md, is linked by its repository path; the site build repoints it). A link into a Markdown
    file outside docs/ names one of its headings by the host's id (the site build translates it)."""
    hooks = _docs_hooks()
    assert hooks.github_slug("Sizing: `inspect --throughput` (issue 34)") == "sizing-inspect---throughput-issue-34"
    bad, checked = [], 0
    for page in doc_pages():
        for target in _markdown_links(page.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, or an anchor of the page itself
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve()
            checked += 1
            where = f"{page.relative_to(ROOT)}: {target}"
            if not resolved.exists() or not resolved.is_relative_to(ROOT):
                bad.append(f"{where} (no such file in the repository)")
            elif anchor and resolved.suffix == ".md" and not resolved.is_relative_to(DOCS):
                ids = {hooks.github_slug(h) for h in hooks.headings(resolved.read_text())}
                if anchor not in ids:
                    bad.append(f"{where} (no such heading)")
    assert checked > 100, checked
    assert not bad, "\n".join(bad)


def test_contributing_test_command_is_the_readmes():
    """docs/contributing.md gives the README's own test command (its second line, which CI runs)."""
    test_command = (ROOT / "README.md").read_text().splitlines()[2].split("#")[0].strip()
    assert test_command == "bash scripts/setup.sh --reference && .venv/bin/python -m pytest tests -n 2"
    commands = [c.split("#")[0].strip() for b in parse_blocks((DOCS / "contributing.md").read_text(), "c.md")
                if b.lang == "bash" for c in _commands(b.text)]
    assert test_command in commands, commands


def test_readme_shows_the_three_ways_and_the_gpu_note():
    """The README shows, one runnable block each and linking its guide: a `ray job submit` to a cluster, `ray start
    --head` and a run, `tune` for the budgets; and beside its figures and every `--use-gpu` that no GPU run is
    recorded."""
    text = (ROOT / "README.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)
    blocks = [b for b in parse_blocks(text, "README.md") if b.runs or b.ran_in]
    for command, guide in (("ray job submit", "docs/cluster.md"), ("ray start --head", "docs/cluster.md"),
                           ("ray-mmbatch tune", "docs/budgets.md")):
        block = next((b for b in blocks if command in b.text), None)
        assert block is not None, f"no runnable README block runs {command}"
        before = "\n".join(text.splitlines()[:block.line])
        assert guide in before[before.rfind("**"):], f"{command}: the sentence above it links no {guide}"
    local = next(b for b in blocks if "ray start --head" in b.text)
    assert "jobs/train.py" in local.text or "ray-mmbatch train" in local.text
    note = "not yet run on a GPU"
    assert note in sections[0], "the figures' note"
    for section in sections:
        if "--use-gpu" in section:
            assert note in section, section.splitlines()[0]


def test_prints_checks_the_shown_output_line_by_line():
    """The 'prints' directive: a shown line (cut at '...') must begin a printed line, words compared."""
    blocks = parse_blocks("<!-- docs-test: prints -->\n```bash\necho hi\n```\n\n```text\nfill  99.84%  ...\n```\n",
                          "t.md")
    assert blocks[0].prints and blocks[0].expected == "fill  99.84%  ...\n"
    assert missing_lines("x\nfill 99.84%   3189  12345\n", blocks[0].expected) == []
    assert missing_lines("fill 99.83%   3189\n", blocks[0].expected) == ["fill  99.84%  ..."]
    with pytest.raises(ValueError, match="needs a text block"):
        parse_blocks("<!-- docs-test: prints -->\n```bash\necho hi\n```\n", "t.md")


def test_readme_fill_figures_are_the_ones_the_benchmark_page_checks():
    """The README's fill table equals the benchmark page's output excerpt, which the 'prints' directive checks
    against bench_packing.py's output in every test run: a changed planner changes all three or fails."""
    page = parse_blocks((DOCS / "benchmarks.md").read_text(), "benchmarks.md")
    run = next(b for b in page if b.prints and "bench_packing.py" in b.text)
    fills = {line.split("  ")[0].strip(): line.split()[len(line.split("  ")[0].split())]
             for line in run.expected.splitlines() if line.startswith("(")}
    readme = (ROOT / "README.md").read_text()
    rows = {"(a) batch_size=32 pad-to-longest": "`batch_size=32`, padded to the longest | ",
            "(b) pad/truncate to 512, 4 per batch": "pad / truncate to 512, 4 per batch | ",
            "(c) pack greedy arrival order (whole set)": "greedy token budget, arrival order | ",
            "(e) pack pack_best_fit_decreasing + carry w=2048": "**ray_mmbatch, pack mode** (window 2048 + carry) | ",
            "(e) pad pad_sorted_buckets + carry w=2048": "**ray_mmbatch, pad mode** (window 2048 + carry) | "}
    for strategy, row in rows.items():
        shown = re.search(re.escape(row) + r"\**([\d.]+) %", readme)
        assert shown, row
        decimals = len(shown.group(1).partition(".")[2])
        assert f"{float(fills[strategy].rstrip('%')):.{decimals}f}" == shown.group(1), (strategy, fills[strategy])
