"""Where and when across processes over DDS: a robot driving along x publishes odometry, texts and a frame;
`~/query` names its evidence with the poses the inputs were kept with, `~/recall` finds the planted moment
and filters by place, bad poses and bad recall arguments are refused with their reasons."""

from __future__ import annotations

import math
import os
import random
import re
import threading
import time

import numpy as np
import pytest
from geometry_msgs.msg import PoseArray
from nav_msgs.msg import Odometry
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image
from std_msgs.msg import String

from inf_mllm_interfaces.msg import CacheStats
from inf_mllm_interfaces.srv import Query, Recall
from inf_mllm_ros.engine.models.loading import SMALL_MODEL
from inf_mllm_ros.image_conversion import rgb_to_image_fields
from ros_helpers import Latest, RosProbe
from test_node import REPO_ROOT, NodeProcess

NAMESPACE = "/where_when"
FQN = f"{NAMESPACE}/memory"
RELIABLE = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
SPEED = 0.5  # m/s along x
FILLER = ["A cart rolled past the shelves with boxes of screws.", "The floor near the window was swept again.",
          "Two workers talked about the weather during the break.", "A forklift beeped while it backed up slowly."]
PLANTED = "The red cone is next to the charging dock."


class Driver:
    """Odometry at 20 Hz of a robot driving along x at SPEED from its start."""

    def __init__(self, probe: RosProbe):
        self.pub = probe.node.create_publisher(Odometry, f"{NAMESPACE}/odom", RELIABLE)
        self.clock = probe.node.get_clock()
        self.start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def x(self) -> float:
        return SPEED * (time.monotonic() - self.start)

    def publish(self, x: float, frame: str = "map", w: float = 1.0) -> None:
        msg = Odometry()
        msg.header.stamp = self.clock.now().to_msg()
        msg.header.frame_id = frame
        msg.pose.pose.position.x = x
        msg.pose.pose.orientation.w = w
        self.pub.publish(msg)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.publish(self.x())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture(scope="module")
def robot(tmp_path_factory):
    node = NodeProcess(REPO_ROOT, dict(os.environ), tmp_path_factory.mktemp("where_when"), name="memory",
                       namespace=NAMESPACE,
                       params={"model": SMALL_MODEL, "cache_size": 128, "chunk_size": 32, "max_new_tokens": 8,
                               "description_period": 0.0, "frame_rate": 0.0, "stats_period": 0.5,
                               "pose_topic": "odom", "pose_frame": "map", "pose_tolerance": 0.5})
    probe = RosProbe("where_when_probe", alive=node.check_alive)
    probe.stats = Latest(probe, CacheStats, f"{FQN}/cache_stats", RELIABLE)
    probe.evidence = Latest(probe, PoseArray, f"{FQN}/evidence_poses", RELIABLE)
    probe.text = probe.node.create_publisher(String, f"{NAMESPACE}/text", RELIABLE)
    probe.image = probe.node.create_publisher(Image, f"{NAMESPACE}/image", RELIABLE)
    probe.query = probe.node.create_client(Query, f"{FQN}/query")
    probe.recall = probe.node.create_client(Recall, f"{FQN}/recall")
    probe.stats.wait(lambda m: m.model_ready, timeout=180, what="model_ready")
    driver = Driver(probe)
    yield probe, driver, node
    driver.stop()
    probe.close()
    node.stop()


def test_answers_and_recalls_name_the_moment_and_the_place(robot):
    probe, driver, node = robot
    time.sleep(2.5)  # the node finds the odometry topic's type (it looks every second) and gets poses
    sent = {}
    for i in range(24):
        text = PLANTED if i == 6 else FILLER[i % len(FILLER)]
        if i == 6:
            sent["x"], sent["at"] = driver.x(), time.monotonic()
        probe.text.publish(String(data=text))
        time.sleep(0.3)
    rgb = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    image = Image(**rgb_to_image_fields(rgb, "rgb8"))
    image.header.stamp = probe.node.get_clock().now().to_msg()
    image.header.frame_id = "camera"
    probe.image.publish(image)
    probe.stats.wait(lambda m: m.texts_ingested >= 24 and m.frames_ingested >= 1, timeout=240,
                     what="every text and the frame taken")
    response = probe.call(probe.query, Query.Request(question="Where is the red cone?"), timeout=180)
    assert response.success, response.message
    top = response.evidence[0]
    assert "red cone" in top.text and top.kind == "text" and top.has_stamp
    assert top.has_pose and top.frame_id == "map" and abs(top.pose.position.x - sent["x"]) < 0.5, (top, sent)
    assert all(a.weight >= b.weight for a, b in zip(response.evidence, response.evidence[1:]))
    arrows = probe.evidence.wait(lambda m: len(m.poses) > 0, timeout=30, what="the evidence poses")
    assert arrows.header.frame_id == "map"

    found = probe.call(probe.recall, Recall.Request(text="red cone", max_results=3), timeout=120)
    assert found.success and len(found.moments) == 3 and "red cone" in found.moments[0].text
    assert found.latency < response.latency, "no answer is decoded"
    here = probe.call(probe.recall, Recall.Request(text="red cone", x=sent["x"], y=0.0, radius=0.6), timeout=120)
    assert here.success and "red cone" in here.moments[0].text
    assert all(abs(m.pose.position.x - sent["x"]) <= 0.6 for m in here.moments)
    # How long ago, counted from the query's time on the node's clock: the moment the model is told (time_note).
    wait_s = random.Random(os.getpid()).uniform(2.0, 6.0)
    time.sleep(wait_s)
    asked = probe.call(probe.query, Query.Request(question="How long ago did you see the red cone?"), timeout=180)
    elapsed = time.monotonic() - sent["at"]
    assert asked.success and "red cone" in asked.evidence[0].text, asked
    said = re.search(r"\[(\d+) seconds? ago\]", asked.time_note)
    assert "red cone" in asked.time_note and said, asked.time_note
    assert abs(int(said.group(1)) - elapsed) <= 2.0 + asked.latency, (asked.time_note, elapsed, wait_s)
    assert response.time_note == "", "a question that asks where is told nothing again"

    far = probe.call(probe.recall, Recall.Request(text="red cone", x=1e4, y=0.0, radius=1.0), timeout=120)
    assert far.success and far.moments == []
    for request, reason in [(Recall.Request(text=" "), "empty"), (Recall.Request(text="cone", radius=-1.0), "radius"),
                            (Recall.Request(text="cone", x=math.nan, radius=1.0), "finite")]:
        refused = probe.call(probe.recall, request, timeout=60)
        assert not refused.success and reason in refused.message, refused.message
    node.check_alive()


def test_bad_poses_are_refused_with_their_reason_and_the_node_goes_on(robot):
    probe, driver, node = robot
    before = probe.stats.wait(lambda m: m.model_ready, timeout=60).inputs_rejected
    driver.publish(math.nan)
    driver.publish(driver.x(), frame="odom")
    driver.publish(driver.x(), w=0.5)
    probe.stats.wait(lambda m: m.inputs_rejected >= before + 3, timeout=30, what="three poses refused")
    log = node.log()
    assert "pose refused" in log and ("not a finite number" in log or "frame" in log or "unit quaternion" in log)
    node.check_alive()
