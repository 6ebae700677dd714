"""Importing the library changes nothing in the process: the exit hook, the signal handlers and
the heartbeat's thread come from the calls a script makes (guard.guarded, stop_requests,
workers_ignore_stop_signals, Heartbeat), where its reader sees them."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

# In a fresh interpreter: the dependencies first (their own import effects are theirs), then
# every module of multi_train_utils; prints what changed.
IMPORT_ALL = """
import atexit, importlib, json, os, pkgutil, signal, threading
import numpy, torch, torch.distributed, torch.utils.data

def state():
    return {"atexit hooks": atexit._ncallbacks(),
            "signal handlers": {s.name: repr(signal.getsignal(s)) for s in signal.valid_signals()
                                if isinstance(s, signal.Signals)},
            "threads": threading.active_count(), "torch threads": torch.get_num_threads(),
            "environment": dict(os.environ)}

before = state()
import multi_train_utils
names = [m.name for m in pkgutil.iter_modules(multi_train_utils.__path__)]
for name in names:
    importlib.import_module(f"multi_train_utils.{name}")
after = state()
print(json.dumps({"modules": names,
                  "changed": {k: [before[k], after[k]] for k in before if before[k] != after[k]}}))
"""


def test_importing_the_library_changes_nothing_in_the_process():
    res = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert {"guard", "heartbeat", "distributed_utils", "train_eval_utils"} <= set(out["modules"])
    assert out["changed"] == {}
