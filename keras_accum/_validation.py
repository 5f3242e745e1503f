"""Argument checks shared by every public entry point."""

from __future__ import annotations

import numbers

PARTIAL_WINDOW_MODES = ("apply", "carry")


def check_accum_steps(accum_steps: object) -> int:
    """Returns `accum_steps` as a Python int, or raises naming the value."""
    # `bool` is an `int` subclass; `True` as a window length is a bug.
    if isinstance(accum_steps, bool) or not isinstance(
        accum_steps, numbers.Integral
    ):
        raise TypeError(
            "`accum_steps` must be an integer >= 1. "
            f"Received: accum_steps={accum_steps!r} "
            f"(of type {type(accum_steps).__name__})"
        )
    if accum_steps < 1:
        raise ValueError(
            "`accum_steps` must be an integer >= 1. "
            f"Received: accum_steps={accum_steps!r}"
        )
    return int(accum_steps)


def check_partial_window(partial_window: object) -> str:
    """Returns `partial_window` if it names a known policy, else raises."""
    if partial_window not in PARTIAL_WINDOW_MODES:
        raise ValueError(
            "`partial_window` must be one of "
            f"{', '.join(repr(m) for m in PARTIAL_WINDOW_MODES)}. "
            f"Received: partial_window={partial_window!r}"
        )
    return partial_window
