"""A plan belongs to the model, not to the names Keras and TensorFlow gave its layers in one process
(``rewriter.trace.op_names``): a copy of the model loaded in the same process (its layers ``dense_2``,
``softmax_3``, ... where the first copy had ``dense``, ``softmax``) or in another process takes the
plan; another model is refused; no op of a plan's order is dropped silently."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tensorflow")

import keras  # noqa: E402

import rewriter  # noqa: E402
from simulator import PlanError, SwapParams, plan_swaps  # noqa: E402

pytestmark = pytest.mark.tf
BATCH = 4
ROOT = Path(__file__).resolve().parents[1]

BLOCK_SOURCE = textwrap.dedent('''
    import keras

    @keras.saving.register_keras_serializable("test_plan_names")
    class Block(keras.layers.Layer):
        """Sublayers made without names: every copy of the model names them from Keras' counter."""

        def __init__(self, units=16, **kwargs):
            super().__init__(**kwargs)
            self.units = units
            self.dense = keras.layers.Dense(units)
            self.softmax = keras.layers.Softmax()

        def call(self, x):
            return self.softmax(self.dense(x))

        def get_config(self):
            return {**super().get_config(), "units": self.units}
''')


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A model of custom blocks saved, and the module that defines them."""
    directory = tmp_path_factory.mktemp("plan_names")
    (directory / "blocks_for_plan_names.py").write_text(BLOCK_SOURCE)
    sys.path.insert(0, str(directory))
    import blocks_for_plan_names as blocks

    inputs = keras.Input((8,))
    outputs = blocks.Block(3)(blocks.Block(16)(blocks.Block(16)(inputs)))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam", loss="categorical_crossentropy")
    model.save(directory / "blocks.keras")
    yield directory, directory / "blocks.keras"
    sys.path.remove(str(directory))


@pytest.fixture(scope="module")
def plan_of_first_copy(saved):
    directory, path = saved
    first = keras.models.load_model(path)
    graph = rewriter.capture(first, BATCH)
    plan = plan_swaps(graph, SwapParams(threshold=1, lb=1, ub=8))
    assert plan.n_swaps > 0
    (directory / "plan.json").write_text(plan.to_json(graph))
    return first, graph, directory / "plan.json"


def _batch():
    rng = np.random.default_rng(0)
    return rng.random((BATCH, 8), dtype=np.float32), np.eye(3, dtype=np.float32)[rng.integers(0, 3, BATCH)]


def test_a_second_copy_in_the_same_process_takes_the_plan(saved, plan_of_first_copy):
    _, path = saved
    first, graph, plan_file = plan_of_first_copy
    second = keras.models.load_model(path)
    inner = [layer.name for layer in second._flatten_layers(include_self=False) if layer.name.startswith("dense")]
    outer = [layer.name for layer in first._flatten_layers(include_self=False) if layer.name.startswith("dense")]
    assert inner != outer  # Keras named the copies' layers apart
    again = rewriter.capture(second, BATCH)
    assert again.op_name.tolist() != graph.op_name.tolist()  # the traced names differ, the canonical ones do not
    assert [again.meta["canonical_names"][n] for n in again.op_name] == \
        [graph.meta["canonical_names"][n] for n in graph.op_name]
    step = rewriter.apply(second, plan_file, batch_size=BATCH)
    planned = json.loads(plan_file.read_text())
    assert step.n_swap_outs == len(planned["swaps"]) and not step.skipped
    assert step.verification.ok, step.verification.summary()
    assert np.isfinite(float(step(*_batch())))


def test_another_process_takes_the_plan(saved, plan_of_first_copy):
    directory, path = saved
    _, _, plan_file = plan_of_first_copy
    script = textwrap.dedent(f'''
        import sys
        sys.path.insert(0, {str(directory)!r})
        import blocks_for_plan_names, keras, rewriter
        keras.models.load_model({str(path)!r})  # a copy first: the one the plan is applied to is named apart
        model = keras.models.load_model({str(path)!r})
        step = rewriter.apply(model, {str(plan_file)!r}, batch_size={BATCH})
        print("applied", step.n_swap_outs, len(step.skipped), step.verification.ok)
    ''')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    planned = json.loads(plan_file.read_text())
    assert f"applied {len(planned['swaps'])} 0 True" in done.stdout, done.stdout + done.stderr[-3000:]


def test_another_model_is_refused_and_no_op_of_the_order_is_dropped(saved, plan_of_first_copy, caplog):
    _, path = saved
    _, _, plan_file = plan_of_first_copy
    inputs = keras.Input((8,))
    other = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(keras.layers.Dense(16)(inputs)))
    other.compile(optimizer="adam", loss="categorical_crossentropy")
    with pytest.raises(PlanError, match="made for another model"):
        rewriter.apply(other, plan_file, batch_size=BATCH)
    # a swap-only plan whose order names an op the step does not have: said, not dropped silently; one whose
    # order is mostly of another step: refused
    data = json.loads(plan_file.read_text())
    data["swaps"] = []
    data["order"] = data["order"][:3] + ["functional/block/no_such_op"] + data["order"][3:]
    with caplog.at_level(logging.WARNING, logger="rewriter.edit.graph_edit"):
        rewriter.apply(keras.models.load_model(path), data, batch_size=BATCH, verify=False)
    assert any("1 of the" in r.getMessage() and "no_such_op" in r.getMessage() for r in caplog.records)
    data["order"] = [f"other/{name}" for name in data["order"]]
    with pytest.raises(PlanError, match="made for another model"):
        rewriter.apply(keras.models.load_model(path), data, batch_size=BATCH)
