"""A convolution's weight gradient four ways, per shape: TF's kernel against im2col and tap matmuls.

    python experiments/benchmarks/weight_gradient_per_shape.py

For each 3x3, stride-1, SAME convolution of the small CNN (digits, batch 128 x 2 views) and of
ResNet-18's four stages (batch 64 x 2 views), in float32 and bf16: `Conv2DBackpropFilter` (what
TF's gradient runs), im2col by `tf.image.extract_patches` + matmul, im2col by nine shifted
slices concatenated on channels + matmul, and nine matmuls (one per kernel tap over its shifted
slice, no 9x patch matrix: what `tfmp.models.conv` builds). Median ms of 30 calls after 3
warm-up calls, and each result's relative error against TF's. The tables in BUILD_NOTES.md
("Performance, round two") came from this script; `tfmp.models.conv.tap_matmul_pays` is read off them.
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

METHODS = ("tf", "extract_patches", "shifted_slices", "nine_matmuls")
SHAPES = [((256, 8, 8, 1), 32), ((256, 8, 8, 32), 64), ((256, 8, 8, 64), 128), ((128, 32, 32, 64), 64),
          ((128, 16, 16, 128), 128), ((128, 8, 8, 256), 256), ((128, 4, 4, 512), 512)]


def main() -> None:
    import tensorflow as tf

    def shifted_patches(inputs, size):
        """im2col for SAME padding, stride 1: size*size shifted copies, channels in (row, column, channel) order."""
        pad = size // 2
        padded = tf.pad(inputs, [[0, 0], [pad, size - 1 - pad], [pad, size - 1 - pad], [0, 0]])
        height, width = inputs.shape[1], inputs.shape[2]
        return tf.concat([padded[:, i:i + height, j:j + width, :] for i in range(size) for j in range(size)], axis=-1)

    def nine_matmuls(inputs, gradient):
        """The same gradient without the 9x patch matrix: one matmul per kernel tap over its shifted slice."""
        height, width, in_channels, out_channels = inputs.shape[1], inputs.shape[2], inputs.shape[3], gradient.shape[3]
        padded = tf.pad(inputs, [[0, 0], [1, 1], [1, 1], [0, 0]])
        flat_gradient = tf.reshape(gradient, [-1, out_channels])
        taps = [tf.matmul(tf.reshape(padded[:, i:i + height, j:j + width, :], [-1, in_channels]), flat_gradient, transpose_a=True)
                for i in range(3) for j in range(3)]
        return tf.reshape(tf.stack(taps), [3, 3, in_channels, out_channels])

    def measure(shape, out_channels, dtype, method, repeats=30):
        inputs = tf.cast(tf.random.normal(shape), dtype)
        gradient = tf.cast(tf.random.normal(shape[:3] + (out_channels,)), dtype)
        in_channels = shape[-1]

        def as_kernel(patches):
            product = tf.matmul(tf.reshape(patches, [-1, 9 * in_channels]), tf.reshape(gradient, [-1, out_channels]), transpose_a=True)
            return tf.reshape(product, [3, 3, in_channels, out_channels])

        functions = {
            "tf": tf.function(lambda: tf.raw_ops.Conv2DBackpropFilter(
                input=inputs, filter_sizes=[3, 3, in_channels, out_channels], out_backprop=gradient, strides=[1, 1, 1, 1],
                padding="SAME")),
            "extract_patches": tf.function(lambda: as_kernel(tf.image.extract_patches(inputs, [1, 3, 3, 1], [1, 1, 1, 1],
                                                                                      [1, 1, 1, 1], "SAME"))),
            "shifted_slices": tf.function(lambda: as_kernel(shifted_patches(inputs, 3))),
            "nine_matmuls": tf.function(lambda: nine_matmuls(inputs, gradient)),
        }
        function = functions[method]
        for _ in range(3):
            function()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            function().numpy()
            times.append(time.perf_counter() - start)
        reference = tf.cast(functions["tf"](), tf.float32)
        error = float(tf.norm(tf.cast(function(), tf.float32) - reference) / tf.norm(reference))
        return 1000 * statistics.median(times), error

    for shape, out_channels in SHAPES:
        for dtype in (tf.float32, tf.bfloat16):
            cells = {method: measure(shape, out_channels, dtype, method) for method in METHODS}
            print(shape, "->", out_channels, dtype.name,
                  " ".join(f"{method}={ms:.2f}ms (error {error:.4f})" for method, (ms, error) in cells.items()), flush=True)


if __name__ == "__main__":
    main()
