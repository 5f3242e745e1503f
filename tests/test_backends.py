"""Other Keras backends: `AccumModel` on JAX and PyTorch equals large-batch
training.

Keras fixes its backend when first imported, and this test session runs on
TensorFlow, so each other backend's cases run once, in a fresh process
(`_backend_worker.py`, with `KERAS_BACKEND` set), which reports what it
measured as JSON; the tests here assert on it.
"""

import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import keras
import numpy as np
import pytest
from _helpers import (
    accum_mlp,
    continue_one_epoch,
    log_noise_scale,
    log_pseudo_batches,
    numpy_weights,
    regression_data,
    run_worker,
    train_to_an_open_window,
)

import keras_accum

WORKER = Path(__file__).with_name("_backend_worker.py")
BACKENDS = ("jax", "torch")
# The worker's micro-batch (`B` there).
BATCH = 8
TOLERANCE = 1e-6

# Case: (optimizer updates, micro-batches) over the whole run.
EQUIVALENCE = {
    # 2 epochs of 64 samples: 8 micro-batches of 8, 2 windows of 4 each.
    "sgd": (4, 16),
    "adam": (4, 16),
    "adamw_clipped": (4, 16),
    # 2 epochs of 70 samples: windows of 4, 4 and 1 (the short last batch).
    "uneven_last_batch": (6, 18),
    "lr_schedule": (4, 16),
    "clipnorm": (4, 16),
    "clipvalue": (4, 16),
    "class_weight": (6, 18),
    "multi_output_loss_weights": (6, 18),
    "unknown_length_dataset": (6, 18),
    "reduction_sum_over_batch_size": (6, 18),
    "reduction_sum": (6, 18),
    "reduction_mean_with_sample_weight": (6, 18),
    "run_eagerly": (2, 8),
}
# What differs by backend: Keras's PyTorch trainer refuses
# `steps_per_execution > 1`; its `jit_compile=True` is `torch.compile`.
BACKEND_EQUIVALENCE = {
    "jax": {"steps_per_execution_3": (6, 18)},
    "torch": {"jit_compile": (2, 8)},
}


def _equivalence(backend):
    return {**EQUIVALENCE, **BACKEND_EQUIVALENCE[backend]}


EQUIVALENCE_CASES = [
    (backend, name)
    for backend in BACKENDS
    for name in sorted(_equivalence(backend))
]


@pytest.fixture(scope="module")
def exchange(tmp_path_factory):
    """A TensorFlow-saved model for the worker to load, and its future."""
    directory = tmp_path_factory.mktemp("exchange")
    x, y = regression_data(n=70)
    model = accum_mlp(4, partial_window="carry")
    train_to_an_open_window(model, x, y, BATCH)
    model.save(directory / "tensorflow.keras")
    assert (model.mini_step, int(model.optimizer.iterations)) == (1, 2)
    return {
        "directory": directory,
        "x": x,
        "y": y,
        "predictions": model.predict(x, verbose=0),
        "continued": continue_one_epoch(model, x, y, BATCH),
    }


@pytest.fixture(scope="module")
def workers(exchange):
    """`results(backend)`: the worker's report, run once per backend."""
    reports = {}

    def results(backend):
        if backend not in reports:
            env = {
                **os.environ,
                "KERAS_BACKEND": backend,
                "TF_CPP_MIN_LOG_LEVEL": "3",
                # The equivalence is measured on CPU wherever the suite runs.
                "JAX_PLATFORMS": "cpu",
                # Two CPU devices for `keras.distribution` on JAX.
                "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                "CUDA_VISIBLE_DEVICES": "",
                "KERAS_ACCUM_EXCHANGE_DIR": str(exchange["directory"]),
            }
            reports[backend] = run_worker([WORKER], env)
        return reports[backend]

    return results


def _case(results, name):
    crashed = [c for c in results["cases"] if "traceback" in c]
    assert not crashed, "\n".join(c["traceback"] for c in crashed)
    return next(c for c in results["cases"] if c["case"] == name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_worker_ran_on_the_backend(backend, workers):
    results = workers(backend)
    assert results["backend"] == backend
    # The package imports only the backend in use: TensorFlow is optional.
    assert results["tensorflow_at_import"] is False
    names = {c["case"] for c in results["cases"]}
    expected = {
        *_equivalence(backend),
        *(["data_parallel"] if backend == "jax" else []),
        "unused_weights",
        "epoch_schedule",
        "schedule_by_update_count",
        "schedule_returning_zero",
        "tensorboard",
        "noise_scale_by_hand",
        "batch_normalization_1d",
        "batch_normalization_3d",
        "noise_scale_like_tensorflow",
        "non_finite_window",
        "mixed_float16",
        "mixed_bfloat16",
        "nan_under_loss_scaling",
        "save_and_load",
        "pseudo_batch_logger",
        "across_backends",
    }
    assert names == expected


@pytest.mark.parametrize(("backend", "name"), EQUIVALENCE_CASES)
def test_equals_large_batch_training(backend, name, workers, report_diff):
    case = _case(workers(backend), name)
    report_diff(case["max_weight_diff"], f"{backend}: {name}")
    # Over every update both models recorded, and the final weights.
    assert case["compared_updates"] >= 1, case
    assert case["max_weight_diff"] < TOLERANCE, case
    assert case["open_window"] == 0, case
    # The window's state is not a weight of the model.
    assert case["weights"] == case["plain_weights"], case


@pytest.mark.parametrize(("backend", "name"), EQUIVALENCE_CASES)
def test_iterations_count_updates_not_micro_batches(backend, name, workers):
    case = _case(workers(backend), name)
    updates, micro_batches = _equivalence(backend)[name]
    assert case["micro_batches"] == micro_batches, case
    assert case["updates"] == case["plain_updates"] == updates, case


@pytest.mark.parametrize("backend", BACKENDS)
def test_epoch_schedule(backend, workers, report_diff):
    # `{0: 2, 1: 4}`: batch 16 for an epoch (5 updates), then 32 (3).
    case = _case(workers(backend), "epoch_schedule")
    report_diff(case["max_weight_diff"], f"{backend}: epoch_schedule")
    assert case["max_weight_diff"] < TOLERANCE, case
    assert case["updates"] == case["plain_updates"] == 8, case


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_weight_the_loss_never_reaches(backend, workers, report_diff):
    case = _case(workers(backend), "unused_weights")
    report_diff(case["max_weight_diff"], f"{backend}: unused weights, AdamW")
    assert case["trainable_weights"] == 4, case
    assert case["updates"] == case["plain_updates"] == 4, case
    assert case["max_weight_diff"] < TOLERANCE, case
    # What the plain model does with it (JAX gives it a zero gradient:
    # weight decay moves it; PyTorch none: it stays), the window does too.
    moved = {"jax": True, "torch": False}[backend]
    assert (case["plain_unused_moved"] > 0) is moved, case


def test_jax_data_parallel_on_two_devices(workers, report_diff):
    case = _case(workers("jax"), "data_parallel")
    report_diff(case["max_weight_diff"], "jax: DataParallel, 2 devices")
    assert case["devices"] == 2, case
    # 70 samples: windows of 4, 4 and 1 micro-batches per epoch.
    assert case["updates"] == case["plain_updates"] == 6, case
    assert case["max_weight_diff"] < TOLERANCE, case
    assert case["same_layouts"], case


@pytest.mark.parametrize("backend", BACKENDS)
def test_schedule_by_update_count(backend, workers, report_diff):
    # 1 micro-batch for 3 updates, then windows of 4 (5 updates in all).
    case = _case(workers(backend), "schedule_by_update_count")
    report_diff(case["max_weight_diff"], f"{backend}: schedule by update")
    assert case["max_weight_diff"] < TOLERANCE, case
    assert case["updates"] == case["plain_updates"] == 5, case
    assert case["window_length"] == 4, case


@pytest.mark.parametrize("backend", BACKENDS)
def test_schedule_returning_a_bad_length_fails_at_fit_start(backend, workers):
    case = _case(workers(backend), "schedule_returning_zero")
    assert case["error"] == "ValueError", case
    assert "must return an integer >= 1" in case["message"], case
    assert "at update 0" in case["message"], case


@pytest.mark.parametrize("backend", BACKENDS)
def test_skips_a_non_finite_window(backend, workers, report_diff):
    # The first of two windows holds a NaN sample: skipped whole, so the
    # run equals one plain update on the second window's samples.
    case = _case(workers(backend), "non_finite_window")
    report_diff(case["max_weight_diff"], f"{backend}: non_finite_window")
    assert case["skipped_windows"] == 1, case
    assert case["updates"] == case["plain_updates"] == 1, case
    assert case["weights_finite"], case
    assert case["max_weight_diff"] < TOLERANCE, case


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "policy, atol", [("mixed_float16", 1e-4), ("mixed_bfloat16", 2e-3)]
)
def test_mixed_precision_tracks_plain_large_batch(
    backend, policy, atol, workers, report_diff
):
    # The same tolerances as on TensorFlow (tests/test_robustness.py).
    case = _case(workers(backend), policy)
    report_diff(case["max_weight_diff"], f"{backend}: {policy}")
    assert case["compute_dtype"] == policy.split("_")[1], case
    assert case["accumulator_dtype"] == "float32", case
    expected = "LossScaleOptimizer" if policy == "mixed_float16" else "Adam"
    assert case["optimizer"] == expected, case
    assert case["updates"] == case["plain_updates"] == 6, case
    assert case["skipped_windows"] == 0, case
    assert case["max_weight_diff"] < atol, case


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_under_loss_scaling_lowers_the_scale_like_a_large_batch(
    backend, workers
):
    case = _case(workers(backend), "nan_under_loss_scaling")
    # The large batch overflowed once: update skipped, scale halved.
    assert case["scales"] == [2.0**14, 2.0**14], case
    assert case["updates"] == case["plain_updates"] == 1, case
    assert case["skipped_windows"] == 1, case
    assert case["max_weight_diff"] < 1e-4, case


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_and_load_round_trip(backend, workers):
    case = _case(workers(backend), "save_and_load")
    assert case["is_accum_model"], case
    assert case["accum_steps"] == 4
    assert case["partial_window"] == "carry"
    assert case["weights_diff"] == 0.0
    assert case["predict_diff"] <= TOLERANCE
    # The window open at the save (one micro-batch) came back with it,
    # and so did the optimizer: both models then train identically.
    assert case["open_window"] == [1, 1]
    assert case["accumulators_diff"] == 0.0
    assert case["updates"] == [2, 2]
    assert case["continued_updates"] == [4, 4]
    assert case["continued_diff"] <= TOLERANCE
    assert case["evaluate_finite"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_pseudo_batch_losses_equal_tensorflow(backend, workers):
    # The same weights and data on both backends: the same windows, and
    # their losses to float32 rounding.
    case = _case(workers(backend), "pseudo_batch_logger")
    x, y = regression_data(n=70)
    model = accum_mlp(4)
    numpy_weights(model)
    expected = log_pseudo_batches(model, x, y, BATCH)
    # 70 samples per epoch at batch 8: windows of 4, 4 and 1 micro-batches.
    counts = [[u, s, m] for u, _, s, m in case["updates"]]
    assert counts == [[u, s, m] for u, _, s, m in expected["updates"]]
    assert counts[:3] == [[1, 32, 4], [2, 32, 4], [3, 6, 1]]
    losses = [u[1] for u in case["updates"]]
    expected_losses = [u[1] for u in expected["updates"]]
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    for key in ("loss_mean", "loss_std"):
        assert len(case[key]) == 2, case
        np.testing.assert_allclose(case[key], expected[key], rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_noise_scale_by_hand(backend, workers):
    # As in tests/test_noise_scale.py. Gradients 1, 2, 3, 4: N = k = 4,
    # sum n_j g_j^2 = 30, |G_W|^2 = 6.25, tr = 5/3, |G|^2 = 35/6.
    case = _case(workers(backend), "noise_scale_by_hand")
    equal = case["equal"]
    assert equal["micro_batches"] == 4, case
    np.testing.assert_allclose(equal["trace"], 5 / 3, rtol=1e-6)
    np.testing.assert_allclose(equal["grad_sq"], 35 / 6, rtol=1e-6)
    np.testing.assert_allclose(equal["estimate"], 2 / 7, rtol=1e-6)
    np.testing.assert_allclose(equal["logged"], [2 / 7], rtol=1e-6)
    # [1, 2], [3, 4], [5]: sum n_j g_j^2 = 54, N = 5, |G_W|^2 = 9, k = 3:
    # tr = 4.5, |G|^2 = 8.1.
    uneven = case["uneven"]
    assert (uneven["samples"], uneven["micro_batches"]) == (5, 3), case
    np.testing.assert_allclose(uneven["trace"], 4.5, rtol=1e-6)
    np.testing.assert_allclose(uneven["grad_sq"], 8.1, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_noise_scale_equals_tensorflow(backend, workers):
    case = _case(workers(backend), "noise_scale_like_tensorflow")
    x, y = regression_data(n=70)
    model = accum_mlp(4)
    numpy_weights(model)
    expected = log_noise_scale(model, x, y, BATCH)
    # Windows of 4, 4 and 1 micro-batches per epoch; every second window
    # estimates (updates 1, 3, 5), one-micro-batch windows cannot.
    counts = [u[:2] for u in case["updates"]]
    assert counts == [u[:2] for u in expected["updates"]]
    estimated = [u[0] for u in case["updates"] if u[2] is not None]
    assert estimated == [u[0] for u in expected["updates"] if u[2] is not None]
    assert estimated == [1, 5], case
    for got, want in zip(case["updates"], expected["updates"], strict=True):
        if want[2] is not None:
            np.testing.assert_allclose(got[2:], want[2:], rtol=1e-4)
    np.testing.assert_allclose(
        case["noise_scale"], expected["noise_scale"], rtol=1e-4
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rank", [1, 3], ids=["dense", "image"])
def test_batch_normalization_moving_statistics_equal_the_large_batch(
    backend, rank, workers, report_diff
):
    case = _case(workers(backend), f"batch_normalization_{rank}d")
    report_diff(case["max_abs_diff"], f"{backend}: AccumBatchNormalization")
    assert case["layers"] == 2, case
    # TensorFlow's relative tolerance (tests/test_layers.py): 2e-6.
    assert case["max_rel_diff"] < 2e-6, case
    assert case["max_abs_diff"] < 1e-5, case
    # The statistics moved away from their initial values...
    assert case["moved"] > 0.1, case
    # ...and the last, partial window was closed into them.
    assert case["open_counts"] == [0.0, 0.0], case


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensorboard_scalars_per_update(backend, workers):
    case = _case(workers(backend), "tensorboard")
    # 2 epochs of 8 micro-batches: 4 windows, one scalar each.
    assert [s[0] for s in case["scalars"]] == [1, 2, 3, 4], case
    np.testing.assert_allclose(
        [s[1] for s in case["scalars"]],
        [u[1] for u in case["logged"]],
        rtol=1e-6,
    )
    assert [u[0] for u in case["logged"]] == [1, 2, 3, 4], case


def _max_diff(a, b):
    return max(
        float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
        for u, v in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensorflow_saved_model_loads_and_trains_on(backend, workers, exchange):
    # Saved on TensorFlow with one micro-batch open after 2 updates: the
    # other backend gets the weights, the optimizer and the open window,
    # and its next epoch equals TensorFlow's.
    case = _case(workers(backend), "across_backends")
    assert case["loaded_is_accum_model"]
    assert case["loaded_open_window"] == 1
    assert case["loaded_updates"] == 2
    np.testing.assert_allclose(
        case["loaded_predictions"], exchange["predictions"], atol=1e-6
    )
    assert _max_diff(case["loaded_continued"], exchange["continued"]) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_saved_model_loads_and_trains_on_tensorflow(backend, workers, exchange):
    case = _case(workers(backend), "across_backends")
    x, y = exchange["x"], exchange["y"]
    loaded = keras.saving.load_model(exchange["directory"] / f"{backend}.keras")
    assert isinstance(loaded, keras_accum.AccumModel)
    assert (loaded.mini_step, int(loaded.optimizer.iterations)) == (1, 2)
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), case["saved_predictions"], atol=1e-6
    )
    continued = continue_one_epoch(loaded, x, y, BATCH)
    assert _max_diff(continued, case["saved_continued"]) < 1e-6


# -- Test modules written for every backend ------------------------------------

# Modules that use only `keras`, `keras.ops` and numpy: this session runs
# them on TensorFlow, and here each runs again under JAX and PyTorch, in one
# pytest process per backend whose JUnit report the tests below read.
EVERY_BACKEND_MODULES = (
    "test_divergence.py",
    "test_dropin.py",
    "test_construction.py",
    "test_embeddings.py",
)


@pytest.fixture(scope="module")
def module_runs(tmp_path_factory):
    """`cases(backend)`: `{(module, test): (outcome, message)}`."""
    reports = {}

    def cases(backend):
        if backend not in reports:
            report = tmp_path_factory.mktemp(f"junit_{backend}") / "r.xml"
            tests = Path(__file__).parent
            env = {
                **os.environ,
                "KERAS_BACKEND": backend,
                "TF_CPP_MIN_LOG_LEVEL": "3",
                "JAX_PLATFORMS": "cpu",
                "CUDA_VISIBLE_DEVICES": "",
            }
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    f"--junitxml={report}",
                    *(str(tests / module) for module in EVERY_BACKEND_MODULES),
                ],
                cwd=tests.parent,
                env=env,
                capture_output=True,
                timeout=1200,
                check=False,
            )
            reports[backend] = _junit_cases(report)
        return reports[backend]

    return cases


def _junit_cases(path):
    results = {}
    for case in ElementTree.parse(path).iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1] + ".py"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
                message = (
                    (child.get("message") or "")
                    + "\n"
                    + (child.text or "")[-2000:]
                )
        results[(module, case.get("name"))] = (outcome, message)
    return results


@pytest.mark.parametrize("module", EVERY_BACKEND_MODULES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_module_passes_on_backend(backend, module, module_runs):
    cases = {
        test: result
        for (name, test), result in module_runs(backend).items()
        if name == module
    }
    assert cases, f"no test of {module} ran on {backend}"
    failed = {
        test: message
        for test, (outcome, message) in cases.items()
        if outcome in ("failure", "error")
    }
    assert not failed, "\n\n".join(f"{t}: {m}" for t, m in failed.items())
    # A skip names a case that does not exist on the backend; never most.
    skipped = [t for t, (outcome, _) in cases.items() if outcome == "skipped"]
    assert len(skipped) < len(cases) / 2, skipped
