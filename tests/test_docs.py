"""README.md and docs/*.md against the code: every flag, path, module and measured number.

Fast: no training and no subprocess but one ``git``; each script's flags come from its own
``get_args_parser()``. Relative links and their anchors are checked in test_budget.py.

The rules, as these tests read the Markdown:

- **Flags.** A *command* is a line of a fenced block (``\\``-continued lines joined) or an inline
  code span. A ``--flag`` in a command belongs to the last tool named before it in that command
  (``TOOLS``: our scripts by their file names, torchrun and ``torch.distributed.launch`` by
  torch's own parsers, srun, sbatch, docker and tensorboard by a short allow-list each). A flag
  with no tool before it (in prose, in a span of its own, in a ``#`` comment) belongs to the
  training scripts, or to a tool named in the same paragraph, list item, table row or fenced
  block. Either way it must be one of that tool's flags.
- **Paths.** A word in code (a span or a fenced block) is a path of this repository when its
  first part is one of the repository's top-level folders (``docs/``, ``tests/``,
  ``multi_train_utils/``, ...), or when it is a bare ``*.py`` or ``*.md`` file name; it must
  exist (a bare name anywhere in the repository). Every other path is a user's example:
  ``flower_photos/``, ``runs/flowers/model_best.pth``, ``/shared/...``, ``DATA/train``,
  ``weights/model-N.pth``. A dotted name whose first part is one of our modules
  (``my_dataset.loader_kwargs``, ``guard.signals_deferred``) must be an attribute of it; not
  ``model.``, which is also every model variable's name (``model.no_sync()``).
- **Modules.** Every module of ``multi_train_utils/`` is in the README's file list and in
  docs/own-project.md's table.
- **Measured numbers.** A paragraph that starts with a label,
  ``Measured YYYY-MM-DD [HH:MM UTC] on MACHINE, commit REV [(note)], torch VERSION: ...``,
  covers itself and everything after it up to the next heading. REV is what
  ``git describe --always --dirty`` printed where the numbers were measured (``-dirty``: with
  changes not yet committed on top of it), and must be in this repository's history. Every
  block of measured numbers must be covered: a table with a column of numbers and a unit (img/s,
  images/s, ms, s, seconds, MiB, MB, GiB, %) in it or in the paragraph just before it; a fenced
  block with a number and a rate, time or memory unit; a paragraph or list item with a rate
  (img/s, images/s) or a time in ms. The README and every page of docs/ are held to this.
- **What has run.** Each item of the README's "what has run" list that names a commit or a GPU
  model (an ``H200``, ``A100``, ...) is backed by a label of docs/ with its date and commit, on
  a machine with the GPUs it names: the front page claims only what was measured.
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache

import pytest

from conftest import ROOT

PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
# How the docs start the benchmark ("python -m benchmarks", recognised by its last word), and
# the module whose get_args_parser() holds its flags.
BENCHMARK = (r"benchmarks", "benchmarks.__main__")


def _flags_of(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings if s.startswith("--")}


def _module_parser(module: str) -> Callable[[], set[str]]:
    return lambda: _flags_of(importlib.import_module(module).get_args_parser())


def _figures_parser() -> set[str]:
    return _module_parser("benchmarks.figures")()


def _torchrun_flags() -> set[str]:
    # Flags the docs name with the torch version that added them (torch 2.13 has them, the floor
    # 2.9 does not): a suite run under the floor checks the rest.
    newer = {"--shutdown-timeout", "--signals-to-handle"}
    return _module_parser("torch.distributed.run")() | newer


def _legacy_launch_flags() -> set[str]:
    # torch.distributed.launch's parse_args() adds --use-env to what its get_args_parser() has.
    return _module_parser("torch.distributed.launch")() | {"--use-env", "--use_env"}


# tool: (the word that names it in a command or a paragraph, a fullmatch; its flags)
TOOLS: dict[str, tuple[str, Callable[[], set[str]]]] = {
    # slurm/train.sbatch passes the flags after it on to the launcher.
    "training": (r"train_multi_gpu_using_(launch|spawn)\.py|train\.sbatch",
                 _module_parser("train_multi_gpu_using_launch")),  # one parser for both
    "predict": (r"predict\.py", _module_parser("predict")),
    "make shards": (r"make_shards\.py", _module_parser("make_shards")),
    "plot": (r"plot_results\.py", _module_parser("plot_results")),
    "benchmark": (BENCHMARK[0], _module_parser(BENCHMARK[1])),
    "example": (r"example_own_project\.py", _module_parser("example_own_project")),
    "figures": (r"benchmarks\.figures", _figures_parser),
    "torchrun": (r"torchrun|torch\.distributed\.run", _torchrun_flags),
    "legacy launch": (r"torch\.distributed\.launch", _legacy_launch_flags),
    # Tools we cannot import: the flags the docs may name.
    "srun": (r"srun", lambda: {"--kill-on-bad-exit", "--gpus-per-task", "--ntasks",
                                "--ntasks-per-node", "--nodes", "--cpus-per-task"}),
    "sbatch": (r"sbatch|#SBATCH", lambda: {"--job-name", "--nodes", "--ntasks-per-node",
                                           "--gpus-per-node", "--gpus-per-task",
                                           "--cpus-per-task", "--time", "--requeue",
                                           "--signal", "--open-mode"}),
    "scancel": (r"scancel", lambda: {"--signal", "--batch"}),
    "docker": (r"docker", lambda: {"--shm-size", "--ipc", "--init", "--cpus", "--gpus"}),
    "tensorboard": (r"tensorboard", lambda: {"--logdir"}),
    "git": (r"git", lambda: {"--always", "--dirty"}),
    "pytest": (r"pytest", lambda: {"--durations"}),
    "pip": (r"pip3?", lambda: {"--index-url"}),
}
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


@cache
def tool_flags(tool: str) -> frozenset[str]:
    return frozenset(TOOLS[tool][1]())


def tool_named_by(word: str) -> str | None:
    """The tool a command word names: ``train_multi_gpu_using_launch.py``, ``#SBATCH``, ..."""
    word = word.strip("`'\"()[]$,;:").rsplit("/", 1)[-1]
    return next((tool for tool, (pattern, _) in TOOLS.items() if re.fullmatch(pattern, word)),
                None)


def tools_mentioned(text: str) -> set[str]:
    return {tool for tool, (pattern, _) in TOOLS.items()
            if re.search(rf"(?<![\w-])(?:{pattern})(?![\w-])", text)}


# ---------------------------------------------------------------- reading the Markdown
@dataclass
class Block:
    kind: str  # "heading", "paragraph" (a list item too), "table", "fence"
    text: str
    line: int  # 1-based, where it starts


def blocks(page: str) -> list[Block]:
    """A page cut into headings, paragraphs and list items, tables and fenced blocks."""
    lines = (ROOT / page).read_text(encoding="utf-8").split("\n")
    found: list[Block] = []
    i = 0
    while i < len(lines):
        line, start = lines[i], i
        if line.startswith(("```", "~~~")):
            i += 1
            while i < len(lines) and not lines[i].startswith(line[:3]):
                i += 1
            found.append(Block("fence", "\n".join(lines[start + 1:i]), start + 1))
            i += 1
        elif line.startswith("#"):
            found.append(Block("heading", line, start + 1))
            i += 1
        elif line.startswith("|"):
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            found.append(Block("table", "\n".join(lines[start:i]), start + 1))
        elif line.strip():
            i += 1
            while (i < len(lines) and lines[i].strip()
                   and not lines[i].startswith(("```", "~~~", "#", "|"))
                   and not re.match(r"\s*([-*]|\d+\.)\s", lines[i])):
                i += 1
            found.append(Block("paragraph", "\n".join(lines[start:i]), start + 1))
        else:
            i += 1
    return found


def units(block: Block) -> Iterator[tuple[str, int]]:
    """What "the same paragraph" means for a flag: each table row apart, else the block."""
    if block.kind == "table":
        for n, row in enumerate(block.text.split("\n")):
            yield row, block.line + n
    elif block.kind != "heading":
        yield block.text, block.line


def spans(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def command_lines(fence: str) -> list[str]:
    return re.sub(r"\\\n", " ", fence).split("\n")


def flags_in_command(command: str) -> Iterator[tuple[str, str | None]]:
    """(flag, its tool) for each flag of a command; None: no tool before it on the line."""
    owner = None
    for word in command.split():
        if word.startswith("#") and word != "#SBATCH":
            owner = None  # a comment: prose again
        owner = tool_named_by(word) or owner
        for flag in FLAG.findall(word):
            yield flag, owner


def flag_uses(page: str) -> Iterator[tuple[int, str, set[str]]]:
    """(line, flag, the tools it may belong to) for every ``--flag`` on a page."""
    for block in blocks(page):
        for unit, line in units(block):
            default = {"training"} | tools_mentioned(unit)
            if block.kind == "fence":
                commands, prose = command_lines(unit), ""
            else:
                commands, prose = spans(unit), re.sub(r"`[^`]+`|https?://\S+", "", unit)
            for command in commands:
                for flag, owner in flags_in_command(command):
                    yield line, flag, {owner} if owner else default
            for flag in FLAG.findall(prose):
                yield line, flag, default


@pytest.mark.parametrize("page", PAGES)
def test_every_flag_exists_in_the_tool_it_belongs_to(page):
    wrong = sorted({f"{page}:{line}: {flag} is not a flag of {' or '.join(sorted(tools))}"
                    for line, flag, tools in flag_uses(page)
                    if not any(flag in tool_flags(tool) for tool in tools)})
    assert not wrong, "\n".join(wrong)


def test_the_flag_reader_tells_the_tools_apart():
    line = ("srun --kill-on-bad-exit=1 torchrun --nproc_per_node=4 --rdzv-id=$ID "
            "train_multi_gpu_using_launch.py --data-path /d --output-dir runs/x  # --resume auto")
    assert list(flags_in_command(line)) == [
        ("--kill-on-bad-exit", "srun"), ("--nproc_per_node", "torchrun"),
        ("--rdzv-id", "torchrun"), ("--data-path", "training"), ("--output-dir", "training"),
        ("--resume", None)]
    assert tool_named_by("#SBATCH") == "sbatch" and tool_named_by("benchmarks.figures")
    assert "--no-sync-bn" in tool_flags("training") and "--top-k" in tool_flags("predict")
    assert "--max-restarts" in tool_flags("torchrun") and "--use_env" in tool_flags(
        "legacy launch")


# ---------------------------------------------------------------- paths and modules
@cache
def repository_files() -> tuple[str, ...]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True)
    return tuple(name for name in listed.stdout.splitlines() if (ROOT / name).exists())


def top_folders() -> set[str]:
    return {name.split("/")[0] for name in repository_files() if "/" in name}


PATH = re.compile(r"(?<![\w./~$<>{-])(?:\.?[\w-]+/)+[\w.*-]*|(?<![\w./-])[\w-]+\.(?:py|md)\b")


def code_texts(page: str) -> Iterator[tuple[int, str]]:
    for block in blocks(page):
        if block.kind == "fence":
            yield block.line, block.text
        elif block.kind != "heading":
            for text in spans(block.text):
                yield block.line, text


def repository_paths(text: str) -> list[str]:
    """The words of ``text`` that name this repository's files (the module docstring's rule)."""
    names = [m.rstrip(".") for m in PATH.findall(text)]
    return [n for n in names if n.split("/")[0] in top_folders() or "/" not in n]


def path_exists(name: str) -> bool:
    if "/" not in name:  # a bare file name: anywhere in the repository
        return any(f.rsplit("/", 1)[-1] == name for f in repository_files())
    return (ROOT / name).exists()


@pytest.mark.parametrize("page", PAGES)
def test_every_repository_path_named_exists(page):
    missing = sorted({f"{page}:{line}: {name}" for line, text in code_texts(page)
                      for name in repository_paths(text) if not path_exists(name)})
    assert not missing, "\n".join(missing)


def test_the_path_rule_tells_repository_paths_from_examples():
    text = ("python benchmarks/figures.py; utils.py; multi_train_utils/; tests/test_x.py; "
            "flower_photos/daisy/x.jpg runs/flowers/model_best.pth /shared/flower_photos "
            "~/.cache/ddp-template/ <output-dir>/weights/model-N.pth DATA/train checkpoint.pth")
    assert repository_paths(text) == ["benchmarks/figures.py", "utils.py", "multi_train_utils/",
                                      "tests/test_x.py"]
    assert path_exists("docs/flags.md") and path_exists("sync_batchnorm.py")
    assert not path_exists("tests/test_x.py")


def our_modules() -> dict[str, str]:
    """Name as the docs write it -> module to import: top-level scripts, multi_train_utils'."""
    found = {}
    for name in repository_files():
        parts = name[:-3].split("/") if name.endswith(".py") else []
        if len(parts) == 1 or (len(parts) == 2 and parts[0] == "multi_train_utils"):
            found[parts[-1]] = ".".join(parts)
    return found


FILE_SUFFIXES = {"py", "md", "pth", "json", "jsonl", "txt", "png", "jpg", "tgz", "lock"}


@pytest.mark.parametrize("page", PAGES)
def test_every_dotted_name_of_our_modules_exists(page):
    modules, missing = our_modules(), set()
    for line, text in code_texts(page):
        for module, attr in re.findall(r"(?<![\w.])(\w+)\.([A-Za-z_]\w*)", text):
            if module in modules and attr not in FILE_SUFFIXES and module != "model":
                # "model" is also the name of every model variable (model.no_sync()).
                if not hasattr(importlib.import_module(modules[module]), attr):
                    missing.add(f"{page}:{line}: {module}.{attr}")
    assert not missing, "\n".join(sorted(missing))


def utils_modules() -> list[str]:
    return sorted(p.name for p in (ROOT / "multi_train_utils").glob("*.py")
                  if p.name != "__init__.py")


def test_the_readme_lists_every_module_of_multi_train_utils():
    (listing,) = [b.text for b in blocks("README.md")
                  if b.kind == "fence" and re.search(r"^multi_train_utils/\s", b.text, re.M)]
    listed = set(re.findall(r"^ {4}(\w+\.py)\s", listing, re.M))
    assert listed == set(utils_modules()), f"README's list: {sorted(listed)}"


def test_own_project_lists_every_module_of_multi_train_utils():
    (table,) = [b.text for b in blocks("docs/own-project.md")
                if b.kind == "table" and "| module |" in b.text]
    listed = set(re.findall(r"^\| `(\w+\.py)` \|", table, re.M))
    assert listed == set(utils_modules()), f"docs/own-project.md's table: {sorted(listed)}"


# ---------------------------------------------------------------- measured numbers
LABEL = re.compile(r"Measured (?P<date>\d{4}-\d{2}-\d{2})(?: \d\d:\d\d UTC)? on (?P<machine>.+?), "
                   r"commit (?P<commit>[0-9a-f]{7,40}(?:-dirty)?)(?: \([^)]*\))?, "
                   r"torch (?P<torch>\d+\.\d+[\w.+]*)")
NUMBER = r"\d(?:[\d,.]*\d)?"
RATE_OR_MS = re.compile(rf"{NUMBER}(?:-{NUMBER})? ?(?:img/s|images/s|ms)\b")
FENCE_UNITS = re.compile(rf"{NUMBER} ?(?:img/s|images/s|ms|MiB|GiB|s/epoch)\b|\bimg/s\b")
TABLE_UNITS = re.compile(r"img/s|images/s|\bms\b|\bs\b|\bseconds\b|MiB|\bMB\b|GiB|%")
CELL_NUMBER = re.compile(rf"[~≈]?{NUMBER}(?: ?[-–] ?{NUMBER})?(?: ?(?:x|×|%|s|ms|MiB))?"
                         rf"(?: \([^)]*\))?")


def label_of(block: Block) -> re.Match | None:
    """The label a paragraph starts with (after a ``<!-- figures:... -->`` marker), if any."""
    text = re.sub(r"^(<!--.*?-->\s*)+", "", block.text)
    return LABEL.match(" ".join(text.split())) if block.kind == "paragraph" else None


def has_a_number_column(table: str) -> bool:
    rows = [[c.strip() for c in row.strip().strip("|").split("|")]
            for row in table.split("\n") if not re.fullmatch(r"[|\s:-]+", row)]
    body = rows[1:]
    return bool(body) and any(all(len(r) > col and CELL_NUMBER.fullmatch(r[col]) for r in body)
                              for col in range(1, len(rows[0])))


def measured(block: Block, before: Block | None) -> bool:
    """Does the block hold measured numbers (the module docstring's rule)?"""
    if block.kind == "table":
        caption = before.text if before and before.kind == "paragraph" else ""
        return has_a_number_column(block.text) and bool(TABLE_UNITS.search(
            block.text + "\n" + caption))
    if block.kind == "fence":
        return bool(FENCE_UNITS.search(block.text))
    return block.kind == "paragraph" and bool(RATE_OR_MS.search(block.text))


def unlabelled(page: str) -> list[str]:
    found, covered, before = [], False, None
    for block in blocks(page):
        if block.kind == "heading":
            covered = False
        covered = covered or bool(label_of(block))
        if measured(block, before) and not covered:
            found.append(f"{page}:{block.line}: {block.text.split(chr(10))[0][:90]}")
        before = block
    return found


def labels(page: str) -> list[re.Match]:
    return [m for block in blocks(page) if (m := label_of(block))]


@pytest.mark.parametrize("page", PAGES)
def test_every_block_of_measured_numbers_carries_a_label(page):
    missing = unlabelled(page)
    assert not missing, ("no 'Measured <date> on <machine>, commit <rev>, torch <version>:' "
                         "label before:\n" + "\n".join(missing))


def test_every_label_names_a_commit_of_this_repository():
    commits = sorted({m["commit"].removesuffix("-dirty") for page in PAGES
                      for m in labels(page)})
    assert commits  # the rule finds the labels
    checked = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, text=True,
                             input="".join(f"{c}^{{commit}}\n" for c in commits),
                             capture_output=True, check=True).stdout
    assert "missing" not in checked and "ambiguous" not in checked, checked


def test_the_label_rule_finds_tables_blocks_and_rates():
    table = Block("table", "| run | img/s |\n| --- | ---: |\n| ddp | 83 |\n| fsdp | 59 |", 1)
    flags = Block("table", "| flag | default |\n| --- | --- |\n| `--lr` | 0.001 |", 1)
    codes = Block("table", "| how it ends | exit code |\n|---|---|\n| finished | 0 |", 1)
    assert measured(table, None) and not measured(flags, None) and not measured(codes, None)
    assert measured(Block("fence", "   ours: train_one_epoch      47.9 img/s", 1), None)
    assert measured(Block("paragraph", "- it trained 5,720 img/s with data", 1), None)
    assert not measured(Block("paragraph", "Docker keeps /dev/shm at 64 MB.", 1), None)
    label = Block("paragraph", "Measured 2026-12-05 on Intel Xeon, 2 CPUs, commit 3ac12fc-dirty\n"
                               "(landed as f5c9fc4), torch 2.14.1: one process, 47.9 img/s.", 1)
    assert label_of(label)["machine"] == "Intel Xeon, 2 CPUs"
    assert label_of(label)["commit"] == "3ac12fc-dirty" and label_of(label)["torch"] == "2.14.1"


COMMIT = re.compile(r"\b[0-9a-f]{7,40}(?:-dirty)?\b")
GPU_MODEL = re.compile(r"\b[A-Z]\d{2,3}(?=s?\b)")  # H200, A100s, V100, L40


def run_claims(readme: str) -> list[str]:
    """The items of the README's section on what has run that name a commit or a GPU model."""
    section = re.search(r"^## [^\n]*what has run\n(.*?)(?=^## )", readme, re.M | re.S | re.I)
    assert section, "the README has no '## ... what has run' section"
    items = re.split(r"\n(?=- )", section[1].strip())
    return [" ".join(item.split()) for item in items
            if COMMIT.search(item) or GPU_MODEL.search(item)]


def unbacked_claims(readme: str, measured: list[re.Match]) -> list[str]:
    backed = [(m["date"], m["commit"], m["machine"]) for m in measured]
    return [claim for claim in run_claims(readme)
            if not any(date in claim and re.search(rf"\b{re.escape(commit)}(?![\w-])", claim)
                       and all(gpu in machine for gpu in GPU_MODEL.findall(claim))
                       for date, commit, machine in backed)]


def test_what_the_front_page_says_has_run_is_backed_by_a_labelled_measurement():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    measured = [m for page in PAGES if page.startswith("docs/") for m in labels(page)]
    assert run_claims(readme)  # the rule finds the claims
    assert not unbacked_claims(readme, measured), unbacked_claims(readme, measured)


def test_the_run_claim_rule_finds_what_it_should():
    label = LABEL.match("Measured 2026-12-04 on one NVIDIA H200 with 16 CPUs, commit 1f7226c, "
                        "torch 2.11.0")
    readme = ("## What has run\n\n- **On a GPU:** one NVIDIA H200, 2026-12-04, commit 1f7226c.\n"
              "- **CI:** 2 CPU processes.\n- **On GPUs:** 8 NVIDIA A100, 2026-12-04, 1f7226c.\n"
              "- **Also:** one H200, 2026-12-05, 1f7226c.\n- **Fast:** on 8 H100s.\n\n## Next\n")
    assert len(run_claims(readme)) == 4
    assert unbacked_claims(readme, [label]) == [
        "- **On GPUs:** 8 NVIDIA A100, 2026-12-04, 1f7226c.",
        "- **Also:** one H200, 2026-12-05, 1f7226c.", "- **Fast:** on 8 H100s."]


# ---------------------------------------------------------------- size and tone
def test_the_readme_and_docs_keep_their_line_budgets():
    """A front page of at most 220 lines; docs/ at most 1,250 lines in all."""
    lines = {page: len((ROOT / page).read_text(encoding="utf-8").splitlines()) for page in PAGES}
    assert lines["README.md"] <= 220, lines["README.md"]
    docs = {page: n for page, n in lines.items() if page.startswith("docs/")}
    assert sum(docs.values()) <= 1250, sorted(docs.items(), key=lambda kv: -kv[1])


# Words that tell how the project got here rather than what a user does: the git log keeps that.
HISTORY = re.compile("|".join([
    r"\bissues? #?\d+", r"\bPR #?\d+", r"\blanded\b", r"\b(?:was|were|is|are|been) lent\b",
    r"reorgani[sz]", r"\bredesign", r"\bearlier (?:design|commit|version|code)",
    r"\bbefore (?:it|the code|this) was\b", r"\bused to (?:run|be)\b", r"\bof then\b",
    r"\bnot (?:yet )?measured again\b", r"\bno longer the default\b", r"\bwas fixed\b",
    r"\bwere fixed\b", r"\bthe old (?:code|way|figures|one)\b", r"\bbefore the (?:change|fix)\b",
]), re.I)


def history_lines(page: str) -> list[str]:
    text = (ROOT / page).read_text(encoding="utf-8")
    return [f"{page}:{n}: {m.group(0)!r} in {line.strip()[:80]}"
            for n, line in enumerate(text.splitlines(), 1) if (m := HISTORY.search(line))]


@pytest.mark.parametrize("page", PAGES)
def test_no_page_tells_the_projects_history(page):
    found = history_lines(page)
    assert not found, "say what a user does and can expect; the git log keeps the history:\n" + \
        "\n".join(found)


def test_the_history_rule_finds_what_it_should():
    for line in ("before the reorganisation of issue 25", "(landed as f5c9fc4)",
                 "not measured since, as no GPU was lent", "what the template sharded before "
                 "issue 36", "the default of then, 8"):
        assert HISTORY.search(line), line
    for line in ("Rank 0 lists the folder.", "issued by torchrun", "the tissue 12 images",
                 "a GPU lends itself to this", "the previous checkpoint is intact"):
        assert not HISTORY.search(line), line
