"""`shapes_captions`: a built-in, offline image+caption set, rendered with PIL and deterministic in the row number.

Each image holds 1 to 6 shapes (circle, square, triangle, diamond) in 8 colours, two sizes, on distinct cells of a
3 × 3 grid, over a plain background. The question picks how much the answer says, so caption lengths run from about
10 tokens ("a small red circle on a white background") to about 100 (every shape with its size, colour and place):
the spread of lengths under which per-micro-batch loss means go wrong.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from PIL import Image, ImageDraw

ROWS = 1024  # rows in the set; data.limit takes the first N
SIDE = 96  # rendered pixels per side; the image processor resizes to the vision tower's size
SHAPE_KINDS = ("circle", "square", "triangle", "diamond")
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "purple": (140, 60, 180),
    "orange": (245, 140, 30),
    "pink": (240, 120, 180),
    "brown": (130, 80, 40),
}
BACKGROUNDS = {"white": (250, 250, 250), "grey": (128, 128, 128), "black": (10, 10, 10)}
PLACES = ("top left", "top", "top right", "left", "centre", "right", "bottom left", "bottom", "bottom right")
NUMBERS = ("no", "one", "two", "three", "four", "five", "six")
QUESTIONS = {
    "brief": ("What is in the image?", "Name what you see.", "Caption this image briefly."),
    "count": ("How many shapes are there, and what are they?", "Count the shapes in the picture."),
    "detailed": ("Describe the image in detail.", "Describe every shape in the picture and where it is."),
}


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    large: bool
    cell: int  # 0..8, row-major over the 3 × 3 grid

    def words(self) -> str:
        return f"{'large' if self.large else 'small'} {self.colour} {self.kind}"


@dataclass(frozen=True)
class Scene:
    background: str
    shapes: tuple[Shape, ...]


def scene(index: int, seed: int = 0) -> Scene:
    rng = random.Random(f"shapes_captions/{seed}/{index}")
    background = rng.choice(list(BACKGROUNDS))
    cells = rng.sample(range(9), rng.randint(1, 6))
    palette = list(COLOURS)
    kinds = rng.sample(SHAPE_KINDS, rng.randint(1, 3))  # repeated kinds and colours make counting matter
    colours = rng.sample(palette, rng.randint(1, 3))
    shapes = tuple(Shape(rng.choice(kinds), rng.choice(colours), rng.random() < 0.5, c) for c in sorted(cells))
    return Scene(background, shapes)


def render(scene_: Scene, side: int = SIDE) -> Image.Image:
    image = Image.new("RGB", (side, side), BACKGROUNDS[scene_.background])
    draw = ImageDraw.Draw(image)
    cell = side / 3
    for shape in scene_.shapes:
        cx, cy = (shape.cell % 3 + 0.5) * cell, (shape.cell // 3 + 0.5) * cell
        r = cell * (0.42 if shape.large else 0.24)
        fill = COLOURS[shape.colour]
        box = (cx - r, cy - r, cx + r, cy + r)
        if shape.kind == "circle":
            draw.ellipse(box, fill=fill)
        elif shape.kind == "square":
            draw.rectangle(box, fill=fill)
        elif shape.kind == "triangle":
            draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=fill)
        else:
            draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fill)
    return image


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _groups(shapes: tuple[Shape, ...]) -> list[str]:
    """'two red circles', 'a blue square', … in order of first appearance."""
    counts = Counter((s.colour, s.kind) for s in shapes)
    out = []
    for (colour, kind), n in counts.items():
        out.append(f"a {colour} {kind}" if n == 1 else f"{NUMBERS[n]} {colour} {kind}s")
    return out


def caption(scene_: Scene, detail: str) -> str:
    shapes, n = scene_.shapes, len(scene_.shapes)
    if detail == "brief":
        if n == 1:
            return f"A {shapes[0].words()} on a {scene_.background} background."
        return _join(_groups(shapes)).capitalize() + f" on a {scene_.background} background."
    if detail == "count":
        are = "is one shape" if n == 1 else f"are {NUMBERS[n]} shapes"
        return f"There {are}: {_join(_groups(shapes))}."
    lines = [f"The image shows {NUMBERS[n]} shape{'s' if n > 1 else ''} on a {scene_.background} background."]
    for shape in shapes:
        where = "in the centre" if PLACES[shape.cell] == "centre" else f"at the {PLACES[shape.cell]}"
        lines.append(f"{where.capitalize()} there is a {shape.words()}.")
    if n > 1:
        lines.append(f"In all: {_join(_groups(shapes))}.")
    return " ".join(lines)


def row(index: int, seed: int = 0, side: int = SIDE) -> dict:
    """{"images": [PIL image], "messages": [user: image + question, assistant: caption]}."""
    scene_ = scene(index, seed)
    rng = random.Random(f"shapes_captions/question/{seed}/{index}")
    detail = rng.choice(list(QUESTIONS))
    question = rng.choice(QUESTIONS[detail])
    return {
        "images": [render(scene_, side)],
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": caption(scene_, detail)},
        ],
    }


def rows(limit: int | None = None, seed: int = 0) -> list[dict]:
    return [row(k, seed) for k in range(ROWS if limit is None else min(limit, ROWS))]
