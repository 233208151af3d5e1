"""Import layers: each part of raymesh imports only its own layer or the ones below it, and every
public package imports first, on its own, without a cycle and without starting Ray.

The layers, lowest first (a module may import its own layer and any lower one):

- base: plain data that every layer speaks and that imports nothing else of raymesh: a mesh
  coordinate (`_src.shape`: the backend addresses procs by `Point`), a failure record
  (`_src.errors`: the backend returns `RemoteFailure` from a proc), the version string.
- backend (`raymesh._src.backend`): the one package that imports Ray for the runtime.
- core (the rest of `raymesh._src`, `raymesh.actor`, `raymesh.cluster`, `raymesh.rdma`,
  `raymesh.debug`, `raymesh/__init__.py`): the programming model. It reaches the backend's
  procs, and the backend runs the core's `ProcRuntime` only as a function handed down to it
  (`create_procs(start_runtime=...)`), never by importing it. `raymesh.actor`,
  `raymesh.cluster`, `raymesh.rdma` and `raymesh.debug` are its public faces.
- common (`raymesh._common`): what several subsystems share (field checks, job-file tables,
  "module:function", the HTTP server thread, bearer auth, the error shape, a future adapter).
  It may import the core at most.
- topology (`raymesh.topology`): plans where ranks run; the core reads a plan through protocols.
- data (`raymesh.data`): preprocessing pipelines, on the core's meshes; the sample order.
- testing (`raymesh.testing`), just above train: the public front of fault injection, whose
  faults (plain data) and injector live in train (a `TrainConfig` carries faults, so training
  needs them, and testing is no production dependency of it); not common or topology.
- train (`raymesh.train`), tune (`raymesh.tune`: studies whose trials are training jobs),
  serve, federated, dashboard (`raymesh.dashboard`: reads the run folders the others write),
  examples (`raymesh.examples`), cli (`raymesh.cli`).

Every import counts: top-level, inside functions (lazy), under `if TYPE_CHECKING:` (a type
named across layers is a dependency all the same), relative ones, and
`importlib.import_module("raymesh...")` with a literal name. Implicit imports of parent
packages are not counted: importing any `raymesh.*` module runs `raymesh/__init__.py`, which is
how Python packages work, not a choice of the importing module.

Four more rules, checked the same way:
- Ray is imported only by the backend (`raymesh/_src/backend/`) and by the adapters of Ray's
  libraries, which live with the subsystem that uses them (`raymesh/*/_ray_*.py`: Ray Serve in
  raymesh.serve, Ray Data in raymesh.data). `import ray`, `from ray...`, lazy imports and
  `import_module("ray...")` all count.
- Above the core nothing imports `raymesh._src`: the core's public faces are `raymesh`,
  `raymesh.actor`, `raymesh.cluster`, `raymesh.rdma` and `raymesh.debug`.
- Above the core, a package imports another package by its exported names (its `__init__`),
  not by a module of its own: a module of another package is imported only where
  `PUBLIC_MODULES` names it a public module, or `PRIVATE_IMPORTS` gives the reason.
- No import cycle among the modules of `raymesh._src`, `raymesh._src.backend` or
  `raymesh.train`, lazy imports included (`TYPE_CHECKING` ones are not: the cycle test says
  why).
"""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "raymesh"

ORDER = (
    "base",
    "backend",
    "core",
    "common",
    "topology",
    "spmd",
    "data",
    "train",
    "testing",
    "rl",
    "tune",
    "serve",
    "federated",
    "dashboard",
    "examples",
    "cli",
)

# Module (or package, with everything under it) -> layer; the longest match wins. "raymesh"
# itself matches only the package's __init__, so a new top-level module must be placed here.
LAYERS = {
    # Below the backend, which speaks them: it addresses a proc by a shape `Point` and returns
    # an endpoint's `RemoteFailure`. Plain data with no Ray, importing nothing else of raymesh.
    "raymesh._version": "base",
    "raymesh._src.errors": "base",
    "raymesh._src.shape": "base",
    "raymesh._src.backend": "backend",
    "raymesh._src": "core",
    "raymesh.actor": "core",
    "raymesh.cluster": "core",
    "raymesh.rdma": "core",
    "raymesh.debug": "core",
    "raymesh": "core",
    "raymesh._common": "common",
    "raymesh.topology": "topology",
    "raymesh.spmd": "spmd",
    "raymesh.testing": "testing",
    "raymesh.data": "data",
    "raymesh.train": "train",
    "raymesh.rl": "rl",
    "raymesh.tune": "tune",
    "raymesh.serve": "serve",
    "raymesh.federated": "federated",
    "raymesh.dashboard": "dashboard",
    "raymesh.examples": "examples",
    "raymesh.cli": "cli",
}

# Lower layers a layer may still not import.
FORBIDDEN = {"testing": {"common", "topology"}}

# Violations known today, (importer module, imported module) -> why it is tolerated and who
# removes it. Each entry must still occur (a fixed one fails the test until it is taken out).
# None today. (raymesh.train used to reach into `procs._state`: private access, which this test
# does not see; it uses `spawn_procs(escalate=False)` and `ProcMesh.failure` instead.)
KNOWN: dict[tuple[str, str], str] = {}

# The public packages, each imported first in a fresh interpreter. raymesh.cli.main is the
# console script's entry point.
PUBLIC = (
    "raymesh",
    "raymesh.actor",
    "raymesh.cluster",
    "raymesh.rdma",
    "raymesh.debug",
    "raymesh._common",
    "raymesh.topology",
    "raymesh.spmd",
    "raymesh.testing",
    "raymesh.data",
    "raymesh.train",
    "raymesh.rl",
    "raymesh.tune",
    "raymesh.federated",
    "raymesh.dashboard",
    "raymesh.cli",
    "raymesh.cli.main",
)


@dataclass(frozen=True)
class Import:
    path: str  # relative to the repository root
    line: int
    importer: str
    imported: str
    names: tuple[str, ...] = ()  # `from imported import names` (names that are not modules)
    eager: bool = True  # it runs when `importer` is imported (not lazy, not TYPE_CHECKING)
    typing_only: bool = False  # under `if TYPE_CHECKING:`: it never runs

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> str | None:
    best = None
    for prefix in LAYERS:
        matches = module == prefix or (prefix != "raymesh" and module.startswith(prefix + "."))
        if matches and (best is None or len(prefix) > len(best)):
            best = prefix
    return LAYERS[best] if best is not None else None


def imports_of(source: str, importer: str, is_package: bool, modules: set[str]) -> list[Import]:
    """Every raymesh module that `source` (module `importer`) imports, wherever the import is."""
    package = importer if is_package else importer.rpartition(".")[0]
    tree = ast.parse(source)
    eager = _run_at_import(tree)
    never = _typing_only(tree)
    found: dict[tuple[int, str], tuple[set[str], bool, bool]] = {}

    def add(node: ast.stmt | ast.expr, name: str, names: tuple[str, ...] = ()) -> None:
        seen, was_eager, _ = found.get((node.lineno, name), (set(), False, False))
        runs = was_eager or id(node) in eager
        found[(node.lineno, name)] = (seen | set(names), runs, id(node) in never)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                # `from raymesh import train` imports the module raymesh.train
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    add(node, sub)
                else:
                    add(node, base, (alias.name,))
        elif isinstance(node, ast.Call) and _is_import_call(node.func) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                add(node, arg.value)
    return [
        Import("", line, importer, name, tuple(sorted(names)), runs, typing)
        for (line, name), (names, runs, typing) in sorted(found.items())
        if name == "raymesh" or name.startswith("raymesh.")
    ]


def _run_at_import(tree: ast.Module) -> set[int]:
    """The ids of the nodes of `tree` that run when its module is imported: all but those in a
    function's body (lazy) and under `if TYPE_CHECKING:` (never run; its `else:` does)."""
    out: set[int] = set()

    def take(node: ast.AST) -> None:
        out.add(id(node))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for branch in child.orelse:
                    take(branch)
                continue
            take(child)

    take(tree)
    return out


def _typing_only(tree: ast.Module) -> set[int]:
    """The ids of the nodes of `tree` under an `if TYPE_CHECKING:` (not its `else:`)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for branch in node.body:
                out |= {id(n) for n in ast.walk(branch)}
    return out


def _is_type_checking(test: ast.expr) -> bool:
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def _is_import_call(func: ast.expr) -> bool:
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in ("import_module", "__import__")


def all_imports() -> list[Import]:
    modules = all_modules()
    names = set(modules)
    out = []
    for importer, path in modules.items():
        rel = str(path.relative_to(ROOT))
        for imp in imports_of(path.read_text(), importer, path.name == "__init__.py", names):
            out.append(dataclasses.replace(imp, path=rel))
    return out


def violation(imp: Import) -> str | None:
    """Why `imp` breaks the layers, or None."""
    src, dst = layer_of(imp.importer), layer_of(imp.imported)
    if src is None or dst is None:
        return None  # reported by test_every_module_belongs_to_a_layer
    if ORDER.index(dst) > ORDER.index(src):
        return f"{src} imports {dst}, a layer above it"
    if dst in FORBIDDEN.get(src, ()):
        return f"{src} may not import {dst}"
    return None


def test_every_module_belongs_to_a_layer():
    unplaced = [m for m in all_modules() if layer_of(m) is None]
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"


def test_each_layer_imports_only_its_own_layer_and_lower_ones():
    found: dict[tuple[str, str], list[str]] = {}
    report = []
    for imp in all_imports():
        why = violation(imp)
        if why is None:
            continue
        found.setdefault((imp.importer, imp.imported), []).append(imp.where())
        if (imp.importer, imp.imported) not in KNOWN:
            report.append(f"{imp.where()}: {imp.importer} -> {imp.imported}: {why}")
    stale = [f"{a} -> {b}" for a, b in KNOWN if (a, b) not in found]
    assert not report, "imports that break the layers:\n" + "\n".join(report)
    assert not stale, "fixed, remove from KNOWN: " + ", ".join(stale)


def test_the_check_sees_lazy_type_checking_relative_and_dynamic_imports():
    source = """
from typing import TYPE_CHECKING
from raymesh import train
from . import channel
if TYPE_CHECKING:
    from raymesh.topology.planner import Placement
def later():
    import raymesh.cli.main
    importlib.import_module("raymesh.examples.mlp")
"""
    modules = {"raymesh.train", "raymesh._src.backend.channel", "raymesh.cli.main"}
    got = imports_of(source, "raymesh._src.backend.procs", False, modules)
    assert [(i.line, i.imported) for i in got] == [
        (3, "raymesh.train"),
        (4, "raymesh._src.backend.channel"),
        (6, "raymesh.topology.planner"),
        (8, "raymesh.cli.main"),
        (9, "raymesh.examples.mlp"),
    ]
    assert [violation(i) is not None for i in got] == [True, False, True, True, True]


def above_the_core(module: str) -> bool:
    layer = layer_of(module)
    return layer is not None and ORDER.index(layer) > ORDER.index("core")


def test_nothing_above_the_core_imports_raymesh_src():
    report = [
        f"{imp.where()}: {imp.importer} -> {imp.imported}"
        for imp in all_imports()
        if above_the_core(imp.importer)
        and (imp.imported == "raymesh._src" or imp.imported.startswith("raymesh._src."))
    ]
    assert not report, (
        "imports of the core's private modules from above it (use raymesh, raymesh.actor or "
        "raymesh.cluster; add what is missing there):\n" + "\n".join(report)
    )


# --- Ray: imported by the backend and by the adapters of Ray's libraries only ---------------


def ray_imports(source: str) -> list[int]:
    """The lines of `source` that import Ray or one of its libraries, wherever they are."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and _is_import_call(node.func) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names = [arg.value]
        if any(name == "ray" or name.startswith("ray.") for name in names):
            lines.add(node.lineno)
    return sorted(lines)


def may_import_ray(path: Path) -> bool:
    """The backend (`raymesh/_src/backend/`), and `raymesh/<subsystem>/_ray_<library>.py`."""
    parts = path.relative_to(PACKAGE).parts
    return parts[:2] == ("_src", "backend") or (len(parts) == 2 and parts[1].startswith("_ray_"))


def test_only_the_backend_and_the_adapters_of_rays_libraries_import_ray():
    report = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if not may_import_ray(path)
        for line in ray_imports(path.read_text())
    ]
    assert not report, (
        "Ray imported outside raymesh/_src/backend and raymesh/*/_ray_*.py (use the backend "
        "through raymesh.cluster, or move a Ray library's adapter to its user):\n"
        + "\n".join(report)
    )


def test_the_ray_check_sees_plain_from_lazy_and_dynamic_imports_of_ray():
    source = """
import ray
from ray import serve
import raymesh
from ray.data import Dataset
import rayon, os
def later():
    import os, ray.util
    importlib.import_module("ray.data")
from . import ray
__import__("ray")
"""
    assert ray_imports(source) == [2, 3, 5, 8, 9, 11]
    assert may_import_ray(PACKAGE / "_src" / "backend" / "procs.py")
    assert may_import_ray(PACKAGE / "serve" / "_ray_serve.py")
    assert not may_import_ray(PACKAGE / "_src" / "proc.py")
    assert not may_import_ray(PACKAGE / "serve" / "app.py")
    assert not may_import_ray(PACKAGE / "serve" / "sub" / "_ray_x.py")


# --- Exported names between packages ---------------------------------------------------------

# Modules of a package that are public in their own right (documented by their path), which
# other packages may import like an `__init__`.
PUBLIC_MODULES = {
    "raymesh.train.checkpoint": "docs/training.md and docs/serve.md document "
    "raymesh.train.checkpoint (export_state_dict, the layout); raymesh.serve loads with it",
    "raymesh.train.export": "docs/training.md documents raymesh.train.export (rebuild, "
    "export_hf); raymesh.serve rebuilds a checkpoint's model with it, as an export does",
    "raymesh.train.hf": "docs/training.md documents raymesh.train.hf (the build function "
    "job files name, generate); raymesh.serve loads an hf folder with it, and raymesh.train "
    "does not export it (it needs transformers, which raymesh.train does not)",
}

# A package reaching into another's private module, (importer, imported) -> why. Each entry
# must still occur (a fixed one fails the test until it is taken out).
_FEED = (
    "the trainer's side of a pipeline (the rank's feed, the sample order, the batch reader): "
    "raymesh.train's ranks are the data pipeline's consumers, not users of its API"
)
_FRONT = (
    "raymesh.testing is the public front of fault injection, whose faults and injector live "
    "in train (a TrainConfig carries faults); train does not export them itself"
)
PRIVATE_IMPORTS: dict[tuple[str, str], str] = {
    (
        "raymesh.cli.federated",
        "raymesh.federated.edge.device",
    ): "the edge client is a script of its "
    "own, copied to devices that have no raymesh; `raymesh federated client` runs it",
    ("raymesh.train.control.balance", "raymesh.data.order"): _FEED,
    ("raymesh.train.control.controller", "raymesh.data.workers"): _FEED,
    ("raymesh.train.control.reporter", "raymesh.data.workers"): _FEED,
    ("raymesh.train.rank.batches", "raymesh.data.order"): _FEED,
    ("raymesh.train.rank.batches", "raymesh.data.feed"): _FEED,
    ("raymesh.train.rank.worker", "raymesh.data.feed"): _FEED,
    ("raymesh.train.rank.worker", "raymesh.data.sources"): _FEED,
    ("raymesh.testing", "raymesh.train.faults"): _FRONT,
    ("raymesh.testing", "raymesh.train.injector"): _FRONT,
}


def package_of(module: str) -> str:
    """`raymesh.serve.http.front` -> `raymesh.serve`; `raymesh.actor` -> itself."""
    return ".".join(module.split(".")[:2])


def reaches_into(imp: Import) -> bool:
    """Whether `imp` takes a module of another package that the package does not export."""
    there = package_of(imp.imported)
    return (
        above_the_core(imp.importer)
        and package_of(imp.importer) != there
        and imp.imported != there
        and imp.imported not in PUBLIC_MODULES
        and not imp.imported.startswith("raymesh._src")  # test_nothing_above_the_core_...
    )


def test_packages_import_each_other_by_their_exported_names():
    found: set[tuple[str, str]] = set()
    report = []
    for imp in all_imports():
        if not reaches_into(imp):
            continue
        found.add((imp.importer, imp.imported))
        if (imp.importer, imp.imported) not in PRIVATE_IMPORTS:
            report.append(f"{imp.where()}: {imp.importer} -> {imp.imported}")
    stale = [f"{a} -> {b}" for a, b in PRIVATE_IMPORTS if (a, b) not in found]
    assert not report, (
        "imports of another package's unexported module (export the name from its "
        "__init__, move it to raymesh._common, or give the reason in PRIVATE_IMPORTS):\n"
        + "\n".join(report)
    )
    assert not stale, "fixed, remove from PRIVATE_IMPORTS: " + ", ".join(stale)


def test_the_export_check_allows_a_packages_front_and_its_own_modules():
    def imp(importer: str, imported: str) -> Import:
        return Import("", 1, importer, imported)

    assert reaches_into(imp("raymesh.serve.model", "raymesh.train.config"))
    assert not reaches_into(imp("raymesh.serve.model", "raymesh.train"))
    assert not reaches_into(imp("raymesh.serve.model", "raymesh.serve.routing.router"))
    assert not reaches_into(imp("raymesh.serve.model", "raymesh.actor"))
    assert not reaches_into(imp("raymesh.serve.model", "raymesh._common"))
    assert reaches_into(imp("raymesh.serve.model", "raymesh._common.tables"))
    assert not reaches_into(imp("raymesh.actor", "raymesh._src.proc_mesh"))  # the core's own


# --- No import cycle inside a package ---------------------------------------------------------

# Packages whose modules may not import each other in a cycle (each with its subpackages).
ACYCLIC = ("raymesh._src", "raymesh._src.backend", "raymesh.train")


def import_graph(package: str, imports: list[Import], packages: set[str]) -> dict[str, set[str]]:
    """module -> the modules it imports, among `package`'s (itself and its subpackages), by the
    imports that run (when it is imported, or lazily, when a function of it runs; not those
    under `if TYPE_CHECKING:`). `packages`: the modules that are packages (their `__init__`).
    A name taken from a package's `__init__` that re-exports it from a module is an edge to
    that module; any other name (or the package itself) is an edge to the `__init__`.
    """

    def inside(module: str) -> bool:
        return module == package or module.startswith(package + ".")

    # package -> {name: the module it re-exports the name from}
    reexports: dict[str, dict[str, str]] = {}
    for imp in imports:
        if imp.importer in packages and imp.eager:
            for name in imp.names:
                reexports.setdefault(imp.importer, {})[name] = imp.imported

    def targets(imported: str, names: tuple[str, ...], seen: frozenset[str]) -> set[str]:
        table = reexports.get(imported, {})
        if not names or imported in seen or any(n not in table for n in names):
            return {imported}
        out: set[str] = set()
        for name in names:  # a re-export of a re-export: followed to where the name lives
            out |= targets(table[name], (name,), seen | {imported})
        return out

    graph: dict[str, set[str]] = {}
    for imp in imports:
        if not inside(imp.importer):
            continue
        graph.setdefault(imp.importer, set())
        if imp.typing_only:
            continue
        for target in targets(imp.imported, imp.names, frozenset()):
            if inside(target) and target != imp.importer:
                graph[imp.importer].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (its modules in import order) for each strongly connected part of `graph`
    that has one."""
    order: list[str] = []  # Kosaraju: finishing order on the graph, then the reversed graph
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        done.add(start)
        stack = [(start, iter(sorted(graph.get(start, ()))))]
        while stack:
            node, rest = stack[-1]
            nxt = next((n for n in rest if n not in done), None)
            if nxt is None:
                stack.pop()
                order.append(node)
            else:
                done.add(nxt)
                stack.append((nxt, iter(sorted(graph.get(nxt, ())))))
    reverse: dict[str, set[str]] = {}
    for a, bs in graph.items():
        for b in bs:
            reverse.setdefault(b, set()).add(a)
    placed: set[str] = set()
    found = []
    for root in reversed(order):
        if root in placed:
            continue
        part, todo = {root}, [root]
        while todo:
            for prev in reverse.get(todo.pop(), ()):
                if prev not in placed and prev not in part:
                    part.add(prev)
                    todo.append(prev)
        placed |= part
        if len(part) > 1:
            found.append(_path_back(min(part), part, graph))
    return found


def _path_back(start: str, part: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest way from `start` back to itself within `part` (breadth first)."""
    came: dict[str, str] = {}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(came[path[-1]])
                return path[::-1]
            if nxt in part and nxt not in came:
                came[nxt] = node
                todo.append(nxt)
    raise AssertionError(f"{start} is on no cycle")


def test_no_import_cycle_inside_the_core_the_backend_or_train():
    """No cycle among the modules of `raymesh._src`, `raymesh._src.backend` or `raymesh.train`
    (each with its subpackages, such as `raymesh.train.checkpoint`).

    Counted: every import that runs, when its module is imported (at module level, in a class
    body, under a module-level `if` or `try`) or lazily, inside a function. An eager cycle
    breaks at import: whichever module of it is imported first hands the next one itself half
    made, and whether that fails depends on which is imported first (what Ray's
    tests/test_circular_imports.py catches). A lazy import only hides the same knot until run
    time: neither module can be read, tested or moved without the other. The fix is the same
    for both: move what both sides need to a module of its own, or have the module above pass
    it down or register it (`runtime.on_connect`, `context.provide_this_proc`).
    Not counted: `if TYPE_CHECKING:` imports, which never run and only name a type for the
    checker (the layer test above counts them).

    A name imported from a package's `__init__` that re-exports it counts as an import of the
    module it comes from: a package's `__init__` runs before any of its modules anyway (Python
    imports parents first, which the layer test does not count either), so a cycle through an
    `__init__` is real only when the module behind the re-export closes it.
    """
    imports = all_imports()
    packages = {m for m, path in all_modules().items() if path.name == "__init__.py"}
    report = [
        f"{package}: " + " -> ".join([*cycle, cycle[0]])
        for package in ACYCLIC
        for cycle in cycles(import_graph(package, imports, packages))
    ]
    assert not report, (
        "import cycles (move what both sides need to a module of its own, or pass it in):\n"
        + "\n".join(report)
    )


def test_the_cycle_check_sees_cycles_through_imports_that_run_lazy_ones_and_real_re_exports():
    sources = {
        "raymesh.fake": "from .a import A\nfrom .b import B\nfrom .f import F\n",
        # A real cycle a -> b -> c -> a, the first edge through the package's re-export of B.
        "raymesh.fake.a": "from raymesh.fake import B\nclass A: ...\n",
        "raymesh.fake.b": "import raymesh.fake.c\nclass B: ...\n",
        "raymesh.fake.c": "class C:\n    from . import a\n",
        # d -> e by a lazy import, e -> d by a type-only one: no cycle.
        "raymesh.fake.d": "def later():\n    from raymesh.fake import e\n",
        "raymesh.fake.e": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\n"
            "else:\n    from raymesh import other\n"
        ),
        # f takes A from the package, which imports f: through the re-export, f -> a only.
        "raymesh.fake.f": "from raymesh.fake import A\nF = A\n",
        # g <-> h by two lazy imports: a cycle all the same.
        "raymesh.fake.g": "def later():\n    from raymesh.fake.h import H\n",
        "raymesh.fake.h": "class H:\n    def later(self):\n        from . import g\n",
    }
    modules = set(sources) | {"raymesh.other"}
    imports = [
        imp
        for name, source in sources.items()
        for imp in imports_of(source, name, name == "raymesh.fake", modules)
    ]
    graph = import_graph("raymesh.fake", imports, {"raymesh.fake"})
    assert graph["raymesh.fake.a"] == {"raymesh.fake.b"}
    assert graph["raymesh.fake.d"] == {"raymesh.fake.e"} and graph["raymesh.fake.e"] == set()
    assert graph["raymesh.fake.f"] == {"raymesh.fake.a"}
    assert sorted(cycles(graph)) == [
        ["raymesh.fake.a", "raymesh.fake.b", "raymesh.fake.c"],
        ["raymesh.fake.g", "raymesh.fake.h"],
    ]
    # The same imports, all made type-only: no cycle.
    typing = [dataclasses.replace(i, eager=False, typing_only=True) for i in imports]
    assert cycles(import_graph("raymesh.fake", typing, {"raymesh.fake"})) == []
    # Without following the re-export, f -> fake -> f would be one: a cycle only on paper.
    assert cycles({"f": {"fake"}, "fake": {"f"}}) == [["f", "fake"]]


# Imports `sys.argv[1]` as the first thing; fails if that started Ray.
_IMPORT_FIRST = """
import importlib, sys
importlib.import_module(sys.argv[1])
ray = sys.modules.get("ray")
if ray is not None and ray.is_initialized():
    sys.exit(f"importing {sys.argv[1]} started Ray")
"""


@pytest.mark.timeout(180)
def test_each_public_package_imports_first_in_a_fresh_interpreter_without_starting_ray():
    # Like Ray's tests/test_circular_imports.py: a cycle shows only when its module is the first
    # one imported, so each package gets an interpreter of its own (all at once).
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    runs = {
        name: subprocess.Popen(
            [sys.executable, "-c", _IMPORT_FIRST, name],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in PUBLIC
    }
    deadline = time.monotonic() + 150
    failures = []
    for name, proc in runs.items():
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            failures.append(f"import {name}: still running after 150s\n{out[-2000:]}")
            continue
        if proc.returncode != 0:
            failures.append(f"import {name}: exit code {proc.returncode}\n{out[-2000:]}")
    assert not failures, "\n\n".join(failures)
