"""python -m benchmarks NAME [options]: run one benchmark and write its table under benchmarks/results/.

NAME: max-batch, fidelity, verdict, tuning, speed, step-time, gpu-check, recompute, floor-split, split-measured,
split-users, cli-time, search-speed, large-model (``python -m benchmarks NAME --help`` for its options).
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "max-batch": "benchmarks.max_batch",
    "fidelity": "benchmarks.fidelity",
    "verdict": "benchmarks.verdict",
    "tuning": "benchmarks.tuning",
    "speed": "benchmarks.speed",
    "gpu-check": "benchmarks.gpu_check",
    "step-time": "benchmarks.step_time",
    "recompute": "benchmarks.recompute",
    "cli-time": "benchmarks.tool_time.cli_time",
    "search-speed": "benchmarks.tool_time.search_speed",
    "floor-split": "benchmarks.floor_split",
    "split-measured": "benchmarks.split.measured",
    "large-model": "benchmarks.large_model.run",
    "split-users": "benchmarks.split.users",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    from rewriter.environment import prepare_environment  # before TensorFlow is imported

    prepare_environment()
    module = importlib.import_module(BENCHMARKS[argv[0]])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
