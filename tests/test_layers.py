"""The package's dependencies point one way (README "Package layers").

Every import of a ``megatron_ssd`` module, at the top of a file, inside a function or
under ``if TYPE_CHECKING:``, must go to the same package or to a lower layer; the planner
imports nothing but the configuration, errors and units, and no third-party module at all
(it is pure arithmetic over measurements); the library (cache, I/O, planner, Megatron
integration) never imports the harness (the commands and the reference workloads). A new
module must be given a layer here, so this test also fails for a module nobody placed.
The repository's lab package (``megatron_ssd_lab``: the GPU check, the sizing tables, the
block-device throttle) is outside the wheel: no module of the package imports it when it
is imported, and the wheel built from setup.py holds none of it.
"""

from __future__ import annotations

import ast
import pathlib
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "megatron_ssd"
LAB_PACKAGE = "megatron_ssd_lab"
"""The repository's lab: run from a checkout, not shipped (setup.py)."""

LAYERS = {
    # foundations: the error types below everything, then modules importing only them
    "megatron_ssd.errors": -1,
    "megatron_ssd.units": 0,
    "megatron_ssd.placement": 0,
    "megatron_ssd.interruptible": 0,
    "megatron_ssd.tier": 1,
    "megatron_ssd.ranks": 1,
    "megatron_ssd.peer_rule": 1,
    # the configuration (which names the peers' rules and bounds them by peer_rule's)
    "megatron_ssd.config": 2,
    # the pure planner: measurements in, plans out
    "megatron_ssd.planner": 3,
    # I/O, measurement and metrics writers
    "megatron_ssd.io": 3,
    "megatron_ssd.metrics": 3,
    "megatron_ssd.memory": 4,
    # the tensor cache, above I/O
    "megatron_ssd.cache": 5,
    # what the adaptive planner runs before it plans (its profiling steps, the host-link
    # probe), then the adaptive planner: the cache's measurements into the pure planner
    "megatron_ssd.profiling": 3,
    "megatron_ssd.adaptive": 6,
    # the Megatron integration, then the CPU reference workloads built on it
    "megatron_ssd.megatron": 7,
    "megatron_ssd.workloads": 8,
    # the commands, above everything
    "megatron_ssd.commands": 9,
}
PLANNER_MAY_IMPORT = {"megatron_ssd.config", "megatron_ssd.errors", "megatron_ssd.peer_rule", "megatron_ssd.placement",
                      "megatron_ssd.tier", "megatron_ssd.units"}
LIBRARY = ("megatron_ssd.cache", "megatron_ssd.io", "megatron_ssd.planner", "megatron_ssd.megatron")
"""The product packages: what a Megatron-LM job imports."""
HARNESS = ("megatron_ssd.commands", "megatron_ssd.workloads")
"""The measurement harness: commands, reports, reference models and the step loop."""


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str | None:
    """The entry of LAYERS that ``module`` belongs to (its longest prefix)."""
    best = None
    for name in LAYERS:
        if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best)):
            best = name
    return best


def _is_module(name: str) -> bool:
    path = ROOT.parent / name.replace(".", "/")
    return path.is_dir() or path.with_suffix(".py").is_file()


def _under(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _imports(path: pathlib.Path, source: str | None = None):
    """``(line, module)`` for every import in ``path`` (or in ``source`` as if it were
    that file): ``ast.walk`` visits every node, so imports inside functions and under
    ``if TYPE_CHECKING:`` count like those at the top."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    text = path.read_text(encoding="utf-8") if source is None else source
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] if node.module or not node.level else [
                f"{target}.{a.name}" if _is_module(f"{target}.{a.name}") else target for a in node.names]
            for name in names:
                yield node.lineno, name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


MODULES = sorted(p for p in ROOT.rglob("*.py") if p != ROOT / "__init__.py")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_imports_point_down(path):
    module = _module_name(path)
    unit = _unit(module)
    assert unit is not None, f"{module} is in no layer: add it to LAYERS in tests/test_layers.py"
    wrong = []
    for line, target in _imports(path):
        if not target.startswith("megatron_ssd") or _under(target, (LAB_PACKAGE,)):
            continue  # the lab package: test_no_module_imports_the_lab_package_when_imported
        other = _unit(target)
        if target == "megatron_ssd" or other == unit:
            continue
        if other is None or LAYERS[other] >= LAYERS[unit]:
            wrong.append(f"line {line}: {target} (layer {LAYERS.get(other)}) from layer {LAYERS[unit]}")
    assert not wrong, f"{module} imports upward or sideways: {wrong}"


@pytest.mark.parametrize("path", sorted((ROOT / "planner").glob("*.py")), ids=lambda p: p.name)
def test_planner_is_pure(path):
    stdlib = set(sys.stdlib_module_names)
    wrong = []
    for line, target in _imports(path):
        if target.startswith("megatron_ssd"):
            if _unit(target) != "megatron_ssd.planner" and not any(
                    target == m or target.startswith(m + ".") for m in PLANNER_MAY_IMPORT):
                wrong.append(f"line {line}: {target}")
        elif target.split(".")[0] not in stdlib and target != "__future__":
            wrong.append(f"line {line}: {target} (third-party)")
    assert not wrong, f"planner/{path.name} is not pure: {wrong}"


def test_test_helpers_are_not_part_of_the_integration():
    """The CPU reference workloads (models, seeded data, the step loop, the local process
    spawner) live in megatron_ssd.workloads, not beside the Megatron integration."""
    integration = {p.stem for p in (ROOT / "megatron").glob("*.py")}
    assert not integration & {"harness", "models", "parallel", "spawn"}, integration


def _harness_imports(path: pathlib.Path, source: str | None = None):
    return [f"line {line}: {target}" for line, target in _imports(path, source) if _under(target, HARNESS)]


LIBRARY_MODULES = [p for p in MODULES if _under(_module_name(p), LIBRARY)]


@pytest.mark.parametrize("path", LIBRARY_MODULES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_the_library_never_imports_the_harness(path):
    """cache, io, planner and megatron import neither megatron_ssd.commands nor
    megatron_ssd.workloads, not even for type annotations."""
    wrong = _harness_imports(path)
    assert not wrong, f"{_module_name(path)} imports the harness: {wrong}"


def test_every_library_package_is_read():
    assert {_unit(_module_name(p)) for p in LIBRARY_MODULES} == set(LIBRARY)


@pytest.mark.parametrize("source, found", [
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..commands.train import TrainRecipe\n",
     ["line 3: megatron_ssd.commands.train"]),
    ("def f():\n    from ..workloads import models\n", ["line 2: megatron_ssd.workloads"]),
    ("from .. import commands\n", ["line 1: megatron_ssd.commands"]),
    ("import megatron_ssd.workloads.harness as h\n", ["line 1: megatron_ssd.workloads.harness"]),
    ("from ..config import Placement\nfrom .policy import PlacementPolicy\n", []),
])
def test_the_harness_check_reads_every_kind_of_import(source, found):
    """The reader behind the two checks above sees an import under ``if TYPE_CHECKING:``,
    inside a function, of a package by name and by absolute path."""
    assert _harness_imports(ROOT / "cache" / "planted.py", source) == found


def _import_graph(paths=MODULES):
    """Module -> the package modules it imports, every kind of import counted (top level,
    inside functions, under ``if TYPE_CHECKING:``)."""
    graph = {}
    for path in paths:
        module = _module_name(path)
        graph[module] = {t for _, t in _imports(path) if t.startswith("megatron_ssd") and _is_module(t) and t != module}
    return graph


def _circles(graph) -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    """No module reaches itself through imports, counting those made only for type
    annotations: a circle hidden from the runtime by ``TYPE_CHECKING`` still ties the two
    modules together for a reader."""
    assert _circles(_import_graph()) == []


def test_the_circle_check_sees_type_checking_imports(tmp_path):
    """Control: two planted modules importing each other, one only under TYPE_CHECKING."""
    pkg = ROOT / "io"
    a = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .planted_b import B\n", pkg / "planted_a.py")
    b = ("from .planted_a import A\n", pkg / "planted_b.py")
    graph = {_module_name(path): {t for _, t in _imports(path, source) if t.startswith("megatron_ssd")}
             for source, path in (a, b)}
    assert _circles(graph) == [["megatron_ssd.io.planted_a", "megatron_ssd.io.planted_b"]]


def _imports_at_import_time(path: pathlib.Path, source: str | None = None):
    """``(line, module)`` for the imports that run when ``path`` is imported: every import
    outside a function body (at the top, under ``if``/``try``, in a class body)."""
    tree = ast.parse(path.read_text(encoding="utf-8") if source is None else source)
    deferred = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                for n in ast.walk(f) if n is not f}
    text = path.read_text(encoding="utf-8") if source is None else source
    eager = {node.lineno for node in ast.walk(tree)
             if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in deferred}
    return [(line, target) for line, target in _imports(path, text) if line in eager]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_no_module_imports_the_lab_package_when_imported(path):
    """No module of megatron_ssd imports megatron_ssd_lab when it is imported, and the
    library (cache, io, planner, megatron) not at all: a command that needs a lab tool
    (``rok --throttle``) imports it inside the function that uses it, so the installed
    wheel works without the lab and says what is missing when such a flag is given."""
    every = [f"line {line}: {t}" for line, t in _imports(path) if _under(t, (LAB_PACKAGE,))]
    eager = [f"line {line}: {t}" for line, t in _imports_at_import_time(path) if _under(t, (LAB_PACKAGE,))]
    assert not eager, f"{_module_name(path)} imports the lab package when imported: {eager}"
    if _under(_module_name(path), LIBRARY):
        assert not every, f"{_module_name(path)} imports the lab package: {every}"


@pytest.mark.parametrize("source, found", [
    ("from megatron_ssd_lab.blkio import Throttle\n", [(1, "megatron_ssd_lab.blkio")]),
    ("try:\n    import megatron_ssd_lab\nexcept ImportError:\n    pass\n", [(2, "megatron_ssd_lab")]),
    ("def f():\n    from megatron_ssd_lab.blkio import Throttle\n", []),
])
def test_the_import_time_check_reads_every_kind_of_import(source, found):
    """Control for the check above: an import at the top or under ``try`` runs when the
    module is imported, one inside a function does not."""
    assert [(line, t) for line, t in _imports_at_import_time(ROOT / "commands" / "planted.py", source)
            if _under(t, (LAB_PACKAGE,))] == found


@pytest.mark.e2e
def test_the_wheel_holds_no_lab_module(checkout_wheel):
    """The wheel that setup.py builds (tests/conftest.py, from a copy of the sources, so
    nothing is written into the checkout) holds megatron_ssd and nothing of megatron_ssd_lab."""
    repo = ROOT.parent
    wheel = checkout_wheel
    names = zipfile.ZipFile(wheel).namelist()
    assert "megatron_ssd/__init__.py" in names and "megatron_ssd/commands/rok.py" in names
    lab = sorted(p.name for p in (repo / LAB_PACKAGE).glob("*.py"))
    assert {"gpu_check.py", "sizing_tables.py", "blkio.py"} <= set(lab)
    assert [n for n in names if n.startswith(LAB_PACKAGE) or n.rsplit("/", 1)[-1] in set(lab) - {"__init__.py"}] == []


MODULE_LINES_MAX = 600
"""The most lines a library module holds (CONTRIBUTING.md, "Size")."""
CLASS_LINES_MAX = 400
"""The most lines one class holds, its docstring and NOTE blocks included."""


def _sizes(source: str):
    """``(lines of the module, [(class, its lines)])`` of one module's source."""
    tree = ast.parse(source)
    classes = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    return len(source.splitlines()), classes


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_no_module_and_no_class_outgrows_its_limit(path):
    lines, classes = _sizes(path.read_text(encoding="utf-8"))
    assert lines <= MODULE_LINES_MAX, f"{path.name}: {lines} lines, more than {MODULE_LINES_MAX}: split it by job"
    large = [(name, n) for name, n in classes if n > CLASS_LINES_MAX]
    assert not large, f"{path.name}: classes over {CLASS_LINES_MAX} lines: {large}; give part of their job to another"


def test_the_size_check_counts_a_class_with_its_docstring_and_nested_classes():
    body = "\n".join(f"    x{i} = {i}" for i in range(CLASS_LINES_MAX))
    lines, classes = _sizes(f'class Big:\n    """Doc."""\n{body}\n\n\nclass Small:\n    class Inner:\n        pass\n')
    assert dict(classes) == {"Big": CLASS_LINES_MAX + 2, "Small": 3, "Inner": 2}
    assert lines == CLASS_LINES_MAX + 7
