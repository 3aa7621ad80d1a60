"""tfmp's fused BatchNormalization: Keras' layer, same numbers, but 16-bit inputs stay 16-bit."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp import models, precision
from tfmp.models.layers import BatchNormalization

SHAPE = (8, 5, 5, 16)


def _inputs():
    return tf.constant(np.random.default_rng(0).normal(2.0, 3.0, SHAPE).astype(np.float32))


def _train_step(layer, inputs):
    """One training call: outputs and gradients of a fixed random projection w.r.t. input, gamma, beta."""
    projection = tf.constant(np.random.default_rng(1).normal(size=SHAPE).astype(np.float32))
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        outputs = layer(inputs, training=True)
        loss = tf.reduce_sum(tf.cast(outputs, tf.float32) * projection)
    return outputs, tape.gradient(loss, [inputs, layer.gamma, layer.beta])


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_matches_keras_batch_normalization(policy):
    precision.set_policy(policy)
    reference = keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-5)
    fused = BatchNormalization(momentum=0.9, epsilon=1e-5)
    inputs = _inputs()
    expected, expected_gradients = _train_step(reference, inputs)
    actual, actual_gradients = _train_step(fused, inputs)
    assert fused.uses_fused_kernel
    assert actual.dtype == expected.dtype == keras.mixed_precision.global_policy().compute_dtype
    tolerance = 1e-5 if policy == "float32" else 2e-2
    np.testing.assert_allclose(tf.cast(actual, tf.float32), tf.cast(expected, tf.float32), atol=tolerance * 4)
    # Moving statistics use the biased batch variance, as in Keras (the kernel returns the unbiased one).
    np.testing.assert_allclose(fused.moving_mean.numpy(), reference.moving_mean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fused.moving_variance.numpy(), reference.moving_variance.numpy(), rtol=1e-5)
    for got, want in zip(actual_gradients, expected_gradients):
        want = tf.cast(want, tf.float32)
        np.testing.assert_allclose(tf.cast(got, tf.float32), want, atol=tolerance * float(tf.reduce_max(tf.abs(want))))
    np.testing.assert_allclose(tf.cast(fused(inputs, training=False), tf.float32),
                               tf.cast(reference(inputs, training=False), tf.float32), atol=tolerance * 4)


def test_16_bit_input_is_normalised_without_a_float32_copy():
    """The kernel consumes the bf16 input itself: no Cast to float32 of the activation in the graph."""
    precision.set_policy("mixed_bfloat16")
    layer = BatchNormalization()
    inputs = tf.cast(_inputs(), tf.bfloat16)
    layer.build(inputs.shape)
    graph = tf.function(lambda x: layer(x, training=True)).get_concrete_function(inputs).graph
    casts_of_activations = [op for op in graph.get_operations()
                            if op.type == "Cast" and op.outputs[0].dtype == tf.float32 and op.outputs[0].shape.rank == 4]
    assert casts_of_activations == []
    assert any(op.type == "FusedBatchNormV3" for op in graph.get_operations())


def test_frozen_layer_uses_moving_statistics_and_does_not_update_them():
    layer = BatchNormalization()
    inputs = _inputs()
    layer.build(inputs.shape)
    layer.trainable = False
    before = layer.moving_mean.numpy().copy()
    outputs = layer(inputs, training=True)
    np.testing.assert_array_equal(layer.moving_mean.numpy(), before)
    np.testing.assert_allclose(outputs, inputs / np.sqrt(1.0 + 1e-3), rtol=1e-5)  # moving mean 0, variance 1


def test_other_cases_take_keras_path_and_still_agree():
    """2-D inputs (the projection head) and renorm are Keras' own code."""
    flat = BatchNormalization()
    flat.build((4, 16))
    assert not flat.uses_fused_kernel
    rows = tf.random.normal((4, 16))
    np.testing.assert_allclose(flat(rows, training=True), keras.layers.BatchNormalization()(rows, training=True), rtol=1e-6, atol=1e-6)
    renorm = BatchNormalization(renorm=True)
    renorm.build(SHAPE)
    assert not renorm.uses_fused_kernel
    reference = keras.layers.BatchNormalization(renorm=True)
    inputs = _inputs()
    np.testing.assert_allclose(renorm(inputs, training=True), reference(inputs, training=True), rtol=1e-5, atol=1e-5)


def test_synchronized_layer_is_fused_only_on_one_replica():
    one = BatchNormalization(synchronized=True)
    one.build(SHAPE)
    assert one.uses_fused_kernel
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        two = BatchNormalization(synchronized=True)
        two.build(SHAPE)
        assert not two.uses_fused_kernel


def test_serialises_as_a_tfmp_layer():
    layer = BatchNormalization(momentum=0.8, name="bn")
    layer.build(SHAPE)
    clone = keras.layers.deserialize(keras.layers.serialize(layer))
    assert type(clone) is BatchNormalization and clone.momentum == 0.8 and clone.fused
    assert not keras.layers.deserialize(keras.layers.serialize(BatchNormalization(fused=False))).fused


def test_unfused_layer_is_exactly_keras():
    layer = BatchNormalization(fused=False)
    reference = keras.layers.BatchNormalization()
    inputs = _inputs()
    layer.build(inputs.shape)
    assert not layer.uses_fused_kernel
    np.testing.assert_array_equal(layer(inputs, training=True), reference(inputs, training=True))
    np.testing.assert_array_equal(layer.moving_variance.numpy(), reference.moving_variance.numpy())


def test_unsynchronized_batch_norm_keeps_one_moving_statistic_on_every_replica(tmp_path):
    """Normalised with each replica's own batch, but the moving statistics are averaged over the replicas: without
    that they drifted apart (0.07 after two steps) and tfmp's replica check stopped a library `fit()` at step 2."""
    from tfmp import callbacks, distribute

    strategy = distribute.get_strategy("mirrored")
    rng = np.random.default_rng(0)
    images, labels = rng.normal(size=(64, 8, 8, 1)).astype(np.float32), np.arange(64) % 10
    with strategy.scope():
        model = models.build_classifier(models.build_encoder("small_cnn", (8, 8, 1), models.NormSettings()), 10)
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(images, labels, batch_size=32, epochs=2, verbose=0, callbacks=callbacks.default_callbacks(str(tmp_path / "run")))
    moving = [variable for variable in model.weights if "moving" in variable.path]
    assert moving
    for variable in moving:
        first, second = strategy.experimental_local_results(variable.value)
        np.testing.assert_array_equal(first.numpy(), second.numpy(), err_msg=variable.path)
        assert not np.allclose(first.numpy(), 0.0 if "mean" in variable.path else 1.0)  # they did move
