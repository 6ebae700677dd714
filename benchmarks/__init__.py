"""Is the template fast by default? ``python -m benchmarks`` measures it side by side, one stage
after another, and prints one table (see ``__main__.py`` for the commands).

One module per stage, each measuring one claim against its baseline in the same run:

- ``pipeline``: images/s per DataLoader worker, the classic template's PIL path against ours
  (and, on CUDA, decoding with nvJPEG in the main process);
- ``loop``: ``train_one_epoch`` against a bare forward/backward/step loop, and its overhead;
- ``scaling``: images/s, time per epoch and peak memory per rank with 1, 2, 4 ... processes,
  and what the machine, the gradient all-reduce and SyncBN each cost;
- ``with_data``: ``train_one_epoch`` fed by the training script's loader, beside the loader
  alone and the compute alone, so the table says which of the two limits training;
- ``decode``: ``--decode workers`` against ``--decode device`` (issue 37): each decoder per
  worker and batched on the device, decode and augment, training with data under each, and the
  compute alone;
- ``shards`` (when named): the loader's img/s over an image folder, over the tar shards
  ``make_shards.py`` makes of it, and over those shards from a local HTTP server (nginx, else
  Python's http.server), on 2 CPU processes.

Shared by the stages: ``common`` (timing, model set-up as the training script does it),
``photos`` (the test JPEGs) and ``report`` (host, versions, commit, table rows, chart).

Every timing is taken after warm-up steps and repeated ``--repeats`` times. The two variants of
a comparison run back to back in each repeat (alternating which goes first), so a burst of load
from another program hits both; a comparison reports the median img/s of each and the median of
the per-repeat ratios, scaling the best repeat of each process count. Every repeat is kept in
``<output-dir>/benchmark.json`` next to the chart ``benchmark.png``, with the commit the numbers
were measured on (``git describe --always --dirty``). Numbers from a shared or busy machine are
noisy: the load average is recorded with them.

A new stage is a module beside these with two functions, added to ``STAGES`` in ``__main__.py``:
``run(args, device, report) -> {"<its key>": {...}}`` measures and returns its part of the
report (earlier stages' parts are in ``report``), and ``table_lines(report) -> list[str]``
formats its section of the table.
"""
