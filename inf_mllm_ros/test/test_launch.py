"""The launch file under launch_pytest, which comes with a ROS 2 install (skipped where it is missing)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

launch_pytest = pytest.importorskip("launch_pytest")
launch = pytest.importorskip("launch")
pytest.importorskip("launch_ros")

from ament_index_python.packages import get_package_share_directory  # noqa: E402
from launch.actions import IncludeLaunchDescription  # noqa: E402
from launch.launch_description_sources import PythonLaunchDescriptionSource  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy  # noqa: E402
from std_msgs.msg import String  # noqa: E402

from inf_mllm_interfaces.msg import CacheStats  # noqa: E402
from ros_helpers import Latest, RosProbe  # noqa: E402

NAMESPACE = "launch_test"
TEXT_TOPIC = "/launch_test/events"


@launch_pytest.fixture
def launch_description():
    share = get_package_share_directory("inf_mllm_bringup")
    arguments = {
        "params_file": os.path.join(share, "config", "cpu.yaml"),
        "cache_size": "256",
        "attention_bias": "0.002",
        "namespace": NAMESPACE,
        "text_topic": TEXT_TOPIC,
        "use_sim_time": "true",
    }
    return launch.LaunchDescription([
        IncludeLaunchDescription(
            PythonLaunchDescriptionSource(os.path.join(share, "launch", "inf_mllm.launch.py")),
            launch_arguments=arguments.items(),
        ),
        launch_pytest.actions.ReadyToTest(),
    ])


@pytest.mark.launch(fixture=launch_description)
def test_launch_arguments_reach_the_node():
    probe = RosProbe("launch_test_probe")
    try:
        stats = Latest(probe, CacheStats, f"/{NAMESPACE}/inf_mllm/cache_stats",
                       QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
        # On sim time with no /clock the node's timers stand still, so its stats come after inputs only: a
        # message taken is what makes it speak (text_topic is remapped).
        publisher = probe.node.create_publisher(String, TEXT_TOPIC, 10)
        probe.wait_for(lambda: publisher.get_subscription_count() > 0, 300, "the node on the text topic")
        publisher.publish(String(data="Launch test message."))
        ready = stats.wait(lambda m: m.texts_ingested >= 1, timeout=120, what="the text ingested")
        assert ready.model_ready
        # The arguments override the params file.
        assert ready.capacity == 256
        assert ready.attention_bias == pytest.approx(0.002)
        # On sim time with no /clock, the node's clock stands at 0: use_sim_time reached it.
        assert (ready.header.stamp.sec, ready.header.stamp.nanosec) == (0, 0)
    finally:
        probe.close()


def _run_launch(**arguments) -> int:
    """Runs the launch file to its end in this process; LaunchService.run()'s result."""
    share = get_package_share_directory("inf_mllm_bringup")
    service = launch.LaunchService()
    service.include_launch_description(launch.LaunchDescription([
        IncludeLaunchDescription(
            PythonLaunchDescriptionSource(os.path.join(share, "launch", "inf_mllm.launch.py")),
            launch_arguments=arguments.items(),
        ),
    ]))
    return service.run()


@pytest.mark.parametrize("arguments", [{"cache_size": "abc"}, {"score_pool": "4"},
                                       {"params_file": "/nonexistent.yaml"}, {"use_sim_time": "maybe"}])
def test_a_bad_argument_fails_the_launch(arguments):
    assert _run_launch(**arguments) != 0


def test_a_model_that_cannot_load_fails_the_launch():
    # The node exits with code 1; a Shutdown alone would end the launch with 0.
    assert _run_launch(model="/nonexistent/folder", device="cpu") != 0


def test_the_launch_process_does_not_hold_the_engine():
    # The parameter table imports torch and transformers (about 400 MiB); the launch reads it in a child
    # process, so the process that supervises the node for hours stays small.
    share = get_package_share_directory("inf_mllm_bringup")
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('inf_mllm_launch', {os.path.join(share, 'launch', 'inf_mllm.launch.py')!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "arguments = [a.name for a in module.generate_launch_description().entities if hasattr(a, 'name')]\n"
        "assert 'attention_bias' in arguments and 'cache_size' in arguments, arguments\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
