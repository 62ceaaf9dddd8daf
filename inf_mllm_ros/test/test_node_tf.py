"""Poses through tf2 across processes over DDS: a robot whose odometry drifts (`odom -> base_link` on its tf topic) and
whose localiser corrects it (`map -> odom`), without a pose topic. The robot's tf topics are in its namespace, remapped
for the node as a robot among several is launched (`-r /tf:=tf -r /tf_static:=tf_static`). Answers and recalls name where the robot truly was
(not where its odometry says), the markers of the last answer reach an RViz that subscribes after it, a jump back
in time clears the poses and is reported with no pose refused, and a reset clears them too."""

from __future__ import annotations

import math
import os
import random
import threading
import time

import pytest
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from geometry_msgs.msg import TransformStamped
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from std_msgs.msg import String
from std_srvs.srv import Trigger
from tf2_msgs.msg import TFMessage
from visualization_msgs.msg import Marker, MarkerArray

from inf_mllm_interfaces.msg import CacheStats
from inf_mllm_interfaces.srv import Query, Recall
from inf_mllm_ros.engine.models.loading import SMALL_MODEL
from ros_helpers import Latest, RosProbe
from test_node import REPO_ROOT, NodeProcess

NAMESPACE = "/tf_robot"
FQN = f"{NAMESPACE}/memory"
TF, TF_STATIC = f"{NAMESPACE}/tf", f"{NAMESPACE}/tf_static"
RELIABLE = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
LATCHED = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.RELIABLE,
                     durability=DurabilityPolicy.TRANSIENT_LOCAL)
SPEED = 0.6  # m/s along the map's x
ODOMETRY_SCALE = 0.8  # the wheels under-read: odometry says 80 % of the way
ODOMETRY_START = -2.0  # and odometry's origin is where the robot started, 2 m into the map
FILLER = ["Battery at eighty percent.", "The aisle ahead is clear.", "Slowing down for a turn.",
          "A worker waved from the loading bay."]
PLANTED = "I see the orange cart next to a stack of tyres."


def transform(parent: str, child: str, stamp, x: float, yaw: float = 0.0) -> TransformStamped:
    t = TransformStamped()
    t.header.stamp, t.header.frame_id, t.child_frame_id = stamp, parent, child
    t.transform.translation.x = x
    t.transform.rotation.z, t.transform.rotation.w = math.sin(yaw / 2), math.cos(yaw / 2)
    return t


class Robot:
    """/tf of a robot driving along x: odometry at 20 Hz (drifting), the localiser's correction at 3 Hz; `back`
    seconds subtracted from every stamp once `jump` is called (a looped bag)."""

    def __init__(self, probe: RosProbe):
        self.node = probe.node
        self.tf = probe.node.create_publisher(TFMessage, TF, QoSProfile(depth=100))
        self.start = time.monotonic()
        self.back = 0.0
        self._held: list | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def true_x(self) -> float:
        return SPEED * (time.monotonic() - self.start)

    def _stamp(self):
        now = self.node.get_clock().now().nanoseconds * 1e-9 - self.back
        sec = math.floor(now)
        return type(self.node.get_clock().now().to_msg())(sec=int(sec), nanosec=int((now - sec) * 1e9))

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(0.05):
            x, stamp = self.true_x(), self._stamp()
            odometry = ODOMETRY_SCALE * x + ODOMETRY_START
            transforms = [transform("odom", "base_link", stamp, odometry)]
            if tick % 7 == 0:  # map -> odom: what makes odometry's pose the true one
                transforms.append(transform("map", "odom", stamp, x - odometry))
            held = self._held
            if held is not None:
                held.append(TFMessage(transforms=transforms))
            else:
                self.tf.publish(TFMessage(transforms=transforms))
            tick += 1

    def hold(self) -> None:
        """Keep the transforms back (a link that stalls, a bag replayed in lockstep); `release` sends them at once."""
        self._held = []

    def release(self) -> None:
        held, self._held = self._held or [], None
        for msg in held:
            self.tf.publish(msg)

    def jump(self, seconds: float) -> None:
        self.back = seconds

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture(scope="module")
def robot(tmp_path_factory):
    node = NodeProcess(REPO_ROOT, dict(os.environ), tmp_path_factory.mktemp("tf"), name="memory",
                       namespace=NAMESPACE, remaps=("/tf:=tf", "/tf_static:=tf_static"),
                       params={"model": SMALL_MODEL, "cache_size": 128, "chunk_size": 32, "max_new_tokens": 8,
                               "description_period": 0.0, "stats_period": 0.5, "pose_tolerance": 0.5})
    probe = RosProbe("tf_probe", alive=node.check_alive)
    probe.stats = Latest(probe, CacheStats, f"{FQN}/cache_stats", RELIABLE)
    probe.diagnostics = Latest(probe, DiagnosticArray, "/diagnostics", RELIABLE)
    probe.text = probe.node.create_publisher(String, f"{NAMESPACE}/text", RELIABLE)
    probe.query = probe.node.create_client(Query, f"{FQN}/query")
    probe.recall = probe.node.create_client(Recall, f"{FQN}/recall")
    probe.reset = probe.node.create_client(Trigger, f"{FQN}/reset")
    static = probe.node.create_publisher(TFMessage, TF_STATIC, LATCHED)
    static.publish(TFMessage(transforms=[transform("base_link", "camera_link", probe.node.get_clock().now().to_msg(),
                                                   0.3)]))
    probe.stats.wait(lambda m: m.model_ready, timeout=180, what="model_ready")
    driver = Robot(probe)
    yield probe, driver, node
    driver.stop()
    probe.close()
    node.stop()


def own_status(msg: DiagnosticArray) -> DiagnosticStatus | None:
    return next((s for s in msg.status if s.name == f"{FQN}: memory"), None)


def test_inputs_are_kept_where_the_corrected_robot_was_and_the_markers_reach_a_late_rviz(robot):
    probe, driver, node = robot
    time.sleep(1.0)
    sent, planted = {}, random.Random(os.getpid()).randrange(2, 14)
    for i in range(16):
        if i == planted:
            sent["x"] = driver.true_x()
        probe.text.publish(String(data=PLANTED if i == planted else FILLER[i % len(FILLER)]))
        time.sleep(0.3)
    probe.stats.wait(lambda m: m.texts_ingested >= 16, timeout=240, what="every text taken")
    assert probe.stats.last.inputs_rejected == 0
    response = probe.call(probe.query, Query.Request(question="Where did you see the cart?"), timeout=180)
    assert response.success, response.message
    top = response.evidence[0]
    assert "orange cart" in top.text and top.has_pose and top.frame_id == "map", top
    # Where the robot was, not where its odometry says (metres off).
    assert abs(top.pose.position.x - sent["x"]) < 0.3, (top.pose.position.x, sent)
    assert abs(ODOMETRY_SCALE * sent["x"] + ODOMETRY_START - sent["x"]) > 1.5
    found = probe.call(probe.recall, Recall.Request(text="orange cart", max_results=3), timeout=120)
    assert found.success and "orange cart" in found.moments[0].text

    # An RViz that starts now, after both, gets the last answer's markers and the last recall's.
    late = RosProbe("tf_late_rviz", alive=node.check_alive)
    try:
        evidence = Latest(late, MarkerArray, f"{FQN}/evidence", LATCHED)
        moments = Latest(late, MarkerArray, f"{FQN}/recall_moments", LATCHED)
        shown = evidence.wait(lambda m: len(m.markers) > 1, timeout=30, what="the evidence markers")
        assert shown.markers[0].action == Marker.DELETEALL
        spheres = [m for m in shown.markers if m.type == Marker.SPHERE]
        labels = [m for m in shown.markers if m.type == Marker.TEXT_VIEW_FACING]
        assert len(spheres) == len(labels) == sum(e.has_pose for e in response.evidence)
        assert spheres[0].header.frame_id == "map" and abs(spheres[0].pose.position.x - top.pose.position.x) < 1e-6
        assert spheres[0].scale.x == max(s.scale.x for s in spheres), "the heaviest is the largest"
        assert "orange cart" in labels[0].text
        recalled = moments.wait(lambda m: len(m.markers) > 1, timeout=30, what="the recall markers")
        assert "orange cart" in [m for m in recalled.markers if m.type == Marker.TEXT_VIEW_FACING][0].text
    finally:
        late.close()
    node.check_alive()


def test_transforms_are_taken_by_a_node_of_their_own_named_after_the_memory(robot):
    """/tf is taken on a thread and node of its own (node/transform_listener.py), in the memory's namespace, named
    after it: the process's `__node:=memory` renames the memory's node alone."""
    probe, _, node = robot
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        names = probe.node.get_node_names_and_namespaces()
        if ("memory_transforms", NAMESPACE) in names:
            break
        time.sleep(0.2)
    assert ("memory_transforms", NAMESPACE) in names, names
    assert names.count(("memory", NAMESPACE)) == 1, names
    node.check_alive()


@pytest.mark.parametrize("held_s", [2.0, 4.5, 9.0])
def test_an_input_that_comes_right_after_a_burst_of_transforms_waits_for_them_and_has_its_pose(robot, held_s):
    """A burst of /tf (held back, then sent at once: 9 s is about 200 messages, as a route bag replayed in lockstep
    sends between two narration lines) is taken one message a turn, while the text sent right after it is taken at
    once: it waits for the transforms of its stamp and is kept where the robot was, not without a pose."""
    probe, driver, node = robot
    thing = f"a {random.Random(held_s).choice(['blue', 'green', 'white'])} ladder {int(held_s * 10)}"
    before = probe.stats.last.texts_ingested
    driver.hold()
    time.sleep(held_s)
    x = driver.true_x()
    driver.release()
    probe.text.publish(String(data=f"I see {thing} by the dock door."))
    probe.stats.wait(lambda m: m.texts_ingested > before, timeout=120, what="the text taken")
    found = probe.call(probe.recall, Recall.Request(text=thing, max_results=3), timeout=120)
    assert found.success and thing in found.moments[0].text, found
    top = found.moments[0]
    assert top.has_pose and top.frame_id == "map", top
    assert abs(top.pose.position.x - x) < 0.5, (top.pose.position.x, x)
    node.check_alive()


def test_a_jump_back_in_time_clears_the_poses_says_so_and_refuses_none(robot):
    probe, driver, node = robot
    rejected = probe.stats.wait(lambda m: m.model_ready, timeout=60).inputs_rejected
    driver.jump(120.0)  # a bag played again from its start
    status = probe.diagnostics.wait(
        lambda m: (s := own_status(m)) is not None and "time jumped back" in s.message, timeout=30,
        what="the jump reported")
    assert own_status(status).level == DiagnosticStatus.WARN
    values = {kv.key: kv.value for kv in own_status(status).values}
    assert int(values["pose_history_cleared"]) >= 1 and values["pose_frame"] == "map"
    time.sleep(1.5)  # transforms go on after the jump
    probe.text.publish(String(data="Passing a blue barrel."))
    probe.stats.wait(lambda m: m.inputs_rejected == rejected and m.texts_ingested >= 17, timeout=120,
                     what="the text taken, no transform refused")
    assert probe.stats.last.inputs_rejected == rejected

    done = probe.call(probe.reset, Trigger.Request(), timeout=120)
    assert done.success, done.message
    probe.diagnostics.wait(lambda m: (s := own_status(m)) is not None and "memory reset: pose history cleared"
                           in s.message, timeout=30, what="the reset reported")
    node.check_alive()
