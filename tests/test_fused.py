"""`tfmp.models.fused`: the exact GELU and LayerNorm as XLA programs compute Keras' own function — forward and every
gradient, under every policy — keep only their input for the backward pass, and export as Keras' own layers."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy.special import erf

from tfmp.diagnostics import memory
from tfmp.models import export, fused

POLICIES = [("float32", 2e-6), ("mixed_bfloat16", 2e-2), ("mixed_float16", 2e-3)]


@pytest.fixture(autouse=True)
def _float32_policy_after():
    yield
    keras.mixed_precision.set_global_policy("float32")


def _outputs_and_gradients(layer, inputs, weights):
    """The layer's output and the gradients of a weighted sum of it (every output element a different weight, so a
    wrong element or a transposed gradient shows) with respect to its input and weights, as float64 NumPy arrays."""
    if not layer.built:
        layer.build(inputs.shape)
    layer.set_weights(weights)
    with tf.GradientTape() as tape:
        tape.watch(inputs)
        outputs = layer(inputs)
        cotangent = tf.reshape(tf.range(tf.size(outputs), dtype=tf.float32) % 7 - 3, outputs.shape)
        loss = tf.reduce_sum(tf.cast(outputs, tf.float32) * cotangent)
    gradients = tape.gradient(loss, [inputs] + layer.trainable_weights)
    return [np.asarray(tf.cast(tensor, tf.float64)) for tensor in [outputs] + gradients], outputs.dtype


def _layers(kind):
    if kind == "dense_gelu":
        return fused.Dense(24, activation="gelu"), keras.layers.Dense(24, activation="gelu")
    return fused.LayerNormalization(epsilon=1e-6), keras.layers.LayerNormalization(epsilon=1e-6)


@pytest.mark.parametrize("policy, tolerance", POLICIES)
@pytest.mark.parametrize("kind", ["dense_gelu", "layer_norm"])
def test_the_fused_layer_computes_keras_function_and_gradients(policy, tolerance, kind):
    keras.mixed_precision.set_global_policy(policy)
    rng = np.random.default_rng(0)
    inputs = tf.cast(rng.normal(scale=2.0, size=(3, 5, 16)).astype(np.float32), keras.mixed_precision.global_policy().compute_dtype)
    ours, theirs = _layers(kind)
    theirs.build(inputs.shape)
    weights = [rng.normal(size=weight.shape).astype(np.float32) + (1.0 if "gamma" in weight.path else 0.0)
               for weight in theirs.weights]
    fused_results, fused_dtype = _outputs_and_gradients(ours, inputs, weights)
    keras_results, keras_dtype = _outputs_and_gradients(theirs, inputs, weights)
    assert fused_dtype == keras_dtype == keras.mixed_precision.global_policy().compute_dtype
    for name, got, expected in zip(["output", "input gradient", *[w.name for w in theirs.weights]], fused_results,
                                   keras_results):
        scale = np.max(np.abs(expected))
        assert np.max(np.abs(got - expected)) <= tolerance * scale, (policy, kind, name)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_gelu_is_no_further_from_the_exact_function_than_tensorflows(dtype):
    """Against the float64 GELU and its derivative at the same (rounded) inputs: for 16-bit inputs the fused GELU's
    error is at most TensorFlow's op-by-op error; in float32 both are within a few roundings."""
    x64 = np.linspace(-6, 6, 4001)
    x = tf.cast(x64, dtype)
    exact_input = np.asarray(tf.cast(x, tf.float64))
    exact = 0.5 * exact_input * (1 + erf(exact_input / np.sqrt(2)))
    exact_derivative = 0.5 * (1 + erf(exact_input / np.sqrt(2))) + exact_input * np.exp(-exact_input ** 2 / 2) / np.sqrt(2 * np.pi)
    errors = {}
    for name, function in [("fused", fused.gelu), ("tensorflow", lambda t: tf.nn.gelu(t, approximate=False))]:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = function(x)
        derivative = tape.gradient(y, x)
        assert y.dtype == derivative.dtype == x.dtype
        errors[name] = (np.max(np.abs(np.asarray(tf.cast(y, tf.float64)) - exact)),
                        np.max(np.abs(np.asarray(tf.cast(derivative, tf.float64)) - exact_derivative)))
    if dtype == "float32":  # XLA's float32 erf is a few roundings off, where TensorFlow's is within about one
        rounding = 6 * 2.0 ** -24  # one rounding at the largest value, 6
        assert max(errors["fused"]) <= 4 * rounding, errors
    else:  # the fused GELU rounds once, from float32; TensorFlow's 16-bit ops round at every step
        assert errors["fused"][0] <= errors["tensorflow"][0] and errors["fused"][1] <= errors["tensorflow"][1], errors


def test_the_gelu_and_layer_norm_have_second_derivatives():
    """The backward programs are differentiable TensorFlow functions: a gradient penalty or a Hessian-vector product
    through a ViT still works. In float64, against TensorFlow's own ops (XLA's float64 erf is good to ~1e-9)."""
    x = tf.constant(np.linspace(-3, 3, 12).reshape(3, 4), tf.float64)
    gamma, beta = tf.constant([1.0, 2.0, 0.5, -1.0], tf.float64), tf.constant([0.1, 0.0, -0.2, 0.3], tf.float64)
    for function, reference in [(fused.gelu, lambda t: tf.nn.gelu(t, approximate=False)),
                                (lambda t: fused.layer_norm(t, gamma, beta, 1e-6), lambda t: _layer_norm_reference(t, gamma, beta))]:
        second = []
        for f in (function, reference):
            with tf.GradientTape() as outer:
                outer.watch(x)
                with tf.GradientTape() as inner:
                    inner.watch(x)
                    y = tf.reduce_sum(tf.sin(f(x)))
                first = inner.gradient(y, x)
                penalty = tf.reduce_sum(first ** 2)
            second.append(outer.gradient(penalty, x).numpy())
        np.testing.assert_allclose(second[0], second[1], rtol=1e-6, atol=1e-12)


def _layer_norm_reference(x, gamma, beta):
    mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(variance + 1e-6) * gamma + beta


@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")
@pytest.mark.parametrize("config", [{"center": False}, {"scale": False}, {"axis": 1}, {"rms_scaling": True}])
def test_a_layer_norm_the_programs_do_not_cover_runs_keras_own(config):
    inputs = tf.constant(np.random.default_rng(1).normal(size=(2, 3, 4)).astype(np.float32))
    ours, theirs = fused.LayerNormalization(**config), keras.layers.LayerNormalization(**config)
    theirs.build(inputs.shape)
    weights = [np.random.default_rng(2).normal(size=weight.shape).astype(np.float32) for weight in theirs.weights]
    np.testing.assert_allclose(_outputs_and_gradients(ours, inputs, weights)[0][0],
                               _outputs_and_gradients(theirs, inputs, weights)[0][0], rtol=1e-6, atol=1e-6)


def test_the_backward_pass_keeps_the_gelus_input_and_output_only():
    """TensorFlow's own GELU keeps four hidden-sized tensors for the backward pass (its erfc and three products, the
    last its output, which the next matmul's gradient reads); the fused one keeps its input (the matmul's output with
    the bias, read by its backward program) and its output."""
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    hidden_bytes = 4 * 10 * 64 * 2  # batch x tokens x hidden, bf16

    def kept(dense):
        inputs = keras.Input((10, 8))
        model = keras.Model(inputs, keras.layers.Dense(3)(dense(64, activation="gelu")(inputs)))
        return [size for size in memory.saved_for_backward(model, (10, 8), 4).values() if size >= hidden_bytes]

    assert kept(fused.Dense) == [hidden_bytes] * 2
    assert kept(keras.layers.Dense) == [hidden_bytes] * 4


def test_the_fused_layers_run_inside_a_step_xla_compiles_whole_at_two_shapes():
    """Where the whole step is one XLA program (a TPU, one GPU), the two programs are inlined into it."""
    dense, norm = fused.Dense(6, activation="gelu"), fused.LayerNormalization(epsilon=1e-6)
    step = tf.function(lambda x: norm(dense(x)), jit_compile=True)
    dense.build((None, 5))
    norm.build((None, 6))
    for rows in (2, 3):
        x = tf.random.stateless_normal((rows, 5), seed=(rows, 0))
        expected = _layer_norm_reference(tf.nn.gelu(tf.matmul(x, dense.kernel) + dense.bias, approximate=False),
                                         norm.gamma, norm.beta)
        np.testing.assert_allclose(step(x).numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)


def test_the_config_names_keras_own_gelu_and_portable_writes_keras_layers():
    inputs = keras.Input((4, 8))
    x = fused.LayerNormalization(epsilon=1e-6, name="norm")(inputs)
    outputs = fused.Dense(16, activation="gelu", name="hidden")(x)
    model = keras.Model(inputs, outputs)
    assert model.get_layer("hidden").get_config()["activation"] == "gelu"
    exported = export.portable(model)
    assert export.uses_only_keras_layers(exported)
    assert type(exported.get_layer("hidden")) is keras.layers.Dense
    assert exported.get_layer("hidden").get_config() == model.get_layer("hidden").get_config()
    adopted = export.adopt(exported)
    assert type(adopted.get_layer("hidden")) is fused.Dense and type(adopted.get_layer("norm")) is fused.LayerNormalization
    batch = np.random.default_rng(0).normal(size=(2, 4, 8)).astype(np.float32)
    np.testing.assert_allclose(exported(batch), model(batch), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(adopted(batch), model(batch), rtol=1e-6, atol=1e-6)
    # A plain Dense keeps Keras' class through adopt: only the GELU's layer has something to gain.
    plain = keras.Model(inputs, keras.layers.Dense(3, name="plain")(inputs))
    assert type(export.adopt(plain).get_layer("plain")) is keras.layers.Dense


def test_a_checkpoint_written_with_keras_layers_restores_into_the_fused_ones(tmp_path):
    """A ViT trained before these layers existed (Keras' own LayerNormalization and Dense) resumes into them: the
    checkpoint's keys are the same (the layers keep Keras' weights and names)."""
    def model(norm, dense):
        inputs = keras.Input((4, 8))
        return keras.Model(inputs, dense(16, activation="gelu", name="hidden")(norm(epsilon=1e-6, name="norm")(inputs)))

    before = model(keras.layers.LayerNormalization, keras.layers.Dense)
    rng = np.random.default_rng(3)
    before.set_weights([rng.normal(size=weight.shape).astype(np.float32) for weight in before.weights])
    path = tf.train.Checkpoint(model=before).write(str(tmp_path / "checkpoint"))
    after = model(fused.LayerNormalization, fused.Dense)
    tf.train.Checkpoint(model=after).read(path).assert_consumed()
    for restored, written in zip(after.weights, before.weights):
        np.testing.assert_array_equal(restored.numpy(), written.numpy())
    batch = rng.normal(size=(2, 4, 8)).astype(np.float32)
    np.testing.assert_allclose(after(batch), before(batch), rtol=1e-5, atol=1e-6)
