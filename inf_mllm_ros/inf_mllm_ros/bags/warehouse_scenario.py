"""The warehouse shift of the sample bags, as data: what happens, when, and what to ask about it.

A `Scenario` holds keyframed tracks of the things in the scene (a red forklift, pallets, a cone, the
signal light above a door) in fractions of the image, the narration that states each fact
(`Event`, e.g. ``"[08:00:05] Forklift F2 parked at dock 3."``) and questions about them (`Probe`).
The first 40 s are scripted (the committed demo bag); longer shifts continue with seeded, randomly
drawn work cycles; a patrol robot drives through the places all along and, past the script, reports what it sees
at some of them (bags/warehouse_patrol.py). The places are in bags/warehouse_layout.py, the drawing of the scene
in bags/warehouse_frames.py, the bag writer in bags/sample_bag.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .warehouse_layout import AISLE_X, DOCK_X, PALLET_COLOURS, PLACES, SHELF_X, clock_text, lane_route, to_metres
from .warehouse_patrol import ROBOT, START_PLACE, plan_patrol

SCRIPT_END_S = 40.0
CYCLE_S = 30.0


class Event(NamedTuple):
    """One narrated fact: seconds after the shift start, and the narration line."""

    time_s: float
    text: str


class Probe(NamedTuple):
    """A question to ask once the stream has reached ``time_s``, and the key answer words.

    kind: "descriptive" (what), "temporal" (when: `expected` is a time of day) or "spatial" (where: `expected` is
    a place); about_s: the moment the answer rests on, where one does; place: where the robot was at that moment,
    where the question is about a place it reported from (its position: `place_xy`).
    """

    time_s: float
    question: str
    expected: str
    needs_vision: bool = False  # only the frames show it (the forklift's colour), no narration says it
    kind: str = "descriptive"
    about_s: float | None = None
    place: str | None = None

    @property
    def place_xy(self) -> tuple[float, float] | None:
        """The place's position in the map frame, metres."""
        return None if self.place is None else to_metres(PLACES[self.place])


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
    kind: str  # "forklift", "pallet", "cone", "light", "robot"
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
        route = lane_route(start, PLACES[place])
        # Time along the route is shared by its length on the floor (metres), so the speed is constant.
        lengths = [math.dist(to_metres(a), to_metres(b)) for a, b in zip(route, route[1:])]
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
            self.events.append(Event(float(t), text))

    def ask(self, t: float, question: str, expected: str, needs_vision: bool = False, *, kind: str = "descriptive",
            about_s: float | None = None, place: str | None = None) -> None:
        if t <= self.duration_s:
            self.probes.append(Probe(float(t), question, expected, needs_vision, kind, about_s, place))

    def robot_xy(self, t: float) -> tuple[float, float]:
        """Where the patrol robot is at `t`, in metres of the map frame (`MAP_FRAME`)."""
        return to_metres(self.tracks[ROBOT].state(t)[0])

    def robot_poses(self, rate: float):
        """(t, x, y, yaw, speed) at `rate` Hz over the shift, as odometry gives them in `MAP_FRAME`: the heading
        follows the last move and holds while the robot waits."""
        yaw, last = 0.0, None
        for i in range(int(math.ceil(self.duration_s * rate - 1e-9))):
            t = i / rate
            x, y = self.robot_xy(t)
            speed = 0.0
            if last is not None and math.dist(last, (x, y)) > 1e-6:
                yaw = math.atan2(y - last[1], x - last[0])
                speed = math.dist(last, (x, y)) * rate
            last = (x, y)
            yield t, x, y, yaw, speed

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
    s.ask(40, "At what time did the light of door D1 turn red?", "08:00:31", kind="temporal", about_s=31)
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


def _patrol(s: Scenario, seed: int) -> None:
    """The patrol robot's drives, and from the end of the script on its reports and their questions."""
    plan = plan_patrol(s.duration_s, seed, reports_from=SCRIPT_END_S)
    s.put(ROBOT, "robot", 0.0, START_PLACE, "")
    for drive in plan.drives:
        s.move(ROBOT, drive.start, drive.end, drive.place)
    for report in plan.reports:
        s.say(report.said, report.text)
        if report.asked < report.said + 10.0:
            continue
        facts = {"about_s": report.said, "place": report.place}
        s.ask(report.asked, f"What colour was the {report.thing} that the patrol robot saw?", report.colour, **facts)
        s.ask(report.asked, f"At what time did the patrol robot see the {report.thing}?", clock_text(report.said),
              kind="temporal", **facts)
        s.ask(report.asked, f"Where did the patrol robot see the {report.thing}?", report.place, kind="spatial",
              **facts)


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
    _patrol(scenario, seed)
    scenario.events.sort(key=lambda e: e.time_s)
    scenario.probes.sort(key=lambda p: p.time_s)
    return scenario


def scenario_events(duration_s: float = SCRIPT_END_S, seed: int = 0) -> list[Event]:
    """The narrated events, ``Event(time_s, "[08:00:05] Forklift F2 parked at dock 3.")``."""
    return list(build_scenario(duration_s, seed).events)


def probe_questions(duration_s: float = SCRIPT_END_S, seed: int = 0) -> list[Probe]:
    """Questions about the shift, ``Probe(time_s, question, expected key words)``."""
    return list(build_scenario(duration_s, seed).probes)
