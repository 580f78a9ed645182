"""Every ``memckpt.X`` the README and the docs/ pages name exists: the package's public names
(``memckpt.WorkerContext``, ``memckpt.run``, ...) and the modules and names behind dotted paths
(``memckpt.bench.recovery``, ``memckpt.ray_train.X``). Every bare name a Python block uses
(``LocalCluster(...)``) is bound on the page, a builtin or a public ``memckpt`` name, and every
memckpt import in a block exists and comes from a public module (``memckpt.testing``, not
the room the layout put the class in). The examples/ scripts follow the same two rules. The
pages are read when the test runs, so a page added later is checked too. A path that moved
keeps a warning alias for a version (``memckpt.FailurePolicy``,
``memckpt.runtime.local_cluster``)."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import memckpt

ROOT = Path(__file__).resolve().parents[1]
# memckpt.A.B...; not a file name such as stall-memckpt.json or a path such as x/memckpt.py
NAME = re.compile(r"(?<![\w./-])memckpt((?:\.[A-Za-z_]\w*)+)")
FILE_SUFFIXES = {"json", "yaml", "yml", "toml", "py", "md", "txt", "log", "jsonl", "png", "csv",
                 "egg", "sh", "ini", "cfg", "html", "pt", "safetensors"}
OPTIONAL = {"ray_train"}  # packages that may not be installed or written yet: skipped if absent


def _pages() -> list[Path]:
    return [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))] if p.exists()]


def _uses() -> list[tuple[str, str]]:
    """(page:line, "memckpt.A.B") for every dotted name on every page."""
    out = []
    for page in _pages():
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for m in NAME.finditer(line):
                parts = m.group(1)[1:].split(".")
                if len(parts) == 1 and parts[0] in FILE_SUFFIXES:
                    continue
                if len(parts[0]) == 1:  # a placeholder in prose: `from memckpt.x import _y`
                    continue
                out.append((f"{page.relative_to(ROOT)}:{n}", "memckpt." + ".".join(parts)))
    return out


def _resolve(dotted: str) -> object:
    """The object behind ``memckpt.A.B...``: attributes first, then submodules."""
    obj: object = memckpt
    parts = dotted.split(".")[1:]
    for i, part in enumerate(parts):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif isinstance(obj, ModuleType):
            obj = importlib.import_module(f"{obj.__name__}.{part}")
        else:
            raise AttributeError(f"{'.'.join(['memckpt', *parts[:i]])} has no {part!r}")
    return obj


def test_pages_name_something():
    """The scan itself works: the README's tours use memckpt.run and memckpt.Config."""
    names = {d for _, d in _uses()}
    assert {"memckpt.run", "memckpt.Config"} <= names


@pytest.mark.parametrize("where,dotted", sorted(set(_uses())) or [("-", "memckpt.run")])
def test_documented_name_exists(where, dotted):
    head = dotted.split(".")[1]
    if head in OPTIONAL:
        try:
            importlib.import_module(f"memckpt.{head}")
        except ImportError:
            pytest.skip(f"memckpt.{head} is not importable here")
    try:
        _resolve(dotted)
    except (AttributeError, ImportError) as e:
        pytest.fail(f"{where}: {dotted} does not exist ({e})")


def test_worker_context_is_public_and_lazy():
    """``memckpt.WorkerContext`` (the type the README's Ray example annotates) is exported, and
    importing memckpt alone still loads neither Ray nor torch."""
    from memckpt.runtime.worker.worker import WorkerContext
    assert memckpt.WorkerContext is WorkerContext
    assert "WorkerContext" in memckpt.__all__
    code = ("import sys, memckpt; heavy = [m for m in ('ray', 'torch') if m in sys.modules]; "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.strip()
    assert out == "", f"import memckpt loaded {out}"


def _public_attributes() -> set[str]:
    """The names ``memckpt`` offers: its non-module attributes without a leading underscore,
    the ones it imports on first use (``__getattr__``) included."""
    lazy = {n for n in memckpt.__all__ if n not in vars(memckpt)}
    return {n for n, v in vars(memckpt).items()
            if not n.startswith("_") and not isinstance(v, ModuleType)} | lazy


def _python_blocks_of(text: str) -> list[tuple[int, str]]:
    return [(text[:m.start()].count("\n") + 1, m.group(2)) for m in re.finditer(
        r"^([ \t]*)```python[^\n]*\n(.*?)^\1```", text, flags=re.S | re.M)]


def _python_blocks(page: Path) -> list[tuple[int, str]]:
    """(line of the opening fence, code) for each fenced ``python`` block of a page."""
    return _python_blocks_of(page.read_text())


def _bound(tree: ast.AST) -> set[str]:
    """The names a block binds: imports, assignments, defs and their parameters, loops, ..."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            out.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            out.add(node.name)
    return out


def _unresolved(code: str, earlier: frozenset[str] | set[str] = frozenset()) -> set[str]:
    """The bare names ``code`` uses that nothing resolves: not bound in it or in ``earlier``
    (the page's blocks above it, which a block continues), not a builtin, not a public
    ``memckpt`` name (a submodule such as ``memckpt.config`` is not one)."""
    tree = ast.parse(code)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return {n for n in used - _bound(tree) - earlier
            if not hasattr(builtins, n) and n not in _public_attributes()}


def _bare_name_problems() -> list[str]:
    problems = []
    for page in _pages():
        earlier: set[str] = set()
        for line, code in _python_blocks(page):
            problems += [f"{page.relative_to(ROOT)}:{line}: {n}"
                         for n in sorted(_unresolved(code, earlier))]
            earlier |= _bound(ast.parse(code))
    return problems


def test_bare_names_check_sees_what_it_checks():
    """The scan finds the blocks, and flags a name no import gives (a drill tool used bare)."""
    assert sum(len(_python_blocks(p)) for p in _pages()) >= 10
    assert _unresolved('LocalCluster(node_labels=[{"rack": "r1"}])') == {"LocalCluster"}
    assert _unresolved("config.load_config()") == {"config"}  # a submodule, not a public name
    assert _unresolved("from memckpt.testing import LocalCluster\n"
                       "with LocalCluster() as c:\n    print(c, Config, len([x for x in ()]))") == set()
    assert _unresolved("model.train()", earlier={"model"}) == set()


def test_every_bare_name_in_a_python_block_resolves():
    """A reader who copies a block gets no NameError from a name the page never imports:
    the user's own objects are bound in the block (``model, opt = ...  # yours``) or above it."""
    problems = _bare_name_problems()
    assert not problems, ("names used in Python blocks that no import on the page gives "
                          "(import them, or bind the reader's own as `x = ...`):\n" + "\n".join(problems))


# The modules a page or an example may import from: the public face at the top level, the
# front doors, and the demo's jobs the examples run (demo code to copy, at a path that stays).
# A room inside the layout (memckpt.runtime.tools, ...) is not one: it moves when the layout
# changes, and a reader's script importing from it breaks with it (LocalCluster once did).
PUBLIC_MODULES = ("memckpt", "memckpt.config", "memckpt.errors", "memckpt.version",
                  "memckpt.checkpointer", "memckpt.testing", "memckpt.ray_train",
                  "memckpt.integrations.hf", "memckpt.integrations.lightning", "memckpt.demo.job")


def _examples() -> list[Path]:
    return sorted((ROOT / "examples").glob("*.py"))


def _import_problems(code: str) -> list[str]:
    """What is wrong with the memckpt imports of ``code``: a module that is not public (not
    in PUBLIC_MODULES) or does not exist, a name it does not offer. A module that needs an
    extra not installed here is not judged."""
    problems = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            wanted = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            wanted = [(node.module, a.name) for a in node.names]
        else:
            continue
        for module, name in wanted:
            if module.split(".")[0] != "memckpt":
                continue
            shown = f"{module}.{name}" if name else module
            if module not in PUBLIC_MODULES and f"{module}.{name}" not in PUBLIC_MODULES:
                problems.append(f"{shown}: {module} is not a public module "
                                f"(import it from one of {', '.join(PUBLIC_MODULES)})")
                continue
            try:
                found = importlib.import_module(module)
                if name and name != "*" and not hasattr(found, name):
                    importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError as e:
                if (e.name or "").split(".")[0] == "memckpt":
                    problems.append(f"{shown}: no such module ({e})")
            except ImportError as e:
                problems.append(f"{shown}: {e}")
    return problems


def test_import_check_sees_what_it_checks():
    """A block that imports a drill tool from where the layout put it, or a name that its
    public home does not offer, is caught; the public homes pass."""
    assert _import_problems("from memckpt.testing import LocalCluster, FaultInjector\n"
                            "import memckpt, memckpt.ray_train\nimport torch") == []
    [moved] = _import_problems("from memckpt.runtime.tools.local_cluster import LocalCluster")
    assert "not a public module" in moved
    [missing] = _import_problems("from memckpt.testing import LocalClusterr")
    assert "LocalClusterr" in missing
    [gone] = _import_problems("import memckpt.no_such_thing")
    assert "memckpt.no_such_thing" in gone and "not a public module" in gone
    page = ("Label the nodes:\n\n```python\nc = LocalCluster(nodes=2)\n```\n")
    [(line, code)] = _python_blocks_of(page)
    assert line == 3 and _unresolved(code) == {"LocalCluster"}


def test_every_import_in_a_python_block_is_from_a_public_module():
    """What a page tells a reader to import exists, at a path the layout can move under."""
    problems = [f"{page.relative_to(ROOT)}:{line}: {p}" for page in _pages()
                for line, code in _python_blocks(page) for p in _import_problems(code)]
    assert not problems, "\n".join(problems)


def test_every_example_imports_public_names_and_binds_what_it_uses():
    """examples/ are scripts a reader copies: the same two rules as the pages' blocks."""
    assert len(_examples()) >= 5
    problems = []
    for path in _examples():
        code = path.read_text()
        problems += [f"{path.relative_to(ROOT)}: {p}" for p in _import_problems(code)]
        problems += [f"{path.relative_to(ROOT)}: {n} is used but never bound or imported"
                     for n in sorted(_unresolved(code))]
    assert not problems, "\n".join(problems)


def test_every_exported_name_is_documented_and_nothing_else_is_exported():
    documented = {d.split(".")[1] for _, d in _uses()}
    assert sorted(set(memckpt.__all__) - documented) == [], \
        "name these in README.md or docs/ as memckpt.NAME, or take them out of memckpt.__all__"
    exported = _public_attributes() - {"__version__"}
    assert sorted(exported - set(memckpt.__all__)) == [], \
        "memckpt offers names outside __all__: import them as _name, or add them to __all__"
    for name in memckpt.__all__:
        assert getattr(memckpt, name) is not None, name


def test_fault_injector_lives_with_the_drills_only():
    from memckpt.runtime.chaos.faults import FaultInjector
    assert "FaultInjector" not in memckpt.__all__
    assert not hasattr(memckpt, "FaultInjector")
    assert FaultInjector().kill_worker(rank=1, at_step=3).faults[0].target == "worker"


def test_drill_tools_have_a_public_home_that_import_memckpt_does_not_load():
    """``memckpt.testing`` (the path the docs give) offers the drill tools where they live now;
    ``import memckpt`` neither loads it nor offers them at the top level."""
    import memckpt.testing
    from memckpt.runtime.chaos.faults import FaultInjector
    from memckpt.runtime.tools.local_cluster import LocalCluster, local_cluster
    assert (memckpt.testing.LocalCluster, memckpt.testing.local_cluster,
            memckpt.testing.FaultInjector) == (LocalCluster, local_cluster, FaultInjector)
    assert sorted(memckpt.testing.__all__) == ["FaultInjector", "LocalCluster", "local_cluster"]
    assert not {"LocalCluster", "FaultInjector"} & set(memckpt.__all__)
    code = "import sys, memckpt; print('memckpt.testing' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.strip()
    assert out == "False"


def test_the_old_local_cluster_path_is_a_deprecated_alias():
    """``memckpt.runtime.local_cluster`` (0.1.0's path) still gives the drill tools for one
    version, warning each time with the import to use instead, and still starts a held
    cluster with ``python -m``."""
    from memckpt.testing import LocalCluster, local_cluster
    with pytest.warns(FutureWarning, match="import LocalCluster from memckpt.testing"):
        from memckpt.runtime.local_cluster import LocalCluster as old
    with pytest.warns(FutureWarning, match="import local_cluster from memckpt.testing"):
        from memckpt.runtime.local_cluster import local_cluster as old_helper
    assert (old, old_helper) == (LocalCluster, local_cluster)
    with pytest.raises(ImportError):
        from memckpt.runtime.local_cluster import NoSuchName  # noqa: F401
    done = subprocess.run([sys.executable, "-m", "memckpt.runtime.local_cluster", "--help"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and "--nodes" in done.stdout, done.stderr
    assert "python -m memckpt.runtime.tools.local_cluster" in done.stderr  # the warning


def test_failure_policy_is_a_deprecated_alias_of_failure_config():
    """The old name still builds the config (this version only) and warns, naming the new one,
    whether it is reached as memckpt.FailurePolicy or imported from memckpt.config."""
    assert "FailurePolicy" not in memckpt.__all__
    with pytest.warns(FutureWarning, match="use FailureConfig"):
        old = memckpt.FailurePolicy
    assert old is memckpt.FailureConfig
    with pytest.warns(FutureWarning, match="memckpt.FailurePolicy is renamed memckpt.FailureConfig"):
        from memckpt.config import FailurePolicy
    cfg = memckpt.Config(failure=FailurePolicy(max_restarts=1))
    assert cfg.failure == memckpt.FailureConfig(max_restarts=1)
    with pytest.warns(FutureWarning):  # every use warns, not only the first
        memckpt.FailurePolicy  # noqa: B018 (the attribute access is what warns)


@pytest.mark.parametrize("fn", ["run", "dcp_reader", "keep_workers"])
def test_public_functions_are_typed_and_name_their_keywords(fn):
    """Every parameter and the return value are annotated; no ``**kwargs`` hides a keyword
    from a type checker or an IDE."""
    sig = inspect.signature(getattr(memckpt, fn))
    assert sig.return_annotation is not inspect.Signature.empty, fn
    for p in sig.parameters.values():
        assert p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL), f"{fn}(..., {p})"
        assert p.annotation is not p.empty, f"{fn}: {p.name} has no annotation"


def test_run_takes_the_drivers_keywords():
    from memckpt.runtime.driver.driver import run
    assert inspect.signature(memckpt.run).parameters.keys() == inspect.signature(run).parameters.keys()


def test_every_lazy_name_is_imported_for_type_checkers():
    """``memckpt.Checkpointer`` and the others are loaded on first use; an import under
    ``TYPE_CHECKING`` lets mypy and IDEs see their types instead of ``Any``."""
    tree = ast.parse(Path(memckpt.__file__).read_text())
    typed = {a.asname or a.name for node in ast.walk(tree)
             if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
             for sub in node.body if isinstance(sub, ast.ImportFrom) for a in sub.names}
    lazy = {n for n in memckpt.__all__ if n not in vars(memckpt)} | {"WorkerContext", "Checkpointer"}
    assert lazy <= typed, f"lazy names without a TYPE_CHECKING import: {sorted(lazy - typed)}"
