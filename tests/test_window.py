"""The window's rules (`keras_accum._window`), on hand-computed windows.

No model, no `fit`: the rules take the window's values and a `WindowOps`,
here `_Recording`, a plain one over `keras.ops` values that records what
the rules asked of it. Each case's figures are worked out by hand in its
comments (optax's `MultiSteps` tests do the same: gradients 1, 2, 3, 4
average to 2.5). Runs under every backend.
"""

import math

import keras
import numpy as np
import pytest
from keras import ops

from keras_accum import _normalizer as normalizers
from keras_accum import _window, _window_fields
from keras_accum._window import Counters, Plan, Share

NAN = float("nan")


def _counters(**values) -> Counters:
    """An empty window of length 4, with `values` replaced."""
    fields = {}
    for field in _window_fields.FIELDS:
        fields[field.name] = ops.zeros(field.shape, field.dtype)
    fields["window_length"] = ops.convert_to_tensor(4, "int32")
    fields["target_length"] = ops.convert_to_tensor(4, "int32")
    for name, value in values.items():
        fields[name] = ops.convert_to_tensor(value, fields[name].dtype)
    return Counters.from_flat(fields.values())


class _Recording(_window.WindowOps):
    """A `WindowOps` of plain values: accumulators as a list, an SGD(1)
    update of `weights`, and a log of what the rules asked."""

    def __init__(self, accumulators, weights=None):
        self.accumulators = [
            ops.convert_to_tensor(a, "float32") for a in accumulators
        ]
        self.weights = weights
        self.iterations = 0
        self.calls = []

    def add(self, grads, weight, starting, sampled, draw=None):
        self.calls.append("add")
        added = [
            ops.convert_to_tensor(g, "float32")
            * (1.0 if weight is None else weight)
            for g in grads
        ]
        self.accumulators = [
            ops.where(starting, value, acc + value)
            for acc, value in zip(self.accumulators, added, strict=True)
        ]
        if sampled is None:
            return None
        squares = _window.sum_of_squares(added)
        return ops.where(sampled, squares, ops.zeros_like(squares))

    def all_finite(self, closing=True):
        return _window.all_finite(self.accumulators)

    def sum_of_squares(self, closing=True):
        return _window.sum_of_squares(self.accumulators)

    def gradients(self, divisor):
        return [acc / divisor for acc in self.accumulators]

    def apply(self, go, divisor):
        self.calls.append("apply")
        if bool(go):
            self.iterations += 1
            gradients = self.gradients(divisor)
            if self.weights is not None:
                self.weights = [
                    ops.subtract(w, g)
                    for w, g in zip(self.weights, gradients, strict=True)
                ]
        return ops.convert_to_tensor(self.iterations, "int32")


def _numpy(value):
    return np.asarray(ops.convert_to_numpy(value))


def _add(counters, backend, gradient, samples, plan=None):
    """Adds one micro-batch of `samples` samples whose mean gradient is
    `gradient` (a mean-reduced loss, weight folded in: the gradient the
    step hands over is `samples * gradient`)."""
    share = Share(None, float(samples), 0.5 * samples, samples)
    grads = [np.asarray(gradient, "float32") * samples]
    return _window.accumulate(counters, backend, grads, share, plan or Plan())


def _close(counters, backend, should_close=True, **policy):
    return _window.close(
        counters, backend, should_close, _window.ClosePolicy(**policy)
    )


def test_gradients_1_2_3_4_average_to_2_5():
    backend = _Recording([[0.0]], weights=[np.zeros(1, "float32")])
    counters = _counters()
    for gradient in (1.0, 2.0, 3.0, 4.0):
        counters, complete = _add(counters, backend, [gradient], samples=8)
        assert bool(complete) is (gradient == 4.0)
    counters, applied = _close(counters, backend)
    assert bool(applied)
    # One SGD(1) step of the mean gradient: 0 - (8 + 16 + 24 + 32) / 32.
    np.testing.assert_allclose(_numpy(backend.weights[0]), [-2.5])
    assert int(_numpy(counters.mini_step)) == 0
    assert int(_numpy(counters.log.count)) == 1
    assert int(_numpy(counters.log.samples[0])) == 32
    assert int(_numpy(counters.log.micro[0])) == 4
    assert int(_numpy(counters.log.update[0])) == 1
    # The pseudo-batch loss: each micro-batch's loss 0.5, weighted alike.
    np.testing.assert_allclose(_numpy(counters.log.loss[0]), 0.5)
    # The totals start again from zero.
    for name in _window_fields.TOTALS:
        assert float(_numpy(counters.get(name))) == 0.0


def test_an_uneven_window_is_the_mean_over_its_samples():
    # 8 samples of mean gradient 1, then 4 of mean gradient 4: the large
    # batch's mean is (8 * 1 + 4 * 4) / 12 = 2, not the mean of means 2.5.
    backend = _Recording([[0.0]], weights=[np.zeros(1, "float32")])
    counters = _counters(window_length=2, target_length=2)
    counters, _ = _add(counters, backend, [1.0], samples=8)
    counters, complete = _add(counters, backend, [4.0], samples=4)
    assert bool(complete)
    _close(counters, backend)
    np.testing.assert_allclose(_numpy(backend.weights[0]), [-2.0])


def test_sample_weight_totals_divide_the_window_whatever_their_sign():
    # "mean_with_sample_weight": micro-batch weight totals 3 and -1 (the
    # gradient handed over is total * mean); the window divides by 2.
    backend = _Recording([[0.0]], weights=[np.zeros(1, "float32")])
    counters = _counters(window_length=2, target_length=2)
    for total, gradient in ((3.0, 1.0), (-1.0, 5.0)):
        share = Share(None, total, 0.0, 4)
        grads = [np.asarray([gradient * total], "float32")]
        counters, _ = _window.accumulate(
            counters, backend, grads, share, Plan()
        )
    np.testing.assert_allclose(_numpy(counters.acc_normalizer), 2.0)
    _close(counters, backend)
    # (3 * 1 - 1 * 5) / 2 = -1.
    np.testing.assert_allclose(_numpy(backend.weights[0]), [1.0])


def test_a_summed_loss_adds_no_normalizer():
    # Sum reductions: the window is the plain sum (divisor 1).
    assert float(_numpy(_window.window_divisor(ops.zeros(())))) == 1.0
    backend = _Recording([[0.0]], weights=[np.zeros(1, "float32")])
    counters = _counters(window_length=2, target_length=2)
    for gradient in (2.0, 3.0):
        share = Share(None, 0.0, 1.0, 4)
        counters, _ = _window.accumulate(
            counters,
            backend,
            [np.asarray([gradient], "float32")],
            share,
            Plan(),
        )
    _close(counters, backend)
    np.testing.assert_allclose(_numpy(backend.weights[0]), [-5.0])


def test_a_share_with_a_weight_is_multiplied_in():
    # Under loss scaling the step hands over the mean over the window's
    # length and a float32 weight of normalizer * length.
    backend = _Recording([[0.0]])
    share = Share(ops.convert_to_tensor(16.0), 8.0, 0.0, 8)
    _window.accumulate(
        _counters(), backend, [np.asarray([0.25], "float32")], share, Plan()
    )
    np.testing.assert_allclose(_numpy(backend.accumulators[0]), [4.0])


def test_a_window_first_micro_batch_overwrites_the_last_window():
    backend = _Recording([[100.0]])
    counters, _ = _add(_counters(), backend, [1.0], samples=2)
    np.testing.assert_allclose(_numpy(backend.accumulators[0]), [2.0])
    counters, _ = _add(counters, backend, [1.0], samples=2)
    np.testing.assert_allclose(_numpy(backend.accumulators[0]), [4.0])


def test_a_non_finite_window_is_skipped_whole_and_counted():
    backend = _Recording([[0.0]], weights=[np.zeros(1, "float32")])
    counters = _counters(window_length=1, target_length=1)
    counters, _ = _add(counters, backend, [NAN], samples=4)
    counters, applied = _close(counters, backend)
    assert not bool(applied)
    assert backend.iterations == 0
    np.testing.assert_allclose(_numpy(backend.weights[0]), [0.0])
    assert int(_numpy(counters.skipped_windows)) == 1
    # Published all the same, so that the logger sees it.
    assert int(_numpy(counters.log.count)) == 1


def test_under_loss_scaling_a_non_finite_window_goes_to_the_optimizer():
    backend = _Recording([[0.0]])
    counters = _counters(window_length=1, target_length=1)
    counters, _ = _add(counters, backend, [math.inf], samples=4)
    _, applied = _close(counters, backend, scales_loss=True)
    assert bool(applied)  # The loss-scale optimizer skips it itself.


def test_a_window_without_samples_applies_nothing():
    totals = _window.Totals.unpack(ops.convert_to_tensor([0.0, 0.0, 0.0, 0.0]))
    assert float(totals.samples) == 0.0
    _, go = _window.decide(totals)
    assert not bool(go)
    # The packed vector's entries, by name: normalizer, loss, samples and
    # the non-finite flag.
    named = _window.Totals.unpack(ops.convert_to_tensor([4.0, 2.0, 8.0, 1.0]))
    assert [float(v) for v in named] == [4.0, 2.0, 8.0, 1.0]
    assert float(named.samples) == 8.0 and float(named.nonfinite) == 1.0
    finite, go = _window.decide(named)
    assert not bool(finite) and not bool(go)


def test_should_close_false_changes_nothing_but_the_apply_is_not_run():
    backend = _Recording([[0.0]], weights=[np.zeros(1, "float32")])
    counters, _ = _add(_counters(), backend, [1.0], samples=4)
    closed, applied = _close(counters, backend, should_close=False)
    assert not bool(applied)
    assert backend.iterations == 0
    assert int(_numpy(closed.mini_step)) == 1
    assert int(_numpy(closed.log.count)) == 0


def test_the_epoch_end_closes_a_partial_window_only_under_apply():
    counters = _counters(mini_step=2, epoch_step=9, steps_per_epoch=9)
    assert bool(_window.is_complete(counters, close_at_epoch_end=True))
    assert not bool(_window.is_complete(counters, close_at_epoch_end=False))
    # An unknown epoch length (0) never closes a window early.
    counters = _counters(mini_step=2, epoch_step=9)
    assert not bool(_window.is_complete(counters, close_at_epoch_end=True))


def test_a_window_length_is_fixed_when_it_starts():
    # A schedule's new length applies from the next window.
    counters = _counters(mini_step=1, window_length=4, target_length=8)
    length = _window.next_window_length(counters, scheduled=2)
    assert int(_numpy(length)) == 4
    length = _window.next_window_length(_counters(target_length=8))
    assert int(_numpy(length)) == 8
    length = _window.next_window_length(_counters(), scheduled=2)
    assert int(_numpy(length)) == 2


def test_noise_estimates_of_two_micro_batches():
    # Micro-batch mean gradients g1 = 1 and g2 = 3 of n = 2 samples each:
    # the window's mean G_W = 2, N = 4, k = 2. The estimator's terms:
    #   |G_W|² = 4, sum_j n_j |g_j|² = 2 * 1 + 2 * 9 = 20,
    #   tr(Σ) = (20 - N |G_W|²) / (k - 1) = (20 - 16) / 1 = 4,
    #   |G|² = |G_W|² - tr(Σ) / N = 4 - 4 / 4 = 3.
    backend = _Recording([[0.0]])
    counters = _counters(window_length=2, target_length=2)
    plan = Plan(noise_every=1)
    counters, _ = _add(counters, backend, [1.0], samples=2, plan=plan)
    counters, _ = _add(counters, backend, [3.0], samples=2, plan=plan)
    np.testing.assert_allclose(_numpy(counters.acc_grad_sq), 20.0)
    trace, grad_sq = _window.noise_statistics(
        counters, backend.sum_of_squares()
    )
    np.testing.assert_allclose(_numpy(trace), 4.0, rtol=1e-6)
    np.testing.assert_allclose(_numpy(grad_sq), 3.0, rtol=1e-6)
    closed, _ = _close(counters, backend, noise_every=1)
    np.testing.assert_allclose(_numpy(closed.log.trace[0]), 4.0, rtol=1e-6)
    np.testing.assert_allclose(_numpy(closed.log.grad_sq[0]), 3.0, rtol=1e-6)


def test_only_sampled_windows_estimate_the_noise():
    assert _window.is_sampled(_counters(log_count=3), 0) is None
    assert _window.is_sampled(_counters(log_count=3), 1) is True
    assert not bool(_window.is_sampled(_counters(log_count=3), 2))
    assert bool(_window.is_sampled(_counters(log_count=4), 2))
    backend = _Recording([[0.0]])
    counters = _counters(window_length=2, target_length=2, log_count=1)
    plan = Plan(noise_every=2)
    for gradient in (1.0, 3.0):
        counters, _ = _add(counters, backend, [gradient], samples=2, plan=plan)
    assert float(_numpy(counters.acc_grad_sq)) == 0.0
    closed, _ = _close(counters, backend, noise_every=2)
    assert math.isnan(float(_numpy(closed.log.trace[1])))


def test_a_one_micro_batch_window_has_no_noise_estimate():
    trace, grad_sq = _window.noise_statistics(
        _counters(mini_step=1, acc_normalizer=4.0, acc_samples=4.0), 1.0
    )
    assert math.isnan(float(_numpy(trace)))
    assert math.isnan(float(_numpy(grad_sq)))


def test_a_carried_window_keeps_its_micro_batches_across_epochs():
    # "carry": the epoch's last step does not close the window; the next
    # epoch's micro-batches continue it.
    backend = _Recording([[0.0]])
    counters = _counters(steps_per_epoch=2)
    plan = Plan(close_at_epoch_end=False)
    for _ in range(2):
        counters, complete = _add(counters, backend, [1.0], 1, plan=plan)
    assert not bool(complete)
    counters = counters._replace(epoch_step=ops.zeros((), "int32"))
    for _ in range(2):
        counters, complete = _add(counters, backend, [1.0], 1, plan=plan)
    assert bool(complete)
    assert int(_numpy(counters.mini_step)) == 4


def test_the_rings_wrap_around():
    backend = _Recording([[0.0]])
    capacity = _window.LOG_CAPACITY
    counters = _counters(
        window_length=1, target_length=1, log_count=capacity + 2
    )
    counters, _ = _add(counters, backend, [1.0], samples=3)
    closed, _ = _close(counters, backend)
    assert int(_numpy(closed.log.samples[2])) == 3
    assert int(_numpy(closed.log.count)) == capacity + 3


@pytest.mark.parametrize(
    "found, outputs, entries, maskable, kind",
    [
        ([], 1, None, True, "samples"),  # A custom `compute_loss`.
        (["sum"], 1, 5, False, "zero"),
        (["sum_over_batch_size", "sum"], 2, None, True, "samples"),
        (
            ["sum_over_batch_size", "sum_over_batch_size"],
            2,
            1,
            False,
            "samples",
        ),
        (["mean_with_sample_weight"], 1, 1, False, "weights"),
        (["mean_with_sample_weight"], 2, 1, False, "samples"),
        (["sum_over_batch_size"], 1, 7, False, "entries"),
        (["sum_over_batch_size"], 1, 7, True, "counted"),
        (["sum_over_batch_size"], None, None, False, "counted"),
    ],
)
def test_the_loss_rule(found, outputs, entries, maskable, kind):
    rule = normalizers.rule(found, outputs, entries, maskable)
    assert rule.kind == kind


def test_the_normalizer_of_each_rule():
    y_pred = ops.zeros((3, 5, 2))  # 3 samples, 5 entries each.
    assert normalizers.normalizer("zero", y_pred, None, 3) is None
    assert normalizers.normalizer("samples", y_pred, None, 3) == 3
    assert normalizers.normalizer("entries", y_pred, None, 3) == 15
    weights = ops.convert_to_tensor([0.5, -1.0, 2.0])
    total = normalizers.normalizer("weights", ops.zeros((3, 2)), weights, 3)
    np.testing.assert_allclose(_numpy(total), 1.5)


def test_a_state_reads_and_writes_its_counters():
    state = _window.WindowState([keras.Variable(np.zeros((2, 3)))], 4)
    read = state.read()
    assert int(_numpy(read.window_length)) == 4
    changed = read._replace(mini_step=ops.convert_to_tensor(3, "int32"))
    state.write(changed, read)
    assert int(_numpy(state.counters.mini_step.value)) == 3
    accumulators, counters = state.unpack([v.value for v in state.variables])
    assert len(accumulators) == 1 and tuple(accumulators[0].shape) == (2, 3)
    assert len(state.pack(accumulators, counters)) == len(state.variables)
    assert {v.dtype for v in state.counters[4:11]} == {"int32"}
    assert state.counters.log.count.dtype == "int32"
    assert state.counters.auto.trace.dtype == "float32"


# Every value finite, yet their sum overflows float32 (max 3.4e38).
_OVERFLOWING = [[2e38, 2e38], [1.0, 2e38]]


@pytest.mark.parametrize(
    "values, sums, every",
    [
        ([[1.0, 2.0], [3.0]], True, True),
        (_OVERFLOWING, False, True),
        ([[1.0, NAN], [3.0]], False, False),
        ([[1.0], [math.inf, -math.inf]], False, False),
        ([[1.0], [-math.inf]], False, False),
    ],
)
def test_a_finite_sum_means_every_value_is_finite(values, sums, every):
    tensors = [ops.convert_to_tensor(v, "float32") for v in values]
    assert bool(_window.sums_finite(tensors)) is sums
    assert bool(_window.all_finite(tensors)) is every


def _backend_ops(accumulators):
    """The backend's own `WindowOps` over `accumulators`."""
    weights = [
        keras.Variable(np.zeros(len(a), "float32")) for a in accumulators
    ]
    backend = keras.backend.backend()
    if backend == "jax":
        from keras_accum._jax_ops import JaxOps

        values = [ops.convert_to_tensor(a, "float32") for a in accumulators]
        return JaxOps(values, None, [w.value for w in weights], [])
    state = _window.WindowState(weights, 1)
    for acc, values in zip(state.acc_grads, accumulators, strict=True):
        acc.assign(np.asarray(values, "float32"))
    if backend == "tensorflow":
        from keras_accum._tf_window import TensorFlowOps

        return TensorFlowOps(state, None, weights, [False] * len(weights))
    from keras_accum._torch_trainer import TorchOps

    return TorchOps(state, None, weights, [False] * len(weights))


@pytest.mark.parametrize(
    "values, finite",
    [
        (_OVERFLOWING, True),
        ([[1.0, NAN], [3.0]], False),
        ([[1.0], [math.inf]], False),
    ],
)
def test_the_backend_finds_a_window_finite_exactly(values, finite):
    # Each backend first tests the sums, then each value where a sum is
    # not finite: a window whose sum merely overflows is still applied (a
    # test of the sums alone would drop it).
    backend = _backend_ops(values)
    assert bool(backend.all_finite()) is finite
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        assert bool(tf.function(backend.all_finite)()) is finite
    if keras.backend.backend() == "jax":
        import jax

        # Traced with a closing flag, as the step runs it.
        check = jax.jit(lambda closing: backend.all_finite(closing))
        assert bool(check(True)) is finite
        assert bool(check(False))  # Not closing: the pass is skipped.


def test_every_counter_is_declared_once_in_the_field_table():
    # `Counters` and `_window_fields.FIELDS` name the same fields in the
    # same order: the table is where dtype, shape, replicas, resets and
    # saving are read from.
    names = tuple(field.name for field in _window_fields.FIELDS)
    assert Counters.from_flat(names).flat() == names
    assert len(set(names)) == len(names)
    # Each field sits where its group says, under its own name: the
    # nested groups (`counters.log.loss`) and `Counters.get("log_loss")`
    # agree with the table.
    counters = Counters.from_flat(names)
    for field in _window_fields.FIELDS:
        holder = (
            counters if field.group is None else getattr(counters, field.group)
        )
        assert (
            getattr(holder, field.attr)
            == field.name
            == counters.get(field.name)
        )
    assert _window_fields.GROUPS == ("log", "auto")
    with pytest.raises(ValueError, match="Expected 25 counter values, got 2"):
        Counters.from_flat([0, 1])
    assert _window_fields.TOTALS == (
        "acc_normalizer",
        "acc_loss",
        "acc_samples",
        "acc_grad_sq",
    )
    assert _window_fields.RESETS == (*_window_fields.TOTALS, "mini_step")
    for field in _window_fields.FIELDS:
        assert field.dtype in ("float32", "int32")
        # What no code path could save: a ring, or a range on a float
        # without a finiteness rule.
        assert not (field.saved and field.ring), field
