"""The documents a user reads: README.md stays short, every relative link in README.md and
docs/*.md resolves (file and, when given, heading anchor), and every `make`, `python -m`
and `torchrun` command in their code (fenced or inline) names a make
target that exists and only flags that the target's `--help` lists; the README's Install and
Run blocks run as written in a fresh shell."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from tests.f8train.launch import TINY

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 300
PACKAGE = "f8train"
# flags a script accepts without listing them: compare passes unknown flags to each run
PASS_THROUGH = {f"{PACKAGE}.compare": f"{PACKAGE}.train"}


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_anchor(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_readme_is_short():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it to {README_MAX_LINES}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    broken = []
    for link in _links(doc):
        if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            broken.append(f"{link}: no file {path}")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{link}: no heading with anchor #{anchor} in {path.name}")
    assert broken == [], f"{doc.name}: broken links"


def _commands(doc: Path) -> list[str]:
    """Commands in fenced blocks (continuation lines joined, comments cut) and in inline
    code that start with make, python -m or torchrun."""
    text = doc.read_text()
    lines = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        lines += block.replace("\\\n", " ").splitlines()
    lines += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    found = []
    for line in lines:
        line = line.split(" #")[0].strip()
        if re.match(r"(make |python -m |torchrun )", line):
            found.append(line)
    return found


@cache
def _help(module: str) -> str:
    if module == "torchrun":
        from torch.distributed.run import get_args_parser

        return get_args_parser().format_help()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    return (
        out.getvalue() + _help(PASS_THROUGH[module]) if module in PASS_THROUGH else out.getvalue()
    )


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), flags=re.M))


def _flags(words: list[str]) -> list[str]:
    return [w.split("=")[0] for w in words if w.startswith("--")]


def _missing(flags: list[str], help_text: str) -> list[str]:
    return [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", help_text)]


def _check(command: str) -> list[str]:
    words = shlex.split(command)
    if words[0] == "make":
        targets = [w for w in words[1:] if "=" not in w]
        return [f"no make target {t}" for t in targets if t not in _make_targets()]
    if "-m" not in words:
        return []  # torchrun --help and the like
    i = words.index("-m")
    module, runner, args = words[i + 1], words[: i + 1], words[i + 2 :]
    problems = []
    if words[0] == "torchrun":
        runner_help = _help("torchrun")
        problems += [f"torchrun has no {f}" for f in _missing(_flags(runner), runner_help)]
    if module.split(".")[0] != PACKAGE or module.split(".")[-1].isupper():  # NAME: a placeholder
        return problems
    if not (REPO / (module.replace(".", "/") + ".py")).exists():
        return [*problems, f"no module {module}"]
    module_help = _help(module)
    return problems + [f"{module} has no {f}" for f in _missing(_flags(args), module_help)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_commands_name_existing_targets_and_flags(doc):
    problems = {c: p for c in _commands(doc) if (p := _check(c))}
    assert problems == {}, f"{doc.name}: commands that would not run as written"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_files_and_tests_exist(doc):
    """Repository paths in inline code (`fsdp_float8/...`, `tests/...py::test_name`) exist."""
    missing = []
    for code in re.findall(r"`([^`\s]+)`", doc.read_text()):
        path, _, test = code.partition("::")
        if not re.match(rf"(fsdp_float8|{PACKAGE}|tests|docs)/", path) or re.search(r"[*{<]", path):
            continue
        file = REPO / path.rstrip("/")
        if not file.exists():
            missing.append(code)
        elif test and not re.search(rf"def {re.escape(test.split('[')[0])}\(", file.read_text()):
            missing.append(code)
    assert missing == [], f"{doc.name} names paths or tests that do not exist"


# The README's Install and Run blocks, run as a new user would: a fresh `bash` (no venv on
# PATH) that follows the Install block's words, then each line of the Run block in turn,
# in one working folder, so the bf16 baseline runs right after the float8 run. `make ...`
# lines are what built the venv running these tests; `.venv` in a line stands for that
# venv (the extras and other-torch lanes run in their own). The default lane appends the
# cheapest flags to each training line; the slow test runs them as written.
CHEAP = (*TINY, "--steps", "2", "--val-every", "0")


def _fenced_block_after(heading: str) -> list[str]:
    """The lines of the first ```bash block under `## heading`, comments cut."""
    text = (REPO / "README.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert block, f"README.md: no ```bash block under ## {heading}"
    lines = [line.split(" #")[0].strip() for line in block[1].replace("\\\n", " ").splitlines()]
    return [line for line in lines if line]


def _readme_shell(line: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    venv = Path(sys.prefix)
    setup = [s for s in _fenced_block_after("Install") if not s.startswith("make ")]
    script = " && ".join([*setup, line]).replace(".venv/", f"{venv}/")
    keep = ("HOME", "PYTHONPATH", "FSDP_FLOAT8_CACHE_DIR", "XDG_CACHE_HOME", "TMPDIR")
    env = {k: os.environ[k] for k in keep if k in os.environ} | {"PATH": "/usr/bin:/bin"}
    return subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _run_readme_block(tmp_path: Path, extra: tuple[str, ...], timeout: float) -> list[str]:
    # tmp_path stands in for the repository root the README's commands run from (f8train is
    # not installed): the package is linked in, and the runs' folders land there.
    (tmp_path / "f8train").symlink_to(REPO / "f8train")
    outputs = []
    for line in _fenced_block_after("Run"):
        trains = " -m f8train.train" in line and "--help" not in line
        result = _readme_shell(f"{line} {shlex.join(extra)}" if trains else line, tmp_path, timeout)
        assert result.returncode == 0, f"README line failed: {line}\n{result.stderr[-3000:]}"
        outputs.append(result.stdout + result.stderr)
    return outputs


def _check_readme_runs(tmp_path: Path, outputs: list[str]) -> None:
    lines = _fenced_block_after("Run")
    float8 = next(i for i, line in enumerate(lines) if line.endswith("-m f8train.train"))
    assert lines[float8 + 1].endswith("-m f8train.train --recipe off"), lines  # right after
    for recipe in ("tensorwise", "off"):
        assert (tmp_path / "runs" / f"train-{recipe}" / "summary.json").exists(), recipe
    assert "token cache: " in outputs[float8], outputs[float8]


def test_readme_run_block_runs_as_written_in_a_fresh_shell(tmp_path):
    _check_readme_runs(tmp_path, _run_readme_block(tmp_path, CHEAP, timeout=300))


@pytest.mark.slow
@pytest.mark.timeout(1900)  # the block's own limit is 1800 s; the 300 s default cut it short
def test_readme_run_block_runs_as_written_in_a_fresh_shell_slow(tmp_path):
    _check_readme_runs(tmp_path, _run_readme_block(tmp_path, (), timeout=1800))
