"""How a run searches and measures: one object each, built once by the CLI or ``autotune.tune``.

``SearchOptions`` holds what ``autotune.run.tuning.search_graph`` needs besides the graph and the target;
``MeasureOptions`` whether and how the chosen plan is measured (``autotune.run.confirm``).
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.run.verdict import MAX_ROUNDS


@dataclass(frozen=True)
class SearchOptions:
    """The search: ``policy`` and Optuna ``sampler``, ``trials``/``timeout_s``/``seed``, where the study
    is kept (``storage``, ``study_name``), ``maximize_batch`` (with ``max_overhead``: the slow-down allowed),
    ``recompute`` (False: swap only), ``split`` (False: never run ops in parts along the batch, even where
    the budget is under the floor of plans that move whole tensors), ``state`` (False: the optimizer state
    stays on the device) and a ``progress`` bar."""

    policy: str = "optuna"
    sampler: str = "tpe"
    trials: int | None = 200
    timeout_s: float | None = None
    seed: int | None = 0
    storage: str | None = None
    study_name: str | None = None
    maximize_batch: bool = False
    max_overhead: float | None = None
    recompute: bool = True
    split: bool = True
    state: bool = True
    progress: bool = False


@dataclass(frozen=True)
class MeasureOptions:
    """The measured run: whether there is one (``measure``), whether step times are calibrated on this
    machine first (``calibrate``; None: when measuring), whether a calibration an earlier run of the same
    graph stored here is measured again instead of reused (``recalibrate``), and how many measured
    ``rounds`` at most."""

    measure: bool = True
    calibrate: bool | None = None
    recalibrate: bool = False
    rounds: int = MAX_ROUNDS

    @property
    def calibrates(self) -> bool:
        return self.measure if self.calibrate is None else bool(self.calibrate)
