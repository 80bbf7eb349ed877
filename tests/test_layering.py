"""The architecture, enforced: who may import whom, no import cycles, no oversized module.

Imports are read with `ast` from every product module, wherever they stand:
module level, inside functions, and inside `if TYPE_CHECKING:` blocks.

- `shared/` and `native/` are the ground floor: they import no process package;
- the process packages (`coordinator/`, `ioworker/`, `gpuworker/`, `supervisor/`, `httpfront/`)
  never import one another: they meet only through `shared/` types and the wire;
- no import cycle between product modules;
- no Python file outside `tests/` over 450 lines;
- in `tests/`: every file is a test module (`test_*.py`), `conftest.py` or a helper in
  `tests/helpers/`; no test module imports another, nothing imports `conftest.py`, and helpers
  are imported only as `tests.helpers...`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROCESSES = ("coordinator", "ioworker", "gpuworker", "supervisor", "httpfront")
GROUND = ("shared", "native")
PRODUCT = (*PROCESSES, *GROUND, "instruments")
MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PRODUCT:
        for path in sorted((REPO / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


MODULES = _modules()


def imported_modules(source: str, here: str, *, is_package: bool = False, known: Collection[str] = MODULES) -> set[str]:
    """Every module the source of module `here` imports (absolute names; `from a import b` also
    counts `a.b` when that is a module in `known`)."""
    tree = ast.parse(source)
    package = here if is_package else here.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known)
    return names


def _top(name: str) -> str:
    return name.split(".")[0]


IMPORTS = {
    name: imported_modules(path.read_text(encoding="utf-8"), name, is_package=path.name == "__init__.py")
    for name, path in MODULES.items()
}


def find_cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Import cycles of a module graph (each as a path that returns to its start)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in graph.get(node, ()):
            if state.get(target) == 1:
                cycles.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_the_ground_floor_imports_no_process_package():
    wrong = {
        name: sorted(m for m in imports if _top(m) in PROCESSES)
        for name, imports in IMPORTS.items()
        if _top(name) in GROUND
    }
    assert not {name: found for name, found in wrong.items() if found}, (
        "shared/ and native/ must not import a process package"
    )


@pytest.mark.parametrize("package", PROCESSES)
def test_a_process_package_imports_no_other_process_package(package):
    wrong = {
        name: sorted(m for m in imports if _top(m) in PROCESSES and _top(m) != package)
        for name, imports in IMPORTS.items()
        if _top(name) == package
    }
    assert not {name: found for name, found in wrong.items() if found}, (
        f"{package}/ may reach other processes only through shared/ and the wire"
    )


@pytest.mark.parametrize(
    "entry", ["supervisor.main", "coordinator.main", "ioworker.main", "httpfront.main", "shared.cli_send"]
)
def test_a_process_that_never_computes_does_not_load_mlx(entry):
    """Every byte a process maps counts in the memory budget (coordinator/footprint.py): MLX (and
    mlx-lm, transformers) belong to the GPU worker alone."""
    code = f"import sys, {entry}; print(sorted(m for m in ('mlx', 'mlx_lm', 'transformers') if m in sys.modules))"
    found = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == "[]", f"{entry} loads {found.stdout.strip()}"


def test_no_import_cycle_between_product_modules():
    graph = {name: sorted(m for m in imports if m in MODULES and m != name) for name, imports in IMPORTS.items()}
    cycles = find_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def test_no_python_file_outside_tests_is_over_the_limit():
    sizes = {
        str(path.relative_to(REPO)): len(path.read_text(encoding="utf-8").splitlines())
        for path in REPO.rglob("*.py")
        if not {".venv", ".git", "tests", "build", ".cache"} & set(path.relative_to(REPO).parts)
    }
    assert sizes, "no Python files found"
    over = {path: lines for path, lines in sorted(sizes.items()) if lines > MAX_LINES}
    assert not over, f"files over {MAX_LINES} lines: {over}"


def test_the_readers_see_every_kind_of_import():
    """The checks above would miss nothing: TYPE_CHECKING, function-local and relative imports count."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from coordinator.residency import ExpertResidencyManager\n"
        "def later():\n    import gpuworker.lanes\n"
        "from . import checks\n"
        "from .plan import ExpertResidencyPlan\n"
    )
    found = imported_modules(source, "shared.probe")
    assert {"coordinator.residency", "gpuworker.lanes", "shared", "shared.checks", "shared.plan"} <= found
    assert find_cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": ["b"], "b": [], "c": ["a", "b"]}) == []


# ---------------------------------------------------------------------------------------------
# tests/: test modules import helpers from tests/helpers/, never from one another

TESTS = REPO / "tests"
HELPERS = "tests.helpers"
TEST_TREE = {_module_name(path): path for path in sorted(TESTS.rglob("*.py"))}


def _in_test_tree(name: str) -> str | None:
    """The tests/ module an import names: as `tests.x`, or as `x` (pytest puts tests/ on sys.path)."""
    return next((candidate for candidate in (name, f"tests.{name}") if candidate in TEST_TREE), None)


def wrong_test_imports(source: str, here: str, *, is_package: bool = False) -> list[str]:
    """What the source of tests/ module `here` imports from tests/ other than `tests.helpers...`
    (another test module, conftest, or a helper under another name)."""
    known = {*MODULES, *TEST_TREE, *(name.removeprefix("tests.") for name in TEST_TREE)}
    wrong = []
    for name in sorted(imported_modules(source, here, is_package=is_package, known=known)):
        target = _in_test_tree(name)
        if target is None or target == "tests":
            continue
        if name != target or not (name == HELPERS or name.startswith(f"{HELPERS}.")):
            wrong.append(name)
    return wrong


def _belongs_in_tests(path: Path) -> bool:
    """A test module or conftest.py directly in tests/, or anything in tests/helpers/."""
    if TESTS / "helpers" in path.parents:
        return True
    return path.parent == TESTS and (path.name.startswith("test_") or path.name == "conftest.py")


def test_every_file_in_tests_is_a_test_module_conftest_or_a_helper():
    stray = [str(path.relative_to(REPO)) for path in TEST_TREE.values() if not _belongs_in_tests(path)]
    assert not stray, f"helpers belong in tests/helpers/: {stray}"


def test_no_test_module_imports_another_and_helpers_come_from_tests_helpers():
    wrong = {
        name: wrong_test_imports(path.read_text(encoding="utf-8"), name, is_package=path.name == "__init__.py")
        for name, path in TEST_TREE.items()
    }
    assert not {name: found for name, found in wrong.items() if found}, (
        "tests/ modules import only helpers, as tests.helpers...; never a test module or conftest"
    )


def test_the_test_import_check_sees_every_spelling():
    here = "tests.test_probe"
    for source in (
        "from tests.test_supervisor import launch\n",
        "from tests import test_stale\n",
        "import tests.conftest\n",
        "from test_supervisor import launch\n",  # tests/ itself is on sys.path under pytest
        "import conftest\n",
        "from helpers.system import PROMPT\n",  # a second copy of the helper module
        "def later():\n    from tests.test_restarts import SLOT\n",
    ):
        assert wrong_test_imports(source, here), source
    for source in (
        "from tests.helpers.system import PROMPT\n",
        "from tests.helpers import oracle\n",
        "import tests.helpers.models\n",
        "from shared.store import ExpertStore\n",
    ):
        assert not wrong_test_imports(source, here), source
    assert not wrong_test_imports("from .system import PROMPT\n", "tests.helpers.supervisor")
    assert wrong_test_imports("from tests.test_supervisor import model\n", "tests.helpers.supervisor")
