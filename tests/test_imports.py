"""The package's import rules, checked by reading its source with `ast` (nothing here imports it).

- Layers: `LAYERS` places every module of the package in exactly one layer, from the bottom (the core data
  model) to the top (cli/, bench/, testing/, the demos and the package's own `__init__`). A module imports
  modules of its own layer or below, never above; a module that `LAYERS` does not place fails, so a new
  module must be given its layer. `dejavu_sdk.engine` reaches nothing under `dejavu_sdk.serving`.
- Backends depend on the core data model only: a module under stores/ or transports/ may import its own subpackage
  and `CORE`, nothing else of ours (not the engine, the cache, the CLI, the benchmarks, the registry...).
- stores/ never imports transports/: a remote store is a Store over a record interface that a transport implements,
  so transports depend on that interface and no store depends on a transport.
- No import circles at all, lazy and type-only ones included: an import inside a function closes a circle as
  surely as one at the top, it only waits longer to fail, and a type-only one ties the two modules together
  as much (neither can be read, checked or moved without the other).
- No package reaches into another package's private names, neither by importing `_name` nor by `obj._name`.

Every import counts, at any depth (module top, function bodies, `if TYPE_CHECKING:` blocks, whose edges are
marked type-only and count for the layers and for circles alike), and so does a backend registered lazily as a
string ("dejavu_sdk.stores.memory:MemoryStore"): it is imported the first time someone asks for it. A module run
in a subprocess (`python -m dejavu_sdk.x`) is not imported, and neither is a name built at run time (f-strings,
or the package `__init__`'s lazy `_LAZY` names, which are relative names given to `importlib`): the package itself
sits at the top, since those lazy names reach the engine, serving and the controller.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import deque
from collections.abc import Collection
from functools import cache
from itertools import pairwise
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "dejavu_sdk"
# The layers, from the bottom. Each name covers that module of the package and every module under it that no longer
# name covers ("serving" is the Pipeline facade: serving/'s own modules that no sub-package name covers); "" is the
# package's own `__init__` alone. docs/architecture.md draws the same layers.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core data model", ("errors", "blocks", "urls", "codec", "tensors", "records", "store", "_version")),
    ("backends", ("stores", "transports")),
    ("choosing by URL", ("registry", "backends")),
    ("streaming the KV", ("stream", "cache", "manifest", "replica")),
    ("models and planning", ("models", "timing", "planner", "profiles", "simulator", "sweep", "traces", "data",
                             "report", "swapping", "swapped_caches")),
    ("prefix cache", ("prefix",)),
    ("generation", ("generation",)),
    ("engine", ("engine",)),
    ("serving: KV replicas", ("serving.kv",)),
    ("serving: wire", ("serving.wire",)),
    ("serving: stage workers", ("serving.worker",)),
    ("serving: worker processes", ("serving.processes",)),
    ("serving: layout and options", ("serving.layout", "serving.option_groups", "serving.defaults", "serving.options")),
    ("serving: head", ("serving.head",)),
    ("serving: Pipeline", ("serving",)),
    ("controller", ("controller",)),
    ("cluster", ("cluster",)),
    ("top", ("cli", "bench", "testing", "demo", "demo_cluster", "")),
]
BACKENDS = tuple(f"{PACKAGE}.{name}" for name in LAYERS[1][1])
CORE = frozenset(f"{PACKAGE}.{name}" for name in LAYERS[0][1])
PUBLIC_UNDERSCORED = frozenset({"dejavu_sdk._version"})  # a module named with an underscore, public all the same
MODULE_STRING = re.compile(r"(dejavu_sdk(?:\.\w+)+)(?::\w+)?")


class Edge(NamedTuple):
    source: str
    target: str
    path: Path
    line: int
    type_only: bool = False
    name: str = ""  # for `from X import name`: the name imported

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def package_dirs(root: Path) -> dict[str, Path]:
    """Our packages and subpackages mapped to their directories, as pyproject's package-dir says."""
    text = (root / "pyproject.toml").read_text(encoding="utf-8")
    if sys.version_info >= (3, 11):
        import tomllib

        table = tomllib.loads(text)["tool"]["setuptools"].get("package-dir", {})
    else:  # no tomllib: read the one flat table by hand
        section = text.split("[tool.setuptools.package-dir]", 1)[-1].split("\n[", 1)[0]
        table = dict(re.findall(r'^"([\w.]+)"\s*=\s*"([^"]+)"', section, re.MULTILINE))
    ours = {name: root / folder for name, folder in table.items() if name.split(".")[0] == PACKAGE}
    return {PACKAGE: root / PACKAGE, **ours}


def module_files(root: Path) -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, folder in package_dirs(root).items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if all(part.isidentifier() for part in parts):
                modules[".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return modules


@cache
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def package_of(module: str, path: Path) -> str:
    """The package whose namespace the module's code lives in: a package's `__init__` is its package itself."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imports_of(module: str, path: Path, known: Collection[str]) -> list[Edge]:
    """Every edge from `module` to another of the `known` modules, lazy, type-only and registry strings included."""
    tree, edges = parse(path), []
    after_dash_m = {id(b) for n in ast.walk(tree) if isinstance(n, (ast.List, ast.Tuple))
                    for a, b in pairwise(n.elts) if isinstance(a, ast.Constant) and a.value == "-m"}

    def add(target: str, line: int, type_only: bool, name: str = "") -> None:
        if target in known and target != module:
            edges.append(Edge(module, target, path, line, type_only, name))
            parents = (target.rsplit(".", n)[0] for n in range(1, target.count(".") + 1))
            edges.extend(Edge(module, parent, path, line, type_only)  # Python runs the package's __init__ first
                         for parent in parents if parent in known and not under(module, parent))

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno, type_only)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package_of(module, path).split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in known else base, node.lineno, type_only, alias.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in after_dash_m:
            if match := MODULE_STRING.fullmatch(node.value):  # a lazy registration; `python -m x` is not an import
                add(match[1], node.lineno, type_only)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in {getattr(node.test, "id", ""),
                                                               getattr(node.test, "attr", "")}:
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
        elif not isinstance(node, ast.JoinedStr):  # f"dejavu_sdk.{x}" names no module we can know
            for child in ast.iter_child_nodes(node):
                visit(child, type_only)

    visit(tree, False)
    return edges


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def shortest_cycle(graph: dict[str, set[str]], start: str) -> list[str]:
    """The shortest path from `start` back to itself, by breadth-first search."""
    queue, seen = deque([[start]]), {start}
    while queue:
        path = queue.popleft()
        for other in sorted(graph.get(path[-1], ())):
            if other == start:
                return [*path, start]
            if other not in seen:
                seen.add(other)
                queue.append([*path, other])
    return []


def graph_of(edges: list[Edge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
    return graph


@cache
def project() -> tuple[dict[str, Path], list[Edge]]:
    modules = module_files(ROOT)
    return modules, [edge for module, path in modules.items() for edge in imports_of(module, path, modules)]


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def representative_edges(edges: list[Edge]) -> dict[tuple[str, str], Edge]:
    """One edge per pair of modules, to name in a report: the first that runs, else the first type-only one."""
    chosen: dict[tuple[str, str], Edge] = {}
    for edge in edges:
        known = chosen.get((edge.source, edge.target))
        if known is None or (known.type_only and not edge.type_only):
            chosen[edge.source, edge.target] = edge
    return chosen


def describe(edge: Edge) -> str:
    return f"{edge.where()}{', type-only' if edge.type_only else ''}"


def test_no_import_cycles() -> None:
    edges = project()[1]
    graph, first = graph_of(edges), representative_edges(edges)
    report = []
    for component in find_cycles(graph):
        cycle = shortest_cycle({m: graph[m] & set(component) for m in component}, component[0])
        steps = [f"{a} ({describe(first[a, b])}) -> {b}" for a, b in pairwise(cycle)]
        report.append(f"{' <-> '.join(component)}\n    e.g. " + "\n         ".join(steps))
    assert not report, "import circles (lazy, type-only and registry-string imports included):\n  " + "\n  ".join(
        report)


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> list[int]:
    """The indices of every layer whose name covers `module` most closely (exactly one, for a module placed right):
    the longest names that are the module or a package above it."""
    found: list[tuple[int, int]] = []  # (length of the name, layer)
    for index, (_, names) in enumerate(layers):
        for name in names:
            full = f"{PACKAGE}.{name}" if name else PACKAGE
            if module == full or (name and module.startswith(full + ".")):
                found.append((len(full), index))
    closest = max((length for length, _ in found), default=0)
    return [index for length, index in found if length == closest]


def layer_violations(modules: Collection[str], edges: list[Edge],
                     layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> list[str]:
    """Modules placed in no layer or in several, names that place nothing, and imports that go up."""
    report = []
    placed = {module: layer_of(module, layers) for module in sorted(modules)}
    report.extend(f"{module} is in no layer of LAYERS: give it one" for module, found in placed.items() if not found)
    report.extend(f"{module} is in several layers: " + ", ".join(layers[i][0] for i in found)
                  for module, found in placed.items() if len(found) > 1)
    for name, names in layers:
        for short in names:
            full = f"{PACKAGE}.{short}" if short else PACKAGE
            if not any(module == full or (short and module.startswith(full + ".")) for module in modules):
                report.append(f"LAYERS names {full!r} (layer {name!r}), which is no module")
    for edge in representative_edges(edges).values():
        source, target = placed.get(edge.source, []), placed.get(edge.target, [])
        if len(source) == 1 and len(target) == 1 and target[0] > source[0]:
            report.append(f"{describe(edge)}: {edge.source} ({layers[source[0]][0]}) imports {edge.target} "
                          f"({layers[target[0]][0]}), a layer above")
    return report


def test_every_module_imports_only_its_own_layer_and_below() -> None:
    modules, edges = project()
    report = layer_violations(modules, edges)
    assert not report, "layers (bottom to top: " + " < ".join(name for name, _ in LAYERS) + "):\n  " + "\n  ".join(
        report)


def test_the_engine_reaches_no_serving_code() -> None:
    """Loading the one-process engine loads nothing of serving/, not even through the modules it imports."""
    graph = graph_of(project()[1])
    came_from: dict[str, str] = {"dejavu_sdk.engine": ""}
    queue = deque(["dejavu_sdk.engine"])
    while queue:
        module = queue.popleft()
        for other in sorted(graph.get(module, ())):
            if other not in came_from:
                came_from[other] = module
                queue.append(other)
    reached = sorted(module for module in came_from if under(module, "dejavu_sdk.serving"))
    paths = []
    for module in reached:
        path = [module]
        while came_from[path[-1]]:
            path.append(came_from[path[-1]])
        paths.append(" -> ".join(reversed(path)))
    assert not paths, "dejavu_sdk.engine reaches serving/:\n  " + "\n  ".join(paths)


def test_stores_never_import_transports() -> None:
    offenders = [f"{e.where()}: {e.source} imports {e.target}" for e in project()[1]
                 if under(e.source, "dejavu_sdk.stores") and under(e.target, "dejavu_sdk.transports")]
    assert not offenders, "stores/ must not import transports/:\n  " + "\n  ".join(dict.fromkeys(offenders))


def test_backends_depend_only_on_the_core() -> None:
    offenders = [f"{e.where()}: {e.source} imports {e.target}" for e in project()[1]
                 for own in BACKENDS if under(e.source, own) and not under(e.target, own) and e.target not in CORE]
    assert not offenders, f"backends may import only their own subpackage and {sorted(CORE)}:\n  " + "\n  ".join(
        dict.fromkeys(offenders))


def test_nothing_reaches_into_another_package_private_names() -> None:
    modules, edges = project()
    offenders: list[tuple[Path, int, str]] = []
    for e in edges:  # from X import _name, X in another package
        origin = e.target.rpartition(".")[0] if e.target.endswith("." + e.name) else e.target
        if (is_private(e.name) and f"{origin}.{e.name}" not in PUBLIC_UNDERSCORED and origin in modules
                and package_of(origin, modules[origin]) != package_of(e.source, modules[e.source])):
            offenders.append((e.path, e.line, f"{e.source} imports {e.name} from {origin}"))
    defined: dict[str, set[str]] = {}
    for module, path in modules.items():
        defined.setdefault(package_of(module, path), set()).update(private_definitions(parse(path)))
    for module, path in modules.items():  # obj._name, _name defined only in other packages
        package = package_of(module, path)
        foreign = set().union(*(names for other, names in defined.items() if other != package)) - defined[package]
        offenders.extend((path, node.lineno, f"{module} uses {ast.unparse(node)}, private to "
                          + ", ".join(sorted(other for other, names in defined.items() if node.attr in names)))
                         for node in ast.walk(parse(path))
                         if isinstance(node, ast.Attribute) and node.attr in foreign and not is_self(node.value))
    lines = dict.fromkeys(f"{path.relative_to(ROOT)}:{line}: {text}" for path, line, text in sorted(offenders))
    assert not lines, "private names used across packages:\n  " + "\n  ".join(lines)


def is_self(node: ast.expr) -> bool:
    if isinstance(node, ast.Call):  # super() and type(self)
        return isinstance(node.func, ast.Name) and node.func.id in {"super", "type"} and all(map(is_self, node.args))
    return isinstance(node, ast.Name) and node.id in {"self", "cls"}


def private_definitions(tree: ast.Module) -> set[str]:
    """The underscored names a module defines: functions, classes, self._name = ..., module and class variables."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, (ast.Module, ast.ClassDef)):
            for statement in node.body:
                targets = statement.targets if isinstance(statement, ast.Assign) else [getattr(statement, "target", 0)]
                names.update(target.id for target in targets if isinstance(target, ast.Name))
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and is_self(node.value):
            names.add(node.attr)
    return {name for name in names if is_private(name)}


def test_the_walk_sees_lazy_imports(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"dejavu_sdk.stores" = "stores"\n')
    for name, text in {
        "dejavu_sdk/__init__.py": '_LAZY = {"B": "b"}\n',  # a relative name for importlib: no edge
        "dejavu_sdk/a.py": "def f():\n    from . import b\n",
        "dejavu_sdk/b.py": "def g():\n    import dejavu_sdk.a\n",
        "dejavu_sdk/c.py": "from .typed import T\n",
        "dejavu_sdk/typed.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n"
                                "else:\n    from .a import f\n"),
        "stores/__init__.py": 'BACKENDS = {"m": "dejavu_sdk.stores.memory:MemoryStore"}\n',
        "stores/memory.py": 'from .. import a\nRUN = ["python", "-m", "dejavu_sdk.b"]  # a subprocess\n',
    }.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = module_files(tmp_path)
    assert sorted(modules) == ["dejavu_sdk", "dejavu_sdk.a", "dejavu_sdk.b", "dejavu_sdk.c", "dejavu_sdk.stores",
                               "dejavu_sdk.stores.memory", "dejavu_sdk.typed"]
    edges = {m: imports_of(m, path, modules) for m, path in modules.items()}
    assert edges["dejavu_sdk"] == []
    assert [(e.target, e.line) for e in edges["dejavu_sdk.a"]] == [("dejavu_sdk.b", 2)]
    assert [(e.target, e.line) for e in edges["dejavu_sdk.stores"]] == [("dejavu_sdk.stores.memory", 1)]
    assert [e.target for e in edges["dejavu_sdk.stores.memory"]] == ["dejavu_sdk.a"]
    assert [(e.target, e.type_only) for e in edges["dejavu_sdk.typed"]] == [("dejavu_sdk.c", True),
                                                                            ("dejavu_sdk.a", False)]
    all_edges = [e for module_edges in edges.values() for e in module_edges]
    # a type-only edge is seen and marked, and it closes a circle as any other import does
    assert find_cycles(graph_of(all_edges)) == [["dejavu_sdk.a", "dejavu_sdk.b"], ["dejavu_sdk.c", "dejavu_sdk.typed"]]
    assert find_cycles(graph_of([e for e in all_edges if not e.type_only])) == [["dejavu_sdk.a", "dejavu_sdk.b"]]
    assert shortest_cycle(graph_of(all_edges), "dejavu_sdk.a") == ["dejavu_sdk.a", "dejavu_sdk.b", "dejavu_sdk.a"]
    assert shortest_cycle(graph_of(all_edges), "dejavu_sdk.c") == ["dejavu_sdk.c", "dejavu_sdk.typed", "dejavu_sdk.c"]
    assert representative_edges([*all_edges, *all_edges[::-1]])["dejavu_sdk.typed", "dejavu_sdk.a"].line == 5


def test_the_layer_check_finds_upward_unplaced_and_doubly_placed_modules_by_their_closest_name() -> None:
    layers = [("low", ("a", "stores")), ("high", ("b", "")), ("stale", ("gone",)), ("again", ("stores.memory",)),
              ("twice", ("stores.memory",))]
    modules = ["dejavu_sdk", "dejavu_sdk.a", "dejavu_sdk.b", "dejavu_sdk.new", "dejavu_sdk.stores",
               "dejavu_sdk.stores.memory"]
    path = ROOT / "x.py"  # where() names it relative to the repository
    edges = [Edge("dejavu_sdk.b", "dejavu_sdk.a", path, 1), Edge("dejavu_sdk.a", "dejavu_sdk.b", path, 2, True),
             Edge("dejavu_sdk.a", "dejavu_sdk", path, 3)]
    assert layer_of("dejavu_sdk.b.x", layers) == [1]
    assert layer_of("dejavu_sdk.bx", layers) == []
    assert layer_of("dejavu_sdk.stores.lmdb", layers) == [0]
    assert layer_of("dejavu_sdk.stores.memory.x", layers) == [3, 4]  # the longest name places it, not "stores"
    report = layer_violations(modules, edges, layers)
    assert report[:3] == ["dejavu_sdk.new is in no layer of LAYERS: give it one",
                          "dejavu_sdk.stores.memory is in several layers: again, twice",
                          "LAYERS names 'dejavu_sdk.gone' (layer 'stale'), which is no module"]
    assert [line.split(": ", 1)[1] for line in report[3:]] == [
        "dejavu_sdk.a (low) imports dejavu_sdk.b (high), a layer above",
        "dejavu_sdk.a (low) imports dejavu_sdk (high), a layer above"]
    assert report[3].startswith("x.py:2, type-only: ")
    assert report[4].startswith("x.py:3: ")


def test_serving_and_the_controller_are_small_modules_under_a_thin_facade() -> None:
    """No module of serving/ or controller/ is over 400 lines, and `Pipeline`'s module, a facade over the head's
    parts, is under 300: a module that grows past them is split by what its parts do."""
    sizes = {path.relative_to(ROOT): len(path.read_text().splitlines())
             for folder in ("serving", "controller") for path in (ROOT / PACKAGE / folder).rglob("*.py")}
    assert sizes, "no modules found"
    assert {path: size for path, size in sizes.items() if size > 400} == {}
    assert sizes[Path(PACKAGE, "serving", "pipeline.py")] < 300
