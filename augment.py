"""The transforms: torchvision's ImageNet recipe, in the loader workers or on the device."""

from __future__ import annotations

from typing import Any

from torchvision.transforms import v2

from device_decode import BatchAugment
from multi_train_utils.guard import ConfigError
from multi_train_utils.train_eval_utils import IMAGENET_MEAN

AUTO_AUGMENT = ("ta_wide", "ra", "augmix", "imagenet", "cifar10", "svhn")  # torchvision's


def get_transforms(img_size: int, decode: str = "workers", *, auto_augment: str | None = None,
                   ra_magnitude: int = 9, augmix_severity: int = 3, random_erase: float = 0.0,
                   interpolation: str = "bilinear", val_resize_size: int | None = None,
                   val_crop_size: int | None = None) -> dict[str, Any]:
    """``{"train": ..., "val": ...}``, ``uint8 (3, H, W) -> uint8 (3, S, S)`` as torchvision's
    recipe (S: ``img_size``; ``val_crop_size`` of a resize to ``val_resize_size``, by default
    x 256/224). Normalising is left to the device: the workers send a quarter of the bytes."""
    if decode == "device" and (auto_augment or random_erase or interpolation != "bilinear"):
        raise ConfigError("--auto-augment, --random-erase and --interpolation run in the loader "
                          "workers; drop them (or the run's), or use --decode workers.")
    mode = v2.InterpolationMode(interpolation)
    train = [v2.RandomResizedCrop(img_size, interpolation=mode), v2.RandomHorizontalFlip()]
    warp = mode if interpolation != "bicubic" else v2.InterpolationMode.BILINEAR  # tensors' only
    if auto_augment:
        train.append({"ta_wide": lambda: v2.TrivialAugmentWide(interpolation=warp),
                      "ra": lambda: v2.RandAugment(magnitude=ra_magnitude, interpolation=warp),
                      "augmix": lambda: v2.AugMix(severity=augmix_severity, interpolation=warp)}
                     .get(auto_augment, lambda: v2.AutoAugment(
                         v2.AutoAugmentPolicy(auto_augment), interpolation=warp))())
    if random_erase:  # the fill: the mean colour, 0 after normalising
        train.append(v2.RandomErasing(random_erase, value=[round(255 * m) for m in IMAGENET_MEAN]))
    val_crop = val_crop_size or img_size
    val = [v2.Resize(val_resize_size or int(val_crop * 256 / 224), interpolation=mode),
           v2.CenterCrop(val_crop)]
    pipelines = {"train": v2.Compose(train), "val": v2.Compose(val)}
    return {k: BatchAugment(t) for k, t in pipelines.items()} if decode == "device" else pipelines
