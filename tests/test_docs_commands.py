"""Every command shown in README.md and docs/*.md is checked, and the runnable ones are run.

The pages are read when the tests run, so a new page is covered without registering it:

- every fenced block names its language;
- every ``memckpt ...`` shell line (and inline ``memckpt ...`` command without placeholders)
  parses with the real CLI parser, every ``ray ...`` line with Ray's own CLI; ``pip`` and
  ``python`` lines must be on the short lists below; repository paths must exist;
- every Python block compiles;
- blocks preceded by ``<!-- test: run -->`` are executed, in page order, in one fresh folder
  per page: Python blocks as programs, ``memckpt`` lines through the CLI;
- relative links (and their ``#anchors``) resolve; the layout block at the top of
  docs/architecture.md lists exactly the modules on disk.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_MARK = "<!-- test: run -->"
LAYOUT_MARK = "<!-- test: layout -->"
SHELL = {"bash", "sh", "shell", "console"}
LANGUAGES = SHELL | {"python", "text", "yaml", "json", "toml", "ini"}

# The only pip and python commands the docs may show (tokens after shlex.split).
PIP_ALLOWED = {
    ("pip", "install", "torch==2.13.0"),
    ("pip", "install", "-e", "."),
    ("pip", "install", "-q", "-e", ".[test]"),
    ("pip", "install", "-e", ".[bench]"),
    ("pip", "install", "-e", ".[bench,peers]"),
    ("pip", "install", "-e", ".[hf]"),
    ("pip", "install", "-e", ".[lightning]"),
}
PYTHON_MODULES_ALLOWED = {"pytest"}
# Other programs a shell block may use; memckpt, ray, pip and python are checked apart.
PROGRAMS_ALLOWED = {"cluster/local-cluster.sh", "kubectl", "export", "echo", "cat", "ruff", "mypy"}
REPO_DIRS = ("examples/", "cluster/", "tests/", "docs/", "benchmarks/", "memckpt/", ".ci/")
# Pages written alongside this one on other branches: a link to one is checked once it exists.
PENDING_PAGES: set[str] = set()
RUN_TIMEOUT_S = 180


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    mark: Optional[str]  # the <!-- test: ... --> line just above the fence

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3)
        prev = next((p.strip() for p in reversed(lines[:i]) if p.strip()), "")
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i])
            i += 1
        found.append(Block(page, start + 1, lang, "\n".join(body),
                           prev if prev.startswith("<!-- test:") else None))
        i += 1
    return found


def prose(page: Path) -> str:
    """The page without its fenced blocks."""
    return re.sub(r"^(\s*)(```+|~~~+).*?^\s*\2\s*$", "", page.read_text(), flags=re.S | re.M)


def shell_commands(text: str) -> list[list[str]]:
    """Each command of a shell block as tokens: continuations joined, comments dropped,
    `&&` / `;` chains split, leading VAR=value assignments removed."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        current: list[str] = []
        for token in shlex.split(line, comments=True) + [";"]:
            if token in ("&&", ";", "||"):
                while current and re.match(r"^[A-Z_][A-Z0-9_]*=", current[0]):
                    current.pop(0)
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(token)
    return commands


ALL_BLOCKS = [b for page in PAGES for b in blocks(page)]
SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.lang in SHELL]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "python"]


# ---- checking a command without running it -------------------------------------------------

_PARSER = None


def parse_memckpt(args: list[str]) -> Optional[str]:
    """None if ``memckpt ARGS`` parses with the real parser, else argparse's complaint."""
    global _PARSER
    if _PARSER is None:
        from memckpt.cli.main import build_parser
        _PARSER = build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            _PARSER.parse_args(args)
    except SystemExit as e:
        if e.code:
            return err.getvalue().strip().splitlines()[-1]
    return None


def parse_ray(args: list[str]) -> tuple[Optional[str], dict]:
    """(None, params) if ``ray ARGS`` parses with Ray's own click CLI, else (the error, {})."""
    import click
    from ray.scripts.scripts import cli
    cmd, rest, name = cli, list(args), "ray"
    while isinstance(cmd, click.Group):
        if not rest:
            return f"'ray {' '.join(args)}' names no command", {}
        name, rest = rest[0], rest[1:]
        sub = cmd.get_command(click.Context(cmd), name)
        if sub is None:
            return f"'ray' has no command {name!r}", {}
        cmd = sub
    try:
        return None, cmd.make_context(name, rest).params
    except click.ClickException as e:
        return e.format_message(), {}


def check_pytest(args: list[str], markers: set[str]) -> list[str]:
    problems, i = [], 0
    while i < len(args):
        a = args[i]
        if a in ("-m", "-k", "-n"):  # options that take a value
            if a == "-m":
                names = set(re.findall(r"[A-Za-z_]\w*", args[i + 1])) - {"and", "or", "not"}
                problems += [f"pytest marker {n!r} is not registered" for n in names - markers]
            i += 2
            continue
        if not a.startswith(("-",) + REPO_DIRS) and not (ROOT / a.split("::")[0]).exists():
            problems.append(f"pytest path {a!r} does not exist")
        i += 1
    return problems


def check_command(tokens: list[str], markers: set[str]) -> list[str]:
    """What is wrong with one shell command shown in the docs (empty if nothing)."""
    prog, args = tokens[0], tokens[1:]
    problems = []
    for t in tokens:  # repository paths, also inside TRAIN specs such as examples/x.py:train
        path = t.split(":")[0] if re.match(r"^[\w./-]+\.py:\w+$", t) else t
        if path.startswith(REPO_DIRS) and not (ROOT / path.split("::")[0]).exists():
            problems.append(f"{path!r} does not exist in the repository")
    if prog == "memckpt":
        err = parse_memckpt(args)
        if err:
            problems.append(f"does not parse: {err}")
    elif prog == "ray":
        err, params = parse_ray(args)
        if err:
            problems.append(f"ray does not accept it: {err}")
        if params.get("entrypoint"):
            problems += check_command(list(params["entrypoint"]), markers)
    elif prog == "pip":
        if tuple(tokens) not in PIP_ALLOWED:
            problems.append("is not one of the pip commands the docs may show (PIP_ALLOWED)")
    elif prog == "python":
        if args[:1] == ["-m"] and len(args) > 1 and args[1] in PYTHON_MODULES_ALLOWED:
            problems += check_pytest(args[2:], markers)
        elif args and args[0].endswith(".py") and (ROOT / args[0]).is_file():
            pass
        else:
            problems.append("is neither `python -m pytest ...` nor a script in the repository")
    elif prog == "cluster/local-cluster.sh":
        if args[:1] not in (["start"], ["status"], ["stop"]):
            problems.append("local-cluster.sh takes start, status or stop")
    elif prog not in PROGRAMS_ALLOWED:
        problems.append(f"{prog!r} is not a program the docs may use (PROGRAMS_ALLOWED)")
    return problems


@pytest.fixture(scope="module")
def markers(pytestconfig) -> set[str]:
    return {m.split(":")[0].strip() for m in pytestconfig.getini("markers")}


def test_docs_have_pages_and_blocks():
    names = {p.name for p in PAGES}
    assert {"README.md", "architecture.md", "configuration.md", "operations.md",
            "persistence.md", "benchmarks.md", "testing.md"} <= names
    assert SHELL_BLOCKS and PYTHON_BLOCKS
    assert any(b.mark == RUN_MARK for b in blocks(ROOT / "README.md"))


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=Block.where)
def test_every_block_names_a_known_language(block):
    assert block.lang in LANGUAGES, (
        f"{block.where()}: give the fence a language ({', '.join(sorted(LANGUAGES))})")
    assert block.mark in (None, RUN_MARK, LAYOUT_MARK), f"{block.where()}: unknown {block.mark}"


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=Block.where)
def test_shell_commands_are_valid(block, markers):
    commands = shell_commands(block.text)
    assert commands, f"{block.where()}: a shell block without a command"
    problems = [f"{block.where()}: `{shlex.join(c)}` {p}"
                for c in commands for p in check_command(c, markers)]
    assert not problems, "\n".join(problems)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((dict(a.choices) for a in parser._actions
                 if isinstance(a, argparse._SubParsersAction)), {})


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def test_inline_memckpt_commands_name_real_commands_and_options():
    """Text mentions such as `memckpt kill --node` or a synopsis such as
    `memckpt ls ROOT [--verify]` name a command and options the CLI has."""
    parse_memckpt([])  # builds _PARSER
    commands = _subcommands(_PARSER)
    checked, problems = 0, []
    for page in PAGES:
        for span in re.findall(r"`(memckpt [^`\n]+)`", prose(page)):
            words = span.replace("\\|", "|").split()
            name = words[1]
            if name not in commands:
                problems.append(f"{page.relative_to(ROOT)}: `{span}`: no command {name!r}")
                continue
            parsers = [commands[name]]
            subs = _subcommands(commands[name])
            if subs and len(words) > 2 and not words[2].startswith(("-", "[")):
                named = [w for w in words[2].split("|") if w]
                problems += [f"{page.relative_to(ROOT)}: `{span}`: no `memckpt {name} {w}`"
                             for w in named if w not in subs]
                parsers = [subs[w] for w in named if w in subs]
            known = set().union(*map(_options, parsers))
            for option in re.findall(r"(?<![\w-])--[\w-]+", span):
                checked += 1
                if option not in known:
                    problems.append(f"{page.relative_to(ROOT)}: `{span}`: memckpt {name} has no "
                                    f"{option}")
    assert checked > 0
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=Block.where)
def test_python_blocks_compile(block):
    try:
        compile(block.text, block.where(), "exec")
    except SyntaxError as e:
        pytest.fail(f"{block.where()}: {e}")


# ---- running the runnable blocks -----------------------------------------------------------

RUNNABLE_PAGES = [p for p in PAGES if any(b.mark == RUN_MARK for b in blocks(p))]


def _run(argv: list[str], cwd: Path, where: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    res = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S)
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"{where}: exit status {res.returncode}\n{out[-3000:]}"
    assert "Traceback" not in out, f"{where}: printed a traceback\n{out[-3000:]}"


@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_runnable_blocks_run(page, tmp_path):
    # Two test runs on one machine would share the snippets' RAM folders (/dev/shm/memckpt/<job>).
    lock = Path(tempfile.gettempdir()) / f"memckpt-docs-{page.stem}.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        for b in blocks(page):
            if b.mark != RUN_MARK:
                continue
            if b.lang == "python":
                script = tmp_path / f"block_{b.line}.py"
                script.write_text(b.text + "\n")
                _run([sys.executable, str(script)], tmp_path, b.where())
            elif b.lang in SHELL:
                for c in shell_commands(b.text):
                    assert c[0] == "memckpt", f"{b.where()}: only memckpt commands are run"
                    _run([sys.executable, "-m", "memckpt.cli", *c[1:]], tmp_path,
                         f"{b.where()}: {shlex.join(c)}")
            else:
                pytest.fail(f"{b.where()}: a {b.lang} block cannot be run")
        _check_ram_freed(page)


def _check_ram_freed(page: Path) -> None:
    """The snippets end with ``close(unlink=True)``: their jobs' RAM folders hold no file."""
    from memckpt.engine.buffers import default_ram_root
    jobs = {j for b in blocks(page) if b.mark == RUN_MARK
            for j in re.findall(r"job_name=[\"']([\w.-]+)[\"']", b.text)}
    for job in jobs:
        folder = default_ram_root() / job
        left = [p for p in folder.rglob("*") if not p.is_dir()] if folder.is_dir() else []
        assert not left, f"{page.relative_to(ROOT)} left snapshots in RAM: {left}"
        for d in sorted(folder.rglob("*"), reverse=True) + [folder]:
            with contextlib.suppress(FileNotFoundError):
                d.rmdir()


# ---- links and the layout ------------------------------------------------------------------

def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+\s+(.*)$", prose(page), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_relative_links_resolve():
    problems = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(page)):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
            if not dest.exists():
                if rel not in PENDING_PAGES:
                    problems.append(f"{page.relative_to(ROOT)}: link to {target} ({rel} is missing)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                problems.append(f"{page.relative_to(ROOT)}: link to {target}: no heading "
                                f"#{anchor} in {rel}")
    assert not problems, "\n".join(problems)


def test_architecture_layout_lists_every_module():
    page = ROOT / "docs" / "architecture.md"
    [layout] = [b for b in blocks(page) if b.mark == LAYOUT_MARK]
    listed, folder = set(), None
    for line in layout.text.splitlines():
        if m := re.match(r"^(memckpt(?:/\w+)*/)(\s|$)", line):
            folder = m.group(1)
        elif (m := re.match(r"^\s+(\w+\.py)(\s|$)", line)) and folder:
            listed.add(folder + m.group(1))
    on_disk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "memckpt").rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    assert not on_disk - listed, (f"docs/architecture.md's layout misses {sorted(on_disk - listed)}: "
                                  "add a line for each, with what it does")
    assert not listed - on_disk, (f"docs/architecture.md's layout lists {sorted(listed - on_disk)}, "
                                  "which do not exist: remove or rename them")
