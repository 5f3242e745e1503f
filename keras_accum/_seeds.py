"""Random draws replayed: the whole-batch step's second pass draws what its
first pass drew.

The whole-batch step (`whole_batch_loss=True`) runs each piece of a batch
forward twice: once without gradients (pass 1, whose outputs the loss
sees) and once with them (pass 2, whose vector-Jacobian product carries
the loss's output gradient back). The gradient is the one-pass gradient
only if both passes draw the same numbers: the same dropout masks, noise
and augmentations.

Keras layers draw from `keras.random.SeedGenerator`s they hold (Dropout's,
GaussianNoise's, RandomFlip's `seed_generator`, held in the layer's
`_seed_generators`). A generator's state is a non-trainable variable of
two integers `(seed, counter)`; each draw (`SeedGenerator.next`) reads it
and assigns the counter plus one. The draws are therefore a function of
the state when a forward pass starts, and a piece's pass is replayed by
setting the state back.

Each piece draws from its own stream: piece `i` starts from the batch's
starting state with `i` times an odd constant added to the seed word
(`piece_state`), piece 0 from the starting state itself. Both passes enter
piece `i` at the same state, so pass 2 draws what pass 1 drew, in any
order of the pieces. After the step each generator is put where one
forward pass of the whole batch leaves it: the start moved by as much as
one piece's forward moved it (`end_state`), since a layer draws as many
times for a piece as for the batch. With one piece the step draws exactly
what `keras.Model`'s does; with several, piece 0 draws from the batch's
stream (with its own shape) and the others from streams no step of a
plain model reaches by counting. Streams never repeat between steps: the
counter word moves on each step as in a plain model.

PyTorch: a `Dropout` whose seed is None draws from torch's global
generators (`torch.nn.functional.dropout`), not from its `SeedGenerator`,
which it never advances (Keras's PyTorch backend, `random.dropout`). Those
draws are replayed too: the global generators' states (CPU and, where
initialized, CUDA) are saved with the start and restored when pass 2
enters piece 0, so the pieces must run in the same order in both passes;
they end where pass 1 left them. `torch_global_draws` names these layers.

Not covered, and said here: a generator advanced with
`next(ordered=False)` (only Keras's global generator is, for unseeded
draws, which JAX refuses while tracing), and random draws that are not
Keras's at all (a layer calling `tf.random.uniform` or `numpy.random`).
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from keras_accum import _compat

# Added to the seed word once per piece index: odd and below 2**31, so
# that it is a valid constant of every backend's seed dtype (int32 on
# PyTorch, uint32 on JAX, int64 on TensorFlow) and the multiples wrap
# around distinct seeds.
PIECE_STRIDE = 0x2545F491


def seed_generators(model) -> list:
    """Every `SeedGenerator` held by `model` or a layer inside it, once
    each, in the order of `model`'s layers."""
    found = {}
    for layer in _compat.sublayers(model):
        for generator in _compat.seed_generators(layer):
            found.setdefault(id(generator), generator)
    return list(found.values())


def seed_state_indices(model) -> tuple[int, ...]:
    """Where the generators' states sit in `model.non_trainable_variables`
    (the list the JAX stateless step passes its values in)."""
    states = {id(g.state) for g in seed_generators(model)}
    return tuple(
        i
        for i, variable in enumerate(model.non_trainable_variables)
        if id(variable) in states
    )


def torch_global_draws(model) -> list:
    """The layers of `model` that draw from torch's global generators on
    the PyTorch backend (a `Dropout` with no seed), [] elsewhere."""
    if keras.backend.backend() != "torch":
        return []
    return [
        layer
        for layer in _compat.sublayers(model)
        if isinstance(layer, keras.layers.Dropout) and _unseeded(layer)
    ]


def _unseeded(dropout) -> bool:
    # A `Dropout` of rate 0 draws nothing and holds no generator.
    generator = getattr(dropout, "seed_generator", None)
    return generator is not None and generator.get_config()["seed"] is None


def piece_state(start, piece):
    """The state a generator enters piece `piece` at, given its state
    `start` when the batch's step began.

    Args:
        start: Tensor. A generator's state, shape `(2,)`, its dtype.
        piece: Integer or integer scalar tensor. The piece's index.

    Returns:
        A tensor like `start`: `start` itself for piece 0.
    """
    stride = ops.convert_to_tensor([PIECE_STRIDE, 0], dtype=start.dtype)
    return start + stride * ops.cast(piece, start.dtype)


def end_state(start, piece, current):
    """A generator's state as one forward pass of the whole batch leaves
    it, given its `start` state, a piece `piece` whose forward pass ran
    last, and the state `current` that forward left."""
    return start + (current - piece_state(start, piece))


def _copy(value):
    # `* 1`, as `SeedGenerator.next` copies: inside a traced step a bare
    # read could be ordered after a later assignment.
    return value * 1


class SeedReplay:
    """Saves and sets the random generators' states of a model around the
    pieces of one batch (stateful form: TensorFlow, PyTorch, eager JAX).

    The step's recipe:

        replay = SeedReplay(model)
        start = replay.start()
        for i, piece in enumerate(pieces):  # pass 1
            replay.enter(start, i)
            outputs.append(model(piece, training=True))
        ...                                   # the loss on all outputs
        for i, piece in enumerate(pieces):  # pass 2, the same order
            replay.enter(start, i)
            ...                               # forward and VJP
        replay.finish(start, len(pieces) - 1)

    Args:
        model: `keras.Model`. The model whose forward passes draw.
    """

    def __init__(self, model) -> None:
        self.generators = seed_generators(model)
        self.torch_global = bool(torch_global_draws(model))

    def start(self) -> tuple[list, Any]:
        """The states at the start of the batch: `(values, torch_rng)`,
        `values` a copy of each generator's state, `torch_rng` the torch
        global generators' states where a layer draws from them (or
        None)."""
        values = [_copy(g.state.value) for g in self.generators]
        return values, _torch_rng_state() if self.torch_global else None

    def enter(self, start, piece) -> None:
        """Sets every generator to the state piece `piece` starts at
        (`piece` an integer, or a scalar tensor in a traced loop; the
        torch global generators are set back on piece 0 only, which
        needs a Python integer)."""
        values, torch_rng = start
        for generator, value in zip(self.generators, values, strict=True):
            generator.state.assign(piece_state(value, piece))
        if torch_rng is not None and isinstance(piece, int) and piece == 0:
            _set_torch_rng_state(torch_rng)

    def finish(self, start, last_piece) -> None:
        """Moves every generator to where one forward pass of the batch
        leaves it, right after the forward pass of piece `last_piece`."""
        values, _ = start
        for generator, value in zip(self.generators, values, strict=True):
            current = _copy(generator.state.value)
            generator.state.assign(end_state(value, last_piece, current))


# -- The stateless form (JAX's step): values lists in, values lists out ------


def start_values(non_trainable, indices) -> list:
    """The generators' states among `non_trainable` (the values of
    `model.non_trainable_variables`; `indices` from
    `seed_state_indices`)."""
    return [non_trainable[i] for i in indices]


def entered_values(non_trainable, indices, start, piece) -> list:
    """`non_trainable` with each generator's state set to the state piece
    `piece` starts at (`start` from `start_values`)."""
    found = list(non_trainable)
    for i, value in zip(indices, start, strict=True):
        found[i] = piece_state(value, piece)
    return found


def finished_values(non_trainable, indices, start, last_piece) -> list:
    """`non_trainable` (as piece `last_piece`'s forward pass left them)
    with each generator's state where one forward pass of the whole
    batch leaves it."""
    found = list(non_trainable)
    for i, value in zip(indices, start, strict=True):
        found[i] = end_state(value, last_piece, found[i])
    return found


def _torch_rng_state():
    import torch

    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state_all()
    return torch.get_rng_state(), cuda


def _set_torch_rng_state(state) -> None:
    import torch

    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
