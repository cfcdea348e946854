"""Bad input to the simulator gets one clear error."""

from __future__ import annotations

import pytest

from simulator import FORWARD, GraphError, OpGraph, ParamsError, SwapParams
from simulator.synthetic import OpSpec, from_spec


def test_cycle_is_reported_with_its_ops():
    with pytest.raises(GraphError, match="cycle"):
        OpGraph.build(op_name=["a", "b"], op_type=["X", "X"], op_phase=[FORWARD, FORWARD],
                      tensor_producer=[0, 1], tensor_bytes_ab=[(1, 0), (1, 0)],
                      edge_tensor=[0, 1], edge_consumer=[1, 0])


def test_self_loop_is_a_cycle():
    with pytest.raises(GraphError, match="itself"):
        from_spec([OpSpec("a", control_inputs=["a"])])


def test_dangling_index():
    with pytest.raises(GraphError, match="outside"):
        OpGraph.build(op_name=["a"], op_type=["X"], op_phase=[FORWARD], tensor_producer=[3],
                      tensor_bytes_ab=[(1, 0)], edge_tensor=[], edge_consumer=[])


@pytest.mark.parametrize("kwargs,message", [
    ({"threshold": 3, "lb": 5, "ub": 2}, "lb"),
    ({"threshold": 0}, "threshold"),
    ({"threshold": -1}, "threshold"),
    ({"threshold": 3, "lb": 0}, "lb"),
    ({"threshold": 3, "ub": 0}, "ub"),
    ({"threshold": 3, "groupby": -1}, "groupby"),
    ({"threshold": 3, "min_bytes": -5}, "min_bytes"),
    ({"threshold": 2.5}, "threshold"),
    ({"threshold": 3, "sync": "sometimes"}, "sync"),
])
def test_bad_params(kwargs, message):
    with pytest.raises(ParamsError, match=message):
        SwapParams(**kwargs)


def test_load_of_a_non_graph_file(tmp_path):
    path = tmp_path / "x.npz"
    path.write_text("not a graph")
    with pytest.raises(GraphError, match="not a saved OpGraph"):
        OpGraph.load(path)
