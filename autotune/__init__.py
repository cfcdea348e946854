"""Tune activation swapping for a Keras model by simulation, and report on it.

``tune(model, batch_size=...)`` captures the training step, searches swap parameters with
Optuna (or another policy from ``search/policies.py``) against the simulator, applies the winner to the
real step and measures it until a measured run confirms it (``result.verdict``).
``python -m autotune MODEL_DIR`` does the same from the shell.
"""

from autotune.inputs import InputError
from autotune.search import Evaluation, SearchSpace, TuningProblem
from autotune.run import MeasuredRun, PlanRun, TuneResult, Verdict, run_plan, tune, tune_graph

__all__ = ["Evaluation", "InputError", "MeasuredRun", "PlanRun", "SearchSpace", "TuneResult", "TuningProblem", "Verdict",
           "run_plan", "tune", "tune_graph"]
