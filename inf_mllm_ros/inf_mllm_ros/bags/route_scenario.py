"""A robot's drive round a warehouse floor, as data: its true route, the things it passes, what it says and what
to ask it afterwards, and the sensors a real robot would record on the way.

`build_route(seed, duration)` draws, from the seed alone:

- a floor of parallel aisles between racks, and a closed loop through them (up one aisle, down the next, back by a
  corridor) with rounded turns, driven at 0.5-1.0 m/s with a stop now and then (`Route`, its true pose at any time);
- 10-16 things at fixed map positions, drawn from `CATALOG` (`Thing`); a movable one (the orange cart always, at
  times another) is moved between the robot's passes, so where it was last seen is not where it was first seen; one
  to three stand off the route, further than the camera reaches, and are never seen, and a few catalog things are
  not on the floor at all (`RouteScenario.absent`);
- a `Sighting` each time the robot passes within `SIGHT_RADIUS_M` of a thing: the time, the robot's true pose in
  `map`, the thing and its position, the place (aisle, cross-aisle, corridor) the robot is in; said on `/narration`
  0-1 s after the closest approach in words that name neither the place nor a number ("Passing a blue barrel."),
  between filler lines that say nothing about things ("Battery at 80 percent.");
- questions in other words than the narration ("Where did you last see the trolley?"), of every kind in `KINDS`,
  each with its expected answer, asked at the end of the drive: about `QUESTIONS_PER_BAG` of them, or with
  `questions="every"` every kind of question about every thing (`QUESTION_SETS`).

The sensors are simulated here too, as numbers: wheel odometry integrated from noisy velocities with a small
heading bias, so that it drifts from the truth (`simulate_odometry`), and a localiser's map->odom corrections at
about 3 Hz that put the robot back on the truth within a few centimetres (`localiser_updates`). bags/route_bag.py
writes all of it as a rosbag2 bag, and the truth beside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .warehouse_layout import clock_text

__all__ = [
    "CATALOG",
    "KINDS",
    "LOCALISER_HZ",
    "LOCALISER_SIGMA_M",
    "ODOM_HZ",
    "QUESTION_NAMES",
    "QUESTION_SETS",
    "SIGHT_RADIUS_M",
    "LocaliserTrack",
    "Narration",
    "OdometryTrack",
    "Placement",
    "Question",
    "Rack",
    "Route",
    "RouteScenario",
    "Sighting",
    "Thing",
    "ThingKind",
    "build_route",
    "compose",
    "invert",
    "localiser_updates",
    "odometry_drift",
    "simulate_odometry",
]

ODOM_HZ = 30.0
LOCALISER_HZ = 3.0
LOCALISER_SIGMA_M = 0.035  # per axis, clipped at 2.5 sigma
SIGHT_RADIUS_M = 3.0  # a thing this near the robot is seen, and said
VIEW_RANGE_M = 8.0  # the camera draws things up to this far
HFOV_RAD = math.radians(70.0)  # the camera's horizontal field of view
OFF_ROUTE_M = 9.5  # things never seen stand at least this far from every point driven
TURN_RADIUS_M = 1.0
RACK_DEPTH_M = 1.2
RACK_HEIGHT_M = 2.4
ARC_SPEED = (0.3, 0.4)  # m/s, in turns
CRUISE_SPEED = (0.5, 1.0)  # m/s, per straight
ACCEL, DECEL = 0.4, 0.6  # m/s^2
STOP_GAP_M = (40.0, 100.0)  # between stops, along the route
STOP_DWELL_S = (3.0, 8.0)
PATH_STEP_M = 0.05

KINDS = ("where_last", "where_first", "when_first", "when_last", "how_long_ago", "never_seen")
# The control of never_seen, asked in the "every" set alone: the same did-you-see questions about a thing seen, whose
# answer is yes; without it a memory that answered "no" to everything would score every never_seen right.
SEEN_CHECK = "seen_check"
QUESTIONS_PER_BAG = 24
# Which questions `build_route` asks: "drawn", about QUESTIONS_PER_BAG of every kind; "every", each thing seen asked
# every kind but never_seen, and never_seen of every catalog thing not seen (those off the route and every one not on
# the floor), for a benchmark that needs many questions of each kind from few drives; then a seen_check of each thing
# seen.
QUESTION_SETS = ("drawn", "every")
# Which names the questions give a thing: "asked", their own (other words than the narration's: "pump truck" for
# the "pallet jack"), or "said", the narration's first (the same questions in the narration's words, which tells a
# miss of the vocabulary from a miss of everything else).
QUESTION_NAMES = ("asked", "said")


# --- what can stand on the floor -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ThingKind:
    """A kind of thing: how the narration names it, how questions name it (other words), how frames draw it."""

    name: str  # the truth's name
    said: tuple[str, ...]  # narration's names (singular phrases unless `said_plural`)
    asked: tuple[str, ...]  # questions' names
    colour: tuple[int, int, int]  # RGB
    shape: str  # box, drum, cones, tyres, ladder, low, tall, sign
    size: tuple[float, float]  # width, height in metres
    poses: tuple[str, ...] = ("on the floor",)
    said_plural: bool = False
    asked_plural: bool = False
    movable: bool = False


def _k(name, said, asked, colour, shape, size, poses=("on the floor",), **flags) -> ThingKind:
    return ThingKind(name, tuple(said), tuple(asked), colour, shape, size, tuple(poses), **flags)


CATALOG: tuple[ThingKind, ...] = (
    _k("orange cart", ["orange cart", "orange push cart"], ["cart", "trolley"], (245, 125, 25), "box", (0.8, 1.0),
       ["parked", "left standing"], movable=True),
    _k("stack of tyres", ["stack of tyres", "pile of tyres", "tyre stack"], ["tyres", "tires", "old tires"],
       (35, 35, 38), "tyres", (0.7, 1.0), ["piled up", "stacked up"], asked_plural=True),
    _k("ladder", ["ladder", "aluminium ladder", "step ladder"], ["ladder", "stepladder"], (200, 200, 210), "ladder",
       (0.5, 2.0), ["leaning on the wall", "leaning on the rack", "standing open"]),
    _k("blue barrel", ["blue barrel", "blue plastic barrel"], ["drum", "blue drum"], (40, 80, 210), "drum",
       (0.6, 0.9), ["standing upright"]),
    _k("pallet jack", ["pallet jack", "hand pallet truck"], ["pallet truck", "pump truck"], (230, 200, 30), "low",
       (0.7, 1.1), ["parked", "left out"], movable=True),
    _k("fire extinguisher", ["fire extinguisher", "red extinguisher"], ["extinguisher"], (210, 30, 30), "tall",
       (0.25, 0.7), ["on its bracket", "standing on the floor"]),
    _k("red toolbox", ["red toolbox", "red tool chest"], ["tool box", "tool kit"], (190, 25, 30), "box",
       (0.6, 0.5), ["on the floor", "left open"]),
    _k("yellow cones", ["yellow cones", "yellow traffic cones"], ["cones", "traffic cones", "pylons"],
       (240, 205, 20), "cones", (1.0, 0.6), ["set out on the floor", "put out in a row"],
       said_plural=True, asked_plural=True),
    _k("wooden crate", ["wooden crate", "wooden packing crate"], ["crate", "wooden box"], (165, 115, 60), "box",
       (0.9, 0.8), ["sitting on the floor"]),
    _k("green bin", ["green wheelie bin", "green bin"], ["rubbish bin", "trash can"], (40, 140, 60), "box",
       (0.6, 1.1), ["with its lid shut"]),
    _k("mop bucket", ["yellow mop bucket", "mop bucket"], ["bucket", "mop and bucket"], (235, 215, 40), "drum",
       (0.45, 0.5), ["with the mop in it"]),
    _k("hose reel", ["coiled hose", "hose reel"], ["hose", "hosepipe"], (40, 160, 70), "tyres", (0.6, 0.5),
       ["rolled up"]),
    _k("hand truck", ["hand truck", "sack truck"], ["dolly", "sack barrow"], (90, 90, 100), "ladder", (0.5, 1.2),
       ["tipped back", "standing up"], movable=True),
    _k("folding chair", ["folding chair", "grey folding chair"], ["chair", "seat"], (130, 130, 135), "low",
       (0.5, 0.9), ["set up", "folded open"]),
    _k("first aid kit", ["first aid kit", "green first aid box"], ["first-aid box", "medical kit"], (30, 150, 70),
       "box", (0.4, 0.3), ["on a crate"]),
    _k("cardboard boxes", ["pile of cardboard boxes", "heap of cardboard boxes"], ["cartons", "boxes"],
       (185, 145, 95), "box", (1.2, 1.0), ["piled up"], asked_plural=True),
    _k("safety barrier", ["striped safety barrier", "safety barrier"], ["barricade", "barrier"], (230, 60, 40),
       "sign", (1.2, 1.0), ["set up across the side"]),
    _k("cable reel", ["cable reel", "reel of cable"], ["spool", "extension reel"], (60, 60, 70), "tyres",
       (0.5, 0.5), ["lying on its side", "standing on the floor"]),
    _k("broom", ["broom", "push broom"], ["brush", "sweeping brush"], (150, 100, 50), "tall", (0.3, 1.3),
       ["leaning on the rack", "propped up"]),
    _k("wet floor sign", ["wet floor sign", "yellow caution sign"], ["warning sign", "caution board"],
       (250, 220, 0), "sign", (0.4, 0.6), ["set out", "standing open"]),
    _k("forklift", ["forklift", "parked forklift"], ["forklift", "fork truck"], (220, 60, 30), "box", (1.2, 2.1),
       ["parked"]),
    _k("scissor lift", ["scissor lift", "folded scissor lift"], ["lifting platform", "work platform"],
       (60, 110, 200), "low", (1.0, 1.6), ["folded down"]),
    _k("bicycle", ["bicycle", "black bicycle"], ["bike", "push bike"], (30, 30, 30), "ladder", (1.2, 0.9),
       ["propped up", "leaning on the rack"]),
    _k("drone", ["small drone", "little drone"], ["quadcopter", "UAV"], (50, 50, 55), "low", (0.4, 0.2),
       ["on the floor"]),
)
CATALOG_BY_NAME = {k.name: k for k in CATALOG}


# --- the route ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rack:
    """A rack's footprint on the floor (metres in `map`): the camera draws it and it hides what is behind it."""

    x0: float
    y0: float
    x1: float
    y1: float


@dataclass(frozen=True)
class Stop:
    """The robot stands still at `s` metres along the route from `arrive_s` to `leave_s` (seconds)."""

    s: float
    arrive_s: float
    leave_s: float


@dataclass
class Route:
    """A closed loop of waypoints with rounded turns, driven lap after lap; its true pose at any time.

    `s, x, y, yaw` sample the path every few centimetres over as many laps as the drive can reach; `knot_t` and
    `knot_s` say where along it the robot is at a time (stops are flat stretches), so that `pose_at` is exact up to
    the sampling of the path.
    """

    waypoints: tuple[tuple[float, float], ...]  # one lap, from the start; it closes back on the first
    places: tuple[str, ...]  # the place each waypoint's outgoing leg is in
    lap_length: float
    s: np.ndarray
    x: np.ndarray
    y: np.ndarray
    yaw: np.ndarray
    arc: np.ndarray  # True where the path turns
    leg: np.ndarray  # index into `places`
    arrive_t: np.ndarray  # when the robot first reaches each sample
    knot_t: np.ndarray
    knot_s: np.ndarray
    stops: tuple[Stop, ...]

    def s_at(self, t) -> np.ndarray:
        """Metres driven at times `t` (seconds from the start)."""
        return np.interp(t, self.knot_t, self.knot_s)

    def t_at(self, s) -> np.ndarray:
        """When the robot first reaches `s` metres along."""
        return np.interp(s, self.s, self.arrive_t)

    def point_at_s(self, s) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x, y, yaw of the path `s` metres along."""
        return np.interp(s, self.s, self.x), np.interp(s, self.s, self.y), np.interp(s, self.s, self.yaw)

    def pose_at(self, t) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The robot's true x, y, yaw in `map` at times `t`."""
        return self.point_at_s(self.s_at(t))

    def place_at(self, t: float) -> str:
        """The place (aisle, cross-aisle, corridor...) the robot is in at time `t`."""
        index = min(int(np.searchsorted(self.s, float(self.s_at(t)))), len(self.s) - 1)
        return self.places[int(self.leg[index])]


def _wrap(angle: float) -> float:
    return (angle + math.pi) % (2 * math.pi) - math.pi


def _floor_plan(rng: np.random.Generator):
    """Aisles between racks and a loop through them: waypoints of one lap, each leg's place, racks, floor size."""
    n = int(rng.integers(5, 7))
    spacing = float(rng.uniform(5.6, 6.6))
    x0 = float(rng.uniform(5.0, 7.0))
    y_lo = float(rng.uniform(6.5, 7.5))
    y_hi = y_lo + float(rng.uniform(17.0, 21.0))
    y_corridor = y_lo - 4.0
    xs = [x0 + spacing * k for k in range(n)]
    corner = [(xs[0], y_corridor)]
    places = ["aisle 1"]  # the leg out of each point
    for k, x in enumerate(xs):
        up = k % 2 == 0
        corner.append((x, y_hi if up else y_lo))
        if k + 1 < n:
            places.append("north cross-aisle" if up else "south cross-aisle")
            corner.append((xs[k + 1], y_hi if up else y_lo))
            places.append(f"aisle {k + 2}")
    if n % 2:  # ends at the top: across and down an east lane
        x_east = xs[-1] + 0.55 * spacing
        corner += [(x_east, y_hi), (x_east, y_corridor)]
        places += ["north cross-aisle", "east lane", "south corridor"]
    else:  # ends at the bottom: straight on down to the corridor
        corner[-1] = (xs[-1], y_corridor)
        places.append("south corridor")
    # corner: [start corner, ..., last corner]; the last leg runs west along the corridor back to the first.
    x_max = max(p[0] for p in corner)
    middle = ((x_max + xs[0]) / 2, y_corridor)
    waypoints = [middle] + corner
    places = ["south corridor"] + places
    racks = []
    for k in range(n + 1):  # between aisles, and beyond the first and last
        cx = x0 + spacing * (k - 0.5)
        racks.append(Rack(cx - RACK_DEPTH_M / 2, y_lo + 1.8, cx + RACK_DEPTH_M / 2, y_hi - 1.8))
    floor = (x_max + 14.0, y_hi + 3.0)
    return waypoints, places, racks, floor


def _fillet_path(points: np.ndarray, radius: float, step: float):
    """Sample a polyline every `step` metres with each corner rounded to `radius`: x, y, yaw, arc flag, segment."""
    d = np.diff(points, axis=0)
    lengths = np.hypot(d[:, 0], d[:, 1])
    u = d / lengths[:, None]
    heading = np.arctan2(u[:, 1], u[:, 0])
    n_seg = len(d)
    cut, turn = np.zeros(n_seg + 1), np.zeros(n_seg + 1)
    for i in range(1, n_seg):
        turn[i] = _wrap(heading[i] - heading[i - 1])
        cut[i] = radius * math.tan(abs(turn[i]) / 2) if abs(turn[i]) > 1e-6 else 0.0
    parts = []
    for i in range(n_seg):
        a, b = points[i] + u[i] * cut[i], points[i + 1] - u[i] * cut[i + 1]
        m = max(2, int(math.ceil(math.dist(a, b) / step)) + 1)
        f = np.linspace(0.0, 1.0, m)[:, None]
        xy = a + (b - a) * f
        parts.append((xy, np.full(m, heading[i]), np.zeros(m, bool), np.full(m, i)))
        if i + 1 < n_seg and cut[i + 1] > 0:
            sign, h1 = math.copysign(1.0, turn[i + 1]), heading[i]
            centre = b + sign * radius * np.array([-math.sin(h1), math.cos(h1)])
            m = max(3, int(math.ceil(radius * abs(turn[i + 1]) / step)) + 1)
            h = h1 + np.linspace(0.0, turn[i + 1], m)
            xy = centre + sign * radius * np.stack([np.sin(h), -np.cos(h)], axis=1)
            parts.append((xy[1:], h[1:], np.ones(m - 1, bool), np.full(m - 1, i + 1)))
    xy = np.concatenate([p[0] for p in parts])
    yaw = np.concatenate([p[1] for p in parts])
    arc = np.concatenate([p[2] for p in parts])
    seg = np.concatenate([p[3] for p in parts])
    keep = np.ones(len(xy), bool)
    keep[1:] = np.hypot(*np.diff(xy, axis=0).T) > 1e-9  # the joins repeat a point
    return xy[keep, 0], xy[keep, 1], np.unwrap(yaw[keep]), arc[keep], seg[keep]


def _speed_profile(s: np.ndarray, arc: np.ndarray, seg: np.ndarray, stop_idx: list[int],
                   rng: np.random.Generator) -> np.ndarray:
    """The fastest speed at each path sample: a cruise speed per straight, slower in turns, nought at stops, with
    the robot's acceleration and braking limits."""
    cruise = rng.uniform(*CRUISE_SPEED, size=int(seg.max()) + 1)
    in_turn = rng.uniform(*ARC_SPEED, size=int(seg.max()) + 1)
    v = np.where(arc, in_turn[seg], cruise[seg])
    v[0] = 0.0
    v[stop_idx] = 0.0
    ds = np.diff(s)
    for i in range(len(v) - 2, -1, -1):  # braking before turns and stops
        v[i] = min(v[i], math.sqrt(v[i + 1] ** 2 + 2 * DECEL * ds[i]))
    for i in range(len(v) - 1):  # speeding up after them
        v[i + 1] = min(v[i + 1], math.sqrt(v[i] ** 2 + 2 * ACCEL * ds[i]))
    return v


def _draw_stops(s: np.ndarray, arc: np.ndarray, rng: np.random.Generator) -> list[int]:
    """Path samples where the robot stops now and then, on straights only."""
    arc_s = s[arc]
    out, at = [], float(rng.uniform(*STOP_GAP_M)) / 2
    while at < s[-1] - 5.0:
        if not len(arc_s) or np.min(np.abs(arc_s - at)) > 2.5:
            out.append(int(np.searchsorted(s, at)))
        at += float(rng.uniform(*STOP_GAP_M))
    return out


def _build_route(waypoints, places, duration: float, rng: np.random.Generator) -> Route:
    """Drive the loop for `duration` seconds: as many laps of path as the robot can reach, timed by its speeds."""
    lap = np.asarray(waypoints + [waypoints[0]], dtype=float)
    lap_length = float(np.sum(np.hypot(*np.diff(lap, axis=0).T)))
    laps = int(math.ceil(duration * CRUISE_SPEED[1] / lap_length)) + 1
    points = np.concatenate([np.asarray(waypoints, float)] * laps + [lap[:1]])
    x, y, yaw, arc, seg = _fillet_path(points, TURN_RADIUS_M, PATH_STEP_M)
    s = np.concatenate([[0.0], np.cumsum(np.hypot(np.diff(x), np.diff(y)))])
    stop_idx = _draw_stops(s, arc, rng)
    v = _speed_profile(s, arc, seg, stop_idx, rng)
    dt = 2 * np.diff(s) / np.maximum(v[:-1] + v[1:], 1e-3)
    dwell = np.zeros(len(s))
    dwell[stop_idx] = rng.uniform(*STOP_DWELL_S, size=len(stop_idx))
    arrive = np.concatenate([[0.0], np.cumsum(dt)]) + np.concatenate([[0.0], np.cumsum(dwell)[:-1]])
    knot_t, knot_s, stops = [], [], []
    for i in range(len(s)):
        knot_t.append(arrive[i])
        knot_s.append(s[i])
        if dwell[i] > 0:
            knot_t.append(arrive[i] + dwell[i])
            knot_s.append(s[i])
            stops.append(Stop(float(s[i]), float(arrive[i]), float(arrive[i] + dwell[i])))
    return Route(tuple(map(tuple, waypoints)), tuple(places), lap_length, s, x, y, yaw, arc,
                 seg % len(waypoints), arrive, np.asarray(knot_t), np.asarray(knot_s), tuple(stops))


# --- things and sightings --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """Where a thing stands from `from_s` until `until_s` (seconds from the start), metres in `map`."""

    from_s: float
    until_s: float
    x: float
    y: float


@dataclass(frozen=True)
class Thing:
    """A thing on the floor: fixed, or moved between places at given times."""

    kind: ThingKind
    placements: tuple[Placement, ...]

    @property
    def name(self) -> str:
        return self.kind.name

    def position_at(self, t: float) -> tuple[float, float]:
        """Where it stands at `t`."""
        for p in self.placements:
            if p.from_s <= t < p.until_s:
                return p.x, p.y
        return self.placements[-1].x, self.placements[-1].y


@dataclass(frozen=True)
class Sighting:
    """The robot passes within sight of a thing: what it says, when, and where it truly is then."""

    thing: str
    time_s: float  # when it is said, 0-1 s after the closest approach
    closest_s: float
    distance_m: float  # at the closest approach
    pose: tuple[float, float, float]  # the robot's true x, y, yaw in `map` at `time_s`
    thing_xy: tuple[float, float]
    place: str  # the place the robot is in then: no narration names it
    side: str  # left or right of the robot
    nth: int  # 1 for the first sighting of the thing
    text: str = ""
    mentions: tuple[str, ...] = ()  # other things the text names, seen at the same pass


@dataclass(frozen=True)
class Narration:
    """A line on /narration: a sighting's (its index) or filler (None)."""

    time_s: float
    text: str
    sighting: int | None = None


@dataclass(frozen=True)
class Question:
    """A question asked at `asked_s`, of a kind in `KINDS`, with its expected answer."""

    question: str
    kind: str
    thing: str
    asked_s: float
    expected: dict


@dataclass
class RouteScenario:
    """Everything `build_route` draws for a seed: the route, the things, what was seen and said, the questions."""

    seed: int
    duration: float
    route: Route
    racks: tuple[Rack, ...]
    floor: tuple[float, float]  # width, height in metres
    things: tuple[Thing, ...]
    absent: tuple[str, ...]  # catalog things asked about that are not on the floor
    sightings: tuple[Sighting, ...] = ()
    narration: tuple[Narration, ...] = ()
    questions: tuple[Question, ...] = ()
    battery_start: int = 90

    def pose_at(self, t):
        """The robot's true pose in `map` at `t`."""
        return self.route.pose_at(t)

    def thing(self, name: str) -> Thing:
        return next(th for th in self.things if th.name == name)

    def sightings_of(self, name: str) -> list[Sighting]:
        return [s for s in self.sightings if s.thing == name]

    @property
    def never_seen(self) -> tuple[str, ...]:
        """Things asked about that the robot never saw: those off the route and those not on the floor."""
        seen = {s.thing for s in self.sightings}
        return tuple(th.name for th in self.things if th.name not in seen) + self.absent


def _min_distance(px: float, py: float, xs: np.ndarray, ys: np.ndarray) -> float:
    return float(np.min(np.hypot(xs - px, ys - py))) if len(xs) else math.inf


def _in_rack(px: float, py: float, racks, margin: float = 0.3) -> bool:
    return any(r.x0 - margin <= px <= r.x1 + margin and r.y0 - margin <= py <= r.y1 + margin for r in racks)


def _beside_route(route: Route, s: float, rng: np.random.Generator) -> tuple[float, float]:
    """A point beside the path `s` metres along: left or right of it, 0.9-1.8 m off its centre line."""
    x, y, yaw = (float(v) for v in route.point_at_s(s))
    side = 1.0 if rng.random() < 0.5 else -1.0
    off = float(rng.uniform(0.9, 1.8))
    return x - side * off * math.sin(yaw), y + side * off * math.cos(yaw)


def _fits(xy, taken, route_xy, racks) -> bool:
    """A thing may stand at `xy`: clear of the path's centre line, of racks and of other things."""
    return (_min_distance(*xy, *route_xy) >= 0.8 and not _in_rack(*xy, racks)
            and all(math.dist(xy, other) >= 2.5 for other in taken))


def _place_moved(kind: ThingKind, route: Route, s_range, taken, route_xy, racks, rng) -> Thing | None:
    """A movable thing at two or three places along the route, each over 6 m from the others, moved while the
    robot is away from both the old and the new place."""
    lo, hi = s_range
    for count in ((3, 2) if hi - lo > 110 and rng.random() < 0.5 else (2,)):
        for _ in range(200):
            ss = np.sort(rng.uniform(lo, hi, size=count))
            if np.any(np.diff(ss) < 20.0):
                continue
            spots = [_beside_route(route, float(v), rng) for v in ss]
            base = [tuple(float(c) for c in route.point_at_s(v)[:2]) for v in ss]
            if any(math.dist(a, b) < 6.0 for i, a in enumerate(base) for b in base[i + 1:]):
                continue
            if not all(_fits(p, taken, route_xy, racks) for p in spots):
                continue
            if any(math.dist(a, b) < 2.5 for i, a in enumerate(spots) for b in spots[i + 1:]):
                continue
            moves = [_move_time(route, float(ss[i]), float(ss[i + 1]), spots[i], spots[i + 1], rng)
                     for i in range(count - 1)]
            bounds = [0.0] + moves + [math.inf]
            return Thing(kind, tuple(Placement(bounds[i], bounds[i + 1], *spots[i]) for i in range(count)))
    return None


def _move_time(route: Route, s_old: float, s_new: float, old, new, rng) -> float:
    """A time between the robot's pass of the old place and of the new one when it is far from both."""
    t0, t1 = float(route.t_at(s_old)) + 5.0, float(route.t_at(s_new)) - 5.0
    ts = np.linspace(t0, t1, 200)
    x, y, _ = route.pose_at(ts)
    far = (np.hypot(x - old[0], y - old[1]) > VIEW_RANGE_M) & (np.hypot(x - new[0], y - new[1]) > VIEW_RANGE_M)
    choices = ts[far] if far.any() else ts[len(ts) // 2:len(ts) // 2 + 1]
    return float(choices[int(rng.integers(len(choices)))])


def _off_route_spot(floor, route_xy, racks, taken, rng) -> tuple[float, float] | None:
    """A spot on the floor further than the camera reaches from everywhere the robot drives."""
    gx, gy = np.meshgrid(np.arange(1.0, floor[0], 1.0), np.arange(1.0, floor[1], 1.0))
    candidates = [(float(x), float(y)) for x, y in zip(gx.ravel(), gy.ravel())
                  if not _in_rack(x, y, racks) and all(math.dist((x, y), o) >= 2.5 for o in taken)]
    rng.shuffle(candidates)
    for xy in candidates:
        if _min_distance(*xy, *route_xy) >= OFF_ROUTE_M:
            return xy
    return None


def _place_things(route: Route, racks, floor, duration: float, rng: np.random.Generator):
    """10-16 things from the catalog on the floor (the orange cart always, moved), the rest stay absent."""
    driven = float(route.s_at(max(duration - 6.0, 1.0)))
    s_lo, s_hi = 6.0, max(min(driven, route.lap_length) - 4.0, 12.0)
    step = max(1, int(round(0.5 / PATH_STEP_M)))
    reach = route.s <= driven + 2.0
    route_xy = (route.x[reach][::step], route.y[reach][::step])
    loop_xy = (route.x[route.s <= route.lap_length][::step], route.y[route.s <= route.lap_length][::step])
    total = int(rng.integers(10, 17))
    cart = CATALOG_BY_NAME["orange cart"]
    others = [k for k in CATALOG if k is not cart]
    order = [others[i] for i in rng.permutation(len(others))]
    drawn, spare = [cart] + order[:total - 1], order[total - 1:]
    fixed = [k.name for k in drawn if not k.movable]
    off_route = {fixed[i] for i in rng.choice(len(fixed), size=int(rng.integers(1, 4)), replace=False)}
    things, taken = [], []
    for kind in drawn:
        thing = None
        if kind.name in off_route:
            xy = _off_route_spot(floor, route_xy, racks, taken, rng)
            thing = Thing(kind, (Placement(0.0, math.inf, *xy),)) if xy else None
        elif kind.movable and (kind is cart or rng.random() < 0.5):
            thing = _place_moved(kind, route, (s_lo, max(driven - 6.0, s_lo + 1.0)), taken, loop_xy, racks, rng)
        if thing is None and kind.name not in off_route:
            for _ in range(100):
                xy = _beside_route(route, float(rng.uniform(s_lo, s_hi)), rng)
                if _fits(xy, taken, loop_xy, racks):
                    thing = Thing(kind, (Placement(0.0, math.inf, *xy),))
                    break
        if thing is not None:
            things.append(thing)
            taken += [(p.x, p.y) for p in thing.placements]
        else:
            spare.append(kind)
    absent = tuple(k.name for k in spare[:int(rng.integers(1, 3))])
    return tuple(things), absent


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """Index ranges [a, b) where `mask` holds."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def _find_sightings(route: Route, things, duration: float, rng: np.random.Generator) -> list[Sighting]:
    """Each pass of the robot within `SIGHT_RADIUS_M` of a thing, closed before the drive ends."""
    t = np.arange(0.0, duration, 1.0 / ODOM_HZ)
    x, y, yaw = route.pose_at(t)
    found = []
    for thing in things:
        for p in thing.placements:
            d = np.hypot(x - p.x, y - p.y)
            runs = _runs((t >= p.from_s) & (t < p.until_s) & (d < SIGHT_RADIUS_M))
            merged = []
            for a, b in runs:  # a pass that dips out of range for a moment is one pass
                if merged and t[a] - t[merged[-1][1] - 1] < 5.0:
                    merged[-1] = (merged[-1][0], b)
                else:
                    merged.append((a, b))
            for a, b in merged:
                k = a + int(np.argmin(d[a:b]))
                if b >= len(t) or t[k] + 1.5 > duration or (t[a] <= p.from_s + 1e-9 and p.from_s > 0):
                    continue
                heading = (math.cos(yaw[k]), math.sin(yaw[k]))
                left = heading[0] * (p.y - y[k]) - heading[1] * (p.x - x[k]) > 0
                found.append((float(t[k]), float(d[k]), thing.name, (p.x, p.y), "left" if left else "right"))
    found.sort()
    out, count = [], {}
    for closest, dist, name, xy, side in found:
        said = closest + float(rng.uniform(0.0, 1.0))
        count[name] = count.get(name, 0) + 1
        px, py, pyaw = (float(v) for v in route.pose_at(said))
        pose = (round(px, 4), round(py, 4), round(_wrap(pyaw), 4))
        out.append(Sighting(name, round(said, 3), round(closest, 3), round(dist, 3), pose,
                            (round(xy[0], 3), round(xy[1], 3)), route.place_at(said), side, count[name]))
    return out


# --- what the robot says ---------------------------------------------------------------------------------------

FIRST_TEMPLATES = (
    "I see {a}{near}.",
    "There {is} {a} {pose} here.",
    "Passing {a}{near}.",
    "{A} on my {side}.",
    "Spotted {a}{near}.",
    "Just went past {a}.",
    "Looks like {a} {pose}.",
    "{A} here{near}.",
    "Coming past {a} on the {side}.",
    "Noticed {a} {pose}.",
)
AGAIN_TEMPLATES = (
    "The {name} again{near}.",
    "Passing the {name} again.",
    "I see the {name} once more, on my {side}.",
    "There's that {name} again.",
)
NEAR_TEMPLATES = (" next to {a}", " beside {a}", ", with {a} close by", " by {a}")
FILLER = (
    "Aisle is clear.", "No obstacles ahead.", "Path is clear.", "Floor looks dry.", "Lights are on.",
    "All systems normal.", "Lidar is working normally.", "Wi-Fi signal is good.", "Running the patrol route.",
    "Nothing unusual.", "Motors are cool.", "Camera is clean.", "Wheels are fine.", "Keeping to the route.",
)


def _article(phrase: str, plural: bool) -> str:
    if plural:
        return f"some {phrase}"
    return f"{'an' if phrase[0] in 'aeiou' else 'a'} {phrase}"


def _said_name(kind: ThingKind, rng) -> tuple[str, str]:
    """A narration name of the thing, bare and with its article."""
    name = str(rng.choice(kind.said))
    return name, _article(name, kind.said_plural)


def _narrate(sighting: Sighting, near: list[str], rng) -> tuple[str, tuple[str, ...]]:
    """A sighting's line: no place, no number, in one of several wordings; at times the thing seen beside it."""
    kind = CATALOG_BY_NAME[sighting.thing]
    name, a_name = _said_name(kind, rng)
    mentions: tuple[str, ...] = ()
    near_text = ""
    if near and rng.random() < 0.6:
        other = str(rng.choice(near))
        near_text = str(rng.choice(NEAR_TEMPLATES)).format(a=_said_name(CATALOG_BY_NAME[other], rng)[1])
        mentions = (other,)
    templates = AGAIN_TEMPLATES if sighting.nth > 1 and rng.random() < 0.5 else FIRST_TEMPLATES
    template = str(rng.choice(templates))
    if "{near}" not in template:
        mentions = ()
    text = template.format(a=a_name, A=a_name[0].upper() + a_name[1:], name=name, near=near_text,
                           pose=str(rng.choice(kind.poses)), side=sighting.side,
                           **{"is": "are" if kind.said_plural else "is"})
    return text[0].upper() + text[1:], mentions


def _filler(scenario: RouteScenario, taken: list[float], rng) -> list[Narration]:
    """Lines that say nothing about things, every 5-15 s, at turns and stops, none within 1.5 s of a sighting's."""
    route, out = scenario.route, []

    def free(t: float) -> bool:
        return 0.0 <= t < scenario.duration - 0.5 and all(abs(t - o) > 1.5 for o in taken)

    for stop in route.stops:
        for t, text in ((stop.arrive_s + 0.3, "Stopping for a moment."), (stop.leave_s - 0.2, "Moving again.")):
            if free(t):
                out.append(Narration(round(t, 3), text))
                taken.append(t)
    starts = route.s[1:][route.arc[1:] & ~route.arc[:-1]]
    for s in starts:
        t = float(route.t_at(s - 1.0))
        if rng.random() < 0.35 and free(t):
            out.append(Narration(round(t, 3), "Slowing down for a turn."))
            taken.append(t)
    t = float(rng.uniform(2.0, 6.0))
    while t < scenario.duration - 0.5:
        if free(t):
            if rng.random() < 0.25:
                text = f"Battery at {scenario.battery_start - int(t // 45)} percent."
            else:
                text = str(rng.choice(FILLER))
            out.append(Narration(round(t, 3), text))
            taken.append(t)
        t += float(rng.uniform(5.0, 15.0))
    return out


def _narration(scenario: RouteScenario, rng) -> tuple[list[Sighting], list[Narration]]:
    """Every sighting's line, then the filler between them, in time order."""
    sightings, lines = [], []
    for i, s in enumerate(scenario.sightings):
        near = [o.thing for o in scenario.sightings
                if o.thing != s.thing and abs(o.closest_s - s.closest_s) < 3.0
                and math.dist(o.thing_xy, s.thing_xy) < 4.0]
        text, mentions = _narrate(s, sorted(set(near)), rng)
        sightings.append(replace(s, text=text, mentions=mentions))
        lines.append(Narration(s.time_s, text, i))
    lines += _filler(scenario, [s.time_s for s in sightings], rng)
    lines.sort(key=lambda n: (n.time_s, n.sighting is None))
    return sightings, lines


# --- questions ---------------------------------------------------------------------------------------------------

QUESTION_TEMPLATES = {
    "where_last": ("Where did you last see the {q}?", "Where {was} the {q} the last time you saw {it}?",
                   "Where {was} the {q} most recently?", "What is the last place you spotted the {q}?"),
    "where_first": ("Where did you first see the {q}?", "Where {was} the {q} when you first came across {it}?",
                    "At which spot did you first notice the {q}?"),
    "when_first": ("When did you first pass the {q}?", "At what time did you first come across the {q}?",
                   "When did the {q} first come into view?"),
    "when_last": ("When did you last see the {q}?", "What time did you most recently pass the {q}?",
                  "When was the last time you saw the {q}?"),
    "how_long_ago": ("How long ago did you see the {q}?", "How many seconds ago did you last pass the {q}?",
                     "How long has it been since you saw the {q}?"),
    "never_seen": ("Did you see {aq}?", "Have you come across {aq} on this drive?",
                   "Was there {aq} anywhere on your route?"),
}
QUESTION_TEMPLATES[SEEN_CHECK] = QUESTION_TEMPLATES["never_seen"]  # the same questions, of a thing seen


def _expected(scenario: RouteScenario, name: str, kind: str) -> dict:
    """The answer a question of `kind` about `name` expects, from the sightings."""
    seen = scenario.sightings_of(name)
    if kind in ("never_seen", SEEN_CHECK):
        return {"seen": kind == SEEN_CHECK}
    s = seen[-1] if kind in ("where_last", "when_last", "how_long_ago") else seen[0]
    out = {"time_s": s.time_s, "clock": clock_text(s.time_s)}
    if kind.startswith("where"):
        out |= {"x": s.pose[0], "y": s.pose[1], "yaw": s.pose[2], "place": s.place, "thing_xy": list(s.thing_xy)}
    if kind == "how_long_ago":
        out["seconds"] = round(scenario.duration - s.time_s, 3)
    return out


def _ask(scenario: RouteScenario, name: str, kind: str, rng, names: str = "asked") -> Question:
    thing = CATALOG_BY_NAME[name]
    q = str(rng.choice(thing.asked))  # drawn with either names, so that the rest of the draws stay as they are
    plural = thing.asked_plural
    if names == "said":
        q, plural = thing.said[0], thing.said_plural
    text = str(rng.choice(QUESTION_TEMPLATES[kind])).format(
        q=q, aq=_article(q, plural).replace("some ", "any ", 1), was="were" if plural else "was",
        it="them" if plural else "it")
    return Question(text, kind, name, scenario.duration, _expected(scenario, name, kind))


def _questions(scenario: RouteScenario, rng, names: str) -> list[Question]:
    """About `QUESTIONS_PER_BAG` questions: where-first and where-last for things seen more than once (the moved
    ones first), a did-you-see for each thing never seen, then the other kinds in turn, so that each is asked."""
    seen = list(dict.fromkeys(s.thing for s in scenario.sightings))
    multi = sorted((n for n in seen if len(scenario.sightings_of(n)) > 1),
                   key=lambda n: (not CATALOG_BY_NAME[n].movable, seen.index(n)))
    chosen = [(n, k) for n in multi[:4] for k in ("where_last", "where_first")]
    chosen += [(n, "never_seen") for n in scenario.never_seen]
    pool = [(n, k) for n in seen for k in KINDS[:-1] if (n, k) not in chosen]
    pool = [pool[i] for i in rng.permutation(len(pool))]
    turn = ("when_first", "when_last", "how_long_ago", "where_last", "where_first")
    while len(chosen) < QUESTIONS_PER_BAG and pool:
        for kind in turn:
            pick = next((p for p in pool if p[1] == kind), None)
            if pick is not None and len(chosen) < QUESTIONS_PER_BAG:
                pool.remove(pick)
                chosen.append(pick)
    chosen = [chosen[i] for i in rng.permutation(len(chosen))]
    return [_ask(scenario, n, k, rng, names) for n, k in chosen]


def _every_question(scenario: RouteScenario, rng, names: str) -> list[Question]:
    """Every thing seen asked every kind but never_seen, and a did-you-see for every thing never seen, in a drawn
    order; then a did-you-see for every thing seen (SEEN_CHECK), in a drawn order (drawn after the others, which are
    then what they were before the control was asked)."""
    seen = list(dict.fromkeys(s.thing for s in scenario.sightings))
    chosen = [(n, k) for n in seen for k in KINDS[:-1]] + [(n, "never_seen") for n in scenario.never_seen]
    chosen = [chosen[i] for i in rng.permutation(len(chosen))]
    asked = [_ask(scenario, n, k, rng, names) for n, k in chosen]
    return asked + [_ask(scenario, seen[i], SEEN_CHECK, rng, names) for i in rng.permutation(len(seen))]


# --- the scenario ------------------------------------------------------------------------------------------------

def build_route(seed: int, duration: float = 300.0, questions: str = "drawn", names: str = "asked") -> RouteScenario:
    """The whole drive for `seed`: route, things, sightings, narration and questions.

    The same seed and duration give the same drive; the floor and route depend on the seed alone, the things are
    placed along the part of the route that `duration` reaches. `questions` (one of `QUESTION_SETS`) changes the
    questions alone: with "every", `absent` holds every catalog thing not on the floor, so that each is asked
    about; the drive, what is seen and said, is the same. `names` (one of `QUESTION_NAMES`) changes the questions'
    names of things alone.
    """
    if duration < 30.0:
        raise ValueError(f"duration must be at least 30 s, got {duration}")
    if questions not in QUESTION_SETS:
        raise ValueError(f"questions must be one of {QUESTION_SETS}, got {questions!r}")
    if names not in QUESTION_NAMES:
        raise ValueError(f"names must be one of {QUESTION_NAMES}, got {names!r}")
    waypoints, places, racks, floor = _floor_plan(np.random.default_rng([seed, 1]))
    route = _build_route(waypoints, places, duration, np.random.default_rng([seed, 2]))
    things, absent = _place_things(route, racks, floor, duration, np.random.default_rng([seed, 3]))
    rng = np.random.default_rng([seed, 4])
    scenario = RouteScenario(seed, float(duration), route, tuple(racks), floor, things, absent,
                             battery_start=int(rng.integers(70, 96)))
    scenario.sightings = tuple(_find_sightings(route, things, duration, rng))
    sightings, lines = _narration(scenario, np.random.default_rng([seed, 5]))
    scenario.sightings, scenario.narration = tuple(sightings), tuple(lines)
    if questions == "every":
        floor = {th.name for th in things}
        scenario.absent = absent + tuple(k.name for k in CATALOG if k.name not in floor and k.name not in absent)
        scenario.questions = tuple(_every_question(scenario, np.random.default_rng([seed, 6]), names))
    else:
        scenario.questions = tuple(_questions(scenario, np.random.default_rng([seed, 6]), names))
    return scenario


# --- sensors -----------------------------------------------------------------------------------------------------

def compose(a, b) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """a ∘ b of planar poses (x, y, yaw), elementwise over arrays."""
    ax, ay, ath = a
    bx, by, bth = b
    c, s = np.cos(ath), np.sin(ath)
    return ax + c * bx - s * by, ay + s * bx + c * by, ath + bth


def invert(a) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The inverse of planar poses (x, y, yaw)."""
    x, y, th = a
    c, s = np.cos(th), np.sin(th)
    return -c * x - s * y, s * x - c * y, -th


@dataclass(frozen=True)
class OdometryTrack:
    """Wheel odometry at `ODOM_HZ`: the robot's pose in `odom` (starting at the origin) and its measured speeds."""

    t: np.ndarray
    x: np.ndarray
    y: np.ndarray
    yaw: np.ndarray
    v: np.ndarray
    w: np.ndarray

    def pose_at(self, t) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """odom -> base_link at times `t`, between the samples linearly."""
        return np.interp(t, self.t, self.x), np.interp(t, self.t, self.y), np.interp(t, self.t, self.yaw)


@dataclass(frozen=True)
class LocaliserTrack:
    """A localiser's map -> odom corrections: stamped at `stamp_s`, published at `publish_s` (a little later)."""

    stamp_s: np.ndarray
    publish_s: np.ndarray
    x: np.ndarray
    y: np.ndarray
    yaw: np.ndarray


def simulate_odometry(scenario: RouteScenario, hz: float = ODOM_HZ) -> OdometryTrack:
    """Integrate noisy wheel measurements of the true motion: a scale error on distance, a heading bias per metre
    (unequal wheels) and a scale error on turning, with white noise while moving, so the estimate drifts."""
    rng = np.random.default_rng([scenario.seed, 11])
    t = np.arange(int(math.ceil(scenario.duration * hz - 1e-9))) / hz
    x, y, yaw = scenario.route.pose_at(t)
    step = np.hypot(np.diff(x), np.diff(y))
    turn = np.diff(yaw)
    moving = step > 1e-6
    scale = 1.0 + rng.uniform(0.01, 0.02) * rng.choice([-1.0, 1.0])
    bias = rng.uniform(0.0003, 0.0007) * rng.choice([-1.0, 1.0])  # rad per metre
    turn_scale = 1.0 + rng.uniform(0.002, 0.006) * rng.choice([-1.0, 1.0])
    step_m = step * scale + moving * rng.normal(0.0, 0.002, len(step))
    turn_m = turn * turn_scale + bias * step + moving * rng.normal(0.0, 0.0003, len(turn))
    ox, oy, oth = np.zeros(len(t)), np.zeros(len(t)), np.zeros(len(t))
    heading = oth[0]
    for i in range(len(step)):
        mid = heading + turn_m[i] / 2
        ox[i + 1] = ox[i] + step_m[i] * math.cos(mid)
        oy[i + 1] = oy[i] + step_m[i] * math.sin(mid)
        heading += turn_m[i]
        oth[i + 1] = heading
    v = np.concatenate([step_m * hz, [0.0]])
    w = np.concatenate([turn_m * hz, [0.0]])
    return OdometryTrack(t, ox, oy, oth, v, w)


def localiser_updates(scenario: RouteScenario, odom: OdometryTrack, hz: float = LOCALISER_HZ,
                      sigma_m: float = LOCALISER_SIGMA_M, sigma_rad: float = 0.005) -> LocaliserTrack:
    """map -> odom as a localiser (AMCL) publishes it: every 1/`hz` s, the correction that puts the odometry on the
    true pose up to a small error (clipped Gaussian), held between updates; published 30-80 ms after its stamp."""
    rng = np.random.default_rng([scenario.seed, 12])
    n = int(math.ceil(scenario.duration * hz - 1e-9))
    stamp = np.round(np.arange(n) / hz + rng.uniform(0.0, 0.01, n), 4)
    stamp = stamp[stamp < odom.t[-1]]
    n = len(stamp)
    tx, ty, tth = scenario.route.pose_at(stamp)
    ex = np.clip(rng.normal(0.0, sigma_m, n), -2.5 * sigma_m, 2.5 * sigma_m)
    ey = np.clip(rng.normal(0.0, sigma_m, n), -2.5 * sigma_m, 2.5 * sigma_m)
    eth = np.clip(rng.normal(0.0, sigma_rad, n), -2.5 * sigma_rad, 2.5 * sigma_rad)
    estimate = (tx + ex, ty + ey, tth + eth)
    mx, my, mth = compose(estimate, invert(odom.pose_at(stamp)))
    publish = stamp + rng.uniform(0.03, 0.08, n)
    return LocaliserTrack(stamp, publish, mx, my, mth)


def odometry_drift(scenario: RouteScenario, odom: OdometryTrack) -> np.ndarray:
    """How far the odometry, started on the true start pose, is from the truth at each of its samples (metres)."""
    start = tuple(np.full(len(odom.t), float(v)) for v in scenario.pose_at(0.0))
    x, y, _ = compose(start, (odom.x, odom.y, odom.yaw))
    tx, ty, _ = scenario.pose_at(odom.t)
    return np.hypot(x - tx, y - ty)
