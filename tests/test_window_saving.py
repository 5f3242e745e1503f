"""Saving and loading an `AccumModel`: a damaged or incompatible window
fails naming the entry, its value and the file, before anything is
assigned; every window training can produce loads; legacy `.h5` files; a
load without `import keras_accum`."""

import os
import re
import shutil
import warnings
import zipfile

import h5py
import keras
import ml_dtypes
import numpy as np
import pytest
from _helpers import (
    LargeBatch,
    accum_mlp,
    assert_equivalent,
    mlp,
    regression_data,
    run_in_fresh_process,
)

import keras_accum

B, K = 8, 4
# The file format, written out rather than imported from the library: a
# counter renamed there must fail these tests, as old files would.
COUNTERS = (
    "acc_normalizer",
    "acc_loss",
    "acc_samples",
    "acc_grad_sq",
    "mini_step",
    "epoch",
    "epoch_step",
    "window_length",
    "skipped_windows",
    "target_length",
    "auto_estimates",
    "auto_trace",
    "auto_grad_sq",
    "auto_progress",
    "rounding_seed",
    "rounding_draws",
)
INTS = (
    "mini_step",
    "epoch",
    "epoch_step",
    "window_length",
    "skipped_windows",
    "target_length",
    "auto_estimates",
    "rounding_seed",
    "rounding_draws",
)
# The layout these tests write out.
FORMAT_VERSION = 2


def _compiled(model):
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _batches(n=64):
    x, y = regression_data(n=n)
    return [(x[i : i + B], y[i : i + B]) for i in range(0, n, B)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A weights file and a `.keras` file of a window 2 of 4 micro-batches
    in, after one update; the two batches that close it."""
    directory = tmp_path_factory.mktemp("saved")
    batches = _batches()
    model = _compiled(accum_mlp(K))
    for xb, yb in batches[:6]:
        model.train_on_batch(xb, yb)
    assert model.mini_step == 2
    model.save_weights(directory / "base.weights.h5")
    model.save(directory / "base.keras")
    return directory, batches[6:]


def _window_group(h5):
    """The H5 group holding the saved window's entries."""
    found = []
    h5.visititems(
        lambda name, item: (
            found.append(name)
            if isinstance(item, h5py.Group) and "mini_step" in item
            else None
        )
    )
    assert len(found) == 1, found
    return h5[found[0]]


def _set(group, name, value):
    del group[name]
    group[name] = value


def _corrupted(source, target, edit):
    """A copy of a weights or `.keras` file with `edit(window group)`."""
    if str(source).endswith(".keras"):
        with zipfile.ZipFile(source) as archive:
            archive.extractall(target.with_suffix(".d"))
        weights = target.with_suffix(".d") / "model.weights.h5"
        with h5py.File(weights, "r+") as h5:
            edit(_window_group(h5))
        with zipfile.ZipFile(target, "w") as archive:
            for path in sorted(target.with_suffix(".d").iterdir()):
                archive.write(path, path.name)
        return target
    shutil.copy(source, target)
    with h5py.File(target, "r+") as h5:
        edit(_window_group(h5))
    return target


def _window_values(model):
    return [
        np.array(keras.ops.convert_to_numpy(v)) for v in model.accumulators
    ] + [
        int(model.mini_step),
        int(model.window_length),
        int(model.skipped_windows),
    ]


# -- The cases of issue 21 -----------------------------------------------------

ISSUE_CASES = [
    # (entry, edit, what the message says)
    (
        "mini_step",
        lambda g: _set(g, "mini_step", np.int32(-3)),
        r"entry `mini_step` = -3 is outside 0\.\.3 \(window_length=4, "
        r"accum_steps=4\)",
    ),
    (
        "mini_step",
        lambda g: _set(g, "mini_step", np.int32(9)),
        r"entry `mini_step` = 9 is outside 0\.\.3",
    ),
    (
        "mini_step",
        lambda g: _set(g, "mini_step", np.int32(4)),
        r"entry `mini_step` = 4 is outside 0\.\.3",
    ),
    (
        "window_length",
        lambda g: _set(g, "window_length", np.int32(0)),
        r"entry `window_length` = 0 is outside 1\.\.",
    ),
    (
        "acc_normalizer",
        lambda g: _set(g, "acc_normalizer", np.float32(0)),
        r"entry `acc_normalizer` = 0\.0 is not 16 \(acc_samples=16",
    ),
    (
        "acc_normalizer",
        lambda g: _set(g, "acc_normalizer", np.float32(-16)),
        r"entry `acc_normalizer` = -16\.0 is not 16",
    ),
    (
        "acc_grad_0",
        lambda g: _set(
            g, "acc_grad_0", np.asarray(g["acc_grad_0"]).astype("int32")
        ),
        r"entry `acc_grad_0` = <array of shape \(5, 8\)>.* has dtype int32; "
        r"keras-accum saves it as float32",
    ),
    (
        "mini_step",
        lambda g: g.__delitem__("mini_step"),
        r"does not have the entries .*: missing `mini_step`",
    ),
    (
        "acc_normalizer",
        lambda g: g.__delitem__("acc_normalizer"),
        r"missing `acc_normalizer`",
    ),
    (
        "skipped_windows",
        lambda g: _set(g, "skipped_windows", np.int32(-5)),
        r"entry `skipped_windows` = -5 is outside 0\.\.",
    ),
    (
        "epoch",
        lambda g: _set(g, "epoch", np.int32(-1)),
        r"entry `epoch` = -1 is outside 0\.\.",
    ),
    (
        "mini_step",
        lambda g: _set(g, "mini_step", "2"),
        r"entry `mini_step` = '2'.* has dtype object; keras-accum saves it as "
        r"int32",
    ),
    (
        "extra",
        lambda g: g.__setitem__("mini_steps", np.int64(2)),
        r"unknown `mini_steps`",
    ),
    # `accum_steps="auto"`'s controller.
    (
        "auto_trace",
        lambda g: _set(g, "auto_trace", np.float32("inf")),
        r"entry `auto_trace` = inf is outside the finite numbers",
    ),
    (
        "auto_grad_sq",
        lambda g: _set(g, "auto_grad_sq", np.float32("nan")),
        r"entry `auto_grad_sq` = nan is outside the finite numbers",
    ),
    (
        "auto_progress",
        lambda g: _set(g, "auto_progress", np.float32(-2)),
        r"entry `auto_progress` = -2\.0 is outside the finite numbers >= 0",
    ),
    (
        "target_length",
        lambda g: _set(g, "target_length", np.int32(0)),
        r"entry `target_length` = 0 is outside 1\.\.",
    ),
    (
        "auto_estimates",
        lambda g: _set(g, "auto_estimates", np.int32(-1)),
        r"entry `auto_estimates` = -1 is outside 0\.\.",
    ),
    (
        "auto_trace",
        lambda g: g.__delitem__("auto_trace"),
        r"missing `auto_trace`",
    ),
]


@pytest.fixture(scope="module")
def other_model():
    """A model with a state of its own (one micro-batch in) that every
    damaged file below fails to load into."""
    model = _compiled(accum_mlp(K, seed=3))
    xb, yb = _batches()[0]
    model.train_on_batch(xb, yb)
    return model


@pytest.mark.parametrize(
    "entry, edit, message", ISSUE_CASES, ids=[c[2][:40] for c in ISSUE_CASES]
)
def test_damaged_window_fails_naming_entry_value_and_file(
    saved, other_model, tmp_path, entry, edit, message
):
    directory, _ = saved
    path = _corrupted(
        directory / "base.weights.h5", tmp_path / "w.weights.h5", edit
    )
    model = other_model
    before = [w.copy() for w in model.get_weights()], _window_values(model)
    assert before[1][-3] == 1  # mini_step
    with pytest.raises(ValueError, match=message) as raised:
        model.load_weights(path)
    assert str(path) in str(raised.value)
    # Nothing assigned: no half-loaded window or weights.
    for a, b in zip(before[0], model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(before[1], _window_values(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_damaged_keras_file_fails_naming_the_entry(
    saved, other_model, tmp_path
):
    directory, _ = saved
    path = _corrupted(
        directory / "base.keras",
        tmp_path / "m.keras",
        lambda g: _set(g, "mini_step", np.int32(-3)),
    )
    message = r"`mini_step` = -3 is outside 0\.\.3"
    # Keras gathers the objects that failed to load into one error, with
    # ours in it; it does not tell the objects which file it reads.
    with pytest.raises(ValueError, match=message):
        keras.saving.load_model(path)
    before = [w.copy() for w in other_model.get_weights()]
    with pytest.raises(ValueError, match=message) as raised:
        other_model.load_weights(path)
    assert str(path) in str(raised.value)
    for a, b in zip(before, other_model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_skip_mismatch_loads_the_weights_and_keeps_the_window(saved, tmp_path):
    directory, _ = saved
    path = _corrupted(
        directory / "base.weights.h5",
        tmp_path / "w.weights.h5",
        lambda g: _set(g, "mini_step", np.int32(-3)),
    )
    model = _compiled(accum_mlp(K, seed=3))
    xb, yb = _batches()[0]
    model.train_on_batch(xb, yb)
    with pytest.warns(UserWarning, match=r"`mini_step` = -3"):
        model.load_weights(path, skip_mismatch=True)
    assert model.mini_step == 1  # Its own window, untouched.
    reference = _compiled(accum_mlp(K))
    reference.load_weights(directory / "base.weights.h5")
    for a, b in zip(reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


# -- What the current release saves keeps loading ------------------------------


@pytest.mark.parametrize("fmt", ["weights", "keras"])
def test_saved_window_loads_and_closes_as_uninterrupted(saved, fmt):
    directory, rest = saved
    reference = _compiled(accum_mlp(K))
    for xb, yb in _batches()[:8]:
        reference.train_on_batch(xb, yb)
    if fmt == "keras":
        model = keras.saving.load_model(directory / "base.keras")
    else:
        model = _compiled(accum_mlp(K, seed=3))
        model.load_weights(directory / "base.weights.h5")
    assert model.mini_step == 2
    for xb, yb in rest:
        model.train_on_batch(xb, yb)
    assert int(model.optimizer.iterations) == 2
    for a, b in zip(reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-7)


def _every_four(updates):
    return keras.ops.where(updates >= 0, K, 1)


@pytest.mark.parametrize(
    "case", ["sum", "negative_weights", "two_outputs", "callable", "masked"]
)
def test_every_normalizer_rule_loads_what_training_saves(case, tmp_path):
    # Three micro-batches of a window of 4, saved and loaded, for each kind
    # of normalizer: none (summed losses), sample weights of either sign,
    # one per sample (two outputs), and loss entries (a callable schedule,
    # whose window may have any length; a mask, which counts fewer).
    x, y = regression_data(n=24)
    if case == "masked":
        rng = np.random.default_rng(0)
        x = rng.integers(0, 3, size=(24, 6))  # Token 0 is masked out.
        y = rng.normal(size=(24, 6, 3)).astype("float32")
    loss, weights = "mse", None
    if case == "sum":
        loss = keras.losses.MeanSquaredError(reduction="sum")
    elif case == "negative_weights":
        loss = keras.losses.MeanSquaredError(
            reduction="mean_with_sample_weight"
        )
        weights = np.where(np.arange(24) % 2 == 0, -1.0, 0.5).astype("float32")

    def build():
        if case == "masked":
            inputs = keras.Input((6,), dtype="int32")
            hidden = keras.layers.Embedding(3, 4, mask_zero=True)(inputs)
            outputs = keras.layers.Dense(3)(hidden)
            model = keras_accum.AccumModel(inputs, outputs, accum_steps=K)
        elif case == "two_outputs":
            inputs = keras.Input((5,))
            hidden = keras.layers.Dense(4)(inputs)
            outputs = [
                keras.layers.Dense(3)(hidden),
                keras.layers.Dense(3)(hidden),
            ]
            model = keras_accum.AccumModel(inputs, outputs, accum_steps=K)
        else:
            model = accum_mlp(_every_four if case == "callable" else K)
        model.compile(optimizer="adam", loss=loss)
        return model

    model = build()
    for i in range(3):
        part = slice(B * i, B * (i + 1))
        yb = [y[part], y[part]] if case == "two_outputs" else y[part]
        sw = None if weights is None else weights[part]
        model.train_on_batch(x[part], yb, sample_weight=sw)
    assert model.mini_step == 3
    normalizer = float(
        keras.ops.convert_to_numpy(model._window.counters.acc_normalizer)
    )
    expected = {
        "sum": 0.0,
        "negative_weights": -6.0,
        "masked": float(np.count_nonzero(x)),
    }.get(case, 24.0)
    assert normalizer == expected
    model.save_weights(tmp_path / "m.weights.h5")
    restored = build()
    restored.load_weights(tmp_path / "m.weights.h5")
    assert restored.mini_step == 3
    loaded = keras.ops.convert_to_numpy(
        restored._window.counters.acc_normalizer
    )
    assert float(loaded) == expected


# -- Property: a damaged window fails loudly or trains as the saved one -------

SPECIALS = (np.nan, np.inf, -np.inf, -16.0, -1.0, 0.0, 0.5, 16.0, 24.0, 1e9)


def _random_damage(rng, group):
    """One random corruption of the window; returns the entries it names."""
    entries = [f"acc_grad_{i}" for i in range(4)] + list(COUNTERS)
    name = str(rng.choice(entries))
    old = np.asarray(group[name])
    kind = str(rng.choice(["value", "dtype", "remove", "extra", "shape"]))
    if kind == "value" and name.startswith("acc_grad_"):
        # Any float32 is a value training can produce there (NaN and inf
        # included: such a window is skipped at its close).
        kind = "dtype"
    if kind == "value":
        if name in INTS:
            value = rng.choice([rng.integers(-10, 20), -(2**40), 2**31])
            _set(group, name, np.asarray(value, old.dtype))
        else:
            value = rng.choice([*SPECIALS, rng.normal() * 50])
            _set(group, name, np.float32(value))
    elif kind == "dtype":
        dtype = rng.choice(
            ["float16", "float32", "float64", "int16", "int32", "int64", "str"]
        )
        if dtype == "str":
            _set(group, name, str(old.tolist()))
        else:
            _set(group, name, old.astype(dtype))
    elif kind == "remove":
        del group[name]
    elif kind == "extra":
        name = str(rng.choice(["acc_grad_4", "mini_steps", "format_version"]))
        if name in group:  # `format_version`, which files now hold
            del group[name]
        group[name] = np.int64(1)
    else:
        _set(group, name, old.reshape((1, *old.shape)))
    return name


def test_property_random_damage_fails_naming_the_entry_or_trains_the_same(
    saved, tmp_path
):
    directory, rest = saved
    base = directory / "base.weights.h5"
    model = _compiled(accum_mlp(K, seed=3))

    def resume():
        for xb, yb in rest:
            model.train_on_batch(xb, yb)
        return int(model.optimizer.iterations), model.get_weights()

    model.load_weights(base)
    expected_iterations, expected = resume()
    loaded = failed = warned = 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        holder = []
        path = _corrupted(
            base,
            tmp_path / f"{seed}.weights.h5",
            lambda group, rng=rng, holder=holder: holder.append(
                _random_damage(rng, group)
            ),
        )
        name = holder[0]
        model.load_weights(base)
        before = _window_values(model)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model.load_weights(path)
        except ValueError as error:
            failed += 1
            assert f"`{name}`" in str(error) or f"{name}=" in str(error), (
                seed,
                str(error),
            )
            for a, b in zip(before, _window_values(model), strict=True):
                np.testing.assert_array_equal(a, b)
            continue
        loaded += 1
        if name == "window_length" and caught:
            # Another length for the open window: loaded as saved, with a
            # warning naming it (see the test above).
            assert any("`window_length`" in str(w.message) for w in caught)
            warned += 1
            continue
        iterations, weights = resume()
        assert iterations == expected_iterations, (seed, name)
        for a, b in zip(expected, weights, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"seed {seed}: {name}")
    # Both outcomes are exercised.
    assert failed > 100 and loaded > 3, (failed, loaded)


def test_window_saved_after_changing_accum_steps_loads_with_a_warning(
    tmp_path,
):
    # An open window keeps the length it started with. A restart builds the
    # model with the first `accum_steps`, which cannot tell a window opened
    # under another value from damage: it loads the window as saved and
    # says so (refusing would make such a run impossible to resume).
    model = _compiled(accum_mlp(K))
    batches = _batches()
    for xb, yb in batches[:2]:
        model.train_on_batch(xb, yb)
    model.accum_steps = 2
    model.save_weights(tmp_path / "m.weights.h5")
    restored = _compiled(accum_mlp(2))
    with pytest.warns(
        UserWarning,
        match=r"`window_length` = 4 is not 2 \(accum_steps=2\) in .*m\.weights"
        r"\.h5: the open window \(2 micro-batches in\) closes after 4",
    ) as caught:
        restored.load_weights(tmp_path / "m.weights.h5")
    # Once, though the file's window is checked twice (before Keras loads
    # anything, and as it loads).
    assert sum("`window_length`" in str(w.message) for w in caught) == 1
    for model_ in (model, restored):
        for xb, yb in batches[2:4]:
            model_.train_on_batch(xb, yb)
        assert int(model_.optimizer.iterations) == 1  # The window of 4.
    for a, b in zip(model.get_weights(), restored.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-7)


# -- Legacy H5 files ----------------------------------------------------------


@keras.saving.register_keras_serializable(package="test_window_saving")
class SubclassedMLP(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


def _h5_model(kind):
    if kind == "functional":
        return accum_mlp(K, partial_window="carry")
    keras.utils.set_random_seed(1)
    inner = SubclassedMLP()
    inner(np.zeros((1, 5), "float32"))
    return keras_accum.AccumModel.from_model(
        inner, accum_steps=K, partial_window="carry"
    )


@pytest.mark.parametrize("kind", ["functional", "from_model"])
def test_h5_file_loads_model_weights_and_settings_not_the_window(
    kind, tmp_path
):
    x, y = regression_data(n=64)
    model = _h5_model(kind)
    # Keras's legacy loader cannot read back a loss given by name.
    loss = keras.losses.MeanSquaredError()
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
    model.fit(x[:24], y[:24], batch_size=B, shuffle=False, verbose=0)
    assert model.mini_step == 3
    with pytest.warns(UserWarning, match=r"not the open accumulation window"):
        model.save(tmp_path / "m.h5")
    restored = keras.saving.load_model(tmp_path / "m.h5")
    assert type(restored) is type(model)
    assert restored.accum_steps == K
    assert restored.partial_window == "carry"
    assert restored.mini_step == 0
    for a, b in zip(model.get_weights(), restored.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(
        model.predict(x, verbose=0), restored.predict(x, verbose=0)
    )
    # Keras 3.15's legacy loader builds the optimizer for no variables, for
    # a plain `keras.Model` too: recompiled, it trains.
    restored.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
    restored.fit(x[:40], y[:40], batch_size=B, shuffle=False, verbose=0)
    assert int(restored.optimizer.iterations) == 1
    assert restored.mini_step == 1


def test_h5_save_of_a_closed_window_does_not_warn(tmp_path):
    x, y = regression_data(n=32)
    model = _compiled(accum_mlp(K))
    model.fit(x, y, batch_size=B, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.save(tmp_path / "m.h5")
    assert not [w for w in caught if "accumulation window" in str(w.message)]


# -- Loading without `import keras_accum` -------------------------------------

_LOAD_WITHOUT_PACKAGE = """
import json, sys
import keras
outcomes = []
for path in sys.argv[1:]:
    try:
        keras.saving.load_model(path)
        outcomes.append({"error": None, "message": ""})
    except Exception as error:
        outcomes.append({"error": type(error).__name__, "message": str(error)})
imported = "keras_accum" in sys.modules
print("RESULTS " + json.dumps({"outcomes": outcomes, "imported": imported}))
"""


@pytest.mark.full_run_only(
    reason="the file's config names the class alike on every backend, and "
    "Keras looks it up in backend-free code"
)
def test_loading_without_the_package_names_it(tmp_path):
    paths = []
    for kind in ("functional", "from_model"):
        model = _h5_model(kind)
        model.compile(optimizer="adam", loss="mse")
        paths.append(tmp_path / f"{kind}.keras")
        model.save(paths[-1])
    script = tmp_path / "load.py"
    script.write_text(_LOAD_WITHOUT_PACKAGE)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("PYTHONPATH", None)
    results = run_in_fresh_process([script, *paths], env)
    assert results["imported"] is False
    for outcome, name in zip(
        results["outcomes"],
        ["keras_accum.AccumModel", "keras_accum.AccumModel.from_model"],
        strict=True,
    ):
        assert outcome["error"] == "TypeError"
        assert f"Could not locate class '{name}'" in outcome["message"]
        assert "make sure they are all imported" in outcome["message"]


# -- The layout's version ------------------------------------------------


def _resumed(model, path, rest):
    model.load_weights(path)
    for xb, yb in rest:
        model.train_on_batch(xb, yb)
    return model.get_weights()


def test_a_file_records_its_layout_version(saved):
    directory, _ = saved
    with h5py.File(directory / "base.weights.h5", "r") as h5:
        group = _window_group(h5)
        assert group["format_version"][()] == FORMAT_VERSION == 2
        assert group["format_version"].dtype == np.int32


def test_a_version_1_file_loads_without_the_rounding_draw(saved, tmp_path):
    # Version 2 added `rounding_seed` and `rounding_draws`; a file written
    # before them loads, the loading model's values kept.
    directory, rest = saved
    base = directory / "base.weights.h5"

    def as_version_1(group):
        for name in ("rounding_seed", "rounding_draws"):
            group.__delitem__(name)
        _set(group, "format_version", np.int32(1))

    old = _corrupted(base, tmp_path / "v1.weights.h5", as_version_1)
    expected = _resumed(_compiled(accum_mlp(K, seed=3)), base, rest)
    got = _resumed(_compiled(accum_mlp(K, seed=3)), old, rest)
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_file_without_a_version_loads_as_before(saved, tmp_path):
    # Files written before the version was recorded hold version 1's
    # layout.
    directory, rest = saved
    base = directory / "base.weights.h5"
    old = _corrupted(
        base,
        tmp_path / "old.weights.h5",
        lambda g: g.__delitem__("format_version"),
    )
    expected = _resumed(_compiled(accum_mlp(K, seed=3)), base, rest)
    got = _resumed(_compiled(accum_mlp(K, seed=3)), old, rest)
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("suffix", [".weights.h5", ".keras"])
def test_a_version_from_the_future_is_refused_naming_it(
    saved, tmp_path, suffix
):
    directory, _ = saved
    source = directory / f"base{suffix}"
    path = _corrupted(
        source,
        tmp_path / f"future{suffix}",
        lambda g: _set(g, "format_version", np.int32(FORMAT_VERSION + 1)),
    )
    model = _compiled(accum_mlp(K, seed=3))
    model.load_weights(directory / "base.weights.h5")
    before = _window_values(model)
    where = re.escape(str(path)) if suffix == ".weights.h5" else ""
    with pytest.raises(
        ValueError,
        match=rf"{where}.*`format_version` = 3, a layout newer.*Upgrade",
    ):
        if suffix == ".keras":
            keras.saving.load_model(path)
        else:
            model.load_weights(path)
    for a, b in zip(before, _window_values(model), strict=True):
        np.testing.assert_array_equal(a, b)


# -- LoRA and a changed trainable set -------------------------------------


def _lora_gpt2(accum_steps):
    """A tiny KerasHub causal LM with LoRA on, as an `AccumModel`. Its
    backbone's config does not record `lora_rank`: a `.keras` file of it
    reloads without LoRA (Keras folds the update into the kernels)."""
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=50,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        max_sequence_length=8,
        dropout=0.0,
    )
    task = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    backbone.enable_lora(rank=2)
    model = keras_accum.AccumModel.from_model(task, accum_steps=accum_steps)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _lora_data(n):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 50, size=(n, 8)).astype("int32")
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens, bool)}
    return x, rng.integers(1, 50, size=(n, 8)).astype("int32")


def test_a_lora_file_loads_when_its_window_is_closed_and_not_when_open(
    tmp_path,
):
    # Before: both refused with "holds 4 gradient accumulators but this
    # model has 10 trainable weights ... load it into the same
    # architecture", which the user had done.
    model = _lora_gpt2(accum_steps=2)
    trained = len(model.trainable_weights)
    x, y = _lora_data(6)
    # Micro-batches by `train_on_batch` only: `fit` calls the step with
    # another structure of data, which compiles it once more.
    micro_batches = [
        ({k: v[i : i + 2] for k, v in x.items()}, y[i : i + 2])
        for i in range(0, 6, 2)
    ]
    # A window of 2 closes: 1 update.
    for xb, yb in micro_batches[:2]:
        model.train_on_batch(xb, yb)
    assert model.mini_step == 0 and int(model.optimizer.iterations) == 1
    model.save(tmp_path / "closed.keras")
    predicted = keras.ops.convert_to_numpy(model.predict(x, verbose=0))
    model.train_on_batch(*micro_batches[2])
    assert model.mini_step == 1
    model.save(tmp_path / "open.keras")
    with pytest.warns(UserWarning, match=r"trainable weights changed.*LoRA"):
        loaded = keras.saving.load_model(tmp_path / "closed.keras")
    assert loaded.mini_step == 0
    assert len(loaded.trainable_weights) > trained  # no LoRA: whole kernels
    # Keras folded LoRA into the kernels: the same function.
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(loaded.predict(x, verbose=0)),
        predicted,
        # Float32 rounding of the merged kernel against the LoRA path, on
        # any CPU; a LoRA update lost would differ by about 4e-3 here.
        atol=1e-4,
    )
    # It trains on: a window of 2 applied. (Keras skips the optimizer's
    # saved variables, which no longer match.)
    before = int(loaded.optimizer.iterations)
    for xb, yb in micro_batches[:2]:
        loaded.train_on_batch(xb, yb)
    assert int(loaded.optimizer.iterations) == before + 1
    assert loaded.mini_step == 0
    with pytest.raises(
        ValueError,
        match=r"open \(1 micro-batch not yet.*`acc_grad_.*LoRA.*enable_lora.*"
        r"apply_partial_window",
    ):
        keras.saving.load_model(tmp_path / "open.keras")


def _lora_mlp(seed=0):
    model = accum_mlp(K, seed=seed)
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dense):
            layer.enable_lora(rank=2)
    # LoRA's second factor starts at zero; give both factors values, as
    # training would, so that a reset to zero shows.
    model.set_weights(
        [w + 0.1 if not np.any(w) else w for w in model.get_weights()]
    )
    return _compiled(model)


def test_a_weights_file_whose_lora_factors_load_as_zero_warns(tmp_path):
    # Keras saves a LoRA kernel merged and zeroes the factors on loading:
    # a window restored with them holds gradients of factors that no
    # longer exist. Before: resumed silently, 0.31 from an uninterrupted
    # run (as a plain LoRA model resumed this way).
    batches = _batches()
    model = _lora_mlp()
    for xb, yb in batches[:K]:
        model.train_on_batch(xb, yb)
    model.save_weights(tmp_path / "closed.weights.h5")
    for xb, yb in batches[K : K + 2]:
        model.train_on_batch(xb, yb)
    model.save_weights(tmp_path / "open.weights.h5")
    restored = _lora_mlp(seed=1)
    with warnings.catch_warnings():
        # No warning at all: the check reads the variables without NumPy
        # 2's copy `DeprecationWarning` either.
        warnings.simplefilter("error")
        restored.load_weights(tmp_path / "closed.weights.h5")
    assert restored.mini_step == 0
    with pytest.warns(UserWarning, match=r"LoRA factors of .*are zero.*open"):
        restored.load_weights(tmp_path / "open.weights.h5")
    assert restored.mini_step == 2


def _bfloat16_lora_model(seed):
    """LoRA factors large enough (128 x 128) for bfloat16 accumulators
    under `accumulator_dtype="bfloat16"`, nonzero as after training."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((128,))
    lora = keras.layers.Dense(128, name="lora")
    outputs = keras.layers.Dense(1)(lora(inputs))
    model = keras_accum.AccumModel(
        inputs, outputs, accum_steps=K, accumulator_dtype="bfloat16"
    )
    lora.enable_lora(rank=128)
    model.set_weights(
        [w + 0.01 if not np.any(w) else w for w in model.get_weights()]
    )
    return _compiled(model)


def test_an_open_bfloat16_window_loads_into_lora_layers_checked_first(
    tmp_path,
):
    # Before, on PyTorch: `load_weights` raised "Got unsupported ScalarType
    # BFloat16" (the LoRA check read the bfloat16 accumulators with
    # `.numpy()`) after the window was assigned, and `load_model` of the
    # `.keras` file failed. On every backend, the check ran after the
    # window was assigned: a warning turned into an error left it changed.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6 * B, 128)).astype("float32")
    y = rng.normal(size=(6 * B, 1)).astype("float32")
    model = _bfloat16_lora_model(seed=0)
    for i in range(6):
        model.train_on_batch(x[i * B : (i + 1) * B], y[i * B : (i + 1) * B])
    saved = _window_values(model)
    assert saved[-3] == 2  # mini_step: an open window
    dtypes = [
        keras.backend.standardize_dtype(a.dtype) for a in model.accumulators
    ]
    assert dtypes.count("bfloat16") == 2  # the LoRA factors'
    model.save_weights(tmp_path / "open.weights.h5")
    model.save(tmp_path / "open.keras")

    restored = _bfloat16_lora_model(seed=1)
    restored.train_on_batch(x[:B], y[:B])
    before = _window_values(restored)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # Keras reports the warning, raised, as the window's load failure.
        with pytest.raises(ValueError, match=r"LoRA factors of 'lora'"):
            restored.load_weights(tmp_path / "open.weights.h5")
    # The check ran before the window was assigned: left as it was.
    for a, b in zip(before, _window_values(restored), strict=True):
        np.testing.assert_array_equal(a, b)

    with pytest.warns(UserWarning, match=r"LoRA factors of 'lora'.*open"):
        restored.load_weights(tmp_path / "open.weights.h5")
    for a, b in zip(saved, _window_values(restored), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.warns(UserWarning, match=r"LoRA factors of 'lora'.*open"):
        loaded = keras.saving.load_model(tmp_path / "open.keras")
    for a, b in zip(saved, _window_values(loaded), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_bfloat16_variable_reads_as_bfloat16_on_every_backend():
    # The window's reader (the LoRA check's, the logger's). Before, on
    # PyTorch: "Got unsupported ScalarType BFloat16".
    from keras_accum._window_log import read_array

    values = np.array([1.5, -2.25, 3.0e38], dtype=ml_dtypes.bfloat16)
    read = read_array(keras.Variable(values, dtype="bfloat16"))
    assert read.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(read, values)


def _lora_rank_mlp(model_cls, rank, **kwargs):
    model = mlp(model_cls, **kwargs)
    model.layers[1].enable_lora(rank=rank)
    return _compiled(model)


def test_a_lora_weights_file_loads_into_another_rank_as_in_keras(tmp_path):
    # Before: `load_weights` right after `compile()` built the optimizer to
    # receive the window, warned "nothing is lost", then Keras raised "The
    # shape of the target variable ... variable.shape=(5, 4), Received:
    # value.shape=(5, 2)" for `..._lora_kernel_a_momentum`, naming neither
    # LoRA nor the rank, with the layers' weights already loaded.
    x, y = regression_data(n=8 * B)
    trained = _lora_rank_mlp(keras_accum.AccumModel, 2, accum_steps=K)
    trained.fit(x, y, batch_size=B, verbose=0)
    assert trained.mini_step == 0  # 2 windows, both applied
    trained.save_weights(tmp_path / "rank2.weights.h5")
    predicted = keras.ops.convert_to_numpy(trained.predict(x, verbose=0))
    trained.train_on_batch(x[:B], y[:B])
    trained.save_weights(tmp_path / "open.weights.h5")

    model = _lora_rank_mlp(keras_accum.AccumModel, 4, accum_steps=K)
    plain = _lora_rank_mlp(keras.Model, 4)
    # An open window of other weights: refused before anything loads.
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"is open \(1 micro-batch.*LoRA"):
        model.load_weights(tmp_path / "open.weights.h5")
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not model.optimizer.built
    lora_path = re.escape(repr(model.layers[1].path))
    with pytest.warns(UserWarning) as record:
        model.load_weights(tmp_path / "rank2.weights.h5")
    messages = "\n".join(str(w.message) for w in record)
    assert re.search(
        r"other trainable weights.*window was closed.*optimizer starts "
        rf"afresh.*LoRA layers: {lora_path} \(rank 4\)",
        messages,
    ), messages
    assert "Skipping variable loading for optimizer" in messages  # Keras's
    assert "nothing is lost" not in messages
    # Plain Keras, the same file: the layers load, the optimizer is skipped.
    with pytest.warns(UserWarning, match="Skipping variable loading"):
        plain.load_weights(tmp_path / "rank2.weights.h5")
    assert not model.optimizer.built and not plain.optimizer.built
    for loaded in (model, plain):
        # The rank-2 update folded into the kernel, the new factors zero.
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(loaded.predict(x, verbose=0)),
            predicted,
            atol=1e-6,
        )
    # Both train on from there alike: the window at batch B x K equals
    # the plain model at the large batch.
    large_batch = LargeBatch(plain)
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    large_batch.fit(x, y, batch_size=B * K, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == 2
    assert_equivalent(model, large_batch)
    # Trained, its optimizer built for rank 4: Keras would load the
    # layers, then fail on the optimizer's rank-2 slots (plain Keras
    # does). Before: "nothing is lost", then that failure, half loaded.
    trained_weights = model.get_weights()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "nothing is lost" first
        with pytest.raises(
            ValueError,
            match=r"optimizer state saved in .* is for other trainable "
            rf"weights.*nothing was loaded.*{lora_path} \(rank 4\)",
        ):
            model.load_weights(tmp_path / "rank2.weights.h5")
    for a, b in zip(trained_weights, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
