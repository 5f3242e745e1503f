"""Shims for the older Keras releases in the tested range, and its check.

keras-accum relies on private Keras members (`keras.src.*`, trainer
internals), which Keras may change in any release: the range below is the
one the test suite ran on (the newest in CI, the oldest in `.ci/compat`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import sys
import warnings

import keras

# Keep in step with `keras` in pyproject.toml's dependencies.
OLDEST_TESTED = (3, 10)
NEWEST_TESTED = (3, 15)
TESTED_RANGE = "keras>=3.10,<3.16"


def _major_minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def warn_if_untested(version: str = keras.__version__) -> None:
    """Warns when `version` is outside the Keras releases tested."""
    found = _major_minor(version)
    if found is not None and OLDEST_TESTED <= found <= NEWEST_TESTED:
        return
    # A warning, not an error: an untested Keras may well work, and a user
    # pinned to one should not be locked out, but told before a failure
    # deep inside `fit` that it is the likely cause.
    warnings.warn(
        f"keras-accum was tested with {TESTED_RANGE}; this is Keras "
        f"{version}. It relies on Keras internals that change between "
        "releases: if something fails, install a tested Keras, e.g. "
        f'`pip install "{TESTED_RANGE}"`.',
        UserWarning,
        stacklevel=2,
    )


# At import, and before the other modules: on an untested Keras, one of
# their private imports may be what fails, and the warning says why.
warn_if_untested()


# -- Private Keras modules, each for what the public API does not offer -------
# Every `keras.src` import of the package is here, so that a Keras release
# that moves one breaks this file alone, with the reason beside it. All are
# present from Keras 3.10 to 3.15.

# How a micro-batch's loss was reduced: the mask a loss applies
# (`_normalizer.normalizer` counts the entries it averaged over).
from keras.src.backend.common.masking import get_keras_mask  # noqa: E402

# A loss under `tf.distribute` is pre-divided by the replica count
# (`unscale_loss_for_distribution` undoes it); `apply_mask` weights a
# batch's sample weights by its mask as `"mean_with_sample_weight"` does.
from keras.src.losses.loss import (  # noqa: E402
    apply_mask,
    scale_loss_for_distribution,
    unscale_loss_for_distribution,
)

# `clone_model`'s helper that rebuilds a functional model: its code object
# identifies the caller (`model_being_cloned`), and None if a release
# renames it (tests/test_compat.py then fails rather than settings drop).
from keras.src.models import cloning as _cloning  # noqa: E402

# The functional model class and Keras's own test of whether a subclass's
# constructor takes `(inputs, outputs)`: `AccumModel(inputs, outputs)` is
# built as Keras builds a functional model, without Keras rewriting
# `AccumModel`'s bases.
from keras.src.models.functional import (  # noqa: E402
    Functional,
    functional_like_constructor,
)

# Keras's test of "called like `Model(inputs, outputs)`", which decides
# when `keras.Model.__new__` makes a model functional.
from keras.src.models.model import functional_init_arguments  # noqa: E402

# What Keras's saver walks: a window state saves its own variables.
from keras.src.saving.keras_saveable import KerasSaveable  # noqa: E402

# `Trainer.__init__`, which `keras.Model.__init__` runs before `Functional`'s
# own; a functional `AccumModel` runs the two itself.
from keras.src.trainers.trainer import Trainer  # noqa: E402

# A line to the user as Keras prints its own (stdout, or absl's log when
# interactive logging is off): `micro_batch_size="auto"`'s choice.
from keras.src.utils.io_utils import print_msg  # noqa: E402

# Unique layer names ("accum_model", "accum_model_1", ...), as Keras names.
from keras.src.utils.naming import auto_name  # noqa: E402

__all__ = [
    "Functional",
    "KerasSaveable",
    "Trainer",
    "apply_mask",
    "auto_name",
    "called_by_clone_model",
    "functional_init_arguments",
    "functional_like_constructor",
    "get_keras_mask",
    "is_nnx_enabled",
    "make_functional",
    "model_keywords",
    "model_being_cloned",
    "optimizer_strategy",
    "print_msg",
    "scale_loss_for_distribution",
    "unscale_loss_for_distribution",
    "warn_if_untested",
]

CLONE_FUNCTIONAL_CODE = getattr(
    getattr(_cloning, "_clone_functional_model", None), "__code__", None
)


# -- Where Keras leaves no hook ----------------------------------------------


def _clone_frame(depth: int):
    """The frame of `_clone_functional_model` within `depth` callers of
    the caller of the function that calls this, or None."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code is CLONE_FUNCTIONAL_CODE:
            return frame
        frame = frame.f_back
    return None


def model_being_cloned():
    """The model `keras.models.clone_model` is cloning, when a model's
    `__init__` (or one it calls, up to two deep) runs for it; else None.

    `_clone_functional_model` rebuilds a functional model as
    `model.__class__(inputs, outputs, name=...)`: nothing in that call says
    what the source model was, so an `AccumModel`'s settings would be lost.
    """
    frame = _clone_frame(depth=3)
    return None if frame is None else frame.f_locals.get("model")


def called_by_clone_model() -> bool:
    """Whether the caller of the function that calls this is
    `_clone_functional_model` (it runs the source model's graph)."""
    return _clone_frame(depth=2) is not None


@functools.cache
def model_keywords() -> tuple[str, ...]:
    """The keyword arguments `keras.Model.__init__` takes, in order.

    Those of `keras.layers.Layer.__init__` (a subclassed model's, which
    refuses others) and of `Functional.__init__` (a functional model's,
    which ignores others), read from their signatures, and the two that
    `Layer.__init__` takes from its `**kwargs` (`input_dim`,
    `input_shape`).
    """
    names = {}
    for init in (keras.layers.Layer.__init__, Functional.__init__):
        for parameter in inspect.signature(init).parameters.values():
            if parameter.name != "self" and parameter.kind in (
                parameter.POSITIONAL_OR_KEYWORD,
                parameter.KEYWORD_ONLY,
            ):
                names[parameter.name] = None
    names.update(dict.fromkeys(("input_dim", "input_shape")))
    return tuple(names)


def make_functional(cls, accum_cls, functional_cls):
    """Makes `cls`, a subclass of `accum_cls`, functional, as Keras would.

    Keras's `inject_functional_model_class` rewrites `__bases__` up to
    `keras.Model`, which would rewrite `accum_cls` itself, for the whole
    process. This stops one step earlier: `accum_cls` in `cls`'s chain of
    bases becomes `functional_cls`, and neither of those two changes.
    (Keras leaves no other way: a functional model must be an instance of
    `Functional`.)
    """
    if cls is accum_cls:
        return functional_cls
    if not issubclass(cls, accum_cls) or issubclass(cls, Functional):
        # Mixins and chains already functional stay as they are.
        return cls
    cls.__bases__ = tuple(
        make_functional(base, accum_cls, functional_cls)
        for base in cls.__bases__
    )
    return cls


def optimizer_strategy(optimizer):
    """The `tf.distribute` strategy a TensorFlow Keras optimizer was made
    under (Keras 3.10-3.15 keep it as `_distribution_strategy`), or None."""
    return getattr(optimizer, "_distribution_strategy", None)


@contextlib.contextmanager
def learning_rate_scaled(optimizer, rate):
    """Within, `optimizer` updates at `rate.scale` times its learning rate.

    Keras reads an optimizer's learning rate through one method,
    `_get_current_learning_rate` (the `learning_rate` property, weight
    decay, every backend's update), so the step overrides it on the
    instance while it traces or runs the update; a `LearningRateSchedule`
    is evaluated at `rate.progress` where given. A `LossScaleOptimizer`'s
    inner optimizer is the one that updates. Nothing changes for
    `rate=None`.
    """
    if rate is None or optimizer is None:
        yield
        return
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    original = inner._get_current_learning_rate

    def scaled():
        learning_rate = inner._learning_rate
        schedule = keras.optimizers.schedules.LearningRateSchedule
        if rate.progress is not None and isinstance(learning_rate, schedule):
            base = learning_rate(rate.progress)
        else:
            base = original()
        return keras.ops.cast(base, "float32") * keras.ops.cast(
            rate.scale, "float32"
        )

    inner.__dict__["_get_current_learning_rate"] = scaled
    try:
        yield
    finally:
        inner.__dict__.pop("_get_current_learning_rate", None)


try:
    from keras.src.backend.config import is_nnx_enabled
except ImportError:  # Keras before 3.11 has no Flax NNX mode.

    def is_nnx_enabled() -> bool:
        return False


# -- Access to private members ------------------------------------------------
# Every read or write of a private Keras member goes through one of these
# (`PRIVATE_MEMBERS` below says why each is needed); overriding a Keras
# hook (`_symbolic_build`, ...) is the only other use, and a test holds it.


def sublayers(layer, include_self=True, recursive=True) -> list:
    """`layer` and every layer it holds (`Layer._flatten_layers`)."""
    return list(
        layer._flatten_layers(include_self=include_self, recursive=recursive)
    )


def symbolic_build(model, data_batch) -> None:
    """Builds `model`, its metrics and optimizer from a batch's spec, as
    `fit` does before its first step (`Trainer._symbolic_build`)."""
    model._symbolic_build(data_batch=data_batch)


def created_trainable_ids(model) -> set:
    """The ids of every weight created trainable, frozen ones included
    (`Layer._trainable_variables` keeps them when `trainable` is off)."""
    return {
        id(v)
        for layer in sublayers(model)
        for v in getattr(layer, "_trainable_variables", ())
    }


def torch_device() -> str:
    """The device Keras's PyTorch backend puts tensors on ("cuda", "cpu",
    ...)."""
    from keras.src.backend.torch.core import get_device

    return get_device()


def seed_generators(layer) -> list:
    """The random number generators a layer draws from."""
    return list(layer._seed_generators)


def variable_layout(variable):
    """A variable's layout under a `keras.distribution`, or None."""
    return getattr(variable, "_layout", None)


def backing_value(variable):
    """A variable's backing value, without `Variable.value`'s autocast
    lookup (PyTorch: about 3 µs a read)."""
    return variable._value


def release_value(variable) -> None:
    """Drops a variable's backing value: JAX's step donates the buffer,
    and `jax_state_sync` reattaches the new one, as Keras does."""
    variable._value = None


def jax_state(model):
    """`(state, synced)`: the JAX trainer's state between steps (None
    outside `fit`) and whether it is attached to the variables."""
    return getattr(model, "_jax_state", None), model._jax_state_synced


def call_takes_training(model) -> bool:
    """Whether `model.call` takes a `training` argument."""
    return model._call_has_training_arg


def compute_loss(model, x, y, y_pred, sample_weight, training=True):
    """The loss of a batch as Keras's own step computes and reports it."""
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def track_loss(model, loss, sample_weight) -> None:
    """Adds a step's loss to the running mean `fit` logs as `loss`."""
    model._loss_tracker.update_state(loss, sample_weight=sample_weight)


def update_metrics_variables(model, *args):
    """The JAX step's metric updates: `(logs, metrics variables)`."""
    return model._update_metrics_variables(*args)


def override_losses(layer, losses) -> None:
    """Makes `layer.losses` the forward pass's `losses` (JAX's stateless
    step), or restores Keras's own where `losses` is None."""
    layer._losses_override.clear()
    if losses is not None:
        layer._losses_override = losses


def aggregate_additional_loss(model, value):
    """A regularization loss's value as Keras adds it to the loss."""
    return model._aggregate_additional_loss(value)


def compiled_parts(model):
    """`(compiled loss, compiled metrics)`, each None before `compile`."""
    return (
        getattr(model, "_compile_loss", None),
        getattr(model, "_compile_metrics", None),
    )


def metric_function_values(model, y_true, y_pred) -> list:
    """`(metric, values)` for each compiled metric that wraps a function
    (`MeanMetricWrapper`), `values` its function on the predictions of
    its output (`CompileMetrics._flat_metrics` and
    `_flat_weighted_metrics` pair them, after `_flatten_y`); [] before
    the compiled metrics are built."""
    metrics = compiled_parts(model)[1]
    if metrics is None or not metrics.built:
        return []
    y_true = metrics._flatten_y(y_true)
    y_pred = metrics._flatten_y(y_pred)
    found = []
    for group in (metrics._flat_metrics, metrics._flat_weighted_metrics):
        for listed, y_t, y_p in zip(group, y_true, y_pred, strict=False):
            for metric in listed.metrics if listed else []:
                if isinstance(metric, keras.metrics.MeanMetricWrapper):
                    values = metric._fn(y_t, y_p, **metric._fn_kwargs)
                    found.append((metric, values))
    return found


def flat_losses(model):
    """Each compiled loss (for its `reduction`), or None."""
    return getattr(compiled_parts(model)[0], "_flat_losses", None)


def in_multi_worker_mode(strategy) -> bool:
    """Whether a `tf.distribute` strategy spans several workers."""
    return bool(strategy.extended._in_multi_worker_mode())


def reduce_per_replica(outputs, strategy):
    """A `tf.distribute` step's logs reduced over the replicas as Keras's
    train function reduces them (`"auto"`)."""
    from keras.src.backend.tensorflow.trainer import reduce_per_replica

    return reduce_per_replica(outputs, strategy, reduction="auto")


def strategy_supports_no_merge_call() -> bool:
    """Whether the current `tf.distribute` strategy applies an optimizer
    without `merge_call` (TensorFlow's `tf.__internal__`)."""
    import tensorflow as tf

    return tf.__internal__.distribute.strategy_supports_no_merge_call()


def clip_gradients(optimizer, grads):
    """`optimizer`'s clipping (`clipnorm`, `clipvalue`, ...) of `grads`."""
    return optimizer._clip_gradients(grads)


def source_dataset(iterator):
    """The `tf.data.Dataset` a Keras epoch iterator distributes, or None:
    `TFEpochIterator._distributed_dataset`, unwrapped from TensorFlow's
    `DistributedDataset._original_dataset`."""
    dataset = getattr(iterator, "_distributed_dataset", None)
    return getattr(dataset, "_original_dataset", dataset)


def initial_epoch(model) -> int:
    """Where `fit` starts (set by `BackupAndRestore`)."""
    return model._initial_epoch or 0


def set_initial_epoch(model, epoch: int) -> None:
    model._initial_epoch = epoch


def backup_files(backup) -> tuple:
    """A `BackupAndRestore`'s weights and metadata files, for messages."""
    return (
        getattr(backup, "_weights_path", backup.backup_dir),
        getattr(backup, "_training_metadata_path", "its metadata"),
    )


def input_layer(tensor):
    """The layer that made a symbolic tensor."""
    return tensor._keras_history.operation


def batch_moments(layer, inputs, mask):
    """A `BatchNormalization`'s mean and variance of a batch."""
    return layer._moments(inputs, mask)


def reduction_axes(layer) -> list:
    """The axes a `BatchNormalization` normalizes over."""
    return list(layer._reduction_axes)


# -- Private members of public objects ----------------------------------------
# Read, set or overridden where Keras (or TensorFlow) has no public hook;
# the same from Keras 3.10 to 3.15. tests/test_compat.py checks that the
# package uses exactly these (and the `keras.src` imports above).
PRIVATE_MEMBERS = {
    # The train step as Keras's own, and the loss's reduction.
    "_call_has_training_arg": "Model: whether `call` takes `training`",
    "_compute_loss": "Trainer: the loss of a batch, as Keras reports it",
    "_loss_tracker": "Trainer: the running mean `logs['loss']`",
    "_aggregate_additional_loss": "Trainer: a regularization loss's value",
    "_compile_loss": "Trainer: the compiled loss (its `_flat_losses`)",
    "_flat_losses": "CompileLoss: each loss, for its `reduction`",
    "_compile_metrics": "Trainer: whether the compiled metrics are built",
    "_update_metrics_variables": "JAXTrainer: the step's metric updates",
    "_flat_metrics": "CompileMetrics: each output's metrics",
    "_flat_weighted_metrics": "CompileMetrics: each output's weighted ones",
    "_flatten_y": "CompileMetrics: the outputs, in its metrics' order",
    "_fn": "MeanMetricWrapper: the function it averages",
    "_fn_kwargs": "MeanMetricWrapper: that function's arguments",
    "_flatten_layers": "Layer: every sublayer",
    "_seed_generators": "Layer: its random number generators",
    "_trainable_variables": "Layer: its weights made trainable, frozen too",
    "_moments": "BatchNormalization: a batch's mean and variance",
    "_reduction_axes": "BatchNormalization: the axes it normalizes over",
    "_keras_history": "KerasTensor: the layer that made an input",
    "_layout": "Variable: its layout under a `keras.distribution`",
    "_value": "Variable: its backing value (JAX frees it for the step)",
    "_obj_type": "KerasSaveable: which objects the saver walks into",
    "_clip_gradients": "Optimizer: clipping the window's sum across replicas",
    "_distribution_strategy": "TF optimizer: the strategy it was made in",
    "_get_current_learning_rate": "Optimizer: its learning rate, read once",
    "_learning_rate": "Optimizer: its float, variable or schedule",
    # The window is created before the step is traced, and travels in it.
    "_maybe_symbolic_build": "Trainer: builds the model before `fit`",
    "_symbolic_build": "Trainer: the same, from a data spec",
    "_get_jax_state": "JAXTrainer: the state handed to the step",
    "_get_state_sharding_spec": "JAXTrainer: the state's shardings",
    "_jax_state": "JAXTrainer: the state between steps",
    "_jax_state_synced": "JAXTrainer: whether that state is attached",
    "_losses_override": "Layer: the forward pass's losses, in JAX's step",
    "_run_through_graph": "Functional: what `clone_model` runs on a model",
    "_clone_functional_model": "cloning: where `clone_model` builds a copy",
    "_initial_epoch": "Trainer: where `fit` starts, set by BackupAndRestore",
    "_weights_path": "BackupAndRestore: its weights file, for messages",
    "_training_metadata_path": "BackupAndRestore: its metadata file",
    # TensorFlow.
    "_distributed_dataset": "TFEpochIterator: the dataset it distributes",
    "_original_dataset": "DistributedDataset: the dataset it wraps",
    "_in_multi_worker_mode": "StrategyExtended: several workers",
    "__internal__": "tf.__internal__: strategy_supports_no_merge_call",
    # PyTorch: one call for every accumulator (as `torch.optim` does).
    "_foreach_add_": "torch: adds a list of tensors into another, in place",
    "_foreach_copy_": "torch: copies a list of tensors into another",
    "_foreach_div_": "torch: divides a list of tensors in place",
    "_foreach_norm": "torch: the norms of a list of tensors",
}
