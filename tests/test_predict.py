"""predict.py: the right numbers for each image, per-image failures, one-line usage errors.

A randomly initialised 3-class ResNet-18 at 64 px stands in for a trained model; the expected
probabilities come from a direct forward pass with the preprocessing written out here, not from
predict.py's own helpers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageOps
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

import predict
from model import get_model

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ["daisy", "rose", "tulip"]
IMG_SIZE = 64  # recorded in the checkpoint's args; the CLI must pick it up from there
PAIR = re.compile(r"^(?P<name>\w+): (?P<prob>[01]\.\d{3})$")


def _noise_image(path: Path, size: tuple[int, int], mode: str = "RGB", seed: int = 0) -> Path:
    generator = torch.Generator().manual_seed(seed)
    channels = len(Image.new(mode, (1, 1)).getbands())
    pixels = torch.randint(0, 256, (size[1], size[0], channels), dtype=torch.uint8,
                           generator=generator)
    Image.frombytes(mode, size, pixels.numpy().tobytes()).save(path)
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A training output dir as training writes it: full checkpoint with its class list and
    args, bare per-epoch weights, class_indices.json; plus some images."""
    out = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    model = get_model("resnet18", num_classes=len(CLASSES)).eval()
    train_args = {"model": "resnet18", "img_size": IMG_SIZE}
    torch.save({"model": model.state_dict(), "epoch": 2, "args": train_args, "classes": CLASSES},
               out / "checkpoint.pth")
    (out / "weights").mkdir()
    torch.save(model.state_dict(), out / "weights" / "model-2.pth")
    (out / "class_indices.json").write_text(json.dumps({str(i): c for i, c in enumerate(CLASSES)}))
    images = out / "images"
    (images / "sub").mkdir(parents=True)
    # Different sizes, modes and extension cases, one in a sub-folder.
    paths = [_noise_image(images / "a_rgb.jpg", (90, 70), "RGB", seed=1),
             _noise_image(images / "b_gray.PNG", (70, 100), "L", seed=2),
             _noise_image(images / "sub" / "c_rgba.png", (80, 80), "RGBA", seed=3)]
    (images / "notes.txt").write_text("not an image")  # left out of the folder
    _noise_image(images / ".hidden.jpg", (40, 40))  # hidden: left out too
    bad = out / "bad.jpg"
    bad.write_bytes(b"\xff\xd8 this is not really a JPEG")
    return {"dir": out, "model": model, "images": paths, "bad": bad}


def _expected_probs(model: torch.nn.Module, path: Path, img_size: int = IMG_SIZE) -> torch.Tensor:
    """Softmax over classes, ``(C,)``, with the validation preprocessing spelled out by hand."""
    with Image.open(path) as img:  # PIL here, so a second decoder checks predict.py's
        image = TF.pil_to_tensor(ImageOps.exif_transpose(img).convert("RGB"))
    image = v2.CenterCrop(img_size)(v2.Resize(int(img_size * 256 / 224), antialias=True)(image))
    x = image.float() / 255
    x = ((x - torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1))
         / torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1))
    with torch.no_grad():
        return model(x.unsqueeze(0)).softmax(dim=1)[0]


def _top1(line: str) -> tuple[str, float]:
    match = PAIR.match(line.split("\t")[1])
    return match["name"], float(match["prob"])


def _main(capsys: pytest.CaptureFixture, *argv: str | Path) -> tuple[int, list[str], list[str]]:
    """Run predict.main in-process: (exit code, stdout lines, stderr lines)."""
    try:
        predict.main(predict.get_args_parser().parse_args([str(a) for a in argv]))
        code = 0
    except SystemExit as exc:
        code = int(exc.code)
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


# Run by ``plain`` (conftest): ``python predict.py ARGS`` in a process forked from one that has
# imported torch already, so the command line costs no torch import.
AS_PREDICT = (f"import runpy, sys\nsys.argv[0] = {str(ROOT / 'predict.py')!r}\n"
              "runpy.run_path(sys.argv[0], run_name='__main__')\nsys.exit(0)\n")


def _cli(plain, *args: str | Path) -> subprocess.CompletedProcess:
    return plain([str(a) for a in args], patch=AS_PREDICT, timeout=120)


def test_predict_matches_direct_forward(run: dict) -> None:
    # batch_size=2 over 3 images also covers a last, partial batch.
    preprocess = predict.load_predictor(run["dir"] / "checkpoint.pth")[2]  # 64 px, recorded
    preds = list(predict.predict(run["model"], run["images"], CLASSES, preprocess,
                                 torch.device("cpu"), top_k=5, batch_size=2))

    assert [p.path for p in preds] == run["images"]
    for pred in preds:
        expected = _expected_probs(run["model"], pred.path)
        assert pred.error is None
        torch.testing.assert_close(pred.probs, expected, atol=1e-5, rtol=1e-4)
        assert pred.probs.sum().item() == pytest.approx(1.0, abs=1e-5)
        assert len(pred.top_k) == len(CLASSES)  # top_k=5 is capped at the 3 classes
        assert ([name for name, _ in pred.top_k]
                == [CLASSES[i] for i in expected.argsort(descending=True)])


def test_checkpoint_gives_model_classes_and_img_size(run: dict,
                                                     capsys: pytest.CaptureFixture) -> None:
    # No --model, --img-size or --class-indices: all come from the checkpoint.
    code, lines, err = _main(capsys, "--weights", run["dir"] / "checkpoint.pth", "--top-k", "2",
                             run["dir"] / "images")

    assert code == 0, err
    # no notes.txt, no hidden file
    assert [Path(line.split("\t")[0]) for line in lines] == sorted(run["images"])
    for line in lines:
        path, *pairs = line.split("\t")
        parsed = [PAIR.match(pair) for pair in pairs]
        assert len(parsed) == 2 and all(parsed), line
        top = _expected_probs(run["model"], Path(path)).topk(2)
        assert [m["name"] for m in parsed] == [CLASSES[i] for i in top.indices.tolist()]
        assert [float(m["prob"]) for m in parsed] == pytest.approx(top.values.tolist(), abs=6e-4)


def test_full_checkpoint_copied_alone_still_knows_its_classes(
        run: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    weights = tmp_path / "model_best.pth"  # no class_indices.json or args.json near it
    weights.write_bytes((run["dir"] / "checkpoint.pth").read_bytes())
    image = run["images"][0]

    code, (line,), _ = _main(capsys, "--weights", weights, "--top-k", "1", image)

    expected = _expected_probs(run["model"], image)
    assert code == 0
    assert _top1(line) == (CLASSES[expected.argmax()],
                           pytest.approx(expected.max().item(), abs=6e-4))


def test_bare_weights_read_the_runs_files_and_flags_override(run: dict, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    # weights/model-2.pth with args.json and class_indices.json one folder up, as training writes.
    out = tmp_path / "out"
    (out / "weights").mkdir(parents=True)
    weights = out / "weights" / "model-2.pth"
    weights.write_bytes((run["dir"] / "weights" / "model-2.pth").read_bytes())
    (out / "class_indices.json").write_text((run["dir"] / "class_indices.json").read_text())
    image = run["images"][0]

    (out / "args.json").write_text(json.dumps({"model": "resnet18", "img_size": IMG_SIZE,
                                               "epochs": 3}))
    code, (line,), err = _main(capsys, "--weights", weights, "--top-k", "1", image)
    assert code == 0 and err == []
    assert _top1(line)[1] == pytest.approx(_expected_probs(run["model"], image).max().item(),
                                           abs=6e-4)

    # Flags win over args.json, which here names an architecture the weights do not fit.
    (out / "args.json").write_text(json.dumps({"model": "resnet34", "img_size": 224}))
    code, (line,), _ = _main(capsys, "--weights", weights, "--top-k", "1", "--model", "resnet18",
                             "--img-size", "32", image)
    assert code == 0
    assert _top1(line)[1] == pytest.approx(_expected_probs(run["model"], image, 32).max().item(),
                                           abs=6e-4)

    # Nothing recorded: 224 px, said in a warning (a model trained at 64 px would be fed
    # 224 px crops).
    (out / "args.json").unlink()
    code, (line,), err = _main(capsys, "--weights", weights, "--model", "resnet18", "--top-k", "1",
                               image)
    assert code == 0
    assert _top1(line)[1] == pytest.approx(_expected_probs(run["model"], image, 224).max().item(),
                                           abs=6e-4)
    (warning,) = err
    assert warning.startswith("warning: ") and "224 px" in warning and "--img-size" in warning


def test_bad_images_are_reported_and_the_rest_predicted_exit_1(run: dict, tmp_path: Path,
                                                               plain) -> None:
    empty = tmp_path / "empty.png"
    empty.touch()
    good = run["images"][0]

    result = _cli(plain, "--weights", run["dir"] / "checkpoint.pth", run["bad"], good, empty,
                  tmp_path / "typo.jpg")

    assert result.returncode == 1
    assert [line.split("\t")[0] for line in result.stdout.splitlines()] == [str(good)]
    assert "Traceback" not in result.stderr
    errors = result.stderr.splitlines()
    assert errors[0].startswith(f"cannot read {run['bad']}: not a readable image")
    assert errors[1] == f"cannot read {empty}: empty file"  # worded as training's scan words it
    assert errors[2].startswith(f"cannot read {tmp_path / 'typo.jpg'}: ")  # a typo stops nothing
    assert errors[3:] == ["error: 3 of 4 images could not be read."]


def _write_classes(path: Path, names: list[str]) -> Path:
    path.write_text(json.dumps({str(i): c for i, c in enumerate(names)}))
    return path


def test_class_count_mismatch_is_one_error_line_exit_2(run: dict, tmp_path: Path, plain) -> None:
    four = _write_classes(tmp_path / "four.json", [*CLASSES, "sunflower"])

    result = _cli(plain, "--weights", run["dir"] / "checkpoint.pth", "--class-indices", four,
                  run["images"][0])

    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == [
        "error: the class list has 4 classes but the weights were trained for 3; "
        "pass the class_indices.json of the same training run."]


@pytest.mark.parametrize("case", ["missing-weights", "foreign-weights", "missing-class-indices",
                                  "bad-class-indices", "no-class-names", "other-architecture"])
def test_usage_errors_are_one_line_exit_2(run: dict, tmp_path: Path, case: str,
                                          capsys: pytest.CaptureFixture) -> None:
    weights, extra = run["dir"] / "weights" / "model-2.pth", ["--model", "resnet18"]
    if case == "missing-weights":
        weights = tmp_path / "nope.pth"
    elif case == "foreign-weights":
        weights = tmp_path / "notes.pth"
        weights.write_text("not a checkpoint\n")
    elif case == "missing-class-indices":
        extra += ["--class-indices", tmp_path / "nope.json"]
    elif case == "bad-class-indices":  # index 1 missing: labels would shift
        (tmp_path / "gap.json").write_text(json.dumps({"0": "a", "2": "c"}))
        extra += ["--class-indices", tmp_path / "gap.json"]
    elif case == "no-class-names":  # bare weights copied alone
        weights = tmp_path / "model-2.pth"
        weights.write_bytes((run["dir"] / "weights" / "model-2.pth").read_bytes())
    else:
        extra = ["--model", "resnet34"]

    code, out, err = _main(capsys, "--weights", weights, *extra, run["images"][0])

    assert (code, out) == (2, [])
    (line,) = err
    expected = {"missing-weights": f"{tmp_path / 'nope.pth'} does not exist",
                "foreign-weights": f"{weights} is not a readable PyTorch checkpoint",
                "missing-class-indices": f"cannot read class indices {tmp_path / 'nope.json'}",
                "bad-class-indices": "must map the indices 0..N-1 to class names",
                "no-class-names": f"{weights} holds none and there is no class_indices.json",
                "other-architecture": "the weights do not fit --model resnet34"}[case]
    assert line.startswith("error: ") and expected in line, line


def test_a_crop_the_runs_model_cannot_take_is_one_line_exit_2(
        run: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A squeezenet1_1 trained at 32 px, asked for 16 px crops: its last pooling would have no
    output. The run's model and size come from the checkpoint; the line says to use 32."""
    torch.manual_seed(0)
    state = get_model("squeezenet1_1", num_classes=len(CLASSES)).state_dict()
    weights = tmp_path / "checkpoint.pth"
    torch.save({"model": state, "epoch": 0, "args": {"model": "squeezenet1_1", "img_size": 32},
                "classes": CLASSES}, weights)

    code, out, err = _main(capsys, "--weights", weights, "--img-size", "16", run["images"][0])

    assert (code, out) == (2, [])
    (line,) = err
    assert re.fullmatch(r"error: --model squeezenet1_1 cannot take --img-size 16 crops \(Given "
                        r"input size: .*\); use 32\.", line), line
    code, (line,), _ = _main(capsys, "--weights", weights, "--top-k", "1", run["images"][0])
    assert code == 0 and _top1(line)[0] in CLASSES  # at its own 32 px


def test_folders_are_searched_and_each_image_predicted_once(run: dict) -> None:
    images = run["dir"] / "images"
    named = images / "notes.txt"  # named explicitly: tried whatever its extension

    found = predict.collect_images([run["images"][0], images, named])

    assert found == [run["images"][0], images / "b_gray.PNG", images / "sub" / "c_rgba.png", named]


def test_format_keeps_one_image_per_line() -> None:
    # A tab or newline in a file or class name would split the line; they are escaped.
    pred = predict.Prediction(Path("/data/a\tb\nc.jpg"), torch.tensor([0.75, 0.25]),
                              [("sun\tflowers", 0.75), ("roses", 0.25)])
    assert (predict.format_prediction(pred)
            == "/data/a\\tb\\nc.jpg\tsun\\tflowers: 0.750\troses: 0.250")


def test_reader_quitting_early_ends_quietly(run: dict) -> None:
    # `predict.py photos/ | head -1`: the reading end is closed before the first line.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([sys.executable, str(ROOT / "predict.py"), "--weights",
                                 str(run["dir"] / "checkpoint.pth"), str(run["dir"] / "images")],
                                cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE, text=True,
                                timeout=120)
    finally:
        os.close(write_end)
    assert result.returncode == -13 and result.stderr == ""  # killed by SIGPIPE, as cat would be
