"""The import graph follows the layers that docs/architecture.md draws, and has no circle.

Two levels are checked, both read from the source with ``ast`` (nothing is imported to find the edges):

- **packages**: the units are gradcomp's sub-packages (``wire``, ``compressors``, ``schemes``, ...) and its
  top-level modules (``errors``, ``feedback``, ``registry``, ...). A unit may import only units of lower
  layers (``LAYERS`` below, lowest first); so the unit graph has no circle. This is the level that matters at
  run time: importing ``gradcomp.compressors.base`` runs ``gradcomp/compressors/__init__.py`` first, so a
  module that imports a package's module depends on the whole package's ``__init__``.
- **modules**: no module imports one that (directly or not) imports it back.

Every ``import`` statement counts, including those inside functions and under ``TYPE_CHECKING`` (a lazy import
hides a circle, it does not remove it). ``gradcomp/__init__.py`` is the unit ``gradcomp``: the public facade,
which re-exports from the layers below it; modules inside gradcomp do not import it (``from gradcomp import
kernels`` names the sub-package ``kernels``, not the facade).
"""

from __future__ import annotations

import ast
from pathlib import Path

import gradcomp

ROOT = Path(gradcomp.__file__).parent

# The layers, lowest first: a unit may import units of strictly lower layers; units of one layer are
# independent of each other. To move a unit, or to add one, edit its line here (and the picture in
# docs/architecture.md, "Layers").
LAYERS: list[tuple[str, ...]] = [
    ("errors",),
    ("allocator", "finite", "netmodel", "step_state"),  # leaves: glibc's allocator, NaN checks, the α–β model, the
    # state of the step a thread runs
    ("kernels",),  # compiled CPU kernels
    ("wire",),  # bits and bytes, the container
    ("compressors",),  # Slot, the Compressor interface, the methods, and state.py: per-slot state, momentum arithmetic
    ("feedback",),  # wrappers of any compressor: error feedback, momentum correction
    ("transport",),  # process group / simulated cluster, and the request vocabulary with its blocking driver
    ("protocols",),  # reusable rounds (sub-generators of requests)
    ("schemes",),  # methods that own their rounds
    ("registry",),  # name → method
    ("train",),  # GradientExchange, GradientAggregator, the DDP hook
    ("gradcomp",),  # the package's __init__: the public facade
    ("experiments",),  # the lab: training runs, bench, race, sweeps
    ("cli",),
]

# Units that LAYERS places but that this checkout may not have yet (another branch adds them).
PENDING: set[str] = set()

# Imports against the layers that are known and being removed: (importer, imported) → why. A pair listed
# here that the code no longer has fails the test, so that the list shrinks as the code is fixed.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imported_all(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        for target in names:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target:
                found.add(target)
    return found


def module_graph() -> dict[str, set[str]]:
    """Module → the gradcomp modules it imports (itself and its own parent packages left out)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {
            t for t in _imported_all(name, path, modules) if t != name and not name.startswith(t + ".")
        }
    return graph


def unit_of(module: str) -> str:
    """``gradcomp.schemes.sketch`` → ``schemes``; ``gradcomp.errors`` → ``errors``; ``gradcomp`` → ``gradcomp``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def unit_graph(modules: dict[str, set[str]]) -> dict[str, dict[str, set[str]]]:
    """Unit → imported unit → the modules of the importer that import it (for the error message)."""
    graph: dict[str, dict[str, set[str]]] = {unit_of(m): {} for m in modules}
    for module, targets in modules.items():
        for target in targets:
            a, b = unit_of(module), unit_of(target)
            if a != b:
                graph[a].setdefault(b, set()).add(module)
    return graph


def layer_violations(
    graph: dict[str, dict[str, set[str]]], layers: list[tuple[str, ...]]
) -> list[tuple[str, str, set[str]]]:
    """The imports (importer, imported, importing modules) that do not go to a strictly lower layer."""
    level = {unit: i for i, group in enumerate(layers) for unit in group}
    return [
        (a, b, modules)
        for a, targets in sorted(graph.items())
        for b, modules in sorted(targets.items())
        if level[b] >= level[a]
    ]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


# ----------------------------------------------------------------------------------------------- the tests


def test_every_unit_has_a_layer():
    units = set(unit_graph(module_graph()))
    placed = [unit for group in LAYERS for unit in group]
    assert len(placed) == len(set(placed)), "a unit is in two layers"
    missing = sorted(units - set(placed))
    assert not missing, f"gradcomp units in no layer: {missing}; add each to LAYERS in tests/test_imports.py"
    stale = sorted(set(placed) - units - PENDING)
    assert not stale, f"LAYERS names units that do not exist: {stale}"


def test_the_picture_in_the_docs_is_the_list_checked_here():
    """docs/architecture.md's "Layers" picture, read top to bottom, names the units of ``LAYERS`` in the same
    layers and order (highest first there): the page cannot drift from what this file enforces."""
    text = (ROOT.parent.parent / "docs" / "architecture.md").read_text()
    picture = text.split("## Layers: the direction of imports", 1)[1].split("```", 2)[1]
    drawn = []
    for line in picture.strip().splitlines():
        units = line.split("   ")[0].strip()  # the units, then a gap of spaces, then what the layer is
        drawn.append(tuple(u.strip().split(" ")[0] for u in units.split("·")))
    assert drawn[::-1] == LAYERS


def test_packages_follow_the_layers():
    graph = unit_graph(module_graph())
    wrong = [(a, b, m) for a, b, m in layer_violations(graph, LAYERS) if (a, b) not in KNOWN_EXCEPTIONS]
    assert not wrong, "imports against the layers (importer -> imported, by):\n" + "\n".join(
        f"  {a} -> {b}  ({', '.join(sorted(m))})" for a, b, m in wrong
    )
    stale = sorted(set(KNOWN_EXCEPTIONS) - {(a, b) for a, b, _ in layer_violations(graph, LAYERS)})
    assert not stale, f"KNOWN_EXCEPTIONS lists imports the code no longer has: {stale}; delete them"


def test_no_circle_between_packages():
    graph = {a: set(targets) - {b for (x, b) in KNOWN_EXCEPTIONS if x == a} for a, targets in
             unit_graph(module_graph()).items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import circle between packages: " + " -> ".join(cycle)


def test_no_circle_between_modules():
    graph = module_graph()
    # the facade re-exports everything; a submodule importing a sibling is not importing it back
    graph["gradcomp"] = set()
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_request_vocabulary_lives_with_the_transport():
    """protocols/ and schemes/ both yield requests: defined below both, so neither imports the other for it."""
    modules = module_graph()
    assert "gradcomp.transport.requests" in modules
    assert "gradcomp.schemes.requests" not in modules
    assert not any(unit_of(t) == "schemes" for m, ts in modules.items() if unit_of(m) == "protocols" for t in ts)


def test_the_checkers_see_a_circle_and_an_upward_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    layers = [("low",), ("mid", "side"), ("high",)]
    graph = {"low": {}, "mid": {"low": {"m.x"}}, "side": {"mid": {"m.y"}}, "high": {"low": {"m.z"}, "mid": {"m.z"}}}
    assert [(a, b) for a, b, _ in layer_violations(graph, layers)] == [("side", "mid")]
    graph["low"] = {"high": {"m.w"}}
    assert [(a, b) for a, b, _ in layer_violations(graph, layers)] == [("low", "high"), ("side", "mid")]


def test_the_reader_resolves_each_form_of_import(tmp_path):
    modules = {n: tmp_path for n in ("gradcomp", "gradcomp.kernels", "gradcomp.wire", "gradcomp.wire.bits",
                                     "gradcomp.errors", "gradcomp.schemes", "gradcomp.schemes.base")}
    source = tmp_path / "m.py"
    source.write_text(
        "import gradcomp.wire.bits\n"
        "from gradcomp import kernels\n"
        "from gradcomp.errors import ConfigError\n"
        "def f():\n    from . import base\n    from ..wire import bits\n"
    )
    found = _imported_all("gradcomp.schemes.sketch", source, modules)
    assert found == {"gradcomp.wire.bits", "gradcomp.kernels", "gradcomp.errors", "gradcomp.schemes.base"}


def test_every_gradcomp_import_names_a_module_that_exists():
    """``from gradcomp.a.b import c`` needs a module ``gradcomp.a.b`` (or ``gradcomp.a.b.c``): a module that moved
    leaves no import behind that only fails when its (lazy) import finally runs."""
    modules = _modules()
    missing = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - (node.level - 1)] + ([base] if base else []))
                wanted = [base] if base.startswith("gradcomp") else []
            elif isinstance(node, ast.Import):
                wanted = [a.name for a in node.names if a.name.startswith("gradcomp")]
            else:
                continue
            missing += [f"{name}: {w}" for w in wanted if w not in modules]
    assert not missing, "imports of modules that do not exist: " + ", ".join(missing)


def test_the_training_run_does_not_import_the_studies_around_it():
    """experiments/run/ (one training run) is what race/, bench/ and study/ build on; it imports none of them."""
    graph = module_graph()
    above = ("gradcomp.experiments.race", "gradcomp.experiments.bench", "gradcomp.experiments.study")
    back = sorted(
        f"{m} -> {t}" for m, ts in graph.items() if m.startswith("gradcomp.experiments.run.")
        for t in ts if t.startswith(above)
    )
    assert not back, "experiments/run imports what builds on it: " + ", ".join(back)
