"""tfmp's Conv2D (tfmp.models.conv): Keras' layer with an im2col weight gradient where measured faster."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp import precision
from tfmp.models import conv


def _relative_error(value, reference):
    value, reference = tf.cast(value, tf.float32), tf.cast(reference, tf.float32)
    return float(tf.norm(value - reference) / tf.norm(reference))


def test_the_im2col_gradients_are_tensorflows_within_bf16_rounding():
    inputs32 = tf.random.stateless_normal((8, 4, 4, 256), seed=(1, 2))
    kernel32 = tf.random.stateless_normal((3, 3, 256, 64), seed=(3, 4)) * 0.05
    upstream32 = tf.random.stateless_normal((8, 4, 4, 64), seed=(5, 6))

    def gradients(function, dtype):
        inputs, kernel = tf.cast(inputs32, dtype), tf.cast(kernel32, dtype)
        with tf.GradientTape() as tape:
            tape.watch([inputs, kernel])
            outputs = function(inputs, kernel)
        return (outputs, *tape.gradient(outputs, [inputs, kernel], output_gradients=tf.cast(upstream32, dtype)))

    def tensorflow_conv(inputs, kernel):
        return tf.nn.conv2d(inputs, kernel, 1, "SAME")

    reference = gradients(tensorflow_conv, tf.float32)
    tensorflow_bf16 = gradients(tensorflow_conv, tf.bfloat16)
    im2col_bf16 = gradients(conv.conv2d_with_im2col_weight_gradient, tf.bfloat16)
    im2col_float32 = gradients(conv.conv2d_with_im2col_weight_gradient, tf.float32)
    # Forward pass and input gradient are TensorFlow's own kernels: identical.
    for mine, theirs in zip(im2col_bf16[:2], tensorflow_bf16[:2]):
        np.testing.assert_array_equal(tf.cast(mine, tf.float32), tf.cast(theirs, tf.float32))
    # The kernel gradient: exact in float32 up to summation order; in bf16 as close to float32 as TF's own.
    assert _relative_error(im2col_float32[2], reference[2]) < 1e-5
    assert _relative_error(im2col_bf16[2], reference[2]) < max(2 * _relative_error(tensorflow_bf16[2], reference[2]), 1e-2)


@pytest.mark.parametrize("shape, kernel_size, strides, dtype, expected", [
    ((128, 8, 8, 256), (3, 3), (1, 1), tf.bfloat16, True),    # ResNet-18 stage 3: measured 1.19x faster
    ((128, 4, 4, 512), (3, 3), (1, 1), tf.bfloat16, True),    # stage 4: 1.54x
    ((128, 8, 8, 256), (3, 3), (1, 1), tf.float32, False),    # float32: TF's kernel faster at every shape
    ((128, 16, 16, 128), (3, 3), (1, 1), tf.bfloat16, False),  # stage 2: TF's kernel 1.47x faster
    ((256, 8, 8, 64), (3, 3), (1, 1), tf.bfloat16, False),     # the small CNN's widest layer
    ((128, 8, 8, 256), (3, 3), (2, 2), tf.bfloat16, False),    # strided: not measured
    ((128, 8, 8, 256), (1, 1), (1, 1), tf.bfloat16, False),    # 1x1 shortcut: not measured
])
def test_the_im2col_path_is_taken_only_where_it_measured_faster(shape, kernel_size, strides, dtype, expected, monkeypatch):
    monkeypatch.setattr(conv, "weight_gradient", "im2col")
    assert conv.im2col_pays(shape, kernel_size, strides, dtype) is expected


def test_by_default_every_shape_keeps_tensorflows_kernel():
    """Off by default: 1.04x faster on the bf16 ResNet-18 step but 48% more peak tensor memory (BUILD_NOTES)."""
    assert conv.weight_gradient == "tf"
    assert not conv.im2col_pays((128, 4, 4, 512), (3, 3), (1, 1), tf.bfloat16)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_bf16_training_step_with_the_layer_takes_the_im2col_path_and_compiles_under_xla(monkeypatch, jit_compile):
    calls = []
    original = conv.conv2d_with_im2col_weight_gradient
    monkeypatch.setattr(conv, "conv2d_with_im2col_weight_gradient", lambda *args: calls.append(args[0].shape) or original(*args))
    monkeypatch.setattr(conv, "weight_gradient", "im2col")
    precision.set_policy("mixed_bfloat16")
    try:
        keras.utils.set_random_seed(0)
        layer = conv.Conv2D(16, 3, padding="same", use_bias=False)
        model = keras.Sequential([keras.Input((4, 4, 256)), layer, keras.layers.GlobalAveragePooling2D(),
                                  keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit_compile)
        before = layer.kernel.numpy().copy()
        images = np.random.default_rng(0).normal(size=(8, 4, 4, 256)).astype(np.float32)
        history = model.fit(images, np.ones((8, 1), np.float32), epochs=1, batch_size=8, verbose=0)
    finally:
        precision.set_policy("float32")
    assert calls  # traced through the im2col path
    assert np.isfinite(history.history["loss"][0])
    assert not np.array_equal(before, layer.kernel.numpy())  # the kernel gradient reached the optimizer
