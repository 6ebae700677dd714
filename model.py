"""ResNet and ResNeXt classifiers: torchvision's own classes and blocks, plus ``include_top``;
and every other torchvision classifier by its name, built as its recipes build it.

Papers: ResNet, https://arxiv.org/abs/1512.03385; ResNeXt, https://arxiv.org/abs/1611.05431.
"""

import difflib
import logging
import os
import pickle
import re
import socket
from typing import Any

import torch
import torchvision
from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock, Bottleneck

from multi_train_utils.checkpoint_io import load_pretrained
from multi_train_utils.guard import ConfigError

log = logging.getLogger("train")


class ResNet(torchvision.models.ResNet):
    """torchvision's ResNet (Bottleneck: "ResNet V1.5"; its ImageNet weights load with
    ``strict=True``), which checks the arguments: ``(N, 3, H, W) -> (N, num_classes)`` logits;
    with ``include_top=False`` no avgpool and fc, and ``(N, num_features, H / 32, W / 32)``
    features (512 with BasicBlock, 2048 with Bottleneck; ``H / 16`` or ``H / 8`` with dilation)."""

    def __init__(self, block: type[BasicBlock | Bottleneck], layers: list[int],
                 num_classes: int = 1000, include_top: bool = True, **kwargs: Any) -> None:
        super().__init__(block, layers, num_classes, **kwargs)
        self.include_top = include_top
        self.num_features = 512 * block.expansion
        if not include_top:
            del self.avgpool, self.fc

    def forward(self, x: Tensor) -> Tensor:
        if self.include_top:
            return super().forward(x)
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))


def _resnext(kwargs: dict[str, Any], **widths: int) -> dict[str, Any]:
    """``kwargs`` plus a ResNeXt's widths, which they may repeat but not change."""
    if any(kwargs.get(k, v) != v for k, v in widths.items()):
        raise ValueError(f"this ResNeXt's widths are {widths}; pass other widths to resnet50 or "
                         "resnet101.")
    return {**kwargs, **widths}


# torchvision's builders, under its names (so ``--model`` spells them as torchvision does).
def resnet18(num_classes: int = 1000, include_top: bool = True, **kwargs: Any) -> ResNet:
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes, include_top, **kwargs)


def resnet34(num_classes: int = 1000, include_top: bool = True, **kwargs: Any) -> ResNet:
    return ResNet(BasicBlock, [3, 4, 6, 3], num_classes, include_top, **kwargs)


def resnet50(num_classes: int = 1000, include_top: bool = True, **kwargs: Any) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes, include_top, **kwargs)


def resnet101(num_classes: int = 1000, include_top: bool = True, **kwargs: Any) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 23, 3], num_classes, include_top, **kwargs)


def resnext50_32x4d(num_classes: int = 1000, include_top: bool = True, **kwargs: Any) -> ResNet:
    return resnet50(num_classes, include_top, **_resnext(kwargs, groups=32, width_per_group=4))


def resnext101_32x8d(num_classes: int = 1000, include_top: bool = True, **kwargs: Any) -> ResNet:
    return resnet101(num_classes, include_top, **_resnext(kwargs, groups=32, width_per_group=8))


MODELS = {f.__name__: f for f in (resnet18, resnet34, resnet50, resnet101,
                                  resnext50_32x4d, resnext101_32x8d)}


def get_model(name: str, num_classes: int = 1000, img_size: int | None = None,
              **kwargs: Any) -> nn.Module:
    """``(N, 3, H, W) -> (N, num_classes)``: the :data:`MODELS` builder ``name``, else torchvision's
    classifier ``name`` (a ViT built for ``img_size`` crops). googlenet and inception_v3 come
    without auxiliary heads and always convert their input as torchvision's weights need (the
    weights do not record it, so every run and every load of their files agrees)."""
    if name.startswith("vit_") and img_size:
        kwargs = {"image_size": img_size, **kwargs}
    if name in MODELS:
        return MODELS[name](num_classes=num_classes, **kwargs)
    if name not in (names := torchvision.models.list_models(module=torchvision.models)):
        close = difflib.get_close_matches(name, names, n=3)
        raise ConfigError(f"unknown --model {name}; " + (f"did you mean {', '.join(close)}?"
                          if close else "see torchvision.models.list_models()."))
    if name in ("googlenet", "inception_v3"):
        kwargs = {"aux_logits": False, "init_weights": True, "transform_input": True, **kwargs}
    return torchvision.models.get_model(name, num_classes=num_classes, **kwargs)


def _weights_enum(value: str, model_name: str) -> Any:
    """The member of ``model_name``'s weights enum named ``value`` (``ResNet50_Weights.DEFAULT``);
    None for a file."""
    if not re.fullmatch(r"\w+_Weights\.\w+", value) or os.path.isfile(value):
        return None
    own = torchvision.models.get_model_weights(model_name)  # an enum: IMAGENET1K_V1, DEFAULT, ...
    enum_name, _, member = value.partition(".")
    if enum_name != own.__name__ or member not in own.__members__:
        raise ConfigError(f"--weights {value} is not a weights name of --model {model_name}; its "
                          f"own are {', '.join(f'{own.__name__}.{k}' for k in own.__members__)}.")
    return own[member]


def weights_size(name: str, weights: str | None) -> int | None:
    """The one crop size a ViT takes with torchvision's ``weights`` by name (their
    ``meta["min_size"]``), else None; a :class:`ConfigError` if they are another model's."""
    if not weights or name not in torchvision.models.list_models(module=torchvision.models):
        return None  # no weights, or an unknown name: get_model says so
    named = _weights_enum(weights, name)
    return named.meta["min_size"][0] if named and name.startswith("vit_") else None


def check_model(name: str, img_size: int, weights: str | None = None, *,
                crops: dict[str, int] | None = None, train_batch: int = 0) -> None:
    """A :class:`ConfigError` for an unknown ``name``, ``weights`` of another model or crop size,
    or a model that cannot take ``img_size`` crops, nor those of ``crops``
    (``{"--val-crop-size": 256}``), nor train on batches of ``train_batch`` (BatchNorm needs more
    than one value per channel): it builds and runs the model on the meta device."""
    if (fixed := weights_size(name, weights)) not in (None, img_size):
        raise ConfigError(f"--weights {weights} is for {fixed} px crops (its position embeddings "
                          f"fit that size alone); use --img-size {fixed}.")
    sizes = {"--img-size": img_size, **(crops or {})}
    flag = "--img-size"  # a build that fails is said as this check
    try:
        with torch.device("meta"), torch.no_grad():
            model = get_model(name, num_classes=2, img_size=img_size).eval()
            for flag in sizes:
                model(torch.empty(1, 3, sizes[flag], sizes[flag]))
            if train_batch:
                flag = "--batch-size"
                model.train()(torch.empty(train_batch, 3, img_size, img_size))
    except NotImplementedError:  # an operation meta lacks (RegNet computes its widths with
        return  # tensors): left to the first real forward
    except (RuntimeError, AssertionError, ValueError) as exc:  # a ViT's size: a multiple of 16
        reason = (str(exc) or type(exc).__name__).splitlines()[0]
        if flag == "--batch-size":
            raise ConfigError(f"--model {name} cannot train on --batch-size {train_batch} at "
                              f"--img-size {img_size}: BatchNorm would see one value per channel "
                              f"({reason}); raise --batch-size or --img-size.") from None
        size = sizes[flag]
        raise ConfigError(f"--model {name} cannot take {flag} {size} crops ({reason}); use "
                          f"{img_size if size != img_size else 224}.") from None


def named_weights(value: str, model_name: str) -> dict[str, Tensor] | None:
    """The state dict (1000 classes) of torchvision's weights ``value`` for ``model_name``, from
    torch hub's cache (``$TORCH_HOME``), downloaded if missing; ``None`` for a file name."""
    if (weights := _weights_enum(value, model_name)) is None:
        return None
    timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(30)  # a network that drops packets would hang the run unseen
    try:  # torchvision's own loader: its key fixes (densenet)
        with torch.random.fork_rng(devices=[]):  # its random init must not move this RNG
            state = torchvision.models.get_model(model_name, weights=weights).state_dict()
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        # No network, a download cut short, or a web page saved as the file: torch says which.
        path = os.path.join(torch.hub.get_dir(), "checkpoints", weights.url.rsplit("/", 1)[-1])
        reason = re.split(r"\. |\n", f"{type(exc).__name__}: {exc}")[0]  # torch's: a paragraph
        raise ConfigError(f"--weights {value}: cannot load {path} ({reason}); put a copy of "
                          f"{weights.url} there.") from None
    finally:
        socket.setdefaulttimeout(timeout)
    aux = ("aux1.", "aux2.", "AuxLogits.")  # googlenet's, inception's: not built here
    return {k: v for k, v in state.items() if not k.startswith(aux)}


def classifier_name(model: nn.Module) -> str:
    """The top-level child holding the model's last layer with parameters, an ``nn.Linear`` or
    1x1 ``nn.Conv2d``: ``fc``, ``classifier``, ``heads`` (ViT), ``head``."""
    name, last = [(n, m) for n, m in model.named_modules()
                  if any(True for _ in m.parameters(recurse=False))][-1]
    if not name or not (isinstance(last, nn.Linear) or isinstance(last, nn.Conv2d)
                        and last.kernel_size == (1, 1)):
        raise ValueError(f"{type(model).__name__} ends in {type(last).__name__}, not a "
                         "classifier (nn.Linear or 1x1 nn.Conv2d); build it with include_top=True.")
    return name.split(".")[0]


def load_weights(model: nn.Module, weights: str, model_name: str, strict: bool = False) -> None:
    """``--weights``: a file, or torchvision's weights by name, loaded as far as they fit: the
    logits layer starts new."""
    load_pretrained(model, weights, strict, head=classifier_name(model),
                    state=named_weights(weights, model_name))


def _batchnorm_eval(model: nn.Module, inputs: Any) -> None:
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()


def freeze_backbone(model: nn.Module) -> None:
    """Train only the classifier of ``model`` (before DDP wraps it). In train mode BatchNorm would
    still update its running statistics and the frozen features drift, so a forward pre-hook puts
    every BatchNorm in eval mode, also after ``model.train()`` and ``convert_sync_batchnorm``."""
    head = classifier_name(model)
    for name, param in model.named_parameters():
        param.requires_grad_(name.split(".")[0] == head)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("--freeze-layers: training only %s (%s of %s parameters)", head, f"{trained:,}",
             f"{total:,}")
    model.register_forward_pre_hook(_batchnorm_eval)
