"""Ways of constructing an `AccumModel` beyond the three documented ones.

Keras builds a `Model` subclass called with `(inputs, outputs)` by
rewriting class bases in place, for the whole process; and
`keras.models.clone_model` rebuilds a functional model through its
constructor. Both must keep accumulation, and the first must leave
`AccumModel` itself alone: a test that constructs such a subclass checks,
in the same process, that the other ways still build, train, save and load.
"""

import math

import keras
import numpy as np
import pytest
from _helpers import regression_data, train_pair

from keras_accum import AccumModel, _settings

B, K = 5, 4
_PACKAGE = "keras_accum_construction_tests"
# What Keras's rewrite used to change; read before any test runs, and
# compared with what `AccumModel` was written to derive from.
_ACCUM_BASES = AccumModel.__bases__
_FUNCTIONAL = keras.src.models.functional.Functional


def _dense_graph(hidden=8):
    inputs = keras.Input((5,))
    x = keras.layers.Dense(hidden, activation="tanh")(inputs)
    return inputs, keras.layers.Dense(3)(x)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class PlainNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))


@keras.saving.register_keras_serializable(package=_PACKAGE)
class AccumNet(AccumModel):
    """Subclassing style: layers in `__init__`, a `call`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x):
        return self.out(self.hidden(x))


@keras.saving.register_keras_serializable(package=_PACKAGE)
class CustomModel(AccumModel):
    """Keras's "customizing what happens in `fit()`" pattern: no
    `__init__`, a `train_step` that defers to the accumulating one."""

    steps_seen = 0

    def train_step(self, *args):
        # `(data)`, or `(state, data)` on JAX. Counted at trace time on
        # graph backends: what matters is that this override, not only
        # `AccumModel`'s, is the step.
        type(self).steps_seen += 1
        return super().train_step(*args)


def _custom_fit_class():
    return CustomModel


@keras.saving.register_keras_serializable(package=_PACKAGE)
class Backbone(AccumModel):
    """KerasHub style: the graph is built in `__init__`, and `get_config`
    and `from_config` are the class's own (not chained to `Functional`)."""

    def __init__(self, hidden=8, accum_steps=K, **kwargs):
        inputs, outputs = _dense_graph(hidden)
        super().__init__(inputs, outputs, accum_steps=accum_steps, **kwargs)
        self.hidden = hidden

    def get_config(self):
        return {
            "name": self.name,
            "trainable": self.trainable,
            "hidden": self.hidden,
            "accum_steps": self.accum_steps,
            "partial_window": self.partial_window,
        }

    @classmethod
    def from_config(cls, config):
        return cls(**config)


def _assert_accum_model_untouched():
    assert AccumModel.__bases__ == _ACCUM_BASES
    assert AccumModel.__bases__[-1] is keras.Model
    assert not issubclass(AccumModel, _FUNCTIONAL)
    functional = type(AccumModel(*_dense_graph(), accum_steps=2))
    assert functional.__bases__ == (AccumModel, _FUNCTIONAL)


def _built(model, x):
    model(x[:1])
    return model


def _fit_count_updates(model, x, y):
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    return int(model.optimizer.iterations)


def _other_models_still_work(tmp_path):
    """Every other way of building an `AccumModel`, and a plain subclassed
    model, builds, trains with accumulation, saves and loads."""
    x, y = regression_data(n=20)
    expected_updates = math.ceil(len(x) / B / K)
    models = {
        "subclassing": _built(AccumNet(accum_steps=K), x),
        "from_sequential": AccumModel.from_model(
            keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)]),
            accum_steps=K,
        ),
        "from_subclassed": AccumModel.from_model(
            _built(PlainNet(), x), accum_steps=K
        ),
        "functional": AccumModel(*_dense_graph(), accum_steps=K),
    }
    for label, model in models.items():
        assert _fit_count_updates(model, x, y) == expected_updates, label
        path = tmp_path / f"{label}.keras"
        model.save(path)
        loaded = keras.saving.load_model(path)
        assert type(loaded) is type(model), label
        assert loaded.accum_steps == K, label
        for u, v in zip(loaded.get_weights(), model.get_weights(), strict=True):
            np.testing.assert_array_equal(u, v)
    plain = _built(PlainNet(), x)
    plain.save(tmp_path / "plain.keras")
    loaded = keras.saving.load_model(tmp_path / "plain.keras")
    assert type(loaded) is PlainNet
    _assert_accum_model_untouched()


def _plain_twin(model):
    """A plain `keras.Model` with `model`'s graph shape and weights."""
    plain = keras.Model(*_dense_graph())
    plain.set_weights(model.get_weights())
    return plain


def _train_against_plain(model):
    x, y = regression_data()
    plain = _plain_twin(model)
    for m in (plain, model):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    diff, _, _ = train_pair(plain, model, x, y, B, K)
    return diff


def test_custom_fit_subclass_accumulates_and_leaves_accum_model_alone(
    tmp_path, report_diff
):
    cls = _custom_fit_class()
    model = cls(*_dense_graph(), accum_steps=K)
    _assert_accum_model_untouched()
    assert isinstance(model, AccumModel)
    assert model.accum_steps == K
    CustomModel.steps_seen = 0
    report_diff(_train_against_plain(model))
    assert CustomModel.steps_seen > 0
    _other_models_still_work(tmp_path)


def test_keras_hub_style_subclass_accumulates_saves_and_loads(
    tmp_path, report_diff
):
    model = Backbone()
    _assert_accum_model_untouched()
    assert model.accum_steps == K
    report_diff(_train_against_plain(model))
    # Then a window left open, to save: 2 micro-batches of 5.
    model.partial_window = "carry"
    x, y = regression_data(n=2 * B)
    model.fit(x, y, batch_size=B, verbose=0)
    assert model.mini_step == 2
    model.save(tmp_path / "backbone.keras")
    loaded = keras.saving.load_model(tmp_path / "backbone.keras")
    assert type(loaded) is Backbone
    assert loaded.accum_steps == K
    assert loaded.partial_window == "carry"
    # The open window travels with the file.
    assert loaded.mini_step == 2
    for u, v in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(u, v)
    _other_models_still_work(tmp_path)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class TaskWithPreprocessor(keras.Model):
    """A KerasHub-task-like model: its own config, and a layer it holds but
    never calls (the task's `preprocessor`, applied to the data before
    the model; unbuilt when the data comes tokenized)."""

    def __init__(self, **kwargs):
        super().__init__(*_dense_graph(), **kwargs)
        self.preprocessor = keras.layers.Normalization()

    def get_config(self):
        return {"name": self.name, "trainable": self.trainable}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


class BackboneWithPreprocessor(Backbone):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.preprocessor = keras.layers.Normalization()


@pytest.mark.parametrize("how", ["from_model", "subclass"])
def test_a_layer_outside_the_graph_may_stay_unbuilt(how, report_diff):
    """Before: the window waited for every layer to be built, so the step
    found none and failed with "The model's trainable weights changed ...
    Call `compile()` again" (which did not help), on TensorFlow and JAX
    (a KerasHub task converted with `from_model` whose preprocessor had
    not run)."""
    keras.utils.set_random_seed(1)
    if how == "from_model":
        task = TaskWithPreprocessor()
        model = AccumModel.from_model(task, accum_steps=K)
    else:
        model = BackboneWithPreprocessor()
        task = model
    assert not task.preprocessor.built
    report_diff(_train_against_plain(model))
    assert int(model.optimizer.iterations) == 8  # 2 epochs of 4 windows.
    assert not task.preprocessor.built


def test_a_subclass_in_both_styles_keeps_them_apart(tmp_path):
    # Functional use of one subclass must not turn a sibling functional.
    _custom_fit_class()(*_dense_graph(), accum_steps=K)
    x, _ = regression_data(n=8)
    model = _built(AccumNet(accum_steps=K), x)
    assert not isinstance(model, _FUNCTIONAL)
    assert not issubclass(AccumNet, _FUNCTIONAL)
    _assert_accum_model_untouched()


def _schedule(updates):
    return keras.ops.where(updates < 1, 2, K)


_CLONE_CASES = {
    "functional_int": lambda x: AccumModel(
        *_dense_graph(), accum_steps=K, partial_window="carry"
    ),
    "functional_epochs": lambda x: AccumModel(
        *_dense_graph(), accum_steps={0: K, 5: 2}
    ),
    "functional_callable": lambda x: AccumModel(
        *_dense_graph(), accum_steps=_schedule, partial_window="carry"
    ),
    "from_sequential": lambda x: AccumModel.from_model(
        keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)]),
        accum_steps={0: K, 5: 2},
        partial_window="carry",
    ),
    "from_subclassed": lambda x: AccumModel.from_model(
        _built(PlainNet(), x), accum_steps=K, partial_window="carry"
    ),
    "custom_fit_subclass": lambda x: _custom_fit_class()(
        *_dense_graph(), accum_steps=K, partial_window="carry"
    ),
    "subclassing": lambda x: _built(
        AccumNet(accum_steps=K, partial_window="carry"), x
    ),
}


@pytest.mark.parametrize("kind", sorted(_CLONE_CASES))
def test_clone_model_keeps_accumulation(kind):
    x, y = regression_data(n=70)
    model = _CLONE_CASES[kind](x)
    # With "carry" the source holds an open window; the clone starts with
    # none, as it starts with fresh weights.
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x[: B * 3], y[: B * 3], batch_size=B, verbose=0)
    assert (model.mini_step > 0) == (model.partial_window == "carry")
    clone = keras.models.clone_model(model)
    assert type(clone) is type(model)
    assert isinstance(clone, AccumModel)
    if callable(model.accum_steps):
        assert clone.accum_steps is model.accum_steps
    else:
        assert clone.accum_steps == model.accum_steps
    assert clone.partial_window == model.partial_window
    assert clone.mini_step == 0
    # 14 micro-batches: 3 updates with 2 micro-batches left open by
    # "carry", 4 with "apply"; the schedule's first window is 2 long.
    expected = {"apply": 4, "carry": 3}[model.partial_window]
    if kind == "functional_callable":
        expected = 4
    assert _fit_count_updates(clone, x, y) == expected
    _assert_accum_model_untouched()


def test_cloned_functional_model_trains_like_the_large_batch(report_diff):
    model = AccumModel(*_dense_graph(), accum_steps=K)
    clone = keras.models.clone_model(model)
    report_diff(_train_against_plain(clone))


def test_clone_model_of_a_keras_hub_style_subclass_says_how():
    # Its constructor does not take `(inputs, outputs)`: Keras would
    # return a plain `Functional`, which would train without accumulating.
    model = Backbone(accum_steps=3)
    with pytest.raises(TypeError, match=r"Backbone\.from_config"):
        keras.models.clone_model(model)
    clone = Backbone.from_config(model.get_config())
    assert type(clone) is Backbone
    assert clone.accum_steps == 3


# -- Keyword arguments --------------------------------------------------------


def _functional_config(**changes):
    config = AccumModel(*_dense_graph(), accum_steps=K).get_config()
    config.update(changes)
    return config


def _misspelt(config, right, wrong):
    config = dict(config)
    config[wrong] = config.pop(right)
    return config


_MISSPELT = {
    "functional": lambda **kw: AccumModel(*_dense_graph(), **kw),
    "custom_fit_subclass": lambda **kw: CustomModel(*_dense_graph(), **kw),
    "subclassing": lambda **kw: AccumNet(**kw),
    "keras_hub_style": lambda **kw: Backbone(**kw),
    "from_sequential": lambda **kw: AccumModel.from_model(
        keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)]), **kw
    ),
    "from_subclassed": lambda **kw: AccumModel.from_model(
        _built(PlainNet(), np.zeros((1, 5), "float32")), **kw
    ),
    "from_config": lambda **kw: AccumModel.from_config(
        _functional_config(**kw)
    ),
    "subclass_from_config": lambda **kw: AccumNet.from_config(
        {**AccumNet(accum_steps=K).get_config(), **kw}
    ),
    "wrapped_from_config": lambda **kw: _wrapped_class().from_config(
        {**_wrapped().get_config(), **kw},
        custom_objects={"PlainNet": PlainNet},
    ),
}


def _wrapped():
    return AccumModel.from_model(
        _built(PlainNet(), np.zeros((1, 5), "float32")), accum_steps=K
    )


def _wrapped_class():
    return type(_wrapped())


@pytest.mark.parametrize("way", sorted(_MISSPELT))
@pytest.mark.parametrize(
    "wrong, right",
    [("accum_step", "accum_steps"), ("micro_batchsize", "micro_batch_size")],
)
def test_a_misspelt_setting_is_refused_naming_the_nearest(way, wrong, right):
    """Before: a functional `AccumModel` (and `from_config`) ignored it and
    trained at `accum_steps=1`; a subclass got Keras's error without the
    hint, `from_model` Python's `TypeError`."""
    owner = {
        "subclassing": "AccumNet",
        "subclass_from_config": "AccumNet",
        "keras_hub_style": "Backbone",
        "custom_fit_subclass": "CustomModel",
        "from_sequential": "AccumModel.from_model",
        "from_subclassed": "AccumModel.from_model",
    }.get(way, "AccumModel")
    match = (
        rf"Unrecognized keyword argument\(s\) for `{owner}`: {wrong}=8\. "
        rf"Did you mean `{right}`\?"
    )
    with pytest.raises(ValueError, match=match):
        _MISSPELT[way](**{wrong: 8})


def test_several_unknown_keywords_are_all_named():
    with pytest.raises(ValueError) as error:
        AccumModel(*_dense_graph(), accum_step=8, colour="red", nme="x")
    message = str(error.value)
    assert "accum_step=8, colour='red', nme='x'." in message
    assert "Did you mean `accum_steps` for `accum_step`?" in message
    assert "Did you mean `name` for `nme`?" in message
    assert "colour`?" not in message


def test_keras_keywords_still_pass_at_every_way_in(tmp_path):
    functional = AccumModel(
        *_dense_graph(), accum_steps=K, name="f", trainable=False
    )
    assert (functional.name, functional.trainable) == ("f", False)
    subclassed = AccumNet(accum_steps=K, name="s", dtype="float32")
    assert subclassed.name == "s"
    hub = Backbone(hidden=4, name="b", accum_steps=2)
    assert (hub.name, hub.accum_steps) == ("b", 2)
    # Configs and files made by this version and by earlier ones (the same
    # keys: the settings were only ever added) revive.
    for model in (functional, subclassed, hub, _wrapped()):
        config = model.get_config()
        revived = type(model).from_config(
            config, **({} if model is hub else {"custom_objects": {}})
        )
        assert revived.accum_steps == model.accum_steps
    old_style = _functional_config()
    del old_style["accumulator_dtype"], old_style["micro_batch_size"]
    assert AccumModel.from_config(old_style).accum_steps == K
    functional.save(tmp_path / "f.keras")
    assert keras.saving.load_model(tmp_path / "f.keras").accum_steps == K


# -- accumulator_dtype --------------------------------------------------------

# A kernel of 2**14 elements: the smallest that gets a bfloat16 accumulator.
_WIDE = 128


def _wide_model(model_cls=AccumModel, **kwargs):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((_WIDE,))
    x = keras.layers.Dense(_WIDE, activation="tanh")(inputs)
    return model_cls(inputs, keras.layers.Dense(3)(x), **kwargs)


def _wide_data(n=24):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, _WIDE)).astype("float32")
    return x, rng.normal(size=(n, 3)).astype("float32")


def _accumulator_dtypes(model):
    return [
        keras.backend.standardize_dtype(a.dtype) for a in model.accumulators
    ]


def _backend_dtypes():
    """The backend's own float32 and bfloat16 dtype objects."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.float32, tf.bfloat16, tf.float16
    if backend == "jax":
        import jax.numpy as jnp

        return jnp.float32, jnp.bfloat16, jnp.float16
    import torch

    return torch.float32, torch.bfloat16, torch.float16


def test_accumulator_dtype_takes_what_keras_reads_as_a_dtype():
    """Before: only the strings were taken; `np.float32`, `ml_dtypes`'
    and the backends' bfloat16 were refused with a `TypeError`."""
    import ml_dtypes

    float32, bfloat16, float16 = _backend_dtypes()
    for value, kept in [
        (np.float32, None),
        (np.dtype("float32"), None),
        (float32, None),
        (ml_dtypes.bfloat16, "bfloat16"),
        (bfloat16, "bfloat16"),
    ]:
        assert _wide_model(accumulator_dtype=value).accumulator_dtype == kept
        converted = AccumModel.from_model(
            keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)]),
            accumulator_dtype=value,
        )
        assert converted.accumulator_dtype == kept
        model = _wide_model()
        model.accumulator_dtype = value
        assert model.accumulator_dtype == kept
        assert model.get_config()["accumulator_dtype"] == kept
    for value in (np.float16, float16, "half"):
        with pytest.raises(ValueError, match="float16 accumulators are not"):
            _wide_model(accumulator_dtype=value)
    for value in (True, 16, 16.0, object()):
        with pytest.raises(TypeError, match=r"accumulator_dtype=.*\(of type"):
            _wide_model(accumulator_dtype=value)


@pytest.mark.parametrize("after", ["evaluate", "load_weights", "fit"])
def test_accumulator_dtype_changes_between_windows(after, tmp_path):
    """Before: refused, "after the first `fit` since `compile()`", once
    `evaluate` or `load_weights` had made the accumulators, though no `fit`
    ran; the docstring said a change applied from the next `compile()`."""
    x, y = _wide_data()
    model = _wide_model(accum_steps=2)
    model.compile(optimizer="sgd", loss="mse")
    if after == "evaluate":
        model.evaluate(x, y, verbose=0)
    elif after == "load_weights":
        source = _wide_model(accum_steps=2)
        source.compile(optimizer="sgd", loss="mse")
        source.fit(x, y, batch_size=4, epochs=2, verbose=0)
        source.save_weights(tmp_path / "w.weights.h5")
        model.load_weights(tmp_path / "w.weights.h5")
    else:
        model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert _accumulator_dtypes(model) == ["float32"] * 4
    epoch = int(keras.ops.convert_to_numpy(model._window.counters.epoch))
    updates = int(model.optimizer.iterations)
    model.accumulator_dtype = "bfloat16"
    # New accumulators, the window's position kept.
    assert _accumulator_dtypes(model) == ["bfloat16"] + ["float32"] * 3
    assert (
        int(keras.ops.convert_to_numpy(model._window.counters.epoch)) == epoch
    )
    model.fit(
        x, y, batch_size=4, epochs=epoch + 1, initial_epoch=epoch, verbose=0
    )
    assert int(model.optimizer.iterations) == updates + 3
    assert _accumulator_dtypes(model)[0] == "bfloat16"


def test_accumulator_dtype_refuses_to_change_with_a_window_open():
    x, y = _wide_data(n=12)
    model = _wide_model(accum_steps=4, partial_window="carry")
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=4, verbose=0)
    assert model.mini_step == 3
    with pytest.raises(
        ValueError,
        match=r"while a window is open \(3 micro-batch.*"
        r"`apply_partial_window\(\)`.*accumulator_dtype='bfloat16'",
    ):
        model.accumulator_dtype = "bfloat16"
    assert model.accumulator_dtype is None
    assert model.mini_step == 3
    # Setting what it is already changes nothing.
    model.accumulator_dtype = "float32"
    assert model.apply_partial_window()
    model.accumulator_dtype = "bfloat16"
    assert _accumulator_dtypes(model)[0] == "bfloat16"


def test_a_model_switched_back_to_float32_trains_like_the_large_batch(
    report_diff,
):
    """Its accumulators made anew in float32 (after `evaluate` made them
    in bfloat16): exact again (6e-8 from the plain model on TensorFlow
    and PyTorch), where bfloat16 ones end 2e-4 from it after one update
    (the 128 x 128 kernel's)."""
    model = _wide_model(accum_steps=K, accumulator_dtype="bfloat16")
    plain = _wide_model(keras.Model)
    x, y = _wide_data(n=40)
    for m in (plain, model):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.evaluate(x, y, verbose=0)
    model.accumulator_dtype = np.float32
    diff, _, _ = train_pair(plain, model, x, y, 2, K)
    report_diff(diff)


# -- Settings, each through every path ----------------------------------------

# For each public setting of `_settings.SETTINGS`, values other than its
# default, with what they need beside them (the rules across settings).
_SETTING_EXAMPLES = {
    "accum_steps": [
        {"accum_steps": 3},
        {"accum_steps": {0: 2, 3: 4}},
        {"accum_steps": "auto"},
    ],
    "partial_window": [{"partial_window": "carry"}],
    "micro_batch_size": [{"micro_batch_size": 4}, {"micro_batch_size": "auto"}],
    "accumulator_dtype": [{"accumulator_dtype": "bfloat16"}],
    "whole_batch_loss": [{"micro_batch_size": 4, "whole_batch_loss": True}],
}


def test_the_signatures_and_examples_follow_the_settings_table():
    """A setting added to the table without its keyword argument, its
    property, its docs or an example for the test below fails here."""
    import inspect

    public = [(s.name, s.default) for s in _settings.PUBLIC]
    assert set(_SETTING_EXAMPLES) == set(_settings.PUBLIC_NAMES)
    for method, skipped in [
        (AccumModel.__init__, 0),
        (AccumModel.from_model, 1),
    ]:
        parameters = [
            p
            for p in inspect.signature(method).parameters.values()
            if p.name not in ("self", "cls", "args", "kwargs")
        ][skipped:]
        assert [(p.name, p.default) for p in parameters] == public, method
    for name in _settings.PUBLIC_NAMES:
        assert isinstance(getattr(AccumModel, name), property), name
        assert getattr(AccumModel, name).fset is not None, name
        assert f"\n        {name}: " in AccumModel.__doc__, name
        assert f"\n            {name}: " in AccumModel.from_model.__doc__, name
    # Internal settings are the package's: no keyword, no config entry.
    config = AccumModel(*_dense_graph()).get_config()
    for setting in _settings.SETTINGS:
        assert (setting.name in config) == setting.public, setting.name
        assert (setting.name in _settings.PUBLIC_NAMES) == setting.public


def _examples():
    return [
        pytest.param(
            example, id="-".join(f"{k}={v}" for k, v in example.items())
        )
        for examples in _SETTING_EXAMPLES.values()
        for example in examples
    ]


@pytest.mark.parametrize("example", _examples())
def test_a_setting_comes_back_through_every_path(example, tmp_path):
    """Before: each setting was threaded by hand through each of these; a
    wrapped model's config dropped `micro_batch_size`."""
    expected = {
        **{s.name: s.default for s in _settings.PUBLIC},
        **_settings.checked(example),
    }
    x = np.zeros((2, 5), "float32")

    def check(model, how):
        assert isinstance(model, AccumModel), how
        for name, value in expected.items():
            assert getattr(model, name) == value, (how, name)
        config = model.get_config()
        for setting in _settings.PUBLIC:
            assert config[setting.name] == setting.to_config(
                expected[setting.name]
            ), (how, setting.name)

    ways = {
        "functional": AccumModel(*_dense_graph(), **example),
        "custom_fit_subclass": CustomModel(*_dense_graph(), **example),
        "subclassing": _built(AccumNet(**example), x),
        "from_sequential": AccumModel.from_model(
            keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)]),
            **example,
        ),
        "from_subclassed": AccumModel.from_model(
            _built(PlainNet(), x), **example
        ),
    }
    for how, model in ways.items():
        check(model, how)
        check(type(model).from_config(model.get_config()), f"{how} config")
        check(keras.models.clone_model(model), f"{how} clone_model")
        model.save(tmp_path / f"{how}.keras")
        loaded = keras.saving.load_model(tmp_path / f"{how}.keras")
        assert type(loaded) is type(model), how
        check(loaded, f"{how} .keras")
    # The setters, on a model built with the defaults.
    model = AccumModel(*_dense_graph())
    for name, value in example.items():
        setattr(model, name, value)
    check(model, "setter")


_REFUSED_WHILE_OPEN = [s.name for s in _settings.PUBLIC if s.while_open]


@pytest.mark.parametrize("name", _settings.PUBLIC_NAMES)
def test_a_setting_changes_with_a_window_open_only_where_the_table_says(name):
    example = _SETTING_EXAMPLES[name][0]
    x, y = regression_data(n=2 * B)
    model = AccumModel(*_dense_graph(), accum_steps=K, partial_window="carry")
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=B, verbose=0)
    assert model.mini_step == 2
    # What the example needs beside the setting, set as the package sets
    # it: a window open may refuse those too. `accum_steps` may change.
    model.accum_steps = 1
    model._configure(
        _settings.checked({n: v for n, v in example.items() if n != name})
    )
    value = example[name]
    if value == getattr(model, name):
        value = _settings.BY_NAME[name].default
    before = getattr(model, name)
    if name in _REFUSED_WHILE_OPEN:
        with pytest.raises(
            ValueError,
            match=rf"`{name}` cannot change while a window is open "
            rf"\(2 micro-batch\(es\) .*`apply_partial_window\(\)` first\. "
            rf"Received: {name}=",
        ):
            setattr(model, name, value)
        assert getattr(model, name) == before
        assert model.mini_step == 2
        assert model.apply_partial_window()
    setattr(model, name, value)
    assert getattr(model, name) == _settings.BY_NAME[name].check(value)
    assert model.mini_step == (0 if name in _REFUSED_WHILE_OPEN else 2)


@pytest.mark.parametrize(
    "way",
    ["constructor", "from_model", "setter", "setter_other", "from_config"],
)
def test_a_rule_across_settings_holds_at_every_way_in(way):
    """`micro_batch_size` beside an `accum_steps` other than 1: refused
    whichever way the pair comes in, the message naming both."""
    pair = {"accum_steps": 2, "micro_batch_size": 4}
    match = r"`micro_batch_size` and `accum_steps` cannot both be set"
    with pytest.raises(ValueError, match=match):
        if way == "constructor":
            AccumModel(*_dense_graph(), **pair)
        elif way == "from_model":
            AccumModel.from_model(
                keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)]),
                **pair,
            )
        elif way == "setter":
            AccumModel(*_dense_graph(), accum_steps=2).micro_batch_size = 4
        elif way == "setter_other":
            AccumModel(*_dense_graph(), micro_batch_size=4).accum_steps = 2
        else:
            AccumModel.from_config(_functional_config(**pair))


@pytest.mark.parametrize(
    "way", ["constructor", "from_model", "setter", "setter_other", "config"]
)
def test_whole_batch_loss_needs_micro_batch_size_at_every_way_in(way):
    match = r"`whole_batch_loss` needs `micro_batch_size`.*micro_batch_size="
    with pytest.raises(ValueError, match=match):
        if way == "constructor":
            AccumModel(*_dense_graph(), whole_batch_loss=True)
        elif way == "from_model":
            AccumModel.from_model(
                keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)]),
                whole_batch_loss=True,
            )
        elif way == "setter":
            AccumModel(*_dense_graph()).whole_batch_loss = True
        elif way == "setter_other":
            AccumModel(
                *_dense_graph(), micro_batch_size=4, whole_batch_loss=True
            ).micro_batch_size = None
        else:
            AccumModel.from_config(_functional_config(whole_batch_loss=True))


def test_changed_trainable_weights_without_a_recompile_are_refused():
    """Unfreezing a layer after `fit` without `compile()` would train
    weights the accumulators were not made for: refused, naming them,
    where the step reads the trainable weights anew (JAX, PyTorch)."""
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, name="hidden")
    hidden.trainable = False
    outputs = keras.layers.Dense(1)(hidden(inputs))
    model = AccumModel(inputs, outputs, accum_steps=2)
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((4, 3), "float32"), np.ones((4, 1), "float32")
    model.fit(x, y, batch_size=2, verbose=0)
    hidden.trainable = True
    if keras.backend.backend() == "tensorflow":
        # Keras's TensorFlow step keeps the weights it was traced with
        # until `compile()`, as a plain model's does: nothing to refuse,
        # and the unfrozen layer stays as it was.
        kernel = keras.ops.convert_to_numpy(hidden.kernel)
        model.fit(x, y, batch_size=2, verbose=0)
        np.testing.assert_array_equal(hidden.kernel.numpy(), kernel)
        return
    with pytest.raises(
        ValueError,
        match=r"trainable weights changed since the accumulators were "
        r"created \(2 added: \['hidden/kernel', 'hidden/bias'\]; 0 removed\)"
        r"\. Call `compile\(\)` again",
    ):
        model.fit(x, y, batch_size=2, verbose=0)
