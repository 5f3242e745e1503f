"""The size a split batch's micro-batches take: `micro_batch_size="auto"`,
and the shrink after an out-of-memory error.

With `micro_batch_size` set, each of the model's train, test and predict
functions goes through a `SplitFunction`. Before a step runs on a batch it
makes sure that step's micro-batch size is known (`SplitSizes`): an int
setting is the size; an `AutoMicroBatch` has `search` find the largest
size whose step's peak fits the budget, from figures the backend measures
(`BatchOps.probing`: JAX's compiled memory analysis, the allocator's peak
of probe steps elsewhere). A train step that raises the backend's
out-of-memory error is undone (`BatchOps.snapshot` / `restore`: what the
pieces write before the window closes) and redone on the same batch at
half the size.

Everything backend-specific comes from the model's `BatchOps`
(`_batch_ops.py`), Keras's calling conventions included.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import warnings
from collections.abc import Callable

from keras_accum import _compat
from keras_accum.auto import AutoMicroBatch

logger = logging.getLogger("keras_accum")

# The probes one search may run: a line needs two; each later probe at
# least halves the sizes left between the largest known to fit and the
# smallest known not to.
MAX_PROBES = 40


@dataclasses.dataclass
class SplitSizes:
    """The micro-batch sizes in force since `compile`.

    Attributes:
        sizes: `{(kind, signature): size}`: the size each kind of step
            splits a batch of that signature into (`BatchOps.signature`:
            the batch's shapes on JAX, where every shape is compiled and
            sized on its own; None elsewhere, one size for every batch).
        active: `{kind: size}`: the size the step being traced or run
            reads (`BaseBatchOps.size`).
        choices: What `model.micro_batch_choices` shows.
        cache: What a backend's `BatchOps` keeps (TensorFlow: the
            compiled read of its `snapshot`).
        bounded_by_batch: `{(kind, signature): batch size}` where
            `"auto"` chose the whole batch: a larger size might fit too,
            so a larger batch of that key is searched again.
        shrunk: `{kind: size}`: the size an out-of-memory error left
            that kind of step at; no batch of it is split larger.
    """

    sizes: dict = dataclasses.field(default_factory=dict)
    active: dict = dataclasses.field(default_factory=dict)
    choices: list = dataclasses.field(default_factory=list)
    cache: dict = dataclasses.field(default_factory=dict)
    bounded_by_batch: dict = dataclasses.field(default_factory=dict)
    shrunk: dict = dataclasses.field(default_factory=dict)


class OutOfMemoryAtOne(RuntimeError):
    """Not even a micro-batch of one sample fits the budget."""


def search(
    measure: Callable[[int], int | None],
    batch_size: int,
    budget: int,
    exact: bool,
) -> tuple[int, int, dict]:
    """The largest micro-batch size in [1, `batch_size`] whose peak fits.

    Assumes the peak grows with the size (the activations do). Every size
    is a candidate: each probe after the first two lands where the line
    through the nearest figures on either side of the budget predicts the
    budget is reached, so a peak linear in the size (the usual case) is
    found in two or three probes.

    Args:
        measure: `measure(size)`: the step's peak in bytes at that size,
            or None where the probe ran out of memory.
        batch_size: The batch's size; no micro-batch exceeds it.
        budget: Bytes the step may use.
        exact: Whether a size predicted not to fit may be measured (a
            compiled analysis, which runs nothing). If not, only sizes
            predicted to fit are probed, and the answer's successor is
            known not to fit from the line alone.

    Returns:
        `(size, predicted peak, {size: peak measured})`.

    Raises:
        OutOfMemoryAtOne: If a micro-batch of one sample does not fit.
    """
    peaks: dict[int, float] = {}

    def fits(size):
        if size not in peaks:
            peak = measure(size)
            peaks[size] = float("inf") if peak is None else peak
        return peaks[size] <= budget

    if exact and fits(batch_size):
        return batch_size, peaks[batch_size], peaks
    if not fits(1):
        raise OutOfMemoryAtOne(peaks[1])
    low, high = 1, batch_size + 1  # `low` fits; `high` does not.
    if batch_size > 1 and not exact:
        if fits(2):
            low = 2
        else:
            high = 2
    for _ in range(MAX_PROBES):
        if high - low <= 1:
            break
        guess = _line_guess(peaks, low, high, budget)
        if guess <= low:
            # The line says `low + 1` no longer fits.
            if not exact:
                break
            guess = low + 1
        guess = min(guess, high - 1)
        if fits(guess):
            low = guess
        else:
            high = guess
    return low, peaks[low], peaks


def _line_guess(peaks, low, high, budget) -> int:
    """Where the line through two figures crosses the budget: `low`'s and
    `high`'s where both are known, else `low`'s and the largest size
    measured below it; with neither, halfway; and no further than halfway
    below a probe that ran out of memory."""
    finite = {s: p for s, p in peaks.items() if p != float("inf")}
    halfway = (low + high) // 2
    if high in finite:
        other = high
    else:
        below = [s for s in finite if s < low]
        if not below:
            return halfway
        other = max(below)
    slope = (finite[other] - finite[low]) / (other - low)
    if slope <= 0:
        # Flat at this resolution.
        return halfway
    guess = low + int((budget - finite[low]) // slope)
    if high in peaks and high not in finite:
        # A probe ran out of memory below the line's crossing: the figures
        # miss what failed it, so the rest is halved.
        return min(guess, halfway)
    return guess


def compiled_peak(analysis) -> int:
    """The bytes a compiled XLA step holds at its peak, from its
    `memory_analysis()`: arguments, outputs not aliased to them (donated
    buffers reused), and temporaries."""
    return (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + analysis.temp_size_in_bytes
    )


def host_available_memory() -> int | None:
    """Bytes the host can still give (`MemAvailable`), or None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def nvidia_total_memory(index: int) -> int | None:
    """An NVIDIA GPU's total memory in bytes, through the driver's NVML
    library; None where there is none."""
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None

    class Memory(ctypes.Structure):
        _fields_ = [
            ("total", ctypes.c_ulonglong),
            ("free", ctypes.c_ulonglong),
            ("used", ctypes.c_ulonglong),
        ]

    handle = ctypes.c_void_p()
    memory = Memory()
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)):
            return None
        if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)):
            return None
        return int(memory.total)
    finally:
        nvml.nvmlShutdown()


def budget_of(batch_ops, auto: AutoMicroBatch) -> tuple[int, str]:
    """`(bytes, where they come from)` a step may use under `auto`."""
    if auto.memory_limit is not None:
        limit, source = auto.memory_limit, "the given memory_limit"
    else:
        limit, source = batch_ops.device_memory()
    budget = auto.budget(limit)
    described = f"{source}, {_gib(limit)}"
    if auto.margin:
        described += f", less a {auto.margin:.0%} margin"
    return budget, described


class SplitFunction:
    """One of Keras's train, test or predict functions, the micro-batch
    sized for each batch before its step runs.

    A train function runs `steps_per_execution` steps per call, as Keras's
    own, so that a step that runs out of memory is redone on its own
    batch (`BatchOps.train_call`: on TensorFlow in the graph, the failed
    batch kept there; elsewhere, or where a batch must be seen to size it,
    `train_each` takes the batches in Python one at a time); a test or
    predict function passes its batches on to Keras's once the size is
    known.

    Args:
        batch_ops: The model's `BatchOps`.
        kind: `"train"`, `"test"` or `"predict"`.
        inner: Keras's function of `kind`.
    """

    def __init__(self, batch_ops, kind: str, inner) -> None:
        self.ops = batch_ops
        self.kind = kind
        self.inner = inner

    def __call__(self, *args):
        ops = self.ops
        if self.kind == "train":
            return ops.train_call(self, args)
        state, batches = ops.unpack_call(self.kind, args)
        first = next(batches)
        self.size_for(first, state)
        batches = itertools.chain([first], batches)
        return self.inner(*ops.pack_call(self.kind, state, batches))

    def train_each(self, args):
        """A train function's call, its batches taken out of the iterator
        in Python one at a time, each step run on its own (`_train_on`)."""
        ops = self.ops
        state, batches = ops.unpack_call(self.kind, args)
        outputs = None
        for index in range(ops.model.steps_per_execution):
            try:
                batch = next(batches)
            except StopIteration:
                if index == 0:
                    raise
                break
            outputs, state = self._train_on(batch, state)
        return ops.call_result(outputs, state)

    def _train_on(self, batch, state):
        ops = self.ops
        while True:
            size = self.size_for(batch, state)
            kept = ops.snapshot()
            try:
                result = self.inner(
                    *ops.pack_call(self.kind, state, iter([batch]))
                )
                return ops.step_result(result)
            except Exception as error:
                if not ops.is_out_of_memory(error):
                    raise
                # The failed attempt is undone before anything else runs.
                state = ops.restore(kept, state, error)
                if not self._shrink(batch, size, error):
                    ops.give_up(state)
                    raise

    def redo(self, batch, state, size: int, error: Exception):
        """`(outputs, state)` of `batch`'s train step redone at a smaller
        size, after it ran out of memory at `size` (raising `error`) and
        was undone; raises `error` where no smaller size can run."""
        if not self._shrink(batch, size, error):
            self.ops.give_up(state)
            raise error
        return self._train_on(batch, state)

    def settled_size(self) -> int | None:
        """The size the next train step splits its batch into, where no
        batch is needed to know it (an int setting, or one `"auto"` chose
        below a batch's size); else None. Recorded as `size_for` would."""
        ops = self.ops
        split = ops.sizes
        key = (self.kind, None)
        size = split.sizes.get(key)
        if isinstance(ops.setting, AutoMicroBatch):
            # A batch larger than the one "auto" chose the whole of would
            # be searched again: only its rows tell.
            if size is None or key in split.bounded_by_batch:
                return None
        elif size is None:
            size = min(ops.setting, split.shrunk.get(self.kind, ops.setting))
            split.sizes[key] = size
        split.active[self.kind] = size
        return size

    def size_for(self, batch, state) -> int:
        """The size this kind of step splits `batch` into; chosen (and
        recorded) where not yet known."""
        ops = self.ops
        split = ops.sizes
        key = (self.kind, ops.signature(batch))
        size = split.sizes.get(key)
        # A size "auto" chose on a smaller batch (the whole of it) is no
        # bound for a larger one.
        bound = split.bounded_by_batch.get(key)
        if size is None or (
            bound is not None and ops.batch_rows(batch) > bound
        ):
            batch_size = ops.batch_rows(batch)
            chosen = self._choose(batch, state)
            if isinstance(ops.setting, AutoMicroBatch) and (
                chosen >= batch_size
            ):
                split.bounded_by_batch[key] = batch_size
            else:
                split.bounded_by_batch.pop(key, None)
            chosen = min(chosen, split.shrunk.get(self.kind, chosen))
            if size is not None and chosen != size:
                # The step was traced at the old size.
                self.inner = ops.fresh(self.kind)
            size = split.sizes[key] = chosen
        split.active[self.kind] = size
        return size

    def _choose(self, batch, state) -> int:
        ops = self.ops
        setting = ops.setting
        if not isinstance(setting, AutoMicroBatch):
            return setting
        batch_size = ops.batch_rows(batch)
        # Each kind of step is searched on its own: evaluation keeps no
        # gradients and may take larger micro-batches than training, and
        # the train step's size is that of whichever batch came last.
        budget, described = budget_of(ops, setting)
        exact, measured_by = ops.sizing_method()
        try:
            with ops.probing(self.kind, batch, state) as measure:
                size, peak, peaks = search(measure, batch_size, budget, exact)
        except OutOfMemoryAtOne as error:
            raise RuntimeError(
                f'`micro_batch_size="auto"`: even a micro-batch of 1 sample '
                f"needs {_gib(error.args[0])} in the {self.kind} step "
                f"(measured by {measured_by}), more than the budget of "
                f"{_gib(budget)}: {described}. The weights and the "
                "optimizer's state alone may not fit: a larger "
                "`memory_limit`, a smaller `margin`, or a smaller model. "
                f"Received: micro_batch_size={setting!r}"
            ) from None
        self._record(
            batch_size,
            size,
            "auto",
            predicted_peak=int(peak),
            budget=budget,
            measured_by=measured_by,
            probes=len(peaks),
        )
        _compat.print_msg(
            f'keras_accum: micro_batch_size="auto" chose {size} for the '
            f"{self.kind} step on batches of {batch_size}: predicted peak "
            f"{_gib(peak)} of a budget of {_gib(budget)} ({described}; "
            f"{len(peaks)} size(s) measured by {measured_by})."
        )
        return size

    def _shrink(self, batch, size, error) -> bool:
        """Halves the size for `batch`'s kind, with a warning; False
        where it cannot (already 1, or replicas in other processes)."""
        ops = self.ops
        if size <= 1 or not ops.can_redo():
            return False
        new = max(size // 2, 1)
        split = ops.sizes
        # Every batch of this kind, whatever its shape, until `compile()`
        # or a new `micro_batch_size`: the device ran out at `size`.
        split.shrunk[self.kind] = new
        for key, known in split.sizes.items():
            if key[0] == self.kind:
                split.sizes[key] = min(known, new)
        split.sizes[(self.kind, ops.signature(batch))] = new
        split.active[self.kind] = new
        self._record(
            ops.batch_rows(batch),
            new,
            "out of memory",
            predicted_peak=None,
            budget=None,
            measured_by=type(error).__name__,
            probes=0,
        )
        warnings.warn(
            f"The {self.kind} step ran out of memory at micro_batch_size="
            f"{size} ({type(error).__name__}); nothing of it was applied. "
            f"Redoing the batch at micro_batch_size={new}: the update is "
            "the same, the step slower.",
            stacklevel=3,
        )
        # The step is retraced at the new size.
        self.inner = ops.fresh(self.kind)
        return True

    def _record(self, batch_size, size, reason, **figures) -> None:
        choice = {
            "step": self.kind,
            "batch_size": batch_size,
            "micro_batch_size": size,
            "reason": reason,
            **figures,
        }
        self.ops.sizes.choices.append(choice)
        logger.info("micro-batch size chosen: %s", choice)


def _gib(value) -> str:
    return f"{value / 2**30:.3g} GiB"
