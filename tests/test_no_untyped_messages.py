"""No ``dict[str, Any]`` crosses a process boundary in ``memckpt/runtime`` (issue #52): what
one process sends another is a typed record (a dataclass: :mod:`memckpt.runtime.worker.result`,
:mod:`memckpt.runtime.ray_nodes`, the coordinator's messages) or a ``TypedDict`` where the
thing is JSON by nature (the coordinator's status, the data plane's messages).

An AST walk over every module of the runtime finds each function's parameter and return
annotation, each annotated class field (a dataclass's, a TypedDict's) and each module-level
alias spelled ``dict[str, Any]``, ``Dict[str, Any]``, ``Mapping[str, Any]`` or
``MutableMapping[str, Any]``, nested ones included (``list[dict[str, Any]]``). Each one found
must be in :data:`ALLOWED`, with the reason it is not an untyped message; an entry that no
longer matches anything must go. (mypy's ``disallow_any_generics`` on ``memckpt.runtime.*``
holds the other half: no bare ``dict`` to hide one.)"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Union

RUNTIME = Path(__file__).resolve().parent.parent / "memckpt" / "runtime"
MAPPINGS = {"dict", "Dict", "Mapping", "MutableMapping"}

_HANDLES = ("node -> a Ray actor handle or ObjectRef, held in the driver's process: Ray "
            "types no handle, and a handle is not a record")
_SUMMARY = ("the run summary: returned to memckpt.run's caller in its own process and "
            "written as summary.json, a document for the user, not a message")
ALLOWED: dict[str, str] = {
    # events.jsonl's lines: free-form key/values by nature, each event kind its own; the one
    # name for them, used by log_event, JobMetrics.event and what the driver logs
    "coordinator/messages.py:EventFields": "an event's fields (events.jsonl)",
    # the driver's own records, in its process
    "driver/driver.py:Runtime.events->": "the driver's event records (events.jsonl's lines)",
    "driver/driver.py:Runtime.run->": _SUMMARY,
    "driver/driver.py:Runtime._finish->": _SUMMARY,
    "driver/driver.py:run->": _SUMMARY,
    "chaos/faults.py:FaultInjector.fired": ("the injector's record of the faults it fired, "
                                            "kept by the process that fires them (driver, "
                                            "Ray Train callback): the run summary's"),
    # maps of Ray handles
    "driver/actors.py:inventory(stores)": _HANDLES,
    "driver/actors.py:roll_back(stores)": _HANDLES,
    "driver/actors.py:free_unserved(stores)": _HANDLES,
    "driver/actors.py:release(stores)": _HANDLES,
    "driver/pool.py:WorkerPool._held(prefaults)": _HANDLES,
    "worker/spec.py:WorkerSpec.stores": ("node -> its ReplicaStore's Ray actor handle: Ray "
                                         "carries a handle as a handle (the spec itself is a "
                                         "typed record)"),
}


def _is_untyped(node: ast.AST) -> bool:
    """``node`` is ``X[str, Any]`` for X a mapping (``typing.`` prefixes allowed)."""
    if not isinstance(node, ast.Subscript) or not isinstance(node.slice, ast.Tuple):
        return False
    base = node.value
    name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
    if name not in MAPPINGS or len(node.slice.elts) != 2:
        return False
    key, value = node.slice.elts
    value_name = value.id if isinstance(value, ast.Name) else \
        value.attr if isinstance(value, ast.Attribute) else ""
    return isinstance(key, ast.Name) and key.id == "str" and value_name == "Any"


def _spells_untyped(annotation: Union[ast.AST, None]) -> bool:
    """The annotation holds an untyped mapping anywhere (a quoted one included)."""
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                if _spells_untyped(ast.parse(node.value, mode="eval").body):
                    return True
            except SyntaxError:
                continue
        elif _is_untyped(node):
            return True
    return False


def _args(fn: Union[ast.FunctionDef, ast.AsyncFunctionDef]) -> Iterator[ast.arg]:
    a = fn.args
    yield from a.posonlyargs + a.args + a.kwonlyargs
    yield from (x for x in (a.vararg, a.kwarg) if x is not None)


def untyped_annotations(source: str, module: str = "<snippet>") -> list[str]:
    """``module:where`` of each untyped mapping in ``source``'s annotations: a function's
    parameter (``f(x)``) or return (``f->``), a class's annotated field (``C.x``), a
    module-level alias or annotated name (``X``)."""
    found: list[str] = []

    def visit(body: list[ast.stmt], scope: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where = f"{module}:{scope}{node.name}"
                found.extend(f"{where}({arg.arg})" for arg in _args(node)
                             if _spells_untyped(arg.annotation))
                if _spells_untyped(node.returns):
                    found.append(f"{where}->")
                visit(node.body, f"{scope}{node.name}.")  # nested functions and classes
            elif isinstance(node, ast.ClassDef):
                for stmt in node.body:
                    if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                            and _spells_untyped(stmt.annotation)):
                        found.append(f"{module}:{scope}{node.name}.{stmt.target.id}")
                visit(node.body, f"{scope}{node.name}.")
            elif not scope and isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if _spells_untyped(node.annotation) or _spells_untyped(node.value):
                    found.append(f"{module}:{node.target.id}")
            elif not scope and isinstance(node, ast.Assign) and _spells_untyped(node.value):
                found.extend(f"{module}:{t.id}" for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.If):  # if TYPE_CHECKING: ... else: ...
                visit(node.body + node.orelse, scope)

    visit(ast.parse(source).body, "")
    return found


def _runtime_findings() -> list[str]:
    out = []
    for path in sorted(RUNTIME.rglob("*.py")):
        out += untyped_annotations(path.read_text(), path.relative_to(RUNTIME).as_posix())
    return out


def test_no_untyped_mapping_crosses_a_process() -> None:
    unexplained = [f for f in _runtime_findings() if f not in ALLOWED]
    assert not unexplained, (
        "a dict[str, Any] in an annotation: give what crosses a process a typed record or a "
        "TypedDict (or, if it never leaves its process, add it to ALLOWED with the reason):\n"
        + "\n".join(unexplained))


def test_every_allowance_is_still_needed() -> None:
    stale = sorted(set(ALLOWED) - set(_runtime_findings()))
    assert not stale, f"ALLOWED entries that match nothing any more (remove them): {stale}"


def test_the_check_catches_untyped_mappings() -> None:
    snippet = '''
from typing import Any, Dict, Mapping
import typing
Alias = Mapping[str, Any]
Typed: typing.Dict[str, int] = {}
class Msg:
    ok: dict[str, int]
    bad: "list[dict[str, Any]]"
    def reply(self, a: int, *rest: Dict[str, Any], **kw: int) -> typing.Mapping[str, typing.Any]:
        def inner(x: Optional[dict[str, Any]]) -> None: ...
async def send(msg: dict[str, Any], fine: dict[int, Any], also: Mapping[str, object]) -> None: ...
def clean(x: dict[str, str]) -> Mapping[str, int]: ...
'''
    assert untyped_annotations(snippet, "m.py") == [
        "m.py:Alias", "m.py:Msg.bad", "m.py:Msg.reply(rest)", "m.py:Msg.reply->",
        "m.py:Msg.reply.inner(x)", "m.py:send(msg)"]


def test_the_check_walks_the_runtime() -> None:
    # vacuous if the walk saw nothing: the allowed entries are found, in each room named
    found = _runtime_findings()
    assert "coordinator/messages.py:EventFields" in found
    assert {f.split("/")[0] for f in found} >= {"driver", "worker", "chaos", "coordinator"}
