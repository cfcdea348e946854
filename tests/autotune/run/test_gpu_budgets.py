"""GPU budgets and settings without a GPU: host budget arithmetic (pinned-memory limit, RAM less a
margin), GPUs without a preset, the setup path, the GPU peak reading, what a copy in waits for."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pandas as pd
import pytest

from simulator.device.presets import GiB, get_device, preset_for_gpu
from simulator.device.memory_budgets import (DEFAULT_PINNED_LIMIT_BYTES, PINNED_LIMIT_ENV, HostBudget, host_usable_bytes,
                                      pinned_limit_bytes, pinned_limit_to_set, usable_gpu_bytes)

MiB = 2**20
REPO = Path(__file__).resolve().parents[3]


def test_pinned_limit_default_and_environment():
    assert DEFAULT_PINNED_LIMIT_BYTES == 128 * GiB  # TF >= 2.15: 2**17 MiB
    assert pinned_limit_bytes(None) == pinned_limit_bytes("") == DEFAULT_PINNED_LIMIT_BYTES
    assert pinned_limit_bytes("65536") == 64 * GiB
    assert pinned_limit_bytes("not a number") == DEFAULT_PINNED_LIMIT_BYTES  # TF keeps its default too


def test_host_budget_is_the_least_of_three():
    physical = 2048 * GiB  # an 8-GPU node with 2 TB
    usable = host_usable_bytes(physical)
    assert physical - usable == int(physical * 0.10)
    assert host_usable_bytes(24 * GiB) == 20 * GiB  # the margin is at least 4 GiB
    preset = get_device("h100-80gb").host_memory_bytes  # 256 GiB per GPU
    default = HostBudget(preset, DEFAULT_PINNED_LIMIT_BYTES, usable)
    assert default.bytes == 128 * GiB and default.limited_by == "pinned limit"
    wanted = min(preset, usable) // MiB
    assert f"{PINNED_LIMIT_ENV}={wanted}" in default.describe()
    raised = HostBudget(preset, pinned_limit_bytes(pinned_limit_to_set(None, physical)), usable, "raised")
    assert raised.bytes == preset and raised.limited_by == "preset"
    small = HostBudget(preset, DEFAULT_PINNED_LIMIT_BYTES, host_usable_bytes(64 * GiB))
    assert small.bytes == 64 * GiB - int(6.4 * GiB) and small.limited_by == "physical memory"
    assert PINNED_LIMIT_ENV + "=" not in small.describe()  # nothing to raise: the machine has no more


def test_the_limit_is_raised_only_when_unset_and_the_machine_has_more():
    assert pinned_limit_to_set(None, 2048 * GiB) == str(host_usable_bytes(2048 * GiB) // MiB)
    assert pinned_limit_to_set(None, 64 * GiB) is None  # the default already exceeds what the machine has
    assert pinned_limit_to_set("4096", 2048 * GiB) is None  # the user's value stays


@pytest.mark.tf
def test_host_budget_with_and_without_the_environment_variable():
    from rewriter.host_memory import host_budget, raise_pinned_limit

    physical = 1024 * GiB
    env: dict[str, str] = {}
    assert host_budget(256 * GiB, environ=env, physical_bytes=physical).bytes == 128 * GiB  # TF's default
    assert raise_pinned_limit(env, physical_bytes=physical) == env[PINNED_LIMIT_ENV]
    assert int(env[PINNED_LIMIT_ENV]) == host_usable_bytes(physical) // MiB
    assert host_budget(256 * GiB, environ=env, physical_bytes=physical).bytes == 256 * GiB
    user = {PINNED_LIMIT_ENV: "4096"}
    assert raise_pinned_limit(user, physical_bytes=physical) is None and user[PINNED_LIMIT_ENV] == "4096"
    budget = host_budget(256 * GiB, environ=user, physical_bytes=physical)
    assert budget.bytes == 4 * GiB and budget.pinned_limit_source == "environment"
    assert "set in the environment" in budget.describe()


def test_gpus_without_a_preset():
    assert preset_for_gpu("NVIDIA L4") is None and preset_for_gpu("NVIDIA GeForce RTX 4090") is None
    assert preset_for_gpu("Tesla V100-SXM2-16GB") == "v100-16gb"
    assert preset_for_gpu("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    total = 24 * GiB  # a 24 GB card of compute capability 8.9
    budget = usable_gpu_bytes(total, 8)
    assert budget == int((total - GiB // 2 - 1536 * MiB) * 0.98)
    assert usable_gpu_bytes(total, 9) < budget < usable_gpu_bytes(total, 7) < total
    assert usable_gpu_bytes(total, None) == usable_gpu_bytes(total, 7)


@pytest.mark.tf
def test_unknown_gpu_budget_comes_from_the_reported_memory(monkeypatch):
    import rewriter.placement.placements as placement

    rows = [["NVIDIA L4", "23034"], ["NVIDIA L4", "23034"], ["Tesla T4", "15360"]]
    assert placement.parse_gpu_memory(rows, "NVIDIA L4") == 23034 * MiB
    assert placement.parse_gpu_memory(rows, "NVIDIA H800") is None
    tf = placement.tf
    device = tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: [device] if kind == "GPU" else [])
    monkeypatch.setattr(tf.config.experimental, "get_device_details",
                        lambda gpu: {"device_name": "NVIDIA L4", "compute_capability": (8, 9)})
    monkeypatch.setattr(tf.config, "get_logical_device_configuration", lambda gpu: None)
    monkeypatch.setattr(placement, "reported_gpu_memory", lambda name: placement.parse_gpu_memory(rows, name))
    name, budget = placement.gpu_memory()
    assert name == "NVIDIA L4" and budget == usable_gpu_bytes(23034 * MiB, 8) > 20 * GiB
    monkeypatch.setattr(placement, "reported_gpu_memory", lambda name: None)
    assert placement.gpu_memory() == ("NVIDIA L4", 0)


def test_resolve_device_for_a_visible_gpu(monkeypatch):
    import autotune.run.target as tuning  # where the budget is resolved
    from autotune.inputs import InputError

    def host(preset_bytes):
        return HostBudget(preset_bytes, DEFAULT_PINNED_LIMIT_BYTES, 40 * GiB)

    monkeypatch.setattr(tuning, "_visible_gpu", lambda: ("NVIDIA L4", 21 * GiB, host))
    model, budget, source = tuning.resolve_device(None, None)
    assert budget == 21 * GiB and model.name == tuning.DEFAULT_DEVICE and "no preset" in source
    assert model.host_memory_bytes == 40 * GiB  # the machine's RAM less a margin, below the preset's 64 GiB
    model, budget, _ = tuning.resolve_device("a100-80gb", None)
    assert budget == get_device("a100-80gb").budget_bytes and model.host_memory_bytes == 40 * GiB
    monkeypatch.setattr(tuning, "_visible_gpu", lambda: ("NVIDIA L4", 0, host))
    with pytest.raises(InputError, match="--memory"):
        tuning.resolve_device(None, None)
    monkeypatch.setattr(tuning, "_visible_gpu", lambda: None)  # no GPU: presets as they are
    model, _, _ = tuning.resolve_device("a100-80gb", None)
    assert model.host_memory_bytes == get_device("a100-80gb").host_memory_bytes


@pytest.mark.parametrize("args, expected", [
    ([], "venv=.venv extras=test"),
    (["--gpu"], "venv=.venv-gpu extras=gpu,dev"),
    (["--cpu"], "venv=.venv extras=test"),
])
def test_setup_path_selection(args, expected):
    result = subprocess.run(["bash", str(REPO / "scripts" / "setup"), *args, "--print-plan"], capture_output=True,
                            text=True, timeout=30, check=False)
    assert result.returncode == 0 and result.stdout.strip() == expected, result.stderr
    bad = subprocess.run(["bash", str(REPO / "scripts" / "setup"), "--gpus"], capture_output=True, text=True,
                         timeout=30, check=False)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_gpu_extras_do_not_pull_the_cpu_build():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    gpu_env = " ".join(extras["gpu"] + extras["dev"])  # what scripts/setup --gpu installs
    assert "tensorflow-cpu" not in gpu_env and "tensorflow[and-cuda]" in gpu_env
    assert any("tensorflow-cpu" in item for item in extras["cpu"]) and "tf-swap-autotune[cpu,dev]" in extras["test"]


def _events(rows):
    columns = ["time_ps", "kind", "addr", "requested_bytes", "allocation_bytes", "tf_op", "allocator_name"]
    frame = pd.DataFrame(rows, columns=columns)
    for column in ("region_type", "data_type", "shape", "thread"):
        frame[column] = ""
    frame["bytes_in_use"] = frame["step_id"] = 0
    return frame


@pytest.mark.tf
def test_gpu_peak_in_requested_bytes_beside_the_allocator_figure():
    from rewriter.placement.placements import gpu_reading

    events = _events([
        (1, "alloc", 10, 1000, 1024, "conv", "GPU_0_bfc"),
        (2, "alloc", 20, 500, 512, "swap_out/conv_0", "gpu_host_bfc"),  # the pinned host copy
        (3, "alloc", 30, 3000, 4096, "relu", "GPU_0_bfc"),
        (4, "free", 10, 1000, 1024, "conv", "GPU_0_bfc"),
        (5, "alloc", 40, 100, 256, "cudnn", "GPU_1_bfc"),  # another GPU
        (6, "free", 30, 3000, 4096, "relu", "GPU_0_bfc"),
    ])
    reading = gpu_reading(events, "GPU:0", allocator_peak_bytes=9999, current_bytes=2000, resident_bytes=700)
    assert reading.peak_bytes == 700 + 4000 and reading.allocator_peak_bytes == 9999
    assert reading.host_peak_bytes == 500 and reading.resident_bytes == 700
    nothing = gpu_reading(events.iloc[0:0], "GPU:0", allocator_peak_bytes=9999, current_bytes=2000)
    assert nothing.peak_bytes == nothing.allocator_peak_bytes == 9999


@pytest.mark.tf
def test_jit_compile_is_reported():
    from rewriter.step.gpu_graph import jit_compile_note

    class Model:
        jit_compile = True

    on, text = jit_compile_note(Model())
    assert on is True and "without XLA" in text
    Model.jit_compile = False
    assert jit_compile_note(Model())[0] is False
    assert jit_compile_note(object())[0] is None


def _node(graph, name, op, inputs=(), device="GPU:0", **attrs):
    node = graph.node.add()
    node.name, node.op, node.device = name, op, f"/job:localhost/replica:0/task:0/device:{device}"
    node.input.extend(inputs)
    for key, value in attrs.items():
        node.attr[key].s = value.encode()
    return node


def _partitions(copy_reads: str):
    """Partition graphs as TensorFlow builds them for one swap: the trigger's control edge to the host
    (dummy Const -> _Send -> _Recv), and the copy in (_Send on the host -> _Recv on the GPU) fed by
    ``copy_reads`` ("host": the host-side node with the control edge; "swap_out": the old construction)."""
    from tensorflow.core.framework import graph_pb2

    gpu, cpu = graph_pb2.GraphDef(), graph_pb2.GraphDef()
    link = {"send_device": "/job:localhost/replica:0/task:0/device:GPU:0",
            "recv_device": "/job:localhost/replica:0/task:0/device:CPU:0"}
    back = {"send_device": link["recv_device"], "recv_device": link["send_device"]}
    _node(gpu, "conv", "Conv2D")
    _node(gpu, "trigger", "Conv2DBackpropInput")
    _node(gpu, "trigger/_0", "Const", ["^trigger"])
    _node(gpu, "trigger/_1", "_Send", ["trigger/_0"], tensor_name="edge_1_trigger", **link)
    _node(gpu, "conv/_2", "_Send", ["conv"], tensor_name="edge_2_conv", **link)
    _node(cpu, "trigger/_3", "_Recv", [], device="CPU:0", tensor_name="edge_1_trigger", **link)
    _node(cpu, "conv/_4", "_Recv", [], device="CPU:0", tensor_name="edge_2_conv", **link)
    _node(cpu, "swap_out/conv_0", "Identity", ["conv/_4"], device="CPU:0")
    _node(cpu, "swap_in/conv_0/0_host", "Identity", ["swap_out/conv_0", "^trigger/_3"], device="CPU:0")
    source = "swap_in/conv_0/0_host" if copy_reads == "host" else "swap_out/conv_0"
    _node(cpu, "copy/_5", "_Send", [source], device="CPU:0", tensor_name=f"edge_5_{source}", **back)
    _node(gpu, "copy/_6", "_Recv", [], tensor_name=f"edge_5_{source}", **back)
    _node(gpu, "swap_in/conv_0/0", "Identity", ["copy/_6"])
    _node(gpu, "grad", "Conv2DBackpropFilter", ["swap_in/conv_0/0", "trigger"])
    post = {name: None for name in ("conv", "trigger", "swap_out/conv_0", "swap_in/conv_0/0_host",
                                    "swap_in/conv_0/0", "grad")}
    return [gpu, cpu], post


@pytest.mark.tf
@pytest.mark.parametrize("copy_reads, waits", [("host", True), ("swap_out", False)])
def test_what_the_copy_in_waits_for(copy_reads, waits):
    from rewriter.check.verification import CopyWaits

    partitions, post = _partitions(copy_reads)
    found = CopyWaits(partitions, post, accelerator="/device:GPU:0")
    assert found.copies_of("swap_in/conv_0/0") == ["copy/_6"]
    assert found.depends("copy/_6", "trigger") is waits
    assert found.depends("copy/_6", "conv")  # the data itself, either way
    assert found.waits_of("swap_in/conv_0/0_host") == ["trigger"]
    assert found.carries_control("trigger/_3") and not found.carries_control("conv/_4")


@pytest.mark.tf
def test_budget_as_the_gpu_memory_limit(monkeypatch, caplog):
    import rewriter.placement.placements as placement

    tf = placement.tf
    assert placement.limit_device_memory(8 * GiB) is False  # no GPU here
    device = tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")
    calls = []
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: [device] if kind == "GPU" else [])
    monkeypatch.setattr(tf.config, "get_logical_device_configuration", lambda gpu: None)
    monkeypatch.setattr(tf.config, "set_logical_device_configuration", lambda gpu, configs: calls.append(configs))
    assert placement.configure_testbed(gpu_memory_limit_bytes=int(14.08 * GiB)) is False  # a GPU: no CPU split
    assert [c[0].memory_limit for c in calls] == [int(14.08 * GiB) // MiB]

    def too_late(gpu, configs):
        raise RuntimeError("Virtual devices cannot be modified after being initialized")

    monkeypatch.setattr(tf.config, "set_logical_device_configuration", too_late)
    with caplog.at_level("WARNING"):
        assert placement.limit_device_memory(8 * GiB) is False
    assert "before the budget" in caplog.text


@pytest.mark.tf
def test_a_plan_copying_more_than_the_pinned_limit_is_told(caplog):
    from rewriter.host_memory import warn_if_pinned_limit_short

    with caplog.at_level("WARNING"):
        assert warn_if_pinned_limit_short(2 * GiB, environ={PINNED_LIMIT_ENV: "4096"}) is False
        assert warn_if_pinned_limit_short(6 * GiB, environ={PINNED_LIMIT_ENV: "4096"}) is True
    assert "ResourceExhausted" in caplog.text and PINNED_LIMIT_ENV in caplog.text


@pytest.mark.tf
def test_gpu_measure_peak_runs_the_profiled_call(monkeypatch, caplog):
    """GpuPlacement.measure_peak end to end on CPU (TF's memory APIs stubbed): the call runs under the
    profiler; with no GPU allocator in the trace the allocator figure is reported, and said so."""
    import rewriter.placement.placements as placement

    tf = placement.tf
    monkeypatch.setattr(tf.config.experimental, "reset_memory_stats", lambda device: None)
    monkeypatch.setattr(tf.config.experimental, "get_memory_info", lambda device: {"current": 100, "peak": 5000})
    calls = []

    @tf.function
    def step(x):
        return tf.reduce_sum(tf.square(x))

    def run(x):
        calls.append(1)
        return step(x)

    with caplog.at_level("WARNING"):
        reading = placement.GpuPlacement().measure_peak(run, tf.ones([64, 64]))
    assert calls == [1] and reading.peak_bytes == reading.allocator_peak_bytes == 5000
    assert reading.resident_bytes == 100 and "no allocation of GPU:0" in caplog.text
