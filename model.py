"""ResNet and ResNeXt image classifiers, compatible with ``torchvision.models``.

One :class:`ResNet` class builds every depth from blocks per stage (``[3, 4, 6, 3]`` for
ResNet-50) and a block type. Module names, shapes and outputs match torchvision's, so its ImageNet
weights load with ``strict=True`` (downloading them is left to the caller). By name, as
``--model``::

    model = get_model("resnet50", num_classes=5)           # (N, 3, H, W) -> (N, 5)
    backbone = get_model("resnet50", include_top=False)    # (N, 3, H, W) -> (N, 2048, H/32, W/32)

Papers: ResNet, https://arxiv.org/abs/1512.03385; ResNeXt, https://arxiv.org/abs/1611.05431.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

NormLayer = Callable[[int], nn.Module]


def conv3x3(in_planes: int, out_planes: int, stride: int = 1, groups: int = 1,
            dilation: int = 1) -> nn.Conv2d:
    """3x3 convolution without bias; padding equals dilation so stride 1 keeps H and W."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=dilation,
                     groups=groups, bias=False, dilation=dilation)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    """1x1 convolution without bias (the following norm layer supplies the shift)."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions plus a shortcut, used by ResNet-18/34:
    ``(N, inplanes, H, W) -> (N, planes, H / stride, W / stride)``."""

    expansion: int = 1  # output channels = planes * expansion, known before a block is built

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None, groups: int = 1, base_width: int = 64,
                 dilation: int = 1, norm_layer: NormLayer = nn.BatchNorm2d) -> None:
        super().__init__()
        if groups != 1 or base_width != 64:
            raise ValueError(f"BasicBlock supports only groups=1 and width_per_group=64, got "
                             f"groups={groups} and width_per_group={base_width}; use resnet50 or "
                             "deeper for ResNeXt widths.")
        if dilation > 1:
            raise ValueError(f"BasicBlock does not support dilation (got dilation={dilation}); use "
                             "replace_stride_with_dilation only with resnet50 or deeper.")
        # The first conv carries the stride; `downsample` strides the shortcut to match.
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = norm_layer(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = norm_layer(planes)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (grouped for ResNeXt), 1x1 expand, plus a shortcut; ResNet-50 and deeper:
    ``(N, inplanes, H, W) -> (N, planes * 4, H / stride, W / stride)``.

    The stride sits on the 3x3 convolution, not the first 1x1 as in the paper: this "ResNet
    V1.5" is what torchvision's weights were trained with, about 0.5% top-1 more accurate, as a
    strided 1x1 skips 3/4 of its inputs (NVIDIA's resnet_50_v1_5_for_pytorch)."""

    expansion: int = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None, groups: int = 1, base_width: int = 64,
                 dilation: int = 1, norm_layer: NormLayer = nn.BatchNorm2d) -> None:
        super().__init__()
        # ResNeXt keeps FLOPs comparable by splitting a wider 3x3 into `groups` paths of
        # `base_width` channels each (per 64 planes); groups=1, base_width=64 is plain ResNet.
        width = int(planes * (base_width / 64.0)) * groups
        if width < 1:
            raise ValueError(f"Bottleneck width is {width} for planes={planes}, groups={groups}, "
                             f"width_per_group={base_width}; both must be positive integers.")
        self.conv1 = conv1x1(inplanes, width)
        self.bn1 = norm_layer(width)
        self.conv2 = conv3x3(width, width, stride, groups, dilation)
        self.bn2 = norm_layer(width)
        self.conv3 = conv1x1(width, planes * self.expansion)
        self.bn3 = norm_layer(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


Block = type[BasicBlock] | type[Bottleneck]


class ResNet(nn.Module):
    """Stem, four residual stages and (``include_top``) a pooled linear classifier: ``(N, 3, H,
    W) -> (N, num_classes)`` logits, else ``(N, num_features, H / 32, W / 32)`` features (512 with
    BasicBlock, 2048 with Bottleneck; ``H / 16`` or ``H / 8`` with dilation).

    ``zero_init_residual``: each block starts as an identity (+0.2-0.3% top-1, arXiv:1706.02677).
    ``groups``, ``width_per_group``: ResNeXt's 3x3 paths and their channels per 64 planes;
    ``replace_stride_with_dilation``: per stage 2-4, keep its resolution and dilate instead (both
    Bottleneck only). ``norm_layer(num_channels)``, e.g. ``lambda c: nn.GroupNorm(32, c)``."""

    def __init__(self, block: Block, layers: list[int], num_classes: int = 1000,
                 include_top: bool = True, zero_init_residual: bool = False, groups: int = 1,
                 width_per_group: int = 64, replace_stride_with_dilation: list[bool] | None = None,
                 norm_layer: NormLayer | None = None) -> None:
        super().__init__()
        if block not in (BasicBlock, Bottleneck):
            raise ValueError(f"block must be BasicBlock or Bottleneck, got {block!r}.")
        if len(layers) != 4 or any(not isinstance(n, int) or n < 1 for n in layers):
            raise ValueError("layers must be four positive block counts, e.g. [2, 2, 2, 2], "
                             f"got {layers!r}.")
        # bool is an int subclass; num_classes=True is always a mistake.
        if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
            raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}.")
        dilate = replace_stride_with_dilation or [False, False, False]
        if len(dilate) != 3:
            raise ValueError("replace_stride_with_dilation must be None or three booleans for "
                             f"stages 2-4, got {replace_stride_with_dilation!r}.")
        norm_layer = norm_layer or nn.BatchNorm2d
        if not callable(norm_layer):
            raise ValueError("norm_layer must be callable as norm_layer(num_channels), "
                             f"got {norm_layer!r}.")

        self._norm_layer = norm_layer
        self.include_top = include_top
        self.num_features = 512 * block.expansion
        # Running state read by _make_layer: channels entering the next stage and current dilation.
        self.inplanes = 64
        self.dilation = 1
        self.groups = groups
        self.base_width = width_per_group

        # Stem: (N, 3, H, W) -> (N, 64, H/4, W/4).
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = norm_layer(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2, dilate=dilate[0])
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2, dilate=dilate[1])
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2, dilate=dilate[2])
        if include_top:
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(self.num_features, num_classes)

        # He init with fan_out preserves the variance of gradients in the backward pass through
        # ReLUs (https://arxiv.org/abs/1502.01852), as torchvision does, so training from scratch
        # behaves the same; norm layers already start at weight 1, bias 0.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif zero_init_residual and isinstance(m, (BasicBlock, Bottleneck)):
                last_norm = m.bn3 if isinstance(m, Bottleneck) else m.bn2
                # Norm layers without an affine weight (or nn.Identity) have nothing to zero.
                if isinstance(getattr(last_norm, "weight", None), Tensor):
                    nn.init.zeros_(last_norm.weight)

    def _make_layer(self, block: Block, planes: int, blocks: int, stride: int = 1,
                    dilate: bool = False) -> nn.Sequential:
        """One stage: ``(N, inplanes, H, W) -> (N, planes * expansion, H / stride, W / stride)``."""
        norm_layer = self._norm_layer
        # Dilation replaces a stride for dense prediction (https://arxiv.org/abs/1706.05587). The
        # first block is the one whose stride is removed, so it keeps the previous dilation; the
        # blocks after it dilate to see the same context as if the stage had downsampled.
        previous_dilation = self.dilation
        if dilate:
            self.dilation *= stride
            stride = 1
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            # Projection shortcut (option B in the ResNet paper) whenever the shape changes.
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * block.expansion, stride),
                                       norm_layer(planes * block.expansion))
        shared = dict(groups=self.groups, base_width=self.base_width, norm_layer=norm_layer)
        layers = [block(self.inplanes, planes, stride, downsample, dilation=previous_dilation,
                        **shared)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes, dilation=self.dilation, **shared)
                   for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward_features(self, x: Tensor) -> Tensor:
        """``(N, 3, H, W) -> (N, num_features, H / 32, W / 32)``, the last stage's feature map."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        return self.layer4(x)

    def forward(self, x: Tensor) -> Tensor:
        """``(N, 3, H, W) -> (N, num_classes)`` logits; the feature map if ``include_top=False``."""
        x = self.forward_features(x)
        if not self.include_top:
            return x
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _resnet(block: Block, layers: list[int], num_classes: int, include_top: bool,
            kwargs: dict[str, Any], **fixed: Any) -> ResNet:
    """Build a :class:`ResNet`; ``fixed`` holds arguments that define the named architecture."""
    # Fail loudly instead of silently building a different network than the name promises.
    for key, value in fixed.items():
        if kwargs.get(key, value) != value:
            raise ValueError(f"{key}={kwargs[key]!r} conflicts with this model's {key}={value}; "
                             f"pass {key} to resnet50 or resnet101 to build a custom width.")
    return ResNet(block, layers, num_classes=num_classes, include_top=include_top,
                  **{**kwargs, **fixed})


# torchvision's builders, under its names (so ``--model`` spells them as torchvision does);
# ``kwargs`` go to :class:`ResNet`.
def resnet18(num_classes: int = 1000, include_top: bool = True, **kwargs: Any) -> ResNet:
    return _resnet(BasicBlock, [2, 2, 2, 2], num_classes, include_top, kwargs)


def resnet34(num_classes: int = 1000, include_top: bool = True, **kwargs: Any) -> ResNet:
    return _resnet(BasicBlock, [3, 4, 6, 3], num_classes, include_top, kwargs)


def resnet50(num_classes: int = 1000, include_top: bool = True, **kwargs: Any) -> ResNet:
    return _resnet(Bottleneck, [3, 4, 6, 3], num_classes, include_top, kwargs)


def resnet101(num_classes: int = 1000, include_top: bool = True, **kwargs: Any) -> ResNet:
    return _resnet(Bottleneck, [3, 4, 23, 3], num_classes, include_top, kwargs)


def resnext50_32x4d(num_classes: int = 1000, include_top: bool = True, **kwargs: Any) -> ResNet:
    return _resnet(Bottleneck, [3, 4, 6, 3], num_classes, include_top, kwargs, groups=32,
                   width_per_group=4)


def resnext101_32x8d(num_classes: int = 1000, include_top: bool = True, **kwargs: Any) -> ResNet:
    return _resnet(Bottleneck, [3, 4, 23, 3], num_classes, include_top, kwargs, groups=32,
                   width_per_group=8)


MODELS: dict[str, Callable[..., ResNet]] = {
    f.__name__: f for f in (resnet18, resnet34, resnet50, resnet101, resnext50_32x4d,
                            resnext101_32x8d)}


def get_model(name: str, **kwargs: Any) -> ResNet:
    """Build the model registered as ``name`` in :data:`MODELS`; ``kwargs`` go to its builder."""
    if name not in MODELS:
        raise ValueError(f"Unknown model {name!r}; choose one of: {', '.join(MODELS)}.")
    return MODELS[name](**kwargs)


def _batchnorm_eval(model: nn.Module, inputs: Any) -> None:
    """Forward pre-hook of :func:`freeze_backbone`: every BatchNorm uses its running statistics."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()


def freeze_backbone(model: nn.Module) -> None:
    """Train only the classifier ``fc`` of ``model`` (before DDP wraps it). In train mode
    BatchNorm would still overwrite its running statistics and the frozen features drift, so a
    forward pre-hook puts every BatchNorm in eval mode, also after ``model.train()`` and
    ``convert_sync_batchnorm``."""
    if not any(name.startswith("fc.") for name, _ in model.named_parameters()):
        raise ValueError("freeze_backbone needs a model with an `fc` classifier "
                         "(include_top=True).")
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("fc."))
    model.register_forward_pre_hook(_batchnorm_eval)
