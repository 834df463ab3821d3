"""The package's shape, read from its own imports: packages only at the root, each import going down
the documented layer order (docs/design.md, "Packages and layers"), no import circles, no command
importing another. Imports under `if TYPE_CHECKING:` are annotations only and not counted; imports
inside functions are (they still tie the modules together).

KNOWN lists the imports that still go against the order, each with why it is still there. An entry
that no longer exists fails the test too, so the list only shrinks."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lmtrace"

# bottom to top; packages on one line are siblings that must not import each other
LAYERS = [
    ["exits", "digest"],
    ["output"],
    ["spec"],
    ["features"],
    ["capture"],
    ["archive"],
    ["runner"],
    ["analysis"],
    ["viewdata"],
    ["query", "report", "serve"],
    ["commands"],
    ["cli"],
]
LAYER_OF = {pkg: i for i, names in enumerate(LAYERS) for pkg in names}

# importer -> imported: imports against the order that are still to be moved, and why they are there
KNOWN = {
    (
        "lmtrace.capture.probes",
        "lmtrace.archive.layout",
    ): "the probes fill arrays shaped by the archive's RunShape; the shape belongs below both"
}
KNOWN_CIRCLES: dict[frozenset[str], str] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    return skip


def import_graph() -> dict[str, set[str]]:
    """module -> the lmtrace modules it imports (a `from pkg import name` counts as pkg.name when that
    is a module, else as pkg)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = (
                    ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).rstrip(".")
                    if node.level
                    else (node.module or "")
                )
                if base.split(".")[0] == "lmtrace":
                    targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == "lmtrace"]
            for target in targets:
                target = resolve(target)
                if target and target not in (mod, "lmtrace"):
                    graph[mod].add(target)
    return graph


def top_package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_root_holds_packages_only():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert not loose, f"modules at lmtrace/'s root (put each in the package it belongs to): {loose}"
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(LAYER_OF), f"packages not in the layer order (docs/design.md): {packages ^ set(LAYER_OF)}"


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    wrong = set()
    for mod, targets in graph.items():
        src = top_package(mod)
        if src not in LAYER_OF:  # lmtrace/__init__ (the public names) and __main__
            continue
        for target in targets:
            dst = top_package(target)
            if dst == src:
                continue
            if LAYER_OF[dst] >= LAYER_OF[src]:
                wrong.add((mod, target))
    return wrong


def test_every_import_goes_down_the_layer_order():
    wrong = upward_imports(import_graph())
    unexplained = sorted(wrong - set(KNOWN))
    assert not unexplained, "imports against the layer order (docs/design.md): " + ", ".join(
        f"{a} -> {b}" for a, b in unexplained
    )
    assert not set(KNOWN) - wrong, f"KNOWN entries that no longer exist (remove them): {sorted(set(KNOWN) - wrong)}"


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_no_import_circles():
    circles = set(_circles(import_graph()))
    unexplained = circles - set(KNOWN_CIRCLES)
    assert not unexplained, "import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in unexplained)
    assert not set(KNOWN_CIRCLES) - circles, "KNOWN_CIRCLES entries that no longer exist (remove them)"


def test_no_command_imports_another():
    """`*_render` modules are a command's own terminal rendering, not commands."""
    wrong = [
        (mod, t)
        for mod, targets in import_graph().items()
        if mod.startswith("lmtrace.commands.")
        for t in targets
        if t.startswith("lmtrace.commands.") and not t.endswith("_render") and not mod.endswith("_render")
    ]
    assert not wrong, f"commands importing commands (move the shared piece below commands/): {wrong}"


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The checks can fail: an archive module importing a command is reported."""
    import shutil

    copy = tmp_path / "lmtrace"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "static", "vendor"))
    (copy / "archive" / "bad.py").write_text("from ..commands import ls\n")
    (copy / "spec" / "loop_a.py").write_text("from . import loop_b\n")
    (copy / "spec" / "loop_b.py").write_text("from . import loop_a\n")
    (copy / "report" / "sideways.py").write_text("from ..serve import guard\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE", copy)
    graph = import_graph()
    assert ("lmtrace.archive.bad", "lmtrace.commands.ls") in upward_imports(graph)
    assert ("lmtrace.report.sideways", "lmtrace.serve.guard") in upward_imports(graph)
    assert frozenset({"lmtrace.spec.loop_a", "lmtrace.spec.loop_b"}) in _circles(graph)


# modules over the size limit that are still to be split (path -> why it is still there)
KNOWN_LARGE: dict[str, str] = {}
MAX_MODULE_LINES = 500


def private_imports(package: Path) -> list[str]:
    """`from lmtrace.x import _name` anywhere in the package: a private name used by another module."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("lmtrace")):
                found += [
                    f"{path.relative_to(package.parent)}:{node.lineno} {alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    return found


def test_no_module_imports_another_modules_private_name():
    found = private_imports(PACKAGE)
    assert not found, f"private names imported from another module (make them public or move the code): {found}"


def test_no_module_is_over_500_lines():
    large = sorted(
        str(p.relative_to(PACKAGE.parent))
        for p in PACKAGE.rglob("*.py")
        if len(p.read_text().splitlines()) > MAX_MODULE_LINES
    )
    unexplained = [p for p in large if p not in KNOWN_LARGE]
    assert not unexplained, f"modules over {MAX_MODULE_LINES} lines (split them by what each part does): {unexplained}"


MAX_FUNCTION_LINES = 80
LONG_REASON = "Long because"


def long_functions(package: Path) -> list[tuple[str, int, bool]]:
    """(where, lines, whether its docstring starts with a reason) of every function or method over
    MAX_FUNCTION_LINES lines (from its `def` to its last line, decorators excluded)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    doc = (ast.get_docstring(node) or "").lstrip()
                    found.append(
                        (
                            f"{path.relative_to(package.parent)}:{node.lineno} {node.name}",
                            lines,
                            doc.startswith(LONG_REASON),
                        )
                    )
    return found


def test_every_function_over_80_lines_says_why_at_the_top_of_its_docstring():
    unexplained = [f"{where} ({n} lines)" for where, n, reason in long_functions(PACKAGE) if not reason]
    assert not unexplained, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them, or start the docstring with "
        f"`{LONG_REASON} ...`): {unexplained}"
    )


def test_the_long_function_check_sees_one_without_a_reason(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(
        f'def long():\n{body}\n\n\ndef explained():\n    """{LONG_REASON} it is a table."""\n{body}\n'
        f"\n\ndef short():\n    return 1\n"
    )
    assert [(w.split(" ")[1], reason) for w, _, reason in long_functions(tmp_path)] == [
        ("long", False),
        ("explained", True),
    ]
