"""The package's shape: no import cycle between distfn's modules, no module over 750 lines, and decorating a
function loads none of the launch machinery (that is the first call's).

Read with `ast` from the source, so nothing is imported and every import counts: top-level ones, function-local
(deferred) ones and those under ``if TYPE_CHECKING:``. A type-only cycle does not fail at run time, but it is a
knot all the same: neither module can be read, tested or moved without the other (issue 24, "the picture tells
the truth"). The decoration rule counts only what runs at import: module-level imports outside TYPE_CHECKING.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "distfn"
MAX_LINES = 750


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The distfn modules that ``name`` (at ``path``) imports, wherever the import statement stands."""
    return _resolve(name, path, ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))), known)


def _resolve(name: str, path: Path, nodes: Iterable[ast.AST], known: set[str]) -> set[str]:
    """The distfn modules that the import statements among ``nodes`` (of module ``name`` at ``path``) name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join([*base, *([node.module] if node.module else [])])
            else:
                origin = node.module or ""
            # `from X import n` imports the module X.n when there is one, else a name defined in X
            for alias in node.names:
                found.add(f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin)
    return {m for m in found if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_the_graph_reader_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The reader itself: a cycle through a TYPE_CHECKING import and one through a function-local import are
    both found, and `from . import name` resolves to the submodule."""
    graph = _graph()
    assert "distfn.worker" in graph and "distfn.checkpoint" in graph
    assert "distfn.checkpoint" in graph["distfn"]  # `from . import checkpoint` in the package's __init__
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    source = tmp_path / "distfn"
    source.mkdir()
    (source / "one.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .two import X\n")
    (source / "two.py").write_text("def f():\n    from . import one\n")
    known = {"distfn.one", "distfn.two"}
    assert _imports("distfn.one", source / "one.py", known) == {"distfn.two"}
    assert _imports("distfn.two", source / "two.py", known) == {"distfn.one"}


def test_no_import_cycle_not_even_a_type_only_one() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (every import counts, TYPE_CHECKING and function-local ones too):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_checkpoint_package_imports_nothing_that_imports_it() -> None:
    """Issue 40 item 4: `distfn.checkpoint` is a plain library below the run. At the level of folders no arrow runs
    back up: no module the package imports (directly or through others) imports the package itself."""
    graph = _graph()
    inside = {m for m in graph if m == "distfn.checkpoint" or m.startswith("distfn.checkpoint.")}
    reached: set[str] = set()
    todo = [w for m in inside for w in graph[m] - inside]
    while todo:
        m = todo.pop()
        if m not in reached and m not in inside:
            reached.add(m)
            todo.extend(graph[m])
    back = sorted(m for m in reached if graph[m] & inside)
    assert not back, f"imported by distfn.checkpoint and importing it back: {back}"


def _runtime_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The distfn modules that importing ``name`` runs: its module-level imports (also under a module-level ``if``
    or ``try``, not under ``if TYPE_CHECKING:``, not in functions), and the packages above each."""
    nodes: list[ast.AST] = []
    for node in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        nodes.extend(ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node])
    found = _resolve(name, path, nodes, known)
    parents = {".".join(m.split(".")[:i]) for m in found for i in range(1, m.count(".") + 1)}
    return (found | parents) & known


def test_decorating_needs_none_of_the_launch_machinery() -> None:
    """Issue 32 item 1, by the source: what ``from distfn import distributed`` runs (the package, the decorator
    and everything they import at module level) reaches neither the launch machinery (`distfn.execute`, the
    launchers, the rank bootstrap) nor the checkpoint code; the decorator imports them at the first call."""
    modules = _modules()
    known = set(modules)
    seen: set[str] = set()
    todo = ["distfn", "distfn.decorator"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_runtime_imports(name, modules[name], known) - seen)
    heavy = {"distfn.execute", "distfn.worker", "distfn.context", "distfn.run", "distfn.checkpoint",
             "distfn.launch.local", "distfn.launch.ray", "distfn.launch.protocol", "distfn.launch.shipping",
             "distfn.rendezvous", "distfn.fsdp"}
    assert not seen & heavy, f"imported at decoration: {sorted(seen & heavy)}"


def test_no_module_over_750_lines() -> None:
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"


def _folder(name: str) -> str:
    """The room a module stands in when each folder of distfn is drawn as one: ``distfn.checkpoint`` for every
    module under ``distfn/checkpoint/`` (its sub-folders too), the module itself at the top level."""
    parts = name.split(".")
    return ".".join(parts[:2])


def _folder_graph(graph: dict[str, set[str]], leave_out: frozenset[str] = frozenset()) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for name, imported in graph.items():
        if name in leave_out:
            continue
        room = rooms.setdefault(_folder(name), set())
        room.update(_folder(m) for m in imported if _folder(m) != _folder(name) and m not in leave_out)
    for targets in list(rooms.values()):
        for t in targets:
            rooms.setdefault(t, set())
    return rooms


def test_no_import_runs_back_up_between_folders() -> None:
    """Issue 40: drawn with each folder as one room, the import graph has no circle, so a folder such as
    ``checkpoint/`` is a plain library below what uses it (it imports nothing that imports it). The reader is
    checked first: a module of a folder that imports a top-level module importing the folder is found."""
    assert _cycles(_folder_graph({"distfn.lib.a": {"distfn.user"}, "distfn.user": {"distfn.lib.b"},
                                  "distfn.lib.b": set()})) == [["distfn.lib", "distfn.user"]]
    graph = _graph()
    cycles = _cycles(_folder_graph(graph))
    assert not cycles, "imports that run back up between folders:\n" + "\n".join(" <-> ".join(c) for c in cycles)


#: The store's methods; only the channel module (`distfn.rankstore`) and the rendezvous that makes the store call them.
_STORE_METHODS = frozenset({"set", "get", "add", "check", "wait", "compare_set", "multi_get", "delete_key"})
_STORE_OWNERS = frozenset({"distfn.rankstore", "distfn.rendezvous"})


def _store_calls(source: str) -> list[str]:
    """Calls of a store method in ``source``: ``<receiver>.<method>(...)`` where the method is one only a store
    has (``multi_get``, ``compare_set``), or a store method called on a receiver whose name ends in "store"
    (``store``, ``self.store``, ``own_store``; not ``_STORES``, a dict of object stores)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _STORE_METHODS:
            receiver = ast.unparse(node.func.value)
            if node.func.attr in ("multi_get", "compare_set") or receiver.lower().endswith("store"):
                found.append(f"{receiver}.{node.func.attr} (line {node.lineno})")
    return found


def test_only_the_channel_module_and_the_rendezvous_touch_a_store() -> None:
    """Issue 40 item 1: every cross-rank service speaks through `distfn.rankstore.Channel` (run-scoped keys, one
    back-off), so a fifth one cannot grow a dialect of its own. The reader is checked on the old check-in's code."""
    assert _store_calls("self.store.set(k, v)\nkeys = store.multi_get(ks)\nown.compare_set(a, b, c)\nd.get(x)\n"
                        "_STORES.get(k)") == ["self.store.set (line 1)", "store.multi_get (line 2)",
                                              "own.compare_set (line 3)"]
    offenders = {name: calls for name, path in _modules().items() if name not in _STORE_OWNERS
                 and (calls := _store_calls(path.read_text(encoding="utf-8")))}
    assert not offenders, f"store access outside distfn.rankstore: {offenders}"


def test_the_rank_bootstrap_reads_as_the_bootstrap() -> None:
    """Issue 40 item 2: `worker.run` stays a bootstrap (at most 40 lines, docstring included); the services' order
    is `distfn.run.Run`'s (open, connect, fail, close)."""
    tree = ast.parse((PACKAGE / "worker.py").read_text(encoding="utf-8"))
    run = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run")
    assert run.end_lineno is not None and run.end_lineno - run.lineno + 1 <= 40


#: What only the 'test' extra installs: a test module imports it at its top only after skipping itself without it.
EXTRA_ONLY = ("hypothesis",)


def _top_level_imports_before_skip(tree: ast.Module) -> list[str]:
    """The extra-only modules a test module imports at its top before (or without) ``pytest.importorskip`` of it."""
    skipped: set[str] = set()
    bad = []
    for node in tree.body:
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            if (isinstance(call.func, ast.Attribute) and call.func.attr == "importorskip" and call.args
                    and isinstance(call.args[0], ast.Constant)):
                skipped.add(str(call.args[0].value).split(".")[0])
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        bad += [n for n in names if n.split(".")[0] in EXTRA_ONLY and n.split(".")[0] not in skipped]
    return bad


def test_no_test_module_needs_the_test_extra_to_be_collected() -> None:
    """The README's quick selection runs on the bare install (CI's first pass): a test module importing hypothesis
    at its top stops the whole pass at collection (it happened twice: test_boundary/test_mesh, then test_pool)."""
    bad = {path.name: found for path in sorted(PACKAGE.parent.joinpath("tests").rglob("*.py"))
           if (found := _top_level_imports_before_skip(ast.parse(path.read_text())))}
    assert bad == {}, f"import these after pytest.importorskip(...) or inside the test: {bad}"
    # the rule reads both ways of writing it
    assert _top_level_imports_before_skip(ast.parse("import pytest\nfrom hypothesis import given\n")) == \
        ["hypothesis"]
    assert _top_level_imports_before_skip(ast.parse(
        "import pytest\nh = pytest.importorskip('hypothesis')\nfrom hypothesis import strategies as st\n")) == []
