"""The search: a space over plan parameters with the simulator as objective, and the policies, chosen by name,
that walk it."""

from autotune.search.off_grid import refine_off_grid
from autotune.search.policies import POLICIES, SAMPLERS, Budget, OptunaPolicy, make_policy
from autotune.search.space import (Evaluation, SearchSpace, TuningProblem, add_evaluation, best_of, closest_of,
                                   evaluation_from_trial)

__all__ = ["add_evaluation", "best_of", "Budget", "closest_of", "Evaluation", "evaluation_from_trial",
    "make_policy", "OptunaPolicy", "POLICIES", "refine_off_grid", "SAMPLERS", "SearchSpace", "TuningProblem"]
