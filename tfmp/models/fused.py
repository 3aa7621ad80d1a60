"""A transformer block's element-wise parts — the exact GELU and LayerNorm — each as two small XLA programs.

TensorFlow runs these parts op by op outside XLA: the GELU of a bf16 tensor is five element-wise bf16 kernels forward
and more backward (TensorFlow's CPU kernels convert every bf16 element to float32 and back per op), and a LayerNorm is
about ten. Measured at ViT-S/16's shapes (BUILD_NOTES.md, "The ViT step against PyTorch, part by part"), the GELU
alone took 4.9x PyTorch's time in bf16 on a Zen 4 and 6.7x on a Xeon with AMX, LayerNorm 2.4-3.5x: most of the gap
between tfmp's ViT step and PyTorch's. XLA fuses each part into one loop over the tensor that reads and writes it
once, computing in float32 in registers.

Each part here is a `tf.custom_gradient` whose forward and backward passes are each a `tf.function(jit_compile=True)`:

* the same function as Keras' own — the exact GELU `x * Phi(x)`, LayerNorm `(x - mean) / sqrt(var + eps) * gamma +
  beta` over the last axis — computed in float32 for 16-bit inputs (as Keras' LayerNormalization does; for the GELU
  more accurate than TensorFlow's bf16 ops) and returned in the input's dtype;
* the backward pass keeps the part's input only and recomputes the rest (the GELU's `Phi(x)` and density, LayerNorm's
  mean and inverse deviation: one pass over a tensor it reads anyway), where TensorFlow's own gradient keeps four
  pre-activation-sized tensors for the GELU;
* the rest of the step stays TensorFlow's graph: the matmuls stay oneDNN's (XLA's CPU matmuls are slower, and
  compiling the whole step on a CPU loses the bf16 gain: `tfmp.compilation`). Under a step compiled whole (a TPU, one
  GPU) the two programs are inlined into it.

The layers, `tfmp>Dense` (with `activation="gelu"`) and `tfmp>LayerNormalization`, are Keras' own with that
computation swapped in and the same config and weights; `tfmp.models.export.portable` writes them back as Keras'
layers (an exported `encoder.keras` loads without tfmp), `adopt` turns Keras' back into these. A LayerNormalization
this module does not cover (an axis other than the last, without center or scale, RMS scaling) runs Keras' own code.

Written for any device; measured on CPUs only (on GPUs, XLA's element-wise fusion is what TensorFlow's auto-clustering
would do, untested here).
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

_SQRT_HALF = math.sqrt(0.5)
_INVERSE_SQRT_TWO_PI = 1.0 / math.sqrt(2.0 * math.pi)


def _float32(tensor: tf.Tensor) -> tf.Tensor:
    """16-bit tensors in float32, others as they are (float64 stays float64)."""
    return tf.cast(tensor, tf.float32) if tensor.dtype in (tf.bfloat16, tf.float16) else tensor


def _normal_cdf(z):
    # Phi(z) as Keras writes it, with erfc: `1 + erf(z / sqrt(2))` cancels for negative z (the GELU's tail, ~1e-6 off
    # in float32 where the true value is ~1e-30).
    return 0.5 * tf.math.erfc(-z * _SQRT_HALF)


@tf.function(jit_compile=True, autograph=False)
def _gelu_forward(x):
    z = _float32(x)
    return tf.cast(z * _normal_cdf(z), x.dtype)


@tf.function(jit_compile=True, autograph=False)
def _gelu_backward(x, upstream):
    z = _float32(x)
    derivative = _normal_cdf(z) + z * _INVERSE_SQRT_TWO_PI * tf.exp(-0.5 * z * z)
    return tf.cast(tf.cast(upstream, z.dtype) * derivative, x.dtype)


@tf.autograph.experimental.do_not_convert  # a `tf.function` calling it must not rewrite the gradient's closure
@tf.custom_gradient
def gelu(x):
    """The exact GELU, `x * Phi(x)` (Keras' `gelu`, `approximate=False`), in float32 for 16-bit `x`."""
    return _gelu_forward(x), lambda upstream: _gelu_backward(x, upstream)


def _normalised(x, epsilon):
    z = _float32(x)
    mean = tf.reduce_mean(z, axis=-1, keepdims=True)
    centred = z - mean
    inverse_deviation = tf.math.rsqrt(tf.reduce_mean(tf.square(centred), axis=-1, keepdims=True) + epsilon)
    return centred * inverse_deviation, inverse_deviation


@tf.function(jit_compile=True, autograph=False)
def _layer_norm_forward(x, gamma, beta, epsilon):
    normalised, _ = _normalised(x, epsilon)
    return tf.cast(normalised * tf.cast(gamma, normalised.dtype) + tf.cast(beta, normalised.dtype), x.dtype)


@tf.function(jit_compile=True, autograph=False)
def _layer_norm_backward(x, gamma, upstream, epsilon):
    normalised, inverse_deviation = _normalised(x, epsilon)
    upstream = tf.cast(upstream, normalised.dtype)
    scaled = upstream * tf.cast(gamma, normalised.dtype)
    # d/dx of (x - mean) * rsqrt(var + eps): the scaled gradient minus its mean and its projection on the output.
    input_gradient = inverse_deviation * (scaled - tf.reduce_mean(scaled, axis=-1, keepdims=True)
                                          - normalised * tf.reduce_mean(scaled * normalised, axis=-1, keepdims=True))
    rows = [-1, tf.shape(normalised)[-1]]
    gamma_gradient = tf.reduce_sum(tf.reshape(upstream * normalised, rows), axis=0)
    beta_gradient = tf.reduce_sum(tf.reshape(upstream, rows), axis=0)
    return tf.cast(input_gradient, x.dtype), tf.cast(gamma_gradient, gamma.dtype), tf.cast(beta_gradient, gamma.dtype)


@tf.autograph.experimental.do_not_convert
def layer_norm(x, gamma, beta, epsilon: float):
    """LayerNorm over the last axis with scale `gamma` and offset `beta` (Keras' `LayerNormalization`), in float32
    for 16-bit `x`, returned in `x`'s dtype."""
    epsilon = float(epsilon)  # a constant of the two programs

    @tf.custom_gradient
    def normalise(x, gamma, beta):
        def gradient(upstream):
            return _layer_norm_backward(x, gamma, upstream, epsilon)
        return _layer_norm_forward(x, gamma, beta, epsilon), gradient

    return normalise(x, gamma, beta)


@keras.saving.register_keras_serializable(package="tfmp")
class Dense(keras.layers.Dense):
    """Keras' `Dense`; with `activation="gelu"` (exact) the GELU is `tfmp.models.fused.gelu`. Same config, weights
    and function."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.activation is keras.activations.gelu:  # "gelu": Keras' exact GELU (its default approximate=False)
            self.activation = gelu

    def get_config(self):
        config = super().get_config()
        if self.activation is gelu:
            config["activation"] = "gelu"
        return config


@keras.saving.register_keras_serializable(package="tfmp")
class LayerNormalization(keras.layers.LayerNormalization):
    """Keras' `LayerNormalization`, computed by `tfmp.models.fused.layer_norm` over the last axis with scale and
    offset (Keras' own code otherwise). Same config, weights and function."""

    def call(self, inputs):
        axes = [self.axis] if isinstance(self.axis, int) else list(self.axis)
        if not (self.center and self.scale and not self.rms_scaling and axes in ([-1], [len(inputs.shape) - 1])):
            return super().call(inputs)
        outputs = layer_norm(inputs, tf.convert_to_tensor(self.gamma), tf.convert_to_tensor(self.beta), self.epsilon)
        return tf.cast(outputs, self.compute_dtype)
