"""Argument checks shared by every public entry point."""

from __future__ import annotations

import difflib
import numbers
import reprlib

# `accumulator_dtype`'s check is its registry's (`_codecs.CODECS`).
from keras_accum._codecs import check_accumulator_dtype  # noqa: F401
from keras_accum.auto import MAX_STEPS, AutoAccumSteps, AutoMicroBatch

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
    if accum_steps > MAX_STEPS:
        # The window counts its micro-batches in int32 on every backend.
        raise ValueError(
            f"`accum_steps` must be at most {MAX_STEPS} (2**31 - 1: the "
            "window counts its micro-batches as int32). "
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


def check_accum_schedule(accum_steps: object) -> object:
    """Returns `accum_steps` (an int, an epoch schedule or a callable).

    An epoch schedule is returned as a new dict with int keys sorted, and
    `"auto"` as `AutoAccumSteps()`.
    """
    if isinstance(accum_steps, AutoAccumSteps):
        return accum_steps
    if isinstance(accum_steps, str) and accum_steps == "auto":
        return AutoAccumSteps()
    if callable(accum_steps) and not isinstance(accum_steps, type):
        return accum_steps
    if isinstance(accum_steps, dict):
        if not accum_steps:
            raise ValueError(
                "An `accum_steps` schedule by epoch must not be empty. "
                f"Received: accum_steps={accum_steps!r}"
            )
        schedule = {}
        for epoch, steps in accum_steps.items():
            # Keys arrive as strings from a saved config.
            if isinstance(epoch, str) and epoch.isdigit():
                epoch = int(epoch)
            if (
                isinstance(epoch, bool)
                or not isinstance(epoch, numbers.Integral)
                or epoch < 0
            ):
                raise ValueError(
                    "The keys of an `accum_steps` schedule must be epoch "
                    "indices (integers >= 0). "
                    f"Received: accum_steps={accum_steps!r}"
                )
            schedule[int(epoch)] = check_accum_steps(steps)
        if 0 not in schedule:
            raise ValueError(
                "An `accum_steps` schedule by epoch must say what epoch 0 "
                "uses (a key 0). "
                f"Received: accum_steps={accum_steps!r}"
            )
        return dict(sorted(schedule.items()))
    if isinstance(accum_steps, bool) or not isinstance(
        accum_steps, numbers.Integral
    ):
        raise TypeError(
            "`accum_steps` must be an integer >= 1, a dict mapping epochs "
            'to integers, a callable of the update count, or "auto" (an '
            "`AutoAccumSteps`). "
            f"Received: accum_steps={accum_steps!r} "
            f"(of type {type(accum_steps).__name__})"
        )
    return check_accum_steps(accum_steps)


def check_micro_batch_size(micro_batch_size: object) -> object:
    """Returns `micro_batch_size` (None, a Python int, or an
    `AutoMicroBatch`, which `"auto"` becomes), or raises naming the
    value."""
    if micro_batch_size is None or isinstance(micro_batch_size, AutoMicroBatch):
        return micro_batch_size
    if isinstance(micro_batch_size, str) and micro_batch_size == "auto":
        return AutoMicroBatch()
    if isinstance(micro_batch_size, bool) or not isinstance(
        micro_batch_size, numbers.Integral
    ):
        raise TypeError(
            '`micro_batch_size` must be None, an integer >= 1, "auto" or '
            "an `AutoMicroBatch`. "
            f"Received: micro_batch_size={micro_batch_size!r} "
            f"(of type {type(micro_batch_size).__name__})"
        )
    if not 1 <= micro_batch_size <= MAX_STEPS:
        raise ValueError(
            '`micro_batch_size` must be None, "auto" or an integer from 1 '
            f"to {MAX_STEPS}. Received: micro_batch_size={micro_batch_size!r}"
        )
    return int(micro_batch_size)


def check_split_mode(accum_steps: object, micro_batch_size) -> None:
    """Refuses `micro_batch_size` beside an `accum_steps` of its own: each
    `fit` batch is then one window, of as many micro-batches as it
    splits into."""
    if micro_batch_size is not None and not (
        type(accum_steps) is int and accum_steps == 1
    ):
        shown = "auto" if isinstance(accum_steps, AutoAccumSteps) else None
        raise ValueError(
            "`micro_batch_size` and `accum_steps` cannot both be set: with "
            "`micro_batch_size`, each batch `fit` is given is one update, "
            "split into micro-batches of that size, so the window's length "
            "follows from the batch. Set one of them. Received: "
            f"accum_steps={shown or accum_steps!r}, "
            f"micro_batch_size={micro_batch_size!r}"
        )


def steps_for_epoch(schedule: dict, epoch: int) -> int:
    """The window length an epoch schedule gives `epoch`."""
    return schedule[max(e for e in schedule if e <= epoch)]


def check_keywords(
    owner: str,
    given: dict,
    ours: tuple[str, ...],
    theirs: tuple[str, ...] = (),
) -> None:
    """Refuses keyword arguments `given` to `owner` that are neither
    `ours` nor `theirs` (what it passes on to Keras), naming each and the
    nearest accepted name. Keras's functional `Model` ignores unknown
    keywords, so a misspelt `accum_step=8` would train at 1."""
    unknown = [name for name in given if name not in (*ours, *theirs)]
    if not unknown:
        return
    shown = ", ".join(f"{name}={reprlib.repr(given[name])}" for name in unknown)
    hints = []
    for name in unknown:
        nearest = difflib.get_close_matches(name, ours, n=1) or (
            difflib.get_close_matches(name, theirs, n=1)
        )
        if nearest:
            hints.append((name, nearest[0]))
    if len(hints) == 1 and len(unknown) == 1:
        hint = f" Did you mean `{hints[0][1]}`?"
    else:
        hint = "".join(
            f" Did you mean `{near}` for `{name}`?" for name, near in hints
        )
    listed = ", ".join(f"`{name}`" for name in ours)
    passed = (
        f"; and `keras.Model`'s: {', '.join(f'`{n}`' for n in theirs)}"
        if theirs
        else ""
    )
    raise ValueError(
        f"Unrecognized keyword argument(s) for `{owner}`: {shown}.{hint} "
        f"It takes {listed}{passed}."
    )


def check_whole_batch_loss(whole_batch_loss: object) -> bool:
    """Returns `whole_batch_loss` if it is a bool, else raises."""
    if not isinstance(whole_batch_loss, bool):
        raise TypeError(
            "`whole_batch_loss` must be True or False. "
            f"Received: whole_batch_loss={whole_batch_loss!r} "
            f"(of type {type(whole_batch_loss).__name__})"
        )
    return whole_batch_loss


def check_whole_batch_loss_mode(micro_batch_size, whole_batch_loss) -> None:
    """Refuses `whole_batch_loss` without `micro_batch_size`: only a batch
    split inside the step has a whole batch for the loss to see."""
    if whole_batch_loss and micro_batch_size is None:
        raise ValueError(
            "`whole_batch_loss` needs `micro_batch_size`: the loss sees the "
            "whole batch only where the step splits it. Set "
            "`micro_batch_size` too, or leave `whole_batch_loss` False. "
            f"Received: micro_batch_size={micro_batch_size!r}, "
            f"whole_batch_loss={whole_batch_loss!r}"
        )
