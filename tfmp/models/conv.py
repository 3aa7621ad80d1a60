"""tfmp's Conv2D: Keras' layer whose weight gradient can be one matmul per kernel tap.

In bf16, for small feature maps with many channels (ResNet-18's last two stages on 32x32
images), the kernel gradient as matmuls — for each tap of a 3x3 kernel, the input shifted by
that tap, flattened to [N*H*W, C] and transposed, times the upstream gradient [N*H*W, F] —
measured faster than TensorFlow's `Conv2DBackpropFilter` on CPUs with bf16 units, and slower
everywhere else (BUILD_NOTES.md, "Performance, round two"). `tap_matmul_pays` is that rule.

The mode is the layer's `conv_weight_gradient` argument (kept in its config): `auto` takes the
tap matmuls where the rule holds on a CPU with bf16 units, `tf` never, `tap_matmul` wherever the
rule holds. The forward pass and the input gradient are TensorFlow's own kernels; pad, slice
and matmul compile under XLA. Saved encoders hold Keras' Conv2D (`tfmp.models.export.portable`).
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf

from tfmp import hardware
from tfmp.config import CONV_WEIGHT_GRADIENTS

RULE = "bf16 3x3 stride-1 layers on <= 8x8 maps with >= 256 channels"  # what `tap_matmul_pays` checks, for logs


def tap_matmul_pays(input_shape, kernel_size, strides, dtype) -> bool:
    """The measured rule (`RULE`): bf16, 3x3 stride 1, a feature map of at most 8x8 with at least 256 channels."""
    height, width, channels = input_shape[1], input_shape[2], input_shape[3]
    return (dtype == tf.bfloat16 and tuple(kernel_size) == (3, 3) and tuple(strides) == (1, 1)
            and None not in (height, width, channels) and height * width <= 64 and channels >= 256)


@functools.cache
def _runs_on_a_cpu_with_bf16_units() -> bool:
    """No GPU or TPU for Keras to place the step on, and a CPU that computes bf16 natively."""
    accelerators = tf.config.list_logical_devices("GPU") + tf.config.list_logical_devices("TPU")
    return not accelerators and hardware.cpu_has_bf16_units()


def check_mode(conv_weight_gradient: str) -> None:
    if conv_weight_gradient not in CONV_WEIGHT_GRADIENTS:
        raise ValueError(f"unknown conv_weight_gradient {conv_weight_gradient!r}; valid: {', '.join(CONV_WEIGHT_GRADIENTS)}")


def use_tap_matmul(conv_weight_gradient: str, input_shape, kernel_size, strides, dtype) -> bool:
    """Whether a layer in mode `conv_weight_gradient` called on this input takes the tap matmuls."""
    check_mode(conv_weight_gradient)
    if conv_weight_gradient == "tf" or not tap_matmul_pays(input_shape, kernel_size, strides, dtype):
        return False
    return conv_weight_gradient == "tap_matmul" or _runs_on_a_cpu_with_bf16_units()


def describe_weight_gradient(conv_weight_gradient: str) -> str:
    """One line for the run's log: what the mode means on this machine."""
    if conv_weight_gradient == "tf":
        return "tf (TensorFlow's kernel everywhere, as asked)"
    if conv_weight_gradient == "tap_matmul":
        return f"tap_matmul ({RULE}, as asked)"
    if _runs_on_a_cpu_with_bf16_units():
        return f"auto: tap matmuls for {RULE} (measured faster on CPUs with bf16 units)"
    return "auto: TensorFlow's kernel (a GPU/TPU is visible or the CPU has no bf16 units)"


def tap_matmul_kernel_gradient(inputs: tf.Tensor, upstream: tf.Tensor, kernel_shape) -> tf.Tensor:
    """A stride-1 "same" convolution's kernel gradient as one matmul per kernel tap: tap (row, column) is
    the input shifted by that tap, flattened to [N*H*W, C], transposed times the upstream gradient
    [N*H*W, F]. The same sum as one matmul over the im2col patch matrix, without that matrix (nine times
    the input)."""
    kernel_height, kernel_width, in_channels, filters = kernel_shape
    top, left = (kernel_height - 1) // 2, (kernel_width - 1) // 2
    # The shifted copies depend only on the forward input, so a graph executor may make them all at the
    # start of the backward pass, for every such layer at once, several times the step's peak. Each copy is
    # made once the previous tap's matmul is done (the first once `upstream` exists): one alive at a time.
    with tf.control_dependencies([upstream]):
        padded = tf.pad(inputs, [[0, 0], [top, kernel_height - 1 - top], [left, kernel_width - 1 - left], [0, 0]])
    height, width = inputs.shape[1], inputs.shape[2]
    flat_upstream = tf.reshape(upstream, [-1, filters])
    taps = []
    for row in range(kernel_height):
        for column in range(kernel_width):
            with tf.control_dependencies(taps[-1:]):
                shifted = tf.reshape(padded[:, row:row + height, column:column + width, :], [-1, in_channels])
            taps.append(tf.matmul(shifted, flat_upstream, transpose_a=True))
    return tf.reshape(tf.stack(taps), kernel_shape)


@tf.custom_gradient
def conv2d_with_tap_matmul_weight_gradient(inputs, kernel):
    """`tf.nn.conv2d(inputs, kernel, 1, "SAME")` whose kernel gradient is one matmul per kernel tap."""
    outputs = tf.nn.conv2d(inputs, kernel, strides=1, padding="SAME")

    def gradient(upstream):
        input_gradient = tf.raw_ops.Conv2DBackpropInput(input_sizes=tf.shape(inputs), filter=kernel, out_backprop=upstream,
                                                        strides=[1, 1, 1, 1], padding="SAME")
        return input_gradient, tap_matmul_kernel_gradient(inputs, upstream, kernel.shape)

    return outputs, gradient


@keras.saving.register_keras_serializable(package="tfmp")
class Conv2D(keras.layers.Conv2D):
    """Keras' Conv2D (same arguments and variables) with the tap-matmul weight gradient where
    `use_tap_matmul` holds for the input it is called on; channels-last, "same" padding, no dilation or groups.

    Args:
        conv_weight_gradient: `auto`, `tf` or `tap_matmul` (see the module docstring).
        **kwargs: `keras.layers.Conv2D`'s arguments.
    """

    tap_matmul_weight_gradient = False  # set when traced: whether this layer took the tap matmuls

    def __init__(self, *args, conv_weight_gradient: str = "auto", **kwargs):
        check_mode(conv_weight_gradient)
        super().__init__(*args, **kwargs)
        self.conv_weight_gradient = conv_weight_gradient

    def get_config(self):
        return {**super().get_config(), "conv_weight_gradient": self.conv_weight_gradient}

    def convolution_op(self, inputs, kernel):
        simple = (self.padding == "same" and self.data_format == "channels_last" and tuple(self.dilation_rate) == (1, 1)
                  and self.groups == 1)
        self.tap_matmul_weight_gradient = simple and use_tap_matmul(self.conv_weight_gradient, inputs.shape, self.kernel_size,
                                                                    self.strides, inputs.dtype)
        if self.tap_matmul_weight_gradient:
            return conv2d_with_tap_matmul_weight_gradient(inputs, tf.convert_to_tensor(kernel))
        return super().convolution_op(inputs, kernel)
