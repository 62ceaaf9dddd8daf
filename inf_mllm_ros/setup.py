"""Installs the inf_mllm_ros package: the node, the bag tools, the Fast DDS profile and the sample bag (the launch
file and parameter files are inf_mllm_bringup's)."""

import os
from glob import glob

from setuptools import find_packages, setup

PACKAGE = "inf_mllm_ros"
HERE = os.path.dirname(os.path.abspath(__file__))


def files(pattern):
    return sorted(os.path.relpath(p, HERE) for p in glob(os.path.join(HERE, pattern)))


def tree(folder):
    """data_files entries that install `folder` recursively under share/<package>/."""
    entries = []
    for root, _dirs, names in os.walk(os.path.join(HERE, folder)):
        paths = [os.path.relpath(os.path.join(root, f), HERE) for f in sorted(names)]
        if paths:
            rel_root = os.path.relpath(root, HERE)
            entries.append((os.path.join("share", PACKAGE, rel_root), paths))
    return sorted(entries)


setup(
    name=PACKAGE,
    version="0.1.0",
    packages=find_packages(exclude=["test", "test.*"]),
    data_files=[
        ("share/ament_index/resource_index/packages", ["resource/" + PACKAGE]),
        ("share/" + PACKAGE, ["package.xml"]),
        ("share/" + PACKAGE + "/config", files("config/*.xml")),
    ]
    + tree("sample_bags"),
    install_requires=["setuptools"],
    zip_safe=True,
    maintainer="inf_mllm_ros maintainers",
    maintainer_email="maintainers@inf-mllm-ros.org",
    description="A multimodal LLM over an endless camera and text stream with a fixed-size KV cache.",
    license="Apache-2.0",
    entry_points={
        "console_scripts": [
            "inf_mllm_node = inf_mllm_ros.node.process:main",
            "inf_mllm_replay = inf_mllm_ros.bags.replay:main",
            "inf_mllm_offline = inf_mllm_ros.bags.offline:main",
            "inf_mllm_demo = inf_mllm_ros.demo:main",
        ],
    },
)
