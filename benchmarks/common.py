"""What every benchmark shares: the machine record, result files, and timing helpers.

Each benchmark writes ``benchmarks/results/<name>.csv``, ``<name>.md`` (a Markdown table with the
machine, versions and settings above it) and its PNG plots next to them.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
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
    # the budget is 30 minutes per benchmark: every table says what its run took
    runtime = {"runtime_s": round(time.perf_counter() - STARTED_S, 1)}
    lines += [f"- {key}: {value}" for key, value in {**machine(), **runtime, **settings}.items()]
    lines += ["", markdown_table(table, float_format), ""]
    lines += [f"{note}" for note in (notes or [])]
    path = directory / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    if directory == RESULTS_DIR:
        update_readme()
    return path


README_ORDER = ("max_batch_v100", "max_batch", "recompute_measured", "fidelity", "fidelity_recompute", "fidelity_zoo",
                "verdict", "step_time", "tuning", "speed", "simulator_speed", "floor_split")
README_INTRO = """# Benchmarks

Every table below is the latest output of the command above it, run on the machine it names
(`python -m benchmarks NAME` writes `results/NAME.csv`, `.md` and `.png`, then rebuilds this page).
Targets are those of docs/design.md section 5; where a number misses its target, the table says so and
the notes say why.

| benchmark | command | what it measures |
|---|---|---|
| max-batch | `python -m benchmarks max-batch` | largest ResNet-50 batch / 3D U-Net input with and without swapping, the U-Net also with `--rewrite split-concat` and `elide-broadcasts` (simulated on V100 presets; measured on the CPU testbed, or on a visible GPU) |
| max_batch_v100 | `python -m benchmarks max-batch --devices v100-16gb --no-measured --name max_batch_v100` | the same on the PCIe preset, each case with swapping alone and with recomputation beside it (issue 22), with a 20 % column, and Keras' `RematScope` modes on the same simulator |
| recompute_measured | `python -m benchmarks recompute` | recomputation measured on the CPU testbed: Keras' step and its `RematScope` modes, the tool's serialized step, every cheap tensor recomputed, and per budget the tuned plan with swapping alone and with recomputation (predicted and measured peak, step time) |
| fidelity | `python -m benchmarks fidelity` | predicted against measured peak memory on the CPU testbed (or a visible GPU), 6 models (and the U-Net with `--rewrite split-concat --rewrite elide-broadcasts`) x several plans, beside Grappler's static estimate |
| fidelity_recompute | `python -m benchmarks fidelity --recompute --models ...` | the same with plans that recompute cheap tensors beside their swaps (issue 22) |
| fidelity_zoo | `python -m benchmarks fidelity --zoo` | the same on the 22 models of `benchmarks.zoo` (models nobody tuned the simulator for: applications, U-Nets, mixed_float16, recurrent, attention, multi-input/output, ...) x 7 plans, measured in chunks (`--zoo --models a,b`), against issue 19's per-model targets |
| verdict | `python -m benchmarks verdict` | the CLI, measured on the testbed, on zoo models whose prediction alone says "fits" (the cases of issue 19: mixed_float16, LSTM/GRU, U-Nets, multi-input/output): exit 0 only when a measured run confirms the plan within the budget, else exit 3 and no "Fits" |
| step_time | `python -m benchmarks step-time` | predicted against measured step time on the CPU testbed: a device model calibrated by `rewriter.timing.device_calibration` at other batch sizes, and the uncalibrated preset, 4 models x 7 plans |
| tuning | `python -m benchmarks tuning` | Optuna, random, tflms-v2 and the exhaustive grid on the same simulator |
| speed | `python -m benchmarks speed` | simulator replays (and plan + replay trials) per second against graph size, beside the numpy replay and the first compiled one in the same process, and the CLI's end-to-end time |
| simulator_speed | `python -m benchmarks.simulator_speed [--first-call]` | replays per second of ResNet-50's graph (batch 32, the 474-swap plan) beside the earlier replays; with `--first-call`, the first replay in fresh processes, compiling and loading the compiled kernels |
| floor_split | `python -m benchmarks floor-split` | the floor (resident state plus the largest op's working set, under which no swap or recomputation plan goes) before and after splitting along the batch in 2, 4 and 8 parts, over the benchmark models and the zoo (simulated; nothing offers a split yet, docs/design.md 10) |
"""


def update_readme() -> Path:
    """Rebuild benchmarks/README.md from the latest result pages."""
    parts = [README_INTRO]
    for name in README_ORDER:
        page = RESULTS_DIR / f"{name}.md"
        if page.exists():
            text = page.read_text()
            body = text.split("\n", 1)[1] if text.startswith("# ") else text
            images = sorted(RESULTS_DIR.glob(f"{name}*.png"))
            parts.append(f"## {name}\n" + body.replace("](", "](results/")
                         + "".join(f"\n![{image.stem}](results/{image.name})\n" for image in images))
    path = RESULTS_DIR.parent / "README.md"
    path.write_text("\n".join(parts))
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
