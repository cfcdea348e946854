"""What every benchmark shares: the machine record, result files, and timing helpers.

Each benchmark writes ``benchmarks/results/<name>.csv``, ``<name>.md`` (a Markdown table with the
machine, versions and settings above it) and its PNG plots next to them.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from autotune.report import markdown_table

RESULTS_DIR = Path(__file__).resolve().parent / "results"


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
    lines += [f"- {key}: {value}" for key, value in {**machine(), **settings}.items()]
    lines += ["", markdown_table(table, float_format), ""]
    lines += [f"{note}" for note in (notes or [])]
    path = directory / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def per_second(function: Callable[[], Any], *, min_seconds: float = 1.0, min_calls: int = 5) -> tuple[float, int]:
    """Calls per second of ``function`` over at least ``min_seconds`` (after one warm-up call)."""
    function()
    calls, start = 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - start < min_seconds:
        function()
        calls += 1
    return calls / (time.perf_counter() - start), calls
