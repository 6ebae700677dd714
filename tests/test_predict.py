"""predict.py: right numbers for each image, per-image failures, and one-sentence usage errors.

A randomly initialised 3-class ResNet-18 at 64x64 px stands in for a trained model; the expected
probabilities come from a direct forward pass over preprocessing written out here from the
contract, not from predict.py's own helpers.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageOps
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

import predict
from model import MODELS

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ["daisy", "rose", "tulip"]
IMG_SIZE = 64  # recorded in the checkpoint's args; the CLI must pick it up from there
PAIR = re.compile(r"^(?P<name>\w+): (?P<prob>[01]\.\d{3})$")


def _noise_image(path: Path, size: tuple[int, int], mode: str, seed: int) -> Path:
    generator = torch.Generator().manual_seed(seed)
    channels = len(Image.new(mode, (1, 1)).getbands())
    pixels = torch.randint(0, 256, (size[1], size[0], channels), dtype=torch.uint8, generator=generator)
    Image.frombytes(mode, size, pixels.numpy().tobytes()).save(path)
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A training output dir: full checkpoint (with its class list, as training saves it), bare
    per-epoch weights, class indices, images."""
    out = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    model = MODELS["resnet18"](num_classes=len(CLASSES)).eval()
    train_args = {"model": "resnet18", "num_classes": len(CLASSES), "img_size": IMG_SIZE}
    torch.save({"model": model.state_dict(), "optimizer": {}, "epoch": 2, "args": train_args, "classes": CLASSES},
               out / "checkpoint.pth")
    (out / "weights").mkdir()
    torch.save(model.state_dict(), out / "weights" / "model-2.pth")
    (out / "class_indices.json").write_text(json.dumps({str(i): c for i, c in enumerate(CLASSES)}))

    images = out / "images"
    images.mkdir()
    # Different sizes, modes and extension cases; notes.txt must be ignored by the folder scan.
    paths = [
        _noise_image(images / "a_rgb.jpg", (90, 70), "RGB", seed=1),
        _noise_image(images / "b_gray.PNG", (70, 100), "L", seed=2),
        _noise_image(images / "c_rgba.png", (80, 80), "RGBA", seed=3),
    ]
    (images / "notes.txt").write_text("not an image")
    bad = out / "bad.jpg"
    bad.write_bytes(b"\xff\xd8 this is not really a JPEG")
    return {"dir": out, "model": model, "images": paths, "bad": bad}


def _expected_probs(model: torch.nn.Module, path: Path, img_size: int = IMG_SIZE) -> torch.Tensor:
    """Softmax over classes, ``(C,)``, with the validation preprocessing spelled out by hand."""
    with Image.open(path) as img:  # PIL here, so a second decoder checks predict.py's
        image = TF.pil_to_tensor(ImageOps.exif_transpose(img).convert("RGB"))
    image = v2.CenterCrop(img_size)(v2.Resize(int(img_size * 256 / 224), antialias=True)(image))
    x = image.float() / 255
    x = (x - torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    with torch.no_grad():
        return model(x.unsqueeze(0)).softmax(dim=1)[0]


def _run_cli(*args: str | Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "predict.py"), *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_predict_matches_direct_forward(run: dict) -> None:
    # batch_size=2 over 3 images also covers a last, partial batch.
    preds = predict.predict(run["model"], run["images"], CLASSES, IMG_SIZE, "cpu", top_k=5, batch_size=2)

    assert [p.path for p in preds] == run["images"]
    for pred in preds:
        expected = _expected_probs(run["model"], pred.path)
        assert pred.ok
        assert pred.probs.shape == (len(CLASSES),)
        assert pred.probs.sum().item() == pytest.approx(1.0, abs=1e-5)
        torch.testing.assert_close(pred.probs, expected, atol=1e-5, rtol=1e-4)
        assert len(pred.top_k) == len(CLASSES)  # top_k=5 is capped at the 3 classes
        assert pred.top_k[0][0] == CLASSES[expected.argmax().item()]
        probs = [p for _, p in pred.top_k]
        assert probs == sorted(probs, reverse=True)


def test_main_reads_model_and_img_size_from_checkpoint(run: dict, capsys: pytest.CaptureFixture) -> None:
    images = run["dir"] / "images"
    # No --model, --img-size or --class-indices: all come from the checkpoint and its folder.
    args = predict.get_args_parser().parse_args(
        ["--weights", str(run["dir"] / "checkpoint.pth"), "--top-k", "2", str(images)]
    )

    predict.main(args)  # returns normally: exit code 0

    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(run["images"])  # notes.txt skipped
    for line, path in zip(lines, sorted(run["images"])):
        shown_path, *pairs = line.split("\t")
        assert Path(shown_path) == path
        assert len(pairs) == 2
        parsed = [PAIR.match(pair) for pair in pairs]
        assert all(parsed), line
        expected = _expected_probs(run["model"], path)
        top = expected.topk(2)
        assert [m["name"] for m in parsed] == [CLASSES[i] for i in top.indices.tolist()]
        for m, p in zip(parsed, top.values.tolist()):
            assert float(m["prob"]) == pytest.approx(p, abs=6e-4)


def test_each_image_is_one_line_of_tab_separated_fields_whatever_its_name() -> None:
    # A tab or newline in a file or class name, and bytes that are not UTF-8 (kept by Python as
    # surrogates), would split the line or fail to print; they are escaped as in skipped_files.txt.
    path = Path(os.fsdecode(b"/data/a\tb\nc\xff.jpg"))
    pred = predict.Prediction(path=path, probs=torch.tensor([0.75, 0.25]),
                              top_k=[("sun\tflowers", 0.75), ("roses", 0.25)])
    line = predict.format_prediction(pred)
    assert line == "/data/a\\tb\\nc\\xff.jpg\tsun\\tflowers: 0.750\troses: 0.250"
    line.encode("utf-8")  # printable anywhere


def test_a_non_ascii_name_in_an_ascii_locale_is_printed_escaped(run: dict, tmp_path: Path) -> None:
    """LC_ALL=C with PYTHONUTF8=0 makes stdout ASCII: printing "rosé.jpg" raised
    UnicodeEncodeError after the first predictions."""
    image = tmp_path / "rosé.jpg"
    shutil.copy(run["images"][0], image)
    result = _run_cli("--weights", run["dir"] / "checkpoint.pth", image,
                      LC_ALL="C", PYTHONUTF8="0")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"{tmp_path}/ros\\xe9.jpg\t"), result.stdout


def test_cli_reports_bad_image_and_still_predicts_the_rest(run: dict) -> None:
    good = run["images"][0]
    result = _run_cli(
        "--weights", run["dir"] / "weights" / "model-2.pth",  # bare state dict
        "--class-indices", run["dir"] / "class_indices.json",
        "--model", "resnet18",
        "--img-size", IMG_SIZE,
        run["bad"], good,
    )

    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if "bad.jpg" in line], result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{good}\t")
    assert lines[0].count(": ") == len(CLASSES)  # default top-5 capped at 3 classes


@pytest.mark.parametrize("weights", ["checkpoint.pth", "weights/model-2.pth"])
def test_cli_class_count_mismatch_is_one_line_exit_2(run: dict, tmp_path: Path, weights: str) -> None:
    # Checked against the checkpoint's class list, or, for bare weights, against the classifier.
    four = tmp_path / "class_indices.json"
    four.write_text(json.dumps({str(i): c for i, c in enumerate([*CLASSES, "sunflower"])}))

    result = _run_cli("--weights", run["dir"] / weights, "--class-indices", four, run["images"][0])

    assert result.returncode == 2
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    (message,) = result.stderr.strip().splitlines()
    assert "4 classes" in message and "3" in message


@pytest.mark.parametrize("missing", ["weights", "class-indices"])
def test_missing_file_exits_2_with_message(
    run: dict, tmp_path: Path, missing: str, caplog: pytest.LogCaptureFixture
) -> None:
    files = {"weights": run["dir"] / "checkpoint.pth", "class-indices": run["dir"] / "class_indices.json"}
    files[missing] = tmp_path / "nope"
    args = predict.get_args_parser().parse_args(
        ["--weights", str(files["weights"]), "--class-indices", str(files["class-indices"]), str(run["images"][0])]
    )

    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exc:
        predict.main(args)

    assert exc.value.code == 2
    assert any(str(tmp_path / "nope") in r.getMessage() for r in caplog.records)


def test_load_checkpoint_accepts_full_and_bare_and_strips_module_prefix(run: dict, tmp_path: Path) -> None:
    reference = run["model"].state_dict()
    wrapped = {}  # DDP, torch.compile(DDP(model)) and DDP(torch.compile(model)) state dicts
    for prefix in ("module.", "_orig_mod.module.", "module._orig_mod."):
        wrapped[prefix] = tmp_path / f"{prefix.replace('.', '-')}pth"
        torch.save({f"{prefix}{k}": v for k, v in reference.items()}, wrapped[prefix])
    # the PyTorch tutorial's general checkpoint, and Lightning's key
    for key in ("model_state_dict", "state_dict"):
        wrapped[key] = tmp_path / f"{key}.pth"
        torch.save({"epoch": 3, key: reference, "optimizer_state_dict": {"state": {}}},
                   wrapped[key])

    for path, expected_args, expected_classes in [
        (run["dir"] / "checkpoint.pth", {"model": "resnet18", "num_classes": 3, "img_size": IMG_SIZE}, CLASSES),
        (run["dir"] / "weights" / "model-2.pth", {}, None),
        *[(path, {}, None) for path in wrapped.values()],
    ]:
        state_dict, train_args = predict.load_checkpoint(path)
        assert train_args == expected_args
        assert predict.load_checkpoint_with_classes(path)[2] == expected_classes
        assert state_dict.keys() == reference.keys()
        assert all(torch.equal(state_dict[k], reference[k]) for k in reference)


def test_wrong_architecture_is_a_usage_error(run: dict) -> None:
    state_dict, _ = predict.load_checkpoint(run["dir"] / "checkpoint.pth")
    with pytest.raises(predict.UsageError, match="resnet34"):
        predict.build_model("resnet34", state_dict, len(CLASSES))


def test_weights_without_our_classifier_are_called_another_architecture() -> None:
    # e.g. a MobileNet's, whose head is classifier.1.weight: it has a classifier, not ours
    foreign = {"features.0.0.weight": torch.zeros(16, 3, 3, 3),
               "classifier.1.weight": torch.zeros(5, 16)}
    with pytest.raises(predict.UsageError) as err:
        predict.build_model("resnet18", foreign, len(CLASSES))
    assert str(err.value) == ("The weights have no fc.weight, the classifier of this template's "
                              "ResNets (weights of another architecture, or a backbone saved "
                              "without its head), so they cannot predict classes; train a head "
                              "for them first (the training script's --weights).")


def test_class_indices_must_cover_0_to_n_minus_1(tmp_path: Path) -> None:
    path = tmp_path / "classes.json"
    path.write_text(json.dumps({"0": "a", "1": "b", "2": "c", "3": "d", "4": "e", "5": "f", "6": "g",
                                "7": "h", "8": "i", "9": "j", "10": "k"}))
    assert predict.load_class_names(path)[9:] == ["j", "k"]  # numeric order, not "10" < "2"

    path.write_text(json.dumps({"0": "a", "2": "c"}))
    with pytest.raises(predict.UsageError, match="0..N-1"):
        predict.load_class_names(path)
    # Two outputs under one name would print as one label twice; training ignores such a file.
    for names in ({"0": "a", "1": "a"}, {"0": "a", "1": ""}, ["a", "a"]):
        path.write_text(json.dumps(names))
        with pytest.raises(predict.UsageError, match="an empty name or names one twice"):
            predict.load_class_names(path)


def test_run_files_are_found_from_a_relative_or_linked_weights_path(run: dict, tmp_path: Path,
                                                                     monkeypatch) -> None:
    from utils import find_run_file

    expected = run["dir"] / "class_indices.json"
    monkeypatch.chdir(run["dir"] / "weights")  # --weights model-2.pth, typed in weights/
    assert find_run_file("model-2.pth", "class_indices.json") == expected
    link = tmp_path / "best.pth"  # a link elsewhere to the run's weights
    link.symlink_to(run["dir"] / "weights" / "model-2.pth")
    assert find_run_file(link, "class_indices.json") == expected


def test_load_image_applies_exif_orientation_and_makes_rgb(tmp_path: Path) -> None:
    path = tmp_path / "sideways.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    Image.new("L", (40, 20), 100).save(path, exif=exif)

    image = predict.load_image(path)

    assert image.shape == (3, 40, 20)  # (C, H, W): width and height swapped by the EXIF tag
    assert image.dtype == torch.uint8


def _main(*argv: str | Path) -> int:
    """Run predict.main in-process; the exit code (0 when it returns normally)."""
    try:
        predict.main(predict.get_args_parser().parse_args([str(a) for a in argv]))
    except SystemExit as exc:
        return int(exc.code)
    return 0


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_folder_skips_hidden_files_but_explicit_ones_are_read(
    run: dict, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "photos"
    folder.mkdir()
    good = _noise_image(folder / "g0.jpg", (40, 40), "RGB", seed=4)
    apple_double = folder / "._g0.jpg"  # macOS resource fork: an image name, not image bytes
    apple_double.write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X")
    _noise_image(folder / ".thumb.png", (40, 40), "RGB", seed=5)  # hidden, though readable

    with caplog.at_level(logging.INFO):
        code = _main("--weights", run["dir"] / "checkpoint.pth", folder)

    assert code == 0, _errors(caplog)
    assert [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()] == [str(good)]
    assert predict.collect_images([apple_double]) == [apple_double]  # named explicitly: still read


def test_dangling_symlink_in_folder_is_reported(
    run: dict, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "photos"
    folder.mkdir()
    good = _noise_image(folder / "a.jpg", (40, 40), "RGB", seed=6)
    (folder / "b.jpg").symlink_to(tmp_path / "gone.jpg")

    with caplog.at_level(logging.INFO):
        code = _main("--weights", run["dir"] / "checkpoint.pth", folder)

    assert code == 1
    assert [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()] == [str(good)]
    errors = _errors(caplog)
    assert any(str(folder / "b.jpg") in e and "dangling symlink" in e and "gone.jpg" in e for e in errors), errors


def test_dataset_root_is_searched_recursively_without_loops(
    run: dict, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "flowers"  # training's layout: one sub-folder per class, nested folders allowed
    (root / "daisy").mkdir(parents=True)
    (root / "rose" / "more").mkdir(parents=True)
    (root / ".cache").mkdir()
    expected = [
        _noise_image(root / "daisy" / "d0.jpg", (40, 40), "RGB", seed=7),
        _noise_image(root / "rose" / "more" / "r1.png", (40, 40), "RGB", seed=8),
        _noise_image(root / "rose" / "r0.JPG", (40, 40), "RGB", seed=9),
    ]
    _noise_image(root / ".cache" / "c.jpg", (40, 40), "RGB", seed=10)  # hidden folder: skipped
    (root / "rose" / "loop").symlink_to(root, target_is_directory=True)  # must neither hang nor repeat

    assert predict.collect_images([root]) == sorted(expected)
    # A file named beside its folder (or twice) is predicted once, where first named.
    rose = expected[2]
    assert predict.collect_images([rose, root / "rose", f"{root}/rose/../rose/r0.JPG"]) == \
        [rose, root / "rose" / "loop" / "daisy" / "d0.jpg", expected[1]]
    with caplog.at_level(logging.INFO):
        code = _main("--weights", run["dir"] / "checkpoint.pth", root)

    assert code == 0, _errors(caplog)
    assert [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()] == list(map(str, sorted(expected)))


@pytest.mark.parametrize("best", [True, False])
def test_weights_directory_exits_2_and_names_the_file_inside(
    run: dict, tmp_path: Path, best: bool, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint.pth").write_bytes((run["dir"] / "checkpoint.pth").read_bytes())
    if best:
        (out / "model_best.pth").write_bytes((run["dir"] / "checkpoint.pth").read_bytes())

    with caplog.at_level(logging.INFO):
        code = _main("--weights", out, run["images"][0])

    assert code == 2
    (message,) = _errors(caplog)
    assert "is a directory" in message and "does not exist" not in message
    assert f"--weights {out / ('model_best.pth' if best else 'checkpoint.pth')}" in message


def test_damaged_or_foreign_weights_exit_2_with_one_line(
    run: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Zeroed bytes inside a tensor: torch.load alone would predict with silently wrong weights.
    damaged = tmp_path / "damaged.pth"
    data = bytearray((run["dir"] / "checkpoint.pth").read_bytes())
    data[len(data) // 2 : len(data) // 2 + 1000] = bytes(1000)
    damaged.write_bytes(data)
    torch.load(damaged, map_location="cpu", weights_only=True)  # what torch alone does: no error
    foreign = tmp_path / "notes.pth"
    foreign.write_text("not a checkpoint\n")

    for path, words in [(damaged, r"is corrupt \(.* fails its CRC check\)"),
                        (foreign, "is not a readable PyTorch checkpoint")]:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            code = _main("--weights", path, run["images"][0])

        assert code == 2
        (message,) = _errors(caplog)
        assert re.search(f"Weights file {re.escape(str(path))} {words}", message), message


def test_bare_weights_use_the_runs_args_json_unless_flags_say_otherwise(
    run: dict, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    # A copy of training's output dir for a bare per-epoch file: weights/model-2.pth, with
    # args.json and class_indices.json one folder up.
    out = tmp_path / "out"
    (out / "weights").mkdir(parents=True)
    weights = out / "weights" / "model-2.pth"
    weights.write_bytes((run["dir"] / "weights" / "model-2.pth").read_bytes())
    (out / "class_indices.json").write_text((run["dir"] / "class_indices.json").read_text())
    image = run["images"][0]

    def top1(*flags: str | Path) -> float:
        with caplog.at_level(logging.INFO):
            code = _main("--weights", weights, "--top-k", "1", *flags, image)
        assert code == 0, _errors(caplog)
        (line,) = capsys.readouterr().out.splitlines()
        return float(PAIR.match(line.split("\t")[1])["prob"])

    (out / "args.json").write_text(json.dumps({"model": "resnet18", "img_size": IMG_SIZE, "epochs": 3}))
    assert top1() == pytest.approx(_expected_probs(run["model"], image).max().item(), abs=6e-4)

    # Explicit flags win over args.json (which here names an architecture the weights do not fit).
    (out / "args.json").write_text(json.dumps({"model": "resnet34", "img_size": 224}))
    expected_32 = _expected_probs(run["model"], image, img_size=32).max().item()
    assert top1("--model", "resnet18", "--img-size", "32") == pytest.approx(expected_32, abs=6e-4)


def _top_names(line: str) -> list[str]:
    return [PAIR.match(pair)["name"] for pair in line.split("\t")[1:]]


def test_full_checkpoint_alone_uses_its_own_class_names(
    run: dict, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    # model_best.pth copied on its own: no class_indices.json here or one folder up.
    weights = tmp_path / "deployed" / "model_best.pth"
    weights.parent.mkdir()
    weights.write_bytes((run["dir"] / "checkpoint.pth").read_bytes())
    image = run["images"][0]

    with caplog.at_level(logging.INFO):
        code = _main("--weights", weights, "--top-k", "3", image)

    assert code == 0, _errors(caplog)
    (line,) = capsys.readouterr().out.splitlines()
    expected = _expected_probs(run["model"], image)
    assert _top_names(line) == [CLASSES[i] for i in expected.argsort(descending=True).tolist()]


@pytest.mark.parametrize("given", [True, False], ids=["--class-indices", "found-next-to-weights"])
def test_class_list_in_another_order_than_the_checkpoint_is_one_line_exit_2(
    run: dict, tmp_path: Path, given: bool
) -> None:
    # Same names, other order: used as given, every label would be wrong and nothing would say so.
    weights = tmp_path / "model_best.pth"
    weights.write_bytes((run["dir"] / "checkpoint.pth").read_bytes())
    reordered = tmp_path / ("rev.json" if given else "class_indices.json")
    reordered.write_text(json.dumps({str(i): c for i, c in enumerate(reversed(CLASSES))}))

    flags = ["--class-indices", reordered] if given else []
    result = _run_cli("--weights", weights, *flags, run["images"][0])

    assert result.returncode == 2
    assert result.stdout == ""
    (message,) = result.stderr.strip().splitlines()
    assert str(reordered) in message and str(weights) in message
    assert "another order" in message
    assert ("drop --class-indices" if given else "move it out") in message


@pytest.mark.parametrize("weights", ["bare", "checkpoint-without-classes"])
def test_weights_without_a_class_list_still_need_class_indices(
    run: dict, tmp_path: Path, weights: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "alone" / "model.pth"
    path.parent.mkdir()
    if weights == "bare":
        path.write_bytes((run["dir"] / "weights" / "model-2.pth").read_bytes())
    else:  # saved before checkpoints carried their classes, or by another tool
        checkpoint = torch.load(run["dir"] / "checkpoint.pth", weights_only=True)
        del checkpoint["classes"]
        torch.save(checkpoint, path)

    with caplog.at_level(logging.INFO):
        code = _main("--weights", path, "--model", "resnet18", run["images"][0])

    assert code == 2
    (message,) = _errors(caplog)
    assert "No --class-indices given" in message and str(path) in message

    caplog.clear()
    (path.parent / "class_indices.json").write_text((run["dir"] / "class_indices.json").read_text())
    with caplog.at_level(logging.INFO):
        assert _main("--weights", path, "--model", "resnet18", "--img-size", IMG_SIZE, run["images"][0]) == 0, \
            _errors(caplog)


def test_a_gpu_index_that_is_not_there_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert predict.resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(predict.UsageError, match=re.escape(
            "--device cuda:7: only 2 GPU(s) are visible (cuda:0 to cuda:1).")):
        predict.resolve_device("cuda:7")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_img_size_from_nowhere_warns_and_a_flag_against_args_json_warns(
    run: dict, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    # Bare weights copied alone: no record of the 64 px they were trained at.
    weights = tmp_path / "lone" / "model-2.pth"
    weights.parent.mkdir()
    weights.write_bytes((run["dir"] / "weights" / "model-2.pth").read_bytes())
    image = run["images"][0]
    flags = ["--weights", weights, "--model", "resnet18", "--class-indices", run["dir"] / "class_indices.json",
             "--top-k", "1", image]

    def top1(*extra: str | Path) -> float:
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert _main(*flags, *extra) == 0, _errors(caplog)
        (line,) = capsys.readouterr().out.splitlines()
        return float(PAIR.match(line.split("\t")[1])["prob"])

    assert top1() == pytest.approx(_expected_probs(run["model"], image, img_size=224).max().item(), abs=6e-4)
    (warning,) = _warnings(caplog)
    assert str(weights) in warning and "assuming 224 px" in warning and "--img-size" in warning

    (weights.parent / "args.json").write_text(json.dumps({"model": "resnet18", "img_size": IMG_SIZE}))
    assert top1() == pytest.approx(_expected_probs(run["model"], image).max().item(), abs=6e-4)
    assert _warnings(caplog) == []

    assert top1("--img-size", "32") == pytest.approx(
        _expected_probs(run["model"], image, img_size=32).max().item(), abs=6e-4)
    (warning,) = _warnings(caplog)
    assert warning.startswith(f"--img-size 32 differs from the {IMG_SIZE} recorded in {weights.parent / 'args.json'}")


def test_reader_quitting_early_exits_141_without_a_traceback(run: dict) -> None:
    # `predict.py photos/ | head -1`: the pipe's reading end is gone; closing it before the first
    # line makes the broken pipe certain instead of a race with head.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, str(ROOT / "predict.py"), "--weights", str(run["dir"] / "checkpoint.pth"),
             str(run["dir"] / "images")],
            cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
        )
    finally:
        os.close(write_end)

    assert result.returncode == 141, result.stderr
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr


def test_quoted_glob_patterns_are_expanded_and_one_matching_nothing_fails(
    run: dict, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    images = run["dir"] / "images"
    nothing = tmp_path / "none*.jpg"

    with caplog.at_level(logging.INFO):
        code = _main("--weights", run["dir"] / "checkpoint.pth", images / "[cb]_*", nothing)

    assert code == 1
    shown = [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()]
    assert shown == [str(images / "b_gray.PNG"), str(images / "c_rgba.png")]  # sorted
    assert [e for e in _errors(caplog) if "could not be read" not in e] == [
        f"No file matches the pattern {nothing}; check the folder and the pattern."
    ]
    literal = _noise_image(tmp_path / "x[1].jpg", (40, 40), "RGB", seed=11)  # a name, not a pattern
    _noise_image(tmp_path / "x1.jpg", (40, 40), "RGB", seed=12)
    assert predict.collect_images([literal]) == [literal]


def test_folder_reports_files_training_would_not_read_but_named_ones_are_read(
    run: dict, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "phone"
    folder.mkdir()
    good = _noise_image(folder / "a.jpg", (40, 40), "RGB", seed=13)
    # PNG bytes under an iPhone-style name: PIL will not write HEIC, and the decoders read by content.
    heic = [_noise_image(folder / f"{name}.png", (40, 40), "RGB", seed=14).rename(folder / f"{name}.HEIC")
            for name in ("b", "c")]
    (folder / "d.psd").write_bytes(b"8BPS")
    (folder / "e.jp2").write_bytes(b"jp2")
    (folder / "README").write_text("no extension")
    (folder / ".f.heic").write_bytes(b"hidden: silent, as before")

    with caplog.at_level(logging.INFO):
        code = _main("--weights", run["dir"] / "checkpoint.pth", folder)

    assert code == 0, _errors(caplog)
    assert [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()] == [str(good)]
    assert _warnings(caplog) == [
        f"Folder {folder}: left out 5 files whose extension training does not read (2 .heic, 1 .jp2, "
        "1 .psd, 1 without extension); name a file explicitly to classify it anyway."
    ]

    with caplog.at_level(logging.INFO):  # named explicitly: classified whatever the extension
        assert _main("--weights", run["dir"] / "checkpoint.pth", heic[0]) == 0, _errors(caplog)
    assert [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()] == [str(heic[0])]


def test_empty_file_is_reported_as_training_reports_it(
    run: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    empty = tmp_path / "empty.png"
    empty.touch()

    with caplog.at_level(logging.INFO):
        code = _main("--weights", run["dir"] / "checkpoint.pth", empty, run["images"][0])

    assert code == 1
    assert _errors(caplog)[0] == f"Cannot read image {empty}: empty file"


def test_a_fifo_named_or_matched_is_reported_not_waited_on(run: dict, tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe.jpg")  # opening it for reading would block until a writer came
    good = tmp_path / "good.jpg"
    good.write_bytes(Path(run["images"][0]).read_bytes())
    result = _run_cli("--weights", run["dir"] / "checkpoint.pth", "--device", "cpu",
                      tmp_path / "*.jpg")  # a quoted pattern matching both
    assert result.returncode == 1, result.stderr
    assert [line.split("\t")[0] for line in result.stdout.splitlines()] == [str(good)]
    assert f"Cannot read image {tmp_path / 'pipe.jpg'}: not a regular file" in result.stderr
    # Inside a folder it is reported too, not dropped without a word.
    assert predict.collect_images([tmp_path]) == [good, tmp_path / "pipe.jpg"]


def test_a_photo_over_the_decompression_bomb_limit_is_refused_as_in_training(
        run: dict, tmp_path: Path, caplog, monkeypatch) -> None:
    huge = tmp_path / "huge.jpg"  # torchvision decodes JPEGs of any size: the check must run
    Image.new("RGB", (1000, 1000)).save(huge)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 400_000)  # 1 MP is over twice this
    with caplog.at_level(logging.INFO):
        code = _main("--weights", run["dir"] / "checkpoint.pth", huge, run["images"][0])
    assert code == 1
    assert _errors(caplog)[0] == (f"Cannot read image {huge}: image too large (over 1 "
                                  "megapixels, PIL's decompression-bomb limit); downscale it")


def test_a_home_folder_in_paths_is_expanded(run: dict, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(run["dir"]))
    args = predict.get_args_parser().parse_args(["--weights=~/checkpoint.pth", "~/x.jpg"])
    assert args.weights == run["dir"] / "checkpoint.pth"
    assert predict.collect_images(["~/x.jpg"]) == [run["dir"] / "x.jpg"]
