"""The package's shape, read from its source with `ast` (nothing is imported but the
package itself):

- the import graph between optax_accum's modules has no cycle;
- no module uses another module's private name: `from optax_accum.x import _y` and
  `x._y` are allowed only when `_y` is a private submodule (what two modules share
  lives in a shared module under a name without the underscore);
- every public module defines, besides its private names, exactly its `__all__`, and
  those lists together are `optax_accum.__all__`;
- `lax.platform_dependent` is used in `_branch.py` alone;
- no module is over 600 lines, and radon rates no function or method worse than C
  (cyclomatic complexity at most 20): a room that grows past that is split along the
  jobs inside it.

The demo (`python -m optax_accum.demo`) is a program whose public modules (`agn`,
`hlo`) the benchmarks also run; it is not part of `optax_accum.__all__`, so its modules
are held to the first two rules only. So is `optax_accum.ray` (the ray extra's own
namespace), whose `__all__` is exactly what it exports.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import optax_accum

PACKAGE = pathlib.Path(optax_accum.__file__).parent
ROOT_NAME = "optax_accum"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in SOURCES.items()}
PACKAGES = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(module: str, node: ast.ImportFrom) -> str | None:
    """The absolute module an `ImportFrom` reads from, if it is in the package."""
    if node.level:
        base = module if module in PACKAGES else module.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
            base = base.rsplit(".", 1)[0]
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module or ""
    return target if target.split(".")[0] == ROOT_NAME else None


def _outside_type_checking(tree: ast.AST) -> list[ast.AST]:
    """Every node of `tree`, except those under `if TYPE_CHECKING:`."""
    nodes, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        nodes.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return nodes


class _Imports:
    """One module's imports of package modules: the edges, the names bound to package
    modules, and the private names it imports."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.edges: set[str] = set()
        self.bound: dict[str, str] = {}  # local name -> package module it stands for
        self.private: list[str] = []
        for node in _outside_type_checking(TREES[module]):
            if isinstance(node, ast.ImportFrom):
                self._from(node)
            elif isinstance(node, ast.Import):
                self._import(node)

    def _from(self, node: ast.ImportFrom) -> None:
        source = _resolve(self.module, node)
        if source is None:
            return
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            if submodule in SOURCES:
                self.edges.add(submodule)
                self.bound[alias.asname or alias.name] = submodule
                continue
            self.edges.add(source)
            if _is_private(alias.name):
                self.private.append(f"line {node.lineno}: from {source} import {alias.name}")

    def _import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] != ROOT_NAME:
                continue
            self.edges.add(alias.name)
            if alias.asname:
                self.bound[alias.asname] = alias.name
            else:
                self.bound[ROOT_NAME] = ROOT_NAME

    def private_attributes(self) -> list[str]:
        """`module._name` uses, where `_name` is not a submodule of `module`."""
        found = []
        for node in _outside_type_checking(TREES[self.module]):
            if not isinstance(node, ast.Attribute) or isinstance(node.ctx, ast.Store):
                continue
            chain = []
            value: ast.AST = node
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if not isinstance(value, ast.Name) or value.id not in self.bound:
                continue
            module = self.bound[value.id]
            for attr in reversed(chain):
                if f"{module}.{attr}" in SOURCES:
                    module = f"{module}.{attr}"
                    continue
                if _is_private(attr):
                    found.append(f"line {node.lineno}: {module}.{attr}")
                break
        return sorted(set(found))


IMPORTS = {module: _Imports(module) for module in SOURCES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first search meets (each reported once, as a path)."""
    found, state = [], dict.fromkeys(graph, 0)  # 0 new, 1 on the path, 2 done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt, 2) == 1:
                found.append([*path[path.index(nxt) :], nxt])
            elif state.get(nxt) == 0:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if state[node] == 0:
            visit(node)
    return found


def test_the_import_graph_has_no_cycle():
    graph = {m: {e for e in imp.edges if e in SOURCES and e != m} for m, imp in IMPORTS.items()}
    assert sum(map(len, graph.values())) > 20  # the graph was read
    assert _cycles(graph) == []


def test_the_cycle_finder_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_no_module_uses_another_modules_private_names(module):
    imports = IMPORTS[module]
    assert imports.private + imports.private_attributes() == []


def test_the_private_name_check_sees_a_violation():
    code = "from optax_accum import _checks, state as s\nx = s._find\ny = _checks.int32\n"
    TREES["optax_accum._probe"] = ast.parse(code)
    SOURCES["optax_accum._probe"] = PACKAGE / "_probe.py"
    try:
        imports = _Imports("optax_accum._probe")
        assert imports.private_attributes() == ["line 2: optax_accum.state._find"]
        TREES["optax_accum._probe"] = ast.parse("from optax_accum.accumulator import _x\n")
        assert _Imports("optax_accum._probe").private == [
            "line 1: from optax_accum.accumulator import _x"
        ]
    finally:
        del TREES["optax_accum._probe"], SOURCES["optax_accum._probe"]


# --------------------------------------------------------------------------- public surface

PUBLIC = sorted(
    m
    for m in SOURCES
    if not any(_is_private(part) for part in m.split("."))
    and not m.startswith((f"{ROOT_NAME}.demo", f"{ROOT_NAME}.ray"))
)


def _defined_names(tree: ast.Module) -> set[str]:
    """The names a module's top level defines (imports aside)."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _reexported_names(tree: ast.Module) -> set[str]:
    """The public names a module imports from the package's private modules: a state
    type lives in the private module that builds it and is re-exported from here."""
    return {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{ROOT_NAME}._")
        for alias in node.names
        if not _is_private(alias.name)
    }


def _declared_all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    return []


@pytest.mark.parametrize("module", [m for m in PUBLIC if m not in PACKAGES])
def test_a_public_module_defines_its_all_and_only_private_names_besides(module):
    tree = TREES[module]
    public = {n for n in _defined_names(tree) if not n.startswith("_")}
    assert public | _reexported_names(tree) == set(_declared_all(tree))


def test_the_public_modules_together_export_exactly_optax_accum_all():
    exported = [n for m in PUBLIC if m != ROOT_NAME for n in _declared_all(TREES[m])]
    assert sorted(exported) == sorted(optax_accum.__all__)
    assert len(set(optax_accum.__all__)) == len(optax_accum.__all__)


def test_the_ray_extra_exports_exactly_its_all():
    ray_package = pytest.importorskip("optax_accum.ray")
    public = {n for n in vars(ray_package) if not n.startswith("_")}
    assert public == set(ray_package.__all__)


def test_only_branch_chooses_a_form_per_backend():
    """`lax.platform_dependent` (a form only XLA:CPU needs) lives in _branch.py alone."""
    users = sorted(
        m
        for m, tree in TREES.items()
        if any(
            isinstance(n, ast.Attribute | ast.Name)
            and "platform_dependent" in (getattr(n, "attr", None), getattr(n, "id", None))
            for n in ast.walk(tree)
        )
    )
    assert users == [f"{ROOT_NAME}._branch"]


# --------------------------------------------------------------------------- explicit steps


def _implicit_channels(tree: ast.AST) -> list[str]:
    """What passes information around a function's signature: a context variable, a
    match by identity (`id(...)`, or `is` against anything but None, True, False or an
    `inspect.Parameter` kind), a walk up the Python call stack."""
    found = []
    for node in ast.walk(tree):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(n.split(".")[0] == "contextvars" or n == "ContextVar" for n in names):
                found.append(f"{where}: contextvars")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "id":
            found.append(f"{where}: id()")
        elif isinstance(node, ast.Attribute) and (
            node.attr in ("_getframe", "f_back", "currentframe")
            or (node.attr == "stack" and getattr(node.value, "id", None) == "inspect")
        ):
            found.append(f"{where}: {node.attr}")
        elif isinstance(node, ast.Compare):
            for op, other in zip(node.ops, node.comparators, strict=True):
                constant = isinstance(other, ast.Constant) and other.value in (None, True, False)
                kind = isinstance(other, ast.Attribute) and "Parameter" in ast.unparse(other)
                if isinstance(op, ast.Is | ast.IsNot) and not (constant or kind):
                    found.append(f"{where}: {ast.unparse(node)}")
    return found


# The transforms and what they share: the host accumulators (Python objects under a
# lock, `host/`, `ray/`) and the demo are not steps of a traced program.
STEP_MODULES = sorted(
    m for m in TREES if not m.startswith(tuple(f"{ROOT_NAME}.{p}" for p in ("host", "ray", "demo")))
)


@pytest.mark.parametrize("module", STEP_MODULES)
def test_a_step_gets_what_it_needs_as_arguments(module):
    """No context variable, no match by identity, no frame walk (issue 36): what an
    inner transform needs from its wrapper arrives as arguments or return values
    (`optax_accum._protocol`)."""
    assert _implicit_channels(TREES[module]) == []


def test_the_explicit_step_check_sees_each_channel():
    code = (
        "import contextvars\n"
        "from contextvars import ContextVar\n"
        "x = id(y)\n"
        "z = a is b\n"
        "f = sys._getframe(1).f_back\n"
        "ok = a is None or p.kind is inspect.Parameter.VAR_KEYWORD\n"
    )
    assert [f.split(": ")[1] for f in _implicit_channels(ast.parse(code))] == [
        "contextvars",
        "contextvars",
        "id()",
        "a is b",
        "f_back",
        "_getframe",
    ]


# --------------------------------------------------------------------------- room sizes

MAX_LINES = 600


def _relative(path: pathlib.Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def _line_counts() -> dict[str, int]:
    return {_relative(p): len(p.read_text().splitlines()) for p in SOURCES.values()}


def test_no_module_is_over_600_lines():
    counts = _line_counts()
    assert len(counts) > 20  # the package was read
    over = {path: n for path, n in counts.items() if n > MAX_LINES}
    assert over == {}


def _ranked_worse_than_c(source: str) -> list[str]:
    """The functions, methods and classes radon rates D, E or F, with their rating."""
    from radon.complexity import cc_rank, cc_visit  # the test extra's, not the library's

    return [
        f"line {block.lineno}: {block.name} {cc_rank(block.complexity)} ({block.complexity})"
        for block in cc_visit(source)
        if cc_rank(block.complexity) > "C"
    ]


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_radon_rates_no_function_worse_than_c(module):
    assert _ranked_worse_than_c(SOURCES[module].read_text()) == []


def test_the_complexity_check_sees_a_tangled_function():
    branches = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(21))
    assert _ranked_worse_than_c(f"def tangled(x):\n{branches}    return -1\n") == [
        "line 1: tangled D (22)"
    ]
    assert _ranked_worse_than_c("def plain(x):\n    return x\n") == []
