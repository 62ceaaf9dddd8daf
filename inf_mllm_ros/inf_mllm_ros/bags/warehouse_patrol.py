"""The patrol robot of the sample bags: its route through the warehouse and what it reports.

A robot (R1) drives from place to place at `ROBOT_SPEED` by the warehouse's lanes and waits `DWELL_S` at each.
From `reports_from` on it reports things it sees at some of the places it reaches ("Patrol robot R1 saw a yellow
ladder at dock 3."), and each report gives three questions asked a while later: what (the thing's colour), when
(the time of day) and where (the place, whose position in metres is the truth a pose is judged against): the
questions a planner asks of a robot's memory, whose answers' evidence carries the stamp and the pose.

The plan draws from its own seeded generator, so the scenario's other facts stay what they were for a seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .warehouse_layout import PLACES, lane_route, to_metres

ROBOT = "R1"
ROBOT_SPEED = 1.0  # m/s
DWELL_S = 4.0
START_PLACE = "charging station"
REPORT_CHANCE = 0.5  # of reporting something at a place it reaches
ASK_AFTER_S = (20.0, 240.0)  # a report's questions come this long after it (drawn), or at the end of the shift
# Each thing is reported once in a shift, so that a question about it has one answer.
THINGS = ("ladder", "toolbox", "fire extinguisher", "helmet", "hand truck", "bucket", "tarp", "hose", "broom",
          "crate", "step stool", "barrier", "drum", "mop", "pallet jack", "traffic cone", "extension cord", "glove",
          "safety vest", "dustpan", "trash bin", "cable reel", "first aid kit", "tool bag")
THING_COLOURS = ("red", "green", "blue", "yellow", "orange", "white", "black", "grey")


class Drive(NamedTuple):
    """The robot leaves for `place` at `start` and reaches it at `end` (seconds into the shift)."""

    start: float
    end: float
    place: str


class Report(NamedTuple):
    """The robot says it saw a `colour` `thing` at `place` at `said`; questions about it come at `asked`."""

    said: float
    thing: str
    colour: str
    place: str
    asked: float

    @property
    def text(self) -> str:
        article = "an" if self.colour[0] in "aeiou" else "a"
        return f"Patrol robot {ROBOT} saw {article} {self.colour} {self.thing} at {self.place}."


@dataclass
class PatrolPlan:
    """The robot's drives, in order, and its reports."""

    drives: list[Drive] = field(default_factory=list)
    reports: list[Report] = field(default_factory=list)


def route_metres(start: str, end: str) -> float:
    """The length of the drive between two places, by the lanes, in metres."""
    points = [to_metres(p) for p in lane_route(PLACES[start], PLACES[end])]
    return sum(math.dist(a, b) for a, b in zip(points, points[1:]))


def plan_patrol(duration_s: float, seed: int, reports_from: float) -> PatrolPlan:
    """The robot's drives over the shift and its reports from `reports_from` on."""
    rng = np.random.default_rng([seed, 1])
    plan = PatrolPlan()
    here, t = START_PLACE, 0.0
    while t < duration_s:
        t += DWELL_S
        there = str(rng.choice([p for p in PLACES if p != here]))
        plan.drives.append(Drive(t, t + route_metres(here, there) / ROBOT_SPEED, there))
        here, t = there, plan.drives[-1].end
    things = list(THINGS)
    for drive in plan.drives:
        said = drive.end + 1.0  # stopped at the place
        if said < reports_from or said >= duration_s or not things or rng.random() >= REPORT_CHANCE:
            continue
        thing = things.pop(int(rng.integers(len(things))))
        colour = str(rng.choice(THING_COLOURS))
        asked = min(said + float(rng.uniform(*ASK_AFTER_S)), duration_s)
        plan.reports.append(Report(said, thing, colour, drive.place, asked))
    return plan
