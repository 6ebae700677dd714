"""``MyDataSet``: image files and labels in, ``(image, label)`` out; a bad file does not kill the
run (docs/bad-data.md)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import logging
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import Dataset, default_collate
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from multi_train_utils.distributed_utils import cpus_per_process
from multi_train_utils.guard import workers_ignore_stop_signals
from multi_train_utils.train_eval_utils import IGNORE_INDEX

try:  # torchvision's successor: torchvision 0.29 deprecates its decoders in its favour
    from torchcodec.decoders import decode_jpeg as codec_decode_jpeg
except ImportError:  # an optional extra
    codec_decode_jpeg = None
try:  # once torchvision's decoders are gone too, and no TorchCodec, PIL decodes all
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:  # pragma: no cover - depends on the installed torchvision
    decode_jpeg = None

log = logging.getLogger(__name__)

LOADER_TIMEOUT_S = 600  # a batch a lost worker never delivers becomes an error, not a hang
PREFETCH_FACTOR = 4  # batches each worker keeps in flight

_JPEG_START = b"\xff\xd8\xff"
_ESCAPES = str.maketrans({"\t": "\\t", "\n": "\\n", "\r": "\\r"})


def printable_path(path: str | os.PathLike) -> str:
    """``path`` as one field of a UTF-8 line: bytes that are not UTF-8 on disk (kept by Python
    as lone surrogates) become ``\\xff`` escapes, tabs and line breaks ``\\t``/``\\n``/``\\r``,
    so tab-separated listings such as ``skipped_files.txt`` stay parseable."""
    data = os.fspath(path).encode("utf-8", "surrogateescape")
    return data.decode("utf-8", "backslashreplace").translate(_ESCAPES)


def load_pil_image(path: str | io.BytesIO) -> Image.Image:
    """An 8-bit RGB PIL image with its EXIF orientation applied; raises if it cannot be read."""
    with Image.open(path) as img:
        img = ImageOps.exif_transpose(img)
        if img.mode.startswith("I;16"):
            # 16-bit grayscale (e.g. medical PNG): convert("RGB") clips at 255, all white.
            img = img.point(lambda v: v / 256).convert("L")
        return img.convert("RGB")


def decode_jpegs(data: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """JPEG bytes (``uint8 (L,)`` CPU tensors) to RGB ``uint8 (3, H, W)`` on ``device`` in one
    call (on CUDA one nvJPEG batch): TorchCodec where installed, else torchvision, else PIL."""
    if codec_decode_jpeg is not None:
        return codec_decode_jpeg(list(data), device=device)
    if decode_jpeg is not None:
        return decode_jpeg(list(data), mode=ImageReadMode.RGB, device=device,
                           apply_exif_orientation=True)
    return [TF.pil_to_tensor(load_pil_image(io.BytesIO(x.numpy()))).to(device) for x in data]


def load_image_tensor(path: str | io.BytesIO) -> torch.Tensor:
    """The image at (or in) ``path`` as ``uint8 (3, H, W)`` RGB, EXIF-oriented. Only JPEG goes
    through :func:`decode_jpegs`: torchvision's PNG decoder kills the process on damaged data
    (vision#3613), decodes all of an animated GIF and ignores WebP's EXIF orientation."""
    with open(path, "rb") if isinstance(path, str) else contextlib.nullcontext(path) as f:
        data = f.read(len(_JPEG_START))
        data += f.read() if data == _JPEG_START else b""  # else PIL opens it itself
    if data.startswith(_JPEG_START):
        try:
            data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            return decode_jpegs([data], torch.device("cpu"))[0]
        except RuntimeError:  # e.g. arithmetic-coded or 12-bit JPEG: PIL may still read it
            pass
    return TF.pil_to_tensor(load_pil_image(path))


def check_image(path: str) -> str | None:
    """Why ``path`` is not a usable image, as a short phrase, or None when it looks fine: PIL
    reads the header only, a JPEG or PNG without its end marker (cut short) is decoded to be
    sure."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block its reader
            return "not a regular file"
        if st.st_size == 0:
            return "empty file"
        with open(path, "rb") as f:
            f.seek(max(0, st.st_size - 1024))
            tail = f.read()
        with Image.open(path) as img:
            if not {"JPEG": b"\xff\xd9" in tail, "PNG": b"IEND" in tail}.get(img.format, True):
                img.load()  # raises "image file is truncated" if it really is
        return None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        if _machine_error(exc):
            raise
        return f"not a readable image ({type(exc).__name__}: {_first_line(exc)})"


def _machine_error(exc: BaseException) -> bool:
    """Out of file descriptors: the machine's problem; a good image is not unreadable for it."""
    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:160].replace("\t", " ")  # tabs split listings


class MyDataSet(Dataset):
    """Images and integer labels; ``dataset[i]`` -> ``(transform(image), label)``, the image
    ``uint8 (3, H, W)`` for a ``transforms.v2`` transform or None, else RGB PIL.

    A file that fails to decode is reported once (:func:`report_unreadable`) and replaced, with
    ``replace_unreadable`` (training), by a readable image of its class: a black one would still
    drag BatchNorm's statistics. Otherwise, or if its class has none, by a black image with label
    ``IGNORE_INDEX``, which the loss and ``evaluate`` ignore."""

    def __init__(self, images_path: Sequence[str], images_class: Sequence[int],
                 transform: Callable[[Any], Any] | None = None, *, seed: int = 0,
                 skip_log: str | os.PathLike | None = None,
                 replace_unreadable: bool = False) -> None:
        if len(images_path) != len(images_class):
            raise ValueError(f"{len(images_path)} image paths but {len(images_class)} labels")
        self.images_path = list(images_path)
        self._labels = np.asarray(images_class, dtype=np.int64)  # a class's other images: below
        self.images_class = self._labels.tolist()
        self.transform = transform
        self.use_pil = not (transform is None or isinstance(transform, v2.Transform)
                            or hasattr(transform, "read"))  # device_decode's reads the files
        self.seed = seed
        self.skip_log = skip_log
        self.replace_unreadable = replace_unreadable
        # Shared memory: persistent DataLoader workers see set_epoch() and each other's finds.
        self._epoch = torch.full((1,), -1, dtype=torch.int64).share_memory_()
        self._bad = torch.zeros(len(self.images_path), dtype=torch.bool).share_memory_()

    def __len__(self) -> int:
        return len(self.images_path)

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch, as ``DistributedSampler.set_epoch``."""
        self._epoch[0] = epoch

    def __getitem__(self, index: int) -> tuple[Any, int]:
        # index + k * len: the k-th copy of an image (repeated augmentation), augmented apart.
        img, label = self._load_or_replace(index % len(self))
        if self.transform is None:
            return img, label
        epoch = int(self._epoch[0])
        with torch.random.fork_rng(devices=[], enabled=epoch >= 0):  # the CPU generator only
            if epoch >= 0:  # not torch.manual_seed: it would reseed the GPUs' too (--workers 0)
                torch.default_generator.manual_seed(
                    ((self.seed * 1_000_003 + epoch) * 1_000_003 + index) % 2**63)
            return self.transform(img), label

    def _load(self, index: int) -> Any:
        path = self.images_path[index]
        if hasattr(self.transform, "read"):  # device_decode.BatchAugment: JPEG bytes, or pixels
            return self.transform.read(path, self.skip_log)
        return load_pil_image(path) if self.use_pil else load_image_tensor(path)

    def _load_or_replace(self, index: int) -> tuple[Any, int]:
        """Sample ``index``'s image and label, or what stands in for it."""
        label = self.images_class[index]
        for i in self._candidates(index):
            try:
                return self._load(i), label
            except Exception as exc:  # any decoder error: report the file, keep the worker
                if _machine_error(exc):
                    raise
                self._bad[i] = True
                report_unreadable(self.images_path[i], exc, self.skip_log)
        return self.stand_in()

    def stand_in(self) -> tuple[Any, int]:
        """A black image labelled ``IGNORE_INDEX``, which the loss and ``evaluate`` ignore."""
        black = torch.zeros(3, 8, 8, dtype=torch.uint8)
        return (TF.to_pil_image(black) if self.use_pil else black), IGNORE_INDEX

    def _candidates(self, index: int) -> Iterator[int]:
        """``index``, then (``replace_unreadable``) its class's others not known unreadable, in an
        order drawn from ``(seed, epoch, index)``: bad files come in runs (a failed download), and
        one neighbour standing in for them all would weigh as much as all of them."""
        if not self._bad[index]:
            yield index
        if self.replace_unreadable:
            same = np.flatnonzero(self._labels == self.images_class[index])
            rng = np.random.default_rng([self.seed % 2**63, max(int(self._epoch[0]), 0), index])
            yield from (int(i) for i in rng.permutation(same) if not self._bad[i])

    @staticmethod
    def collate_fn(batch: Sequence[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[(image (3, H, W), label), ...]`` -> ``(images (N, 3, H, W), labels (N,) int64)``."""
        images, labels = tuple(zip(*batch))
        if hasattr(images[0], "collate"):  # device_decode's samples: files read, not decoded
            return images[0].collate(images, labels)
        # default_collate stacks into shared memory inside a worker: one copy fewer.
        return default_collate(list(images)), torch.as_tensor(labels, dtype=torch.int64)


def report_unreadable(path: str, exc: Exception, skip_log: str | os.PathLike | None) -> None:
    """A warning, and ``path<TAB>reason`` appended to ``skip_log`` unless listed there (by
    another rank or worker: the lock makes "already listed?" and the append one step)."""
    name = printable_path(path)
    reason = f"not a readable image at load time ({type(exc).__name__}: {_first_line(exc)})"
    log.warning("skipping %s: %s", name, reason)
    if skip_log is None:
        return
    try:
        with open(skip_log, "a+", encoding="utf-8", errors="backslashreplace") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            if not any(line.startswith(name + "\t") for line in f):
                f.write(f"{name}\t{reason}\n")
    except OSError as err:  # a full disk must not kill the worker: say so instead
        log.warning("could not list %s in %s: %s", name, skip_log, err)


def default_workers(batch_size: int, device: torch.device) -> int:
    """Loader workers per process: at most one per image of the batch and this process's share of
    the CPUs; on CUDA all but the one launching kernels, on CPU at most 8, as they take cores from
    training (measured: docs/performance.md)."""
    batch_cap = batch_size if batch_size > 1 else 0
    if device.type == "cuda":
        return max(0, min(cpus_per_process() - 1, batch_cap))
    return min(cpus_per_process(), batch_cap, 8)


def loader_kwargs(workers: int, device: torch.device) -> dict[str, Any]:
    """``DataLoader`` keyword arguments for ``MyDataSet`` batches: the workers stay alive
    between epochs, so an epoch does not start by waiting for them, and ignore stop signals, so
    a stopping run still gets the batches of its last step; batches are pinned for a GPU. Each
    ``iter()`` draws the workers' seeds from a generator of its own, not dropout's RNG."""
    kwargs: dict[str, Any] = dict(num_workers=workers, collate_fn=MyDataSet.collate_fn,
                                  pin_memory=device.type == "cuda",
                                  generator=torch.Generator().manual_seed(torch.initial_seed()))
    if workers > 0:  # DataLoader refuses these without workers
        kwargs.update(persistent_workers=True, prefetch_factor=PREFETCH_FACTOR,
                      timeout=LOADER_TIMEOUT_S, worker_init_fn=workers_ignore_stop_signals())
    return kwargs
