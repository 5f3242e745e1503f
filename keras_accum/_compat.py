"""Shims for the older Keras releases in the tested range, and its check.

keras-accum relies on private Keras members (`keras.src.*`, trainer
internals), which Keras may change in any release: the range below is the
one the test suite ran on (the newest in CI, the oldest in `.ci/compat`).
"""

from __future__ import annotations

import re
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
# (`_trainer._loss_normalizer` counts the entries it averaged over).
from keras.src.backend.common.masking import get_keras_mask  # noqa: E402

# A loss under `tf.distribute` is pre-divided by the replica count
# (`unscale_loss_for_distribution` undoes it); `apply_mask` weights a
# batch's sample weights by its mask as `"mean_with_sample_weight"` does.
from keras.src.losses.loss import (  # noqa: E402
    apply_mask,
    unscale_loss_for_distribution,
)

# `clone_model`'s helper that rebuilds a functional model: its code object
# identifies the caller (`model._clone_source`), and None if a release
# renames it (the clone tests then fail rather than settings dropping).
from keras.src.models import cloning as _cloning  # noqa: E402

# The functional model class and Keras's own test of whether a subclass's
# constructor takes `(inputs, outputs)`: `AccumModel(inputs, outputs)` is
# built as Keras builds a functional model, without Keras rewriting
# `AccumModel`'s bases.
from keras.src.models.functional import (  # noqa: E402
    Functional,
    functional_like_constructor,
)

# What Keras's saver walks: a window state saves its own variables.
from keras.src.saving.keras_saveable import KerasSaveable  # noqa: E402

# `Trainer.__init__`, which `keras.Model.__init__` runs before `Functional`'s
# own; a functional `AccumModel` runs the two itself.
from keras.src.trainers.trainer import Trainer  # noqa: E402

# Unique layer names ("accum_model", "accum_model_1", ...), as Keras names.
from keras.src.utils.naming import auto_name  # noqa: E402

__all__ = [
    "CLONE_FUNCTIONAL_CODE",
    "Functional",
    "KerasSaveable",
    "Trainer",
    "apply_mask",
    "auto_name",
    "functional_like_constructor",
    "get_keras_mask",
    "is_nnx_enabled",
    "optimizer_strategy",
    "unscale_loss_for_distribution",
    "warn_if_untested",
]

CLONE_FUNCTIONAL_CODE = getattr(
    getattr(_cloning, "_clone_functional_model", None), "__code__", None
)


def optimizer_strategy(optimizer):
    """The `tf.distribute` strategy a TensorFlow Keras optimizer was made
    under (Keras 3.10-3.15 keep it as `_distribution_strategy`), or None."""
    return getattr(optimizer, "_distribution_strategy", None)


try:
    from keras.src.backend.config import is_nnx_enabled
except ImportError:  # Keras before 3.11 has no Flax NNX mode.

    def is_nnx_enabled() -> bool:
        return False


# -- Private members of public Keras objects ----------------------------------
# Read or overridden where Keras has no public hook; the same from Keras
# 3.10 to 3.15:
# - `Model._flatten_layers()`, `_call_has_training_arg`, `_loss_tracker`,
#   `_compute_loss`, `_aggregate_additional_loss`, `_compile_loss`
#   (`_flat_losses`, each `.loss.reduction`), `_compile_metrics`: the
#   train step as Keras's own, and the loss's reduction per micro-batch.
# - `Trainer._maybe_symbolic_build`, `_symbolic_build`: the window is
#   created before the step is traced.
# - `Optimizer._clip_gradients`: clipping the window's sum across replicas.
# - TensorFlow: `TFEpochIterator._distributed_dataset` (the element spec
#   without copying in-memory data), `strategy.extended
#   ._in_multi_worker_mode()`.
# - JAX: `_get_jax_state`, `_get_state_sharding_spec`, `jax_state_sync`,
#   `_jax_state`, `_jax_state_synced`, `_losses_override`: the window's
#   values ride in the trainer's state.
# - PyTorch: `Variable.value.grad` (the backward pass's gradients).
