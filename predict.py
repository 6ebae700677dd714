"""Classify images with weights written by the training script (docs/evaluate-and-predict.md)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from model import check_model, classifier_name, get_model
from multi_train_utils.checkpoint_io import extract_state_dict, load_file, save_atomic
from multi_train_utils.distributed_utils import pick_device
from multi_train_utils.guard import UserError
from multi_train_utils.train_eval_utils import prepare_images
from my_dataset import check_image, load_image_tensor, printable_path
from augment import get_transforms
from flags import HelpFormatter, path_flag, positive_int
from image_folder import IMG_EXTENSIONS

DEFAULT_MODEL = "resnet34"
DEFAULT_IMG_SIZE = 224
Preprocess = Callable[[Tensor], Tensor]  # uint8 (3, H, W) -> uint8 (3, crop, crop)


@dataclass(frozen=True)
class Prediction:
    """One image's result: ``probs`` is the softmax ``(num_classes,)``, ``top_k`` the best
    ``(class, probability)`` pairs; an unreadable image has neither, and ``error`` says why."""

    path: Path
    probs: Tensor | None
    top_k: list[tuple[str, float]]
    error: str | None = None


def run_file(weights: Path, name: str) -> Path | None:
    """``name`` beside ``weights`` or one folder up (training's output dir, above
    ``weights/model-N.pth``)."""
    folder = weights.absolute().parent  # "model-1.pth" alone: its folder is the working dir
    return next((f / name for f in (folder, folder.parent) if (f / name).is_file()), None)


def load_class_names(path: Path) -> list[str]:
    """``class_indices.json`` (``{"0": "daisy", "1": "dandelion", ...}``) as a list by index."""
    try:  # a gap would shift every label after it: a KeyError
        data = json.loads(path.read_text(encoding="utf-8"))
        return [str(data[str(i)]) for i in range(len(data))]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"cannot read class indices {path} ({type(exc).__name__}: {exc}); it must "
                        'map the indices 0..N-1 to class names, like {"0": "daisy"}.') from None


def build_model(name: str, state_dict: dict[str, Tensor], num_classes: int,
                img_size: int | None = None) -> nn.Module:
    """``name`` (a ViT: for ``img_size`` crops) with ``state_dict`` loaded, in eval mode."""
    model = get_model(name, num_classes=num_classes, img_size=img_size)
    head = classifier_name(model)  # its last weight: the logits layer's, (num_classes, ...)
    last = [k for k in model.state_dict() if k.startswith(f"{head}.") and k.endswith("weight")]
    got = state_dict.get(last[-1])
    if got is not None and got.shape[0] != num_classes:
        raise UserError(f"the class list has {num_classes} classes but the weights were trained "
                        f"for {got.shape[0]}; pass the class_indices.json of the same training "
                        "run.")
    try:
        model.load_state_dict(state_dict)
    except RuntimeError:  # torch's message lists every key; the fix is one flag
        raise UserError(f"the weights do not fit --model {name}; pass the architecture they were "
                        "trained with.") from None
    return model.eval()


def load_predictor(weights: Path | str, *, model: str | None = None, img_size: int | None = None,
                   class_indices: Path | str | None = None
                   ) -> tuple[nn.Module, list[str], Preprocess]:
    """``(model in eval mode on the CPU, class names, the run's validation preprocessing)`` for
    ``weights``; the keyword arguments override what the checkpoint or the run's files record."""
    weights = Path(weights)
    obj = load_file(weights)  # CPU, weights_only=True: a file from elsewhere cannot run code
    state_dict = extract_state_dict(obj, weights)  # obj is a dict, or this raised
    recorded, classes = obj.get("args"), obj.get("classes")  # none in bare weights: run_file
    if recorded is None and (found := run_file(weights, "args.json")):
        try:
            recorded = json.loads(found.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # damaged: as if there were none
            pass
    recorded = recorded if isinstance(recorded, dict) else {}
    if class_indices or not classes:
        found = class_indices or run_file(weights, "class_indices.json")
        if found is None:
            raise UserError(f"no class names: {weights} holds none and there is no "
                            "class_indices.json beside it or one folder up; pass --class-indices.")
        classes = load_class_names(Path(found))
    # `or`, not a .get default: args.json holds null for options left unset.
    name = model or recorded.get("model") or DEFAULT_MODEL
    trained = int(recorded.get("img_size") or img_size or DEFAULT_IMG_SIZE)  # the size a ViT fits
    net = build_model(name, state_dict, len(classes), trained)
    if not (img_size or recorded.get("img_size")):
        # A model trained at 32 px and fed 224 px crops still answers, with wrong classes.
        print(f"warning: no image size recorded for {weights}; assuming {DEFAULT_IMG_SIZE} px: "
              "pass the --img-size used in training.", file=sys.stderr)
    sizes = {} if img_size else {k: recorded.get(k) for k in ("val_resize_size", "val_crop_size")}
    check_model(name, trained, crops={"--img-size": img_size or sizes["val_crop_size"] or trained})
    return net, list(classes), get_transforms(
        img_size or trained, interpolation=recorded.get("interpolation") or "bilinear",
        **sizes)["val"]


def collect_images(inputs: Sequence[Path | str]) -> list[Path]:
    """Files as given (a missing one is reported per image, so one typo stops nothing), folders
    as the image files below them, sorted; hidden files and folders skipped."""
    paths: list[Path] = []
    for given in map(Path, inputs):
        if not given.is_dir():
            paths.append(given)
            continue
        paths += sorted(p for p in given.rglob("*")
                        if p.suffix.lower() in IMG_EXTENSIONS and p.is_file()
                        and not any(part.startswith(".") for part in p.relative_to(given).parts))
    return list(dict.fromkeys(paths))  # a file named and also inside a named folder: once


@torch.inference_mode()
def predict(model: nn.Module, paths: Sequence[Path], classes: Sequence[str],
            preprocess: Preprocess, device: torch.device, top_k: int = 5,
            batch_size: int = 32) -> Iterator[Prediction]:
    """One :class:`Prediction` per path, in order, batch by batch (so output can start early)."""
    model.eval().to(device)  # eval: BatchNorm uses its running statistics, not the batch's
    for start in range(0, len(paths), batch_size):
        chunk, images, errors = paths[start:start + batch_size], [], {}
        for path in chunk:
            try:  # the header check first, as in training's scan: it refuses what the decoder
                # would hang on (a FIFO) or decode in full (a decompression bomb)
                if why := check_image(str(path)):
                    raise OSError(why)
                images.append(preprocess(load_image_tensor(str(path))))
            except Exception as exc:  # decoders of untrusted files raise many types
                errors[path] = str(exc) or type(exc).__name__
        batch = prepare_images(torch.stack(images), device) if images else None
        rows = iter(model(batch).float().softmax(dim=1).cpu() if images else [])
        for path in chunk:
            if path in errors:
                yield Prediction(path, None, [], errors[path])
                continue
            probs = next(rows)
            values, indices = probs.topk(min(top_k, len(classes)))
            top = [(classes[i], p) for i, p in zip(indices.tolist(), values.tolist())]
            yield Prediction(path, probs, top)


def format_prediction(pred: Prediction) -> str:
    """``path<TAB>class: 0.912<TAB>class: 0.051 ...`` (a tab or line break in a name: ``\\t``)."""
    pairs = (f"{printable_path(name)}: {prob:.3f}" for name, prob in pred.top_k)
    return "\t".join([printable_path(pred.path), *pairs])


def main(args: argparse.Namespace) -> None:
    try:
        device = pick_device(args.device)  # a mistake: one error line, as in training
        paths = collect_images(args.images)
        if not (paths or args.export):
            raise UserError("no image files found; name image files or folders, or --export.")
        model, classes, preprocess = load_predictor(args.weights, model=args.model,
                                                    img_size=args.img_size,
                                                    class_indices=args.class_indices)
        if args.export:  # from any checkpoint, sharded (fsdp) or not: torchvision's format
            save_atomic(model.state_dict(), args.export)
            return print(f"wrote {args.export}: the model of {args.weights}, as a state dict")
    except UserError as exc:  # CheckpointError too: a missing, damaged or foreign file
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    failed = 0
    for pred in predict(model, paths, classes, preprocess, device, args.top_k, args.batch_size):
        if pred.error is None:
            print(format_prediction(pred), flush=True)
        else:
            failed += 1
            print(f"cannot read {printable_path(pred.path)}: {pred.error}", file=sys.stderr)
    if failed:
        print(f"error: {failed} of {len(paths)} images could not be read.", file=sys.stderr)
        sys.exit(1)


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Classify images with a trained checkpoint.",
                                     add_help=add_help, formatter_class=HelpFormatter)
    parser.add_argument("images", nargs="*", type=path_flag, metavar="IMAGE",
                        help="image files, or folders searched recursively for image files")
    group = parser.add_argument_group("model")
    group.add_argument("--weights", type=path_flag, required=True, metavar="PATH",
                       help="checkpoint.pth / model_best.pth, or bare weights/model-N.pth")
    group.add_argument("--class-indices", type=path_flag, metavar="PATH",
                       help="JSON index -> class name (default: the checkpoint's, else "
                            "class_indices.json beside --weights or one folder up)")
    group.add_argument("--model", help=f"architecture (default: training's, else {DEFAULT_MODEL})")
    group.add_argument("--export", type=path_flag, metavar="FILE",
                       help="write the weights to FILE as a state dict instead of predicting")
    group.add_argument("--img-size", type=positive_int,
                       help=f"crop size (default: training's, else {DEFAULT_IMG_SIZE})")
    group = parser.add_argument_group("inference")
    group.add_argument("--top-k", type=positive_int, default=5, help="classes printed per image")
    group.add_argument("--device", default="auto",
                       help="auto (CUDA if available), cpu, cuda or cuda:N")
    group.add_argument("--batch-size", type=positive_int, default=32, help="images per forward")
    return parser


if __name__ == "__main__":
    if hasattr(signal, "SIGPIPE"):  # `predict.py photos/ | head -1`: end quietly, as cat does
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main(get_args_parser().parse_args())
