"""Whether the tool may say "fits": the simulator's prediction, overruled by measured runs.

Memory tools lose their users over one thing: being told a model fits and then running out of
memory (TFLMS v2's "LMS not needed", then OOM). So a measured run, where there is one, decides. It
runs on the machine at hand (the target's GPU, or the CPU testbed) and checks the simulator there: its
measured peak is compared with the prediction for that machine (the same plan, that machine's device
model and timings). What the check shows of the simulator (measured over predicted, on the step's own
memory) is carried to the target's prediction at the requested batch, which is held to the target's
budget: the testbed's bytes are never compared with another device's budget. A plan is confirmed when
both hold; otherwise the miss becomes a ``PeakCorrection`` the next search budgets for
(``autotune.run.confirm``). Everything here is plain arithmetic on byte counts, so it is tested without
TensorFlow; the CLI line, the report's headline and ``summary.json`` all read one ``Verdict``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from autotune.inputs import format_bytes

TOLERANCE = 0.05  # a measured peak this far above the prediction is still run-to-run noise on the testbed
MAX_ROUNDS = 3  # measured runs before the tool gives up on confirming a plan

# Verdict.status values
FITS, FITS_WITHOUT_SWAPPING, DOES_NOT_FIT, NOT_CONFIRMED = "fits", "fits-without-swapping", "does-not-fit", "not-confirmed"
# Verdict.train_with values: what the user should train with
SWAP_STEP, PLAIN_FIT, SERIALIZED_STEP = "swap-step", "plain-fit", "serialized-step"
# model.fit's own step runs in TensorFlow's executor order, whose peak varies from step to step (the same LSTM step
# measured 7.2 to 16.6 MiB, docs/design.md 6): "fits with a plain model.fit" stands on the highest of this many
PLAIN_FIT_PEAK_RUNS = 5


@dataclass(frozen=True)
class PeakCorrection:
    """What measured runs taught about the simulator's peaks on one model: a step's own memory
    (the peak less what is resident) is ``factor`` times the predicted one, and the peak is at least
    ``excess_bytes`` above the prediction (an allocation the simulator does not see at all). The
    factor carries a miss over to other batch sizes; the excess to other plans at the same batch."""

    factor: float = 1.0
    excess_bytes: int = 0

    @property
    def is_identity(self) -> bool:
        return self.factor == 1.0 and self.excess_bytes == 0

    def corrected(self, predicted_bytes: int, resident_bytes: int) -> int:
        transient = max(0, predicted_bytes - resident_bytes)
        return int(max(resident_bytes + self.factor * transient, predicted_bytes + self.excess_bytes))

    def search_budget(self, budget_bytes: int, resident_bytes: int) -> int:
        """The largest predicted peak whose corrected peak is within ``budget_bytes``."""
        if self.is_identity:
            return int(budget_bytes)
        by_factor = resident_bytes + (budget_bytes - resident_bytes) / self.factor
        return int(max(0, min(by_factor, budget_bytes - self.excess_bytes)))

    def describe(self) -> str:
        parts = []
        if self.factor != 1.0:
            parts.append(f"the step's own memory x{self.factor:.3f}")
        if self.excess_bytes:
            parts.append(f"+{format_bytes(self.excess_bytes)}")
        return " and ".join(parts) or "none"


@dataclass(frozen=True)
class Check:
    """One measured run of a plan against the prediction for the machine it ran on, carried to the target."""

    round: int
    measured_on: str
    measured_batch: int
    requested_batch: int
    budget_bytes: int  # the target's
    predicted_bytes: int  # the simulator's peak on the machine measured, at the measured batch
    corrected_bytes: int  # the same with the correction the search budgeted for
    measured_bytes: int | None  # None: the run ran out of memory
    # the target's prediction at the requested batch with the measured miss carried to it (= measured
    # when the target is the machine measured, at the requested batch)
    projected_bytes: int | None
    tolerance: float = TOLERANCE
    target_on: str = ""  # the target's device model ("": the machine measured)
    target_predicted_bytes: int | None = None  # the target's prediction at the requested batch
    reused_from: int | None = None  # the round whose measurement of the same plan this check reads (not run again)

    @property
    def carried(self) -> bool:
        """Whether the measured miss was carried to another prediction (another batch or device model)."""
        return self.measured_batch != self.requested_batch or (self.target_predicted_bytes is not None
                                                               and self.target_predicted_bytes != self.predicted_bytes)

    @property
    def agrees(self) -> bool:
        return self.measured_bytes is not None and self.measured_bytes <= self.corrected_bytes * (1 + self.tolerance)

    @property
    def within_budget(self) -> bool:
        return self.projected_bytes is not None and self.projected_bytes <= self.budget_bytes

    @property
    def confirmed(self) -> bool:
        return self.agrees and self.within_budget

    @property
    def miss(self) -> float | None:
        """Measured over predicted, less one (positive: the simulator was short)."""
        return None if self.measured_bytes is None else self.measured_bytes / self.predicted_bytes - 1

    def describe(self) -> str:
        where = f"on {self.measured_on} at batch {self.measured_batch}"
        reused = "" if self.reused_from is None else f" (the plan measured in round {self.reused_from}, not run again)"
        if self.measured_bytes is None:
            return f"round {self.round}: the measured run {where} ran out of memory{reused}"
        text = (f"round {self.round}: measured {format_bytes(self.measured_bytes)} {where}{reused}, predicted "
                f"{format_bytes(self.predicted_bytes)} there ({self.miss:+.1%})")
        if self.corrected_bytes != self.predicted_bytes:
            text += f", {format_bytes(self.corrected_bytes)} with the correction"
        if self.carried:
            target = f"the {self.target_on} prediction" if self.target_on else "the prediction"
            text += (f"; carried to {target} at batch {self.requested_batch} "
                     f"({format_bytes(self.target_predicted_bytes)}): {format_bytes(self.projected_bytes)}")
        text += f" against the budget of {format_bytes(self.budget_bytes)}"
        if self.confirmed:
            return text + ": confirmed"
        why = [] if self.agrees else [f"more than {self.tolerance:.0%} above the prediction"]
        why += [] if self.within_budget else ["over the budget"]
        return text + ": " + " and ".join(why)

    def to_dict(self) -> dict:
        return {**asdict(self), "agrees": self.agrees, "within_budget": self.within_budget, "confirmed": self.confirmed}


def project(measured_bytes: int | None, predicted_bytes: int, resident_bytes: int, predicted_at_request_bytes: int,
            resident_at_request_bytes: int) -> int | None:
    """A measured peak carried to the target's prediction at the requested batch: its step's own memory
    (the peak less what is resident) scaled as measured over predicted on the machine measured, the same
    at the measured batch as at another (what is resident grows with the batch only by its inputs, which
    are counted). The identical prediction carries the measured peak unchanged."""
    if measured_bytes is None or (predicted_bytes, resident_bytes) == (predicted_at_request_bytes,
                                                                      resident_at_request_bytes):
        return measured_bytes
    ratio = max(0, measured_bytes - resident_bytes) / max(1, predicted_bytes - resident_bytes)
    return int(resident_at_request_bytes + ratio * max(0, predicted_at_request_bytes - resident_at_request_bytes))


def check_run(*, round: int, measured_on: str, measured_bytes: int | None, predicted_bytes: int, resident_bytes: int,
              predicted_at_request_bytes: int, resident_at_request_bytes: int, measured_batch: int,
              requested_batch: int, budget_bytes: int, correction: PeakCorrection, target_on: str = "",
              reused_from: int | None = None, tolerance: float = TOLERANCE) -> Check:
    """``measured_bytes`` against ``predicted_bytes`` (the machine measured, at ``measured_batch``), and
    carried to ``predicted_at_request_bytes`` (the target ``target_on``, at ``requested_batch``) for
    the target's ``budget_bytes``."""
    projected = project(measured_bytes, predicted_bytes, resident_bytes, predicted_at_request_bytes,
                        resident_at_request_bytes)
    return Check(round=round, measured_on=measured_on, measured_batch=measured_batch, requested_batch=requested_batch,
                 budget_bytes=budget_bytes, predicted_bytes=predicted_bytes,
                 corrected_bytes=correction.corrected(predicted_bytes, resident_bytes), measured_bytes=measured_bytes,
                 projected_bytes=projected, tolerance=tolerance, target_on=target_on,
                 target_predicted_bytes=predicted_at_request_bytes, reused_from=reused_from)


def next_correction(check: Check, correction: PeakCorrection, resident_bytes: int) -> PeakCorrection:
    """The correction the next search budgets for after ``check`` failed: at least the simulator's
    miss on the machine measured (measured over predicted there, not that machine's bytes), and always
    stricter than the last (so the rounds make progress)."""
    transient = max(1, check.predicted_bytes - resident_bytes)
    if check.measured_bytes is None:  # out of memory: the peak was over the device's limit, which is the budget
        seen = max(check.budget_bytes, check.corrected_bytes) * (1 + check.tolerance)
    else:
        seen = check.measured_bytes
    factor = max(correction.factor * (1 + check.tolerance), (seen - resident_bytes) / transient)
    excess = correction.excess_bytes
    if check.measured_batch == check.requested_batch:
        excess = max(excess, int(seen - check.predicted_bytes))
    return PeakCorrection(factor=float(factor), excess_bytes=int(max(0, excess)))


@dataclass(frozen=True)
class Verdict:
    """What the tool says about the model at the requested batch, and how sure it is."""

    status: str
    confirmed_by_measurement: bool
    measured: bool  # a measured run was asked for (False: --no-measure, a prediction only)
    train_with: str | None
    headline: str
    details: tuple[str, ...] = ()
    checks: tuple[Check, ...] = field(default=())
    action: str = "swapping"  # what the plan does: swapping, recomputation or both (actions_phrase)

    @property
    def ok(self) -> bool:
        """Exit 0: it fits, and a measured run confirmed it (or none was asked for)."""
        return self.status in (FITS, FITS_WITHOUT_SWAPPING) and (self.confirmed_by_measurement or not self.measured)

    def to_dict(self) -> dict:
        return {"verdict": self.status, "confirmed_by_measurement": self.confirmed_by_measurement,
                "prediction_only": not self.measured, "train_with": self.train_with, "headline": self.headline,
                "verdict_details": list(self.details), "measured_rounds": [c.to_dict() for c in self.checks]}

    def with_checks(self, checks, details=()) -> "Verdict":
        return replace(self, checks=tuple(checks), details=tuple(self.details) + tuple(details))


def actions_phrase(n_swaps: int, n_recomputes: int, n_host_state: int = 0, split_parts: int = 0) -> str:
    """What a plan does, as the verdict says it (a plan that only recomputes does not swap; a split step says
    so first: its parts, not a swap, take it under the floor)."""
    done = [name for name, count in ((f"the batch split in {split_parts} parts", split_parts), ("swapping", n_swaps),
                                     ("recomputation", n_recomputes), ("optimizer state on the host", n_host_state))
            if count]
    if not done:
        return "swapping"
    return done[0] if len(done) == 1 else ", ".join(done[:-1]) + " and " + done[-1]


def predicted(*, fits: bool, swaps: bool, peak_bytes: int | None, budget_bytes: int, measured: bool,
              train_with: str | None = None, action: str = "swapping", host_miss_bytes: int = 0) -> Verdict:
    """The verdict of the simulator alone: before a measured run, or with ``--no-measure``. ``host_miss_bytes``:
    how far the closest plan's swapped tensors are over the host's room for them, when it misses there."""
    suffix = "" if measured else " (predicted only: not measured, run without --no-measure to confirm)"
    if not fits:
        text = "Does not fit"
        over = peak_bytes is not None and peak_bytes > budget_bytes
        if peak_bytes is not None:
            text += (f": the closest plan peaks at {format_bytes(peak_bytes)}, {'over' if over else 'within'} the "
                     f"budget of {format_bytes(budget_bytes)}")
        if host_miss_bytes > 0:
            whose = ", and its" if over else ", but its" if peak_bytes is not None else ": the closest plan's"
            text += f"{whose} swapped tensors need {format_bytes(host_miss_bytes)} more host memory than the host has"
        return Verdict(DOES_NOT_FIT, False, measured, None, text + ".")
    if swaps:
        status, text = FITS, f"Fits with {action}: predicted peak {format_bytes(peak_bytes)} of {format_bytes(budget_bytes)}"
        train_with = SWAP_STEP
    else:
        status, text = FITS_WITHOUT_SWAPPING, (f"Fits without swapping: predicted peak {format_bytes(peak_bytes)} of "
                                               f"{format_bytes(budget_bytes)}")
        train_with = train_with or PLAIN_FIT
    return Verdict(status, False, measured, train_with, text + suffix + ".", action=action)


def confirmed(base: Verdict, checks: list[Check], *, plain: Check | None = None,
              apply_with: str = "rewriter.step.apply_plan + rewriter.use_swap_step") -> Verdict:
    """``base`` (a fitting prediction) confirmed by the last of ``checks``. Without swapping, the
    step the user runs with a plain ``model.fit`` (``plain``) must fit too, or the output says to
    train with the tool's serialized step (``apply_with``: the calls that train with it)."""
    last = checks[-1]
    target = f"the {last.target_on} at batch" if last.target_on else "batch"
    where = (f"measured {format_bytes(last.measured_bytes)} on {last.measured_on} at batch {last.measured_batch}"
             + ("" if not last.carried else
                f" (predicted {format_bytes(last.predicted_bytes)} there), {format_bytes(last.projected_bytes)} "
                f"carried to {target} {last.requested_batch}"))
    rounds = "" if len(checks) == 1 else f" after {len(checks) - 1} correction(s) from measured runs"
    if base.status == FITS:
        return Verdict(FITS, True, True, SWAP_STEP, f"Fits with {base.action}, confirmed by measurement: {where}, "
                       f"within the budget of {format_bytes(last.budget_bytes)}{rounds}.", base.details, tuple(checks),
                       base.action)
    if plain is not None and plain.within_budget:
        return Verdict(FITS_WITHOUT_SWAPPING, True, True, PLAIN_FIT,
                       f"Fits without swapping, confirmed by measurement: model.fit's own step at most "
                       f"{format_bytes(plain.measured_bytes)} in {PLAIN_FIT_PEAK_RUNS} steps (its op order varies), "
                       f"the serialized step {where}; budget "
                       f"{format_bytes(last.budget_bytes)}{rounds}.", base.details, tuple(checks))
    plain_text = ("model.fit's own step was not measured" if plain is None else
                  f"model.fit's own step measured up to {format_bytes(plain.measured_bytes)}"
                  + ("" if not plain.carried else
                     f" ({format_bytes(plain.projected_bytes)} carried to batch {plain.requested_batch})")
                  + ", over the budget")
    return Verdict(FITS_WITHOUT_SWAPPING, True, True, SERIALIZED_STEP,
                   f"Fits without swapping only with the tool's serialized step ({where}{rounds}): "
                   f"{plain_text}. Train with plan.json ({apply_with}), "
                   "not a plain model.fit.", base.details, tuple(checks))


def not_confirmed(checks: list[Check], *, reason: str) -> Verdict:
    """The measured runs never confirmed a plan (or a measured run failed): never a success."""
    return Verdict(NOT_CONFIRMED, False, True, None, f"Not confirmed: {reason}.", (), tuple(checks))
