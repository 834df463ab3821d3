"""The tests' own shape: tests/ mirrors the package (a directory per package of lmtrace/, each a Python
package), shared helpers live in tests/helpers/ or as fixtures in tests/conftest.py, and no test module
imports another test module (nor conftest.py), so a helper cannot end up inside a test file again."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "lmtrace"
HELPERS = "helpers"
# the only test modules directly in tests/: those about the package as a whole
WHOLE_PACKAGE = {"test_layers.py", "test_tests_shape.py"}


def _is_test_module(dotted: str) -> bool:
    """A test module or conftest, named as imported: `test_x`, `tests.archive.test_x`, `conftest`."""
    last = dotted.rpartition(".")[2]
    return last.startswith("test_") or last == "conftest"


def imports_of_test_modules(root: Path) -> list[tuple[str, int, str]]:
    """(file relative to root, line, what it imports) for every import of a test module or conftest
    under root, those inside functions included."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                # `from tests.cli import test_x` and `from . import test_x` import the module test_x
                names = [module] + [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            found += [
                (str(path.relative_to(root)), node.lineno, name) for name in names if name and _is_test_module(name)
            ]
    return found


def test_no_test_module_imports_another_test_module():
    wrong = imports_of_test_modules(TESTS)
    assert not wrong, (
        "test modules importing test modules or conftest (move the shared piece to tests/helpers/, "
        f"or make it a fixture in tests/conftest.py): {wrong}"
    )


def test_the_test_directories_mirror_the_packages():
    flat = sorted(p.name for p in TESTS.glob("test_*.py") if p.name not in WHOLE_PACKAGE)
    assert not flat, f"test modules directly in tests/ (move each into tests/<the package it tests>/): {flat}"
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    directories = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert directories - {HELPERS} <= packages, (
        f"test directories that are no package of lmtrace/: {directories - packages - {HELPERS}}"
    )
    assert not [p.name for p in (TESTS / HELPERS).glob("test_*.py")], "tests/helpers/ holds helpers, not tests"
    for directory in directories:  # tests.<dir>.test_x: the same file name may appear in two directories
        assert (TESTS / directory / "__init__.py").is_file(), f"tests/{directory}/ has no __init__.py"


def test_the_checker_sees_a_test_module_imported(tmp_path):
    """The check can fail: every way of importing a test module or conftest is reported."""
    (tmp_path / "archive").mkdir()
    (tmp_path / "archive" / "test_a.py").write_text("from tests.serve.test_b import LiveServer\nimport json\n")
    (tmp_path / "test_c.py").write_text("def test_x():\n    from tests.cli import test_d\n    import test_e\n")
    (tmp_path / "test_f.py").write_text(
        "from conftest import run_spec\nfrom .test_g import helper\nfrom tests.helpers.cli import lmtrace\n"
    )
    assert {(f, line) for f, line, _ in imports_of_test_modules(tmp_path)} == {
        ("archive/test_a.py", 1),
        ("test_c.py", 2),
        ("test_c.py", 3),
        ("test_f.py", 1),
        ("test_f.py", 2),
    }
