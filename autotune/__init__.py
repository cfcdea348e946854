"""Tune activation swapping for a Keras model by simulation, and report on it.

``tune(model, batch_size=...)`` captures the training step, searches swap parameters with
Optuna (or another policy from ``search/policies.py``) against the simulator, applies the winner to the
real step and measures it until a measured run confirms it (``result.verdict``). Its target device and
budget (``Target``) are resolved once; ``SearchOptions`` and ``MeasureOptions`` hold the rest.
``python -m autotune MODEL_DIR`` does the same from the shell.
"""

from autotune.inputs import InputError
from autotune.search import Evaluation, SearchSpace, TuningProblem
from autotune.run import (MeasuredRun, MeasureOptions, PlanRun, SearchOptions, Target, TuneResult, Verdict,
                          resolve_target, run_plan, tune, tune_graph)

__all__ = ["Evaluation", "InputError", "MeasureOptions", "MeasuredRun", "PlanRun", "SearchOptions", "SearchSpace",
           "Target", "TuneResult", "TuningProblem", "Verdict", "resolve_target", "run_plan", "tune", "tune_graph"]
