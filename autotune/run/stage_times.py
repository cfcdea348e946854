"""Where a run's time goes: the seconds of each stage of ``python -m autotune``.

A ``StageClock`` is handed down the run (``autotune.run.confirm.tune``, ``autotune.run.plan_run``) and times
each stage as it happens; ``StageClock.times()`` builds the ``StageTimes`` record the report and
summary.json show once, at the end. Stages nest (the plan's apply inside its measured run): each
second counts once, in the innermost stage running, so the stages add up to the run's wall time
less what no stage covers (``other_s``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, fields

STAGES = ("load", "capture", "calibration", "search", "apply", "measured_run", "report")


@dataclass(frozen=True)
class StageTimes:
    """Seconds of each stage of one run; ``total_s`` is its wall time from the clock's start."""

    load_s: float = 0.0
    capture_s: float = 0.0
    calibration_s: float = 0.0
    search_s: float = 0.0
    apply_s: float = 0.0
    measured_run_s: float = 0.0
    report_s: float = 0.0
    total_s: float = 0.0

    @property
    def other_s(self) -> float:
        """Wall time no stage covers (start-up, imports, messages)."""
        return max(0.0, self.total_s - sum(getattr(self, f"{stage}_s") for stage in STAGES))

    def to_dict(self) -> dict[str, float]:
        return {**{f.name: round(getattr(self, f.name), 3) for f in fields(self)}, "other_s": round(self.other_s, 3)}

    def describe(self) -> str:
        """One line: the stages that took any time, largest first."""
        spent = sorted(((getattr(self, f"{stage}_s"), stage) for stage in STAGES), reverse=True)
        parts = [f"{stage.replace('_', ' ')} {seconds:.1f} s" for seconds, stage in spent if seconds >= 0.05]
        return f"{self.total_s:.0f} s in all: " + ", ".join(parts + [f"other {self.other_s:.1f} s"])


class StageClock:
    """Times the stages of a run as it goes (``with clock.stage("capture"): ...``)."""

    def __init__(self, started: float | None = None) -> None:
        self._started = time.monotonic() if started is None else started
        self._spent = dict.fromkeys(STAGES, 0.0)
        self._open: list[list[float]] = []  # per running stage: [start, seconds of the stages inside it]

    @contextlib.contextmanager
    def stage(self, name: str):
        if name not in self._spent:
            raise ValueError(f"unknown stage {name!r}; known: {', '.join(STAGES)}")
        self._open.append([time.monotonic(), 0.0])
        try:
            yield
        finally:
            start, inner_s = self._open.pop()
            elapsed = time.monotonic() - start
            self._spent[name] += elapsed - inner_s
            if self._open:
                self._open[-1][1] += elapsed

    def times(self) -> StageTimes:
        """The record of the stages so far."""
        return StageTimes(**{f"{stage}_s": seconds for stage, seconds in self._spent.items()},
                          total_s=time.monotonic() - self._started)
