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

try:
    from keras.src.backend.config import is_nnx_enabled
except ImportError:  # Keras before 3.11 has no Flax NNX mode.

    def is_nnx_enabled() -> bool:
        return False


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
