"""The product's layout holds: one subpackage per step of a request's flow, small files and
classes, a docstring on every public class, an import graph without cycles (every import
counted: late ones and TYPE_CHECKING ones too), and a router whose insides nothing outside
the core touches.

The harness (emulator/, loadgen/) in rooms, under looser rules of its own (the end of this
file): no import cycle between its modules, at most 15 modules directly in any of its
folders, files of at most 600 lines and classes of at most 450 (the product's: 450 and
300; benchmarks and the engine twin carry long tables, reports and request handlers), and
every package's __init__.py a docstring that imports nothing. That the product never
imports the harness is tests/unit/test_boundaries.py's."""

import ast
import random
import re
from collections.abc import Sequence
from pathlib import Path

import pytest

from ext_proc.core.router import Router

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ROOT / "ext_proc"
MAX_FILE_LINES = 450
MAX_CLASS_LINES = 300


def _modules(roots: Sequence[Path] = (PRODUCT,)) -> dict[str, Path]:
    out = {}
    for p in sorted(p for root in roots for p in root.rglob("*.py")):
        if p.name.endswith("_pb2.py"):
            continue
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def import_graph(
    modules: dict[str, Path] = MODULES, prefixes: tuple[str, ...] = ("ext_proc",)
) -> dict[str, set[str]]:
    """Module -> the modules of `modules` it imports, wherever the import statement is."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    base = f"{base}.{node.module}" if node.module else base
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                # the longest prefix that is a module: `from pkg import mod` names mod
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith(prefixes):
                    edges.add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph as a path (empty: none)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str]:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state and (cycle := visit(m)):
                return cycle
        stack.pop()
        state[n] = 2
        return []

    for n in sorted(graph):
        if n not in state and (cycle := visit(n)):
            return cycle
    return []


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert graph["ext_proc.core.router"] >= {"ext_proc.core.fleet", "ext_proc.core.features"}
    assert find_cycle(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_one_subpackage_per_step_each_saying_what_it_is_for() -> None:
    packages = [p.parent for p in PRODUCT.glob("*/__init__.py")]
    assert len(packages) >= 6
    for p in packages:
        tree = ast.parse((p / "__init__.py").read_text(encoding="utf-8"))
        assert ast.get_docstring(tree), f"{p.name}/__init__.py has no docstring"
        # importing a subpackage must not import its modules (no cycles through __init__)
        assert not any(isinstance(n, ast.Import | ast.ImportFrom) for n in tree.body), p.name


def package_of(module: str) -> str:
    """The top-level package of a product module (`ext_proc.core.router` -> `core`)."""
    return module.split(".")[1] if module.count(".") >= 1 else module


def package_graph() -> dict[str, set[str]]:
    """Package -> the other product packages its modules import."""
    graph: dict[str, set[str]] = {}
    for a, bs in import_graph().items():
        for b in bs:
            if package_of(a) != package_of(b):
                graph.setdefault(package_of(a), set()).add(package_of(b))
    return graph


def test_no_package_imports_another_in_a_loop() -> None:
    assert find_cycle(package_graph()) == []


ALLOWED = re.compile(r"May\s+import:\s+([^.]*)\.", re.S)


@pytest.mark.parametrize("package", sorted({package_of(m) for m in MODULES if m.count(".")}))
def test_a_package_imports_only_what_its_docstring_allows(package: str) -> None:
    """Every package's __init__ says what it may import; its modules import no more."""
    init = PRODUCT / package / "__init__.py"
    if not init.exists():  # a top-level module (cli)
        return
    said = ALLOWED.search(init.read_text(encoding="utf-8"))
    assert said, f"{package}/__init__.py does not say what it may import"
    allowed = (
        set() if "nothing" in said.group(1) else set(re.split(r"[,\s]+", said.group(1).strip()))
    )
    assert package_graph().get(package, set()) <= allowed


def oversized(path: Path, max_file_lines: int, max_class_lines: int) -> list[str]:
    """What of the file is over the caps: the file itself, or a class in it."""
    text = path.read_text(encoding="utf-8")
    lines = len(text.splitlines())
    found = [f"{lines} lines"] if lines > max_file_lines else []
    classes = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef)]
    for c in classes:
        if (n := (c.end_lineno or c.lineno) - c.lineno + 1) > max_class_lines:
            found.append(f"class {c.name}: {n} lines")
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_files_and_classes_stay_small(name: str) -> None:
    assert oversized(MODULES[name], MAX_FILE_LINES, MAX_CLASS_LINES) == []


def undocumented_classes(text: str) -> list[str]:
    """The public top-level classes of a module's source that have no docstring."""
    return [
        n.name
        for n in ast.parse(text).body
        if isinstance(n, ast.ClassDef) and not n.name.startswith("_") and not ast.get_docstring(n)
    ]


def test_every_public_class_says_what_it_is_for() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}: class {name}"
        for path in MODULES.values()
        if "_pb2" not in path.name
        for name in undocumented_classes(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "public classes without a docstring:\n" + "\n".join(offenders)


def test_the_docstring_check_sees_a_class_without_one() -> None:
    text = (
        'class Said:\n    """What it is."""\n\n'
        "class Unsaid:\n    x = 1\n\n"
        "class _Private:\n    pass\n\n"
        "def f() -> None:\n    class Inner:\n        pass\n"
    )
    assert undocumented_classes(text) == ["Unsaid"]


# -- the router's surface ------------------------------------------------------------------

PRIVATE = {n for n in dir(Router) if n.startswith("_") and not n.startswith("__")} | {
    n for n in Router.__slots__ if n.startswith("_")
}


# What names a router in our code: `router`, `self.router`, `routers[i]`, `r`, `rt`.
ROUTERISH = re.compile(r"(^|\.)(router|routers\[[^]]*\])$|^(r|rt|r\d)$")


def _outside_the_core() -> list[Path]:
    roots = [PRODUCT, ROOT / "loadgen", ROOT / "emulator", ROOT / "tests"]
    return [
        p
        for r in roots
        for p in sorted(r.rglob("*.py"))
        if PRODUCT / "core" not in p.parents and not p.name.endswith("_pb2.py")
    ]


def _router_reaches(tree: ast.AST) -> list[str]:
    """Attribute uses that reach into a router: its private names, and assignments into a
    backend's record read through `router.backends[...]`."""
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in PRIVATE
            and ROUTERISH.search(ast.unparse(node.value))
        ):
            found.append(f"{node.lineno}: .{node.attr}")
        if isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Subscript)
                    and isinstance(t.value.value, ast.Attribute)
                    and t.value.value.attr == "backends"
                ):
                    found.append(f"{node.lineno}: writes .backends[...].{t.attr}")
    return sorted(found)


def test_nothing_outside_the_core_reaches_into_the_router() -> None:
    assert {"_fleet", "_features", "_listeners"} <= PRIVATE
    offenders = {
        str(p.relative_to(ROOT)): hits
        for p in _outside_the_core()
        if (hits := _router_reaches(ast.parse(p.read_text(encoding="utf-8"))))
    }
    assert offenders == {}


def test_the_reach_check_sees_a_reach() -> None:
    tree = ast.parse("router._fleet.state\nrouter.backends['a'].suspect = True\nx._fleet\n")
    assert _router_reaches(tree) == ["1: ._fleet", "2: writes .backends[...].suspect"]


def test_a_router_takes_no_new_attributes_and_its_records_are_read_only() -> None:
    from ext_proc.config.load import config_from_dict
    from ext_proc.core.build import build_router

    cfg = config_from_dict({"backends": [{"id": "a", "address": "127.0.0.1:1"}]})
    router = build_router(cfg, lambda: 0.0, random.Random(0))
    with pytest.raises(AttributeError):
        router.state = None  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        router.backends["b"] = router.backends["a"]  # type: ignore[index]


def test_the_architecture_doc_shows_the_import_graph_of_the_code() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    shown = doc.split("<!-- import-graph -->\n")[1].split("<!-- /import-graph -->")[0]

    def short(m: str) -> str:
        return m.split(".")[1]

    edges: dict[str, set[str]] = {}
    for a, bs in import_graph().items():
        for b in bs:
            if short(a) != short(b):
                edges.setdefault(short(a), set()).add(short(b))
    expected = "".join(f"    {a:<10} -> {', '.join(sorted(edges[a]))}\n" for a in sorted(edges))
    assert shown == expected


# -- the harness -----------------------------------------------------------------------------

HARNESS = (ROOT / "emulator", ROOT / "loadgen")
HARNESS_MODULES = _modules(HARNESS)
MAX_HARNESS_FILE_LINES = 600
MAX_HARNESS_CLASS_LINES = 450
MAX_MODULES_IN_A_FOLDER = 15


def test_the_harness_import_graph_has_no_cycle() -> None:
    graph = import_graph(HARNESS_MODULES, ("emulator", "loadgen"))
    assert graph["loadgen.sim.simulate"] >= {"loadgen.traces.request", "loadgen.sim.world"}
    assert "emulator.engine.model.scheduler" in graph["loadgen.sim.world"]
    assert find_cycle(graph) == []


def test_no_harness_folder_holds_more_than_15_modules() -> None:
    folders = {p.parent for p in HARNESS_MODULES.values()}
    counts = {
        str(f.relative_to(ROOT)): sum(p.name != "__init__.py" for p in f.glob("*.py"))
        for f in folders
    }
    assert counts["loadgen/bench/live"] >= 10  # the count sees a room's modules
    assert {f: n for f, n in counts.items() if n > MAX_MODULES_IN_A_FOLDER} == {}


@pytest.mark.parametrize("name", sorted(HARNESS_MODULES))
def test_harness_files_and_classes_stay_under_their_caps(name: str) -> None:
    path = HARNESS_MODULES[name]
    assert oversized(path, MAX_HARNESS_FILE_LINES, MAX_HARNESS_CLASS_LINES) == []


def test_every_harness_package_says_what_it_is_for_and_imports_nothing() -> None:
    inits = sorted(p for p in HARNESS_MODULES.values() if p.name == "__init__.py")
    assert len(inits) >= 12
    trees = {str(p.relative_to(ROOT)): ast.parse(p.read_text(encoding="utf-8")) for p in inits}
    assert [name for name, tree in trees.items() if not ast.get_docstring(tree)] == []
    assert [
        name
        for name, tree in trees.items()
        if any(isinstance(n, ast.Import | ast.ImportFrom) for n in tree.body)
    ] == []
