"""The fused optimizers update weights exactly as Keras's SGD and Adam do."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from bigmem.train.optimizers import FusedAdam, FusedSGD

CASES = {
    "sgd-nesterov": (lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
                     lambda: FusedSGD(0.1, momentum=0.9, nesterov=True)),
    "sgd-momentum": (lambda: keras.optimizers.SGD(0.1, momentum=0.5),
                     lambda: FusedSGD(0.1, momentum=0.5)),
    "sgd-plain": (lambda: keras.optimizers.SGD(0.1), lambda: FusedSGD(0.1)),
    "adam": (lambda: keras.optimizers.Adam(1e-2), lambda: FusedAdam(1e-2)),
    "adam-amsgrad": (lambda: keras.optimizers.Adam(1e-2, amsgrad=True), lambda: FusedAdam(1e-2, amsgrad=True)),
}


def _train(make_optimizer, graph: bool):
    rng = np.random.default_rng(0)
    variables = [keras.Variable(rng.normal(size=shape).astype(np.float32)) for shape in ((3, 3, 3, 2, 4), (4,))]
    grads = [[tf.constant(rng.normal(size=v.shape).astype(np.float32)) for v in variables] for _ in range(4)]
    optimizer = make_optimizer()
    optimizer.build(variables)
    def apply(step_grads):
        optimizer.apply(step_grads, variables)
    apply = tf.function(apply) if graph else apply
    for step_grads in grads:
        apply(step_grads)
    return [np.asarray(v) for v in variables], [np.asarray(v) for v in optimizer.variables]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_update_equals_keras(case, graph):
    make_keras, make_fused = CASES[case]
    (want_weights, want_slots), (got_weights, got_slots) = _train(make_keras, graph), _train(make_fused, graph)
    assert len(got_slots) == len(want_slots)
    for got, want in zip(got_weights + got_slots, want_weights + want_slots):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The weights moved: four steps of a non-zero gradient.
    assert not np.allclose(got_weights[0], _train(lambda: FusedSGD(0.0), graph)[0][0])


def test_config_round_trip_keeps_class():
    optimizer = FusedSGD(0.1, momentum=0.9, nesterov=True)
    again = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert type(again) is FusedSGD
    assert again.get_config() == optimizer.get_config()


def _one_step(optimizer, weights, gradient):
    variable = keras.Variable(np.asarray(weights, np.float32))
    optimizer.build([variable])
    optimizer.apply([tf.constant(np.asarray(gradient, np.float32))], [variable])
    return np.asarray(variable)


@pytest.mark.parametrize("make", [lambda l2: FusedSGD(0.1, momentum=0.9, nesterov=True, l2=l2),
                                  lambda l2: FusedAdam(1e-2, l2=l2)], ids=["sgd", "adam"])
def test_l2_is_added_to_the_gradient_as_torch_applies_weight_decay(make):
    weights, gradient, l2 = [1.0, -2.0, 3.0], [0.5, 0.25, -1.0], 0.1
    coupled = _one_step(make(l2), weights, gradient)
    by_hand = _one_step(make(0.0), weights, np.add(gradient, l2 * np.asarray(weights)))
    np.testing.assert_allclose(coupled, by_hand, rtol=1e-6)


def test_global_clipnorm_scales_the_gradient_down_to_the_norm():
    clipped = _one_step(FusedSGD(1.0, global_clipnorm=1.0), [0.0, 0.0], [3.0, 4.0])
    np.testing.assert_allclose(clipped, [-0.6, -0.8], rtol=1e-6)


def test_l2_survives_the_optimizers_config():
    assert FusedSGD.from_config(FusedSGD(0.1, momentum=0.99, l2=3e-5).get_config()).l2 == 3e-5
