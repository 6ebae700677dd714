"""benchmarks/figures.py on tiny inputs, and docs/how-it-works.md against the committed figures.

No training runs here: ``make figures`` (minutes) makes the real ones; these tests check the
code that turns runs into figures and sentences, and that the page shows what the JSON says.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch.utils.data import DistributedSampler

from conftest import ROOT

from benchmarks import figures as make_figures

DOC, FIGURES = ROOT / "docs" / "how-it-works.md", ROOT / "docs" / "figures"
MAX_PNG_BYTES = 300_000


def fake_history(epochs: int, loss0: float, acc_step: float, seconds: float) -> list[dict]:
    """Epoch records shaped as the training script writes them to metrics.jsonl."""
    return [{"epoch": e, "train_loss": loss0 / (e + 1), "val_acc": min(1.0, 0.2 + acc_step * e),
             "val_loss": 1.0, "lr": 0.01, "epoch_seconds": seconds,
             "train_images_per_sec": 480 / seconds} for e in range(epochs)]


@pytest.fixture(scope="module")
def summary() -> dict:
    histories = {"1x32": fake_history(4, 1.5, 0.2, 3.0),
                 "1x32_1thread": fake_history(4, 1.5, 0.2, 4.0),
                 "2x16_syncbn": fake_history(4, 1.5, 0.2, 4.0),
                 "2x16_no_syncbn": fake_history(4, 1.8, 0.15, 3.5)}
    histories["2x16_syncbn"][2]["val_acc"] += 1 / 120  # one more image right at epoch 2
    return {**make_figures.summarise(histories, val_images=120, epochs=4), "elapsed_s": 200.0}


def is_small_png(path) -> bool:
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < MAX_PNG_BYTES


@pytest.mark.parametrize("world", [2, 3, 5])
def test_split_table_is_what_distributed_sampler_gives_padding_with_the_first_samples(world):
    table = make_figures.split_table(11, world, batch_size=2, seed=0)
    for rank in range(world):
        assert table["ranks"][rank] == list(DistributedSampler(range(11), world, rank, seed=0))
    # The permutation of epoch 0 drawn independently: the padding is its first samples again.
    perm = torch.randperm(11, generator=torch.Generator().manual_seed(0)).tolist()
    total = math.ceil(11 / world) * world
    padded = sorted((rank + i * world, idx) for rank in range(world)
                    for i, (idx, pad) in enumerate(zip(table["ranks"][rank], table["padded"][rank]))
                    if pad)
    assert [pos for pos, _ in padded] == list(range(11, total))
    assert [idx for _, idx in padded] == perm[:total - 11]
    kept = [i for r in range(world) for i, pad in zip(table["ranks"][r], table["padded"][r])
            if not pad]
    assert sorted(kept) == list(range(11))  # every sample once, apart from the padding
    for rank, batches in enumerate(table["batches"]):  # drop_last: full batches, in order
        share = table["ranks"][rank]
        assert batches == [share[k:k + 2] for k in range(0, len(share) - 1, 2)]


def test_split_figure_is_a_small_png(tmp_path):
    make_figures.plot_split(11, (2, 3), 2, tmp_path / "split.png")
    assert is_small_png(tmp_path / "split.png")


def test_summary_computes_speed_up_and_largest_gaps(summary):
    assert summary["speed"]["1x32"] == {"epoch_seconds": 3.0, "train_images_per_sec": 160.0}
    assert summary["speedup"] == pytest.approx(3.0 / 4.0)
    assert summary["max_diff"]["2x16_syncbn"]["val_acc"] == pytest.approx(1 / 120)
    assert summary["max_diff"]["2x16_syncbn"]["train_loss"] == 0
    assert summary["max_diff"]["2x16_no_syncbn"]["train_loss"] == pytest.approx(0.3)
    assert "1x32" not in summary["max_diff"]


def test_speed_and_curve_figures_from_a_fake_history_are_small_pngs(summary, tmp_path):
    make_figures.plot_speed(summary, tmp_path / "speed.png")
    make_figures.plot_curves(summary, tmp_path / "curves.png")
    assert is_small_png(tmp_path / "speed.png") and is_small_png(tmp_path / "curves.png")


def test_sentences_are_formatted_from_the_json(summary):
    blocks = make_figures.render_blocks(summary)
    assert "**0.75x** the speed of one" in blocks["speed"]
    assert "160.0 images/s (3.00 s per epoch)" in blocks["speed"]
    assert "2 processes x 16, SyncBatchNorm: 0.0083 and 0.0000" in blocks["curves"]
    assert "in 200 s" in blocks["made"]


# ---------------------------------------------------------------- the committed page
def test_the_page_says_what_figures_json_says():
    committed = json.loads((FIGURES / "figures.json").read_text(encoding="utf-8"))
    text = DOC.read_text(encoding="utf-8")
    for name, body in make_figures.render_blocks(committed).items():
        found = re.findall(rf"<!-- figures:{name} -->\n(.*?)\n<!-- /figures -->", text, re.S)
        assert found == [body], f"block {name!r}: rerun `make figures`"


def test_the_page_embeds_every_figure_and_each_is_small():
    text = DOC.read_text(encoding="utf-8")
    for name in ("split.png", "speed.png", "curves.png"):
        assert f"](figures/{name})" in text
        assert is_small_png(FIGURES / name), name


def test_the_page_explains_the_points_in_the_order_a_learner_needs_them():
    headings = re.findall(r"^## (.+)$", DOC.read_text(encoding="utf-8"), re.M)
    order = ["Processes and ranks", "sampler", "Batches", "all-reduce", "SyncBatchNorm",
             "evaluation", "logging", "Rank 0", "learning rate", "torchrun"]
    where = [next((i for i, h in enumerate(headings) if key.lower() in h.lower()), None)
             for key in order]
    assert None not in where and where == sorted(where), list(zip(order, where))
