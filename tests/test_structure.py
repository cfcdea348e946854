"""The shape of the code, read from the sources (no imports, no TensorFlow): one home for the plan format,
no import cycles (dodged or not), dependencies one way, rooms in their order, folders of a dozen modules or
fewer, files of at most 600 lines, one name per class (docs/design.md 2)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("simulator", "rewriter", "autotune", "benchmarks")
LAYER = {name: rank for rank, name in enumerate(PACKAGES)}  # simulator <- rewriter <- autotune <- benchmarks
MAX_LINES = 600
MAX_MODULES_PER_FOLDER = 12
# The rooms of each package in the order they may import each other: a module imports modules of its own
# room or of a room before it, never after (a package's __init__ and __main__ stand above them all).
ROOMS = {
    "rewriter": ("errors", "host_memory", "environment", "tf_effects", "trace", "placement", "edit", "check", "step",
                 "timing"),
    "autotune": ("inputs", "search", "run", "report", "cli"),
}
LEAF_ROOMS = ("simulator.kernels",)  # import nothing else of their package


def _sources() -> dict[str, Path]:
    """Module name -> file, for every module of the packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


SOURCES = _sources()


def _module_of(name: str) -> str | None:
    """The package module an import names (the longest known prefix), None outside the packages."""
    while name and name not in SOURCES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path, *, module_level: bool) -> set[str]:
    """Modules of the packages that ``path`` imports: at module level only (what runs when it is
    imported), or everywhere (imports inside functions too). ``from pkg import sub`` names the
    submodule; ``if TYPE_CHECKING:`` blocks are left out."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and module_level:
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(filter(None, (_module_of(alias.name) for alias in child.names)))
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                for alias in child.names:
                    submodule = f"{child.module}.{alias.name}"
                    target = submodule if submodule in SOURCES else _module_of(child.module)
                    if target:
                        found.add(target)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _graph(*, module_level: bool) -> dict[str, set[str]]:
    return {name: _imports(path, module_level=module_level) - {name} for name, path in SOURCES.items()}


def test_the_plan_format_is_defined_in_one_file():
    """The format's name, its version and the file's keys are written in simulator/plan.py only."""
    defining = [path.relative_to(ROOT).as_posix() for path in SOURCES.values()
                if re.search(r"[\"']swap-plan(/\d+)?[\"']", path.read_text())]
    assert defining == ["simulator/plan.py"]
    readers = [path.relative_to(ROOT).as_posix() for path in SOURCES.values()
               if re.search(r"\[[\"'](swap_ins|consumers)[\"']\]|\.get\([\"'](swap_ins|consumers)[\"']", path.read_text())]
    assert readers == ["simulator/plan.py"], "plan records are read as raw dicts outside simulator/plan.py"


def test_no_module_imports_one_that_imports_it_back():
    """At module level (what importing runs), and with imports inside functions too: an import inside a
    function must not be the way round a cycle."""
    assert _cycles(_graph(module_level=True)) == []
    assert _cycles(_graph(module_level=False)) == []


def test_dependencies_point_one_way():
    """simulator <- rewriter <- autotune <- benchmarks; the simulator never imports TensorFlow; nothing
    in the packages imports the tests, not even a program held in a string."""
    wrong = []
    for name, path in SOURCES.items():
        package = name.partition(".")[0]
        for target in _imports(path, module_level=False):
            if LAYER[target.partition(".")[0]] > LAYER[package]:
                wrong.append(f"{name} -> {target}")
        text = path.read_text()
        if re.search(r"^\s*(import|from)\s+tests\b", text, re.MULTILINE):
            wrong.append(f"{name} -> tests")
        if package == "simulator" and re.search(r"^\s*(import|from)\s+(tensorflow|keras)\b", text, re.MULTILINE):
            wrong.append(f"{name} -> tensorflow")
    assert wrong == []


# Over the limit, and why it is not split here: the exception must name its reason, and the test fails
# as soon as the file is back under the limit, so that the entry goes with it.
OVER_THE_LIMIT: dict[str, str] = {}


def test_no_source_file_is_over_600_lines():
    long = {path.relative_to(ROOT).as_posix(): count for name, path in SOURCES.items()
            if name.partition(".")[0] in ("simulator", "rewriter", "autotune")
            and (count := len(path.read_text().splitlines())) > MAX_LINES}
    assert set(long) == set(OVER_THE_LIMIT), long


def test_distinct_things_have_distinct_names():
    """No two classes of the packages share a name (two ``Measurement`` classes were two things)."""
    homes = defaultdict(list)
    for name, path in SOURCES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                homes[node.name].append(name)
    assert {cls: modules for cls, modules in homes.items() if len(modules) > 1} == {}


def _room(module: str) -> tuple[str, str]:
    package, _, rest = module.partition(".")
    return package, rest.partition(".")[0]


def test_rooms_import_only_rooms_before_them():
    wrong = []
    for name, path in SOURCES.items():
        package, room = _room(name)
        if package not in ROOMS or room in ("", "__main__"):
            continue
        rank = ROOMS[package].index(room)
        for target in _imports(path, module_level=False):
            target_package, target_room = _room(target)
            if target_package == package and target_room and ROOMS[package].index(target_room) > rank:
                wrong.append(f"{name} -> {target}")
    assert wrong == []


def test_every_room_is_declared():
    found = {package: sorted({_room(name)[1] for name in SOURCES if name.startswith(package + ".")} - {"__main__"})
             for package in ROOMS}
    assert found == {package: sorted(rooms) for package, rooms in ROOMS.items()}


def test_leaf_rooms_import_nothing_else_of_their_package():
    wrong = [f"{name} -> {target}" for name, path in SOURCES.items() for leaf in LEAF_ROOMS
             if name.startswith(leaf + ".") or name == leaf
             for target in _imports(path, module_level=False)
             if target.partition(".")[0] == leaf.partition(".")[0] and not target.startswith(leaf)]
    assert wrong == []


def test_no_folder_holds_more_than_a_dozen_modules():
    """Packages and tests alike: a folder that outgrows a dozen modules gets rooms."""
    crowded = {}
    for top in (*PACKAGES, "tests"):
        for folder in [ROOT / top, *(p for p in (ROOT / top).rglob("*") if p.is_dir() and p.name != "__pycache__")]:
            modules = [p for p in folder.glob("*.py") if not p.name.startswith("__")]
            if len(modules) > MAX_MODULES_PER_FOLDER:
                crowded[folder.relative_to(ROOT).as_posix()] = len(modules)
    assert crowded == {}


def test_every_room_says_what_lives_in_it():
    """Each sub-package's __init__ has a docstring, and no module is made callable (its functions are
    re-exported by name instead)."""
    silent = [name for name, path in SOURCES.items() if path.name == "__init__.py" and not ast.get_docstring(
        ast.parse(path.read_text()))]
    assert silent == []
    tricks = [name for name, path in SOURCES.items() if re.search(r"sys\.modules\[[^\]]+\]\.__class__", path.read_text())]
    assert tricks == []


def test_the_simulators_tests_need_no_tensorflow():
    """tests/simulator/ runs from stored graphs: none of its modules imports TensorFlow, Keras, the rewriter
    or the TensorFlow test tools, and the suite's conftest (with ``import rewriter``, which prepares the
    environment) loads no TensorFlow either."""
    wrong = []
    for path in sorted((ROOT / "tests" / "simulator").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            wrong += [f"{path.name}: {name}" for name in names
                      if name.partition(".")[0] in ("tensorflow", "keras", "rewriter") or name == "tests.tf_tools"]
    assert wrong == []
    script = "import sys, tests.conftest, rewriter, simulator; sys.exit('tensorflow' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
