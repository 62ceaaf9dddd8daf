"""The installed node as its own process, and the rclpy node that plays its sensors and its user, for the tests and
benchmarks that run the node whole over DDS (the soak, the flood): `NodeProcess`, `Driver`, `Scene` and readings of
a process from /proc.

The node is the installed `inf_mllm_node` (found through the ament index, so `bash scripts/setup.sh` and `source
scripts/env.sh` come first); it runs in the given ROS domain with localhost discovery only.
"""

from __future__ import annotations

import array
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

NAMESPACE = "/soak"
NODE_NAME = "inf_mllm"  # the node's own default name


def node_executable() -> Path:
    """The installed inf_mllm_node."""
    from ament_index_python.packages import PackageNotFoundError, get_package_prefix

    try:
        exe = Path(get_package_prefix("inf_mllm_ros")) / "lib" / "inf_mllm_ros" / "inf_mllm_node"
    except PackageNotFoundError:
        raise SystemExit("inf_mllm_ros is not installed: build the workspace (bash scripts/setup.sh) and source "
                         "scripts/env.sh") from None
    if not exe.exists():
        raise SystemExit(f"{exe} is missing: build the workspace (bash scripts/setup.sh)")
    return exe


def default_domain_id() -> int:
    """A ROS domain per process (1..100, like the tests), so the node meets nothing else on the machine."""
    return os.getpid() % 100 + 1


def proc_status(pid: int) -> dict:
    """VmRSS, VmHWM (MiB) and Threads of a live process, from /proc/<pid>/status; {} once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
        elif key == "Threads":
            out[key] = int(value)
    return out


def proc_cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time of a process so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def open_files(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


class NodeProcess:
    """The installed node in a temporary folder (parameters, log, memory file), in the given ROS domain."""

    def __init__(self, domain_id: int, params: dict, folder: Path, extra_env: dict | None = None,
                 namespace: str = NAMESPACE):
        import yaml

        self.folder = folder
        self.memory_file = folder / "memory.safetensors"
        self.params = dict(params, memory_file=str(self.memory_file))
        params_file = folder / "params.yaml"
        params_file.write_text(yaml.safe_dump({"/**": {"ros__parameters": self.params}}))
        self.log_path = folder / "node.log"
        self._log = open(self.log_path, "w")
        env = dict(os.environ, ROS_DOMAIN_ID=str(domain_id), ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST",
                   PYTHONUNBUFFERED="1", RCUTILS_LOGGING_BUFFERED_STREAM="0", RCUTILS_COLORIZED_OUTPUT="0",
                   **(extra_env or {}))
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [str(node_executable()), "--ros-args", "--params-file", str(params_file), "-r", f"__ns:={namespace}"],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60.0) -> tuple[int | None, float, bool]:
        """SIGINT, then wait (the node answers its callers and saves the memory); kill if it hangs.

        Returns (exit code, seconds it took, killed)."""
        start = time.monotonic()
        killed = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                killed = True
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode, time.monotonic() - start, killed


class Scene:
    """640x480 camera frames: a fixed textured background and a square moving across it."""

    def __init__(self, height: int = 480, width: int = 640, seed: int = 0):
        import numpy as np

        rng = np.random.default_rng(seed)
        self.background = rng.integers(40, 200, (height, width, 3), dtype=np.uint8)
        self.height, self.width = height, width
        self.size = height // 6

    def frame(self, index: int):
        rgb = self.background.copy()
        x = (index * 4) % (self.width - self.size)
        y = (index * 2) % (self.height - self.size)
        rgb[y : y + self.size, x : x + self.size] = (250, 40 + index % 200, 30)
        return rgb


class Driver:
    """The test's own rclpy node, in its own context and domain: camera and text publishers, the query client, the
    latest cache_stats. It spins the node's own executor; `executor="rclpy"` spins rclpy's MultiThreadedExecutor
    instead, as many robot nodes do (its spinning thread is busy under load: node/executor.py)."""

    def __init__(self, domain_id: int, namespace: str = NAMESPACE, name: str = "soak_driver",
                 executor: str = "once_queued"):
        import rclpy
        from rclpy.executors import ExternalShutdownException
        from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
        from sensor_msgs.msg import Image
        from std_msgs.msg import String

        from inf_mllm_interfaces.msg import CacheStats
        from inf_mllm_interfaces.srv import Query

        from ..node.executor import OnceQueuedExecutor
        from ..node.inputs import TEXT_QOS

        self._rclpy, self._Image, self._String, self._Query = rclpy, Image, String, Query
        self.context = rclpy.Context()
        rclpy.init(context=self.context, domain_id=domain_id)
        self.node = rclpy.create_node(name, context=self.context)
        camera_qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.BEST_EFFORT,
                                durability=DurabilityPolicy.VOLATILE)
        reliable = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10, reliability=ReliabilityPolicy.RELIABLE)
        # Texts as deep as the node takes them: a reliable writer of depth 10 drops what its reader has not yet
        # acknowledged after ten more, so that a flood would count the publisher's losses as the node's.
        texts = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=TEXT_QOS.depth,
                           reliability=ReliabilityPolicy.RELIABLE)
        self.camera = self.node.create_publisher(Image, f"{namespace}/image", camera_qos)
        self.text = self.node.create_publisher(String, f"{namespace}/text", texts)
        self.query = self.node.create_client(Query, f"{namespace}/{NODE_NAME}/query")
        self.stats = None
        self.stats_at = None
        self._lock = threading.Lock()
        self.node.create_subscription(CacheStats, f"{namespace}/{NODE_NAME}/cache_stats", self._on_stats, reliable)
        if executor == "rclpy":
            from rclpy.executors import MultiThreadedExecutor

            self.executor = MultiThreadedExecutor(context=self.context)
        else:
            self.executor = OnceQueuedExecutor(num_threads=2, context=self.context)
        self.executor.add_node(self.node)

        def spin():
            try:
                self.executor.spin()
            except ExternalShutdownException:
                pass

        self._thread = threading.Thread(target=spin, name=f"{name}_executor", daemon=True)
        self._thread.start()

    def _on_stats(self, msg) -> None:
        with self._lock:
            self.stats, self.stats_at = msg, time.monotonic()

    def latest_stats(self):
        with self._lock:
            return self.stats, self.stats_at

    def publish_frame(self, rgb, stamp_ns: int) -> None:
        msg = self._Image(height=rgb.shape[0], width=rgb.shape[1], encoding="rgb8", is_bigendian=0,
                          step=rgb.shape[1] * 3)
        msg.header.frame_id = "camera"
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(stamp_ns, 1_000_000_000)
        msg.data = array.array("B", rgb.tobytes())  # an array is taken as it is; a bytes object is checked per byte
        self.camera.publish(msg)

    def publish_text(self, text: str) -> None:
        self.text.publish(self._String(data=text))

    def ask(self, question: str, max_new_tokens: int = 0):
        return self.query.call_async(self._Query.Request(question=question, max_new_tokens=max_new_tokens))

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=5)
        self.node.destroy_node()
        self._rclpy.try_shutdown(context=self.context)
        self._thread.join(5)
