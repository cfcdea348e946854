"""A search runs on an in-memory copy of the user's study; its trials are stored in one write each.

Optuna writes every suggested parameter, user attribute and state change of a trial to the storage as
it happens: about 20 journal lines per trial, each appended under a file lock and fsynced. On
ResNet-50 (batch 256, v100-16gb, swap-only, 200 trials) that was 7.1 s of an 11.5 s search. Here the
search works on an in-memory study holding the stored finished trials, and its finished trials are
added to the stored study, one write each, every ``STORE_EVERY_S`` seconds and when the search ends,
normally or not (Ctrl-C finishes the running trial and stops the search: ``autotune.search.policies``). A
search killed outright (SIGKILL, power loss) loses its last seconds. Trials enqueued and not run are
not stored (a resumed search enqueues what it needs again); several machines sharing one study
(``--storage postgresql://...``) see each other's trials when a search starts. ``open_study`` opens the user's
study where ``--storage`` names it (``optuna_storage``) and refuses one made for another model or search space.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import optuna
from optuna.storages import InMemoryStorage
from optuna.trial import TrialState

from autotune.inputs import InputError
from autotune.search.space import SearchSpace
from simulator import OpGraph

STORE_EVERY_S = 2.0


class _StoringStorage(InMemoryStorage):
    """An in-memory storage that calls ``store(False)`` whenever a trial finishes or a finished one is added."""

    def __init__(self, store) -> None:
        super().__init__()
        self._store = store

    def create_new_trial(self, study_id: int, template_trial=None) -> int:
        trial_id = super().create_new_trial(study_id, template_trial)
        if template_trial is not None and template_trial.state.is_finished():
            self._store(False)
        return trial_id

    def set_trial_state_values(self, trial_id: int, state: TrialState, values=None) -> bool:
        changed = super().set_trial_state_values(trial_id, state, values)
        if state.is_finished():
            self._store(False)
        return changed


@contextlib.contextmanager
def in_memory(study: optuna.Study) -> Iterator[optuna.Study]:
    """An in-memory study with ``study``'s name, direction, attributes and finished trials; the trials
    that finish in it are added to ``study`` every ``STORE_EVERY_S`` seconds and on leaving."""
    stored: set[int] = set()  # numbers of the in-memory trials that are in ``study``
    last = [float("inf")]  # when they were last stored (not before the stored trials are copied in)

    def store(now: bool) -> None:
        if not now and not time.monotonic() - last[0] >= STORE_EVERY_S:
            return
        new = [t for t in memory.get_trials(deepcopy=False) if t.number not in stored and t.state.is_finished()]
        study.add_trials(new)
        stored.update(t.number for t in new)
        last[0] = time.monotonic()

    memory = optuna.create_study(storage=_StoringStorage(store), study_name=study.study_name,
                                 directions=study.directions, sampler=study.sampler)
    for key, value in study.user_attrs.items():
        memory.set_user_attr(key, value)
    memory.add_trials([trial for trial in study.get_trials(deepcopy=False) if trial.state.is_finished()])
    stored.update(t.number for t in memory.get_trials(deepcopy=False))
    last[0] = time.monotonic()
    try:
        yield memory
    finally:
        store(True)


# What a sampler whose cost grows with the trials (TPE) sees of a study: the best WINDOW_BEST and a
# uniform sample of the rest, WINDOW_SIZE in all, renewed every WINDOW_BATCH trials. TPE's "good"
# group is its best 10 % (25 at most), all in the window; the rest estimate its "bad" density, which a
# uniform sample of them estimates alike at a bounded cost per trial.
WINDOW_SIZE = 128
WINDOW_BEST = 32
WINDOW_BATCH = 16


def _rank(trial: optuna.trial.FrozenTrial) -> tuple[int, float]:
    """As a constrained sampler ranks trials: those that fit by value, then by how far they are over."""
    if trial.state != TrialState.COMPLETE or trial.value is None:
        return 2, 0.0
    over = sum(max(0.0, value) for value in trial.constraints.values())
    return (0, trial.value) if over <= 0 else (1, over)


def optimize_windowed(study: optuna.Study, objective, *, n_trials: int | None, timeout_s: float | None,
                      callbacks, stopped, rng: np.random.Generator) -> None:
    """``study.optimize(objective, n_trials, timeout)`` with its sampler seeing a window of the study's
    finished trials (``WINDOW_SIZE`` of them; every trial when there are no more), renewed every
    ``WINDOW_BATCH`` trials: a sampler's cost per trial then stays bounded however many trials the
    study holds. The window's new trials go into ``study``. ``stopped()``: a stop was asked for."""
    end = None if timeout_s is None else time.monotonic() + timeout_s
    done = 0
    while n_trials is None or done < n_trials:
        finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        if len(finished) > WINDOW_SIZE:
            ranked = sorted(finished, key=_rank)
            rest = rng.choice(len(ranked) - WINDOW_BEST, WINDOW_SIZE - WINDOW_BEST, replace=False)
            finished = sorted(ranked[:WINDOW_BEST] + [ranked[WINDOW_BEST + i] for i in rest], key=lambda t: t.number)
        window = optuna.create_study(directions=study.directions, sampler=study.sampler)
        window.add_trials(finished)
        batch = WINDOW_BATCH if n_trials is None else min(WINDOW_BATCH, n_trials - done)
        try:
            window.optimize(objective, n_trials=batch, timeout=None if end is None else max(0.0, end - time.monotonic()),
                            callbacks=callbacks, gc_after_trial=False)
        finally:
            new = window.get_trials(deepcopy=False)[len(finished):]
            study.add_trials([trial for trial in new if trial.state != TrialState.RUNNING])
        done += len(new)
        if len(new) < batch or stopped() or end is not None and time.monotonic() >= end:
            return


def optuna_storage(storage: str | None):
    """What ``--storage`` names: a database URL (``sqlite:///...``, ``postgresql://...``) as Optuna
    takes it, or else a journal file (Optuna's JournalStorage). A journal appends one line per
    change, where SQLite commits a transaction: a 200-trial search took 6 s instead of 44 s."""
    if storage is None or "://" in storage:
        return storage
    path = Path(storage)
    if _stored_kind(path) == "sqlite":  # a database given as a path
        return f"sqlite:///{path.resolve()}"
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(storage))


def check_storage(storage: str | None) -> None:
    """Refuse a ``--storage`` file that holds neither a journal nor an SQLite database before anything slow runs
    (``InputError``; the file is left as it is)."""
    if storage is not None and "://" not in storage:
        try:
            _stored_kind(Path(storage))
        except InputError as error:
            raise InputError(f"cannot open the Optuna storage {storage!r}: {error}") from None


def _stored_kind(path: Path) -> str | None:
    """"sqlite" or "journal" for a file holding a study, None for a missing or empty one; another file is refused:
    a journal is never appended to a file that is not one."""
    if not (path.is_file() and path.stat().st_size):
        return None
    with path.open("rb") as file:
        first = file.readline()
    if first.startswith(b"SQLite format 3\x00"):
        return "sqlite"
    try:
        is_journal = "op_code" in json.loads(first)
    except (ValueError, TypeError):
        is_journal = False
    if not is_journal:
        raise InputError("it is neither an Optuna journal nor an SQLite database (it is left as it is)")
    return "journal"


def open_study(storage: str | None, name: str, graph: OpGraph, space: SearchSpace) -> optuna.Study:
    """Create or resume a study; refuse to mix trials of another model or search space into it."""
    try:
        study = optuna.create_study(storage=optuna_storage(storage), study_name=name, direction="minimize",
                                    load_if_exists=True)
    except Exception as error:  # bad URL, unreachable server, unreadable file
        raise InputError(f"cannot open the Optuna storage {storage!r}: {error}") from None
    fingerprint = graph.fingerprint()
    found = study.user_attrs.get("graph_fingerprint")
    if found is None:
        study.set_user_attr("graph_fingerprint", fingerprint)
        study.set_user_attr("space", space.to_dict())
    elif found != fingerprint or study.user_attrs.get("space") != space.to_dict():
        raise InputError(f"the study {name!r} in {storage} was made for another model or search space; "
                         "give another --study-name (the existing study is left as it is)")
    return study
