"""The default loader workers follow the machine, and the next batch is copied while one trains.

``my_dataset.default_workers`` is checked with mocked CPU counts (the start-up line that says the
resolved count, in test_launchers.py's one-process run); ``prefetch_to_device`` on CPU
(the batches pass through untouched) and, with a fake stream API, in the order its CUDA path
queues copies (or ``--decode device``'s decodes, each after a host wait for the side stream),
events, waits and ``record_stream`` calls. A real GPU, where there is one, checks it too.
"""

from __future__ import annotations

import collections
import contextlib
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from conftest import ROOT

import device_decode
import my_dataset
from multi_train_utils import distributed_utils, train_eval_utils
from multi_train_utils.data import prefetch_to_device
from multi_train_utils.train_eval_utils import train_one_epoch
from augment import get_transforms

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("device, cpus, batch, workers", [
    (CUDA, 16, 256, 15),  # every CPU but the one that launches the kernels
    (CUDA, 16, 4, 4),  # at most a worker per image of the batch
    (CUDA, 1, 256, 0),  # one CPU: it loads and launches
    (CUDA, 16, 1, 0),
    (CPU, 16, 256, 8),  # on CPU the workers take cores from training: at most 8
    (CPU, 2, 16, 2),
    (CPU, 4, 3, 3),
    (CPU, 16, 1, 0),
])
def test_default_workers_follow_the_device(monkeypatch, device, cpus, batch, workers):
    monkeypatch.setattr(my_dataset, "cpus_per_process", lambda: cpus)
    assert my_dataset.default_workers(batch, device) == workers


def test_default_workers_take_this_process_share_of_the_cpus(monkeypatch):
    # 8 GPU processes of a 16-CPU machine (torchrun sets LOCAL_WORLD_SIZE): 2 CPUs each.
    monkeypatch.setattr(distributed_utils, "usable_cpus", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert my_dataset.default_workers(256, CUDA) == 1
    assert my_dataset.default_workers(256, CPU) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert my_dataset.default_workers(256, CUDA) == 15


def test_on_cpu_the_batches_pass_through_untouched_and_in_order():
    batches = [(torch.full((2, 3), k), torch.tensor([k, k]), f"batch {k}") for k in range(4)]
    out = list(prefetch_to_device(iter(batches), CPU))
    assert len(out) == 4 and all(a is b for a, b in zip(out, batches))
    assert list(prefetch_to_device([], CPU)) == []


class _Stream:
    """A stand-in for ``torch.cuda.Stream`` that writes what is queued on it into ``log``."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.events = name, log, 0

    def record_event(self) -> tuple[str, int]:
        self.events += 1
        self.log.append(("event", self.name, self.events - 1))
        return self.name, self.events - 1

    def wait_event(self, event: tuple[str, int]) -> None:
        self.log.append(("wait", self.name, *event))

    def synchronize(self) -> None:  # the host waits for what is queued on it
        self.log.append(("sync", self.name))


class _Tensor(torch.Tensor):
    """A CPU tensor whose copy to the device and ``record_stream`` are logged, not done."""

    def to(self, device, non_blocking=False):
        self.log.append(("copy", self.tag, self.streams[-1].name, str(device), non_blocking))
        return self

    def record_stream(self, stream):
        self.log.append(("record", self.tag, stream.name))


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's stream API faked: ``(log, make_tensor)``, every call written to ``log``."""
    log: list = []
    compute = _Stream("compute", log)
    streams = [compute]  # the innermost ``with torch.cuda.stream(s)`` last

    @contextlib.contextmanager
    def use(stream):
        streams.append(stream)
        yield
        streams.pop()

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: _Stream("side", log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams[-1])
    monkeypatch.setattr(torch.cuda, "stream", use)

    def make_tensor(tag: str) -> torch.Tensor:
        tensor = torch.zeros(1).as_subclass(_Tensor)
        tensor.tag, tensor.log, tensor.streams = tag, log, streams
        return tensor

    return log, make_tensor


def test_on_cuda_the_next_batch_is_copied_on_a_side_stream_while_this_one_trains(fake_cuda):
    log, make_tensor = fake_cuda

    def loader():
        for k in range(3):
            log.append(("load", k))
            yield make_tensor(f"x{k}"), make_tensor(f"y{k}"), f"path {k}"

    for k, (images, labels, path) in enumerate(prefetch_to_device(loader(), CUDA)):
        assert (images.tag, labels.tag, path) == (f"x{k}", f"y{k}", f"path {k}")  # in order
        log.append(("train", k))

    def copied(k):  # batch k's copies queued on the side stream, its event, their records
        return [*(("copy", f"{t}{k}", "side", "cuda", True) for t in "xy"),
                ("event", "side", k), *(("record", f"{t}{k}", "compute") for t in "xy")]

    def wait(k):  # compute waits for batch k's event: its copies, not the next batch's
        return ("wait", "compute", "side", k)
    # Batch k+1 is loaded and its copy queued before batch k trains, and the wait for batch k
    # is queued on the compute stream before the step that uses it.
    assert log == [("load", 0), *copied(0),
                   ("load", 1), *copied(1), wait(0), ("train", 0),
                   ("load", 2), *copied(2), wait(1), ("train", 1),
                   wait(2), ("train", 2)]


def test_on_cuda_a_namedtuple_batch_keeps_its_type(fake_cuda):
    Batch = collections.namedtuple("Batch", "images labels")
    log, make_tensor = fake_cuda
    (out,) = prefetch_to_device([Batch(make_tensor("x0"), make_tensor("y0"))], CUDA)
    assert type(out) is Batch and (out.images.tag, out.labels.tag) == ("x0", "y0")
    assert ("copy", "y0", "side", "cuda", True) in log


def test_on_cuda_a_batch_of_another_shape_passes_through(fake_cuda):
    log, make_tensor = fake_cuda
    batch = {"images": make_tensor("x0")}  # _unpack explains what train_one_epoch takes
    out = list(prefetch_to_device([batch], CUDA))
    assert len(out) == 1 and out[0] is batch
    assert log == [("event", "side", 0), ("wait", "compute", "side", 0)]  # nothing copied


def test_on_cuda_jpeg_batches_are_decoded_on_the_side_stream_after_a_host_wait(
        fake_cuda, monkeypatch, tmp_path):
    """``--decode device``: each batch's decode is queued on the side stream after the host
    has waited for that stream (nvJPEG's hardware engine ignores stream order, vision#9606),
    then its event; compute waits for the event, the images and labels are recorded for it."""
    log, _ = fake_cuda
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):  # on the fake GPU a copy is logged, the tensor stays here
        if args and str(args[0]) == "cuda":
            log.append(("copy", tuple(self.shape)))
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, stream: log.append(("record", stream.name)))
    paths = [str(p) for p in two_jpegs_and_a_png_twice(tmp_path)]
    dataset = my_dataset.MyDataSet(paths, [0, 1, 2, 3, 4, 5], get_transforms(16, "device")["val"])
    batches = [my_dataset.MyDataSet.collate_fn([dataset[i], dataset[i + 1], dataset[i + 2]])
               for i in (0, 3)]
    expected = [batch.to_device(CPU) for batch in batches]
    decode = device_decode.decode_jpegs
    monkeypatch.setattr(device_decode, "decode_jpegs", lambda data, device: log.append(
        ("decode", torch.cuda.current_stream().name, len(data), str(device)))
        or decode(data, CPU))  # decoded on the CPU, as if on the GPU

    def loader():
        for k, batch in enumerate(batches):
            log.append(("load", k))
            yield batch

    for k, (images, labels) in enumerate(prefetch_to_device(loader(), CUDA)):
        assert torch.equal(images, expected[k][0]) and torch.equal(labels, expected[k][1])
        log.append(("train", k))

    def decoded(k):  # the PNG, decoded in the worker, is copied as it is; then the labels
        return [("sync", "side"), ("decode", "side", 2, "cuda"), ("copy", (3, 30, 40)),
                ("copy", (3,)), ("event", "side", k), ("record", "compute"), ("record", "compute")]
    assert log == [("load", 0), *decoded(0),
                   ("load", 1), *decoded(1), ("wait", "compute", "side", 0), ("train", 0),
                   ("wait", "compute", "side", 1), ("train", 1)]


def two_jpegs_and_a_png_twice(folder):
    """Two JPEGs and a PNG, twice."""
    from PIL import Image
    paths = []
    for k in range(6):
        colour = (40 * k, 255 - 40 * k, 90)
        path = folder / (f"{k}.png" if k % 3 == 0 else f"{k}.jpg")
        Image.new("RGB", (40, 30), colour).save(path)
        paths.append(path)
    return paths


def test_train_one_epoch_takes_its_batches_through_the_prefetcher(monkeypatch):
    seen = []

    def spy(batches, device):
        for batch in prefetch_to_device(batches, device):
            seen.append((batch, device))
            yield batch

    monkeypatch.setattr(train_eval_utils, "prefetch_to_device", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 3))
    batches = [(torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8), torch.tensor([0, 2]))
               for _ in range(3)]
    loss = train_one_epoch(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, CPU, 0)
    assert [b for b, _ in seen] == batches and {d for _, d in seen} == {CPU}
    assert loss > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_every_batch_arrives_whole_and_in_order():
    source = [(torch.randint(0, 256, (64, 3, 224, 224), dtype=torch.uint8).pin_memory(),
               torch.arange(64) + k) for k in range(5)]
    out = []
    for images, labels in prefetch_to_device(source, CUDA):
        assert images.is_cuda and labels.is_cuda
        images.float().sum()  # compute on the current stream while the next copy runs
        out.append((images.cpu(), labels.cpu()))
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(out, source))
    assert len(out) == 5


EXIT_WITH_LIVE_WORKERS = """
import sys
sys.path.insert(0, sys.argv[1])
from my_dataset import loader_kwargs
import torch
from torch.utils.data import DataLoader, TensorDataset
kwargs = loader_kwargs(2, torch.device("cpu"))
kwargs.pop("collate_fn")
loader = DataLoader(TensorDataset(torch.arange(40.0)), batch_size=4, **kwargs)
for batch in loader:  # a module-level loader: its persistent workers live on to the exit
    pass
print("trained")
"""


def test_a_script_exits_though_its_loader_workers_ignore_sigterm():
    """The workers ignore stop signals (a stopping run still needs its last batches); at exit
    Python ends daemonic children with SIGTERM and waits, so the template ends them first."""
    res = subprocess.run([sys.executable, "-c", EXIT_WITH_LIVE_WORKERS, str(ROOT)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout == "trained\n", res.stderr[-2000:]
    assert "Exception ignored" not in res.stderr, res.stderr[-2000:]
