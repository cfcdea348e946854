"""What every benchmark shares: the machine record, result files, and timing tools.

Each benchmark writes ``benchmarks/results/<name>.csv``, ``<name>.md`` (a Markdown table with the
commit, machine, versions and settings above it) and its PNG plots next to them. benchmarks/README.md
is kept by hand: each benchmark's headline numbers and a link to its result file.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import time
import timeit
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from autotune.report.writer import markdown_table

RESULTS_DIR = Path(__file__).resolve().parent / "results"
STARTED_S = time.perf_counter()  # each benchmark is its own process: its runtime is counted from here


def start_measuring_process() -> None:
    """Make this process a measuring worker (a benchmark runs each model in a fresh one): the testbed's
    environment before TensorFlow is imported, then CPU:0 (accelerator) and CPU:1 (host) before its
    runtime starts (beside a GPU, nothing is split)."""
    from rewriter.environment import prepare_environment  # must run before TensorFlow is imported

    prepare_environment()
    from rewriter.placement.placements import configure_testbed  # imports TensorFlow

    configure_testbed()


def _commit() -> str:
    """The code a result was measured on (a result file names it beside the command)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=RESULTS_DIR.parent, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def machine() -> dict[str, Any]:
    """The facts a reader needs to judge a number: where, when, with what."""
    versions = {}
    for package in ("tensorflow", "tensorflow-cpu", "keras", "numpy", "optuna", "pandas"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "commit": _commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        **versions,
    }


def write_results(name: str, table: pd.DataFrame, *, settings: dict[str, Any], notes: list[str] | None = None,
                  directory: Path | None = None, float_format: str = "{:.4g}") -> Path:
    """Write ``<name>.csv`` and ``<name>.md`` (settings and machine above the table); return the .md path."""
    directory = Path(directory or RESULTS_DIR)
    directory.mkdir(parents=True, exist_ok=True)
    table.to_csv(directory / f"{name}.csv", index=False)
    lines = [f"# {name}", ""]
    # docs/design.md 5 gives each benchmark 30 minutes: every table says what its run took
    runtime = {"runtime_s": round(time.perf_counter() - STARTED_S, 1)}
    lines += [f"- {key}: {value}" for key, value in {**machine(), **runtime, **settings}.items()]
    lines += ["", markdown_table(table, float_format), ""]
    lines += [f"{note}" for note in (notes or [])]
    path = directory / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def interleaved_seconds(functions: dict[str, Callable[[], Any]], *, min_seconds: float = 1.0,
                        repeats: int = 7) -> dict[str, list[float]]:
    """Seconds per call of each function, one list of ``repeats`` rounds each, the rounds of the
    functions taken in turn (a same-process comparison: load on the machine hits them alike); the
    functions share ``min_seconds`` of rounds between them. Report the fastest and the spread."""
    timers = {name: timeit.Timer(function) for name, function in functions.items()}
    numbers = {}
    for name, timer in timers.items():
        number, elapsed = timer.autorange()  # also the warm-up
        numbers[name] = max(1, round(number * min_seconds / len(timers) / repeats / max(elapsed, 1e-9)))
    rounds: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(repeats):
        for name, timer in timers.items():
            rounds[name].append(timer.timeit(numbers[name]) / numbers[name])
    return rounds


def per_second(function: Callable[[], Any], *, min_seconds: float = 1.0, repeats: int = 5) -> tuple[float, int]:
    """Calls per second of ``function``: the fastest of ``repeats`` rounds lasting ``min_seconds`` in
    all (timeit's advice: slower rounds measure other load on the machine, not the code). Returns
    the rate and the number of calls timed."""
    timer = timeit.Timer(function)
    number, elapsed = timer.autorange()  # also the warm-up
    number = max(1, round(number * min_seconds / repeats / max(elapsed, 1e-9)))
    best = min(timer.repeat(repeat=repeats, number=number))
    return number / best, number * repeats
