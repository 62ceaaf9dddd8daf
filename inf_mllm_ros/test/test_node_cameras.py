"""Several cameras into one memory, across processes over DDS: three image topics at 5 Hz with `frame_rate` 1 each
put frames of every camera into the memory, `~/recall` finds each camera's own frames and names their camera, an
answer's frame evidence names its camera, and a camera that stops publishing is reported on /diagnostics while the
others go on. A camera list the node cannot take ends it at start with the reason."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image

from inf_mllm_interfaces.msg import CacheStats
from inf_mllm_interfaces.srv import Query, Recall
from inf_mllm_ros.engine.models.loading import SMALL_MODEL
from inf_mllm_ros.image_conversion import rgb_to_image_fields
from ros_helpers import Latest, RosProbe
from test_node import REPO_ROOT, NodeProcess

NAMESPACE = "/cameras"
FQN = f"{NAMESPACE}/memory"
RELIABLE = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
# Named by their topics: the last segment that names no kind of image.
CAMERAS = {"front": "front/image_raw", "rear": "rear/image_raw", "arm_cam": "arm_cam/color/image_rect"}
CAMERA_HZ = 5.0
TIMEOUT = 3.0  # camera_timeout: the rear camera stops, and is reported silent after this


class Cameras:
    """Each camera publishes its own random 48 x 64 frames at CAMERA_HZ from a thread until it is stopped."""

    def __init__(self, probe: RosProbe):
        self.clock = probe.node.get_clock()
        self.pubs = {name: probe.node.create_publisher(Image, f"{NAMESPACE}/{topic}", RELIABLE)
                     for name, topic in CAMERAS.items()}
        self.stopped = {name: threading.Event() for name in CAMERAS}
        self.sent = {name: 0 for name in CAMERAS}
        self._threads = [threading.Thread(target=self._run, args=(name, seed), daemon=True)
                         for seed, name in enumerate(CAMERAS)]
        for thread in self._threads:
            thread.start()

    def _run(self, name: str, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not self.stopped[name].wait(1.0 / CAMERA_HZ):
            image = Image(**rgb_to_image_fields(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8), "rgb8"))
            image.header.stamp = self.clock.now().to_msg()
            image.header.frame_id = f"{name}_camera"
            self.pubs[name].publish(image)
            self.sent[name] += 1

    def stop(self, name: str | None = None) -> None:
        for camera in [name] if name else list(CAMERAS):
            self.stopped[camera].set()
        for thread in self._threads:
            if name is None:
                thread.join(5)


@pytest.fixture(scope="module")
def robot(tmp_path_factory):
    node = NodeProcess(REPO_ROOT, dict(os.environ), tmp_path_factory.mktemp("cameras"), name="memory",
                       namespace=NAMESPACE,
                       params={"model": SMALL_MODEL, "cache_size": 256, "max_new_tokens": 8,
                               "description_period": 0.0, "frame_rate": 1.0, "stats_period": 0.5,
                               "max_frame_pixels": 64 * 64, "camera_timeout": TIMEOUT,
                               "image_topics": list(CAMERAS.values())})
    probe = RosProbe("cameras_probe", alive=node.check_alive)
    probe.stats = Latest(probe, CacheStats, f"{FQN}/cache_stats", RELIABLE)
    probe.diagnostics = Latest(probe, DiagnosticArray, "/diagnostics", RELIABLE)
    probe.query = probe.node.create_client(Query, f"{FQN}/query")
    probe.recall = probe.node.create_client(Recall, f"{FQN}/recall")
    probe.stats.wait(lambda m: m.model_ready, timeout=180, what="model_ready")
    yield probe, node
    probe.close()
    node.stop()


def own_status(msg: DiagnosticArray) -> DiagnosticStatus | None:
    return next((s for s in msg.status if s.name == f"{FQN}: memory"), None)


def test_three_cameras_go_into_one_memory_each_named_and_a_silent_one_is_reported(robot):
    probe, node = robot
    cameras = Cameras(probe)
    try:
        # 5 Hz each, frame_rate 1 each: about a frame a second from every camera (the rest held back by its gate).
        probe.stats.wait(lambda m: m.frames_ingested >= 9, timeout=240, what="nine frames taken")
        moments = {}
        for name in CAMERAS:
            found = probe.call(probe.recall, Recall.Request(text="What did the camera see?", max_results=8,
                                                            camera=name), timeout=120)
            assert found.success, found.message
            moments[name] = found.moments
        for name, found in moments.items():
            assert len(found) >= 2, (name, [(m.kind, m.camera) for m in found])
            assert all(m.kind == "frame" and m.camera == name and m.has_stamp for m in found), (name, found)
        stats = probe.stats.last
        assert stats.frames_dropped > 0, "the gates held frames back: 5 Hz a camera against frame_rate 1"

        answer = probe.call(probe.query, Query.Request(question="What did the rear camera see?"), timeout=180)
        assert answer.success, answer.message
        frames = [e for e in answer.evidence if e.kind == "frame"]
        assert frames and all(e.camera in CAMERAS for e in frames), answer.evidence

        refused = probe.call(probe.recall, Recall.Request(text="the dock", camera="roof"), timeout=60)
        assert not refused.success and "no camera 'roof'" in refused.message, refused.message

        cameras.stop("rear")
        stopped = time.monotonic()
        status = probe.diagnostics.wait(
            lambda m: (s := own_status(m)) is not None and s.level == DiagnosticStatus.WARN
            and "rear" in s.message, timeout=60, what="the rear camera reported silent")
        assert time.monotonic() - stopped >= TIMEOUT - 1.0
        values = {kv.key: kv.value for kv in own_status(status).values}
        assert values["cameras_silent"] == "rear", values
        assert values["cameras"] == "front, rear, arm_cam", values
        ingested = probe.stats.last.frames_ingested
        probe.stats.wait(lambda m: m.frames_ingested >= ingested + 2, timeout=120, what="the other cameras go on")
    finally:
        cameras.stop()
    node.check_alive()


def test_a_camera_list_the_node_cannot_take_ends_it_at_start_with_the_reason(tmp_path):
    params = {"model": SMALL_MODEL, "image_topics": ["a/image", "b/image"], "camera_names": ["left"]}
    node = NodeProcess(REPO_ROOT, dict(os.environ), tmp_path, name="memory", namespace="/cameras_bad", params=params)
    try:
        node.proc.wait(120)
    finally:
        node.stop()
    assert node.proc.returncode == 1
    assert "camera_names gives 1 names for 2 image_topics" in node.log(), node.log()[-2000:]
