"""The documentation a reader meets: sized for its reader, its links alive, its numbers traceable.

README.md is for users (under 15 KB; measurements live in benchmarks/results/, reasoning in
docs/design.md); benchmarks/README.md sums up each benchmark (under 20 KB); every result file says
how to reproduce it (command, commit, date); and the project speaks of itself alone: no word in a
tracked file about who worked on it when (docs/design.md 7). No TensorFlow, no benchmark run.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARKS_README = ROOT / "benchmarks" / "README.md"
RESULTS = ROOT / "benchmarks" / "results"

# Words about the work rather than the tool: sessions, hel[p]ers (in any sense), waves and tracker numbers.
FORBIDDEN = re.compile(r"(first|second|third|fourth|fifth|this|previous|next|last) session|\bhel[p]ers?\b|\w+_hel[p]ers?\b"
                       r"|\bissue #?[0-9]+|\(#[0-9]+\)|\bwave\b", re.IGNORECASE)
FORBIDDEN_IN_PROSE = re.compile(r"\bsession\b", re.IGNORECASE)  # code may name a profiler's session
CHECKED_SUFFIXES = (".py", ".md", ".toml")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def tracked_files() -> list[Path]:
    """The files git tracks (what a clone gets); outside a git checkout, the tree without its venvs."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [ROOT / name for name in listed.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        return [path for path in ROOT.rglob("*") if path.is_file()
                and not any(part.startswith(".") or part in ("__pycache__", "autotune-out") for part in
                            path.relative_to(ROOT).parts)]


def test_readme_is_a_users_guide_in_15_kb():
    size = README.stat().st_size
    assert size <= 15_000, f"README.md is {size} bytes: measurements go to benchmarks/results/, reasoning to docs/design.md"


def test_benchmarks_readme_sums_up_in_20_kb():
    size = BENCHMARKS_README.stat().st_size
    assert size <= 20_000, f"benchmarks/README.md is {size} bytes: full tables belong in benchmarks/results/"


def test_no_tracked_file_speaks_of_how_it_was_made():
    hits = []
    for path in tracked_files():
        if not path.exists():
            continue
        if path.suffix in CHECKED_SUFFIXES:
            text = path.read_text(errors="replace")
        elif path.suffix == ".csv":
            text = path.read_text(errors="replace").split("\n", 1)[0]  # a table's header
        else:
            continue
        patterns = (FORBIDDEN, FORBIDDEN_IN_PROSE) if path.suffix == ".md" else (FORBIDDEN,)
        for number, line in enumerate(text.splitlines(), 1):
            if any(pattern.search(line) for pattern in patterns):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not hits, f"{len(hits)} lines cite sessions, hel[p]ers, waves or tracker numbers:\n" + "\n".join(hits[:30])


RESULT_PAGES = sorted(RESULTS.glob("*.md"))


def test_there_are_result_pages():
    assert len(RESULT_PAGES) >= 10


@pytest.mark.parametrize("page", RESULT_PAGES, ids=lambda page: page.name)
def test_each_result_names_its_command_commit_and_date(page):
    header = page.read_text().split("\n|", 1)[0]  # what comes before the table
    assert re.search(r"^- command: .*python -m (benchmarks|autotune)", header, re.M), f"{page.name}: no command"
    assert re.search(r"^- commit: .*\b[0-9a-f]{7,40}\b", header, re.M), f"{page.name}: no commit"
    assert re.search(r"^- date: 20\d\d-\d\d-\d\d", header, re.M), f"{page.name}: no date"
    assert re.search(r"^- (host|cpu|cores): ", header, re.M), f"{page.name}: no machine"


@pytest.mark.parametrize("page", [p for p in RESULT_PAGES if p.name.startswith(("step_time", "speed", "simulator_speed"))],
                         ids=lambda page: page.name)
def test_timing_results_say_the_load(page):
    assert re.search(r"\bload\b", page.read_text(), re.I), f"{page.name}: a timing without the machine's load"


@pytest.mark.parametrize("document", [README, BENCHMARKS_README, ROOT / "docs" / "design.md"],
                         ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_point_at_files_that_exist(document):
    missing = []
    for target in LINK.findall(document.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address or an anchor in the page
        path = (document.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            missing.append(target)
    assert not missing, f"{document.name} links to files that do not exist: {missing}"


def test_result_files_the_docs_name_exist():
    """Result files named in prose too (``benchmarks/results/NAME.md`` in backticks), not only linked."""
    missing = []
    for document in (README, BENCHMARKS_README, ROOT / "docs" / "design.md"):
        for name in re.findall(r"benchmarks/results/([\w.-]+\.(?:md|csv|png))", document.read_text()):
            if not (RESULTS / name).exists():
                missing.append(f"{document.name}: {name}")
    assert not missing, missing


def test_quick_start_is_two_commands_that_exist():
    text = README.read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", section, re.S)
    assert block, "the quick start has no command block"
    commands = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    commands = [command for command in commands if command]
    assert commands == ["scripts/demo", "scripts/test"], commands
    for command in commands:
        script = ROOT / command
        assert script.is_file() and os.access(script, os.X_OK), f"{command} is not an executable script"
