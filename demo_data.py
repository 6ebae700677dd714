"""The demo dataset: drawn "flowers" in five classes, ``root/<class>/NNNN.jpg``, written once and
cached, so the template trains without a download."""

from __future__ import annotations

import math
import os
import random
import tempfile
from pathlib import Path

from PIL import Image, ImageDraw, ImageFilter

from multi_train_utils.guard import UserError

DEMO_CLASSES = ("daisy", "dandelion", "roses", "sunflowers", "tulips")  # as flower_photos
# Flowers of petals: count range, petal width (x radius), petal and centre colours, centre radius.
PETALS = {"daisy": ((10, 15), 0.22, (240, 240, 235), (235, 190, 30), 0.25),
          "sunflowers": ((14, 20), 0.28, (245, 200, 30), (80, 45, 20), 0.45),
          "dandelion": ((24, 34), 0.1, (245, 200, 30), (230, 170, 20), 0.3)}


def _draw_demo_image(cls: str, rng: random.Random, size: int) -> Image.Image:
    """A "flower" of class ``cls`` with jittered hue, size, position and clutter: learnable in a
    few CPU epochs, not trivially."""
    def jitter(rgb: tuple[int, int, int], amount: int = 25) -> tuple[int, ...]:
        return tuple(min(255, max(0, c + rng.randint(-amount, amount))) for c in rgb)

    sky = rng.random() < 0.4
    img = Image.new("RGB", (size, size), jitter((110, 160, 220) if sky else (50, 110, 45), 40))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randrange(4, 10)):  # leaves and blades of grass
        x, y = rng.uniform(0, size), rng.uniform(0, size)
        draw.line([(x, y), (x + rng.uniform(-12, 12), y - rng.uniform(5, 25))],
                  fill=jitter((40, 120, 40), 35), width=rng.randrange(1, 4))

    def oval(cx, cy, a, b, angle, n=10):  # n points of an ellipse turned by angle
        return [(cx + a * math.cos(t) * math.cos(angle) - b * math.sin(t) * math.sin(angle),
                 cy + a * math.cos(t) * math.sin(angle) + b * math.sin(t) * math.cos(angle))
                for t in (2 * math.pi * k / n for k in range(n))]

    for _ in range(rng.choice((1, 1, 2))):
        r = rng.uniform(0.18, 0.32) * size
        cx, cy = rng.uniform(r * 0.6, size - r * 0.6), rng.uniform(r * 0.6, size - r * 0.6)
        draw.line([(cx, cy), (cx + rng.uniform(-5, 5), size)], fill=jitter((30, 110, 30)), width=2)
        spin = rng.uniform(0, math.pi)
        if cls in PETALS:
            # A count is drawn for each kind, in this order: the images stay those measured.
            petals = {kind: rng.randrange(*spec[0]) for kind, spec in PETALS.items()}[cls]
            _, width, colour, centre, c = PETALS[cls]
            for k in range(petals):
                angle = spin + 2 * math.pi * k / petals
                px, py = cx + 0.55 * r * math.cos(angle), cy + 0.55 * r * math.sin(angle)
                draw.polygon(oval(px, py, 0.48 * r, width * r, angle), fill=jitter(colour, 20))
            draw.ellipse([cx - c * r, cy - c * r, cx + c * r, cy + c * r], fill=jitter(centre, 20))
        elif cls == "roses":
            base = jitter((200, 25, 45), 30)
            for layer in range(4):  # darker layers inwards
                lr_ = r * (1 - 0.22 * layer)
                draw.polygon(oval(cx, cy, lr_, lr_ * 0.9, spin + layer, n=7),
                             fill=tuple(max(0, v - 25 * layer) for v in base))
        else:  # tulips: a cup of three petals
            colour = jitter(rng.choice(((230, 90, 170), (200, 80, 220), (240, 120, 150))), 20)
            for offset in (-0.45, 0.0, 0.45):
                draw.polygon(oval(cx + offset * r, cy, 0.35 * r, 0.8 * r, 0.0), fill=colour)
            draw.rectangle([cx - 0.75 * r, cy + 0.15 * r, cx + 0.75 * r, cy + 0.6 * r], fill=colour)
    return img.filter(ImageFilter.GaussianBlur(rng.uniform(0, 0.7)))


def make_demo_data(root: str | os.PathLike, per_class: int = 120, size: int = 64) -> Path:
    """``root``, holding the demo data (the same every time) unless it was there. Processes may
    call it at once: each draws into a temporary folder and renames it; the first rename wins."""
    root = Path(root)
    if root.is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=f".{root.name}.") as tmp:
        for cls in DEMO_CLASSES:
            os.mkdir(Path(tmp, cls))
            rng = random.Random(f"0-{cls}")
            for i in range(per_class):
                _draw_demo_image(cls, rng, size).save(Path(tmp, cls, f"{i:04d}.jpg"), quality=90)
        try:
            os.rename(tmp, root)
        except OSError:
            if not root.is_dir():  # not another process's rename that won: a real error
                raise
    return root


def user_cache_dir(instead: str) -> Path:
    """``$XDG_CACHE_HOME`` or ``~/.cache``; without a home folder (some containers) a
    :class:`UserError` that ends with ``instead``."""
    try:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except (RuntimeError, KeyError):  # KeyError: Python < 3.12 without a user database entry
        raise UserError(f"this user has no home folder to keep a cache in; {instead}.") from None


def default_demo_root() -> Path:
    """Where the demo data is cached: ``$DDP_DEMO_DATA`` or the user's cache folder."""
    if given := os.environ.get("DDP_DEMO_DATA"):
        return Path(given)
    return user_cache_dir("pass --demo-dir a folder you can write, or --data-path your own "
                          "images") / "ddp-template" / "demo_flowers_v1"
