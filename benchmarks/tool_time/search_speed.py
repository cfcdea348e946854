"""The search's own speed: trials per second of a search on the demo's ResNet-50, and what each trial
costs beside the simulation (the sampler, the study's storage).

    python -m benchmarks search-speed [--runs 2] [--reference COMMIT] [--trials 200]

``tune_graph`` on ResNet-50's captured step at batch 256 on the v100-16gb preset (``scripts/demo``), with
a journal file as the study's storage (the CLI's default), swapping only and with recomputation (the
default), each in a fresh process. ``outside_simulation_ms``: the search's seconds outside
``TuningProblem.evaluate`` (the simulations), per trial. With ``--reference``, the same searches run on
that commit's code (``git archive``), interleaved with today's, so that both see the same load on the
machine; the chosen plan's predicted step time and peak show whether the search found as good a plan.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODES = ("swap-only", "recompute")


def _worker(graph_file: str, mode: str, trials: int) -> None:
    """One search in this process (the code on PYTHONPATH: today's or the reference's); one JSON line."""
    import optuna

    import autotune.search.space as search
    from autotune.run.tuning import tune_graph
    from simulator import OpGraph
    from simulator.warmup import warm_up

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    graph = OpGraph.load(graph_file)
    warm_up()
    simulated_s = [0.0]
    evaluate = search.TuningProblem.evaluate

    def timed(self, params):
        start = time.perf_counter()
        try:
            return evaluate(self, params)
        finally:
            simulated_s[0] += time.perf_counter() - start

    search.TuningProblem.evaluate = timed
    with tempfile.TemporaryDirectory() as directory:
        load = os.getloadavg()[0]
        start, cpu_start = time.perf_counter(), time.process_time()
        result = tune_graph(graph, batch_size=256, device="v100-16gb", trials=trials,
                            storage=str(Path(directory) / "study.log"), recompute=mode == "recompute")
        seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    n = len(result.evaluations)
    print(json.dumps({"mode": mode, "trials": n, "seconds": seconds, "trials_per_s": n / seconds,
                      "trials_per_cpu_s": n / cpu_s,
                      "outside_simulation_ms": 1e3 * (seconds - simulated_s[0]) / n,
                      "chosen_step_s": result.chosen.step_s, "chosen_peak_GB": result.chosen.peak_bytes / 1e9,
                      "chosen_overhead": result.chosen.metrics["overhead"], "load_before": load,
                      "load_after": os.getloadavg()[0]}), flush=True)


def _search(code_root: Path, graph_file: Path, mode: str, trials: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code_root)}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(graph_file), mode, str(trials)],
                          env=env, capture_output=True, text=True, cwd=code_root)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"the search on {code_root} failed: {done.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def _extract(commit: str, directory: Path) -> Path:
    archive = subprocess.run(["git", "archive", commit], capture_output=True, cwd=ROOT, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(directory, filter="data")
    return directory


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        _worker(argv[1], argv[2], int(argv[3]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks search-speed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="searches per code and mode (default 2)")
    parser.add_argument("--trials", type=int, default=200, help="the search's trials (the CLI's default, 200)")
    parser.add_argument("--reference", help="a commit whose search runs beside today's")
    parser.add_argument("--name", default="search_speed", help="results file name under benchmarks/results/")
    args = parser.parse_args(argv)
    import pandas as pd

    from benchmarks.common import write_results
    from benchmarks.models.graphs import captured_graph

    rows = []
    with tempfile.TemporaryDirectory() as directory:
        graph_file = Path(directory) / "resnet50.npz"
        captured_graph("resnet50").save(graph_file)
        codes = {"today": ROOT}
        if args.reference:
            codes[args.reference] = _extract(args.reference, Path(directory) / "reference")
            _search(codes[args.reference], graph_file, "swap-only", 5)  # compiles its kernels once
        for run in range(1, args.runs + 1):
            for mode in MODES:
                for label, root in codes.items():
                    rows.append({"code": label, "run": run, **_search(root, graph_file, mode, args.trials)})
                    print(rows[-1], file=sys.stderr, flush=True)
    table = pd.DataFrame(rows)
    summary = table.groupby(["mode", "code"])[["trials_per_s", "trials_per_cpu_s", "outside_simulation_ms",
                                                "chosen_step_s"]].median()
    notes = ["Median per mode and code: " + "; ".join(
        f"{mode}, {code}: {row.trials_per_s:.1f} trials/s ({row.trials_per_cpu_s:.1f} per CPU second), "
        f"{row.outside_simulation_ms:.1f} ms per trial outside the "
        f"simulation, plan {row.chosen_step_s:.4g} s" for (mode, code), row in summary.iterrows()) + ".",
        "trials: the study's completed trials (a search with recomputation runs a swap-only search of as many "
        "trials first, and 15 % on top of each off the grid); load_before/after: os.getloadavg's 1-minute figure "
        "(2 cores: above 2 the searches shared them); trials_per_cpu_s: per second of the search's own CPU time "
        "(time.process_time), which other processes on the machine do not inflate."]
    command = f"python -m benchmarks search-speed --runs {args.runs}" + (
        f" --reference {args.reference}" if args.reference else "") + (
        f" --trials {args.trials}" if args.trials != 200 else "")
    path = write_results(args.name, table, settings={"command": command,
                                                     "graph": "resnet50 224x224, batch 256", "device": "v100-16gb",
                                                     "storage": "journal file"}, notes=notes)
    print(table.to_string(index=False))
    print("\n".join(notes))
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
