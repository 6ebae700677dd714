"""``MyDataSet``: a list of image files and labels, read robustly.

Two decoders:

- ``decoder="tensor"`` (what the training scripts use): bytes are decoded by ``torchvision.io``
  into ``uint8 (3, H, W)`` and augmented by ``transforms.v2`` on uint8; normalisation happens later
  on the device. About 2x the template's PIL throughput per worker (``benchmark.py``; README,
  "Speed").
- ``decoder="pil"`` (the classic template's contract): ``transform`` receives an RGB PIL image.

Either way EXIF orientation is applied, grayscale/palette/RGBA/CMYK/16-bit and 32-bit int/float
(TIFF) become 8-bit RGB, and a file that cannot be decoded does not crash the DataLoader worker:
it is reported (a warning from each rank that meets it, and, with ``skip_log``, one line in the
run's ``skipped_files.txt``) and replaced by a readable sample of its class (training) or by a
black image with label ``-100``, which ``nn.CrossEntropyLoss`` and our ``evaluate`` ignore.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import Dataset, default_collate, get_worker_info
try:  # deprecated in torchvision 0.29 in favour of TorchCodec: once removed, PIL decodes
    from torchvision.io import ImageReadMode, decode_image, read_file
except ImportError:  # pragma: no cover - depends on the installed torchvision
    decode_image = None
from torchvision.transforms.v2 import functional as TF

from multi_train_utils.train_eval_utils import IGNORE_INDEX  # nn.CrossEntropyLoss's default

log = logging.getLogger(__name__)

# Unreadable images logged one by one per dataset copy (every rank); skip_log lists them all.
MAX_LOGGED_ERRORS = 20

_JPEG_END = b"\xff\xd9"
_PNG_END = b"IEND"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_GIF_SIGNATURE = b"GIF8"  # GIF87a, GIF89a


_LINE_BREAKERS = str.maketrans({"\t": "\\t", "\n": "\\n", "\r": "\\r"})


def printable_path(path: str | os.PathLike) -> str:
    """``path`` as one field of a line that encodes to UTF-8: bytes that are not valid UTF-8 on
    disk (which Python keeps as lone surrogates) are shown as ``\\xff`` escapes, and a tab or
    line break in a name as ``\\t``/``\\n``/``\\r``, so tab-separated listings stay parseable.
    Other paths are unchanged."""
    # Not os.fsencode: a class name from a checkpoint is text, which an ASCII file-system
    # encoding (LC_ALL=C with PYTHONUTF8=0) cannot encode.
    raw = os.fspath(path)
    data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogateescape")
    return data.decode("utf-8", "backslashreplace").translate(_LINE_BREAKERS)


def load_pil_image(path: str) -> Image.Image:
    """An 8-bit RGB PIL image with EXIF orientation applied; raises on undecodable files."""
    with warnings.catch_warnings():
        # Set before the open, which is what warns: the scan accepted the size (PIL warns from
        # half its bomb limit); a palette with transparency in bytes converts correctly anyway.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        warnings.filterwarnings("ignore", message="Palette images with Transparency")
        with Image.open(path) as img:
            return _to_rgb(img)


def _to_rgb(img: Image.Image) -> Image.Image:
    """``img`` as 8-bit RGB with EXIF orientation applied (inside the caller's warning filters)."""
    img = ImageOps.exif_transpose(img)
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N"):
        # 16-bit grayscale: convert("RGB") would clip at 255 -> white; scale to 8 bits instead.
        img = img.point(lambda v: v * (1 / 256)).convert("L")
    elif img.mode in ("I", "F"):
        # 32-bit int or float (e.g. scientific TIFF): convert("RGB") clips at 255, so [0, 1]
        # floats would train black. The value range says where white is.
        top = img.getextrema()[1]
        white = next((w for w in (1.0, 255.0, 65535.0) if top <= w), top)
        img = img.point(lambda v: v * (255 / white)).convert("L")
    return img.convert("RGB")


def _webp_with_exif(head: bytes) -> bool:
    """Whether a file starting with ``head`` (21+ bytes) is a WebP that carries EXIF data: the
    extended format's VP8X chunk has flag 0x08 set (Google's WebP container specification)."""
    return (len(head) > 20 and head[:4] == b"RIFF" and head[8:16] == b"WEBPVP8X"
            and bool(head[20] & 0x08))


def load_image_tensor(path: str) -> torch.Tensor:
    """``uint8 (3, H, W)`` RGB with EXIF orientation; falls back to PIL for what torchvision
    cannot decode (e.g. some TIFF/GIF variants); raises on undecodable files."""
    if decode_image is None:
        return TF.pil_to_tensor(load_pil_image(path))
    try:
        with open(path, "rb") as f:
            head = f.read(21)
        # PIL for PNG: torchvision's PNG decoder kills the process (SIGSEGV after libpng's
        # "IDAT: incorrect data check") on damaged compressed data, where PIL raises. That took
        # down a whole run, rerun after rerun: torchvision 0.29.1 crashed on 40 of 40 random
        # corruptions of a PNG, none of a JPEG, GIF or WebP (pytorch/vision#3613). And for a
        # WebP with EXIF: torchvision orients JPEG and PNG only. And for a GIF: torchvision
        # decodes every frame of an animated one to give the first (a 56 KB GIF of 300 frames
        # at 1000 x 1000 px took 858 MiB in each worker, each epoch); PIL reads only the first.
        if head.startswith((_PNG_SIGNATURE, _GIF_SIGNATURE)) or _webp_with_exif(head):
            return TF.pil_to_tensor(load_pil_image(path))
        data = read_file(path)
        img = decode_image(data, mode=ImageReadMode.RGB, apply_exif_orientation=True)
        if img.ndim == 4:  # frames (N, 3, H, W) of an animation: the first, as PIL gives
            img = img[0]
        if img.dtype != torch.uint8:  # 16-bit PNG
            img = TF.to_dtype(img, torch.uint8, scale=True)
        return img
    except (RuntimeError, ValueError):
        return TF.pil_to_tensor(load_pil_image(path))


def _lock(f: Any) -> None:
    """Hold an exclusive ``flock`` on ``f`` until it is closed (no-op where there is none)."""
    try:
        import fcntl

        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    except (ImportError, OSError):  # Windows, some network file systems: lines may repeat
        pass


def _machine_error(exc: BaseException) -> bool:
    """An error of this machine, not of the file being read: out of file descriptors."""
    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)


def check_image(path: str) -> str | None:
    """Why ``path`` is not a usable image (one short phrase), or None if it looks fine.

    Cheap: reads the header (PIL identifies the format without decoding) and, for JPEG/PNG, the
    last bytes - a file cut short lacks its end marker. Only files without one are decoded in
    full, so valid files with trailing padding are kept. Images above PIL's decompression-bomb
    limit (``Image.MAX_IMAGE_PIXELS`` x 2, about 179 megapixels) are refused as too large.
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the open forever
            return "not a regular file"
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            if size == 0:
                return "empty file"
            f.seek(max(0, size - 1024))
            tail = f.read()
        with Image.open(path) as img:
            fmt = img.format
            width, height = img.size
            if width < 1 or height < 1:
                return "image has no pixels"
            ends_ok = {"JPEG": _JPEG_END in tail, "PNG": _PNG_END in tail}.get(fmt, True)
            if not ends_ok:
                img.load()  # raises "image file is truncated" if it really is
        return None
    except FileNotFoundError:
        return "dangling link or missing file"
    except PermissionError:  # as an unreadable folder is reported, not as a damaged image
        return "permission denied"
    except Image.DecompressionBombError:
        return (f"image too large (over {2 * Image.MAX_IMAGE_PIXELS / 1e6:.0f} megapixels, PIL's "
                "decompression-bomb limit); downscale it")
    except (OSError, ValueError, SyntaxError) as exc:
        if _machine_error(exc):
            raise
        return f"not a readable image ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"


class PackedStrings(Sequence[str]):
    """A read-only list of strings held in two buffers instead of one Python object each.

    DataLoader workers are forked from the training process, and reading a Python ``str``
    updates its reference count, which copies its memory page into the worker: over an epoch
    every worker copies every path (pytorch/pytorch#13246; measured ~0.3 KB per path per
    worker, ~400 MB per worker for ImageNet's 1.28M). Bytes and offsets are never written.
    """

    def __init__(self, strings: Iterable[str]) -> None:
        encoded = [os.fsencode(s) for s in strings]  # exact for any file name (surrogateescape)
        self._data = b"".join(encoded)
        self._ends = np.cumsum([len(b) for b in encoded], dtype=np.int64)

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, index: int | slice) -> str | list[str]:  # as a list would
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = range(len(self))[index]  # negative indices and IndexError as for a list
        start = int(self._ends[i - 1]) if i else 0
        return os.fsdecode(self._data[start:int(self._ends[i])])

    def __repr__(self) -> str:
        return f"PackedStrings({len(self)} strings)"


class MyDataSet(Dataset):
    """Images and integer labels; item ``i`` -> ``(image, label)``.

    ``image`` is whatever ``transform`` makes of the decoded image (``uint8 (3, H, W)`` with the
    tensor decoder and no transform). With ``seed`` set, the random augmentation of sample ``i``
    in epoch ``e`` is a pure function of ``(seed, e, i)``: independent of worker count, worker
    restarts and world size, so a resumed run replays exactly what an uninterrupted one would.

    A sample that fails to decode is logged (``report_errors``) and, with ``skip_log``, appended
    to that file as ``"<path>\t<reason>\n"``, once per sample per dataset copy (all DataLoader
    workers of one process share the record; each rank has its own). In its place comes, with
    ``replace_unreadable`` (training), a readable sample of its class drawn at random (of any
    class if its class has none), else a black image labelled ``-100``, which the loss and
    ``evaluate`` ignore. A placeholder in a training batch still passes through BatchNorm and drags its
    statistics: with half the files unreadable, val loss after one epoch was 190-11,000 where
    it was under 1 without them.
    """

    def __init__(self, images_path: Sequence[str], images_class: Sequence[int],
                 transform: Callable[[Any], Any] | None = None, *, decoder: str = "pil",
                 seed: int | None = None, report_errors: bool = True,
                 skip_log: str | os.PathLike | None = None,
                 replace_unreadable: bool = False) -> None:
        if len(images_path) != len(images_class):
            raise ValueError(f"{len(images_path)} image paths but {len(images_class)} labels")
        if decoder not in ("pil", "tensor"):
            raise ValueError(f"decoder must be 'pil' or 'tensor', not {decoder!r}")
        # Compact, so forked DataLoader workers share them instead of copying (see PackedStrings).
        self.images_path = PackedStrings(images_path)
        self.images_class = np.asarray(images_class, dtype=np.int64)
        self.transform = transform
        self.decoder = decoder
        self.seed = seed
        self.report_errors = report_errors
        self.skip_log = skip_log
        self.replace_unreadable = replace_unreadable
        # Shared memory, so persistent DataLoader workers see set_epoch() from the main process.
        # Shared too: whichever worker meets a bad sample in whichever epoch, it is reported once;
        # and how many were logged: a folder of bad files must not flood the log.
        counters = (torch.zeros(1, dtype=torch.int64), torch.zeros(len(self.images_path),
                                                                   dtype=torch.bool),
                    torch.zeros(1, dtype=torch.int64))
        try:
            self._epoch, self._reported, self._logged = (t.share_memory_() for t in counters)
            self._unshared = None
        except RuntimeError as exc:  # /dev/shm read-only, absent or full: fine without workers
            self._epoch, self._reported, self._logged = counters
            self._unshared = str(exc)
        # This process's view of skip_log: the names read so far, and up to which byte.
        self._skip_names: set[bytes] = set()
        self._skip_read = 0

    def __len__(self) -> int:
        return len(self.images_path)

    def set_epoch(self, epoch: int) -> None:
        """Call before iterating each epoch (with ``seed``) so augmentations change per epoch."""
        self._epoch[0] = epoch

    def _load(self, path: str) -> Any:
        return load_image_tensor(path) if self.decoder == "tensor" else load_pil_image(path)

    def _placeholder(self) -> Any:
        return (torch.zeros(3, 8, 8, dtype=torch.uint8) if self.decoder == "tensor"
                else Image.new("RGB", (8, 8)))

    def __getitem__(self, item: int) -> tuple[Any, int]:
        if self._unshared and get_worker_info() is not None:
            # A worker would not see set_epoch(): the same augmentation every epoch, unsaid.
            raise RuntimeError(self._unshared)
        img, label = self._load_or_replace(item)
        if self.transform is not None:
            if self.seed is None:
                img = self.transform(img)
            else:
                sample_seed = (self.seed * 1_000_003 + int(self._epoch[0])) * 1_000_003 + item
                with torch.random.fork_rng(devices=[]):
                    # CPU generator only: torch.manual_seed would also queue seeds for CUDA.
                    torch.default_generator.manual_seed(sample_seed % (2**63))
                    img = self.transform(img)
        return img, label

    def _load_or_replace(self, item: int) -> tuple[Any, int]:
        """Sample ``item``'s image and label, or what stands in for it (see the class)."""
        for other in self._candidates(item):
            path = self.images_path[other]
            try:
                return self._load(path), int(self.images_class[other])
            except Exception as exc:  # any decoder failure: skip the sample, never kill the worker
                if _machine_error(exc):
                    raise  # not the file's fault: skipped, a good image would go as unreadable
                self._reported[other] = True
                self._report(path, exc)
        return self._placeholder(), IGNORE_INDEX

    def _candidates(self, item: int) -> Iterator[int]:
        """``item``, then (``replace_unreadable``) the samples of its class, then of any, in an
        order drawn from ``(seed, epoch, item)``, leaving out those known to be unreadable: the
        stand-in is the first readable one, whichever of the others were found unreadable
        before, so a resumed run replays it. Drawn, not the next in the list: unreadable files
        come in runs (a failed download), and one neighbour standing in for all of them trained
        as a tenth of the class. A failed read marks its file: an epoch reads each about once."""
        known = self._reported.numpy()  # a view of the shared flags, as workers set them
        if not known[item]:
            yield item
        if not self.replace_unreadable:
            return
        rng = np.random.default_rng([(self.seed or 0) % 2**63, int(self._epoch[0]), item])
        same = np.flatnonzero(self.images_class == self.images_class[item])
        for pool in (same, None):
            order = rng.permutation(pool if pool is not None else len(self))
            for start in range(0, len(order), 4096):  # a bad file need not sort a million
                window = order[start:start + 4096]
                for other in window[~known[window]]:
                    if not known[other]:  # marked by a failed read since the window was cut
                        yield int(other)

    def _report(self, path: str, exc: Exception) -> None:
        detail = str(exc).splitlines()[0][:120].replace("\t", " ") if str(exc) else ""
        if self.report_errors:
            self._logged += 1  # racy between workers: the limit is a guide, not a count
            logged = int(self._logged[0])
            if logged <= MAX_LOGGED_ERRORS:
                log.warning("skipping unreadable image %s (%s: %s)%s", printable_path(path),
                            type(exc).__name__, detail,
                            "; further ones are not logged one by one" +
                            (f", see {self.skip_log}" if self.skip_log else "")
                            if logged == MAX_LOGGED_ERRORS else "")
        if self.skip_log is not None:
            name = printable_path(path).encode("utf-8", "backslashreplace") + b"\t"
            line = name + (f"not a readable image at load time ({type(exc).__name__}: "
                           f"{detail})\n").encode("utf-8", "backslashreplace")
            # Every rank (and worker) has its own "reported" marks, and the shuffle hands a file
            # to other ranks in later epochs: the file itself, locked, says who was first. Each
            # process reads only what was appended since it last looked (a full reread per bad
            # file is quadratic: 16,000 of them took 23 s). One unbuffered write in append mode
            # lands whole even where flock is missing.
            try:
                with open(self.skip_log, "a+b", buffering=0) as f:
                    _lock(f)
                    size = f.seek(0, os.SEEK_END)
                    if size < self._skip_read:  # rewritten since: read it all again
                        self._skip_names.clear()
                        self._skip_read = 0
                    f.seek(self._skip_read)
                    new_lines = f.read(size - self._skip_read).splitlines()
                    self._skip_names.update(known.split(b"\t", 1)[0] + b"\t"
                                            for known in new_lines if b"\t" in known)
                    self._skip_read = size
                    if name not in self._skip_names:
                        f.write(line)
                        self._skip_names.add(name)
                        self._skip_read += len(line)
            except OSError as err:  # a full disk must not kill the worker; say so instead
                log.warning("could not record %s in %s (%s)", path, self.skip_log, err)

    @staticmethod
    def collate_fn(batch: Sequence[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[(image (3, H, W), label), ...]`` -> ``(images (N, 3, H, W), labels (N,) int64)``.

        In a DataLoader worker both are built in shared memory, as ``default_collate`` builds
        its tensors: a full ``/dev/shm`` (a container's default is 64 MB) then fails the batch
        in the worker, and the loader raises that in the training process. Built in private
        memory, they would be moved there by the worker queue's feeder thread, which only
        prints its error and drops the batch: training waited for it forever.
        """
        images, labels = tuple(zip(*batch))
        labels = torch.as_tensor(labels, dtype=torch.int64)
        if get_worker_info() is not None:
            labels.share_memory_()
        return default_collate(list(images)), labels
