"""The package's import rule, checked by reading every module with ``ast``.

Layers, highest first; a module may import its own layer or any layer below it, never one
above. Function-level (lazy) imports count like top-level ones. ``memckpt/__init__.py``,
the public facade, may import anything; as an import *target* it counts as the runtime
layer (it re-exports ``run``), so nothing below runtime imports it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "memckpt"

# (layer, the module prefixes in it), highest first. A prefix covers the module of that
# name and everything under it; "memckpt" alone catches every other top-level module.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("cli", ("memckpt.cli",)),
    ("apps", ("memckpt.bench", "memckpt.demo", "memckpt.ray_train", "memckpt.integrations",
              "memckpt.testing")),
    ("runtime", ("memckpt.runtime",)),
    ("checkpointer", ("memckpt.checkpointer",)),
    ("persist", ("memckpt.persist",)),
    ("engine", ("memckpt.engine",)),
    ("format", ("memckpt.format",)),
    # configuration checks itself with the pure decisions (placement's feasibility); no
    # decision reads a Config: the arrow between them points one way
    ("config", ("memckpt.config",)),
    # the base: errors, version, pure decisions and plain helpers
    ("base", ("memckpt.errors", "memckpt.version", "memckpt.policy", "memckpt.util")),
]
# the public face at the top level; every other module lives in a room (sub-package)
TOP_LEVEL = {"memckpt", "memckpt.config", "memckpt.errors", "memckpt.version",
             "memckpt.checkpointer", "memckpt.testing"}
FACADE = "memckpt"
FACADE_LAYER = "runtime"
MAX_LINES = 600
# every module in them imports neither Ray nor torch: the pure decisions, and what a worker
# and its node's store both speak (a store never imports torch)
PURE_ROOMS = ("memckpt.policy", "memckpt.runtime.wire")
# Inside runtime, one room per process that runs it, and three they share. A room never
# imports the rooms named here:
# - a node's actors and the coordinator run beside the driver and the workers, never as
#   them, and hold neither their code nor torch;
# - a worker is told what to do by the driver and never reaches back, and it reaches its
#   node's store only through Ray calls, the store's files and its TCP data plane: never
#   the store's code (nor the store a worker's);
# - wire/ is what a worker and a store both speak (the shared-memory layout, the data
#   plane's protocol and client, the store's call names): it imports no other room;
# - chaos/ is fault injection, run by the processes it hits (the driver fires a schedule,
#   a worker its own step's fault): it imports no process's room;
# - tools/ are the operator's (a local cluster, the job client): no process imports them.
# ray_nodes.py, shared by all, imports no room.
RUNTIME = "memckpt.runtime"
ROOMS = {"driver", "worker", "node", "coordinator", "wire", "chaos", "tools"}
ROOMS_NOT_IMPORTED: dict[str, tuple[str, ...]] = {
    "memckpt.runtime.node": ("driver", "worker", "chaos", "tools"),
    "memckpt.runtime.coordinator": ("driver", "worker", "node", "wire", "chaos", "tools"),
    "memckpt.runtime.worker": ("driver", "node", "coordinator", "tools"),
    "memckpt.runtime.wire": ("driver", "worker", "node", "coordinator", "chaos", "tools"),
    "memckpt.runtime.chaos": ("driver", "worker", "node", "coordinator", "wire", "tools"),
    "memckpt.runtime.tools": ("driver", "worker", "node"),
    "memckpt.runtime.ray_nodes": ("driver", "worker", "node", "coordinator", "wire", "chaos",
                                  "tools"),
}
# Old import paths kept one version as aliases that warn (a user's script imported them):
# each imports only what it names, and shares its file name with the module it points to.
DEPRECATED_ALIASES = {"memckpt.runtime.local_cluster": "memckpt.runtime.tools.local_cluster"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> int:
    if module == FACADE:
        return [name for name, _ in LAYERS].index(FACADE_LAYER)
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer: add its prefix to LAYERS")


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported memckpt module, the name taken from it or None, line) for every import
    statement anywhere in ``module``, lazy ones included."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                # "from memckpt import shard" names a module; "from memckpt import Config" a name
                out.append((sub, None, node.lineno) if sub in MODULES
                           else (base, a.name, node.lineno))
    return [(m, name, line) for m, name, line in out if m == FACADE or m.startswith(FACADE + ".")]


def _edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        if module == FACADE:
            continue
        for target, _, _ in _imports(module):
            while target not in MODULES:  # memckpt.x.name -> memckpt.x
                target = target.rpartition(".")[0]
            if target != module:
                graph[module].add(target)
    return graph


def test_every_module_is_in_a_layer():
    for module in MODULES:
        _layer(module)


def test_no_import_points_up():
    names = [name for name, _ in LAYERS]
    up = []
    for module in MODULES:
        if module == FACADE:
            continue
        for target, _, line in _imports(module):
            if _layer(target) < _layer(module):
                up.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} ({names[_layer(module)]})"
                          f" imports {target} ({names[_layer(target)]})")
    assert not up, "imports that point up a layer:\n" + "\n".join(up)


def _in(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_runtime_rooms_follow_their_processes():
    rooms = {m.split(".")[2] for m in MODULES if m.startswith(RUNTIME + ".") and m.count(".") >= 3}
    assert rooms == ROOMS, rooms
    wrong = []
    for module in MODULES:
        for room, forbidden in ROOMS_NOT_IMPORTED.items():
            if not _in(module, room):
                continue
            for target, _, line in _imports(module):
                hit = [f for f in forbidden if _in(target, f"{RUNTIME}.{f}")]
                if hit:
                    wrong.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports "
                                 f"{target} (the {hit[0]} room)")
    assert not wrong, "runtime rooms that import another process's code:\n" + "\n".join(wrong)


def test_config_and_policy_import_one_way():
    graph = _edges()
    assert "memckpt.policy.placement" in graph["memckpt.config"]  # the checker sees the arrow
    back = sorted(m for m in graph if _in(m, "memckpt.policy") and "memckpt.config" in graph[m])
    assert not back, f"policy modules that import memckpt.config: {back}"


def test_no_import_cycles():
    graph = _edges()
    cycles, state = [], {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_private_name_imported_from_another_module():
    private = []
    for module in MODULES:
        for target, name, line in _imports(module):
            hidden = [p for p in (target.split(".") + [name or ""]) if p.startswith("_")
                      and not (p.startswith("__") and p.endswith("__"))]
            if hidden:
                private.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports "
                               f"{target}{'.' + name if name else ''}")
    assert not private, "private names imported across modules:\n" + "\n".join(private)


def _module_aliases(tree: ast.AST) -> dict[str, str]:
    """Local names bound to memckpt modules: ``import memckpt.x as a``, ``from memckpt import x``."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update({a.asname: a.name for a in node.names if a.asname and a.name in MODULES})
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                        if f"{node.module}.{a.name}" in MODULES})
    return out


def test_no_private_name_reached_through_another_module():
    # `from memckpt.x import y as m; m._helper()` is the same coupling as importing _helper
    private = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        aliases = _module_aliases(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__") and aliases[node.value.id] != module):
                private.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} uses "
                               f"{aliases[node.value.id]}.{node.attr}")
    assert not private, "private names used across modules:\n" + "\n".join(private)


def test_no_module_is_too_long():
    long = []
    for path in MODULES.values():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            long.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines")
    assert not long, f"modules over {MAX_LINES} lines (split them along a seam):\n" + "\n".join(long)


def test_top_level_holds_only_the_public_face():
    top = {m for m in MODULES if m.count(".") == 1 and not MODULES[m].name == "__init__.py"}
    assert top | {FACADE} == TOP_LEVEL, f"top-level modules outside the public face: {top - TOP_LEVEL}"


def test_no_two_rooms_share_a_file_name():
    # the same name is allowed only for the same role in parallel rooms: a persisted tier's
    # backend, a front door's context, a benchmark's parts (memckpt/bench/<name>/)
    parallel = {"context", "local", "s3", "command", "measure", "rows", "report"}
    names: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        if path.name != "__init__.py" and module not in DEPRECATED_ALIASES:
            names.setdefault(path.stem, []).append(module)
    shared = {n: ms for n, ms in names.items() if len(ms) > 1 and n not in parallel}
    assert not shared, f"one file name in several rooms: {shared}"


def test_pure_modules_import_neither_ray_nor_torch():
    pure = [m for m in MODULES if any(m == r or m.startswith(r + ".") for r in PURE_ROOMS)]
    assert len(pure) >= 4, pure
    for module in pure:
        code = (f"import sys, {module}; "
                "heavy = sorted(m for m in ('ray', 'torch') if m in sys.modules); "
                "sys.exit(', '.join(heavy) or None)")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, f"{module} imported {done.stderr.strip()}"


def test_the_checker_sees_what_it_checks():
    # the rule would pass vacuously if the walk found nothing
    graph = _edges()
    assert any("memckpt.checkpointer" in graph[m] for m in graph if m.startswith("memckpt.runtime."))
    assert "memckpt.persist.uploader" in graph["memckpt.checkpointer"]
    assert _layer("memckpt.cli.main") < _layer("memckpt.demo.job") < _layer("memckpt.runtime.driver.driver") \
        < _layer("memckpt.checkpointer") < _layer("memckpt.persist.uploader") < _layer("memckpt.format.state")
    assert _layer("memckpt.ray_train.anything") == _layer("memckpt.bench.common")
    assert _layer("memckpt.config") < _layer("memckpt.policy.placement") == _layer("memckpt.errors")
    assert "memckpt.runtime.wire.ram_files" in graph["memckpt.runtime.worker.context"]
    assert "memckpt.runtime.wire.data_plane" in graph["memckpt.runtime.node.shard_server"]
    assert "memckpt.runtime.chaos.faults" in graph["memckpt.runtime.worker.context"]
    assert "memckpt.runtime.coordinator.state_store" in graph["memckpt.runtime.node.janitor"]
