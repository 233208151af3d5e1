"""How many of Monarch's own public-API actor tests pass on raymesh, through a renames-only shim.

Run from the repository root, with the venv active:

    python bench/monarch_compat.py                    # the whole measurement (~15 min at most)
    python bench/monarch_compat.py --only cookbook    # a subset: regex on "test_file.py::test_name"
    python bench/monarch_compat.py --classify-only    # print the classification, run nothing

Other options: --timeout S (per-test floor, default 90; Monarch's own shorter timeout markers are
raised to it), --total S (wall limit for all the pytest runs, default 780), --json-out FILE,
--isolation inprocess|subprocess (default inprocess, see 4), --keep (keep the temp dir),
--monarch-git-dir DIR and --ref REF (default: the local mirror, HEAD).

What it does, all in a fresh temp dir (nothing of Monarch's is copied into this repo):
1. `git archive` Monarch's python/tests out of the mirror and reads Monarch's public API (the
   `__all__` of python/monarch/actor/__init__.py, with the module each name comes from).
2. Writes a shim package `monarch` whose `monarch.actor` is the module `raymesh.actor` plus the
   aliases in RENAMES (Monarch name -> raymesh name). Nothing else: a Monarch name raymesh lacks
   stays missing, and the tests that use it fail.
3. Classifies each test function by AST: the names it references, its decorators, the fixtures it
   takes, and (transitively) the module-level helpers, classes and strings those reference. A
   test is excluded when that closure touches anything but Monarch's public `monarch.actor` API:
   monarch._rust_bindings, monarch._src internals (an internal import path of a name that
   `monarch.actor` itself re-exports counts as public), a private attribute of a Monarch object
   (`obj._name` that the test module neither defines nor assigns, read from anything but a
   non-Monarch import), monarch.config/tools/job, local helper
   modules built on those (scoped_state, ProcessJob), `mock.patch("monarch._src...")` strings,
   HYPERACTOR_*/MONARCH_* config variables. Tests Monarch itself does not run in its OSS CI
   (`oss_skip`) or skips unconditionally (`pytest.mark.skip`) are excluded too.
4. Rewrites each test module in the temp dir: internal imports, excluded tests and the
   module-level statements only they need are dropped; public imports become one guarded import
   per name (so one missing name fails only the tests that use it); every other module-level
   statement and test is wrapped so that one that raises on raymesh (a missing name, a keyword
   raymesh's `endpoint` does not take) leaves its own names undefined, and is recorded as the
   root cause of the NameErrors it causes. `cast(T, v)` becomes `v`, and annotations naming a
   dropped internal become strings (typing only). Timeout markers below --timeout are raised to
   it (the machine is small and shared).
   Harness: Monarch's conftest.py (crash-recovery plugin, tensor-engine probes) is replaced by a
   recorder. `@isolate_in_subprocess` tests run in the pytest process by default (a fresh
   process starting its own Ray costs 30-60 s a test on 2 cores, too much for the budget);
   with --isolation subprocess, Monarch's harness is used, its two `monarch.config`
   runtime-config calls made no-ops and its child's process group killed on a timeout.
5. Runs pytest on the included tests (PYTHONPATH: shim first), with pytest-asyncio
   (asyncio_mode=auto, as Monarch's pyproject sets). If pytest-asyncio or cloudpickle (which
   Monarch's tests import) is not importable it is pip-installed into the temp dir (not into
   the venv). pytest-timeout uses the thread method
   (a test blocked in native code ignores SIGALRM), which ends the pytest process: the test is
   recorded as timed out and pytest starts again on the tests not yet run. Then every process
   left carrying this run's marker variable is killed by pid. Prints a JSON summary.

Counting: one test = one pytest item (a parametrized function counts once per parameter set).
A test is passed only if pytest reports it passed; skipped-at-run-time, failed, errored, timed
out, not collected or not reached within --total all count as not passed.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MIRROR = Path("/work/.mirror/meta-pytorch+monarch/repo")

# The test modules measured (under python/tests in Monarch's tree).
TEST_MODULES = [
    "test_python_actors",
    "test_actor_error",
    "test_supervision_hierarchy",
    "test_proc_mesh",
    "test_cookbook",
    "test_inter_mesh_ping_pong",
    "test_concurrent_endpoints",
    "test_actor_logging",
]

# Monarch public name -> raymesh public name, where the two differ. Renames only.
RENAMES = {
    "Context": "ActorContext",
}

# Local helper modules of Monarch's test dir that are test harness, not API under test.
HARNESS_MODULES = {"isolate_in_subprocess"}

# Tests that fail because raymesh differs from Monarch on purpose (docs/programming-model.md,
# "Differences from Monarch", says why). They still count as not passed; the summary lists
# them apart from the failures that are work left.
DIFFERS_ON_PURPOSE = {
    "test_proc_mesh.py::test_this_proc_in_controller_spawns_actor_in_client_os_process": (
        "controllers run on a proc of their own (any process of the job reaches them), not in "
        "the client's process"
    ),
    "test_proc_mesh.py::test_context_proc_mesh_in_controller_spawns_actor_in_client_os_process": (
        "controllers run on a proc of their own, not in the client's process"
    ),
    "test_python_actors.py::test_instance_name": (
        "records logged in the controller are not prefixed with [actor=<root>] (the script's "
        "logs stay as it wrote them)"
    ),
    "test_python_actors.py::test_run_forever_on_init": (
        "spawn returns once the constructors have returned (Monarch's returns at once)"
    ),
}

# Pytest's own fixtures (a test taking one of these is not taking a module fixture).
_ENV_VAR = re.compile(r"^(HYPERACTOR|MONARCH)_[A-Z0-9_]+$")
_MONARCH_PATH = re.compile(r"\bmonarch((?:\.\w+)+)")


# ------------------------------------------------------------------------------------------
# Monarch's tree


def git(git_dir: Path, *args: str) -> str:
    return subprocess.run(
        ["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True, text=True
    ).stdout


def extract_tests(git_dir: Path, ref: str, dest: Path) -> None:
    archive = subprocess.run(
        ["git", f"--git-dir={git_dir}", "archive", ref, "python/tests"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def monarch_public_api(git_dir: Path, ref: str) -> dict[str, tuple[str, str]]:
    """Public name -> (module it is imported from, its name there), from monarch.actor."""
    src = git(git_dir, "show", f"{ref}:python/monarch/actor/__init__.py")
    tree = ast.parse(src)
    imported: dict[str, tuple[str, str]] = {}
    exported: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                imported[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            exported = list(ast.literal_eval(node.value))
    return {name: imported.get(name, ("monarch.actor", name)) for name in exported}


# ------------------------------------------------------------------------------------------
# Classification


@dataclass(frozen=True)
class Binding:
    kind: str  # "ok" | "public" | "internal" | "module" (`monarch` or `monarch.actor` itself)
    what: str = ""  # public: the Monarch public name; internal: a description; module: its path


@dataclass
class Refs:
    names: set[str] = field(default_factory=set)  # module-level names referenced
    public: set[str] = field(default_factory=set)  # Monarch public names used
    internal: set[str] = field(default_factory=set)  # non-public things used
    typing: set[str] = field(default_factory=set)  # non-public things named only for typing

    def update(self, other: Refs) -> None:
        self.names |= other.names
        self.public |= other.public
        self.internal |= other.internal
        self.typing |= other.typing


class Classifier:
    def __init__(self, public: dict[str, tuple[str, str]], tests_dir: Path) -> None:
        self.public = public
        self.by_source = {src: name for name, src in public.items()}
        self.tests_dir = tests_dir
        self._helpers: dict[str, Binding] = {}

    def helper(self, module: str) -> Binding | None:
        """A local helper module of Monarch's test dir: harness, internal, or plain."""
        top = module.split(".")[0]
        path = self.tests_dir / f"{top}.py"
        if not path.exists():
            return None
        if top in HARNESS_MODULES:
            return Binding("ok")
        if top not in self._helpers:
            self._helpers[top] = Binding("ok")  # cycles
            bad = []
            for node in ast.walk(ast.parse(path.read_text())):
                for b in self.import_bindings(node).values():
                    if b.kind == "internal":
                        bad.append(b.what)
            if bad:
                self._helpers[top] = Binding(
                    "internal", f"helper {top} (uses {', '.join(sorted(set(bad))[:2])})"
                )
        return self._helpers[top]

    def from_import(self, module: str, name: str) -> Binding:
        if module == "monarch.actor":
            if name in self.public:
                return Binding("public", name)
            return Binding("internal", f"monarch.actor.{name} (not in monarch.actor.__all__)")
        if module == "monarch" or module.startswith("monarch."):
            pub = self.by_source.get((module, name))
            if pub is not None:  # an internal path to a name monarch.actor re-exports
                return Binding("public", pub)
            return Binding("internal", f"{module}.{name}")
        return self.helper(module) or Binding("ok")

    def import_bindings(self, node: ast.AST) -> dict[str, Binding]:
        """Names an import statement binds, and what each is."""
        out: dict[str, Binding] = {}
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                out[alias.asname or alias.name] = self.from_import(node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                mod = alias.name
                bound = alias.asname or mod.split(".")[0]
                if mod == "monarch" or mod.startswith("monarch."):
                    if mod not in ("monarch", "monarch.actor"):
                        out[bound] = Binding("internal", mod)
                    else:  # `monarch` itself, or `monarch.actor` under an alias
                        out[bound] = Binding("module", mod if alias.asname else "monarch")
                else:
                    out[bound] = self.helper(mod) or Binding("ok")
        return out

    def string_refs(self, s: str, refs: Refs) -> None:
        if _ENV_VAR.match(s):
            refs.internal.add(f"Monarch config variable {s}")
            return
        if "monarch" not in s:
            return
        if "import" in s:  # code run in a subprocess
            try:
                tree = ast.parse(textwrap.dedent(s))
            except SyntaxError:
                tree = None
            if tree is not None:
                for node in ast.walk(tree):
                    for b in self.import_bindings(node).values():
                        if b.kind == "public":
                            refs.public.add(b.what)
                        elif b.kind == "internal":
                            refs.internal.add(f"{b.what} (in code run as a subprocess)")
                sub = RefCollector(self, {}, set(), set())
                sub.visit(tree)
                refs.public |= sub.refs.public
                refs.internal |= sub.refs.internal
                return
        for m in _MONARCH_PATH.finditer(s):
            path = "monarch" + m.group(1)
            parts = path.split(".")
            if parts[1] == "actor":
                if len(parts) > 2:
                    if parts[2] in self.public:
                        refs.public.add(parts[2])
                    else:
                        refs.internal.add(f"'{path}' (string)")
            else:
                refs.internal.add(f"'{path}' (string)")

    def attribute_refs(self, chain: list[str], refs: Refs) -> None:
        """`monarch.<...>` reached through the `monarch` package."""
        if len(chain) < 2:
            return
        if chain[1] == "actor":
            if len(chain) >= 3:
                if chain[2] in self.public:
                    refs.public.add(chain[2])
                else:
                    refs.internal.add(".".join(chain[:3]))
        else:
            refs.internal.add(".".join(chain[:3]))


def _docstring_ids(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                ids.add(id(body[0].value))
    return ids


class RefCollector(ast.NodeVisitor):
    """What one statement references: module-level names, public names, internals."""

    def __init__(
        self,
        cls: Classifier,
        module_bindings: dict[str, Binding],
        module_names: set[str],
        docstrings: set[int],
        own_attrs: frozenset[str] = frozenset(),
    ) -> None:
        self.cls = cls
        self.module_bindings = module_bindings
        self.module_names = module_names
        self.docstrings = docstrings
        self.own_attrs = own_attrs  # attributes the test module itself defines or assigns
        self.local_bindings: dict[str, Binding] = {}
        self.refs = Refs()
        self.typing = False  # inside an annotation or cast()'s type argument

    def _typing(self, node: ast.AST) -> None:
        saved, self.typing = self.typing, True
        self.visit(node)
        self.typing = saved

    def visit_arg(self, node: ast.arg) -> None:
        if node.annotation is not None:
            self._typing(node.annotation)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for child in [*node.decorator_list, node.args, *node.body]:
            self.visit(child)
        if node.returns is not None:
            self._typing(node.returns)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.visit(node.target)
        self._typing(node.annotation)
        if node.value is not None:
            self.visit(node.value)

    def visit_Call(self, node: ast.Call) -> None:
        if _dotted(node.func) in ("cast", "typing.cast") and node.args:
            self.visit(node.func)
            self._typing(node.args[0])
            for child in [*node.args[1:], *node.keywords]:
                self.visit(child)
        else:
            self.generic_visit(node)

    def _binding(self, name: str) -> Binding | None:
        return self.local_bindings.get(name) or self.module_bindings.get(name)

    def _apply(self, b: Binding) -> None:
        if b.kind == "internal" and self.typing:
            self.refs.typing.add(b.what)
        elif b.kind == "public":
            self.refs.public.add(b.what)
        elif b.kind == "internal":
            self.refs.internal.add(b.what)

    def visit_Import(self, node: ast.Import) -> None:
        self._local_import(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self._local_import(node)

    def _local_import(self, node: ast.AST) -> None:
        for name, b in self.cls.import_bindings(node).items():
            self.local_bindings[name] = b
            self._apply(b)

    def visit_Global(self, node: ast.Global) -> None:
        self.refs.names |= set(node.names) & self.module_names

    def visit_Name(self, node: ast.Name) -> None:
        b = self._binding(node.id)
        if b is not None:
            if isinstance(node.ctx, ast.Load):
                self._apply(b)
        elif node.id in self.module_names:
            self.refs.names.add(node.id)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain = []
        cur: ast.AST = node
        while isinstance(cur, ast.Attribute):
            chain.append(cur.attr)
            cur = cur.value
        if isinstance(cur, ast.Name):
            b = self._binding(cur.id)
            if b is not None and b.kind == "module":
                self.cls.attribute_refs([*b.what.split("."), *reversed(chain)], self.refs)
                return
            private = chain[-1].startswith("_") and not chain[-1].startswith("__")
            if b is not None and b.kind == "public" and private:  # e.g. Future._from_coro
                self._apply(Binding("internal", f"monarch.actor.{b.what}.{chain[-1]}"))
                self.generic_visit(node)
                return
        # A private attribute the test module neither defines nor assigns, read from anything
        # but a non-Monarch import (`os._exit` is fine): a Monarch object's internals, e.g.
        # `cast(Any, Actor.method)._explicit_response_port`.
        root = cur.id if isinstance(cur, ast.Name) else None
        imported = root is not None and (b := self._binding(root)) is not None and b.kind == "ok"
        if (
            isinstance(node.ctx, ast.Load)
            and _is_private(node.attr)
            and node.attr not in self.own_attrs
            and not imported
        ):
            self._apply(Binding("internal", f"private attribute .{node.attr} of a Monarch object"))
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and id(node) not in self.docstrings:
            self.cls.string_refs(node.value, self.refs)


def _is_private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def _own_attributes(tree: ast.Module) -> frozenset[str]:
    """Attribute names the module itself gives meaning: assigned (`x.a = ...`), or defined in
    one of its class bodies (methods, class attributes)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
            out.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                out |= _defined_names(stmt)
    return frozenset(out)


def _is_import(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Import | ast.ImportFrom)


def _defined_names(stmt: ast.stmt) -> set[str]:
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {stmt.name}
    out = set()
    stack: list[ast.AST] = [stmt]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
            continue
        elif isinstance(node, ast.Lambda):
            continue
        stack.extend(ast.iter_child_nodes(node))
    return out


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _mark_name(dec: ast.AST) -> str:
    """'skip' for @pytest.mark.skip(...), etc.; '' if not a pytest mark."""
    target = dec.func if isinstance(dec, ast.Call) else dec
    name = _dotted(target)
    return name.split(".", 2)[2] if name.startswith("pytest.mark.") else ""


def _param_count(fn: ast.AST) -> int:
    n = 1
    for dec in fn.decorator_list:
        if _mark_name(dec) == "parametrize" and isinstance(dec, ast.Call) and len(dec.args) >= 2:
            values = dec.args[1]
            if isinstance(values, ast.List | ast.Tuple):
                n *= max(1, len(values.elts))
    return n


@dataclass
class TestInfo:
    module: str
    name: str
    node: ast.AST
    params: int
    refs: Refs
    via: dict[str, str]  # internal thing -> module-level helper it came through
    exclude_reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.module}.py::{self.name}"


@dataclass
class ModulePlan:
    name: str
    tree: ast.Module
    bindings: dict[str, Binding]
    stmt_refs: dict[int, Refs]
    defines: dict[str, list[int]]
    tests: list[TestInfo]


def analyse_module(cls: Classifier, name: str, source: str) -> ModulePlan:
    tree = ast.parse(source)
    docstrings = _docstring_ids(tree)
    bindings: dict[str, Binding] = {}
    for stmt in tree.body:
        if _is_import(stmt):
            bindings.update(cls.import_bindings(stmt))
    defines: dict[str, list[int]] = defaultdict(list)
    for i, stmt in enumerate(tree.body):
        if not _is_import(stmt):
            for n in _defined_names(stmt):
                if n not in bindings:
                    defines[n].append(i)
    module_names = set(defines)
    own_attrs = _own_attributes(tree)
    stmt_refs: dict[int, Refs] = {}
    for i, stmt in enumerate(tree.body):
        if _is_import(stmt):
            continue
        rc = RefCollector(cls, bindings, module_names, docstrings, own_attrs)
        rc.visit(stmt)
        rc.refs.names -= _defined_names(stmt) if not _is_test(stmt) else set()
        stmt_refs[i] = rc.refs

    fixtures = {}
    autouse = []
    module_marks = []
    for i, stmt in enumerate(tree.body):
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            for dec in stmt.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if _dotted(target) in ("pytest.fixture", "pytest_asyncio.fixture"):
                    fixtures[stmt.name] = i
                    if isinstance(dec, ast.Call) and any(
                        k.arg == "autouse" and isinstance(k.value, ast.Constant) and k.value.value
                        for k in dec.keywords
                    ):
                        autouse.append(i)
        if "pytestmark" in _defined_names(stmt) and not _is_import(stmt):
            module_marks.append(i)

    tests = []
    for i, stmt in enumerate(tree.body):
        if not _is_test(stmt):
            continue
        start = set(stmt_refs[i].names)
        start |= {a.arg for a in stmt.args.args if a.arg in fixtures}
        start -= {stmt.name}
        refs = Refs(public=set(stmt_refs[i].public), internal=set(stmt_refs[i].internal))
        via: dict[str, str] = {}
        seen_stmts = {i}
        todo = [(j, None) for j in [*autouse, *module_marks]]
        todo += [(j, n) for n in start for j in defines.get(n, [])]
        while todo:
            j, through = todo.pop()
            if j in seen_stmts:
                continue
            seen_stmts.add(j)
            r = stmt_refs[j]
            helper = through or _stmt_label(tree.body[j])
            for thing in r.internal - refs.internal:
                via.setdefault(thing, helper)
            refs.public |= r.public
            refs.internal |= r.internal
            for n in r.names:
                for k in defines.get(n, []):
                    todo.append((k, helper))
        refs.names = {n for j in seen_stmts for n in _defined_names(tree.body[j])}
        info = TestInfo(name, stmt.name, stmt, _param_count(stmt), refs, via)
        info.exclude_reason = _exclusion(info, [tree.body[j] for j in module_marks])
        tests.append(info)
    return ModulePlan(name, tree, bindings, stmt_refs, dict(defines), tests)


def _is_test(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name.startswith("test")


def _stmt_label(stmt: ast.stmt) -> str:
    names = sorted(_defined_names(stmt))
    return names[0] if names else f"line {stmt.lineno}"


def _exclusion(t: TestInfo, module_marks: list[ast.stmt]) -> str:
    marks = [(_mark_name(d), d) for d in t.node.decorator_list]
    for stmt in module_marks:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Attribute | ast.Call) and _mark_name(node):
                marks.append((_mark_name(node), node))
    for name, dec in marks:
        if name == "oss_skip":
            return "oss_skip: Monarch's own OSS CI does not run it (-m 'not oss_skip')"
        if name == "skip":
            why = ""
            if isinstance(dec, ast.Call):
                for k in dec.keywords:
                    if k.arg == "reason" and isinstance(k.value, ast.Constant):
                        why = f" ({k.value.value})"
            return f"skipped unconditionally in Monarch{why}"
    if t.refs.internal:
        items = []
        for thing in sorted(t.refs.internal):
            helper = t.via.get(thing)
            items.append(f"{thing} via {helper}" if helper else thing)
        more = f" (+{len(items) - 3} more)" if len(items) > 3 else ""
        return "non-public: " + "; ".join(items[:3]) + more
    return ""


# ------------------------------------------------------------------------------------------
# Rewriting a test module for the run


class _StripTyping(ast.NodeTransformer):
    """`cast(T, v)` -> `v`; an annotation naming a dropped internal becomes a string (which
    Python does not evaluate). Neither changes what the code does."""

    def __init__(self, dropped: set[str]) -> None:
        self.dropped = dropped

    def _names_dropped(self, node: ast.AST | None) -> bool:
        return node is not None and any(
            isinstance(n, ast.Name) and n.id in self.dropped for n in ast.walk(node)
        )

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if _dotted(node.func) in ("cast", "typing.cast") and len(node.args) == 2:
            return node.args[1]
        return node

    def visit_arg(self, node: ast.arg) -> ast.AST:
        if self._names_dropped(node.annotation):
            node.annotation = ast.Constant(ast.unparse(node.annotation))
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.AST:
        self.generic_visit(node)
        if self._names_dropped(node.returns):
            node.returns = ast.Constant(ast.unparse(node.returns))
        return node

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        self.generic_visit(node)
        if self._names_dropped(node.annotation):
            node.annotation = ast.Constant(ast.unparse(node.annotation))
        return node


class _RaiseTimeouts(ast.NodeTransformer):
    def __init__(self, floor: int) -> None:
        self.floor = floor

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if _dotted(node.func) == "pytest.mark.timeout" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, int | float):
                arg.value = max(arg.value, self.floor)
        return node


def _guard_import(stmt: ast.stmt) -> ast.Try:
    """`try: <import> except ImportError: pass`: a missing name stays undefined."""
    handler = ast.ExceptHandler(type=ast.Name("ImportError"), name=None, body=[ast.Pass()])
    return ast.Try(body=[stmt], handlers=[handler], orelse=[], finalbody=[])


def _guard_def(stmt: ast.stmt) -> ast.Try:
    """`try: <stmt> except Exception: <record it>`: a module-level definition that fails on
    raymesh (a missing name, an unsupported keyword) leaves its names undefined instead of
    failing the whole module; the recorder notes why, for the tests that then hit NameError."""
    names = sorted(_defined_names(stmt)) or [f"line {stmt.lineno}"]
    record = ast.Expr(
        ast.Call(
            func=ast.Name(GUARD_FN),
            args=[ast.Constant(names), ast.Name("_monarch_compat_err")],
            keywords=[],
        )
    )
    handler = ast.ExceptHandler(
        type=ast.Name("Exception"), name="_monarch_compat_err", body=[record]
    )
    return ast.Try(body=[stmt], handlers=[handler], orelse=[], finalbody=[])


def _rewrite_import(stmt: ast.stmt, cls: Classifier) -> list[ast.stmt]:
    if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
        return [stmt]
    out: list[ast.stmt] = []
    if isinstance(stmt, ast.ImportFrom):
        keep = []
        for alias in stmt.names:
            b = cls.from_import(stmt.module or "", alias.name) if stmt.level == 0 else Binding("ok")
            if b.kind == "ok":
                keep.append(alias)
            elif b.kind == "public":
                imp = ast.ImportFrom(
                    module="monarch.actor",
                    names=[ast.alias(name=b.what, asname=alias.asname or alias.name)],
                    level=0,
                )
                out.append(_guard_import(imp))
        if keep:
            out.insert(0, ast.ImportFrom(module=stmt.module, names=keep, level=stmt.level))
    else:
        keep = []
        for alias in stmt.names:
            b = cls.import_bindings(ast.Import(names=[alias]))
            if all(v.kind != "internal" for v in b.values()):
                keep.append(alias)
        if keep:
            out.append(ast.Import(names=keep))
    return out


def rewrite_module(
    plan: ModulePlan, cls: Classifier, keep_tests: set[str], floor: int
) -> tuple[str, list[str]]:
    """The module as run, and notes on module-level statements dropped."""
    tree = plan.tree
    notes = []

    # A module-level statement whose closure uses internals: only excluded tests can need it.
    def closure_internal(i: int) -> bool:
        seen, todo = set(), [i]
        while todo:
            j = todo.pop()
            if j in seen:
                continue
            seen.add(j)
            if plan.stmt_refs[j].internal:
                return True
            for n in plan.stmt_refs[j].names:
                todo.extend(plan.defines.get(n, []))
        return False

    body: list[ast.stmt] = []
    for i, stmt in enumerate(tree.body):
        if _is_import(stmt):
            body.extend(_rewrite_import(stmt, cls))
        elif _is_test(stmt):
            if stmt.name in keep_tests:
                body.append(_guard_def(stmt))
        elif i == 0 and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            body.append(stmt)  # the module docstring
        elif closure_internal(i):
            notes.append(
                f"{plan.name}.py: dropped module-level {_stmt_label(stmt)} (line {stmt.lineno}): "
                f"uses {', '.join(sorted(plan.stmt_refs[i].internal)[:2]) or 'a dropped helper'}"
            )
        else:
            body.append(_guard_def(stmt))
    guard_import = ast.ImportFrom(
        module=GUARD_MODULE, names=[ast.alias(name="record_failed_def", asname=GUARD_FN)], level=0
    )
    # __future__ imports first.
    future = [s for s in body if isinstance(s, ast.ImportFrom) and s.module == "__future__"]
    rest = [s for s in body if s not in future]
    doc = [rest.pop(0)] if rest and isinstance(rest[0], ast.Expr) else []
    new = ast.Module(body=[*doc, *future, guard_import, *rest], type_ignores=[])
    new = _RaiseTimeouts(floor).visit(new)
    new = _StripTyping({n for n, b in plan.bindings.items() if b.kind == "internal"}).visit(new)
    ast.fix_missing_locations(new)
    header = "# Rewritten by raymesh bench/monarch_compat.py from Monarch's test module.\n"
    return header + ast.unparse(new) + "\n", notes


# ------------------------------------------------------------------------------------------
# Harness files written into the temp dir

GUARD_MODULE = "monarch_compat_guard"
GUARD_FN = "_monarch_compat_failed"
GUARD_SOURCE = '''"""Records module-level definitions that failed (bench/monarch_compat.py)."""
import json
import os


def record_failed_def(names, err):
    path = os.environ.get("MONARCH_COMPAT_RESULTS")
    if path:
        rec = {"def_failed": names, "error": f"{type(err).__name__}: {err}"}
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\\n")
'''

SHIM_INIT = '''"""Monarch's package name over raymesh (bench/monarch_compat.py). Renames only."""
'''

CONFTEST = '''"""Recorder for bench/monarch_compat.py (replaces Monarch's conftest.py)."""
import json
import os

_OUT = os.environ["MONARCH_COMPAT_RESULTS"]


def _write(rec):
    with open(_OUT, "a") as f:
        f.write(json.dumps(rec) + "\\n")


def _message(report):
    lr = report.longrepr
    if lr is None:
        return ""
    if isinstance(lr, tuple):  # skip: (file, line, reason)
        return str(lr[2])
    crash = getattr(lr, "reprcrash", None)
    if crash is not None and crash.message:
        return crash.message
    return str(lr).strip().splitlines()[-1] if str(lr).strip() else ""


def pytest_collection_modifyitems(session, config, items):
    _write({"collected": [item.nodeid for item in items]})


def pytest_collectreport(report):
    if report.failed:
        _write({"collect_error": report.nodeid, "message": _message(report)})


def pytest_runtest_logreport(report):
    _write(
        {
            "nodeid": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "duration": round(report.duration, 2),
            "message": _message(report) if report.outcome != "passed" else "",
        }
    )
'''

PYTEST_INI = """[pytest]
asyncio_mode = auto
asyncio_default_fixture_loop_scope = function
markers =
    oss_skip: marks tests to skip in OSS CI
timeout = {timeout}
"""


def shim_actor_init() -> str:
    return f'''"""monarch.actor over raymesh: the module raymesh.actor itself plus renames (no
behaviour). The module itself, not a copy of its names, so that a program assigning one of its
attributes (`monarch.actor.unhandled_fault_hook = fn`) assigns raymesh's, as `import raymesh.actor`
in place of `import monarch.actor` would."""
import sys

import raymesh.actor as _actor

for _monarch_name, _raymesh_name in {sorted(RENAMES.items())!r}:
    if hasattr(_actor, _raymesh_name) and not hasattr(_actor, _monarch_name):
        setattr(_actor, _monarch_name, getattr(_actor, _raymesh_name))
sys.modules[__name__] = _actor
'''


ISOLATE_INPROCESS = '''"""isolate_in_subprocess, as bench/monarch_compat.py --isolation inprocess:
runs the test in the pytest process (sharing its Ray and warm procs), `env` set around it."""
import asyncio
import functools
import os


def _with_env(env):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    def restore():
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return restore


def isolate_in_subprocess(test_fn=None, *, env=None):
    if test_fn is None:
        return functools.partial(isolate_in_subprocess, env=env)
    if not env:
        return test_fn
    if asyncio.iscoroutinefunction(test_fn):
        @functools.wraps(test_fn)
        async def awrapper(*args, **kwargs):
            restore = _with_env(env)
            try:
                return await test_fn(*args, **kwargs)
            finally:
                restore()
        return awrapper

    @functools.wraps(test_fn)
    def wrapper(*args, **kwargs):
        restore = _with_env(env)
        try:
            return test_fn(*args, **kwargs)
        finally:
            restore()
    return wrapper
'''


def patch_isolate_harness(path: Path) -> list[str]:
    """Monarch's isolate_in_subprocess, minus its monarch.config runtime-config round trip, and
    killing the child's process group when the parent is interrupted (a pytest timeout)."""
    src = path.read_text()
    notes = []
    swaps = [
        (
            "from monarch.config import get_runtime_config",
            "get_runtime_config = dict  # monarch_compat: no Monarch runtime config to carry",
        ),
        (
            "from monarch.config import configure",
            "configure = lambda **_: None  # monarch_compat: no Monarch runtime config",
        ),
        (
            "returncode = proc.wait()",
            "try:\n"
            "            returncode = proc.wait()\n"
            "        except BaseException:  # monarch_compat: a timeout ends the child too\n"
            "            try:\n"
            "                os.killpg(proc.pid, signal.SIGKILL)\n"
            "            except OSError:\n"
            "                pass\n"
            "            raise",
        ),
    ]
    for old, new in swaps:
        if old in src:
            src = src.replace(old, new)
        else:
            notes.append(f"isolate_in_subprocess.py: did not find {old!r} to patch")
    path.write_text(src)
    return notes


# ------------------------------------------------------------------------------------------
# Running


# What Monarch's tests import beyond pytest and torch (module -> pip requirement).
TEST_DEPENDENCIES = {"pytest_asyncio": "pytest-asyncio>=0.23", "cloudpickle": "cloudpickle"}


def ensure_test_dependencies(tmp: Path) -> tuple[str | None, str]:
    """A directory to add to PYTHONPATH (None if the venv already has them all), and a note.
    Missing ones are pip-installed into the temp dir, never into the venv."""
    missing = [req for mod, req in TEST_DEPENDENCIES.items() if not importlib.util.find_spec(mod)]
    if not missing:
        return None, "pytest-asyncio and cloudpickle from the venv"
    target = tmp / "plugins"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target"]
    r = subprocess.run(
        [*pip, str(target), *missing],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise SystemExit(f"{missing} are needed and could not be installed:\n{r.stderr}")
    versions = sorted(p.name.removesuffix(".dist-info") for p in target.glob("*.dist-info"))
    return str(target), f"{', '.join(versions)} pip-installed into the temp dir"


def shim_names(env: dict[str, str]) -> tuple[set[str], str]:
    code = (
        "import json, monarch.actor as m, raymesh;"
        "print(json.dumps([sorted(n for n in dir(m) if not n.startswith('_')),"
        " m.__file__, raymesh.__file__]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    if r.returncode != 0:
        raise SystemExit(f"the shim does not import:\n{r.stderr[-3000:]}")
    names, shim_file, raymesh_file = json.loads(r.stdout.strip().splitlines()[-1])
    return set(names), f"{shim_file} over {raymesh_file}"


def kill_marked(token: str) -> int:
    """SIGKILL this run's leftover processes: those whose environment carries our token."""
    killed = 0
    me = os.getpid()
    needle = f"MONARCH_COMPAT_RUN={token}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                os.kill(int(d.name), signal.SIGKILL)
                killed += 1
        except (OSError, PermissionError):
            continue
    return killed


def run_pytest(
    tests_dir: Path, targets: list[str], env: dict[str, str], limit: float, timeout: int, log: Path
) -> int | None:
    """One pytest process; None if it ran past `limit` seconds (then it is killed)."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-c",
        str(tests_dir / "pytest.ini"),
        "--rootdir",
        str(tests_dir),
        "--timeout",
        str(timeout),
        # A test blocked in native code never sees the signal method's SIGALRM; the thread
        # method ends the whole process instead, and run_all starts pytest again after it.
        "--timeout-method",
        "thread",
        "-q",
        "-rN",
        "--continue-on-collection-errors",
        *targets,
    ]
    with log.open("a") as out:
        out.write(f"\n===== monarch_compat: pytest on {len(targets)} targets =====\n")
        out.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=tests_dir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=max(1.0, limit))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                proc.wait()
            return None


def run_all(
    tests_dir: Path,
    files: list[str],
    env: dict[str, str],
    total: int,
    timeout: int,
    log: Path,
    results: Path,
    token: str,
) -> dict:
    """pytest until every collected test has finished or `total` seconds are spent. A test that
    ends its pytest process (a timeout under the thread method, a crash) is recorded as failed
    and pytest starts again on the tests not yet run."""
    start = time.monotonic()
    targets, rcs, killed, hit_limit = list(files), [], 0, False
    while True:
        left = total - (time.monotonic() - start)
        if left < 30:
            hit_limit = True
            break
        rc = run_pytest(tests_dir, targets, env, left, timeout, log)
        rcs.append(rc)
        killed += kill_marked(token)
        if rc is None:
            hit_limit = True
            break
        res = read_results(results)
        started = {n for n, t in res.per_test.items() if "teardown" not in t["phases"]}
        text = log.read_text(errors="replace").rsplit("===== monarch_compat:", 1)[-1]
        why = (
            f"Timeout: over {timeout}s (pytest-timeout ended the pytest process)"
            if "Timeout" in text
            else f"the pytest process died (rc={rc})"
        )
        with results.open("a") as f:
            for n in sorted(started):
                for when, outcome in (("call", "failed"), ("teardown", "passed")):
                    rec = {"nodeid": n, "when": when, "outcome": outcome, "duration": 0.0}
                    f.write(json.dumps({**rec, "message": why}) + "\n")
        res = read_results(results)
        finished = {n for n, t in res.per_test.items() if "teardown" in t["phases"]}
        remaining = sorted(res.collected - finished)
        if not remaining or not started:
            break
        targets = remaining
    return {
        "rcs": rcs,
        "wall_s": round(time.monotonic() - start, 1),
        "hit_total_limit": hit_limit,
        "pytest_processes": len(rcs),
        "leftover_processes_killed": killed,
    }


@dataclass
class RunResults:
    collected: set[str] = field(default_factory=set)
    per_test: dict[str, dict] = field(default_factory=dict)
    collect_errors: dict[str, str] = field(default_factory=dict)
    failed_defs: dict[str, str] = field(default_factory=dict)  # module-level name -> error


def read_results(path: Path) -> RunResults:
    res = RunResults()
    collected, per_test, collect_errors = res.collected, res.per_test, res.collect_errors
    if not path.exists():
        return res
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "def_failed" in rec:
            for name in rec["def_failed"]:
                res.failed_defs.setdefault(name, rec["error"])
        elif "collected" in rec:
            collected |= set(rec["collected"])
        elif "collect_error" in rec:
            collect_errors[rec["collect_error"]] = rec["message"]
        else:
            t = per_test.setdefault(
                rec["nodeid"], {"outcome": "passed", "message": "", "phases": []}
            )
            t["phases"].append(rec["when"])
            if rec["outcome"] == "failed" and t["outcome"] != "failed":
                label = "error in " + rec["when"] if rec["when"] != "call" else "failed"
                t.update(outcome="failed", message=f"[{label}] {rec['message']}")
            elif rec["outcome"] == "skipped" and t["outcome"] == "passed":
                t.update(outcome="skipped", message=f"[skipped] {rec['message']}")
            t.setdefault("duration", 0.0)
            t["duration"] = round(t["duration"] + rec["duration"], 2)
    return res


_NAME_ERROR = re.compile(r"NameError: name '(\w+)' is not defined")


def root_cause(message: str, failed_defs: dict[str, str], missing: set[str]) -> str:
    """For a NameError: the missing public name, or why the module-level definition failed."""
    hit = _NAME_ERROR.search(message)
    seen = set()
    while hit and hit.group(1) not in seen:
        name = hit.group(1)
        seen.add(name)
        if name in missing:
            return f"raymesh lacks monarch.actor.{name}"
        if name not in failed_defs:
            return ""
        err = failed_defs[name]
        hit = _NAME_ERROR.search(err)
        if not hit:
            return f"module-level {name} fails on raymesh: {first_line(err, 160)}"
    return ""


def first_line(s: str, limit: int = 240) -> str:
    line = next((x.strip() for x in s.splitlines() if x.strip()), "")
    return line[:limit]


def reason_group(message: str) -> str:
    """A coarse bucket for a failure message, for the grouped counts."""
    m = message
    root = re.search(r"\(root: (.*)\)$", m)
    if root:
        return root.group(1)
    rules = [
        (r"PlacementError|needs \d+ GPU", "PlacementError: 'gpus' axis needs real GPUs"),
        (r"NameError: name '(\w+)' is not defined", "NameError: {0} (name missing)"),
        (r"cannot import name '(\w+)'", "ImportError: {0}"),
        (r"has no attribute '(\w+)'", "AttributeError: .{0}"),
        (r"Timeout: over", "timeout (pytest-timeout: over --timeout)"),
        (r"^\[failed\] TimeoutError\s*$", "TimeoutError (the test's own wait ran out)"),
        (r"\[not run\] (.*)", "not run: {0}"),
        (r"\[skipped\]", "skipped at run time"),
        (r"DID NOT RAISE", "expected exception not raised"),
    ]
    for pat, label in rules:
        hit = re.search(pat, m)
        if hit:
            return label.format(*hit.groups())
    text = re.sub(r"^\[[^\]]*\] (Failed: )?", "", first_line(m))
    return re.sub(r"0x[0-9a-f]+|\d+(\.\d+)?", "N", text)[:90]


# ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="regex on 'test_file.py::test_name' to run a subset")
    ap.add_argument("--timeout", type=int, default=90, help="per-test timeout floor (s)")
    ap.add_argument("--total", type=int, default=780, help="wall limit for the pytest run (s)")
    ap.add_argument("--monarch-git-dir", type=Path, default=DEFAULT_MIRROR)
    ap.add_argument("--ref", default="HEAD")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("--classify-only", action="store_true", help="classify, run nothing")
    ap.add_argument(
        "--isolation",
        choices=["inprocess", "subprocess"],
        default="inprocess",
        help="@isolate_in_subprocess tests: in the pytest process (default; a fresh process "
        "with its own Ray costs 30-60 s a test here), or in Monarch's subprocess harness",
    )
    args = ap.parse_args(argv)

    load_start = os.getloadavg()
    commit = git(args.monarch_git_dir, "rev-parse", args.ref).strip()
    tmp = Path(tempfile.mkdtemp(prefix="monarch_compat_"))
    try:
        return _main(args, tmp, commit, load_start)
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _main(args: argparse.Namespace, tmp: Path, commit: str, load_start: tuple) -> int:
    extract_tests(args.monarch_git_dir, args.ref, tmp)
    tests_dir = tmp / "python" / "tests"
    public = monarch_public_api(args.monarch_git_dir, args.ref)

    found = {p.stem for p in tests_dir.glob("test_*.py")}
    modules = [m for m in TEST_MODULES if m in found]
    absent = [m for m in TEST_MODULES if m not in found]
    log(f"Monarch {commit[:12]}: test modules found: {', '.join(modules)}")
    if absent:
        log(f"not found (moved or renamed?): {', '.join(absent)}")

    # Shim.
    shim = tmp / "shim"
    (shim / "monarch" / "actor").mkdir(parents=True)
    (shim / "monarch" / "__init__.py").write_text(SHIM_INIT)
    (shim / "monarch" / "actor" / "__init__.py").write_text(shim_actor_init())

    plugin_dir, plugin_note = (
        (None, "not needed") if args.classify_only else (ensure_test_dependencies(tmp))
    )
    token = uuid.uuid4().hex
    env = dict(os.environ)
    path = [str(shim), str(tests_dir)]
    if plugin_dir:
        path.append(plugin_dir)
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env.update(
        PYTHONPATH=os.pathsep.join(path),
        MONARCH_COMPAT_RUN=token,
        MONARCH_COMPAT_RESULTS=str(tmp / "results.jsonl"),
        PYTHONDONTWRITEBYTECODE="1",
    )
    names, shim_where = shim_names(env)
    missing = set(public) - names
    log(f"shim: {shim_where}")
    log(
        f"Monarch public names missing from the shim ({len(missing)}): {', '.join(sorted(missing))}"
    )

    # Classify.
    cls = Classifier(public, tests_dir)
    plans = {m: analyse_module(cls, m, (tests_dir / f"{m}.py").read_text()) for m in modules}
    only = re.compile(args.only) if args.only else None
    included: list[TestInfo] = []
    excluded: dict[str, str] = {}
    for plan in plans.values():
        for t in plan.tests:
            if only and not only.search(t.id):
                continue
            if t.exclude_reason:
                excluded[t.id] = t.exclude_reason
            else:
                included.append(t)
    log(f"\nexcluded ({len(excluded)} functions):")
    for tid, why in excluded.items():
        log(f"  {tid}: {why}")
    log(f"\nincluded ({len(included)} functions):")
    for t in included:
        lacking = sorted(t.refs.public & missing)
        log(
            f"  {t.id}"
            + (f"   [uses names raymesh lacks: {', '.join(lacking)}]" if lacking else "")
        )

    notes: list[str] = []
    if args.classify_only:
        return 0

    # Rewrite the modules and the harness.
    (tests_dir / "conftest.py").write_text(CONFTEST)
    (tests_dir / f"{GUARD_MODULE}.py").write_text(GUARD_SOURCE)
    (tests_dir / "pytest.ini").write_text(PYTEST_INI.format(timeout=args.timeout))
    if args.isolation == "inprocess":
        (tests_dir / "isolate_in_subprocess.py").write_text(ISOLATE_INPROCESS)
    elif (tests_dir / "isolate_in_subprocess.py").exists():
        notes += patch_isolate_harness(tests_dir / "isolate_in_subprocess.py")
    files = []
    for m, plan in plans.items():
        keep = {t.name for t in included if t.module == m}
        if not keep:
            continue
        text, dropped = rewrite_module(plan, cls, keep, args.timeout)
        (tests_dir / f"{m}.py").write_text(text)
        notes += dropped
        files.append(f"{m}.py")

    # Run.
    load_before = os.getloadavg()
    log(f"\nrunning {len(files)} modules (load {load_before[0]:.1f}); log: {tmp}/pytest.log")
    run = {"rcs": [], "wall_s": 0.0, "hit_total_limit": False, "pytest_processes": 0}
    if files:
        run = run_all(
            tests_dir,
            files,
            env,
            args.total,
            args.timeout,
            tmp / "pytest.log",
            tmp / "results.jsonl",
            token,
        )
    run["leftover_processes_killed"] = run.get("leftover_processes_killed", 0) + kill_marked(token)
    load_after = os.getloadavg()
    res = read_results(tmp / "results.jsonl")
    collected, per_test, collect_errors = res.collected, res.per_test, res.collect_errors
    not_run = (
        "[not run] not reached within --total"
        if run["hit_total_limit"]
        else f"[not run] pytest ended first (rc={run['rcs'][-1] if run['rcs'] else None})"
    )
    pytest_tail = (tmp / "pytest.log").read_text().splitlines()[-15:] if files else []

    # Tally: every included function's items; missing items are failures too.
    results: dict[str, dict] = {}
    for t in included:
        prefix = f"{t.module}.py::{t.name}"
        items = [n for n in collected if n == prefix or n.startswith(prefix + "[")]
        if not items:
            err = collect_errors.get(f"{t.module}.py")
            why = "[not collected] " + (
                first_line(err) if err else res.failed_defs.get(t.name, "(no error recorded)")
            )
            for k in range(t.params):
                results[prefix if t.params == 1 else f"{prefix}[#{k}]"] = {
                    "outcome": "failed",
                    "message": why,
                }
            continue
        for n in items:
            results[n] = dict(per_test.get(n, {"outcome": "failed", "message": not_run}))
    for r in results.values():
        cause = (
            root_cause(r["message"], res.failed_defs, missing) if r["outcome"] != "passed" else ""
        )
        if cause:
            r["message"] = f"{first_line(r['message'])} (root: {cause})"
    passed = sorted(n for n, r in results.items() if r["outcome"] == "passed")
    failed = {n: r for n, r in results.items() if r["outcome"] != "passed"}
    on_purpose = {n: DIFFERS_ON_PURPOSE[n] for n in failed if n in DIFFERS_ON_PURPOSE}
    groups = Counter(reason_group(r["message"]) for n, r in failed.items() if n not in on_purpose)
    n_incl = len(results)
    summary = {
        "included": n_incl,
        "passed": len(passed),
        "rate": round(len(passed) / n_incl, 4) if n_incl else None,
        "included_functions": len(included),
        "passed_functions": sum(
            1
            for t in included
            if all(
                r["outcome"] == "passed"
                for n, r in results.items()
                if n == t.id or n.startswith(t.id + "[")
            )
        ),
        "failed": [f"{n}: {first_line(r['message'])}" for n, r in sorted(failed.items())],
        "failure_groups": dict(groups.most_common()),
        "differs_on_purpose": on_purpose,
        "excluded": excluded,
        "excluded_count": len(excluded),
        "passed_tests": passed,
        "monarch_commit": commit,
        "monarch_test_modules": modules,
        "monarch_test_modules_missing": absent,
        "missing_public_names": sorted(missing),
        "renames": RENAMES,
        "load_avg": {
            "start": [round(x, 2) for x in load_start],
            "before_run": [round(x, 2) for x in load_before],
            "after_run": [round(x, 2) for x in load_after],
        },
        "pytest": {
            **run,
            "per_test_timeout_floor_s": args.timeout,
            "isolation": args.isolation,
            "total_limit_s": args.total,
            "plugin": plugin_note,
            "log_tail": pytest_tail,
        },
        "only": args.only,
        "notes": notes,
    }
    out = json.dumps(summary, indent=2)
    if args.json_out:
        args.json_out.write_text(out + "\n")
    print(out)
    log(f"\n{len(passed)}/{n_incl} passed ({summary['rate']}); failure reasons:")
    for label, count in groups.most_common():
        log(f"  {count:4d}  {label}")
    for name, why in on_purpose.items():
        log(f"     1  differs on purpose: {name}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
