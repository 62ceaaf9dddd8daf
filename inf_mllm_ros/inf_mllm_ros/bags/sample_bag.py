"""Write a synthetic rosbag2 bag of a warehouse robot's shift, with questions about it.

The bag holds a camera topic (drawn frames of a warehouse floor: docks, shelves, a door with a
signal light, a red forklift carrying pallets, a patrol robot), a ``/narration`` topic
(``std_msgs/msg/String``) that states what happens, e.g. ``"Forklift F2 parked at dock 3."``, each message
stamped with the bag's clock (the shift starts at 08:00:00 UTC: a memory with `clock: wall` reads the time of
day), and the patrol robot's odometry on ``/odom`` (``nav_msgs/msg/Odometry`` at 10 Hz in the ``map`` frame,
metres), which the node's `pose_topic` takes. Frames, narration and odometry come from one scenario, so what the
text says is what the frames show, and where the robot says it saw something is where its odometry puts it.

The first 40 s are scripted (the committed demo bag). Longer bags continue with seeded,
randomly drawn work cycles (a pallet arrives, is shelved, the door light may change, the forklift
parks), so a bag of any length has facts to ask about.

Command line::

    python -m inf_mllm_ros.bags.sample_bag OUT_DIR [--storage mcap|sqlite3] [--duration S]
        [--fps F] [--size WxH] [--raw] [--seed N] [--questions FILE]

The scenario is also available as data: :func:`scenario_events` and :func:`probe_questions`
(bags/warehouse_scenario.py); its frames are drawn by :func:`render_frame` (bags/warehouse_frames.py).
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..image_conversion import rgb_to_compressed_fields, rgb_to_image_fields
from .warehouse_frames import render_frame
from .warehouse_layout import MAP_FRAME, SHIFT_START, START_NS, clock_text
from .warehouse_scenario import SCRIPT_END_S, Event, Probe, Scenario, build_scenario, probe_questions, scenario_events

__all__ = [
    "CAMERA_TOPIC_COMPRESSED",
    "CAMERA_TOPIC_RAW",
    "NARRATION_TOPIC",
    "ODOMETRY_TOPIC",
    "SHIFT_START",
    "START_NS",
    "BagSummary",
    "Event",
    "Probe",
    "Scenario",
    "build_scenario",
    "clock_text",
    "main",
    "probe_questions",
    "render_frame",
    "scenario_events",
    "write_questions_yaml",
    "write_sample_bag",
]

CAMERA_TOPIC_COMPRESSED = "/camera/image_raw/compressed"
CAMERA_TOPIC_RAW = "/camera/image_raw"
NARRATION_TOPIC = "/narration"
ODOMETRY_TOPIC = "/odom"
CAMERA_FRAME_ID = "warehouse_cam"
ODOMETRY_HZ = 10.0
ROBOT_FRAME_ID = "base_link"

# rosbag2 metadata version 8 is read by Iron, Jazzy and Kilted alike.
BAG_VERSION = 8


@dataclass(frozen=True)
class BagSummary:
    """What :func:`write_sample_bag` wrote."""

    path: Path
    topics: dict[str, str]  # topic -> message type
    counts: dict[str, int]  # topic -> message count
    size_bytes: int
    events: list[Event]
    probes: list[Probe]


def _stamp(typestore, time_ns: int):
    Time = typestore.types["builtin_interfaces/msg/Time"]
    return Time(sec=time_ns // 1_000_000_000, nanosec=time_ns % 1_000_000_000)


def _odometry(typestore, header, x: float, y: float, yaw: float, speed: float):
    """The robot's odometry message: its pose in the map frame, its forward speed."""
    types = typestore.types
    Point, Quaternion, Vector3 = (types[f"geometry_msgs/msg/{n}"] for n in ("Point", "Quaternion", "Vector3"))
    pose = types["geometry_msgs/msg/Pose"](position=Point(x=x, y=y, z=0.0),
                                           orientation=Quaternion(x=0.0, y=0.0, z=math.sin(yaw / 2),
                                                                  w=math.cos(yaw / 2)))
    twist = types["geometry_msgs/msg/Twist"](linear=Vector3(x=speed, y=0.0, z=0.0),
                                             angular=Vector3(x=0.0, y=0.0, z=0.0))
    covariance = np.zeros(36, dtype=np.float64)
    return types["nav_msgs/msg/Odometry"](
        header=header, child_frame_id=ROBOT_FRAME_ID,
        pose=types["geometry_msgs/msg/PoseWithCovariance"](pose=pose, covariance=covariance),
        twist=types["geometry_msgs/msg/TwistWithCovariance"](twist=twist, covariance=covariance.copy()))


def write_sample_bag(
    out_dir: str | Path,
    *,
    storage: str = "mcap",
    duration_s: float = SCRIPT_END_S,
    fps: float = 1.0,
    size: tuple[int, int] = (320, 240),
    raw: bool = False,
    seed: int = 0,
    jpeg_quality: int = 80,
    overwrite: bool = False,
) -> BagSummary:
    """Write the shift as a rosbag2 bag folder ``out_dir`` (which must not exist yet).

    Camera frames go to ``/camera/image_raw/compressed`` (JPEG CompressedImage), or with
    ``raw=True`` to ``/camera/image_raw`` (rgb8 Image). Narration goes to ``/narration``, the patrol robot's
    odometry to ``/odom``.
    Bag time and header stamps agree and start at :data:`START_NS`.
    """
    from rosbags.rosbag2 import StoragePlugin, Writer
    from rosbags.typesys import Stores, get_typestore

    out = Path(out_dir)
    plugins = {"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}
    if storage not in plugins:
        raise ValueError(f"storage must be one of {sorted(plugins)}, got {storage!r}")
    if fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    width, height = size
    if width < 64 or height < 48:
        raise ValueError(f"size must be at least 64x48, got {width}x{height}")
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{out} exists; rosbag2 writes into a new folder")
        shutil.rmtree(out)

    scenario = build_scenario(duration_s, seed)
    typestore = get_typestore(Stores.LATEST)
    Header = typestore.types["std_msgs/msg/Header"]
    String = typestore.types["std_msgs/msg/String"]
    camera_type = "sensor_msgs/msg/Image" if raw else "sensor_msgs/msg/CompressedImage"
    camera_topic = CAMERA_TOPIC_RAW if raw else CAMERA_TOPIC_COMPRESSED
    ImageType = typestore.types[camera_type]
    rng = np.random.default_rng(seed)

    # Merge odometry, frames and narration by time; at equal times in that order (a text's pose is known when it
    # comes).
    frame_count = int(math.ceil(duration_s * fps - 1e-9))
    items = [(round(pose[0] * 1e9), 0, pose) for pose in scenario.robot_poses(ODOMETRY_HZ)]
    items += [(round(i / fps * 1e9), 1, i) for i in range(frame_count)]
    items += [(round(e.time_s * 1e9), 2, e) for e in scenario.events]
    items.sort(key=lambda item: (item[0], item[1]))

    counts = {camera_topic: 0, NARRATION_TOPIC: 0, ODOMETRY_TOPIC: 0}
    with Writer(out, version=BAG_VERSION, storage_plugin=plugins[storage]) as writer:
        cam = writer.add_connection(camera_topic, camera_type, typestore=typestore)
        text = writer.add_connection(NARRATION_TOPIC, "std_msgs/msg/String", typestore=typestore)
        odom = writer.add_connection(ODOMETRY_TOPIC, "nav_msgs/msg/Odometry", typestore=typestore)
        for offset_ns, what, payload in items:
            stamp_ns = START_NS + offset_ns
            if what == 0:
                msg = _odometry(typestore, Header(stamp=_stamp(typestore, stamp_ns), frame_id=MAP_FRAME), *payload[1:])
                writer.write(odom, stamp_ns, typestore.serialize_cdr(msg, "nav_msgs/msg/Odometry"))
                counts[ODOMETRY_TOPIC] += 1
            elif what == 1:
                rgb = render_frame(scenario, offset_ns / 1e9, width, height, rng)
                header = Header(stamp=_stamp(typestore, stamp_ns), frame_id=CAMERA_FRAME_ID)
                if raw:
                    fields = rgb_to_image_fields(rgb, "rgb8")
                else:
                    fields = rgb_to_compressed_fields(rgb, "jpeg", quality=jpeg_quality)
                fields["data"] = np.frombuffer(fields["data"], dtype=np.uint8)
                msg = ImageType(header=header, **fields)
                writer.write(cam, stamp_ns, typestore.serialize_cdr(msg, camera_type))
                counts[camera_topic] += 1
            else:
                msg = String(data=payload.text)
                writer.write(text, stamp_ns, typestore.serialize_cdr(msg, "std_msgs/msg/String"))
                counts[NARRATION_TOPIC] += 1

    size_bytes = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return BagSummary(out, {camera_topic: camera_type, NARRATION_TOPIC: "std_msgs/msg/String",
                            ODOMETRY_TOPIC: "nav_msgs/msg/Odometry"},
                      counts, size_bytes, list(scenario.events), list(scenario.probes))


def write_questions_yaml(path: str | Path, probes: Sequence[Probe]) -> None:
    """Write probes as YAML: a list of {time_s, question, expected[, needs_vision][, kind, about_s, place,
    place_xy]}."""
    import yaml

    doc = [{"time_s": float(p.time_s), "question": p.question, "expected": p.expected}
           | ({"needs_vision": True} if p.needs_vision else {})
           | ({"kind": p.kind} if p.kind != "descriptive" or p.about_s is not None else {})
           | ({"about_s": float(p.about_s)} if p.about_s is not None else {})
           | ({"place": p.place, "place_xy": [round(v, 3) for v in p.place_xy]} if p.place else {})
           for p in probes]
    header = (
        "# Questions about the bag next to this file. Ask each one once the replay has passed\n"
        "# time_s seconds from the bag start; a correct answer contains the expected words.\n"
        "# needs_vision: only the frames show the answer (no narration says it), so only a model\n"
        "# with trained vision can know it; the embedded models cannot.\n"
        "# kind: descriptive (what), temporal (when: expected is a time of day) or spatial (where);\n"
        "# about_s: the moment the answer rests on (seconds from the bag start); place_xy: where the\n"
        "# robot was then, metres in the map frame of /odom.\n"
    )
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=100)
    Path(path).write_text(header + text, encoding="utf-8")


def parse_size(text: str) -> tuple[int, int]:
    """A frame size on a command line, "WxH" (the bag writers' --size)."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must look like 320x240, got {text!r}") from None
    return width, height


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m inf_mllm_ros.bags.sample_bag",
        description="Write a synthetic warehouse-shift rosbag2 bag (camera + /narration).",
    )
    parser.add_argument("out_dir", help="bag folder to create (must not exist)")
    parser.add_argument("--storage", choices=("mcap", "sqlite3"), default="mcap")
    parser.add_argument("--duration", type=float, default=SCRIPT_END_S, help="seconds")
    parser.add_argument("--fps", type=float, default=1.0)
    parser.add_argument("--size", type=parse_size, default=(320, 240), help="WxH")
    parser.add_argument("--raw", action="store_true",
                        help=f"write {CAMERA_TOPIC_RAW} (rgb8 Image) instead of JPEG")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jpeg-quality", type=int, default=80)
    parser.add_argument("--questions", help="also write the probe questions to this YAML file "
                        "(default: questions.yaml inside OUT_DIR)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    args = parser.parse_args(argv)
    try:
        summary = write_sample_bag(
            args.out_dir, storage=args.storage, duration_s=args.duration, fps=args.fps,
            size=args.size, raw=args.raw, seed=args.seed, jpeg_quality=args.jpeg_quality,
            overwrite=args.overwrite,
        )
    except (ValueError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    questions = Path(args.questions) if args.questions else summary.path / "questions.yaml"
    write_questions_yaml(questions, summary.probes)
    for topic, msgtype in summary.topics.items():
        print(f"{topic}  {msgtype}  {summary.counts[topic]} messages")
    print(f"{summary.path}: {summary.size_bytes / 1e6:.2f} MB, "
          f"{len(summary.events)} events, {len(summary.probes)} questions in {questions}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
