"""``--decode device`` (issue 37): the workers read the files and draw the augmentation, the
main process decodes and augments whole batches; the result is what ``--decode workers`` gives.

On the CPU, as CI runs it: the worker's draws equal ``transforms.v2``'s; a batch equals the
workers path, train and val (pixel for pixel on the CPU, where both use v2's uint8 kernel;
within a level with the float arithmetic of a GPU); a file the decoder fails on falls back image
by image and is listed as today; TorchCodec's decoder is used where installed (faked here), PIL
where no decoder library is; a messy folder trains and lists its bad files; two processes train
as with ``--decode workers``. The stream discipline on CUDA is tested with a faked stream API in
test_loader_and_prefetch.py; the checks that need a GPU run where there is one
(``make bench-gpu``).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import LAUNCH, TORCHRUN, flags, read_metrics
from PIL import Image
from test_bad_data import jpeg_without_scan, write_jpeg
from torch.utils.data import DataLoader
from torchvision.transforms import v2

import device_decode
import my_dataset
from benchmarks.photos import make_photos
from device_decode import BatchAugment, Encoded, JpegBatch
from multi_train_utils.data import prefetch_to_device
from multi_train_utils.train_eval_utils import IGNORE_INDEX
from my_dataset import MyDataSet, load_image_tensor, loader_kwargs
from augment import get_transforms

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def seeded(seed: int, epoch: int, index: int) -> None:
    """The generator state ``MyDataSet`` gives sample ``index`` of ``epoch``."""
    torch.manual_seed(((seed * 1_000_003 + epoch) * 1_000_003 + index) % 2**63)


# ---------------------------------------------------------------- the worker's draws
def test_crop_boxes_and_flips_are_v2s_for_the_same_seed_epoch_and_index(monkeypatch):
    """What v2's transforms really applied (recorded by spies) against the plans, for 400
    samples of sizes from 1 px to very wide and tall (ten misses: v2's central fallback)."""
    applied = []
    crop_params = v2.RandomResizedCrop.make_params
    monkeypatch.setattr(v2.RandomResizedCrop, "make_params",
                        lambda self, inputs: applied.append(crop_params(self, inputs)) or
                        applied[-1])
    flip = v2.RandomHorizontalFlip.transform
    monkeypatch.setattr(v2.RandomHorizontalFlip, "transform",
                        lambda self, inpt, params: applied.append("flip") or
                        flip(self, inpt, params))
    transform = get_transforms(16)["train"]
    device_plan = BatchAugment(transform)
    rng, images = np.random.default_rng(0), {}
    flips = extreme = 0
    for index in range(400):
        height, width = (int(x) for x in rng.choice([1, 2, 7, 40, 120, 375], 2))
        seed, epoch = index % 3, index % 5
        seeded(seed, epoch, index)
        if (height, width) not in images:
            images[height, width] = torch.zeros(3, height, width, dtype=torch.uint8)
        image = images[height, width]
        assert transform(image).shape == (3, 16, 16)
        (params, *flipped), applied[:] = applied, []
        seeded(seed, epoch, index)
        plan = device_plan(Encoded(image, (height, width))).plan  # the size alone is read
        applied.clear()
        assert plan.box == (params["top"], params["left"], params["height"], params["width"])
        assert plan.flip == bool(flipped) and plan.size == (16, 16)
        flips += plan.flip
        extreme += max(height, width) / min(height, width) > 20  # v2's central fallback
    assert 150 < flips < 250 and extreme > 50


def test_validation_plan_is_v2s_resize_then_centre_crop():
    transform = get_transforms(32)["val"]
    for height, width in [(36, 36), (36, 39), (39, 36), (37, 80), (500, 333), (3, 1000), (1, 1)]:
        image = torch.arange(3 * height * width, dtype=torch.float64).view(3, height, width)
        expected = transform(image)
        plan = BatchAugment(transform)(Encoded(torch.zeros(0), (height, width))).plan
        resized = v2.Resize(36)(image)
        assert plan.size == tuple(resized.shape[1:]) and plan.crop == (32, 32) and not plan.flip
        assert torch.equal(device_decode._augment(image, plan), expected)


def test_a_pipeline_the_device_cannot_run_is_one_sentence():
    with pytest.raises(ValueError, match="use --decode workers"):
        BatchAugment(v2.Compose([v2.RandomResizedCrop(8), v2.ColorJitter(0.4)]))


# ---------------------------------------------------------------- what the workers send
@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> list[str]:
    """Photo-like JPEGs (one progressive) and the files the device decoder cannot take: CMYK,
    grey, PNG, EXIF-rotated."""
    folder = tmp_path_factory.mktemp("mixed")
    paths = make_photos(folder, 9, width=90, height=67)
    with Image.open(paths[0]) as img:
        img.save(folder / "progressive.jpg", quality=90, progressive=True)
        img.convert("CMYK").save(folder / "cmyk.jpg", quality=95)
        img.convert("L").save(folder / "grey.jpg", quality=95)
        img.save(folder / "image.png")
        exif = Image.Exif()
        exif[0x0112] = 6  # rotated 90 degrees
        img.save(folder / "rotated.jpg", quality=95, exif=exif)
    return [*paths, *(str(folder / n) for n in ("progressive.jpg", "cmyk.jpg", "grey.jpg",
                                                  "image.png", "rotated.jpg"))]


def test_workers_send_bytes_only_of_what_the_device_decoder_reads_as_the_cpu(mixed):
    reader = BatchAugment(get_transforms(32)["train"])
    sent = {Path(p).name: reader.read(p) for p in mixed}
    for name, sample in sent.items():
        pixels = load_image_tensor(str(Path(mixed[0]).parent / name))
        assert sample.hw == tuple(pixels.shape[1:]), name
        as_bytes = name.endswith(".jpg") and name.split(".")[0] not in ("cmyk", "grey", "rotated")
        assert sample.data.dim() == (1 if as_bytes else 3), name  # bytes, else pixels
        if not as_bytes:
            assert torch.equal(sample.data, pixels)  # decoded as --decode workers decodes it
    assert sent["rotated.jpg"].hw == (90, 67)  # turned: the EXIF orientation applied


@pytest.mark.parametrize("split, sizes", [("train", {}), ("val", {}), (  # a crop past the
    "val", {"val_resize_size": 21, "val_crop_size": 32})])  # resize: padded as v2's CenterCrop
def test_device_batches_equal_workers_batches(mixed, split, sizes, monkeypatch):
    batches, augment = {}, device_decode._augment
    for decode in ("workers", "device", "device as on a GPU"):
        if decode == "device as on a GPU":  # float arithmetic, as v2 and this path use there
            monkeypatch.setattr(device_decode, "_augment", lambda x, plan: augment(x.float(), plan))
        dataset = MyDataSet(mixed, list(range(len(mixed))),
                            get_transforms(32, decode.split()[0], **sizes)[split], seed=7)
        dataset.set_epoch(3)
        loader = DataLoader(dataset, batch_size=5, **loader_kwargs(2, CPU))  # 2 workers
        batches[decode] = list(prefetch_to_device(loader, CPU))
    assert [len(labels) for _, labels in batches["device"]] == [5, 5, 4]
    for want, got, as_on_gpu in zip(*batches.values()):
        assert got[0].dtype == torch.uint8 and got[0].shape == want[0].shape
        assert torch.equal(got[1], want[1]) and torch.equal(as_on_gpu[1], want[1])  # labels
        assert torch.equal(got[0], want[0])  # the same pixels
        assert (as_on_gpu[0].int() - want[0].int()).abs().max() <= 1  # the issue asks <= 2


def test_a_file_the_decoder_fails_on_falls_back_image_by_image_and_is_listed(tmp_path,
                                                                             monkeypatch, caplog):
    good = [write_jpeg(tmp_path / f"{i}.jpg", i, (40, 30)) for i in range(3)]
    bad = jpeg_without_scan(good[0], tmp_path / "no-scan.jpg")  # a header, but no image data
    paths = [str(good[0]), str(bad), str(good[1]), str(good[2])]
    log_file = tmp_path / "skipped_files.txt"
    dataset = MyDataSet(paths, [0, 1, 2, 3], get_transforms(16, "device")["val"],
                        skip_log=log_file)
    batch = MyDataSet.collate_fn([dataset[i] for i in range(4)])
    assert isinstance(batch, JpegBatch) and [len(s) for s in batch.shapes] == [1] * 4  # bytes
    calls = []
    decode = device_decode.decode_jpegs
    monkeypatch.setattr(device_decode, "decode_jpegs",
                        lambda data, device: calls.append(len(data)) or decode(data, device))
    with caplog.at_level(logging.WARNING, logger="my_dataset"):
        images, labels = batch.to_device(CPU)
    assert calls == [4, 1, 1, 1, 1]  # the batch, then image by image
    assert labels.tolist() == [0, IGNORE_INDEX, 2, 3] and images[1].max() == 0
    workers = MyDataSet(paths, [0, 1, 2, 3], get_transforms(16)["val"])
    assert all(torch.equal(images[i], workers[i][0]) for i in (0, 2, 3))
    (line,) = log_file.read_text(encoding="utf-8").splitlines()
    assert line.startswith(f"{bad}\tnot a readable image at load time (RuntimeError: ")
    assert f"skipping {bad}: not a readable image at load time" in caplog.text


def test_a_file_the_decoder_fails_on_is_black_under_the_training_crop_too(tmp_path):
    good = write_jpeg(tmp_path / "0.jpg", 0, (40, 30))
    bad = str(jpeg_without_scan(good, tmp_path / "no-scan.jpg"))
    dataset = MyDataSet([bad] * 4, [1] * 4, get_transforms(16, "device")["train"])
    torch.manual_seed(0)  # crop boxes away from the top left corner
    batch = MyDataSet.collate_fn([dataset[i] for i in range(4)])
    assert any(plan.box[:2] != (0, 0) for plan in batch.plans)
    images, labels = batch.to_device(CPU)
    assert images.shape == (4, 3, 16, 16) and images.max() == 0
    assert labels.tolist() == [IGNORE_INDEX] * 4


# ---------------------------------------------------------------- which decoder
def test_torchcodec_decodes_where_installed_and_pil_where_no_library_does(mixed, monkeypatch):
    """TorchCodec is not installed here: its ``decode_jpeg`` is faked by torchvision's, called
    as TorchCodec is (a list of 1-D uint8 tensors, ``device=``; RGB and EXIF are its defaults)."""
    calls = []

    def codec_decode_jpeg(source, *, device="cpu"):
        calls.append((len(source), torch.device(device)))
        return [my_dataset.decode_jpeg(x, mode=my_dataset.ImageReadMode.RGB,
                                       apply_exif_orientation=True) for x in source]

    expected = [load_image_tensor(p) for p in mixed]
    monkeypatch.setattr(my_dataset, "codec_decode_jpeg", codec_decode_jpeg)
    assert all(map(torch.equal, map(load_image_tensor, mixed), expected))
    assert calls == [(1, CPU)] * 13  # the JPEGs, one call each (the PNG went to PIL)
    dataset = MyDataSet(mixed[:4], [0] * 4, get_transforms(32, "device")["val"])
    dataset.collate_fn([dataset[i] for i in range(4)]).to_device(CPU)
    assert calls[-1] == (4, CPU)  # one batched call
    monkeypatch.setattr(my_dataset, "codec_decode_jpeg", None)
    monkeypatch.setattr(my_dataset, "decode_jpeg", None)  # torchvision's gone too: PIL decodes
    for path, want in zip(mixed, expected):
        assert (load_image_tensor(path).int() - want.int()).abs().float().mean() < 2, path
    raw = torch.frombuffer(bytearray(Path(mixed[0]).read_bytes()), dtype=torch.uint8)
    assert torch.equal(my_dataset.decode_jpegs([raw], CPU)[0], load_image_tensor(mixed[0]))


# ---------------------------------------------------------------- training
def test_a_messy_folder_trains_with_device_decoding_and_lists_its_bad_files(tiny_data, tmp_path,
                                                                          plain):
    root, val = tmp_path / "flowers", tmp_path / "val"
    shutil.copytree(tiny_data, root)
    good = root / "daisy" / "0000.jpg"
    with Image.open(good) as img:
        img.save(root / "daisy" / "progressive.jpg", quality=90, progressive=True)
        img.convert("CMYK").save(root / "roses" / "cmyk.jpg")
        img.convert("L").save(root / "tulips" / "grey.jpg")
        img.save(root / "sunflowers" / "image.png")
    data = good.read_bytes()
    (root / "roses" / "truncated.jpg").write_bytes(data[:len(data) // 2])
    (root / "roses" / "zero.jpg").write_bytes(b"")
    (root / "tulips" / "not-an-image.jpg").write_text("a text file")
    shutil.copytree(tiny_data, val)  # validation sees every file: the undecodable one is met
    jpeg_without_scan(good, val / "daisy" / "no-scan.jpg")
    out = tmp_path / "run"
    res = plain(flags(root, out, "--epochs", "1", "--decode", "device", "--val-path", str(val),
                      "--tensorboard"))  # its first images come through the device path too
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    listed = {Path(line.split("\t")[0]).name: line.split("\t")[1] for line in
              (out / "skipped_files.txt").read_text(encoding="utf-8").splitlines()}
    assert listed.keys() == {"truncated.jpg", "zero.jpg", "not-an-image.jpg", "no-scan.jpg"}
    assert listed["no-scan.jpg"].startswith("not a readable image at load time")
    (metrics,) = read_metrics(out)
    assert metrics["train_loss"] > 0 and 0 <= metrics["val_acc"] <= 1
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_two_processes_with_device_decoding_train_as_with_workers(reference_run, tiny_data,
                                                                  tmp_path, plain):
    """Epoch 0 of the 3-epoch reference run (torchrun, 2 processes, ``--decode workers``; the
    cosine schedule gives epoch 0 the same lr in any run) against one epoch with ``--decode
    device``. On the CPU both paths give the same pixels, so the numbers must agree to their
    rounding: a tolerance would hide a real difference here, where ResNet18 on 4 images of
    32 px a step amplifies a grey level in one pixel into a visibly different loss."""
    out = tmp_path / "run"
    res = plain(["--standalone", "--nproc_per_node=2", LAUNCH,
                 *flags(tiny_data, out, "--epochs", "1", "--decode", "device")], patch=TORCHRUN)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    (got,), want = read_metrics(out), read_metrics(reference_run.out)[0]
    for key in ("train_loss", "val_acc", "val_loss"):
        assert got[key] == pytest.approx(want[key], abs=2e-6), key


# ---------------------------------------------------------------- on a GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_device_batches_match_the_cpu_path(mixed):
    """nvJPEG (or TorchCodec's decoder) on the GPU, a batch ahead on a side stream: every batch
    whole, in order, and near the CPU path (decoders differ slightly in their IDCT and chroma
    upsampling; the augmentation alone is checked within 2 levels on CPU-decoded input)."""
    dataset = MyDataSet(mixed * 8, list(range(len(mixed) * 8)),
                        get_transforms(64, "device")["train"], seed=1)
    dataset.set_epoch(0)
    batches = [MyDataSet.collate_fn([dataset[i] for i in range(k, k + 16)])
               for k in range(0, len(dataset) - 15, 16)]
    on_cpu = [b.to_device(CPU) for b in batches]
    for (images, labels), (want, want_labels) in zip(prefetch_to_device(batches, CUDA), on_cpu):
        assert images.is_cuda and torch.equal(labels.cpu(), want_labels)
        diff = (images.cpu().int() - want.int()).abs()
        assert diff.float().mean() < 1.5 and diff.max() <= 40, (diff.float().mean(), diff.max())
    augment = BatchAugment(get_transforms(64)["train"])  # the augmentation alone: the same
    samples = []  # CPU-decoded pixels resized on the GPU and on the CPU
    for i, path in enumerate(mixed):
        seeded(0, 0, i)
        samples.append(augment(load_image_tensor(path)))
    batch = Encoded.collate(samples, list(range(len(samples))))
    (on_gpu, _), (on_cpu, _) = batch.to_device(CUDA), batch.to_device(CPU)
    assert (on_gpu.cpu().int() - on_cpu.int()).abs().max() <= 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_one_process_trains_with_device_decoding(tiny_data, tmp_path, plain):
    args = flags(tiny_data, tmp_path / "run", "--epochs", "2", "--decode", "device")
    args[args.index("--device") + 1] = "cuda"
    res = plain(args)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert [m["epoch"] for m in read_metrics(tmp_path / "run")] == [0, 1]
