"""Install on a robot: `rosdep install --from-paths src` must bring what the code imports. Every import of the
packages' sources that is neither the standard library nor the package itself (read from the source: AST, imports
in functions and `pytest.importorskip` too) maps, through the table below, to a rosdep key declared in the right
package.xml: what the package imports as `exec_depend`, what only its tests import as `test_depend`; and nothing is
declared that no import needs. Where `rosdep` and its sources are at hand, every key also resolves for Humble,
Jazzy and Kilted (skipped elsewhere)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import REPO_ROOT

# Import name -> rosdep key (rosdistro's rosdep/base.yaml and python.yaml, or a ROS package's own name).
ROSDEP_KEYS = {
    "numpy": "python3-numpy",
    "yaml": "python3-yaml",
    "PIL": "python3-pil",  # Pillow 9.0 or later (compressed_images.py)
    "cv2": "python3-opencv",
    "matplotlib": "python3-matplotlib",
    "tqdm": "python3-tqdm",
    "pytest": "python3-pytest",
    # Not packaged by the distributions: rosdep's pip keys.
    "transformers": "python3-transformers-pip",
    "huggingface_hub": "python3-huggingface-hub-pip",
    "rosbags": "python3-rosbags-pip",
    # No key of their own in rosdistro: transformers requires both, so its key brings them.
    "safetensors": "python3-transformers-pip",
    "tokenizers": "python3-transformers-pip",
    # ROS packages, by their package names.
    **{name: name for name in (
        "rclpy", "std_msgs", "sensor_msgs", "geometry_msgs", "nav_msgs", "std_srvs", "lifecycle_msgs",
        "diagnostic_msgs", "visualization_msgs", "tf2_msgs", "builtin_interfaces", "rcl_interfaces", "rosgraph_msgs", "action_msgs",
        "ament_index_python", "launch", "launch_ros", "launch_pytest",
        # The workspace's own packages: rosdep finds them among the sources (--from-paths src).
        "inf_mllm_interfaces", "inf_mllm_ros")},
}
# Imports that deliberately have no key: a robot installs them by hand (README, Install on a robot).
NO_KEY = {
    # rosdep's torch keys give the distribution's or PyPI's generic build; a robot needs the CUDA build that
    # matches its driver, or NVIDIA's Jetson wheel, and installs it by hand before requirements.txt.
    "torch": "the CUDA / Jetson build of PyTorch is installed by hand",
    # The GPU scoring kernel (engine/ops/triton_scoring.py, optional: the engine falls back without it) comes with
    # the CUDA build of PyTorch.
    "triton": "comes with the CUDA build of PyTorch",
}

PACKAGES = {
    # package.xml -> (sources whose imports are run-time dependencies, sources whose imports are test dependencies)
    REPO_ROOT / "inf_mllm_ros" / "package.xml": ([REPO_ROOT / "inf_mllm_ros" / "inf_mllm_ros"],
                                                 [REPO_ROOT / "inf_mllm_ros" / "test"]),
    REPO_ROOT / "inf_mllm_bringup" / "package.xml": ([REPO_ROOT / "inf_mllm_bringup" / "launch"], []),
}
DISTROS = {"humble": "ubuntu:jammy", "jazzy": "ubuntu:noble", "kilted": "ubuntu:noble"}


def imported(folders: list[Path]) -> dict[str, set[str]]:
    """Top-level name -> the files that import it, for every absolute import under `folders`, less the standard
    library and the folders' own modules (a test's helpers)."""
    found: dict[str, set[str]] = {}
    for folder in folders:
        own = {p.stem for p in folder.glob("*.py")} | {p.name for p in folder.iterdir() if p.is_dir()}
        for path in sorted(folder.rglob("*.py")):
            for name in _names(ast.parse(path.read_text(), filename=str(path))):
                top = name.split(".")[0]
                if top and top not in sys.stdlib_module_names and top not in own and top != "__future__":
                    found.setdefault(top, set()).add(str(path.relative_to(REPO_ROOT)))
    return found


def _names(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("importorskip", "import_module") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.args[0].value


def declared(package_xml: Path) -> tuple[str, dict[str, set[str]]]:
    """The package's name, and its keys by dependency tag (`depend` counts as build, exec and test)."""
    root = ET.parse(package_xml).getroot()
    tags: dict[str, set[str]] = {}
    for element in root:
        if element.tag.endswith("depend"):
            tags.setdefault(element.tag, set()).add(element.text.strip())
    return root.findtext("name"), tags


def needed(package_xml: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """The keys a package needs, each with the files whose imports need it: (at run time, only in its tests)."""
    name, _ = declared(package_xml)
    run_sources, test_sources = PACKAGES[package_xml]
    unmapped = []

    def keys(imports: dict[str, set[str]]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for module, files in sorted(imports.items()):
            if module == name or module in NO_KEY:
                continue
            if module not in ROSDEP_KEYS:
                unmapped.append(f"{module} (imported by {', '.join(sorted(files))})")
                continue
            out.setdefault(ROSDEP_KEYS[module], set()).update(files)
        return out

    run = keys(imported(run_sources))
    test = {k: v for k, v in keys(imported(test_sources)).items() if k not in run}
    assert not unmapped, ("imports with no rosdep key in test_rosdep_keys.py's table (add the key, or to NO_KEY "
                          "with the reason): " + "; ".join(unmapped))
    return run, test


@pytest.mark.parametrize("package_xml", sorted(PACKAGES), ids=lambda p: p.parent.name)
def test_every_import_is_a_declared_rosdep_key_and_every_key_is_used(package_xml):
    run, test = needed(package_xml)
    _, tags = declared(package_xml)
    exec_keys = tags.get("exec_depend", set()) | tags.get("depend", set())
    test_keys = tags.get("test_depend", set()) | tags.get("depend", set())
    missing = [f"<exec_depend>{k}</exec_depend> ({', '.join(sorted(files))})"
               for k, files in sorted(run.items()) if k not in exec_keys]
    missing += [f"<test_depend>{k}</test_depend> ({', '.join(sorted(files))})"
                for k, files in sorted(test.items()) if k not in test_keys | exec_keys]
    assert not missing, f"{package_xml.relative_to(REPO_ROOT)} lacks: " + "; ".join(missing)
    unused = sorted(exec_keys - set(run)) + sorted(tags.get("test_depend", set()) - set(test))
    assert not unused, f"{package_xml.relative_to(REPO_ROOT)} declares keys no import needs: {unused}"


def test_the_table_knows_no_key_twice_and_torch_has_none():
    assert not set(ROSDEP_KEYS) & set(NO_KEY)
    assert "torch" in NO_KEY and "torch" not in ROSDEP_KEYS


def _rosdep_ready() -> str:
    """Why rosdep cannot resolve here ('' when it can): the command, or its sources cache, missing."""
    if shutil.which("rosdep") is None:
        return "rosdep is not installed"
    home = Path(os.environ.get("ROS_HOME", Path.home() / ".ros"))
    if not (home / "rosdep" / "sources.cache" / "index").exists():
        return "rosdep has no sources cache (rosdep init; rosdep update)"
    return ""


@pytest.mark.parametrize("distro", sorted(DISTROS))
def test_the_keys_resolve_for_each_distribution(distro):
    reason = _rosdep_ready()
    if reason:
        pytest.skip(reason)
    workspace = {declared(p)[0] for p in PACKAGES} | {"inf_mllm_interfaces"}
    keys = sorted({k for p in PACKAGES for tag, ks in declared(p)[1].items() for k in ks} - workspace)
    env = dict(os.environ, ROS_DISTRO=distro)
    failed = []
    for key in keys:
        done = subprocess.run(["rosdep", "resolve", key, f"--rosdistro={distro}", f"--os={DISTROS[distro]}"],
                              capture_output=True, text=True, env=env, timeout=120)
        if done.returncode != 0:
            failed.append(f"{key}: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    assert not failed, f"keys rosdep cannot resolve for {distro}: {failed}"
