"""The shape of gpukit's imports: they run one way (no module imports, however indirectly, one that imports it),
the library never reaches up into the lessons nor into a package's own face, and a private name stays in its module.

Device: CPU. The source is read with ``ast``: the walk imports nothing, and makes no tensor.

What counts as an import of a module: ``import gpukit.x``, ``from gpukit.x import name`` and ``from . import x`` (a
submodule: that module, not the package it sits in, whose own code has run already), wherever the statement stands:
at the top of a module or inside a function. An import inside a function still runs the other module's code, and
still makes the two modules know each other, so it counts as much as one at the top: no exception is needed today,
and none is listed.
"""

import ast
import collections
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gpukit"
LESSONS = "gpukit.lessons"

# Private names imported across modules, each with why it cannot be public in its module or move where it is used.
# (``gpukit._torch`` is left out: it is the one home of PyTorch's private names, and its own names are the package's.)
PRIVATE_IMPORTS_ALLOWED: dict[tuple[str, str, str], str] = {}
MOST_PRIVATE_IMPORTS_ALLOWED = 10


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@dataclass(frozen=True)
class Import:
    importer: str
    module: str  # the gpukit module whose code must have run
    name: str | None  # the name taken from it; None for the module itself
    line: int
    in_function: bool

    def __str__(self) -> str:
        what = f"{self.module}.{self.name}" if self.name else self.module
        return f"{self.importer} imports {what} (line {self.line}{', in a function' if self.in_function else ''})"


def _imports(importer: str) -> list[Import]:
    path = MODULES[importer]
    tree = ast.parse(path.read_text())
    in_functions = {id(node) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for node in ast.walk(f)}
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        inside = id(node) in in_functions
        if isinstance(node, ast.Import):
            found += [Import(importer, a.name, None, node.lineno, inside) for a in node.names if a.name in MODULES]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for a in node.names:
                if f"{source}.{a.name}" in MODULES:
                    found.append(Import(importer, f"{source}.{a.name}", None, node.lineno, inside))
                elif source in MODULES:
                    found.append(Import(importer, source, a.name, node.lineno, inside))
    return [i for i in found if i.module != importer]


IMPORTS = {m: _imports(m) for m in MODULES}


def _cycles() -> list[list[str]]:
    """One shortest cycle through each strongly connected set of modules (Tarjan's algorithm, then a search)."""
    graph = {m: sorted({i.module for i in IMPORTS[m]}) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
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

    for v in graph:
        if v not in index:
            connect(v)
    cycles = []
    for component in components:
        inside, start = set(component), component[0]
        came_from: dict[str, str] = {}
        queue = collections.deque([start])
        while queue:
            v = queue.popleft()
            if start in graph[v] and v in inside:
                path = [v]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                cycles.append([start, *reversed(path[:-1]), start])
                break
            for w in graph[v]:
                if w in inside and w not in came_from and w != start:
                    came_from[w] = v
                    queue.append(w)
    return cycles


def _edge(a: str, b: str) -> str:
    """How ``a`` imports ``b``: the names and the lines, a line inside a function marked with ``f``."""
    found = [i for i in IMPORTS[a] if i.module == b]
    names = sorted({i.name or "(the module)" for i in found})
    lines = sorted({f"{i.line}{'f' if i.in_function else ''}" for i in found}, key=lambda x: int(x.rstrip("f")))
    return f"{a} -> {b}: {', '.join(names)} (line {', '.join(lines)})"


def test_the_walk_sees_gpukits_modules_and_their_imports():
    assert {"gpukit", "gpukit.meter", "gpukit.counter.mode", "gpukit.plan.search"} <= set(MODULES)
    assert any(i.module == "gpukit.meter" and i.name == "measure" for i in IMPORTS["gpukit"])
    assert any(i.module == "gpukit.plan.host" and i.name is None for i in IMPORTS["gpukit.plan.search"])
    assert any(i.in_function for m in MODULES for i in IMPORTS[m])  # imports inside functions are read too


def test_imports_run_one_way():
    cycles = _cycles()
    named = ["\n".join([" -> ".join(c)] + [f"  {_edge(a, b)}" for a, b in zip(c, c[1:])]) for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(named)


def test_a_cycle_would_be_found_and_named():
    saved = IMPORTS["gpukit.report"]
    IMPORTS["gpukit.report"] = saved + [Import("gpukit.report", "gpukit.meter", "measure", 1, True)]
    try:
        (cycle,) = _cycles()
        assert cycle[0] == cycle[-1] and {"gpukit.report", "gpukit.meter"} <= set(cycle)
    finally:
        IMPORTS["gpukit.report"] = saved


def test_the_library_never_reaches_up_into_the_lessons_nor_into_its_own_package():
    """The lessons sit above the library, as the notebooks do (and may use ``import gpukit`` as a notebook does);
    a library module imports what it needs from the module that owns it, never from a package's face."""
    up = [str(i) for m in MODULES if not m.startswith(LESSONS) for i in IMPORTS[m]
          if i.module.startswith(LESSONS) or m.startswith(i.module + ".")]
    assert up == []


def test_every_module_says_its_one_job_in_its_first_line():
    silent = [m for m, p in MODULES.items() if not (ast.get_docstring(ast.parse(p.read_text())) or "").strip()]
    assert silent == []


def _is_private(name: str | None) -> bool:
    return bool(name) and name.startswith("_") and not name.startswith("__")


def _module_attributes(importer: str) -> list[Import]:
    """Names read from a module imported whole (``from . import host``, then ``host.name``)."""
    whole = {}
    tree = ast.parse(MODULES[importer].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                whole.update({a.asname or a.name: i.module for i in IMPORTS[importer] if i.line == node.lineno
                              and i.name is None and i.module.rpartition(".")[2] == a.name})
        elif isinstance(node, ast.Import):
            whole.update({a.asname or a.name: a.name for a in node.names
                          if a.name in MODULES and (a.asname or "." not in a.name)})
    return [Import(importer, whole[n.value.id], n.attr, n.lineno, False) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in whole]


def _private_imports() -> list[Import]:
    return [i for m in MODULES for i in IMPORTS[m] + _module_attributes(m)
            if _is_private(i.name) and i.module != "gpukit._torch"]


def test_a_private_name_is_one_imported_or_read_from_another_module():
    assert _is_private("_Search") and not _is_private("Search") and not _is_private("__version__")
    read = {(i.module, i.name) for i in _module_attributes("gpukit.plan.search")}
    assert ("gpukit.plan.host", "host_bound") in read  # from . import host as host_steps; host_steps.host_bound(...)


def test_a_private_name_stays_in_its_module():
    found = {(i.importer, i.module, i.name): str(i) for i in _private_imports()}
    assert sorted(v for k, v in found.items() if k not in PRIVATE_IMPORTS_ALLOWED) == []
    assert sorted(set(PRIVATE_IMPORTS_ALLOWED) - set(found)) == []  # an exception no longer needed goes
    assert len(PRIVATE_IMPORTS_ALLOWED) <= MOST_PRIVATE_IMPORTS_ALLOWED
