"""ResNet and ResNeXt image classifiers: torchvision's own classes and blocks, plus
``include_top``; and every other classifier of torchvision by its name, as its recipes use it.

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
    """torchvision's ResNet (Bottleneck: "ResNet V1.5", stride on the 3x3 convolution; its
    ImageNet weights load with ``strict=True``): ``(N, 3, H, W) -> (N, num_classes)`` logits; with
    ``include_top=False`` no avgpool and fc, and ``(N, num_features, H / 32, W / 32)`` features
    (512 with BasicBlock, 2048 with Bottleneck; ``H / 16`` or ``H / 8`` with dilation)."""

    def __init__(self, block: type[BasicBlock | Bottleneck], layers: list[int],
                 num_classes: int = 1000, include_top: bool = True, **kwargs: Any) -> None:
        if not (isinstance(block, type) and issubclass(block, (BasicBlock, Bottleneck))):
            raise ValueError(f"block must be BasicBlock, Bottleneck or a subclass, got {block!r}.")
        counts = [num_classes, kwargs.get("groups", 1), kwargs.get("width_per_group", 64)]
        # type(n) is int: num_classes=True (bool is an int subclass) is always a mistake.
        if len(layers) != 4 or any(type(n) is not int or n < 1 for n in [*counts, *layers]):
            raise ValueError("num_classes, groups, width_per_group and the four layers' block "
                             f"counts must be positive integers, got {counts} and {layers!r}.")
        if issubclass(block, BasicBlock) and any(kwargs.get("replace_stride_with_dilation") or []):
            raise ValueError("replace_stride_with_dilation needs resnet50 or deeper.")
        norm = kwargs.get("norm_layer") or nn.BatchNorm2d
        # torchvision's init sets every norm layer's weight and bias, so they must exist.
        if not callable(norm) or getattr(norm(64), "weight", None) is None:
            raise ValueError("norm_layer(num_channels) must build a norm layer with learnable "
                             f"weights, e.g. lambda c: nn.GroupNorm(32, c); got {norm!r}.")
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


def _resnext(kwargs: dict[str, Any], groups: int, width_per_group: int) -> dict[str, Any]:
    """``kwargs`` plus a ResNeXt's widths, which they may repeat but not change."""
    fixed = {"groups": groups, "width_per_group": width_per_group}
    if changed := {k: kwargs[k] for k, v in fixed.items() if kwargs.get(k, v) != v}:
        raise ValueError(f"{changed} conflicts with this model's {fixed}; pass them to resnet50 "
                         "or resnet101 to build a custom width.")
    return {**kwargs, **fixed}


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
    return resnet50(num_classes, include_top, **_resnext(kwargs, 32, 4))


def resnext101_32x8d(num_classes: int = 1000, include_top: bool = True, **kwargs: Any) -> ResNet:
    return resnet101(num_classes, include_top, **_resnext(kwargs, 32, 8))


MODELS = {f.__name__: f for f in (resnet18, resnet34, resnet50, resnet101,
                                  resnext50_32x4d, resnext101_32x8d)}


def get_model(name: str, num_classes: int = 1000, img_size: int | None = None,
              **kwargs: Any) -> nn.Module:
    """``(N, 3, H, W) -> (N, num_classes)``: the :data:`MODELS` builder ``name``, else torchvision's
    classifier ``name`` (``kwargs`` go to the builder). googlenet and inception_v3 come without
    auxiliary heads and always convert their input as torchvision's weights need (a fixed affine
    map; the weights do not record it, so every run and every load of their files agrees)."""
    if name.startswith("vit_") and img_size:
        kwargs = {"image_size": img_size, **kwargs}
    if name in MODELS:
        return MODELS[name](num_classes=num_classes, **kwargs)
    if name not in (names := torchvision.models.list_models(module=torchvision.models)):
        close = difflib.get_close_matches(name, names, n=3)
        raise ConfigError(f"unknown --model {name}; " + (f"did you mean {', '.join(close)}?"
                          if close else "see torchvision.models.list_models()."))
    if name in ("googlenet", "inception_v3"):  # plain (N, K) logits: no auxiliary heads
        kwargs = {"aux_logits": False, "init_weights": True, "transform_input": True, **kwargs}
    return torchvision.models.get_model(name, num_classes=num_classes, **kwargs)


def weights_size(name: str, weights: str | None) -> int | None:
    """The one crop size ``name`` takes with torchvision's ``weights`` by name (a ViT's: their
    ``meta["min_size"]``), else None; a :class:`ConfigError` if they are another model's."""
    if not weights or name not in torchvision.models.list_models(module=torchvision.models):
        return None  # no weights, or an unknown name: get_model says so
    named = _weights_enum(weights, name)
    return named.meta["min_size"][0] if named and name.startswith("vit_") else None


def check_model(name: str, img_size: int, weights: str | None = None, *,
                crops: dict[str, int] | None = None, train_batch: int = 0) -> None:
    """A :class:`ConfigError` for an unknown ``name``, ``weights`` named for another model or
    crop size, or a model that cannot take ``img_size`` crops (a ViT is built for them), those
    of ``crops`` (``{"--val-crop-size": 256}``), or train on batches of ``train_batch`` (BatchNorm
    needs more than one value per channel): it builds and runs the model on the meta device."""
    if (fixed := weights_size(name, weights)) not in (None, img_size):
        raise ConfigError(f"--weights {weights} is for {fixed} px crops (its position embeddings "
                          f"fit that size alone); use --img-size {fixed}.")
    checks = [(flag, size, 1, False) for flag, size in [("--img-size", img_size),
                                                        *(crops or {}).items()]]
    checks += [("--batch-size", img_size, train_batch, True)] if train_batch else []
    flag, size, batch, train = checks[0]  # a build that fails is said as the first check
    try:
        with torch.device("meta"), torch.no_grad():
            model = get_model(name, num_classes=2, img_size=img_size)
            for check in checks:
                flag, size, batch, train = check
                model.train(train)(torch.empty(batch, 3, size, size))
    except NotImplementedError:  # an operation meta lacks (RegNet computes its widths with
        return  # tensors): left to the first real forward
    except (RuntimeError, AssertionError, ValueError) as exc:  # a ViT's size: a multiple of 16
        reason = (str(exc) or type(exc).__name__).splitlines()[0]
        if train:
            raise ConfigError(f"--model {name} cannot train on --batch-size {batch} at --img-size "
                              f"{img_size}: BatchNorm would see one value per channel ({reason}); "
                              "raise --batch-size or --img-size.") from None
        raise ConfigError(f"--model {name} cannot take {flag} {size} crops ({reason}); use "
                          f"{img_size if size != img_size else 224}.") from None


def _weights_enum(value: str, model_name: str) -> Any:
    """The member of ``model_name``'s weights enum that ``value`` names
    (``ResNet50_Weights.DEFAULT``); None for a file."""
    if not re.fullmatch(r"\w+_Weights\.\w+", value) or os.path.isfile(value):
        return None
    own = torchvision.models.get_model_weights(model_name)  # an enum: IMAGENET1K_V1, DEFAULT, ...
    enum_name, _, member = value.partition(".")
    weights = own.__members__.get(member) if enum_name == own.__name__ else None
    if weights is None:
        raise ConfigError(f"--weights {value} is not a weights name of --model {model_name}; its "
                          f"own are {', '.join(f'{own.__name__}.{k}' for k in own.__members__)}.")
    return weights


def named_weights(value: str, model_name: str) -> dict[str, Tensor] | None:
    """The state dict (1000 classes) of torchvision's weights ``value`` for ``model_name``, from
    torch hub's cache (``$TORCH_HOME``), downloaded if missing; ``None`` for a file name."""
    if (weights := _weights_enum(value, model_name)) is None:
        return None
    folder = os.path.join(torch.hub.get_dir(), "checkpoints")
    file = weights.url.rsplit("/", 1)[-1]  # torch hub's name for it
    timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(30)  # a network that drops packets would hang the run unseen
    try:  # torchvision's own loader: its key fixes (densenet)
        with torch.random.fork_rng(devices=[]):  # its random init must not move this RNG
            state = torchvision.models.get_model(model_name, weights=weights).state_dict()
        aux = ("aux1.", "aux2.", "AuxLogits.")  # googlenet's, inception's: not built here
        return {k: v for k, v in state.items() if not k.startswith(aux)}
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        # urllib's URLError: no network; else a cut download, or a web page saved as the file
        path = os.path.join(folder, file)
        if not os.path.isfile(path):
            raise ConfigError(f"--weights {value}: {file} is not in the torch hub cache and could "
                              f"not be downloaded ({getattr(exc, 'reason', exc)}); download "
                              f"{weights.url} into {folder}.") from None
        reason = re.split(r"\. |\n", f"{type(exc).__name__}: {exc}")[0]  # torch's: a paragraph
        if isinstance(exc, OSError):
            raise ConfigError(f"--weights {value}: {path} cannot be read ({reason}).") from None
        raise ConfigError(f"--weights {value}: {path} is damaged ({reason}); delete it to "
                          f"download it again, or put a copy of {weights.url} there.") from None
    finally:
        socket.setdefaulttimeout(timeout)


def classifier_name(model: nn.Module) -> str:
    """The top-level child holding the model's last layer with parameters (registration order),
    an ``nn.Linear`` or 1x1 ``nn.Conv2d``: ``fc``, ``classifier``, ``heads`` (ViT), ``head``."""
    name, last = [(n, m) for n, m in model.named_modules()
                  if any(True for _ in m.parameters(recurse=False))][-1]
    if not name or not (isinstance(last, nn.Linear) or isinstance(last, nn.Conv2d)
                        and last.kernel_size == (1, 1)):
        raise ValueError(f"{type(model).__name__} ends in {type(last).__name__}, not a "
                         "classifier (nn.Linear or 1x1 nn.Conv2d); build it with include_top=True.")
    return name.split(".")[0]


def load_weights(model: nn.Module, weights: str, model_name: str, strict: bool = False) -> None:
    """``--weights``: a file, or torchvision's weights by name (:func:`named_weights`), loaded as
    far as it fits (:func:`~multi_train_utils.checkpoint_io.load_pretrained`): the logits layer
    new."""
    load_pretrained(model, weights, strict, head=classifier_name(model),
                    state=named_weights(weights, model_name))


def _batchnorm_eval(model: nn.Module, inputs: Any) -> None:
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()


def freeze_backbone(model: nn.Module) -> None:
    """Train only the classifier of ``model`` (:func:`classifier_name`; before DDP wraps it). In
    train mode BatchNorm would still overwrite its running statistics and the frozen features
    drift, so a forward pre-hook puts every BatchNorm in eval mode, also after ``model.train()``
    and ``convert_sync_batchnorm``."""
    head = classifier_name(model)
    for name, param in model.named_parameters():
        param.requires_grad_(name.split(".")[0] == head)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("--freeze-layers: training only %s (%s of %s parameters)", head, f"{trained:,}",
             f"{total:,}")
    model.register_forward_pre_hook(_batchnorm_eval)
