"""The package's folders are its layers: imports only go down, no file imports itself back.

docs/design/architecture.md has the map. Each folder (or top-level module) of ``src/zbpipe`` has
a layer; a module may import from its own folder or from a lower layer, never from a higher one,
and the files import no circle (a ``TYPE_CHECKING`` import and an import inside a function count
too: both are the same dependency, paid later). The checks read the source with :mod:`ast`, so
they need no torch; each is also run on a small hand-made package where it must find the fault.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

#: layer of each folder / top-level module (docs/design/architecture.md): lower never imports higher
LAYERS: dict[str, int] = {
    "planning": 0,  # plans, costs, simulator: pure Python
    "_compat": 1,  # every private torch name
    "patching": 1,  # the one way zbpipe replaces someone else's attribute
    "testing": 1,  # multi-process launcher and tiny models (no zbpipe import)
    "memory": 2,  # saved tensors, meter, probe
    "engines": 3,  # how B and W run
    "observe": 4,  # traces, timelines, pictures, measured costs, rank agreement
    "schedules": 5,  # public classes, runtime, seam, sends, inputs, validation, re-planning
    "continuous": 6,  # the flush-free schedule
    "integrations": 7,  # schedule names, torch's plans, torchtitan
    "torchtitan": 7,  # the public name of integrations.torchtitan
    "backward": 8,  # public shim
    "cli": 8,
    "demo": 8,
    "__init__": 8,
    "__main__": 8,  # python -m zbpipe: the command line
}

#: limits a module or a function may pass only with a reason ("Long because ...") in its docstring
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_edges(root: Path, package: str) -> dict[str, set[str]]:
    """{module: modules of ``package`` it imports}, from every import statement anywhere in it.

    ``from X import name`` depends on ``X.name`` where that is a module, else on ``X``.
    """
    files = {_module_name(root, p): p for p in (root / package).rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for module, path in files.items():
        is_pkg = path.name == "__init__.py"
        here = module.split(".") if is_pkg else module.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                stem = ".".join(base + ([node.module] if node.module else []))
                targets = [
                    f"{stem}.{a.name}" if f"{stem}.{a.name}" in files else stem for a in node.names
                ]
            else:
                continue
            deps |= {t for t in targets if t.split(".")[0] == package and t != module}
        edges[module] = deps | {name for name in named_imports(path) if name in files}
    return edges


#: module-level names whose strings are modules imported later (a lazy table, a preload list)
IMPORT_TABLES = ("_LAZY", "PRELOAD")


def named_imports(path: Path) -> set[str]:
    """Modules a file imports by a string: ``importlib.import_module("x")``, ``__import__("x")``
    and the strings of its :data:`IMPORT_TABLES` (values of a dict, items of a tuple or list)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__") and node.args:
                found |= _strings(node.args[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(getattr(t, "id", "") in IMPORT_TABLES for t in targets) and node.value:
                found |= _strings(node.value)
    return found


def _strings(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Dict):
        return {s for v in node.values if v is not None for s in _strings(v)}
    if isinstance(node, (ast.Tuple, ast.List)):
        return {s for v in node.elts for s in _strings(v)}
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    return set()


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


#: upward references allowed, each with its reason
ALLOWED_UPWARD: dict[tuple[str, str], str] = {
    ("zbpipe.testing.launch", "zbpipe.schedules.runtime"): (
        "the fork server's preload list: importing it before forking saves every rank the import "
        "(an optimisation the launcher works without), not a dependency"
    ),
    ("zbpipe.testing.launch", "zbpipe.engines.native.preload"): (
        "the fork server's preload list: loading the native weight capture before forking saves "
        "every rank the load (an optimisation the launcher works without), not a dependency"
    ),
}


def layer_violations(
    edges: dict[str, set[str]], layers: dict[str, int], allowed: Iterable[tuple[str, str]] = ()
) -> list[str]:
    """Every import of a module from a higher layer, as 'importer -> imported (layer a < b)'."""
    missing = sorted({_unit(m) for m in edges} - set(layers))
    assert not missing, f"give these folders / top-level modules a layer: {missing}"
    out = []
    for module, deps in sorted(edges.items()):
        mine = layers[_unit(module)]
        for dep in sorted(deps):
            theirs = layers[_unit(dep)]
            if _unit(dep) != _unit(module) and theirs > mine and (module, dep) not in allowed:
                out.append(f"{module} -> {dep} (layer {mine} imports layer {theirs})")
    return out


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def too_long_without_reason(root: Path, package: str) -> list[str]:
    """Modules over MAX_MODULE_LINES and functions over MAX_FUNCTION_LINES whose docstring does
    not say why ("Long because ...")."""
    out = []
    for path in sorted((root / package).rglob("*.py")):
        tree = ast.parse(path.read_text())
        n = len(path.read_text().splitlines())
        if n > MAX_MODULE_LINES and "Long because" not in (ast.get_docstring(tree) or ""):
            out.append(f"{path.relative_to(root)}: {n} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_FUNCTION_LINES and "Long because" not in (
                    ast.get_docstring(node) or ""
                ):
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {size} lines")
    return out


def test_every_folder_and_top_level_module_has_a_layer():
    names = {p.stem if p.is_file() else p.name for p in (SRC / "zbpipe").iterdir()}
    names = {n for n in names if n != "__pycache__"}
    assert names == set(LAYERS), f"give these a layer in LAYERS and docs: {names ^ set(LAYERS)}"


def test_no_module_imports_from_a_higher_layer():
    assert layer_violations(import_edges(SRC, "zbpipe"), LAYERS, ALLOWED_UPWARD) == []


def test_every_module_named_in_a_string_exists():
    """A lazy table or preload list naming a moved module would fail late (or, for the fork
    server's preload, silently): every such string must name a module that exists."""
    files = {_module_name(SRC, p) for p in (SRC / "zbpipe").rglob("*.py")}
    named = {n for p in (SRC / "zbpipe").rglob("*.py") for n in named_imports(p)}
    assert {n for n in named if n.startswith("zbpipe")} - files == set()


def test_the_architecture_map_gives_every_folder_its_layer():
    table = (SRC.parent / "docs" / "design" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d) \| (.+?) \|", table, flags=re.M)
    documented = {
        name.strip("`/").removesuffix(".py"): int(layer)
        for layer, cell in rows
        for name in cell.split(", ")
    }
    assert documented == LAYERS


def test_no_import_circle_between_files():
    assert import_cycles(import_edges(SRC, "zbpipe")) == []


def test_long_modules_and_functions_say_why():
    assert too_long_without_reason(SRC, "zbpipe") == []


#: hard limit on a module's length, reason or not (issue 36)
HARD_MODULE_LINES = 600


def test_no_module_is_over_the_hard_limit():
    long = {
        str(p.relative_to(SRC)): n
        for p in (SRC / "zbpipe").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > HARD_MODULE_LINES
    }
    assert long == {}, f"split these modules (over {HARD_MODULE_LINES} lines): {long}"


def test_no_two_modules_share_a_file_name():
    """A file name says which module it is: ``choose.py`` in two folders said nothing."""
    seen: dict[str, list[str]] = {}
    for p in (SRC / "zbpipe").rglob("*.py"):
        if p.name != "__init__.py":
            seen.setdefault(p.name, []).append(str(p.relative_to(SRC)))
    assert {n: ps for n, ps in seen.items() if len(ps) > 1} == {}


def attributes_defined(path: Path) -> set[str]:
    """Methods and annotated attributes of the classes in ``path``, and ``self.x`` it assigns."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            for f in node.body:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.add(f.name)
                elif isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name):
                    out.add(f.target.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            out.add(node.attr)
    return out


#: attribute names that zbpipe's higher layers define but that also name a builtin's, torch's or
#: a library's attribute, which lower layers read on those objects (a set's ``add``, a process
#: group's ``group``, scipy's ``status``, a queue's ``put``, a socket's ``bind``, a torch
#: ``SymInt``'s ``node``, a file's ``flush``, the ``install`` of a hooks module the Trainer run
#: server imports by name)
SHARED_ATTRIBUTE_NAMES = {
    "add",
    "clear",
    "group",
    "status",
    "put",
    "bind",
    "scale_grads",
    "node",
    "flush",
    "install",
}


def upward_attribute_uses(root: Path, package: str, layers: dict[str, int]) -> list[str]:
    """Attribute reads, writes and calls in a module of names that only classes of higher
    layers define: a call made through ``Any`` (a schedule's ``build_plan`` from observe/, say)
    that the import check cannot see, because nothing was imported."""
    files = {_module_name(root, p): p for p in (root / package).rglob("*.py")}
    defined = {m: attributes_defined(p) for m, p in files.items()}
    layer = {m: layers[_unit(m)] for m in files}
    out = []
    for module, path in sorted(files.items()):
        own = set().union(*(defined[m] for m in files if layer[m] <= layer[module]))
        higher = set().union(*(defined[m] for m in files if layer[m] > layer[module]))
        only_higher = higher - own - SHARED_ATTRIBUTE_NAMES
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in only_higher:
                out.append(f"{module}:{node.lineno} .{node.attr}")
    return out


def test_no_module_reaches_an_attribute_only_a_higher_layer_defines():
    assert upward_attribute_uses(SRC, "zbpipe", LAYERS) == []


@pytest.fixture
def toy(tmp_path: Path) -> Path:
    """A package ``toy`` with a low folder ``low`` and a high one ``high`` (high imports low)."""
    for folder in ("toy", "toy/low", "toy/high"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "toy/low/a.py").write_text("X = 1\n")
    (tmp_path / "toy/high/b.py").write_text("from ..low.a import X\n")
    return tmp_path


TOY_LAYERS = {"low": 0, "high": 1, "__init__": 2}


def test_the_layer_check_finds_an_upward_import(toy: Path):
    assert layer_violations(import_edges(toy, "toy"), TOY_LAYERS) == []
    (toy / "toy/low/a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from toy.high import b\n"
    )
    assert layer_violations(import_edges(toy, "toy"), TOY_LAYERS) == [
        "toy.low.a -> toy.high.b (layer 0 imports layer 1)"
    ]


@pytest.mark.parametrize(
    "source",
    [
        "import toy.high.b\n",
        "def f():\n    import importlib\n    return importlib.import_module('toy.high.b')\n",
        "PRELOAD = ('torch', 'toy.high.b')\n",
    ],
)
def test_the_layer_check_reads_every_form_of_import(toy: Path, source: str):
    (toy / "toy/low/a.py").write_text(source)
    assert layer_violations(import_edges(toy, "toy"), TOY_LAYERS) == [
        "toy.low.a -> toy.high.b (layer 0 imports layer 1)"
    ]
    allowed = [("toy.low.a", "toy.high.b")]
    assert layer_violations(import_edges(toy, "toy"), TOY_LAYERS, allowed) == []


def test_an_upward_import_in_a_package_init_is_found(toy: Path):
    (toy / "toy/low/__init__.py").write_text("from ..high import b\n")
    assert layer_violations(import_edges(toy, "toy"), TOY_LAYERS) == [
        "toy.low -> toy.high.b (layer 0 imports layer 1)"
    ]


def test_the_circle_check_finds_a_circle_inside_a_function(toy: Path):
    assert import_cycles(import_edges(toy, "toy")) == []
    (toy / "toy/high/c.py").write_text("def f():\n    from . import b\n")
    (toy / "toy/high/b.py").write_text("from ..low.a import X\nfrom .c import f\n")
    assert import_cycles(import_edges(toy, "toy")) == [["toy.high.b", "toy.high.c"]]


def test_the_length_check_wants_a_reason(toy: Path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (toy / "toy/low/a.py").write_text(f"def f():\n{body}")
    assert too_long_without_reason(toy, "toy") == [
        f"toy/low/a.py:1 f: {MAX_FUNCTION_LINES + 1} lines"
    ]
    (toy / "toy/low/a.py").write_text(f'def f():\n    """Long because it must."""\n{body}')
    assert too_long_without_reason(toy, "toy") == []


def test_the_upward_attribute_check_finds_a_call_through_any(toy: Path):
    (toy / "toy/high/b.py").write_text(
        "class Sched:\n    def build_plan(self):\n        return 1\n"
    )
    assert upward_attribute_uses(toy, "toy", TOY_LAYERS) == []
    (toy / "toy/low/a.py").write_text("def replan(sched):\n    return sched.build_plan()\n")
    assert upward_attribute_uses(toy, "toy", TOY_LAYERS) == ["toy.low.a:2 .build_plan"]
