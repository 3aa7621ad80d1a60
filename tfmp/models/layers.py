"""Building blocks shared by tfmp's encoders, and tfmp's BatchNormalization.

Keras' BatchNormalization casts a bf16/fp16 input up to float32, normalises and casts back,
so the backward pass keeps a float32 copy of every BatchNorm input. tfmp's `BatchNormalization`
is the same layer (variables, arguments, serialisation, moving-statistics update) whose NHWC
4-D case runs TensorFlow's fused kernel on the 16-bit input directly, as PyTorch and tf.keras 2's
`fused=True` do; every other case is Keras' own code path. What that saves is measured in
BUILD_NOTES.md ("Performance").
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from tfmp import keras_internals
from tfmp.models.conv import Conv2D
from tfmp.models.remat import is_recomputing

@dataclasses.dataclass(frozen=True)
class NormSettings:
    """How encoders normalise.

    Attributes:
        bn_momentum: BatchNorm moving-average momentum (`--bn_momentum`). 0.9, not Keras'
            0.99, whose moving statistics stay stale over the few steps of a small data set.
        synchronized: compute batch statistics across all replicas (SimCLR needs
            it so a replica cannot "cheat" with its local batch statistics).
        fused: use tfmp's fused kernel where it applies (see `BatchNormalization`);
            False runs Keras' own code path everywhere (for exact comparisons).
    """

    bn_momentum: float = 0.9
    synchronized: bool = False
    fused: bool = True


@keras.saving.register_keras_serializable(package="tfmp")
class BatchNormalization(keras.layers.BatchNormalization):
    """`keras.layers.BatchNormalization` that runs the fused kernel where it applies.

    Differences from Keras' layer, all numerical round-off: the batch statistics are
    accumulated by the fused kernel (float32 accumulators) instead of `ops.moments`;
    the normalised output is rounded to the compute dtype once. The moving variance is
    updated with the biased batch variance, exactly as Keras does (the kernel returns
    the unbiased one, which is corrected here).

    Args:
        fused: take the fused path where it applies (default); False is exactly Keras' layer.
        **kwargs: `keras.layers.BatchNormalization`'s arguments.
    """

    def __init__(self, fused: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.fused = fused

    def get_config(self):
        return {**super().get_config(), "fused": self.fused}

    @property
    def uses_fused_kernel(self) -> bool:
        """Whether training and inference calls run the fused kernel (the layer must be built).

        Synchronized statistics across replicas need an all-reduce between computing the
        moments and normalising, which the fused kernel cannot do: with more than one
        replica in sync such a layer takes Keras' path. With a single replica, local
        statistics *are* the global ones.
        """
        if not self.fused or self.renorm or self.axis not in (-1, 3) or self.input_spec is None or self.input_spec.ndim != 4:
            return False
        return not self.synchronized or tf.distribute.get_strategy().num_replicas_in_sync == 1

    def _fused_call_applies(self, inputs, training, mask) -> bool:
        # A symbolic `training` flag or a mask: leave it to Keras' code path.
        return (self.uses_fused_kernel and mask is None and isinstance(training, (bool, type(None)))
                and inputs.dtype in (tf.float32, tf.bfloat16, tf.float16))

    def call(self, inputs, training=None, mask=None):
        if not self._fused_call_applies(inputs, training, mask):
            if training and self.trainable and is_recomputing() and not self.renorm:
                return self._normalise_with_batch_statistics(inputs, mask)
            return super().call(inputs, training=training, mask=mask)
        channels = inputs.shape[-1]
        gamma = self.gamma if self.scale else tf.ones((channels,), tf.float32)
        beta = self.beta if self.center else tf.zeros((channels,), tf.float32)
        inputs = tf.convert_to_tensor(inputs)
        if training and self.trainable:
            empty = tf.constant([], tf.float32)
            outputs, mean, unbiased_variance, *_ = tf.raw_ops.FusedBatchNormV3(
                x=inputs, scale=gamma, offset=beta, mean=empty, variance=empty, epsilon=self.epsilon,
                exponential_avg_factor=1.0, data_format="NHWC", is_training=True)
            count = tf.cast(tf.size(inputs) // channels, tf.float32)
            variance = unbiased_variance * (count - 1.0) / tf.maximum(count, 1.0)
            if not is_recomputing():
                context = tf.distribute.get_replica_context()
                if context is not None and context.num_replicas_in_sync > 1:
                    # Each replica normalised with its own batch; the moving statistics must still be one value on
                    # every replica (Keras 3.15 lets them drift apart, and tfmp's replica check then stops the run:
                    # BUILD_NOTES.md, "BatchNorm moving statistics on several replicas").
                    mean, variance = context.all_reduce(tf.distribute.ReduceOp.MEAN, [mean, variance])
                self.moving_mean.assign(self.moving_mean * self.momentum + mean * (1.0 - self.momentum))
                self.moving_variance.assign(self.moving_variance * self.momentum + variance * (1.0 - self.momentum))
        else:
            outputs, *_ = tf.raw_ops.FusedBatchNormV3(
                x=inputs, scale=gamma, offset=beta, mean=tf.convert_to_tensor(self.moving_mean),
                variance=tf.convert_to_tensor(self.moving_variance), epsilon=self.epsilon, exponential_avg_factor=1.0,
                data_format="NHWC", is_training=False)
        return tf.cast(outputs, self.compute_dtype)

    def _normalise_with_batch_statistics(self, inputs, mask):
        """Keras' training-mode computation without the moving-statistics update (recomputation)."""
        inputs = keras.ops.cast(inputs, "float32")
        mean, variance = keras_internals.batch_statistics(self, inputs, mask)
        outputs = keras.ops.batch_normalization(inputs, mean, variance, axis=self.axis, epsilon=self.epsilon,
                                                offset=self.beta if self.center else None,
                                                scale=self.gamma if self.scale else None)
        return keras.ops.cast(outputs, self.compute_dtype)


def batch_norm(norm: NormSettings, name: str | None = None, zero_init: bool = False) -> BatchNormalization:
    return BatchNormalization(
        momentum=norm.bn_momentum,
        epsilon=1e-5,
        synchronized=norm.synchronized,
        fused=norm.fused,
        gamma_initializer="zeros" if zero_init else "ones",
        name=name,
    )


def conv(filters: int, kernel_size: int, strides: int = 1, name: str | None = None,
         conv_weight_gradient: str = "auto") -> keras.layers.Conv2D:
    # No bias: every convolution is followed by BatchNorm, whose beta plays that role. tfmp's Conv2D
    # is Keras' with a tap-matmul weight gradient where measured faster (tfmp.models.conv).
    return Conv2D(filters, kernel_size, strides=strides, padding="same", use_bias=False, kernel_initializer="he_normal", name=name,
                  conv_weight_gradient=conv_weight_gradient)


def conv_bn_relu(x, filters: int, kernel_size: int, norm: NormSettings, strides: int = 1, name: str = "conv",
                 conv_weight_gradient: str = "auto"):
    x = conv(filters, kernel_size, strides, name=f"{name}_conv", conv_weight_gradient=conv_weight_gradient)(x)
    x = batch_norm(norm, name=f"{name}_bn")(x)
    return keras.layers.ReLU(name=f"{name}_relu")(x)
