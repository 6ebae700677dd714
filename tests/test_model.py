"""model.py builds torchvision's ResNets (classes, state dicts, outputs, include_top) and, by
name, its other classifiers; their classifier, FSDP units and named weights.

Everything runs on CPU at 64x64 px (the other classifiers mostly on the meta device) with randomly
initialised weights; nothing is downloaded (named weights come from a planted torch hub cache).
"""

import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

import model
from multi_train_utils.guard import ConfigError

NAMES = list(model.MODELS)
# (N, 3, 64, 64) is enough to pass through all five downsamplings: layer4 is 2x2.
INPUT_SHAPE = (2, 3, 64, 64)
BOTTLENECK = {"resnet50", "resnet101", "resnext50_32x4d", "resnext101_32x8d"}


def _feature_channels(name: str) -> int:
    return 2048 if name in BOTTLENECK else 512


def _randomize_(module: nn.Module, seed: int = 0) -> None:
    """Give every parameter and BN buffer non-default values, in place.

    Freshly initialised BN layers are an identity in eval mode (mean 0, var 1, weight 1, bias 0),
    which would hide a swapped or misplaced norm layer; random statistics make every tensor count.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            if not tensor.is_floating_point():
                continue  # num_batches_tracked
            if name.endswith("running_var") or (name.endswith("weight") and tensor.dim() == 1):
                tensor.copy_(torch.rand(tensor.shape, generator=generator) + 0.5)
            elif tensor.dim() == 1:
                tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))
            else:
                # Conv/linear weights: keep He scaling so activations stay O(1) through 100+ layers.
                fan_in = tensor[0].numel()
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * (2.0 / fan_in) ** 0.5)


@pytest.fixture(scope="module", params=NAMES)
def model_pair(request: pytest.FixtureRequest) -> tuple[str, nn.Module, nn.Module]:
    """(name, ours, torchvision's) built once per name, since the ResNeXt-101s are slow to build."""
    name = request.param
    torch.manual_seed(0)
    reference = getattr(torchvision.models, name)(weights=None)
    return name, model.MODELS[name](), reference


def test_models_registry_lists_every_builder() -> None:
    assert NAMES == ["resnet18", "resnet34", "resnet50", "resnet101", "resnext50_32x4d",
                     "resnext101_32x8d"]
    for name, builder in model.MODELS.items():
        assert builder is getattr(model, name)


def test_classes_are_torchvisions_and_fsdp_finds_their_blocks() -> None:
    from torchvision.models import resnet

    from multi_train_utils.strategy import RESIDUAL_BLOCKS

    assert model.BasicBlock is resnet.BasicBlock and model.Bottleneck is resnet.Bottleneck
    assert issubclass(model.ResNet, resnet.ResNet)
    net = model.resnet18(include_top=False)
    assert isinstance(net, torchvision.models.ResNet)
    # shard_model's default units are the residual blocks, found by class name: 8 in resnet18.
    assert sum(type(m).__name__ in RESIDUAL_BLOCKS for m in net.modules()) == 8
    # A seed gives torchvision's own initialisation, tensor for tensor.
    torch.manual_seed(0)
    ours = model.resnet18(num_classes=5).state_dict()
    torch.manual_seed(0)
    reference = torchvision.models.resnet18(num_classes=5).state_dict()
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[k], reference[k]) for k in ours)


def test_state_dict_matches_torchvision(model_pair: tuple[str, nn.Module, nn.Module]) -> None:
    _, ours, reference = model_pair
    ours_shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    reference_shapes = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    # Compare as ordered lists too: optimizers and checkpoint converters rely on the order.
    assert list(ours_shapes) == list(reference_shapes)
    assert ours_shapes == reference_shapes


def test_torchvision_weights_give_identical_outputs(
        model_pair: tuple[str, nn.Module, nn.Module]) -> None:
    _, ours, reference = model_pair
    _randomize_(reference)
    ours.load_state_dict(reference.state_dict(), strict=True)
    ours.eval()
    reference.eval()
    x = torch.randn(INPUT_SHAPE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(x)
        actual = ours(x)
    assert actual.shape == (2, 1000)
    # Guard against a vacuous pass: the logits must depend on the input.
    assert expected.std() > 1e-3
    assert not torch.equal(expected[0], expected[1])
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["resnet18", "resnext50_32x4d"])
def test_num_classes_sets_logit_size(name: str) -> None:
    net = model.get_model(name, num_classes=7).eval()
    assert net.fc.out_features == 7
    with torch.no_grad():
        assert net(torch.randn(INPUT_SHAPE)).shape == (2, 7)


@pytest.mark.parametrize("name", NAMES)
def test_include_top_false_returns_feature_map(name: str) -> None:
    net = model.get_model(name, include_top=False).eval()
    assert not hasattr(net, "fc") and not hasattr(net, "avgpool")
    assert not any(key.startswith("fc.") for key in net.state_dict())
    assert net.num_features == _feature_channels(name)
    with torch.no_grad():
        features = net(torch.randn(INPUT_SHAPE))
    # Output stride 32: 64 px -> 2x2.
    assert features.shape == (2, _feature_channels(name), 2, 2)


def test_backbone_loads_torchvision_weights_without_fc() -> None:
    torch.manual_seed(0)
    reference = torchvision.models.resnet18(weights=None)
    _randomize_(reference)
    backbone = model.resnet18(include_top=False).eval()
    missing, unexpected = backbone.load_state_dict(reference.state_dict(), strict=False)
    assert missing == [] and sorted(unexpected) == ["fc.bias", "fc.weight"]
    # The pooled backbone followed by torchvision's fc must reproduce torchvision's logits.
    x = torch.randn(INPUT_SHAPE)
    with torch.no_grad():
        pooled = backbone(x).mean(dim=(2, 3))
        torch.testing.assert_close(reference.eval().fc(pooled), reference(x), rtol=1e-5, atol=1e-5)


def test_dilation_matches_torchvision() -> None:
    torch.manual_seed(0)
    dilation = [False, True, True]
    reference = torchvision.models.resnet50(weights=None, replace_stride_with_dilation=dilation)
    _randomize_(reference)
    ours = model.resnet50(include_top=False, replace_stride_with_dilation=dilation)
    ours.load_state_dict(reference.state_dict(), strict=False)
    layer4 = {}
    reference.layer4.register_forward_hook(lambda module, args, output: layer4.update(out=output))
    x = torch.randn(INPUT_SHAPE)
    with torch.no_grad():
        reference.eval()(x)
        features = ours.eval()(x)
    # Output stride 8: 64 px -> 8x8.
    assert features.shape == (2, 2048, 8, 8)
    torch.testing.assert_close(features, layer4["out"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_norm_layer_replaces_every_batchnorm(name: str) -> None:
    net = model.get_model(name, norm_layer=lambda c: nn.GroupNorm(32, c), zero_init_residual=True)
    batch_norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    assert not any(isinstance(m, batch_norms) for m in net.modules())
    group_norms = [m for m in net.modules() if isinstance(m, nn.GroupNorm)]
    # Stem + 2 or 3 per block + one per downsample shortcut.
    expected = 1 + (2 * 8 + 3 if name == "resnet18" else 3 * 16 + 4)
    assert len(group_norms) == expected
    # GroupNorm has no running statistics, so train-mode output is independent per sample.
    x = torch.randn(INPUT_SHAPE)
    out = net.train()(x)
    torch.testing.assert_close(out[:1], net(x[:1]))


def test_default_init_matches_torchvision_recipe() -> None:
    torch.manual_seed(0)
    net = model.resnet50()
    bns = [m for m in net.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(torch.all(m.weight == 1) and torch.all(m.bias == 0) for m in bns)
    # kaiming_normal_(mode="fan_out"): std = sqrt(2 / (out_channels * kh * kw)).
    conv = net.conv1.weight
    expected_std = (2.0 / (64 * 7 * 7)) ** 0.5
    assert abs(conv.std().item() - expected_std) / expected_std < 0.05
    # No residual-branch zeroing unless asked for.
    assert all(torch.all(block.bn3.weight == 1) for block in net.layer1)


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_zero_init_residual_makes_blocks_identity_branches(name: str) -> None:
    net = model.get_model(name, zero_init_residual=True)
    blocks = [m for m in net.modules() if isinstance(m, (model.BasicBlock, model.Bottleneck))]
    assert len(blocks) == {"resnet18": 8, "resnet50": 16}[name]
    for block in blocks:
        last_norm = block.bn3 if isinstance(block, model.Bottleneck) else block.bn2
        assert torch.all(last_norm.weight == 0)
        assert torch.all(block.bn1.weight == 1)


def test_an_unknown_model_name_is_one_line_with_the_closest_names() -> None:
    for call in (lambda: model.get_model("resnet35"), lambda: model.check_model("resnet35", 64),
                 lambda: model.check_model("resnet35", 64, "ResNet50_Weights.DEFAULT")):
        with pytest.raises(ConfigError, match=r"^unknown --model resnet35; did you mean .*34"):
            call()


@pytest.mark.parametrize(
    ("builder", "kwargs", "error", "match"),
    [  # torchvision checks the arguments; the ResNeXts their fixed widths
        (model.resnet50, {"num_classes": -3}, RuntimeError, "negative dimension"),
        (model.resnet50, {"replace_stride_with_dilation": [True]}, ValueError,
         "replace_stride_with_dilation"),
        (model.resnet18, {"replace_stride_with_dilation": [False, False, True]},
         NotImplementedError, "Dilation"),
        (model.resnet18, {"groups": 32}, ValueError, "BasicBlock"),
        (model.resnext50_32x4d, {"groups": 64}, ValueError, "groups"),
    ],
)
def test_bad_arguments_raise(builder: Callable[..., nn.Module], kwargs: dict,
                             error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        builder(**kwargs)


def test_resnet50_with_resnext_widths_equals_resnext50() -> None:
    # torchvision allows resnet50(groups=32, width_per_group=4); it must be the same network.
    custom = model.resnet50(groups=32, width_per_group=4)
    named = model.resnext50_32x4d(groups=32)  # a matching value is not a conflict
    assert {k: v.shape for k, v in custom.state_dict().items()} == {
        k: v.shape for k, v in named.state_dict().items()
    }


def _bn_buffers(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in net.state_dict().items()
            if k.endswith(("running_mean", "running_var", "num_batches_tracked"))}


def test_freeze_backbone_trains_only_fc_and_keeps_batchnorm_statistics() -> None:
    from multi_train_utils.sync_batchnorm import SyncBatchNormCPU, convert_sync_batchnorm

    torch.manual_seed(0)
    net = model.resnet18(num_classes=3)
    _randomize_(net)  # as pretrained: running statistics far from this batch's
    x = torch.randn(INPUT_SHAPE) * 3 + 1
    with torch.no_grad():
        expected = net.eval()(x)
    before = _bn_buffers(net)
    unfrozen = model.resnet18(num_classes=3)
    unfrozen.load_state_dict(net.state_dict())
    unfrozen.train()(x)  # without freezing, one training forward moves every statistic
    assert all(not torch.equal(v, before[k]) for k, v in _bn_buffers(unfrozen).items())

    model.freeze_backbone(net)
    assert {n for n, p in net.named_parameters() if p.requires_grad} == {"fc.weight", "fc.bias"}
    for converted in (False, True):
        if converted:  # new BatchNorm modules: the hook on the root still finds them
            net = convert_sync_batchnorm(net, torch.device("cpu"))
            assert sum(isinstance(m, SyncBatchNormCPU) for m in net.modules()) == 20
        out = net.train()(x)
        # The backbone sees fixed statistics: the eval-mode output, and no buffer moved.
        torch.testing.assert_close(out, expected)
        after = _bn_buffers(net)
        assert after.keys() == before.keys()
        assert all(torch.equal(after[k], before[k]) for k in before)
        assert net.training and net.fc.training  # only the BatchNorm layers were switched
        out.sum().backward()
        assert ({n for n, p in net.named_parameters() if p.grad is not None}
                == {"fc.weight", "fc.bias"})
        net.zero_grad(set_to_none=True)


def test_freeze_backbone_needs_a_classifier() -> None:
    with pytest.raises(ValueError, match="include_top=True"):
        model.freeze_backbone(model.resnet18(include_top=False))


# torchvision's other classifiers by name (--model): built on the meta device where the test
# needs only their structure (no memory, no init time), on the CPU where it runs them.
def _meta(name: str, **kwargs: object) -> nn.Module:
    with torch.device("meta"):
        return model.get_model(name, **kwargs)


@pytest.mark.parametrize("name", ["mobilenet_v3_small", "squeezenet1_0"])
def test_a_torchvision_model_by_name_gives_num_classes_logits(name: str) -> None:
    torch.manual_seed(0)
    net = model.get_model(name, num_classes=7).eval()
    assert type(net) is type(torchvision.models.get_model(name))
    with torch.no_grad():
        assert net(torch.randn(INPUT_SHAPE)).shape == (2, 7)


def test_googlenet_has_no_auxiliary_heads_and_converts_input_as_its_weights_need() -> None:
    for name in ("googlenet", "inception_v3"):
        net = _meta(name, num_classes=7)
        assert (net.aux_logits, net.AuxLogits if name == "inception_v3" else net.aux1,
                net.transform_input) == (False, None, True)


@pytest.mark.parametrize(("name", "head"), [
    ("resnet18", "fc"), ("mobilenet_v3_small", "classifier"), ("vit_b_16", "heads"),
    ("swin_t", "head"), ("squeezenet1_0", "classifier")])  # squeezenet: a 1x1 Conv2d
def test_the_classifier_is_the_child_holding_the_last_layer(name: str, head: str) -> None:
    assert model.classifier_name(_meta(name, num_classes=7)) == head


def test_freeze_backbone_trains_only_mobilenets_classifier(caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    torch.manual_seed(0)
    net = model.get_model("mobilenet_v3_small", num_classes=3)
    before = _bn_buffers(net)
    with caplog.at_level(logging.INFO, logger="train"):
        model.freeze_backbone(net)
    trained = {n for n, p in net.named_parameters() if p.requires_grad}
    assert trained == {n for n, _ in net.classifier.named_parameters(prefix="classifier")}
    count = sum(p.numel() for p in net.classifier.parameters())
    total = sum(p.numel() for p in net.parameters())
    assert caplog.messages == [f"--freeze-layers: training only classifier ({count:,} of "
                               f"{total:,} parameters)"]
    net.train()(torch.randn(INPUT_SHAPE))
    assert all(torch.equal(v, before[k]) for k, v in _bn_buffers(net).items())


def test_fsdp_units_are_the_repeated_blocks() -> None:
    from torchvision.models.mobilenetv3 import InvertedResidual
    from torchvision.models.vision_transformer import EncoderBlock

    from multi_train_utils.strategy import RESIDUAL_BLOCKS, fsdp_units

    resnet = _meta("resnet18")  # as before the rule: the residual blocks, in the same order
    assert fsdp_units(resnet) == [m for m in resnet.modules()
                                  if type(m).__name__ in RESIDUAL_BLOCKS]
    for name, block, count in [("vit_b_16", EncoderBlock, 12),
                               ("mobilenet_v3_small", InvertedResidual, 11)]:
        units = fsdp_units(_meta(name))
        assert len(units) == count and all(type(u) is block for u in units), name
    # torch.nn's own layers are no blocks: the whole model is one unit.
    assert fsdp_units(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))) == []


def _hub_file(weights: str) -> Path:
    url = torchvision.models.get_weight(weights).url
    return Path(torch.hub.get_dir()) / "checkpoints" / url.rsplit("/", 1)[-1]


def test_named_weights_come_from_torch_hubs_cache(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    name = "MobileNet_V3_Small_Weights.IMAGENET1K_V1"
    torch.manual_seed(3)
    planted = torchvision.models.mobilenet_v3_small().state_dict()
    _hub_file(name).parent.mkdir(parents=True)
    torch.save(planted, _hub_file(name))

    state = model.named_weights(name, "mobilenet_v3_small")

    assert state.keys() == planted.keys()
    assert all(torch.equal(state[k], planted[k]) for k in planted)
    assert model.named_weights("MobileNet_V3_Small_Weights.DEFAULT", "mobilenet_v3_small"
                               ).keys() == planted.keys()
    assert model.named_weights(str(tmp_path / "model-3.pth"), "mobilenet_v3_small") is None


def test_missing_named_weights_say_where_to_put_them(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    for var in ("https_proxy", "HTTPS_PROXY", "http_proxy"):  # nothing listens: fails at once
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    name = "MobileNet_V3_Small_Weights.IMAGENET1K_V1"
    start = time.monotonic()
    with pytest.raises(ConfigError) as excinfo:
        model.named_weights(name, "mobilenet_v3_small")
    assert time.monotonic() - start < 20
    message, file = str(excinfo.value), _hub_file(name)
    assert "\n" not in message and not file.exists()
    assert message.startswith(f"--weights {name}: cannot load {file} (URLError: "), message
    assert message.endswith(f"); put a copy of {torchvision.models.get_weight(name).url} "
                            "there."), message


@pytest.mark.parametrize("damage", ["truncated", "web page"])
def test_a_damaged_hub_file_is_one_line_saying_to_replace_it(
        damage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A download cut short, or a proxy's page saved under the file's name: the file is named,
    with what to do; nothing is downloaded."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    name = "MobileNet_V3_Small_Weights.IMAGENET1K_V1"
    file = _hub_file(name)
    file.parent.mkdir(parents=True)
    torch.save(torchvision.models.mobilenet_v3_small().state_dict(), file)
    whole = file.read_bytes()
    file.write_bytes(whole[:len(whole) // 2] if damage == "truncated"
                     else b"<!DOCTYPE html><html><body>Sign in to continue</body></html>")
    with pytest.raises(ConfigError) as excinfo:
        model.named_weights(name, "mobilenet_v3_small")
    reason = {"truncated": "RuntimeError: PytorchStreamReader failed reading zip archive",
              "web page": "UnpicklingError: invalid load key, '<'."}[damage]
    message = str(excinfo.value)
    assert message.startswith(f"--weights {name}: cannot load {file} ({reason}"), message
    assert message.endswith(f"); put a copy of {torchvision.models.get_weight(name).url} "
                            "there."), message
    assert "\n" not in message


def test_weights_named_for_another_model_are_refused() -> None:
    other = "ResNet50_Weights.IMAGENET1K_V2"
    for call in (lambda: model.named_weights(other, "mobilenet_v3_small"),
                 lambda: model.check_model("mobilenet_v3_small", 64, other)):
        with pytest.raises(ConfigError, match=r"^--weights ResNet50_Weights.IMAGENET1K_V2 is not a "
                           r"weights name of --model mobilenet_v3_small; its own are "
                           r"MobileNet_V3_Small_Weights\.IMAGENET1K_V1, "):
            call()
    model.check_model("resnet34", 64, "ResNet34_Weights.DEFAULT")  # the template's own ResNets


def test_check_model_refuses_a_crop_size_the_model_cannot_take() -> None:
    with pytest.raises(ConfigError, match=r"^--model vit_b_16 cannot take --val-crop-size 64 crops "
                       r"\(Wrong image height! Expected 224 but got 64!\); use 224\.$"):
        model.check_model("vit_b_16", 224, crops={"--val-crop-size": 64})
    with pytest.raises(ConfigError, match=r"^--model squeezenet1_1 cannot take --img-size 16 crops "
                       r"\(Given input size: .*\); use 224\.$"):
        model.check_model("squeezenet1_1", 16)
    with pytest.raises(ConfigError, match=r"^--model vit_b_16 cannot take --img-size 60 crops "
                       r"\(Input shape indivisible by patch size!\); use 224\.$"):
        model.check_model("vit_b_16", 60)
    model.check_model("vit_b_16", 224)
    model.check_model("vit_b_16", 64, crops={"--val-crop-size": 64})  # a ViT built for 64 px
    model.check_model("regnet_x_400mf", 32)  # not buildable on meta: left to its first forward


def test_check_model_refuses_a_training_batch_batchnorm_sees_one_value_of() -> None:
    """BatchNorm in training needs more than one value per channel: resnet18 at 32 px ends in
    1x1 maps, so a batch of 1 cannot train; 2 images (one process's, or SyncBatchNorm's over
    two processes), or larger crops, can."""
    for name, channels in [("resnet18", 512), ("mobilenet_v3_small", 288)]:
        with pytest.raises(ConfigError) as excinfo:
            model.check_model(name, 32, train_batch=1)
        assert str(excinfo.value) == (
            f"--model {name} cannot train on --batch-size 1 at --img-size 32: BatchNorm would see "
            "one value per channel (Expected more than 1 value per channel when training, got "
            f"input size torch.Size([1, {channels}, 1, 1])); raise --batch-size or --img-size.")
    model.check_model("resnet18", 32, train_batch=2)
    model.check_model("resnet18", 64, train_batch=1)  # 2x2 maps: four values per channel
    model.check_model("resnet18", 32)  # evaluation only: BatchNorm uses its running statistics


def test_vit_weights_for_another_size_build_the_model_at_their_size() -> None:
    """torchvision builds vit_b_16 with its SWAG E2E weights for 384 px crops (``meta["min_size"]``,
    its ``image_size``); so does get_model with that --img-size, and the weights fit. Another
    --img-size is one line naming the size."""
    name = "ViT_B_16_Weights.IMAGENET1K_SWAG_E2E_V1"
    assert model.weights_size("vit_b_16", name) == 384
    assert model.weights_size("vit_b_16", "ViT_B_16_Weights.IMAGENET1K_V1") == 224
    assert model.weights_size("resnet50", "ResNet50_Weights.DEFAULT") is None  # any size
    with torch.device("meta"):
        theirs = torchvision.models.vit_b_16(image_size=384).state_dict()  # as weights= builds
        ours = model.get_model("vit_b_16", num_classes=5, img_size=384)
    assert ours.encoder.pos_embedding.shape == theirs["encoder.pos_embedding"].shape
    assert theirs["encoder.pos_embedding"].shape == (1, (384 // 16) ** 2 + 1, 768)
    from multi_train_utils.checkpoint_io import load_pretrained

    load_pretrained(ours, name, head=model.classifier_name(ours), state=theirs)  # it fits
    model.check_model("vit_b_16", 384, name)
    with pytest.raises(ConfigError) as excinfo:
        model.check_model("vit_b_16", 224, name)
    assert str(excinfo.value) == (f"--weights {name} is for 384 px crops (its position embeddings "
                                  "fit that size alone); use --img-size 384.")


def test_mallopt_returns_freed_fsdp_buffers_to_the_os(monkeypatch: pytest.MonkeyPatch) -> None:
    from multi_train_utils import strategy

    calls = []

    class Libc:
        def __init__(self, name: None) -> None:
            assert name is None

        def mallopt(self, *args: int) -> int:
            calls.append(args)
            return 1

    monkeypatch.setattr(strategy.ctypes, "CDLL", Libc)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    strategy.return_freed_memory()
    assert calls == [(-3, 1 << 20)]  # M_MMAP_THRESHOLD, 1 MiB
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # the user's own choice stands
    strategy.return_freed_memory()
    assert calls == [(-3, 1 << 20)]
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setattr(Libc, "mallopt", property(lambda self: self.missing))  # not glibc
    strategy.return_freed_memory()


def test_load_pretrained_keeps_the_backbone_and_starts_the_named_head_new(
        caplog: pytest.LogCaptureFixture) -> None:
    from multi_train_utils.checkpoint_io import CheckpointError, load_pretrained

    torch.manual_seed(0)
    state = torchvision.models.mobilenet_v3_small().state_dict()  # 1000 classes
    net = model.get_model("mobilenet_v3_small", num_classes=3)
    new_head = net.classifier[3].weight.clone()
    with pytest.raises(CheckpointError, match="does not fit this model"):  # fc is no head here
        load_pretrained(net, "MobileNet_V3_Small_Weights.DEFAULT", state=state)
    with caplog.at_level(logging.INFO, logger="train"):
        load_pretrained(net, "MobileNet_V3_Small_Weights.DEFAULT", head="classifier",
                        state=state)
    own = net.state_dict()
    assert all(torch.equal(own[k], state[k]) for k in own if not k.startswith("classifier.3."))
    assert torch.equal(own["classifier.3.weight"], new_head)
    total = len(own)
    # Only classifier.3 starts new: classifier.0 (576 -> 1024) is the file's.
    assert torch.equal(own["classifier.0.weight"], state["classifier.0.weight"])
    assert caplog.messages == [f"loaded MobileNet_V3_Small_Weights.DEFAULT: {total - 2} of the "
                               f"model's {total} tensors; new for the data's classes: "
                               "classifier.3"]


def test_predict_checks_the_class_count_on_any_classifier() -> None:
    from multi_train_utils.guard import UserError
    from predict import build_model

    torch.manual_seed(0)
    state = model.get_model("mobilenet_v3_small", num_classes=3).state_dict()
    assert not build_model("mobilenet_v3_small", state, 3).training
    with pytest.raises(UserError, match="^the class list has 4 classes but the weights were "
                       "trained for 3;"):
        build_model("mobilenet_v3_small", state, 4)
    with pytest.raises(UserError, match="^the weights do not fit --model resnet18;"):
        build_model("resnet18", state, 3)
