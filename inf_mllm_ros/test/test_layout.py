"""The package's shape, read from its source: no import cycle, and every import pointing down the layers (the engine
knows nothing of ROS, the bags or the node; only the node's modules, and the test helpers that drive the node, import
the node's modules)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "inf_mllm_ros" / "inf_mllm_ros"
ROS = {"rclpy", "rosbag2_py", "rcl_interfaces", "lifecycle_msgs", "std_msgs", "sensor_msgs", "std_srvs",
       "diagnostic_msgs", "builtin_interfaces", "action_msgs", "inf_mllm_interfaces", "launch", "launch_ros"}


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level) for every import of a module: at module level, inside functions and
    under `if TYPE_CHECKING:` alike (an import for annotations ties the modules together as much as any)."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        top = all(not isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)) for p in _ancestors(node, parents))
        if isinstance(node, ast.Import):
            found += [(a.name, top) for a in node.names]
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        known = modules()
        for a in node.names:  # `from . import x` imports the module x where there is one
            found.append((f"{base}.{a.name}" if f"{base}.{a.name}" in known else base, top))
    return found


def _ancestors(node, parents):
    while node in parents:
        node = parents[node]
        yield node


def owner(module: str) -> str:
    """The layer a module of the package belongs to."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("engine", "bags", "testing"):
        return parts[1]
    if len(parts) > 1 and (parts[1] == "node" or parts[1].startswith("node_")):
        return "node"
    return "top"


def test_the_engine_imports_nothing_of_ros_or_of_the_layers_above_it():
    wrong = []
    for name, path in modules().items():
        for imported, _ in imports(name, path):
            root = imported.split(".")[0]
            if owner(name) == "engine" and (root in ROS or (root == "inf_mllm_ros" and owner(imported) != "engine")):
                wrong.append(f"{name} imports {imported}")
            if owner(name) not in ("node", "testing") and root == "inf_mllm_ros" and owner(imported) == "node":
                wrong.append(f"{name} imports the node's {imported}")
            if owner(name) in ("engine", "bags", "top") and root == "inf_mllm_ros" and owner(imported) == "testing":
                wrong.append(f"{name} imports the test helpers' {imported}")
    assert not wrong, wrong


def test_no_import_cycle():
    """Counting every import: at module level, inside functions and for annotations."""
    graph = {name: {i for i, _ in imports(name, path) if i in modules() and i != name}
             for name, path in modules().items()}
    # A package's __init__ is imported on the way to its modules: an edge to it is no cycle of the code's making.
    graph = {name: {i for i in targets if not name.startswith(i + ".")} for name, targets in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node, trail):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, cycles


@pytest.mark.parametrize("module", ["inf_mllm_ros.engine.runtime.engine", "inf_mllm_ros.engine.runtime.stream"])
def test_the_layout_rules_see_imports(module):
    """The checks above read real edges (a parser that found none would pass them all)."""
    found = {i for i, _ in imports(module, modules()[module])}
    assert "inf_mllm_ros.engine.memory.cache" in found or "inf_mllm_ros.engine.runtime.stream" in found, found


def test_the_layout_rules_see_imports_for_annotations_and_inside_functions():
    retriever = {i for i, _ in imports("inf_mllm_ros.engine.archive.retriever", modules()["inf_mllm_ros.engine.archive.retriever"])}
    assert "inf_mllm_ros.engine.archive.archive" in retriever, "an import under TYPE_CHECKING"
    loading = [(i, top) for i, top in imports("inf_mllm_ros.engine.runtime.worker", modules()["inf_mllm_ros.engine.runtime.worker"])]
    assert ("inf_mllm_ros.engine.runtime.live_settings", True) in loading, "an import under TYPE_CHECKING, at module level"
    offline = imports("inf_mllm_ros.bags.offline", modules()["inf_mllm_ros.bags.offline"])
    assert ("inf_mllm_ros.engine.models.loading", False) in offline, "an import inside a function"


def package_classes() -> dict[str, list[str]]:
    """Class name -> its bases as written, for every class of the package."""
    classes = {}
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = [ast.unparse(base) for base in node.bases]
    return classes


def test_objects_own_their_state_no_class_is_a_part_of_another():
    """A class of the package inherits from the package only an abstract kind (a model family's adapter, an
    eviction policy) or an error: never a part of another class that shares its state (a mixin). Parts are
    objects their owner makes and holds."""
    classes = package_classes()
    kinds = {name for name, bases in classes.items() if "ABC" in bases}
    grew = True
    while grew:  # the subclasses of an abstract kind are kinds of it too (a vision-language adapter)
        more = {name for name, bases in classes.items() if any(b in kinds for b in bases)} - kinds
        kinds |= more
        grew = bool(more)
    assert {"ModelAdapter", "EvictionPolicy"} <= kinds
    for name, bases in classes.items():
        for base in bases:
            if base in classes:
                assert base in kinds or base.endswith("Error"), f"{name} inherits {base}: a part, not a kind"


def test_no_private_name_is_imported_or_reached_for_from_another_package():
    """A private name (`_x`) stays in its package: no `from m import _x` across packages, and no `obj._x` of the
    package's objects from the tests' or benchmarks' code, nor a private member replaced by name (they use what the
    package offers: a parameter, a public method or attribute). torch's own test helpers (`torch._dynamo.testing`)
    are torch's."""
    crossing = []
    for path in sorted(REPO_ROOT.glob("inf_mllm_ros/**/*.py")) + sorted(REPO_ROOT.glob("benchmarks/*.py")):
        tree = ast.parse(path.read_text())
        own = path.parent.relative_to(REPO_ROOT).as_posix().replace("/", ".")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.rpartition(".")[0] != own.removeprefix("inf_mllm_ros."):
                    crossing += [f"{path.name}: from {node.module} import {a.name}" for a in node.names
                                 if a.name.startswith("_") and not a.name.startswith("__")]
    assert not crossing, crossing
    outside = sorted(REPO_ROOT.glob("benchmarks/*.py")) + sorted(Path(__file__).parent.glob("*.py"))
    private = lambda name: name.startswith("_") and not name.startswith("__")  # noqa: E731
    reached = []
    for path in outside:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and private(node.attr)
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "torch"))):
                reached.append(f"{path.name}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("setattr"):
                names = [a.value for a in node.args[:2] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                reached += [f"{path.name}:{node.lineno} setattr {name}" for name in names
                            if private(name.rpartition(".")[2])]
    assert not reached, reached


LAUNCH_FILE = REPO_ROOT / "inf_mllm_bringup" / "launch" / "inf_mllm.launch.py"


def test_the_launch_file_reads_the_parameter_table_in_its_own_process_without_torch():
    """The launch process imports the parameter table itself (no child process): the table, the engine's door
    (engine/api.py and the other modules at the engine's top, of which it is made; the engine's parts are in its
    folders) and whatever else of the package the launch file imports load neither torch nor transformers, which
    it would otherwise hold for as long as the node runs. Checked in a fresh interpreter."""
    tree = ast.parse(LAUNCH_FILE.read_text())
    launched = sorted({node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                       and (node.module or "").startswith("inf_mllm_ros")})
    assert "inf_mllm_ros.settings" in launched
    assert not any(isinstance(node, ast.Import) and any(a.name == "subprocess" for a in node.names)
                   for node in ast.walk(tree))
    code = ("import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)\n"
            "print(','.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    door = sorted(f"inf_mllm_ros.engine.{path.stem}" for path in (PACKAGE / "engine").glob("*.py"))
    assert "inf_mllm_ros.engine.api" in door
    done = subprocess.run([sys.executable, "-P", "-c", code, *door, *launched],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "", f"{launched} load {done.stdout.strip()}"


def test_the_node_process_loads_torch_only_to_configure():
    """Every module of the node (node/) imports without torch or transformers: the model's machinery comes with the
    first configure, so that a process refused at start (a bad parameter) says so at once and a node that waits
    unconfigured for a lifecycle manager stays small. Checked in a fresh interpreter."""
    node = sorted(f"inf_mllm_ros.node.{path.stem}" for path in (PACKAGE / "node").glob("*.py"))
    assert "inf_mllm_ros.node.process" in node
    code = ("import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)\n"
            "print(','.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-P", "-c", code, *node], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "", f"the node's modules load {done.stdout.strip()}"


def test_every_module_is_placed_in_the_architecture():
    """docs/architecture.md names every module of the package, and the plan and the recorder it draws are the
    engine's names."""
    doc = (REPO_ROOT / "docs" / "architecture.md").read_text()
    unplaced = sorted(path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
                      if path.name != "__init__.py" and path.name not in doc)
    assert not unplaced, f"not in docs/architecture.md: {unplaced}"
    for name in ("ForwardPlan", "PromptPositions", "LayerRecorder", "ForwardRecording", "KVArchive.recording",
                 "KVArchive.end_forward", "BoundedKVCache.stage", "StaticIngester.run"):
        assert name in doc, name
