"""Write a seeded route bag: a robot's drive round a warehouse floor as its sensors record it, with the truth beside
it (bags/route_scenario.py draws the drive).

Topics, as a real robot's bag has them:

- ``/odom`` (``nav_msgs/msg/Odometry``, 30 Hz, ``odom`` -> ``base_link``): wheel odometry, which drifts from the
  truth (a few decimetres to a couple of metres over a 300 s drive);
- ``/tf`` (``tf2_msgs/msg/TFMessage``): ``odom -> base_link`` with each odometry message, as the odometry broadcaster
  sends it, and ``map -> odom`` from a localiser at about 3 Hz, in steps, published 30-80 ms after its stamp:
  composed with ``odom -> base_link`` it gives the true pose within a few centimetres;
- ``/tf_static``: ``base_link -> camera_link`` once, at the start (offered transient local, as tf2's static
  broadcaster does);
- ``/camera/image_raw/compressed`` (JPEG ``sensor_msgs/msg/CompressedImage``, ``camera_link``): drawn views ahead
  of the robot, racks and the things in sight;
- ``/narration`` (``std_msgs/msg/String``): what the robot says it sees, in words that name no place, among filler.

The bag clock starts at :data:`START_NS` (08:00:00 UTC, as the sample bags), so a memory with ``clock: wall`` reads
times of day. The truth file (:func:`write_route_truth`, YAML) holds every sighting's time and true pose, the
questions with their expected answers, and the seed.

Command line::

    python -m inf_mllm_ros.bags.route_bag OUT_DIR --seed N [--duration S] [--fps F] [--size WxH]
        [--storage mcap|sqlite3] [--truth FILE] [--overwrite]

writes the bag folder OUT_DIR and its truth, ``OUT_DIR/truth.yaml`` unless ``--truth`` says where.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..image_conversion import rgb_to_compressed_fields
from .route_scenario import (HFOV_RAD, LOCALISER_HZ, LOCALISER_SIGMA_M, ODOM_HZ, RACK_HEIGHT_M, SIGHT_RADIUS_M,
                             VIEW_RANGE_M, RouteScenario, build_route, localiser_updates, odometry_drift,
                             simulate_odometry)
from .sample_bag import BAG_VERSION, parse_size
from .warehouse_layout import SHIFT_START, START_NS, clock_text

__all__ = [
    "CAMERA_TOPIC",
    "NARRATION_TOPIC",
    "ODOMETRY_TOPIC",
    "START_NS",
    "TF_STATIC_TOPIC",
    "TF_TOPIC",
    "RouteBagSummary",
    "build_route",
    "main",
    "render_view",
    "truth_document",
    "write_route_bag",
    "write_route_truth",
]

ODOMETRY_TOPIC = "/odom"
TF_TOPIC = "/tf"
TF_STATIC_TOPIC = "/tf_static"
CAMERA_TOPIC = "/camera/image_raw/compressed"
NARRATION_TOPIC = "/narration"
MAP_FRAME, ODOM_FRAME, BASE_FRAME, CAMERA_FRAME = "map", "odom", "base_link", "camera_link"
CAMERA_MOUNT = (0.25, 0.0, 0.45)  # base_link -> camera_link, metres; the camera looks along base_link's x

TYPES = {
    ODOMETRY_TOPIC: "nav_msgs/msg/Odometry",
    TF_TOPIC: "tf2_msgs/msg/TFMessage",
    TF_STATIC_TOPIC: "tf2_msgs/msg/TFMessage",
    CAMERA_TOPIC: "sensor_msgs/msg/CompressedImage",
    NARRATION_TOPIC: "std_msgs/msg/String",
}


@dataclass(frozen=True)
class RouteBagSummary:
    """What :func:`write_route_bag` wrote, with the scenario it came from and its sensors' errors."""

    path: Path
    topics: dict[str, str]  # topic -> message type
    counts: dict[str, int]  # topic -> message count
    size_bytes: int
    write_s: float
    scenario: RouteScenario
    drift_end_m: float  # odometry from the true start pose vs the truth, at the end
    drift_max_m: float


# --- camera frames -------------------------------------------------------------------------------------------

class _Camera:
    """A level pinhole camera on the robot: world points (map) to pixels."""

    def __init__(self, scenario: RouteScenario, t: float, width: int, height: int) -> None:
        x, y, yaw = (float(v) for v in scenario.pose_at(t))
        self.c, self.s = math.cos(yaw), math.sin(yaw)
        self.x, self.y = x + CAMERA_MOUNT[0] * self.c, y + CAMERA_MOUNT[0] * self.s
        self.w, self.h = width, height
        self.f = (width / 2) / math.tan(HFOV_RAD / 2)

    def to_camera(self, wx, wy, wz):
        """Forward, left and up of the camera, metres."""
        dx, dy = np.asarray(wx, float) - self.x, np.asarray(wy, float) - self.y
        return self.c * dx + self.s * dy, -self.s * dx + self.c * dy, np.asarray(wz, float) - CAMERA_MOUNT[2]

    def pixels(self, fwd, left, up) -> np.ndarray:
        return np.stack([self.w / 2 - self.f * left / fwd, self.h / 2 - self.f * up / fwd], axis=-1)


def _clip_near(poly: np.ndarray, near: float = 0.15) -> np.ndarray:
    """Clip a camera-frame polygon (rows: forward, left, up) to the part in front of the camera."""
    out = []
    for i in range(len(poly)):
        a, b = poly[i], poly[(i + 1) % len(poly)]
        if a[0] >= near:
            out.append(a)
        if (a[0] >= near) != (b[0] >= near):
            out.append(a + (b - a) * (near - a[0]) / (b[0] - a[0]))
    return np.asarray(out)


WALL_HEIGHT_M = 5.0
RACK_COLOUR, RACK_END_COLOUR, BEAM_COLOUR, WALL_COLOUR = (55, 85, 140), (70, 78, 96), (235, 120, 30), (122, 120, 114)


def _faces(cam: _Camera, scenario: RouteScenario) -> list[tuple]:
    """Vertical faces toward the camera as (distance, a, b, height, colour, beams): racks' sides and the walls."""
    faces = []
    for r in scenario.racks:  # counter-clockwise footprints: the outward normal of a -> b is (by - ay, ax - bx)
        corners = [(r.x0, r.y0), (r.x1, r.y0), (r.x1, r.y1), (r.x0, r.y1)]
        for i in range(4):
            a, b = corners[i], corners[(i + 1) % 4]
            long_side = math.dist(a, b) > 2.0
            faces.append((a, b, RACK_HEIGHT_M, RACK_COLOUR if long_side else RACK_END_COLOUR, long_side))
    w, h = scenario.floor
    walls = [(0.0, 0.0), (0.0, h), (w, h), (w, 0.0)]  # clockwise: the normals point into the floor
    faces += [(walls[i], walls[(i + 1) % 4], WALL_HEIGHT_M, WALL_COLOUR, False) for i in range(4)]
    out = []
    for a, b, height, colour, beams in faces:
        mx, my = (a[0] + b[0]) / 2, (a[1] + b[1]) / 2
        if (b[1] - a[1]) * (cam.x - mx) + (a[0] - b[0]) * (cam.y - my) > 0:
            out.append((math.hypot(mx - cam.x, my - cam.y), a, b, height, colour, beams))
    return sorted(out, key=lambda f: -f[0])


def _draw_faces(img: np.ndarray, cam: _Camera, scenario: RouteScenario) -> None:
    """Walls and racks, far faces first, with orange beams along the racks' long sides."""
    import cv2

    for _, (ax, ay), (bx, by), height, colour, beams in _faces(cam, scenario):
        fwd, left, up = cam.to_camera([ax, bx, bx, ax], [ay, by, by, ay], [0, 0, height, height])
        poly = _clip_near(np.stack([fwd, left, up], axis=1))
        if len(poly) < 3:
            continue
        px = np.round(cam.pixels(poly[:, 0], poly[:, 1], poly[:, 2])).astype(np.int32)
        cv2.fillPoly(img, [px], colour)
        for z in (0.15, 0.95, 1.75, height - 0.05) if beams else ():
            fwd, left, up = cam.to_camera([ax, bx], [ay, by], [z, z])
            seg = _clip_near(np.stack([fwd, left, up], axis=1))
            if len(seg) >= 2:
                p = np.round(cam.pixels(seg[:, 0], seg[:, 1], seg[:, 2])).astype(np.int32)
                cv2.line(img, tuple(p[0]), tuple(p[1]), BEAM_COLOUR, 1, cv2.LINE_AA)


def _hidden(cam: _Camera, px: float, py: float, racks) -> bool:
    """Whether a rack stands between the camera and a point (Liang-Barsky on each footprint)."""
    dx, dy = px - cam.x, py - cam.y
    for r in racks:
        lo, hi = 0.0, 1.0
        for p, q in ((-dx, cam.x - r.x0), (dx, r.x1 - cam.x), (-dy, cam.y - r.y0), (dy, r.y1 - cam.y)):
            if abs(p) < 1e-12:
                if q < 0:
                    break
                continue
            u = q / p
            lo, hi = (max(lo, u), hi) if p < 0 else (lo, min(hi, u))
        else:
            if lo < hi:
                return True
    return False


def _draw_thing(img: np.ndarray, shape: str, colour, u: float, v: float, w: float, h: float) -> None:
    """A thing's simple drawing: bottom centre at pixel (u, v), `w` x `h` pixels."""
    import cv2

    dark = tuple(int(c * 0.55) for c in colour)
    light = tuple(min(255, int(c * 1.25) + 20) for c in colour)
    x0, x1, y0, y1 = int(u - w / 2), int(u + w / 2), int(v - h), int(v)
    t = max(1, int(w / 10))
    if shape == "box":
        cv2.rectangle(img, (x0, y0), (x1, y1), colour, -1)
        cv2.rectangle(img, (x0, y0), (x1, y0 + max(1, int(h / 8))), light, -1)
        cv2.rectangle(img, (x0, y0), (x1, y1), dark, 1)
    elif shape == "drum":
        cv2.rectangle(img, (x0, y0), (x1, y1), colour, -1)
        cv2.ellipse(img, (int(u), y0), (max(1, int(w / 2)), max(1, int(h / 8))), 0, 0, 360, light, -1)
        cv2.line(img, (x0, int(v - h / 2)), (x1, int(v - h / 2)), dark, 1)
    elif shape == "cones":
        for k in range(3):
            cu = x0 + (k + 0.5) * w / 3
            pts = np.array([[cu, y0 + h * 0.1], [cu - w / 8, y1], [cu + w / 8, y1]], dtype=np.int32)
            cv2.fillPoly(img, [pts], colour)
            cv2.line(img, (int(cu - w / 14), int(v - h / 2)), (int(cu + w / 14), int(v - h / 2)), (245, 245, 245), 1)
    elif shape == "tyres":
        n = 4 if h > w else 2
        for k in range(n):
            cy = int(v - (k + 0.5) * h / n)
            cv2.ellipse(img, (int(u), cy), (max(1, int(w / 2)), max(1, int(h / (2 * n)))), 0, 0, 360, colour, -1)
            cv2.ellipse(img, (int(u), cy), (max(1, int(w / 5)), max(1, int(h / (5 * n)))), 0, 0, 360, dark, -1)
    elif shape == "ladder":
        cv2.line(img, (x0, y1), (int(u - w / 4), y0), colour, t)
        cv2.line(img, (x1, y1), (int(u + w / 4), y0), colour, t)
        for k in range(1, 6):
            yy = int(v - k * h / 6)
            cv2.line(img, (int(x0 + k * w / 24), yy), (int(x1 - k * w / 24), yy), colour, max(1, t // 2))
    elif shape == "low":
        cv2.rectangle(img, (x0, int(v - h * 0.3)), (x1, y1), colour, -1)
        cv2.rectangle(img, (x0, int(v - h * 0.3)), (x1, y1), dark, 1)
        cv2.line(img, (x1 - t, int(v - h * 0.3)), (x1 - t, y0), dark, t)
    elif shape == "tall":
        cv2.rectangle(img, (x0, int(y0 + h * 0.15)), (x1, y1), colour, -1)
        cv2.rectangle(img, (int(u - w / 4), y0), (int(u + w / 4), int(y0 + h * 0.15)), dark, -1)
    else:  # sign: an A-frame with a stripe
        pts = np.array([[u - w / 4, y0], [u + w / 4, y0], [x1, y1], [x0, y1]], dtype=np.int32)
        cv2.fillPoly(img, [pts], colour)
        cv2.line(img, (int(u - w / 3), int(v - h / 2)), (int(u + w / 3), int(v - h / 2)), (30, 30, 30), t)


def render_view(scenario: RouteScenario, t: float, width: int = 160, height: int = 120,
                rng: np.random.Generator | None = None, noise: float = 2.0) -> np.ndarray:
    """What the robot's camera sees at `t`: floor, racks and the things within `VIEW_RANGE_M` in front and not
    behind a rack, as an (height, width, 3) RGB uint8 array; `rng` adds mild sensor noise."""
    cam = _Camera(scenario, t, width, height)
    img = np.empty((height, width, 3), dtype=np.uint8)
    img[: height // 2] = (88, 90, 96)  # far wall and roof
    img[height // 2:] = (160, 157, 148)  # concrete floor
    _draw_faces(img, cam, scenario)
    visible = []
    for thing in scenario.things:
        px, py = thing.position_at(t)
        fwd, left, _ = cam.to_camera(px, py, 0.0)
        fwd, left = float(fwd), float(left)
        if fwd < 0.4 or math.hypot(fwd, left) > VIEW_RANGE_M or abs(math.atan2(left, fwd)) > HFOV_RAD / 2 + 0.1:
            continue
        if not _hidden(cam, px, py, scenario.racks):
            visible.append((fwd, left, thing.kind))
    for fwd, left, kind in sorted(visible, key=lambda item: -item[0]):
        u, v = cam.pixels(fwd, left, -CAMERA_MOUNT[2])
        _draw_thing(img, kind.shape, kind.colour, float(u), float(v), cam.f * kind.size[0] / fwd,
                    cam.f * kind.size[1] / fwd)
    if rng is not None and noise > 0:
        jitter = rng.normal(0.0, noise, size=img.shape)
        img = np.clip(img.astype(np.float32) + jitter, 0, 255).astype(np.uint8)
    return img


# --- messages ------------------------------------------------------------------------------------------------

def _stamp(types, time_ns: int):
    return types["builtin_interfaces/msg/Time"](sec=time_ns // 1_000_000_000, nanosec=time_ns % 1_000_000_000)


def _header(types, time_ns: int, frame_id: str):
    return types["std_msgs/msg/Header"](stamp=_stamp(types, time_ns), frame_id=frame_id)


def _quaternion(types, yaw: float):
    return types["geometry_msgs/msg/Quaternion"](x=0.0, y=0.0, z=math.sin(yaw / 2), w=math.cos(yaw / 2))


def _transform(types, time_ns: int, parent: str, child: str, x: float, y: float, yaw: float, z: float = 0.0):
    """A TransformStamped `parent` -> `child` (a planar pose, at height `z`)."""
    transform = types["geometry_msgs/msg/Transform"](
        translation=types["geometry_msgs/msg/Vector3"](x=float(x), y=float(y), z=float(z)),
        rotation=_quaternion(types, float(yaw)))
    return types["geometry_msgs/msg/TransformStamped"](header=_header(types, time_ns, parent), child_frame_id=child,
                                                       transform=transform)


POSE_COVARIANCE = np.diag([0.02, 0.02, 1e3, 1e3, 1e3, 0.01]).ravel()  # x, y, z, roll, pitch, yaw
TWIST_COVARIANCE = np.diag([0.002, 1e3, 1e3, 1e3, 1e3, 0.005]).ravel()


def _odometry(types, time_ns: int, x: float, y: float, yaw: float, v: float, w: float):
    """The wheel odometry message: pose in `odom`, twist in `base_link`."""
    Vector3 = types["geometry_msgs/msg/Vector3"]
    pose = types["geometry_msgs/msg/Pose"](position=types["geometry_msgs/msg/Point"](x=float(x), y=float(y), z=0.0),
                                           orientation=_quaternion(types, float(yaw)))
    twist = types["geometry_msgs/msg/Twist"](linear=Vector3(x=float(v), y=0.0, z=0.0),
                                             angular=Vector3(x=0.0, y=0.0, z=float(w)))
    return types["nav_msgs/msg/Odometry"](
        header=_header(types, time_ns, ODOM_FRAME), child_frame_id=BASE_FRAME,
        pose=types["geometry_msgs/msg/PoseWithCovariance"](pose=pose, covariance=POSE_COVARIANCE.copy()),
        twist=types["geometry_msgs/msg/TwistWithCovariance"](twist=twist, covariance=TWIST_COVARIANCE.copy()))


def _static_qos():
    """The QoS tf2's static broadcaster offers: reliable, transient local, keep last 1."""
    from rosbags.interfaces import Qos, QosDurability, QosHistory, QosLiveliness, QosReliability, QosTime

    zero = QosTime(0, 0)
    return [Qos(QosHistory.KEEP_LAST, 1, QosReliability.RELIABLE, QosDurability.TRANSIENT_LOCAL, zero, zero,
                QosLiveliness.AUTOMATIC, zero, False)]


def _ns(t: float) -> int:
    return START_NS + int(round(t * 1e9))


def _schedule(scenario: RouteScenario, odom, localiser, fps: float) -> list[tuple]:
    """Every message as (bag time ns, tie order, topic, payload), in time order."""
    items = [(START_NS, 0, TF_STATIC_TOPIC, None)]
    items += [(_ns(t), 1, TF_TOPIC, ("odom", i)) for i, t in enumerate(odom.t)]
    items += [(_ns(t), 2, ODOMETRY_TOPIC, i) for i, t in enumerate(odom.t)]
    items += [(_ns(t), 1, TF_TOPIC, ("map", i)) for i, t in enumerate(localiser.publish_s)]
    frames = int(math.ceil(scenario.duration * fps - 1e-9))
    items += [(_ns(i / fps), 3, CAMERA_TOPIC, i / fps) for i in range(frames)]
    items += [(_ns(n.time_s), 4, NARRATION_TOPIC, n.text) for n in scenario.narration]
    items.sort(key=lambda item: (item[0], item[1]))
    return items


def write_route_bag(out_dir: str | Path, seed: int, duration: float = 300.0, fps: float = 2.0,
                    size: tuple[int, int] = (160, 120), storage: str = "mcap", *, jpeg_quality: int = 75,
                    overwrite: bool = False) -> RouteBagSummary:
    """Write the drive of `seed` as a rosbag2 bag folder `out_dir` (which must not exist, unless `overwrite`).

    Header stamps are the sensors' times; bag times equal them, but for the localiser's map -> odom, which comes
    30-80 ms after the scan it was computed from, as on a robot.
    """
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore

    plugins = {"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}
    if storage not in plugins:
        raise ValueError(f"storage must be one of {sorted(plugins)}, got {storage!r}")
    if fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    width, height = size
    if width < 32 or height < 24:
        raise ValueError(f"size must be at least 32x24, got {width}x{height}")
    out = Path(out_dir)
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{out} exists; rosbag2 writes into a new folder")
        shutil.rmtree(out)

    started = time.perf_counter()
    scenario = build_route(seed, duration)
    odom = simulate_odometry(scenario)
    localiser = localiser_updates(scenario, odom)
    drift = odometry_drift(scenario, odom)
    typestore = get_typestore(Stores.LATEST)
    types = typestore.types
    frame_rng = np.random.default_rng([seed, 21])
    counts = dict.fromkeys(TYPES, 0)
    with Writer(out, version=BAG_VERSION, storage_plugin=plugins[storage]) as writer:
        conns = {topic: writer.add_connection(topic, msgtype, typestore=typestore,
                                              offered_qos_profiles=_static_qos() if topic == TF_STATIC_TOPIC else ())
                 for topic, msgtype in TYPES.items()}
        for time_ns, _, topic, payload in _schedule(scenario, odom, localiser, fps):
            msg = _message(types, topic, payload, scenario, odom, localiser, size, frame_rng, jpeg_quality)
            writer.write(conns[topic], time_ns, typestore.serialize_cdr(msg, TYPES[topic]))
            counts[topic] += 1
    size_bytes = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return RouteBagSummary(out, dict(TYPES), counts, size_bytes, time.perf_counter() - started, scenario,
                           float(drift[-1]), float(drift.max()))


def _message(types, topic: str, payload, scenario, odom, localiser, size, rng, quality: int):
    """The message of one scheduled item."""
    if topic == TF_STATIC_TOPIC:
        mount = _transform(types, START_NS, BASE_FRAME, CAMERA_FRAME, CAMERA_MOUNT[0], CAMERA_MOUNT[1], 0.0,
                           CAMERA_MOUNT[2])
        return types["tf2_msgs/msg/TFMessage"](transforms=[mount])
    if topic == TF_TOPIC:
        which, i = payload
        if which == "odom":
            tf = _transform(types, _ns(odom.t[i]), ODOM_FRAME, BASE_FRAME, odom.x[i], odom.y[i], odom.yaw[i])
        else:
            tf = _transform(types, _ns(localiser.stamp_s[i]), MAP_FRAME, ODOM_FRAME, localiser.x[i],
                            localiser.y[i], localiser.yaw[i])
        return types["tf2_msgs/msg/TFMessage"](transforms=[tf])
    if topic == ODOMETRY_TOPIC:
        i = payload
        return _odometry(types, _ns(odom.t[i]), odom.x[i], odom.y[i], odom.yaw[i], odom.v[i], odom.w[i])
    if topic == CAMERA_TOPIC:
        fields = rgb_to_compressed_fields(render_view(scenario, payload, *size, rng), "jpeg", quality=quality)
        fields["data"] = np.frombuffer(fields["data"], dtype=np.uint8)
        return types["sensor_msgs/msg/CompressedImage"](header=_header(types, _ns(payload), CAMERA_FRAME), **fields)
    return types["std_msgs/msg/String"](data=payload)


# --- the truth -----------------------------------------------------------------------------------------------

def _plain(value):
    """Numbers as plain rounded floats, infinity as None, for YAML."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return None if math.isinf(value) else round(float(value), 4)
    if isinstance(value, np.integer):
        return int(value)
    return value


def truth_document(scenario: RouteScenario) -> dict:
    """The truth of a drive as plain data (what :func:`write_route_truth` writes)."""
    odom = simulate_odometry(scenario)
    drift = odometry_drift(scenario, odom)
    route = scenario.route
    doc = {
        "seed": scenario.seed,
        "duration_s": scenario.duration,
        "start_ns": START_NS,
        "start_time": SHIFT_START.isoformat(),
        "frames": {"map": MAP_FRAME, "odom": ODOM_FRAME, "base": BASE_FRAME, "camera": CAMERA_FRAME},
        "topics": dict(TYPES),
        "sight_radius_m": SIGHT_RADIUS_M,
        "floor": {"width_m": scenario.floor[0], "height_m": scenario.floor[1]},
        "route": {"lap_length_m": route.lap_length, "waypoints": [list(p) for p in route.waypoints],
                  "places": list(route.places),
                  "stops": [{"arrive_s": s.arrive_s, "leave_s": s.leave_s} for s in route.stops
                            if s.arrive_s < scenario.duration]},
        "racks": [[r.x0, r.y0, r.x1, r.y1] for r in scenario.racks],
        "things": [{"name": th.name, "movable": len(th.placements) > 1,
                    "placements": [{"from_s": p.from_s, "until_s": p.until_s, "x": p.x, "y": p.y}
                                   for p in th.placements]} for th in scenario.things],
        "absent": list(scenario.absent),
        "never_seen": list(scenario.never_seen),
        "sightings": [{"index": i, "thing": s.thing, "time_s": s.time_s, "clock": clock_text(s.time_s),
                       "closest_s": s.closest_s, "distance_m": s.distance_m,
                       "pose": {"x": s.pose[0], "y": s.pose[1], "yaw": s.pose[2]}, "thing_xy": list(s.thing_xy),
                       "place": s.place, "side": s.side, "nth": s.nth, "text": s.text, "mentions": list(s.mentions)}
                      for i, s in enumerate(scenario.sightings)],
        "narration": [{"time_s": n.time_s, "text": n.text, "sighting": n.sighting} for n in scenario.narration],
        "questions": [{"question": q.question, "kind": q.kind, "thing": q.thing, "asked_s": q.asked_s,
                       "expected": q.expected} for q in scenario.questions],
        "odometry": {"hz": ODOM_HZ, "drift_end_m": float(drift[-1]), "drift_max_m": float(drift.max())},
        "localiser": {"hz": LOCALISER_HZ, "sigma_m": LOCALISER_SIGMA_M},
    }
    return _plain(doc)


def write_route_truth(path: str | Path, scenario: RouteScenario) -> None:
    """Write the drive's truth as YAML: sightings with the robot's true pose, the questions with expected
    answers, the things and where they stood, the route, and the seed."""
    import yaml

    header = (
        "# The truth of the route bag beside this file (bags/route_bag.py). Times are seconds from the bag start\n"
        "# (start_ns; a wall clock reads start_time + time_s); poses and positions are metres in the map frame.\n"
        "# A sighting's time_s is when the narration says it, its pose the robot's true pose then. Questions are\n"
        "# asked at asked_s (the end of the drive); expected: where_*: the sighting's pose (x, y) and place,\n"
        "# when_*: its time_s, how_long_ago: seconds before asked_s, never_seen: seen false.\n"
    )
    text = yaml.safe_dump(truth_document(scenario), sort_keys=False, allow_unicode=True, width=120,
                          default_flow_style=None)
    Path(path).write_text(header + text, encoding="utf-8")


# --- command line --------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inf_mllm_ros.bags.route_bag",
                                     description="Write a seeded route bag (odometry, tf, camera, narration) "
                                                 "and its truth.")
    parser.add_argument("out_dir", help="bag folder to create (must not exist)")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds")
    parser.add_argument("--fps", type=float, default=2.0)
    parser.add_argument("--size", type=parse_size, default=(160, 120), help="WxH")
    parser.add_argument("--storage", choices=("mcap", "sqlite3"), default="mcap")
    parser.add_argument("--truth", help="truth file (default: truth.yaml inside OUT_DIR)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    args = parser.parse_args(argv)
    try:
        summary = write_route_bag(args.out_dir, args.seed, args.duration, args.fps, args.size, args.storage,
                                  overwrite=args.overwrite)
    except (ValueError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    truth = Path(args.truth) if args.truth else summary.path / "truth.yaml"
    write_route_truth(truth, summary.scenario)
    for topic, msgtype in summary.topics.items():
        print(f"{topic}  {msgtype}  {summary.counts[topic]} messages")
    sc = summary.scenario
    print(f"{summary.path}: {summary.size_bytes / 1e6:.2f} MB in {summary.write_s:.1f} s; {len(sc.sightings)} "
          f"sightings, {len(sc.questions)} questions in {truth}; odometry drift {summary.drift_end_m:.2f} m at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
