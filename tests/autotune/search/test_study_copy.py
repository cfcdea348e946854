"""The search's study in memory (autotune.search.study_copy): finished trials reach the stored study as it goes
and when it stops, and a windowed sampler sees a bounded number of trials."""

from __future__ import annotations

import numpy as np
import optuna
import pytest

from autotune.search import study_copy
from autotune.search.study_copy import optuna_storage

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _journal_study(path, name="s"):
    return optuna.create_study(storage=optuna_storage(str(path)), study_name=name, load_if_exists=True)


def _objective(trial):
    return trial.suggest_float("x", -1, 1) ** 2


def test_trials_are_stored_on_leaving_also_when_interrupted(tmp_path):
    study = _journal_study(tmp_path / "study.log")
    study.set_user_attr("graph_fingerprint", "g")
    study.optimize(_objective, n_trials=3)
    with pytest.raises(KeyboardInterrupt):
        with study_copy.in_memory(study) as memory:
            assert len(memory.trials) == 3 and memory.user_attrs == {"graph_fingerprint": "g"}
            memory.enqueue_trial({"x": 0.5})  # enqueued and never run: not stored
            memory.optimize(_objective, n_trials=4)
            memory.enqueue_trial({"x": 0.25})
            raise KeyboardInterrupt
    stored = _journal_study(tmp_path / "study.log").trials
    assert [t.state for t in stored] == [optuna.trial.TrialState.COMPLETE] * 7
    assert stored[3].params == {"x": 0.5}


def test_trials_are_stored_while_the_search_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(study_copy, "STORE_EVERY_S", 0.0)
    study = _journal_study(tmp_path / "study.log")
    seen = []
    with study_copy.in_memory(study) as memory:
        memory.optimize(_objective, n_trials=3,
                        callbacks=[lambda *_: seen.append(len(_journal_study(tmp_path / "study.log").trials))])
        memory.add_trial(optuna.trial.create_trial(params={"x": 0.1}, distributions={
            "x": optuna.distributions.FloatDistribution(-1, 1)}, value=0.01))
        assert len(_journal_study(tmp_path / "study.log").trials) == 4
    assert seen == [1, 2, 3]  # each trial in the journal as soon as it finished
    assert len(_journal_study(tmp_path / "study.log").trials) == 4  # and not twice


def test_a_windowed_sampler_sees_a_bounded_number_of_trials():
    class Counting(optuna.samplers.TPESampler):
        def sample_relative(self, study, trial, search_space):
            seen.append(len(study.get_trials(deepcopy=False)))
            return super().sample_relative(study, trial, search_space)

        def sample_independent(self, study, trial, name, distribution):
            seen.append(len(study.get_trials(deepcopy=False)))
            return super().sample_independent(study, trial, name, distribution)

    seen: list[int] = []
    study = optuna.create_study(sampler=Counting(seed=0))
    rng = np.random.default_rng(0)
    study.add_trials([optuna.trial.create_trial(params={"x": float(x)}, value=float(x) ** 2, distributions={
        "x": optuna.distributions.FloatDistribution(-1, 1)}) for x in rng.uniform(-1, 1, 300)])
    study_copy.optimize_windowed(study, _objective, n_trials=40, timeout_s=None, callbacks=[], stopped=lambda: False,
                                 rng=rng)
    assert len(study.trials) == 340
    assert seen and max(seen) <= study_copy.WINDOW_SIZE + study_copy.WINDOW_BATCH
    best = sorted(t.value for t in study.trials[:300])[:study_copy.WINDOW_BEST]
    assert min(t.value for t in study.trials[300:]) < 10 * best[-1]  # it still samples near the best
