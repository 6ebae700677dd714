"""ResNet and ResNeXt image classifiers: torchvision's own classes, plus ``include_top``.

:class:`ResNet` is ``torchvision.models.ResNet``; the blocks are torchvision's :class:`BasicBlock`
(ResNet-18/34) and :class:`Bottleneck` (ResNet-50 and deeper; stride on the 3x3 convolution, the
"ResNet V1.5" of torchvision's weights). Its ImageNet weights load with ``strict=True``
(downloading them is left to the caller). By name, as ``--model``::

    model = get_model("resnet50", num_classes=5)           # (N, 3, H, W) -> (N, 5)
    backbone = get_model("resnet50", include_top=False)    # (N, 3, H, W) -> (N, 2048, H/32, W/32)

Papers: ResNet, https://arxiv.org/abs/1512.03385; ResNeXt, https://arxiv.org/abs/1611.05431.
"""

from typing import Any

import torchvision
from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock, Bottleneck


class ResNet(torchvision.models.ResNet):
    """torchvision's ResNet: ``(N, 3, H, W) -> (N, num_classes)`` logits; with
    ``include_top=False`` no avgpool and fc, and ``(N, num_features, H / 32, W / 32)`` features
    (512 with BasicBlock, 2048 with Bottleneck; ``H / 16`` or ``H / 8`` with dilation).
    ``kwargs`` go to torchvision: ``zero_init_residual``, ``groups``, ``width_per_group``,
    ``replace_stride_with_dilation`` and ``norm_layer(num_channels)``, e.g. ``nn.SyncBatchNorm``
    or ``lambda c: nn.GroupNorm(32, c)``. Bad arguments raise ``ValueError``."""

    def __init__(self, block: type[BasicBlock | Bottleneck], layers: list[int],
                 num_classes: int = 1000, include_top: bool = True, **kwargs: Any) -> None:
        if not (isinstance(block, type) and issubclass(block, (BasicBlock, Bottleneck))):
            raise ValueError(f"block must be BasicBlock, Bottleneck or a subclass, got {block!r}.")
        if len(layers) != 4 or any(not isinstance(n, int) or n < 1 for n in layers):
            raise ValueError(f"layers must be four positive block counts, got {layers!r}.")
        # bool is an int subclass; num_classes=True is always a mistake.
        if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}.")
        widths = kwargs.get("groups", 1), kwargs.get("width_per_group", 64)
        if any(not isinstance(n, int) or n < 1 for n in widths):
            raise ValueError(f"groups and width_per_group must be positive integers, got {widths}.")
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


def get_model(name: str, **kwargs: Any) -> ResNet:
    """Build the model registered as ``name`` in :data:`MODELS`; ``kwargs`` go to its builder."""
    if name not in MODELS:
        raise ValueError(f"Unknown model {name!r}; choose one of: {', '.join(MODELS)}.")
    return MODELS[name](**kwargs)


def _batchnorm_eval(model: nn.Module, inputs: Any) -> None:
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()


def freeze_backbone(model: nn.Module) -> None:
    """Train only the classifier ``fc`` of ``model`` (before DDP wraps it). In train mode
    BatchNorm would still overwrite its running statistics and the frozen features drift, so a
    forward pre-hook puts every BatchNorm in eval mode, also after ``model.train()`` and
    ``convert_sync_batchnorm``."""
    if not any(name.startswith("fc.") for name, _ in model.named_parameters()):
        raise ValueError("freeze_backbone needs a model with an fc classifier (include_top=True).")
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("fc."))
    model.register_forward_pre_hook(_batchnorm_eval)
