"""Tune activation swapping for a Keras model by simulation, and report on it.

``tune(model, batch_size=...)`` captures the training step, searches swap parameters with
Optuna (or another policy from policies.py) against the simulator, applies the winner to the
real step and measures it until a measured run confirms it (``result.verdict``). Its target device and
budget (``Target``) are resolved once; ``SearchOptions`` and ``MeasureOptions`` hold the rest.
``python -m autotune MODEL_DIR`` does the same from the shell.
"""

from autotune.inputs import InputError
from autotune.search import Evaluation, SearchSpace, TuningProblem
from autotune.confirm import tune
from autotune.measured import PlanRun, run_plan
from autotune.options import MeasureOptions, SearchOptions
from autotune.target import Target, resolve_target
from autotune.tuning import MeasuredRun, TuneResult, tune_graph
from autotune.verdict import Verdict

__all__ = ["Evaluation", "InputError", "MeasureOptions", "MeasuredRun", "PlanRun", "SearchOptions", "SearchSpace",
           "Target", "TuneResult", "TuningProblem", "Verdict", "resolve_target", "run_plan", "tune", "tune_graph"]
