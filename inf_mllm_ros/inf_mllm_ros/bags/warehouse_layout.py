"""The warehouse of the sample bags: its places, lanes and clock, in the image's fractions and in metres.

Places are kept in fractions of the drawn image (bags/warehouse_frames.py draws them); `to_metres` gives the same
points in the map frame `MAP_FRAME`, `WORLD_W` x `WORLD_H` metres, x to the right of the image and y up, where the
patrol robot's odometry is (bags/warehouse_patrol.py).
"""

from __future__ import annotations

import math
from datetime import datetime, timezone

# A fixed epoch makes the bag byte-for-byte reproducible for a given seed.
SHIFT_START = datetime(2024, 6, 3, 8, 0, 0, tzinfo=timezone.utc)
START_NS = int(SHIFT_START.timestamp()) * 1_000_000_000

WORLD_W, WORLD_H = 40.0, 30.0  # metres
MAP_FRAME = "map"


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


def lane_route(start: tuple[float, float], end: tuple[float, float]) -> list[tuple[float, float]]:
    """Waypoints from start to end: trips to or from the shelf row go by the lane."""
    if max(start[1], end[1]) <= LANE_Y:
        return [start, end]
    points = [start, (start[0], LANE_Y), (end[0], LANE_Y), end]
    return [p for i, p in enumerate(points) if i == 0 or math.dist(p, points[i - 1]) > 1e-9]


def to_metres(xy: tuple[float, float]) -> tuple[float, float]:
    """A point in fractions of the image as metres in the map frame."""
    return xy[0] * WORLD_W, (1.0 - xy[1]) * WORLD_H


PLACES_M: dict[str, tuple[float, float]] = {name: to_metres(xy) for name, xy in PLACES.items()}
