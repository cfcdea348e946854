"""The tuning run: a budget resolved, the search run, the winner applied and measured, and the verdict the
measured runs allow (docs/design.md 6)."""

from autotune.run.calibrated_timing import PRESET_TIME_ERROR, calibration_batches, extrapolation_note, time_model_note
from autotune.run.confirm import tune
from autotune.run.options import MeasureOptions, SearchOptions
from autotune.run.plan_run import PlanRun, run_plan
from autotune.run.probes import HOST_UNLIMITED_BYTES, SwapProbes, largest_batch, largest_batch_with_swap
from autotune.run.tuning import (DEFAULT_DEVICE, MeasuredRun, TuneResult, max_batch_without_swap, resolve_device,
                                 study_name_for, tune_graph)
from autotune.search.study_copy import optuna_storage
from autotune.run.target import Target, resolve_target
from autotune.run.verdict import Verdict

__all__ = ["calibration_batches", "DEFAULT_DEVICE", "extrapolation_note", "HOST_UNLIMITED_BYTES", "largest_batch",
    "largest_batch_with_swap", "max_batch_without_swap", "MeasuredRun", "MeasureOptions", "optuna_storage",
    "PlanRun", "PRESET_TIME_ERROR", "resolve_device", "resolve_target", "run_plan", "SearchOptions",
    "study_name_for", "SwapProbes", "Target", "time_model_note", "tune", "tune_graph", "TuneResult", "Verdict"]
