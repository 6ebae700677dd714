"""``--decode device``: the loader workers read JPEG files and draw each one's :class:`Plan` as
the v2 pipeline of ``get_transforms`` would (``MyDataSet`` calls :class:`BatchAugment`); the
training device decodes and augments whole batches (``prefetch_to_device``: a batch ahead)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from multi_train_utils.train_eval_utils import IGNORE_INDEX
from my_dataset import decode_jpegs, load_image_tensor, report_unreadable


class Plan(NamedTuple):
    """Crop ``box`` (top, left, h, w), resize to ``size``, centre-crop to ``crop`` (padding as
    ``v2.CenterCrop`` does), maybe flip."""

    box: tuple[int, int, int, int]
    size: tuple[int, int]
    crop: tuple[int, int]
    flip: bool


class Encoded(NamedTuple):
    """A sample from a worker: JPEG bytes ``uint8 (L,)`` or pixels ``uint8 (3, H, W)``, the
    image's height and width, ``source`` (path, skip log) to list it by, and its plan."""

    data: torch.Tensor
    hw: tuple[int, int]
    source: tuple[str, Any] = ("", None)
    plan: Plan | None = None

    @staticmethod
    def collate(samples: Sequence[Encoded], labels: Sequence[int]) -> JpegBatch:
        return JpegBatch(torch.cat([s.data.reshape(-1) for s in samples]),
                         [s.data.shape for s in samples], [s.plan for s in samples],
                         torch.as_tensor(labels, dtype=torch.int64), [s.source for s in samples])


class BatchAugment:
    """``get_transforms``' train or val pipeline as a :class:`Plan` per image."""

    def __init__(self, transform: v2.Compose) -> None:
        self.steps = list(getattr(transform, "transforms", [transform]))
        if [type(t) for t in self.steps] not in ([v2.RandomResizedCrop, v2.RandomHorizontalFlip],
                                                 [v2.Resize, v2.CenterCrop]):
            raise ValueError(f"--decode device does RandomResizedCrop + RandomHorizontalFlip or "
                             f"Resize + CenterCrop, not {transform}; use --decode workers.")

    def read(self, path: str, skip_log: Any = None) -> Encoded:
        """In a worker: the bytes of a whole 8-bit colour JPEG without EXIF rotation (nvJPEG
        ignores it), else the pixels as ``--decode workers`` decodes them (or raises)."""
        with open(path, "rb") as f:
            data = f.read()
        try:
            with Image.open(io.BytesIO(data)) as img:  # the header only
                if (img.format, img.mode) == ("JPEG", "RGB") and b"\xff\xd9" in data[-1024:] \
                        and img.getexif().get(0x0112, 1) == 1:  # EXIF orientation: none
                    data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                    return Encoded(data, (img.height, img.width), (path, skip_log))
        except Exception:  # a header PIL cannot read: the workers' decoders say why
            pass
        pixels = load_image_tensor(path)
        return Encoded(pixels, (pixels.shape[1], pixels.shape[2]), (path, skip_log))

    def __call__(self, sample: Encoded | torch.Tensor) -> Encoded:
        """``sample`` (or an unreadable file's stand-in pixels) with its plan, drawn as v2 does."""
        sample = Encoded(sample, tuple(sample.shape[1:])) if torch.is_tensor(sample) else sample
        (height, width), (first, second) = sample.hw, self.steps
        shape = torch.empty(0, height, width)  # no pixels: v2 reads the size from it
        if isinstance(first, v2.RandomResizedCrop):
            params = first.make_params([shape])
            box = (params["top"], params["left"], params["height"], params["width"])
            flip = bool(torch.rand(1) < second.p)  # v2 keeps the image if rand(1) >= p
            return sample._replace(plan=Plan(box, first.size, first.size, flip))
        size = tuple(first(shape).shape[1:])  # v2's resize rule
        return sample._replace(plan=Plan((0, 0, height, width), size, second.size, False))


class JpegBatch(NamedTuple):
    """What the workers send: ``data`` holds each sample's bytes or pixels end to end (one
    shared-memory segment a batch, not one a sample), cut by ``shapes``."""

    data: torch.Tensor
    shapes: list[torch.Size]
    plans: list[Plan]
    labels: torch.Tensor  # int64 (N,)
    sources: list[tuple[str, Any]]

    def to_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(images uint8 (N, 3, S, S), labels (N,))`` on ``device`` as ``--decode workers``
        gives them: one decode call, then :func:`_augment` per image."""
        parts = [x.view(s) for x, s in zip(self.data.split([s.numel() for s in self.shapes]),
                                            self.shapes)]
        jpegs = [(x, source) for x, source in zip(parts, self.sources) if x.dim() == 1]
        if device.type == "cuda":  # a host wait: nvJPEG's hardware engine ignores stream order
            # and may write into memory this stream's queued work still reads (vision#9606)
            torch.cuda.current_stream(device).synchronize()
        try:
            decoded = decode_jpegs([x for x, _ in jpegs], device) if jpegs else []
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception:  # one bad file fails the call: image by image, as the workers decode
            decoded = [_decode_on_cpu(x, source, device) for x, source in jpegs]
        decoded = iter(decoded)
        images = [x.to(device, non_blocking=True) if x.dim() == 3 else next(decoded)
                  for x in parts]
        labels = self.labels.masked_fill(torch.tensor([x is None for x in images]), IGNORE_INDEX)
        out = torch.stack([_augment(x, plan).float() if x is not None  # else black, of its size
                           else torch.zeros(3, *plan.crop, device=device)
                           for x, plan in zip(images, self.plans)])
        return out.round_().to(torch.uint8), labels.to(device, non_blocking=True)


def _decode_on_cpu(data: torch.Tensor, source: tuple, device: torch.device) -> torch.Tensor | None:
    try:
        return decode_jpegs([data], torch.device("cpu"))[0].to(device, non_blocking=True)
    except Exception as exc:
        report_unreadable(source[0], exc, source[1])
        return None


def _augment(image: torch.Tensor, plan: Plan) -> torch.Tensor:
    """``uint8 (3, H, W)`` -> ``(3, h, w)``: the plan's steps with v2's own kernels, on uint8 on
    the CPU (the very pixels of ``--decode workers``), else on float (antialiased bilinear
    ``F.interpolate``, which ``roi_align`` lacks)."""
    x = TF.resized_crop(image if image.is_cpu else image.float(), *plan.box, list(plan.size),
                        antialias=True)
    x = TF.center_crop(x, list(plan.crop))
    return TF.horizontal_flip(x) if plan.flip else x
