"""Camera frames of the warehouse shift: the scene of a `Scenario` drawn at a moment, as RGB.

Floor, docks, shelves, aisles, the charging station and the door are drawn the same in every frame;
the forklift, pallets, cone and door light where their tracks put them at that moment; a status bar
shows the wall clock, as a camera overlay would. OpenCV is imported only when a frame is drawn.
"""

from __future__ import annotations

import numpy as np

from .warehouse_layout import AISLE_X, COLOURS, DOCK_X, PLACES, SHELF_X, SHIFT_START, clock_text
from .warehouse_scenario import Scenario


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


def _draw_robot(img: np.ndarray, at: tuple[int, int], name: str, scale: float) -> None:
    import cv2

    h, w = img.shape[:2]
    r = max(3, int(0.022 * w))
    cv2.circle(img, at, r, (60, 64, 72), -1)
    cv2.circle(img, at, max(1, r // 3), (120, 220, 255), -1)  # its sensor
    _label(img, name, (at[0] + r + 1, at[1] - r), 0.3 * scale, (40, 40, 60))


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

    # Cones, the robot and forklifts first, pallets last: a carried pallet is drawn on the forklift.
    order = {"cone": 0, "robot": 1, "forklift": 2, "pallet": 3}
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
        elif track.kind == "robot":
            _draw_robot(img, at, track.name, scale)
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
