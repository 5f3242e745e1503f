"""The benchmark scripts run (tiny sizes); no test asserts a timing."""

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.tensorflow_only(
    reason="the benchmark scripts run on TensorFlow"
)

ROOT = Path(__file__).resolve().parents[1]


def _script(script, *args, env=None):
    """Runs `benchmarks/<script> *args`; returns the finished process."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result


# The JAX processes inherit the suite's quicker XLA compiles
# (tests/conftest.py; this file runs under TensorFlow, whose XLA_FLAGS hold
# no devices): a smoke run's time is mostly XLA compiling; LLVM's level 0
# alone halves it, with the same compiled memory analyses (checked on
# bench_low_precision.py's rows).

# For the PyTorch processes: one OpenMP thread. Its pool's threads spin
# while they wait: on a busy 2-core machine, up to twice a smoke run's
# CPU seconds; nothing here asserts a time.
_ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _in_process(script, *args):
    """Runs `benchmarks/<script>`'s `main(args)` in this process: for the
    TensorFlow scripts, whose own process would spend seconds of CPU
    importing TensorFlow, which this one (the suite's) holds already."""
    spec = importlib.util.spec_from_file_location(
        Path(script).stem, ROOT / "benchmarks" / script
    )
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)  # The script adds benchmarks/ to it.
    try:
        with warnings.catch_warnings():
            # Keras's, on `fit(dataset)`; its own process printed it unread.
            warnings.filterwarnings("ignore", "`shuffle=True` was passed")
            spec.loader.exec_module(module)
            assert module.main(list(args)) in (0, None)
    finally:
        sys.path[:] = path


def _run(script, out, *args, run=_script, **kwargs):
    """Runs `benchmarks/<script>` writing `out`, in a process of its own or
    (`run=_in_process`) in this one; returns its JSON."""
    common = ("--models=mlp", "--samples-per-run=256", f"--out={out}")
    run(script, *common, *args, **kwargs)
    return json.loads(out.read_text())


def test_throughput_script_smoke(tmp_path):
    rows = _run(
        "bench_throughput.py",
        tmp_path / "throughput.json",
        "--jit=off",
        "--ks=1,4",
        "--spe=1",
        "--rounds=1",
        run=_in_process,
    )["rows"]
    assert {(r["variant"], r["k"]) for r in rows} == {
        ("plain", 1),
        ("accum", 1),
        ("accum", 4),
        ("keras_ga", 4),
        ("large", 4),
    }
    assert all(r["samples_per_s"] > 0 for r in rows)


def test_noise_overhead_script_smoke(tmp_path):
    report = _run(
        "bench_noise_overhead.py",
        tmp_path / "noise_overhead.json",
        "--jit=off",
        "--ks=4",
        "--every=1,2",
        "--rounds=3",
        run=_in_process,
    )
    rows = report["rows"]
    assert [r["noise_scale_every"] for r in rows] == [0, 1, 2]
    assert all(len(r["ratios"]) == 3 for r in rows)
    assert all(
        r["ratio_q1"] <= r["ratio_median"] <= r["ratio_q3"] for r in rows
    )
    assert set(report["median_over_settings"]) == {"0", "1", "2"}


def test_backends_script_smoke(tmp_path):
    rows = _run(
        "bench_backends.py",
        tmp_path / "backends.json",
        "--backends=torch",
        "--ks=4",
        "--rounds=2",
        env=_ONE_THREAD,
    )["rows"]
    assert {(r["backend"], r["variant"], r["k"]) for r in rows} == {
        ("torch", "accum", 4),
        ("torch", "keras_ga", 4),
    }
    assert all(len(r["ratios"]) == 2 and r["ratio_median"] > 0 for r in rows)


def test_micro_batch_script_smoke(tmp_path):
    rows = _run(
        "bench_micro_batch.py",
        tmp_path / "micro_batch.json",
        "--backends=jax",
        "--micro-batch=8",
        "--accum-steps=4",
        "--rounds=2",
        "--memory",
    )["rows"]
    assert [r["variant"] for r in rows] == ["split", "keras_ga", "large"]
    assert all(len(r["ratios"]) == 2 and r["ratio_median"] > 0 for r in rows)
    by_variant = {r["variant"]: r["temp_p"] for r in rows}
    # The split step holds a micro-batch's activations, not the batch's.
    assert by_variant["split"] < by_variant["large"]


def test_window_positions_script_smoke(tmp_path):
    out = tmp_path / "window_positions.json"
    _in_process(
        "bench_window_positions.py",
        "--models=mlp",
        "--ks=2",
        "--windows=3",
        "--block=2",
        f"--out={out}",
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == [
        "accum",
        "keras_ga",
        "keras_ga_whole",
    ]
    for row in rows:
        assert len(row["position_ms"]) == 2
        assert all(t > 0 for t in row["position_ms"])
        assert row["window_ms"] == sum(row["position_ms"])
    reference = rows[1]
    assert reference["between_ms"] == reference["update_ms"] == 0
    assert reference["window_ratio"] == 1


# A measured process's arguments: the CNN as AccumModel(2, 4), one window.
_CNN_ACCUM_4 = ("--steps=1", "--child", "cnn", "accum", "4", "2")


def _memory_child(script, backend, *args):
    """What one measured process of `benchmarks/<script>` reports."""
    env = {"KERAS_BACKEND": backend}
    if backend == "torch":
        env.update(_ONE_THREAD)
    result = _script(script, *args, env=env)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_memory_child_on_torch_smoke():
    # One measured process of `bench_memory.py --backend=torch`.
    row = _memory_child("bench_memory.py", "torch", *_CNN_ACCUM_4)
    assert row["device"] == "CPU"
    assert row["peak_bytes"] > 0
    assert row["param_bytes"] == 455464  # The CNN's float32 weights.
    assert "tensor_peak_bytes" not in row  # TensorFlow's allocator only.


def test_data_memory_child_smoke():
    # One measured process of `bench_data_memory.py`: fit on arrays.
    row = _memory_child(
        "bench_data_memory.py", "tensorflow", "--child", "accum", "64"
    )
    assert row["data_bytes"] == 64 * 64 * 64 * 3 * 4 + 64 * 4
    assert row["peak_bytes"] > 0


def test_gpu_memory_child_on_torch_smoke():
    # One measured process of `bench_gpu_memory.py`, GPU or not.
    row = _memory_child("bench_gpu_memory.py", "torch", *_CNN_ACCUM_4)
    assert row["param_bytes"] == 455464
    measures = [row[name] for name in ("peak_bytes", "state_bytes")]
    if row["device"].startswith("CPU (no GPU"):
        assert measures == [None, None] and row["raw"] is None
    else:
        assert all(value >= 0 for value in measures)
        assert row["total_peak_bytes"] > 0


def test_loss_scale_script_smoke(tmp_path, capsys):
    out = tmp_path / "loss_scale.json"
    _in_process(
        "bench_loss_scale.py",
        "--backends=tensorflow",
        "--in-process",
        "--scales=16",
        "--dynamic-updates=1",
        f"--out={out}",
    )
    results = json.loads(out.read_text())["tensorflow"]
    # Both apply their update at 2^16 (the guide's table; 2^18, where both
    # overflow, is in test_robustness.py).
    for variant in ("large", "accum"):
        (row,) = results["one_update"][variant]
        assert not row["skipped"] and row["relative_error"] < 1e-3
    (dynamic,) = results["dynamic"]["accum"]
    assert dynamic["skipped"] == 0
    assert "| 16 |" in capsys.readouterr().out


def test_auto_accum_script_smoke(tmp_path, capsys):
    if not os.environ.get("TFDS_DATA_DIR"):
        pytest.skip("real MNIST needs TFDS_DATA_DIR (.ci/run sets it)")
    out = tmp_path / "auto.json"
    plot = tmp_path / "auto.png"
    _in_process(
        "bench_auto_accum.py",
        "--models=mlp",
        "--seeds=1",
        "--epochs=2",
        "--fixed=1,4",
        "--train-images=320",
        "--test-images=200",
        "--target=0.5",
        f"--out={out}",
    )
    rows = json.loads(out.read_text())
    assert [r["run"] for r in rows] == ["fixed 1", "fixed 4", "ramp", "auto"]
    by_run = {r["run"]: r for r in rows}
    # 10 micro-batches per epoch: 20 updates at 1, 6 at 4 (4, 4, 2 per
    # epoch); the ramp doubles from 1 after the second epoch, not yet.
    assert by_run["fixed 1"]["updates"] == 20
    assert by_run["fixed 4"]["updates"] == 6
    assert by_run["ramp"]["updates"] == 20
    # "auto" starts at windows of 2, and 2 epochs are within its warmup.
    assert by_run["auto"]["updates"] == 10
    assert all(0 < r["final_accuracy"] <= 1 for r in rows)
    assert "| mlp | auto | 10 |" in capsys.readouterr().out
    _in_process("bench_auto_accum.py", f"--out={out}", f"--plot={plot}")
    assert plot.stat().st_size > 10_000


# The script, then (in its process: one JAX start, not two) the HLO
# reading on two sums over sharded data, on the 2 devices it set up.
_BRANCHES = """
import json, runpy, sys
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from _collectives import collective_bytes
mesh = Mesh(jax.devices(), ("batch",))
x = jax.device_put(jnp.ones((8, 1000)), NamedSharding(mesh, P("batch")))
replicated = NamedSharding(mesh, P())
def in_branch(x, go):
    return jax.lax.cond(go, lambda x: x.sum(0), lambda x: jnp.zeros(1000), x)
def every_step(x):
    return x.sum(0)
print(json.dumps([
    collective_bytes(
        jax.jit(in_branch, out_shardings=replicated).lower(x, True).compile()
        .as_text()
    ),
    collective_bytes(
        jax.jit(every_step, out_shardings=replicated).lower(x).compile()
        .as_text()
    ),
]))
"""


def test_communication_script_tells_branches_from_every_step(tmp_path):
    """The HLO reading sees a sum over sharded data (4,000 bytes of
    float32) inside a conditional's branch and outside one; the script
    runs, and finds the plain step's gradient all-reduce."""
    out = tmp_path / "communication.json"
    script = ROOT / "benchmarks" / "bench_communication.py"
    result = subprocess.run(
        [sys.executable, "-c", _BRANCHES, str(script), "--devices=2"]
        + ["--accum-steps=4", "--rounds=1", "--steps=8", f"--out={out}"],
        # The script sets JAX's devices and backend itself.
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found == [
        {"every_step": 0, "in_branches": 4000},
        {"every_step": 4000, "in_branches": 0},
    ]
    rows = {
        (r["variant"], r["accum_steps"]): r for r in json.loads(out.read_text())
    }
    assert set(rows) == {("plain", 1), ("keras_ga", 4), ("accum_model", 4)}
    plain = rows[("plain", 1)]
    # 256-512-512-10: 399,370 float32 weights.
    assert plain["gradient_bytes"] == 4 * 399_370
    assert plain["every_step"] >= plain["gradient_bytes"]
    # AccumModel's devices keep partial sums: the gradient at the close.
    accum = rows[("accum_model", 4)]
    assert accum["every_step"] <= 16
    assert accum["in_branches"] >= plain["gradient_bytes"]
    assert accum["bytes_per_sample"] < plain["bytes_per_sample"] / 3
    # Timed: each variant against the plain model of the same run.
    assert plain["ratio_to_plain"] == 1.0
    assert all(r["ratio_to_plain"] > 0 for r in rows.values())


def test_auto_micro_batch_script_smoke(tmp_path):
    out = tmp_path / "auto_micro_batch.json"
    _script(
        "bench_auto_micro_batch.py",
        "--backends=jax",
        "--models=mlp",
        "--batch=32",
        # The limit halfway between the peaks at 5 and 6: 5 is chosen, and
        # three tasks give every figure (the peaks at 5 and 6, "auto");
        # 4:32 took five. (The peak at 4 is above 5's: not monotonic.)
        "--pairs=5:6",
        # JAX's figures are compiled analyses: the same in one process.
        "--in-process",
        f"--out={out}",
    )
    (row,) = json.loads(out.read_text())["rows"]
    # JAX's figures are exact: the size chosen fits, the next does not.
    assert 5 <= row["chosen"] < 32
    assert row["predicted_peak"] == row["measured_at_chosen"] <= row["limit"]
    assert row["measured_at_next"] > row["limit"]


def test_low_precision_benchmark_runs(tmp_path):
    # The sections run in a JAX process of the script's own, whatever
    # backend the suite runs under.
    out = tmp_path / "low_precision.json"
    result = _script("bench_low_precision.py", "--quick", f"--json={out}")
    report = json.loads(out.read_text())
    assert report["quick"] is True
    for row in report["bias"]["rows"]:
        k = row["k"]
        # float32 sums exactly; Keras's bfloat16 accumulators stagnate at
        # 256 (256 + 0.5 rounds back to 256); stochastic rounding does not.
        assert row["f32"]["mean_error"] == 0
        assert row["keras"]["mean_error"] == -(k - 1) * 0.5
        assert abs(row["bf16"]["mean_error"]) < 0.05 * (k - 1) * 0.5
        assert row["bf16"]["std_error"] > 0
    (row,) = report["error"]["rows"]
    error = row["relative_error"]
    # float32 accumulators: the float64 mean of the same gradients, to
    # float32's rounding; bfloat16 sums: to bfloat16's (2**-8) or so.
    assert error["f32"] < 1e-5
    assert 0 < error["bf16"] < 0.05 and 0 < error["rtn"] < 0.05
    assert error["large_bf16"] > error["f32"]
    assert abs(row["along"]["f32"]) < 1e-5
    rows = report["training"]["rows"]
    assert {(r["model"], r["variant"]) for r in rows} == {
        (m, v) for m in ("mlp", "lm") for v in ("f32", "bf16", "keras")
    }
    for row in rows:
        metric = "eval_loss" if row["model"] == "lm" else "train_loss"
        assert 0 < row[metric]["mean"] < 10
    memory = {r["row"]: r for r in report["memory"]["rows"]}
    per_param = {
        name: r["accumulator_bytes_per_param"] for name, r in memory.items()
    }
    assert per_param["plain"] == per_param["large"] == 0
    assert per_param["keras"] == 2 and per_param["f32"] == 4
    # Half of float32's, but for the small weights' float32 accumulators.
    assert 2 < per_param["bf16"] < 2.05
    # JAX's compiled step: the bfloat16 accumulators add their own size.
    extra = memory["bf16"]["jax"]["over_plain_per_param"]
    assert 2 <= extra < 2.1
    assert extra < memory["f32"]["jax"]["over_plain_per_param"]
    assert "| AccumModel bfloat16 |" in result.stdout
    # float32 weights: the bfloat16 accumulators still save their half.
    f32 = {r["row"]: r["jax"] for r in report["memory_float32"]["rows"]}
    assert set(f32) == {"plain", "f32", "bf16"}
    saved = (
        f32["f32"]["over_plain_per_param"] - f32["bf16"]["over_plain_per_param"]
    )
    assert saved >= 1.5, f32
    assert "float32 MLP" in result.stdout
