"""The test JPEGs of the pipeline and with-data stages: photo-sized, photo-like, cached."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from demo_data import user_cache_dir


def _photo(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A photo-like RGB image: smooth colour gradients, blurred shapes and sensor noise.

    Flat synthetic images compress to a few KB and decode unrealistically fast; this lands near
    a real 500x375 quality-90 photo (about 40-50 KB), so decoding costs what it costs in training.
    """
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    yy, xx = yy / height, xx / width
    planes = []
    for _ in range(3):
        fx, fy, phase = rng.uniform(0.5, 3.0, 3)
        planes.append(120 + 80 * np.sin(fx * np.pi * xx + 6 * phase) * np.cos(fy * np.pi * yy)
                      + rng.uniform(-40, 40))
    img = Image.fromarray(np.clip(np.stack(planes, -1), 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(5, 15))):
        x, y, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(10, 120)
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.ellipse([x - r, y - r * rng.uniform(0.5, 1.5), x + r, y + r], fill=colour)
        else:
            draw.polygon([(x + rng.uniform(-r, r), y + rng.uniform(-r, r))
                          for _ in range(int(rng.integers(3, 7)))], fill=colour)
    pixels = np.asarray(img.filter(ImageFilter.GaussianBlur(1.5)), dtype=np.float32)
    pixels += rng.normal(0, 6, pixels.shape).astype(np.float32)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def make_photos(folder: str | os.PathLike, count: int, *, width: int = 500, height: int = 375,
                seed: int = 0) -> list[str]:
    """Paths of ``count`` photo-like JPEGs (quality 90) in ``folder``; missing ones are written.

    Image ``i`` depends only on ``(seed, i)``, so the cache grows without changing what exists.
    Each file is written under a temporary name and renamed, so concurrent runs can share it.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = folder / f"{seed}_{i:05d}_{width}x{height}.jpg"
        if not path.is_file():
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".jpg")
            os.close(fd)
            _photo(np.random.default_rng([seed, i]), width, height).save(tmp, quality=90)
            os.replace(tmp, path)
        paths.append(str(path))
    return paths


def default_image_dir() -> Path:
    """Where the photos are cached without ``--image-dir``; ``UserError`` without a home."""
    return user_cache_dir("pass --image-dir a folder you can write") / "ddp-template" / \
        "bench_photos_v1"


def photos(args: argparse.Namespace) -> list[str]:
    """The run's ``--pipeline-images`` photos in ``--image-dir`` (resolved by ``__main__``)."""
    return make_photos(args.image_dir, args.pipeline_images, seed=args.seed)
