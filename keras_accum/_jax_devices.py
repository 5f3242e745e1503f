"""JAX under a `keras.distribution`: each device keeps its own window sum.

A plain data-parallel step all-reduces the gradient on every step, and so
would a window that sums the reduced gradients. Here each device adds the
gradient of its own shard of the micro-batch to its own accumulator (a
partial sum, with no communication), and the window's close sums the
devices' accumulators once, inside the conditional that applies it: one
gradient all-reduce per window instead of one per micro-batch.

An accumulator then has a leading axis of the devices along the mesh's
batch axis, sharded over it, and its weight's layout on the other axes:
each device holds one accumulator per weight shard.

The micro-batch's forward and backward pass runs in `jax.shard_map`,
manual over the batch axis only (a `ModelParallel` mesh's model axes stay
with XLA), with the trainable values marked as varying over it so that
the gradient is not reduced. Inside, a layer sees its device's shard of
the micro-batch: models whose layers compute statistics over the batch
(`BatchNormalization`) take the reduced gradient instead, added to the
first device's accumulator (`maps_over_devices`). Random generators'
states are folded with the device's index, so that devices draw different
numbers, and leave the step moved as a plain step moves them. The loss's
share of the window, the step's logs and how far each generator moved
still cross devices on every step, as scalars (as Keras's own logs do).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import keras
import numpy as np
from jax.sharding import PartitionSpec

from keras_accum import _compat, _window
from keras_accum._jax_ops import JaxOps, only_if


class BatchAxis(NamedTuple):
    """The devices along the distribution's batch axis.

    Attributes:
        mesh: The `jax.sharding.Mesh`.
        name: The batch axis's name.
        size: How many devices it spans.
    """

    mesh: Any
    name: str
    size: int


def batch_axis(weights=()) -> BatchAxis | None:
    """The distribution's batch axis, where it spans several devices and
    JAX can keep per-device values (`jax.shard_map`, `jax.lax.pcast`);
    None elsewhere: the window then sums the reduced gradients.

    None too where one of `weights` is sharded over the batch axis
    (FSDP-style layouts, such as KerasHub's Gemma `get_layout_map`): a
    device then holds a slice of that weight, and a partial sum of the
    whole weight would cost more memory than the reduced gradient's
    slice, which a plain step reduce-scatters anyway.
    """
    if not (hasattr(jax, "shard_map") and hasattr(jax.lax, "pcast")):
        return None
    distribution = keras.distribution.distribution()
    name = getattr(distribution, "batch_dim_name", None)
    if name is None:
        return None
    mesh = distribution.device_mesh.backend_mesh
    size = dict(mesh.shape).get(name, 1)
    if size < 2 or any(_sharded_over(w, name) for w in weights):
        return None
    return BatchAxis(mesh, name, size)


def data_shards() -> int:
    """How many parts the distribution splits a batch into along its
    batch axis (1 without a distribution): each device's rows are a
    contiguous block of the global batch."""
    distribution = keras.distribution.distribution()
    name = getattr(distribution, "batch_dim_name", None)
    if name is None:
        return 1
    return int(dict(distribution.device_mesh.backend_mesh.shape).get(name, 1))


def _sharded_over(weight, name: str) -> bool:
    layout = _compat.variable_layout(weight)
    for axis in getattr(layout, "axes", None) or ():
        if axis == name or (isinstance(axis, tuple) and name in axis):
            return True
    return False


def partial_sum_variables(axis: BatchAxis):
    """A `make_variable` for `_window.WindowState`: accumulators with a
    leading axis of devices, sharded over the batch axis."""

    def make_variable(name, shape, dtype, like):
        if like is None:
            return _window._plain_variable(name, shape, dtype)
        layout = _window.layout_like(like, shape)
        axes = [None] * len(shape) if layout is None else list(layout.axes)
        device_mesh = keras.distribution.distribution().device_mesh
        return keras.Variable(
            initializer="zeros",
            shape=(axis.size, *shape),
            dtype=dtype,
            trainable=False,
            name=name,
            layout=keras.distribution.TensorLayout(
                [axis.name, *axes], device_mesh
            ),
        )

    return make_variable


def summed_on_host(accumulator):
    """An accumulator's devices' partial sums, summed, as a NumPy array
    (for saving): replicated first, so that every process can read it."""
    value = accumulator.value
    replicated = jax.sharding.NamedSharding(
        value.sharding.mesh, PartitionSpec()
    )
    summed = jax.jit(_sum_over_devices, out_shardings=replicated)
    return np.asarray(summed(value))


def _sum_over_devices(value):
    # In float32: bfloat16 partial sums would round once more. Saved so;
    # a load rounds the sum to nearest into the first device's slot.
    return value.astype(_window.ACC_DTYPE).sum(axis=0)


def maps_over_devices(model, axis: BatchAxis, x) -> bool:
    """Whether each device can compute its own shard's gradient.

    Not where a layer computes batch statistics (`BatchNormalization`:
    its moments would be its device's, where the plain step's are the
    whole micro-batch's), nor for a micro-batch that does not split evenly
    (Keras's data layout refuses one anyway).
    """
    batch = next(i for i in keras.tree.flatten(x) if i is not None).shape[0]
    if batch % axis.size:
        return False
    return not any(
        isinstance(layer, keras.layers.BatchNormalization)
        for layer in _compat.sublayers(model)
    )


def seed_states(model) -> tuple:
    """Where the model's random generators' states sit among its
    non-trainable variables."""
    states = {
        id(generator.state)
        for layer in _compat.sublayers(model)
        for generator in _compat.seed_generators(layer)
    }
    return tuple(
        i
        for i, variable in enumerate(model.non_trainable_variables)
        if id(variable) in states
    )


def in_first_slot(grads, slots: int) -> list:
    """Reduced gradients as partial sums over `slots` devices: on the
    first, zeros on the others."""
    return [
        keras.ops.zeros((slots, *g.shape), _window.ACC_DTYPE)
        .at[0]
        .set(keras.ops.cast(g, _window.ACC_DTYPE))
        for g in grads
    ]


class DeviceStep(NamedTuple):
    """What `per_device_gradients` returns.

    Attributes:
        grads: Each trainable weight's partial gradients, with a leading
            axis of devices (the micro-batch's weight folded in).
        y_pred: The micro-batch's predictions, sharded along the batch.
        non_trainable: The non-trainable values after the forward pass.
        metrics: The metrics' values after the loss (its trackers).
        share: The micro-batch's `_window.Share`, summed over devices.
        loss: The micro-batch's loss as a plain step reports it.
    """

    grads: list
    y_pred: Any
    non_trainable: list
    metrics: list
    share: _window.Share
    loss: Any


def per_device_gradients(
    objective, axis: BatchAxis, trainable, values, data, seeds=()
):
    """Each device's gradient of `objective` on its shard of `data`.

    Args:
        objective: The trainer's `_jax_objective(trainable, values, x, y,
            sample_weight)`; `values` get the device's index (`device`).
        axis: The `BatchAxis`.
        trainable: The trainable values.
        values: The step's other values (`_StepValues`).
        data: `(x, y, sample_weight)`.
        seeds: `seed_states`: each device draws from its own stream.

    Returns:
        A `DeviceStep`.
    """

    def on_device(trainable, values, data):
        # Varying over the batch axis: the gradient stays this device's.
        trainable = jax.lax.pcast(trainable, axis.name, to="varying")
        device = jax.lax.axis_index(axis.name)
        given = values.non_trainable
        values = values._replace(
            device=device, non_trainable=_own_streams(given, seeds, device)
        )
        grad_fn = jax.value_and_grad(objective, has_aux=True)
        (_, out), grads = grad_fn(trainable, values, *data)
        out = out._replace(
            non_trainable=_streams_moved(
                out.non_trainable, (given, values.non_trainable), seeds, axis
            )
        )
        share = out.share
        if share.weight is not None:
            grads = [g * keras.ops.cast(share.weight, g.dtype) for g in grads]
        summed = jax.lax.psum(_scalars(share, out.loss), axis.name)
        metrics = [
            _summed_change(new, old, axis)
            for new, old in zip(out.metrics, values.metrics, strict=True)
        ]
        _check_invariant(out.non_trainable, axis)
        grads = [g[None] for g in grads]
        return grads, out.y_pred, out.non_trainable, (metrics, summed)

    batch = PartitionSpec(axis.name)
    whole = PartitionSpec()
    grads, y_pred, non_trainable, (metrics, summed) = jax.shard_map(
        on_device,
        mesh=axis.mesh,
        in_specs=(whole, whole, batch),
        out_specs=(batch, batch, whole, (whole, whole)),
        axis_names={axis.name},
    )(trainable, values, data)
    share = _window.Share(None, summed[0], summed[1], summed[2])
    loss = summed[3] / _window.window_divisor(summed[0])
    return DeviceStep(grads, y_pred, non_trainable, metrics, share, loss)


def _scalars(share: _window.Share, loss):
    """`[normalizer, weighted loss, samples, reported loss]` of a device,
    to sum over devices (`loss`: the trainer's `_device_loss`)."""
    return keras.ops.stack(
        [keras.ops.cast(v, "float32") for v in (*share[1:], loss)]
    )


def _own_streams(non_trainable, seeds, device) -> list:
    """The non-trainable values with each random generator's state folded
    with the device's index: devices draw different numbers for their
    shards, as the plain step draws different numbers for each sample."""
    found = list(non_trainable)
    for i in seeds:
        state = found[i]
        folded = jax.random.fold_in(state.astype("uint32"), device)
        found[i] = folded.astype(state.dtype)
    return found


def _streams_moved(non_trainable, before, seeds, axis: BatchAxis) -> list:
    """The generators' states as a plain step leaves them: moved from the
    given state (`before[0]`) as far as each device's stream moved from
    its folded start (`before[1]`), the same on every device (a maximum
    over devices of two integers makes that known to JAX)."""
    found = list(non_trainable)
    given, folded = before
    for i in seeds:
        moved = jax.lax.pmax(found[i] - folded[i], axis.name)
        found[i] = given[i] + moved
    return found


def _summed_change(new, old, axis: BatchAxis):
    """A metric's value with every device's change added (the loss's own
    trackers, updated in the objective); unchanged values pass as they
    are, with no exchange."""
    if new is old:
        return new
    return old + jax.lax.psum(new - old, axis.name)


def _varying_axes(value) -> frozenset:
    """The mesh axes `value` varies over, inside `jax.shard_map`."""
    aval = jax.typeof(value)
    found = getattr(aval, "vma", None)
    if found is None:  # JAX 0.10 moved it.
        found = aval.mat.varying
    return frozenset(found)


def _check_invariant(values, axis: BatchAxis) -> None:
    for value in values:
        if axis.name in _varying_axes(value):
            raise ValueError(
                "A non-trainable variable of the model changes with the "
                "data in the forward pass, and AccumModel's per-device "
                "accumulation under a `keras.distribution` cannot follow "
                "it (each device sees its own shard of the micro-batch). "
                "Layers that compute batch statistics like "
                "`BatchNormalization` are handled; please report this "
                f"model. Received: a value of shape {value.shape}"
            )


class PartialSumOps(JaxOps):
    """`JaxOps` where each accumulator holds each device's partial sum of
    the window along a leading axis, and the gradients added come that
    way: the window's sum is theirs, taken when the window is read (the
    window's one all-reduce, in the close's conditional)."""

    def _sums(self, values):
        return [keras.ops.sum(value, axis=0) for value in values]

    def _squares_added(self, added, sampled):
        # The micro-batch's whole gradient: summed over devices only in
        # sampled windows.
        return only_if(sampled, _squares_of_sums, added)

    def sum_of_squares(self, closing=True):
        return only_if(closing, _squares_of_sums, self.accumulators)

    def _after_update(self, window_gradients, accumulators):
        # The devices' sums keep their shape; the next micro-batch
        # overwrites them.
        return list(accumulators)


def _squares_of_sums(values):
    # Over the devices first: the square of the sum, not the sum of squares.
    return _window.sum_of_squares([v.sum(axis=0) for v in values])


def ops_class(window_state):
    """The window's `WindowOps`: each device's partial sums under a
    `keras.distribution` that splits the batch (`_jax_devices`), else the
    one-device values."""
    if window_state.partial_sums:
        return PartialSumOps
    return JaxOps
