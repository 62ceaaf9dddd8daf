"""Write a synthetic rosbag2 bag of a warehouse robot's shift, with questions about it.

The bag holds a camera topic (drawn frames of a warehouse floor: docks, shelves, a door with a
signal light, a red forklift carrying pallets) and a ``/narration`` topic
(``std_msgs/msg/String``) that states what happens as timestamped facts, e.g.
``"[08:00:05] Forklift F2 parked at dock 3."``. Frames and narration come from one scenario, so
what the text says is what the frames show.

The first 40 s are scripted (the committed demo bag). Longer bags continue with seeded,
randomly drawn work cycles (a pallet arrives, is shelved, the door light may change, the forklift
parks), so a bag of any length has facts to ask about.

Command line::

    python -m inf_mllm_ros.bags.sample_bag OUT_DIR [--storage mcap|sqlite3] [--duration S]
        [--fps F] [--size WxH] [--raw] [--seed N] [--questions FILE]

The scenario is also available as data: :func:`scenario_events` and :func:`probe_questions`.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

from ..image_conversion import rgb_to_compressed_fields, rgb_to_image_fields

__all__ = [
    "CAMERA_TOPIC_COMPRESSED",
    "CAMERA_TOPIC_RAW",
    "NARRATION_TOPIC",
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
CAMERA_FRAME_ID = "warehouse_cam"

# A fixed epoch makes the bag byte-for-byte reproducible for a given seed.
SHIFT_START = datetime(2024, 6, 3, 8, 0, 0, tzinfo=timezone.utc)
START_NS = int(SHIFT_START.timestamp()) * 1_000_000_000

SCRIPT_END_S = 40.0
CYCLE_S = 30.0
# rosbag2 metadata version 8 is read by Iron, Jazzy and Kilted alike.
BAG_VERSION = 8


class Event(NamedTuple):
    """One narrated fact: seconds after the shift start, and the narration line."""

    time_s: float
    text: str


class Probe(NamedTuple):
    """A question to ask once the stream has reached ``time_s``, and the key answer words."""

    time_s: float
    question: str
    expected: str
    needs_vision: bool = False  # only the frames show it (the forklift's colour), no narration says it


def clock_text(time_s: float) -> str:
    """The wall clock at ``time_s`` into the shift, e.g. ``"08:00:12"``."""
    total = int(SHIFT_START.hour * 3600 + SHIFT_START.minute * 60 + math.floor(time_s))
    return f"{total // 3600 % 24:02d}:{total // 60 % 60:02d}:{total % 60:02d}"


# --- layout, in fractions of the image width and height --------------------------------------

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (205, 35, 35),
    "green": (40, 175, 70),
    "blue": (40, 85, 220),
    "yellow": (235, 200, 30),
    "purple": (140, 60, 185),
    "white": (240, 240, 240),
    "orange": (250, 130, 20),
}
PALLET_COLOURS = ("blue", "green", "yellow", "purple", "white")

DOCK_X = {1: 0.30, 2: 0.48, 3: 0.66, 4: 0.84}
SHELF_X = {"B1": 0.36, "B2": 0.54, "B3": 0.72, "B4": 0.90}
AISLE_X = {1: 0.35, 2: 0.55, 3: 0.75}

PLACES: dict[str, tuple[float, float]] = {
    "charging station": (0.13, 0.82),
    **{f"dock {n}": (x, 0.31) for n, x in DOCK_X.items()},
    **{f"shelf {name}": (x, 0.86) for name, x in SHELF_X.items()},
    **{f"aisle {n}": (x, 0.58) for n, x in AISLE_X.items()},
}


LANE_Y = 0.68  # the driving lane between the aisles and the shelf row


def _route(start: tuple[float, float], end: tuple[float, float]) -> list[tuple[float, float]]:
    """Waypoints from start to end: trips to or from the shelf row go by the lane."""
    if max(start[1], end[1]) <= LANE_Y:
        return [start, end]
    points = [start, (start[0], LANE_Y), (end[0], LANE_Y), end]
    return [p for i, p in enumerate(points) if i == 0 or math.dist(p, points[i - 1]) > 1e-9]


# --- scenario as keyframed tracks --------------------------------------------------------------

@dataclass(frozen=True)
class _Key:
    t: float
    xy: tuple[float, float] | None  # None: not in the scene
    colour: str
    glide: bool = False  # move in a straight line from the previous key's position


@dataclass
class _Track:
    name: str
    kind: str  # "forklift", "pallet", "cone", "light"
    keys: list[_Key] = field(default_factory=list)

    def add(self, key: _Key) -> None:
        if self.keys and key.t < self.keys[-1].t:
            raise ValueError(f"{self.name}: key at {key.t} s before {self.keys[-1].t} s")
        self.keys.append(key)

    def state(self, t: float) -> tuple[tuple[float, float] | None, str]:
        """Position (or None) and colour at time ``t``."""
        index = -1
        for i, key in enumerate(self.keys):
            if key.t > t:
                break
            index = i
        if index < 0:
            return None, ""
        current = self.keys[index]
        following = self.keys[index + 1] if index + 1 < len(self.keys) else None
        if following is not None and following.glide and current.xy and following.xy:
            share = (t - current.t) / max(following.t - current.t, 1e-9)
            (x0, y0), (x1, y1) = current.xy, following.xy
            return (x0 + (x1 - x0) * share, y0 + (y1 - y0) * share), current.colour
        return current.xy, current.colour


@dataclass
class Scenario:
    """Everything that happens in a shift of ``duration_s`` seconds."""

    duration_s: float
    tracks: dict[str, _Track] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    probes: list[Probe] = field(default_factory=list)

    # Building steps; times past the duration are dropped so a short bag stays consistent.
    def put(self, name: str, kind: str, t: float, place: str | None, colour: str) -> None:
        track = self.tracks.setdefault(name, _Track(name, kind))
        track.add(_Key(t, PLACES[place] if place else None, colour))

    def move(self, name: str, t0: float, t1: float, place: str, cargo: str | None = None) -> None:
        start = self.tracks[name].state(t0)[0]
        route = _route(start, PLACES[place])
        # Time along the route is shared by length, so the speed is constant.
        lengths = [math.dist(a, b) for a, b in zip(route, route[1:])]
        total = sum(lengths) or 1.0
        for moved in (name, cargo) if cargo else (name,):
            track = self.tracks[moved]
            colour = track.state(t0)[1]
            track.add(_Key(t0, route[0], colour))
            elapsed = 0.0
            for point, length in zip(route[1:], lengths):
                elapsed += length
                track.add(_Key(t0 + (t1 - t0) * elapsed / total, point, colour, glide=True))

    def recolour(self, name: str, t: float, colour: str) -> None:
        track = self.tracks[name]
        track.add(_Key(t, track.state(t)[0], colour))

    def say(self, t: float, text: str) -> None:
        if t < self.duration_s:
            self.events.append(Event(float(t), f"[{clock_text(t)}] {text}"))

    def ask(self, t: float, question: str, expected: str, needs_vision: bool = False) -> None:
        if t <= self.duration_s:
            self.probes.append(Probe(float(t), question, expected, needs_vision))

    def place_of(self, name: str, t: float) -> str | None:
        xy = self.tracks[name].state(t)[0]
        return next((p for p, at in PLACES.items() if xy and math.dist(at, xy) < 1e-6), None)


def _script(s: Scenario) -> None:
    """The first 40 s: the facts of the committed demo bag."""
    s.put("F2", "forklift", 0, "charging station", "red")
    s.put("D1", "light", 0, None, "green")
    s.say(0, "Shift started. Forklift F2 is at the charging station. Door D1 light is green.")
    s.move("F2", 1, 5, "dock 3")
    s.say(5, "Forklift F2 parked at dock 3.")
    s.put("A17", "pallet", 9, "dock 2", "blue")
    s.say(9, "Blue pallet A17 arrived at dock 2.")
    s.move("F2", 13, 16, "dock 2")
    s.say(16, "Forklift F2 picked up pallet A17 at dock 2.")
    s.move("F2", 16, 20, "shelf B4", cargo="A17")
    s.say(20, "Pallet A17 moved to shelf B4.")
    s.put("cone", "cone", 26, "aisle 2", "orange")
    s.say(26, "Orange cone placed in aisle 2.")
    s.recolour("D1", 31, "red")
    s.say(31, "Door D1 light turned red.")
    s.move("F2", 34, 38, "charging station")
    s.say(38, "Forklift F2 returned to the charging station.")

    s.ask(8, "Where did forklift F2 park?", "dock 3")
    s.ask(10, "What colour is the light above door D1?", "green")
    s.ask(12, "Which dock did pallet A17 arrive at?", "dock 2")
    s.ask(22, "Where was pallet A17 moved?", "shelf B4")
    s.ask(22, "What colour is pallet A17?", "blue")
    s.ask(29, "What was placed in aisle 2?", "cone")
    s.ask(33, "What colour is the light above door D1?", "red")
    s.ask(40, "At what time did the light of door D1 turn red?", "08:00:31")
    s.ask(40, "Where is forklift F2 now?", "charging station")
    # Told at 9 s: at 40 s more than four caches back in the demo (config/demo.yaml), so the archive's to answer.
    s.ask(40, "Which dock did pallet A17 arrive at?", "dock 2")
    s.ask(40, "What colour is the forklift?", "red", needs_vision=True)


def _cycle(s: Scenario, start: float, index: int, rng: np.random.Generator,
           shelves: dict[str, str | None]) -> None:
    """One seeded work cycle of ``CYCLE_S`` seconds after the script."""
    pallet = f"A{18 + index}"
    colour = str(rng.choice(PALLET_COLOURS))
    # Not the dock where the forklift stands, so the new pallet is not drawn on top of it.
    docks = [n for n in DOCK_X if s.place_of("F2", start) != f"dock {n}"]
    dock = int(rng.choice(docks))
    free = [name for name, held in shelves.items() if held is None]
    if not free:
        # Ship the pallet that has been shelved longest to make room.
        oldest = min((name for name in shelves), key=lambda n: int(shelves[n][1:]))
        s.put(shelves[oldest], "pallet", start + 1, None, "")
        s.say(start + 1, f"Pallet {shelves[oldest]} shipped from shelf {oldest}.")
        shelves[oldest] = None
        free = [oldest]
    shelf = str(rng.choice(sorted(free)))
    shelves[shelf] = pallet

    s.put(pallet, "pallet", start + 2, f"dock {dock}", colour)
    s.say(start + 2, f"{colour.capitalize()} pallet {pallet} arrived at dock {dock}.")
    s.move("F2", start + 4, start + 8, f"dock {dock}")
    s.move("F2", start + 9, start + 13, f"shelf {shelf}", cargo=pallet)
    s.say(start + 13, f"Pallet {pallet} moved to shelf {shelf}.")
    s.ask(start + CYCLE_S, f"Which dock did pallet {pallet} arrive at?", f"dock {dock}")
    s.ask(start + CYCLE_S, f"Where was pallet {pallet} moved?", f"shelf {shelf}")

    if rng.random() < 0.5:
        light = "green" if s.tracks["D1"].state(start)[1] == "red" else "red"
        s.recolour("D1", start + 16, light)
        s.say(start + 16, f"Door D1 light turned {light}.")
        s.ask(start + 18, "What colour is the light above door D1?", light)

    park = int(rng.integers(0, 5))  # 0: charging station
    target = f"dock {park}" if park else "charging station"
    s.move("F2", start + 19, start + 23, target)
    s.say(start + 23, f"Forklift F2 parked at dock {park}." if park
          else "Forklift F2 returned to the charging station.")
    s.ask(start + 25, "Where is forklift F2 now?", target)

    if rng.random() < 0.3:
        aisle = int(rng.choice([n for n in AISLE_X if s.place_of("cone", start) != f"aisle {n}"]))
        s.put("cone", "cone", start + 26, f"aisle {aisle}", "orange")
        s.say(start + 26, f"Orange cone moved to aisle {aisle}.")
        s.ask(start + 28, "In which aisle is the orange cone?", f"aisle {aisle}")


def build_scenario(duration_s: float = SCRIPT_END_S, seed: int = 0) -> Scenario:
    """The scenario of a shift of ``duration_s`` seconds (seed only matters past 40 s)."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    scenario = Scenario(duration_s)
    _script(scenario)
    rng = np.random.default_rng(seed)
    shelves: dict[str, str | None] = {name: None for name in SHELF_X}
    shelves["B4"] = "A17"
    start, index = SCRIPT_END_S, 0
    while start < duration_s:
        _cycle(scenario, start, index, rng, shelves)
        start += CYCLE_S
        index += 1
    scenario.events.sort(key=lambda e: e.time_s)
    scenario.probes.sort(key=lambda p: p.time_s)
    return scenario


def scenario_events(duration_s: float = SCRIPT_END_S, seed: int = 0) -> list[Event]:
    """The narrated events, ``Event(time_s, "[08:00:05] Forklift F2 parked at dock 3.")``."""
    return list(build_scenario(duration_s, seed).events)


def probe_questions(duration_s: float = SCRIPT_END_S, seed: int = 0) -> list[Probe]:
    """Questions about the shift, ``Probe(time_s, question, expected key words)``."""
    return list(build_scenario(duration_s, seed).probes)


# --- drawing ---------------------------------------------------------------------------------

def _px(xy: tuple[float, float], width: int, height: int) -> tuple[int, int]:
    return int(round(xy[0] * width)), int(round(xy[1] * height))


def _label(img: np.ndarray, text: str, org: tuple[int, int], scale: float,
           colour: tuple[int, int, int] = (20, 20, 20), thickness: int = 1) -> None:
    import cv2

    cv2.putText(img, text, org, cv2.FONT_HERSHEY_SIMPLEX, scale, colour, thickness, cv2.LINE_AA)


def _draw_static(img: np.ndarray, scale: float) -> None:
    """Floor, walls, docks, shelves, aisles, charging station and door."""
    import cv2

    h, w = img.shape[:2]
    img[:] = (178, 176, 168)  # concrete
    for n, x in AISLE_X.items():  # painted aisle lines
        cv2.line(img, (int((x - 0.09) * w), int(0.45 * h)), (int((x - 0.09) * w), int(0.72 * h)),
                 (225, 195, 40), max(1, int(2 * scale)))
        _label(img, f"AISLE {n}", (int((x - 0.07) * w), int(0.73 * h)), 0.3 * scale, (90, 80, 40))
    cv2.rectangle(img, (0, 0), (w, int(0.2 * h)), (120, 118, 112), -1)  # back wall
    for n, x in DOCK_X.items():
        cv2.rectangle(img, (int((x - 0.07) * w), int(0.1 * h)), (int((x + 0.07) * w), int(0.2 * h)),
                      (60, 60, 66), -1)
        _label(img, f"DOCK {n}", (int((x - 0.07) * w), int(0.19 * h)), 0.3 * scale, (240, 240, 240))
    for name, x in SHELF_X.items():
        cv2.rectangle(img, (int((x - 0.075) * w), int(0.77 * h)), (int((x + 0.075) * w), h - 1),
                      (130, 90, 50), max(1, int(2 * scale)))
        _label(img, name, (int((x - 0.07) * w), h - 3), 0.3 * scale, (90, 55, 25))
    cx, cy = _px(PLACES["charging station"], w, h)
    cv2.rectangle(img, (cx - int(0.08 * w), cy - int(0.08 * h)),
                  (cx + int(0.08 * w), cy + int(0.1 * h)), (40, 120, 200), max(1, int(2 * scale)))
    _label(img, "CHARGE", (cx - int(0.08 * w), cy + int(0.16 * h)), 0.3 * scale, (30, 90, 160))
    cv2.rectangle(img, (0, int(0.4 * h)), (int(0.05 * w), int(0.62 * h)), (90, 70, 50), -1)  # door
    _label(img, "D1", (int(0.055 * w), int(0.56 * h)), 0.35 * scale)


def _draw_forklift(img: np.ndarray, at: tuple[int, int], colour: tuple[int, int, int],
                   name: str, scale: float) -> None:
    import cv2

    h, w = img.shape[:2]
    x, y = at
    bw, bh = int(0.045 * w), int(0.06 * h)
    cv2.rectangle(img, (x - bw, y - bh), (x + bw, y + bh), colour, -1)
    cv2.rectangle(img, (x - bw, y - bh), (x + bw, y + bh), (40, 20, 20), 1)
    for dx in (-bw, bw):  # wheels
        for dy in (-bh // 2, bh):
            cv2.circle(img, (x + dx, y + dy), max(2, int(3 * scale)), (25, 25, 25), -1)
    # Below the body, so a carried pallet does not hide the name.
    _label(img, name, (x - bw, y + bh + int(11 * scale)), 0.35 * scale, (120, 10, 10))


def _draw_pallet(img: np.ndarray, at: tuple[int, int], colour: tuple[int, int, int],
                 name: str, scale: float) -> None:
    import cv2

    h, w = img.shape[:2]
    x, y = at
    s = int(0.03 * w)
    cv2.rectangle(img, (x - s - 2, y - s + 2), (x + s + 2, y + s + 3), (150, 110, 60), -1)  # wood
    cv2.rectangle(img, (x - s, y - s), (x + s, y + s), colour, -1)
    cv2.rectangle(img, (x - s, y - s), (x + s, y + s), (30, 30, 30), 1)
    _label(img, name, (x - s, y - s - 3), 0.33 * scale)


def _draw_cone(img: np.ndarray, at: tuple[int, int], colour: tuple[int, int, int],
               scale: float) -> None:
    import cv2

    h, w = img.shape[:2]
    x, y = at
    s = int(0.025 * w)
    pts = np.array([[x, y - 2 * s], [x - s, y + s], [x + s, y + s]], dtype=np.int32)
    cv2.fillPoly(img, [pts], colour)
    _label(img, "CONE", (x + s + 2, y + s), 0.3 * scale)


def render_frame(scenario: Scenario, t: float, width: int = 320, height: int = 240,
                 rng: np.random.Generator | None = None, noise: float = 2.0) -> np.ndarray:
    """Draw the scene at ``t`` seconds as an (height, width, 3) RGB uint8 array.

    ``rng`` adds mild sensor noise so that consecutive frames of a still scene differ a little,
    as a real camera's do.
    """
    import cv2

    img = np.empty((height, width, 3), dtype=np.uint8)
    scale = height / 240.0
    _draw_static(img, scale)

    light = scenario.tracks.get("D1")
    if light is not None and light.state(t)[1]:
        cv2.circle(img, (int(0.025 * width), int(0.34 * height)), max(3, int(6 * scale)),
                   COLOURS[light.state(t)[1]], -1)
        cv2.circle(img, (int(0.025 * width), int(0.34 * height)), max(3, int(6 * scale)),
                   (20, 20, 20), 1)

    # Cones and forklifts first, pallets last: a carried pallet is drawn on the forklift.
    order = {"cone": 0, "forklift": 1, "pallet": 2}
    for track in sorted((tr for tr in scenario.tracks.values() if tr.kind in order),
                        key=lambda tr: order[tr.kind]):
        xy, colour = track.state(t)
        if xy is None:
            continue
        at = _px(xy, width, height)
        if track.kind == "forklift":
            _draw_forklift(img, at, COLOURS[colour], track.name, scale)
        elif track.kind == "pallet":
            _draw_pallet(img, at, COLOURS[colour], track.name, scale)
        else:
            _draw_cone(img, at, COLOURS[colour], scale)

    # Status bar with the wall clock, as a camera overlay would show it.
    cv2.rectangle(img, (0, 0), (width, int(0.085 * height)), (20, 20, 24), -1)
    _label(img, f"CAM1  {SHIFT_START:%Y-%m-%d}  {clock_text(t)}",
           (4, int(0.065 * height)), 0.38 * scale, (250, 250, 250))

    if rng is not None and noise > 0:
        jitter = rng.normal(0.0, noise, size=img.shape)
        img = np.clip(img.astype(np.float32) + jitter, 0, 255).astype(np.uint8)
    return img


# --- bag writing -----------------------------------------------------------------------------

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
    ``raw=True`` to ``/camera/image_raw`` (rgb8 Image). Narration goes to ``/narration``.
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

    # Merge frames and narration by time; at equal times the frame goes first.
    frame_count = int(math.ceil(duration_s * fps - 1e-9))
    items = [(round(i / fps * 1e9), 0, i) for i in range(frame_count)]
    items += [(round(e.time_s * 1e9), 1, e) for e in scenario.events]
    items.sort(key=lambda item: (item[0], item[1]))

    counts = {camera_topic: 0, NARRATION_TOPIC: 0}
    with Writer(out, version=BAG_VERSION, storage_plugin=plugins[storage]) as writer:
        cam = writer.add_connection(camera_topic, camera_type, typestore=typestore)
        text = writer.add_connection(NARRATION_TOPIC, "std_msgs/msg/String", typestore=typestore)
        for offset_ns, what, payload in items:
            stamp_ns = START_NS + offset_ns
            if what == 0:
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
    return BagSummary(out, {camera_topic: camera_type, NARRATION_TOPIC: "std_msgs/msg/String"},
                      counts, size_bytes, list(scenario.events), list(scenario.probes))


def write_questions_yaml(path: str | Path, probes: Sequence[Probe]) -> None:
    """Write probes as YAML: a list of {time_s, question, expected[, needs_vision]}."""
    import yaml

    doc = [{"time_s": float(p.time_s), "question": p.question, "expected": p.expected}
           | ({"needs_vision": True} if p.needs_vision else {}) for p in probes]
    header = (
        "# Questions about the bag next to this file. Ask each one once the replay has passed\n"
        "# time_s seconds from the bag start; a correct answer contains the expected words.\n"
        "# needs_vision: only the frames show the answer (no narration says it), so only a model\n"
        "# with trained vision can know it; the embedded models cannot.\n"
    )
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=100)
    Path(path).write_text(header + text, encoding="utf-8")


def _parse_size(text: str) -> tuple[int, int]:
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
    parser.add_argument("--size", type=_parse_size, default=(320, 240), help="WxH")
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
