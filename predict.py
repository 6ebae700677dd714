"""Classify images with a checkpoint written by the training script.

Give it any checkpoint the training run left behind::

    # full checkpoint: the class names, architecture and image size are all read from it
    python predict.py --weights runs/train/model_best.pth tulip.jpg

    # bare per-epoch state dict: class names come from the run's class_indices.json, architecture
    # and image size from its args.json; folders mean "every image below" (hidden ones skipped)
    python predict.py --weights runs/train/weights/model-29.pth photos/ more.png

A full checkpoint (``checkpoint.pth``, ``model_best.pth``) carries the class list it was trained
on, so it works copied anywhere on its own. Bare weights need ``--class-indices``, which may be
left out when ``class_indices.json`` sits next to the weights file or one folder above it (the
layout training writes); they find the run's ``args.json`` the same way, and
``--model``/``--img-size`` given on the command line always win (with a warning when they differ
from the recorded ones; with nothing recorded the image size is assumed 224 px, also with a
warning). Folders leave out files with extensions training does not read, saying how many, and
quoted glob patterns (``'photos/000*.jpg'``) are expanded. Each image prints
one line on stdout, tab-separated: the path, then the top-k ``class: probability`` pairs. An
image that cannot be read (or a dangling symlink) is reported on stderr and the rest are still
predicted; the exit code is then 1 (so is a missing image path or a pattern that matches nothing:
one typo does not stop the rest). When the reader of stdout quits early (``| head -1``), the
exit code is 141, as for ``cat``.
Mistakes in the other arguments (a missing weights or class-indices file, a class list that does
not fit the checkpoint or disagrees with the one inside it) exit with code 2.

From Python::

    from predict import load_checkpoint_with_classes, build_model, predict

    state_dict, train_args, class_names = load_checkpoint_with_classes("runs/train/model_best.pth")
    # bare weights: class_names is None; use load_class_names("runs/train/class_indices.json")
    model = build_model(train_args.get("model", "resnet34"), state_dict, len(class_names))
    for p in predict(model, ["tulip.jpg"], class_names, img_size=224, device="cpu", top_k=3):
        print(p.path, p.top_k)
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor, nn
from torchvision.transforms import v2

from model import MODELS
from multi_train_utils.checkpoint import CheckpointError, extract_state_dict, load_file
from my_dataset import check_image, load_image_tensor, printable_path
from utils import (IMAGENET_MEAN, IMAGENET_STD, IMG_EXTENSIONS, find_run_file, get_transforms,
                   path_flag, run_args_near, user_path)

log = logging.getLogger(__name__)

# Used only when neither the command line nor the checkpoint's recorded args say otherwise.
DEFAULT_MODEL = "resnet34"
DEFAULT_IMG_SIZE = 224


class UsageError(Exception):
    """A mistake in the inputs the user gave; the message says what and how to fix it."""


@dataclass(frozen=True)
class Prediction:
    """The result for one image.

    ``probs`` is the softmax over all classes, shape ``(num_classes,)``, on the CPU; ``top_k`` is
    the best ``(class_name, probability)`` pairs, most likely first. When the image could not be
    read, ``probs`` is ``None``, ``top_k`` is empty and ``error`` says why.
    """

    path: Path
    probs: Tensor | None
    top_k: list[tuple[str, float]]
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def build_transform(img_size: int) -> v2.Compose:
    """Validation preprocessing: ``uint8 (3, H, W)`` -> normalised ``float32 (3, img_size, img_size)``.

    Reuses training's own validation transform (shorter side to ``img_size * 256 / 224``, centre
    crop) and its normalisation, so predictions see exactly what the validation accuracy saw;
    even a different resize implementation shifts pixels enough to move borderline predictions.
    """
    return v2.Compose(
        [
            get_transforms(img_size)["val"],
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def load_image(path: str | Path) -> Tensor:
    """Decode an image file as upright RGB, ``uint8 (3, H, W)``, with the training decoder.

    EXIF orientation is applied (phone photos are often stored sideways), and grayscale, palette
    and RGBA images become 3-channel RGB. Raises on files that cannot be decoded.
    """
    return load_image_tensor(str(path))


def load_class_names(path: str | Path) -> list[str]:
    """Read ``class_indices.json`` (``{"0": "daisy", "1": "dandelion", ...}``) into a list by index."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(
            f"Class-indices file {path} does not exist; pass the class_indices.json written by training."
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"Cannot read class-indices file {path} as JSON ({exc}).") from None

    if isinstance(data, list) and data and all(isinstance(name, str) for name in data):
        names = list(data)
    else:
        expected = [str(i) for i in range(len(data))] if isinstance(data, dict) else []
        if not expected or sorted(data, key=lambda k: (len(k), k)) != expected:
            raise UsageError(
                f"Class-indices file {path} must map the indices 0..N-1 (as strings) to class "
                'names, like {"0": "daisy", "1": "dandelion"}.'
            )
        names = [str(data[key]) for key in expected]
    if not all(names) or len(set(names)) < len(names):  # two outputs would print one label
        raise UsageError(f"Class-indices file {path} gives a class an empty name or names one "
                         "twice; pass the class_indices.json written by training.")
    return names


def load_checkpoint(path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Load weights saved by training, returning ``(state_dict, train_args)``.

    Accepts a full checkpoint (``{"model": state_dict, "args": {...}, ...}``) or a bare state
    dict; ``train_args`` is ``{}`` for the latter. Loads with ``weights_only=True`` so a file from
    an untrusted source cannot run code. :func:`load_checkpoint_with_classes` also returns the
    class names a full checkpoint carries.
    """
    state_dict, train_args, _ = load_checkpoint_with_classes(path)
    return state_dict, train_args


def load_checkpoint_with_classes(
    path: str | Path,
) -> tuple[dict[str, Tensor], dict[str, Any], list[str] | None]:
    """Like :func:`load_checkpoint`, returning ``(state_dict, train_args, class_names)``.

    ``class_names`` is the checkpoint's ``"classes"`` entry (names in label order), or ``None`` for
    a bare state dict or a checkpoint saved without one.
    """
    path = Path(path)
    if path.is_dir():
        # Users often pass training's --output-dir; name the file they most likely meant.
        inside = [path / name for name in ("model_best.pth", "checkpoint.pth") if (path / name).is_file()]
        hint = f"pass --weights {inside[0]}" if inside else (
            "pass a checkpoint.pth, model_best.pth or weights/model-<epoch>.pth file written by training"
        )
        raise UsageError(f"Weights path {path} is a directory, not a file; {hint}.")
    if not path.is_file():
        raise UsageError(
            f"Weights file {path} does not exist; pass a checkpoint.pth, model_best.pth or "
            "weights/model-<epoch>.pth written by training."
        )
    try:  # training's loader: CPU, weights_only, and a CRC check torch.load itself skips
        obj = load_file(path)
    except CheckpointError as exc:
        raise UsageError(f"Weights file {exc}") from None

    classes, train_args = None, {}
    if isinstance(obj, Mapping) and isinstance(obj.get("model"), Mapping):  # our checkpoint
        train_args, classes = obj.get("args"), obj.get("classes")
        train_args = dict(train_args) if isinstance(train_args, Mapping) else {}
        if classes is not None and not (
            isinstance(classes, (list, tuple)) and classes and all(isinstance(c, str) for c in classes)
        ):
            log.warning("Ignoring the 'classes' entry of %s, which is not a list of class names.", path)
            classes = None
    # The state dict as training's --weights reads it: inside a checkpoint (ours, the PyTorch
    # tutorial's) or bare, without the prefixes DDP ("module.") and torch.compile ("_orig_mod.")
    # add, in any order; ours never have them (saved unwrapped).
    try:
        state_dict = extract_state_dict(obj, path)
    except CheckpointError as exc:
        raise UsageError(f"Weights file {exc}") from None
    return state_dict, train_args, None if classes is None else list(classes)


def build_model(model_name: str, state_dict: Mapping[str, Tensor], num_classes: int) -> nn.Module:
    """Build ``model_name`` with ``num_classes`` outputs and load ``state_dict`` into it (strict).

    The returned model is in eval mode on the CPU: ``(N, 3, H, W) -> (N, num_classes)`` logits.
    """
    if model_name not in MODELS:
        raise UsageError(f"Unknown model {model_name!r}; pass --model with one of: {', '.join(MODELS)}.")
    fc_weight = state_dict.get("fc.weight")
    if fc_weight is None:
        raise UsageError("The weights have no fc.weight, the classifier of this template's "
                         "ResNets (weights of another architecture, or a backbone saved without "
                         "its head), so they cannot predict classes; train a head for them "
                         "first (the training script's --weights).")
    if fc_weight.shape[0] != num_classes:
        raise UsageError(
            f"The class-indices file lists {num_classes} classes but the weights were trained for "
            f"{fc_weight.shape[0]}; pass the class_indices.json written by the same training run."
        )
    model = MODELS[model_name](num_classes=num_classes)
    try:
        model.load_state_dict(state_dict, strict=True)
    except RuntimeError:
        # The full PyTorch message lists every mismatched key; one sentence is more useful here.
        raise UsageError(
            f"The weights do not fit architecture {model_name}; pass --model with the architecture "
            "they were trained with."
        ) from None
    return model.eval()


def resolve_device(name: str) -> torch.device:
    """``"auto"`` picks CUDA when available, else the CPU; anything else is a torch device string."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"Unknown device {name!r}; use auto, cpu, cuda or cuda:<index>.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name} was requested but CUDA is not available; use --device cpu.")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: only {torch.cuda.device_count()} GPU(s) are visible "
                         f"(cuda:0 to cuda:{torch.cuda.device_count() - 1}).")
    return device


def _walk_images(folder: Path) -> tuple[list[Path], list[Path]]:
    """``(images, others)`` anywhere below ``folder``, sorted; hidden files and folders are left out.

    Mirrors training's folder scan (``utils.scan_image_folder``), so a dataset root predicts the
    images training would use: ``._name.jpg`` AppleDouble files and ``.git``-style folders are not
    images, and ``others`` are the files whose extension is not in ``IMG_EXTENSIONS`` (.heic,
    .jp2, none), which training skips too. Symlinked folders are followed once (their real path
    is remembered), so a link back up the tree cannot loop. Dangling symlinks and FIFOs are kept,
    so they are reported like unreadable images.
    """
    found: list[Path] = []
    others: list[Path] = []
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            path = Path(dirpath, name)
            if name.startswith("."):
                continue
            if path.suffix.lower() not in IMG_EXTENSIONS:
                others.append(path)
            else:  # a FIFO or a dangling link too: reported per image, not dropped unsaid
                found.append(path)
    return sorted(found), sorted(others)


def _left_out(others: Sequence[Path]) -> str:
    """``"left out 3 files ... (2 .heic, 1 without extension); ..."`` for a folder's ``others``."""
    counts = Counter(p.suffix.lower() or "without extension" for p in others)
    kinds = ", ".join(f"{n} {suffix}" for suffix, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return (f"left out {len(others)} file{'s' if len(others) != 1 else ''} whose extension training "
            f"does not read ({kinds}); name a file explicitly to classify it anyway")


def collect_images(inputs: Sequence[str | Path]) -> list[Path]:
    """Expand patterns into their matches and folders into the image files anywhere below them
    (both sorted); keep files as given, each once.

    Files named explicitly are kept whatever their name or extension (and even if missing): they
    are reported per image later, so one typo does not stop the rest of the batch. So is a
    pattern that matches nothing. A folder's files with other extensions are left out, as
    training leaves them out, with one warning per folder.
    """
    paths: list[Path] = []
    for raw in inputs:
        raw = user_path(str(raw))  # as the shell would have, had the path not been quoted
        matches = [Path(raw)]
        # A quoted pattern ('photos/000*.jpg') reaches us unexpanded, as it does from shells that
        # never expand (Windows cmd); a file whose name really holds * or [ is still itself.
        if glob.has_magic(str(raw)) and not os.path.lexists(raw):
            matches = [Path(p) for p in sorted(glob.glob(str(raw), recursive=True))] or matches
        for path in matches:
            if not path.is_dir():
                paths.append(path)
                continue
            found, others = _walk_images(path)
            if not found:
                extra = f"; {_left_out(others)}" if others else ""
                log.warning("Folder %s contains no image files (%s)%s.", path, ", ".join(IMG_EXTENSIONS), extra)
            elif others:
                log.warning("Folder %s: %s.", path, _left_out(others))
            paths.extend(found)
    # A file named and also inside a named folder (or matched twice) is predicted once.
    first: dict[str, Path] = {}
    for path in paths:
        first.setdefault(os.path.abspath(path), path)
    return list(first.values())


@torch.inference_mode()
def iter_predictions(
    model: nn.Module,
    image_paths: Sequence[str | Path],
    class_names: Sequence[str],
    img_size: int,
    device: str | torch.device,
    top_k: int = 5,
    batch_size: int = 32,
) -> Iterator[Prediction]:
    """Like :func:`predict`, but yields results batch by batch, so output can start early."""
    if top_k < 1 or batch_size < 1:
        raise ValueError(f"top_k and batch_size must be positive, got top_k={top_k}, batch_size={batch_size}.")
    k = min(top_k, len(class_names))
    transform = build_transform(img_size)
    # Eval mode matters: BatchNorm must use its running statistics, not the batch's.
    model.eval().to(device)

    paths = [Path(p) for p in image_paths]
    for start in range(0, len(paths), batch_size):
        chunk = paths[start : start + batch_size]
        results: list[Prediction | None] = [None] * len(chunk)
        tensors: list[Tensor] = []
        slots: list[int] = []
        for i, path in enumerate(chunk):
            try:
                # Training's up-front check first: a FIFO would block the read, and a
                # decompression bomb (over PIL's limit) would be decoded in full.
                with warnings.catch_warnings():  # a photo under PIL's limit: no warning
                    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                    why = check_image(str(path)) if os.path.lexists(path) else None
                if why:
                    raise OSError(why)
                tensors.append(transform(load_image(path)))
                slots.append(i)
            except Exception as exc:  # decoders of untrusted files raise many types (OSError, SyntaxError, ...)
                results[i] = Prediction(path, None, [], _read_error(path, exc))
        if tensors:
            logits = model(torch.stack(tensors).to(device))  # (B, 3, S, S) -> (B, C)
            if logits.shape[1] != len(class_names):
                raise ValueError(
                    f"The model has {logits.shape[1]} outputs but {len(class_names)} class names were given."
                )
            probs = logits.float().softmax(dim=1).cpu()
            top_probs, top_idx = probs.topk(k, dim=1)
            for row, i in enumerate(slots):
                pairs = [(class_names[j], p) for j, p in zip(top_idx[row].tolist(), top_probs[row].tolist())]
                results[i] = Prediction(chunk[i], probs[row], pairs)
        yield from (r for r in results if r is not None)


def _read_error(path: Path, exc: Exception) -> str:
    """One sentence on why ``path`` gave no image, worded like training's scan where it can be."""
    if path.is_symlink() and not path.exists():  # "No such file" alone would puzzle: the link is there
        return f"Cannot read image {path}: dangling symlink to {os.readlink(path)}"
    if not os.path.lexists(path):
        if glob.has_magic(str(path)):  # left unexpanded by collect_images
            return f"No file matches the pattern {path}; check the folder and the pattern."
        return f"Cannot read image {path}: {exc}"
    # check_image is what training's scan reports ("empty file", "image has no pixels", ...); it
    # finds nothing wrong with a file whose damage is past the header, and then the decoder's
    # own message is the best there is.
    return f"Cannot read image {path}: {check_image(str(path)) or exc}"


def predict(
    model: nn.Module,
    image_paths: Sequence[str | Path],
    class_names: Sequence[str],
    img_size: int,
    device: str | torch.device,
    top_k: int = 5,
    batch_size: int = 32,
) -> list[Prediction]:
    """Classify image files, one :class:`Prediction` per path, in the order given.

    Each image goes through :func:`build_transform`, so ``model`` sees ``(N, 3, img_size, img_size)``
    and must return ``(N, len(class_names))`` logits. The model is switched to eval mode and moved
    to ``device``. Unreadable images get a :class:`Prediction` with ``error`` set instead of raising.
    """
    return list(iter_predictions(model, image_paths, class_names, img_size, device, top_k, batch_size))


def format_prediction(pred: Prediction) -> str:
    """``path<TAB>class: 0.912<TAB>class: 0.051 ...`` (tabs, since paths and names may hold spaces;
    a tab or line break inside one is written ``\\t``/``\\n``, bytes that are not UTF-8 ``\\xff``)."""
    return "\t".join([printable_path(pred.path),
                      *(f"{printable_path(name)}: {prob:.3f}" for name, prob in pred.top_k)])


def _default_class_indices(weights: Path) -> Path:
    found = find_run_file(weights, "class_indices.json")
    if found is None:
        raise UsageError(
            f"No --class-indices given and no class_indices.json next to {weights} or one folder above; "
            "pass --class-indices."
        )
    return found


def resolve_class_names(
    weights: str | Path, class_indices: str | Path | None, checkpoint_classes: Sequence[str] | None
) -> list[str]:
    """The class names by label index: the checkpoint's own list when it has one, else the file's.

    ``class_indices`` (or, when ``None``, a ``class_indices.json`` next to ``weights`` or one
    folder up) is required for bare weights. With a checkpoint list it is optional, but one that
    is there must list the same names in the same order: a disagreeing list means files of two
    runs got mixed up, and the user should hear which labels they were about to trust.
    """
    weights = Path(weights)
    if checkpoint_classes is None:
        return load_class_names(class_indices or _default_class_indices(weights))
    classes = list(checkpoint_classes)
    path = Path(class_indices) if class_indices else find_run_file(weights, "class_indices.json")
    if path is None:
        return classes
    names = load_class_names(path)
    if names == classes:
        return classes

    if len(names) != len(classes):
        what = f"lists {len(names)} classes but checkpoint {weights} was trained on {len(classes)}"
    else:
        i = next(i for i, (a, b) in enumerate(zip(names, classes)) if a != b)
        how = "the classes in another order" if sorted(names) == sorted(classes) else "other classes"
        what = (f"lists {how} than checkpoint {weights} (class {i} is {names[i]!r} there, "
                f"{classes[i]!r} in the checkpoint)")
    if class_indices:
        fix = "drop --class-indices: without it the checkpoint's own class list is used"
    else:  # found next to the weights, not given: the folder mixes files of two runs
        fix = ("it seems to belong to another run: move it out of that folder and the "
               "checkpoint's own class list is used")
    raise UsageError(f"{path} {what}; {fix}.")


def _run_args_near(weights: Path) -> tuple[dict[str, Any], Path | None]:
    """The training run's ``args.json`` next to ``weights`` or one folder up and its path, else ``({}, None)``.

    Bare state dicts carry no args, but the run's folder records its model and img_size; without
    them a resnet18 trained at 64 px would be rebuilt as the default resnet34 at 224 px.
    """
    run_args, path = run_args_near(weights)
    if path is not None:
        log.info("Bare weights: using the model and img-size recorded in %s unless given.", path)
    return run_args, path


def _setting(flag: str, given: Any, recorded: Any, source: Path | str) -> Any:
    """``given`` (a command-line value) if set, else ``recorded`` (training's); a disagreement is
    worth a warning, since predictions at another size or architecture than trained are off."""
    if given is not None and recorded is not None and given != recorded:
        log.warning("%s %s differs from the %s recorded in %s; using %s (leave the flag out to use "
                    "the training value).", flag, given, recorded, source, given)
    return given if given is not None else recorded


def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    if hasattr(sys.stdout, "reconfigure"):  # an ASCII locale (LC_ALL=C): escape, as stderr does
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        device = resolve_device(args.device)
        state_dict, train_args, checkpoint_classes = load_checkpoint_with_classes(args.weights)
        source: Path | str | None = f"checkpoint {args.weights}"
        if not train_args:
            train_args, source = _run_args_near(args.weights)
        class_names = resolve_class_names(args.weights, args.class_indices, checkpoint_classes)
        # `or None`, not a .get default: args.json-style records hold null for unset options.
        recorded_model = train_args.get("model") or None
        recorded_size = int(train_args["img_size"]) if train_args.get("img_size") else None
        model_name = str(_setting("--model", args.model, recorded_model, source) or DEFAULT_MODEL)
        model = build_model(model_name, state_dict, len(class_names))
        image_paths = collect_images(args.images)
        if not image_paths:
            raise UsageError("No images to predict; pass image files or folders that contain some.")
    except UsageError as exc:
        log.error("%s", exc)
        sys.exit(2)

    img_size = _setting("--img-size", args.img_size, recorded_size, source)
    if img_size is None:
        # A model trained at 32 px and fed 224 px crops still answers, with wrong classes.
        log.warning("No image size is recorded in %s or in an args.json next to it or one folder up; "
                    "assuming %d px: pass the --img-size used in training.", args.weights, DEFAULT_IMG_SIZE)
        img_size = DEFAULT_IMG_SIZE
    log.info("%s, %d classes, img-size %d, on %s", model_name, len(class_names), img_size, device)
    failed = 0
    try:
        for pred in iter_predictions(model, image_paths, class_names, img_size, device, args.top_k, args.batch_size):
            if pred.ok:
                print(format_prediction(pred), flush=True)
            else:
                failed += 1
                log.error("%s", pred.error)
    except BrokenPipeError:
        # The reader has quit (`predict.py photos/ | head -1`): stop quietly, as cat or grep do.
        # 141 (128 + SIGPIPE) is the status the shell shows for them, so `set -o pipefail` scripts
        # treat us alike; 1 would claim unreadable images. stdout goes to devnull so that Python's
        # final flush does not fail again (docs.python.org/3/library/signal.html#note-on-sigpipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    if failed:
        log.error("%d of %d images could not be read.", failed, len(image_paths))
        sys.exit(1)


def _path(text: str) -> Path:
    return Path(path_flag(text))  # "~/x" arrives unexpanded when quoted or written --weights=~/x


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except "(default: None)": those flags explain their fallback in the help text."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Classify images with a trained checkpoint.",
        formatter_class=_HelpFormatter,
        add_help=add_help,
    )
    parser.add_argument(
        "images",
        nargs="+",
        type=path_flag,  # "" would be the current folder, searched recursively
        metavar="IMAGE",
        help="image files, folders searched recursively for image files (hidden ones skipped), or quoted glob patterns",
    )

    group = parser.add_argument_group("model")
    group.add_argument(
        "--weights", type=_path, required=True, metavar="PATH", help="checkpoint.pth / model_best.pth, or a bare state dict"
    )
    group.add_argument(
        "--class-indices",
        type=_path,
        metavar="PATH",
        default=None,
        help="JSON mapping index -> class name, for bare weights (full checkpoints carry their own list); "
        "default: class_indices.json next to --weights or one folder up",
    )
    group.add_argument(
        "--model",
        choices=list(MODELS),
        default=None,
        help=f"architecture; default: the one recorded in the checkpoint or the run's args.json, else {DEFAULT_MODEL}",
    )
    group.add_argument(
        "--img-size",
        type=_positive_int,
        default=None,
        help=f"crop size; default: the one recorded in the checkpoint or the run's args.json, else {DEFAULT_IMG_SIZE}",
    )

    group = parser.add_argument_group("inference")
    group.add_argument(
        "--top-k", type=_positive_int, default=5, help="classes printed per image (capped at the class count)"
    )
    group.add_argument("--device", default="auto", help="auto (CUDA if available, else CPU), cpu, cuda, cuda:1, ...")
    group.add_argument("--batch-size", type=_positive_int, default=32, help="images per forward pass")
    return parser


if __name__ == "__main__":
    main(get_args_parser().parse_args())
