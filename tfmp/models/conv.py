"""tfmp's Conv2D: Keras' layer whose weight gradient is an im2col matmul where that measured faster.

TensorFlow computes a convolution's weight gradient with `Conv2DBackpropFilter` (oneDNN's
backward-weights kernel). In bf16, for small feature maps with many channels — ResNet-18's last
two stages on 32x32 images — the same gradient as one matmul over the input's patches (im2col:
the nine shifted copies of a 3x3 neighbourhood side by side on the channel axis) measured faster:
1.19x at 8x8x256 and 1.54x at 4x4x512 on a Zen 4 with AVX512_BF16, 3.2x at 4x4x512 on an AMX
Xeon, and slower for every float32 shape and every larger feature map
(`experiments/benchmarks/weight_gradient_im2col.py`, BUILD_NOTES "Performance, round two").
`im2col_pays` is that measured rule; everywhere else the layer is Keras' Conv2D unchanged.

It is off by default (`weight_gradient = "tf"`): on the whole ResNet-18 bf16 step it measured
1.04x faster but raised the step's peak tensor memory by 48% and peak RSS by 38% at batch 256
(the patch matrices are nine times the input), and halved activation memory is what mixed
precision is for. `python -m tfmp.bench --conv_weight_gradient=im2col` measures it.

The forward pass and the input gradient are TensorFlow's own kernels; only the kernel's gradient
changes, and it is the same sum in a different order (the matmul accumulates in float32 inside
oneDNN and rounds to bf16 once, as the convolution kernel does). Pad, slice, concat and matmul
all compile under XLA. Saved encoders hold Keras' Conv2D (`tfmp.models.export.portable`).
"""

from __future__ import annotations

import keras
import tensorflow as tf

# Which weight gradient to use: "tf" (TensorFlow's kernel everywhere: the default, see above), or
# "im2col" (the im2col matmul where `im2col_pays`).
weight_gradient = "tf"


def im2col_pays(input_shape, kernel_size, strides, dtype) -> bool:
    """With `weight_gradient = "im2col"`, the measured rule: bf16, 3x3 stride 1, a feature map of at most
    8x8 with at least 256 channels."""
    height, width, channels = input_shape[1], input_shape[2], input_shape[3]
    return (weight_gradient == "im2col" and dtype == tf.bfloat16 and tuple(kernel_size) == (3, 3) and tuple(strides) == (1, 1)
            and None not in (height, width, channels) and height * width <= 64 and channels >= 256)


def shifted_patches(inputs: tf.Tensor, kernel_height: int, kernel_width: int) -> tf.Tensor:
    """im2col for "same" padding and stride 1: [N, H, W, kh*kw*C], channels ordered (row, column, channel)
    like a [kh, kw, C, F] kernel flattened."""
    top, left = (kernel_height - 1) // 2, (kernel_width - 1) // 2
    padded = tf.pad(inputs, [[0, 0], [top, kernel_height - 1 - top], [left, kernel_width - 1 - left], [0, 0]])
    height, width = inputs.shape[1], inputs.shape[2]
    return tf.concat([padded[:, row:row + height, column:column + width, :]
                      for row in range(kernel_height) for column in range(kernel_width)], axis=-1)


@tf.custom_gradient
def conv2d_with_im2col_weight_gradient(inputs, kernel):
    """`tf.nn.conv2d(inputs, kernel, 1, "SAME")` whose kernel gradient is one matmul over the patches."""
    outputs = tf.nn.conv2d(inputs, kernel, strides=1, padding="SAME")

    def gradient(upstream):
        input_gradient = tf.raw_ops.Conv2DBackpropInput(input_sizes=tf.shape(inputs), filter=kernel, out_backprop=upstream,
                                                        strides=[1, 1, 1, 1], padding="SAME")
        kernel_height, kernel_width, in_channels, filters = kernel.shape
        patches = tf.reshape(shifted_patches(inputs, kernel_height, kernel_width), [-1, kernel_height * kernel_width * in_channels])
        kernel_gradient = tf.matmul(patches, tf.reshape(upstream, [-1, filters]), transpose_a=True)
        return input_gradient, tf.reshape(kernel_gradient, kernel.shape)

    return outputs, gradient


@keras.saving.register_keras_serializable(package="tfmp")
class Conv2D(keras.layers.Conv2D):
    """Keras' Conv2D (same arguments, variables and config) with the im2col weight gradient where
    `im2col_pays` for the input it is called on; channels-last, "same" padding, no dilation or groups."""

    def convolution_op(self, inputs, kernel):
        simple = (self.padding == "same" and self.data_format == "channels_last" and tuple(self.dilation_rate) == (1, 1)
                  and self.groups == 1)
        if simple and im2col_pays(inputs.shape, self.kernel_size, self.strides, inputs.dtype):
            return conv2d_with_im2col_weight_gradient(inputs, tf.convert_to_tensor(kernel))
        return super().convolution_op(inputs, kernel)
