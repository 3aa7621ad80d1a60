"""Vision Transformer encoders: the forward pass against attention written out in NumPy, sizes, the float32 islands
under mixed precision, activation checkpointing, stochastic depth, 2 replicas against one device, XLA."""

import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy.special import erf

from conftest import REPO, one_device_and_two_replicas
from tfmp import data, distribute, models, precision, registry, ssl
from tfmp.data import augment
from tfmp.diagnostics import flops, memory, precision_report
from tfmp.models import vit

TINY = vit.ViTSize(patch=2, width=8, depth=1, heads=2, mlp_width=16)


def _randomized(model, seed=0):
    """Every weight drawn at random (LayerNorm scales around 1), so that no term of the forward pass hides."""
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        value = rng.normal(0.0, 0.3, weight.shape)
        weight.assign((1.0 + value if weight.path.endswith("gamma") else value).astype(np.float32))
    return model


def _layer_norm(x, gamma, beta):
    mean, variance = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(variance + 1e-6) * gamma + beta


def _cubic_matrix(source: int, target: int) -> np.ndarray:
    """(target, source) weights of bicubic resizing as TensorFlow defines it: half-pixel centres, Keys' cubic kernel
    with a = -0.5, taps outside the source dropped and the rest renormalised."""
    matrix = np.zeros((target, source))
    for row in range(target):
        centre = (row + 0.5) * source / target - 0.5
        for tap in range(math.floor(centre) - 1, math.floor(centre) + 3):
            t = abs(centre - tap)
            weight = 1.5 * t ** 3 - 2.5 * t ** 2 + 1 if t <= 1 else -0.5 * t ** 3 + 2.5 * t ** 2 - 4 * t + 2 if t < 2 else 0.0
            if 0 <= tap < source:
                matrix[row, tap] += weight
        matrix[row] /= matrix[row].sum()
    return matrix


def _bicubic(grid: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """A (rows, columns, channels) grid resized to `shape`, separably (rows, then columns)."""
    return np.einsum("ir,jc,rcw->ijw", _cubic_matrix(grid.shape[0], shape[0]), _cubic_matrix(grid.shape[1], shape[1]), grid)


def _numpy_vit(images, weights, size):
    """The ViT forward pass written out: patches, projection + position embedding, pre-norm blocks, mean pooling."""
    batch, height, width, channels = images.shape
    p = size.patch
    patches = images.reshape(batch, height // p, p, width // p, p, channels).transpose(0, 1, 3, 2, 4, 5)
    position = _bicubic(weights["patch_embedding/position"], (height // p, width // p))  # the grid it was learned at: itself
    tokens = patches.reshape(batch, -1, p * p * channels) @ weights["patch_embedding/kernel"] + position.reshape(-1, size.width)
    key_dim = size.width // size.heads
    for block in range(size.depth):
        def w(name):
            return weights[f"block{block}_{name}"]
        y = _layer_norm(tokens, w("attention_norm/gamma"), w("attention_norm/beta"))
        q, k, v = (np.einsum("btw,whd->bthd", y, w(f"attention/{part}/kernel")) + w(f"attention/{part}/bias")
                   for part in ("query", "key", "value"))
        logits = np.einsum("bthd,bshd->bhts", q, k) / math.sqrt(key_dim)
        probabilities = np.exp(logits - logits.max(-1, keepdims=True))
        probabilities /= probabilities.sum(-1, keepdims=True)
        attended = np.einsum("bhts,bshd->bthd", probabilities, v)
        tokens = tokens + np.einsum("bthd,hdw->btw", attended, w("attention/attention_output/kernel")) \
            + w("attention/attention_output/bias")
        y = _layer_norm(tokens, w("mlp_norm/gamma"), w("mlp_norm/beta"))
        hidden = y @ w("mlp_hidden/kernel") + w("mlp_hidden/bias")
        hidden = 0.5 * hidden * (1.0 + erf(hidden / math.sqrt(2.0)))  # exact GELU
        tokens = tokens + hidden @ w("mlp_output/kernel") + w("mlp_output/bias")
    return _layer_norm(tokens, weights["final_norm/gamma"], weights["final_norm/beta"]).mean(axis=1)


@pytest.mark.parametrize("depth", [1, 2])
def test_the_forward_pass_matches_attention_written_out_in_numpy(depth):
    size = vit.ViTSize(patch=2, width=8, depth=depth, heads=2, mlp_width=16)
    encoder = _randomized(vit.vision_transformer((4, 6, 3), size, "tiny"))
    weights = {weight.path: weight.numpy() for weight in encoder.weights}  # "block0_attention/query/kernel", ...
    assert len(weights) == len(encoder.weights)
    images = np.random.default_rng(1).normal(size=(3, 4, 6, 3)).astype(np.float32)
    expected = _numpy_vit(images.astype(np.float64), {key: value.astype(np.float64) for key, value in weights.items()}, size)
    np.testing.assert_allclose(encoder(images, training=False).numpy(), expected, rtol=1e-4, atol=1e-5)


def test_the_position_embedding_resized_by_the_layer_is_an_independent_bicubic_resize():
    from PIL import Image

    embedding = vit.PatchEmbedding(2, 3, (3, 4))
    embedding.build((None, None, None, 1))
    grid = np.random.default_rng(0).normal(size=(3, 4, 3)).astype(np.float32)
    embedding.position.assign(grid)
    for shape in [(3, 4), (6, 8), (2, 2), (5, 7), (1, 9), (7, 3)]:  # itself, up, down, uneven, one row, mixed
        resized = embedding.position_grid(*shape).numpy()
        np.testing.assert_allclose(resized, _bicubic(grid.astype(np.float64), shape), rtol=1e-5, atol=1e-6, err_msg=str(shape))
        if shape[0] >= 3 and shape[1] >= 4:  # enlarged: PIL's bicubic (it antialiases when shrinking), channel by channel
            pil = np.stack([np.asarray(Image.fromarray(grid[..., channel], mode="F").resize(shape[::-1], Image.BICUBIC))
                            for channel in range(3)], axis=-1)
            np.testing.assert_allclose(resized, pil, rtol=1e-4, atol=1e-5, err_msg=str(shape))


@pytest.mark.parametrize("side", [8, 16, 32])
def test_an_encoder_built_at_16_pixels_computes_the_vit_at_8_and_32(side):
    """One encoder, learned at a 4x4 grid of patches, on 8, 16 and 32 px images: patches of the image it is given, the
    position embedding resized to their grid (written out in NumPy), the same blocks."""
    size = vit.ViTSize(patch=4, width=8, depth=1, heads=2, mlp_width=16)
    encoder = _randomized(vit.vision_transformer((16, 16, 3), size, "tiny"))
    assert encoder.input_shape == (None, None, None, 3)
    weights = {weight.path: weight.numpy().astype(np.float64) for weight in encoder.weights}
    assert weights["patch_embedding/position"].shape == (4, 4, 8)
    images = np.random.default_rng(1).normal(size=(2, side, side, 3)).astype(np.float32)
    np.testing.assert_allclose(encoder(images, training=False).numpy(), _numpy_vit(images.astype(np.float64), weights, size),
                               rtol=1e-4, atol=1e-5)


def test_an_image_of_two_sizes_in_one_compiled_step_and_its_gradient_reaches_the_learned_grid():
    """Global and local crops through one encoder in one XLA-compiled step (DINO's multi-crop): the position embedding's
    gradient arrives at its learned (4, 4) grid from both."""
    size = vit.ViTSize(patch=2, width=8, depth=1, heads=2, mlp_width=16)
    encoder = vit.vision_transformer((8, 8, 1), size, "tiny")
    position = next(weight for weight in encoder.trainable_weights if weight.path.endswith("position"))

    @tf.function(jit_compile=True)
    def step(large, small):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(encoder(large, training=True)) + tf.reduce_sum(encoder(small, training=True))
        return tape.gradient(loss, position)

    rng = np.random.default_rng(0)
    gradient = step(rng.normal(size=(2, 8, 8, 1)).astype(np.float32), rng.normal(size=(2, 4, 4, 1)).astype(np.float32))
    assert gradient.shape == (4, 4, 8) and np.all(np.isfinite(gradient)) and np.any(gradient.numpy() != 0)


def _encoder_saved_before_vits_took_any_resolution(size, side, channels):
    """A ViT in the layout tfmp saved before this change, built here from Keras' layers: patches by Reshape / Permute /
    Reshape and one EinsumDense whose (token, channel) bias is the position embedding."""
    rows = side // size.patch
    inputs = keras.Input((side, side, channels), name="images")
    x = keras.layers.Reshape((rows, size.patch, rows, size.patch, channels), name="patch_grid")(inputs)
    x = keras.layers.Permute((1, 3, 2, 4, 5), name="patch_order")(x)
    x = keras.layers.Reshape((rows * rows, size.patch ** 2 * channels), name="patches")(x)
    x = keras.layers.EinsumDense("btp,pc->btc", output_shape=(rows * rows, size.width), bias_axes="tc",
                                 name="patch_embedding")(x)
    for block in range(size.depth):
        x = vit.encoder_block(x, f"block{block}", heads=size.heads, mlp_width=size.mlp_width)
    x = keras.layers.LayerNormalization(epsilon=1e-6, name="final_norm")(x)
    return keras.Model(inputs, keras.layers.GlobalAveragePooling1D(name="pool")(x), name="vit_old")


def test_an_encoder_saved_before_vits_took_any_resolution_is_adopted_and_takes_other_sizes(tmp_path):
    from tfmp.models import export

    size = vit.ViTSize(patch=2, width=8, depth=2, heads=2, mlp_width=16)
    old = _randomized(_encoder_saved_before_vits_took_any_resolution(size, 8, 1))
    old.save(tmp_path / "old.keras")
    loaded = keras.saving.load_model(tmp_path / "old.keras")  # plain Keras, safe mode
    assert export.takes_images_of(loaded, (16, 16, 1)) and not export.takes_images_of(loaded, (15, 15, 1))
    adopted = export.adopt(loaded)
    assert adopted.input_shape == (None, None, None, 1)
    assert [type(layer) for layer in adopted.layers[:2]] == [keras.layers.InputLayer, vit.PatchEmbedding]
    images = np.random.default_rng(1).normal(size=(3, 8, 8, 1)).astype(np.float32)
    np.testing.assert_allclose(adopted(images).numpy(), old(images).numpy(), rtol=1e-5, atol=1e-6)
    assert adopted(np.zeros((1, 12, 16, 1), np.float32)).shape == (1, 8)
    # And back: the exported layout is the old one, with the same weights.
    exported = export.portable(adopted)
    assert [layer.name for layer in exported.layers[:5]] == [layer.name for layer in old.layers[:5]]
    assert export.uses_only_keras_layers(exported) and exported.input_shape == (None, 8, 8, 1)
    for mine, theirs in zip(exported.weights, old.weights):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


def _parameter_count(size: vit.ViTSize, image_side: int, channels: int = 3) -> int:
    """ViT parameters by formula: patch projection, position embedding, blocks, final LayerNorm."""
    tokens, width = (image_side // size.patch) ** 2, size.width
    attention = 4 * (width * width + width)  # query, key, value, output projections with biases
    mlp = width * size.mlp_width + size.mlp_width + size.mlp_width * width + width
    return size.patch ** 2 * channels * width + tokens * width + size.depth * (attention + mlp + 4 * width) + 2 * width


@pytest.mark.parametrize("name, shape", [("vit_micro_p2", (8, 8, 1)), ("vit_micro_p2", (16, 16, 3)), ("vit_tiny_p4", (32, 32, 3)),
                                         ("vit_small_p16", (224, 224, 3)), ("vit_base_p16", (224, 224, 3))])
def test_every_size_has_its_shape_and_parameters(name, shape):
    encoder = models.build_encoder(name, shape)
    size = vit.SIZES[name]
    assert encoder.output_shape == (None, size.width)
    assert encoder.count_params() == _parameter_count(size, shape[0], shape[2])
    if name == "vit_small_p16":
        # timm's vit_small_patch16_224 (22,050,664) less its CLS token, the CLS row of its position embedding, its
        # patch-projection bias (folded into the position embedding here) and its 1000-class head.
        assert encoder.count_params() == 22_050_664 - 3 * 384 - (384 * 1000 + 1000)


def test_an_image_size_that_is_not_a_multiple_of_the_patch_is_refused():
    with pytest.raises(ValueError, match=r"vit_tiny_p4 cuts 4x4 patches: the image size must be a multiple of 4, got 30x30"):
        models.build_encoder("vit_tiny_p4", (30, 30, 3))
    with pytest.raises(ValueError, match="no stochastic depth"):
        models.build_encoder("small_cnn", (8, 8, 1), drop_path_rate=0.1)


def _operation_dtypes(encoder, shape):
    """(op type, dtype) -> count over the traced training forward pass, the bodies of the functions it calls (the
    fused GELU's and LayerNorm's XLA programs) counted at each call."""
    forward = tf.function(lambda images: encoder(images, training=True), autograph=False)
    graph_def = forward.get_concrete_function(tf.TensorSpec((2, *shape), tf.float32)).graph.as_graph_def()
    bodies = {function.signature.name: function.node_def for function in graph_def.library.function}
    counts = {}

    def count(nodes):
        for node in nodes:
            called = node.attr["f"].func.name if "f" in node.attr else ""
            if called in bodies:
                count(bodies[called])
                continue
            single = "T" in node.attr and node.attr["T"].WhichOneof("value") == "type"  # not a list of dtypes
            dtype = tf.dtypes.as_dtype(node.attr["T"].type).name if single else None
            counts[(node.op, dtype)] = counts.get((node.op, dtype), 0) + 1

    count(graph_def.node)
    return counts


@pytest.mark.parametrize("policy, low", [("mixed_bfloat16", "bfloat16"), ("mixed_float16", "float16")])
def test_mixed_precision_keeps_softmax_and_layer_norm_in_float32_and_matmuls_low(policy, low):
    keras.mixed_precision.set_global_policy(policy)
    size = vit.ViTSize(patch=2, width=16, depth=2, heads=2, mlp_width=32)
    encoder = vit.vision_transformer((8, 8, 1), size, "islands")
    counts = _operation_dtypes(encoder, (8, 8, 1))
    kinds = {kind for kind, _ in counts}
    softmax = {dtype for kind, dtype in counts if kind == "Softmax"}
    assert softmax == {"float32"}, counts  # attention probabilities
    assert {dtype for kind, dtype in counts if kind == "Rsqrt"} == {"float32"}  # LayerNorm's statistics
    assert sum(count for (kind, _), count in counts.items() if kind == "Rsqrt") == 2 * size.depth + 1
    assert {dtype for kind, dtype in counts if kind == "Erfc"} == {"float32"}  # the GELU's CDF (tfmp.models.fused)
    matmuls = {dtype for kind, dtype in counts if kind in ("MatMul", "BatchMatMulV2", "Einsum")}
    assert matmuls == {low}, (kinds, counts)
    assert all(weight.dtype == "float32" for weight in encoder.weights)  # float32 master weights
    assert encoder(np.zeros((2, 8, 8, 1), np.float32)).dtype == low


def test_blocks_remat_gives_the_gradients_of_no_remat():
    images = np.random.default_rng(0).normal(size=(4, 8, 8, 1)).astype(np.float32)
    plain = _randomized(models.build_encoder("vit_micro_p2", (8, 8, 1)))
    checkpointed = models.build_encoder("vit_micro_p2", (8, 8, 1), remat="blocks")
    checkpointed.set_weights(plain.get_weights())

    def gradients(encoder):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(encoder(images, training=True)))
        return loss, tape.gradient(loss, encoder.trainable_variables)

    expected_loss, expected = gradients(plain)
    loss, actual = gradients(checkpointed)
    assert float(loss) == pytest.approx(float(expected_loss), rel=1e-6)
    assert len(actual) == len(expected) == len(plain.trainable_variables)
    for a, b in zip(actual, expected):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6)


def test_stochastic_depth_drops_whole_branches_in_training_only():
    encoder = models.build_encoder("vit_micro_p2", (8, 8, 1), drop_path_rate=0.5)
    drops = [layer for layer in encoder.layers if isinstance(layer, keras.layers.Dropout)]
    # Rates rise linearly from 0 (the first block has none) to the rate asked for.
    assert sorted({layer.rate for layer in drops}) == pytest.approx([0.5 / 3, 1.0 / 3, 0.5])
    images = np.random.default_rng(0).normal(size=(64, 8, 8, 1)).astype(np.float32)
    np.testing.assert_array_equal(encoder(images, training=False), encoder(images, training=False))
    assert not np.allclose(encoder(images, training=True), encoder(images, training=False))
    # One draw per sample and branch: the branch output is all kept (scaled by 1/(1-rate)) or all zero.
    kept = drops[-1](np.ones((64, 16, 64), np.float32), training=True).numpy()
    assert set(np.unique(kept)) == {0.0, 2.0} and all(len(np.unique(sample)) == 1 for sample in kept)


def _classifier_loss_and_gradients(model, images, labels, replicas):
    with tf.GradientTape() as tape:
        logits = model(images, training=True)
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
        scaled = loss / replicas
    return loss, tape.gradient(scaled, model.trainable_variables)


def test_two_replicas_give_the_one_device_loss_and_gradients():
    images = tf.random.stateless_normal((8, 8, 8, 1), seed=[3, 4])
    labels = tf.range(8) % 10

    def build(strategy):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            return models.build_classifier(models.build_encoder("vit_micro_p2", (8, 8, 1)), 10)

    single = build(tf.distribute.get_strategy())
    strategy = distribute.get_strategy("mirrored")
    assert strategy.num_replicas_in_sync == 2
    mirrored = build(strategy)
    (loss, gradients), (losses, summed) = one_device_and_two_replicas(_classifier_loss_and_gradients, single, mirrored,
                                                                       strategy, images, labels)
    assert np.mean(losses) == pytest.approx(float(loss), rel=1e-5)
    for expected, total, variable in zip(gradients, summed, single.trainable_variables):
        np.testing.assert_allclose(total.numpy(), expected.numpy(), rtol=1e-3, atol=1e-6,
                                   err_msg=variable.path)


@pytest.mark.parametrize("remat", ["none", pytest.param("blocks", marks=pytest.mark.slow)])  # 12 s, 18 s
def test_the_training_step_compiles_with_xla(remat):
    keras.utils.set_random_seed(0)
    model = models.build_classifier(models.build_encoder("vit_micro_p2", (8, 8, 1), remat=remat, drop_path_rate=0.1), 10)
    model.compile(optimizer=keras.optimizers.AdamW(1e-3), jit_compile=True,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    images = np.random.default_rng(0).normal(size=(64, 8, 8, 1)).astype(np.float32)
    labels = np.arange(64) % 10
    history = model.fit(images, labels, batch_size=16, epochs=3, verbose=0)
    assert model.jit_compile
    assert history.history["loss"][-1] < history.history["loss"][0]


def _ssl_method_on_a_tiny_vit(name, strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        encoder = models.build_encoder("vit_micro_p2", (8, 8, 1))
        method = registry.SSL_METHODS.load(name)
        options = {"total_steps": 8} if issubclass(method, ssl.MomentumTwoViewModel) else {}
        if "projection_dim" in method.settings:
            options["projection_dim"] = 16
        if "decoder_width" in method.settings:  # MAE
            options.update(decoder_width=32, decoder_depth=1, decoder_heads=4)
        model = method(encoder, num_classes=10, norm=models.NormSettings(synchronized=True), seed=0,
                       augment_config=augment.AugmentConfig(crop_scale=(0.5, 1.0), flip=False), **options)
        model.compile(optimizer=precision.wrap_optimizer(keras.optimizers.AdamW(1e-3)))
    return model


# ~10 s each, so under -m slow; the default suite trains a ViT through fit() in the XLA test above.
@pytest.mark.slow
@pytest.mark.parametrize("name, setup", [(name, setup) for setup in ("float32", "bf16", "two_replicas")
                                         for name in registry.SSL_METHODS.names()])
def test_every_ssl_method_trains_a_tiny_vit(name, setup):
    if setup == "bf16":
        precision.set_policy("mixed_bfloat16")
    strategy = distribute.get_strategy("mirrored") if setup == "two_replicas" else tf.distribute.get_strategy()
    model = _ssl_method_on_a_tiny_vit(name, strategy)
    before = [weight.numpy() for weight in model.encoder.trainable_weights]
    digits = data.load("digits")
    history = model.fit(data.classification_pipeline(digits.train, 64, training=True, indices=np.arange(256)), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all(), history.history
    assert all(np.isfinite(weight.numpy()).all() for weight in model.weights)
    changed = [not np.array_equal(old, weight.numpy()) for old, weight in zip(before, model.encoder.trainable_weights)]
    assert all(changed), [weight.path for weight, moved in zip(model.encoder.trainable_weights, changed) if not moved]


# ---------------------------------------------------------------------------- what the doctor and the memory estimate see


def test_the_precision_doctor_reports_each_blocks_attention_on_its_own():
    keras.utils.set_random_seed(0)
    model = models.build_classifier(models.build_encoder("vit_micro_p2", (8, 8, 1)), 10)
    query = next(weight for weight in model.weights if weight.path.endswith("block1_attention/query/kernel"))
    query.assign(query.numpy() * 1e5)  # block 1's queries now overflow float16 (max 65504); block 0's do not
    images = np.random.default_rng(0).random((16, 8, 8, 1), dtype=np.float32)
    report = precision_report(model, [(images, np.arange(16) % 10)], steps=1)
    names = [layer.name for layer in report.layers]
    assert {f"block{block}_attention/{part}" for block in range(4) for part in ("query", "key", "value")} <= set(names)
    assert "block1_attention/query" in report.overflowing_layers("float16")
    assert "block0_attention/query" not in report.overflowing_layers("float16")
    assert "block1_attention/attention_output" in report.table()  # names are not cut


@pytest.mark.parametrize("policy, probability_bytes", [("float32", 4), ("mixed_bfloat16", 4 + 2)])
def test_the_memory_estimate_counts_attention_probabilities_by_the_square_of_the_tokens(policy, probability_bytes):
    keras.mixed_precision.set_global_policy(policy)
    size = vit.ViTSize(patch=2, width=16, depth=2, heads=4, mlp_width=32)
    rest = {}
    for side in (8, 16, 24):  # 16, 64 and 144 tokens
        tokens = (side // 2) ** 2
        encoder = vit.vision_transformer((side, side, 1), size, "tiny")
        kept = [sum(memory.saved_for_backward(encoder, (side, side, 1), batch).values()) for batch in (1, 2)]
        rest[tokens] = kept[1] - kept[0] - size.depth * size.heads * tokens * tokens * probability_bytes
    # What one example keeps: without the probabilities (heads x tokens^2 per block: the softmax's float32 output, and
    # under bf16 its 16-bit copy for the matmul with the values) the rest is linear in the tokens.
    assert 48 * (rest[144] - rest[64]) == 80 * (rest[64] - rest[16])
    assert flops.forward_flops_per_example(encoder, (24, 24, 1)) > 9 * flops.forward_flops_per_example(
        vit.vision_transformer((8, 8, 1), size, "tiny"), (8, 8, 1))


@pytest.mark.slow  # ~25 s
def test_the_memory_estimate_is_near_the_measured_peak_with_and_without_remat():
    images = np.random.default_rng(0).random((32, 32, 32, 3), dtype=np.float32)
    labels = np.arange(32) % 10
    measured = {}
    for remat in ("none", "blocks"):
        keras.utils.set_random_seed(0)
        model = models.build_classifier(models.build_encoder("vit_tiny_p4", (32, 32, 3), remat=remat), 10)
        estimate = memory.estimate_memory(model, (32, 32, 3), 32)
        peak = memory.measure_step_peak(model, images, labels)
        measured[remat] = peak
        assert 0.5 <= peak / (estimate.activations_bytes + estimate.gradients_bytes) <= 2.0, (remat, peak, estimate)
    assert measured["blocks"] < 0.7 * measured["none"]


@pytest.mark.parametrize("preset, task", [("cifar10_mocov3_vit", "mocov3"), ("cifar10_mae_vit", "mae"), ("cifar10_dino_vit", "dino")])
def test_the_cifar10_vit_presets_are_valid_configs(preset, task):
    """The GPU/TPU presets cannot run here (CIFAR-10 is not downloadable offline); their flags must still parse and
    pass every check the CLI makes before touching the data, the method's own included."""
    from absl import flags

    from tfmp import config, registry
    from tfmp.tasks import stage

    flag_values = flags.FlagValues()
    config.define_flags(flag_values)
    flag_values(["tfmp.train", f"--flagfile={os.path.join(REPO, 'experiments', f'{preset}.cfg')}"])
    parsed = config.validate(config.from_flags(flag_values))
    assert (parsed.task, parsed.model) == (task, "vit_tiny_p4")
    models.check_image_size(parsed.model, (32, 32, 3))
    stage.check_method_settings(parsed)
    registry.SSL_METHODS.load(task).check_inputs(parsed, (32, 32, 3))


@pytest.mark.slow  # ~40 s
def test_a_vit_pretrained_by_the_cli_serves_linear_eval_and_finetune(tmp_path):
    from tfmp import training
    from tfmp.config import Config, UsageError

    common = dict(dataset="digits", model="vit_micro_p2", precision="float32", strategy="off", global_batch_size=128,
                  label_fraction=0.05, probe_epochs=5, flip=False)
    metrics = training.run(Config(task="mocov3", epochs=2, **common), str(tmp_path / "pretrain"))
    assert metrics["method"] == "mocov3" and np.isfinite(metrics["train_loss"])
    encoder = str(tmp_path / "pretrain" / "encoder.keras")
    evaluation = training.run(Config(task="linear_eval", encoder=encoder, **common), str(tmp_path / "eval"))
    assert evaluation["linear_probe_accuracy"] > 0.2  # chance is 0.1 on digits' 10 classes
    assert evaluation["knn_accuracy"] == pytest.approx(metrics["knn_accuracy"])  # the same encoder, the same labels
    finetuned = training.run(Config(task="finetune", encoder=encoder, epochs=20, learning_rate=1e-3, **common),
                             str(tmp_path / "finetune"))
    assert finetuned["eval_accuracy"] > 0.2
    decayed = training.run(Config(task="finetune", encoder=encoder, epochs=20, learning_rate=1e-3, layer_decay=0.75, **common),
                           str(tmp_path / "finetune_decayed"))
    assert decayed["eval_accuracy"] > 0.2
    # At another resolution than it learned (digits at 16 px: 64 tokens instead of 16), adopted back to any resolution.
    larger = training.run(Config(task="linear_eval", encoder=encoder, image_size=16, **common), str(tmp_path / "eval16"))
    assert larger["linear_probe_accuracy"] > 0.2
    with pytest.raises(UsageError, match=r"takes images with sides a multiple of 2 and 1 channel, digits gives \(9, 9, 1\)"):
        training.run(Config(task="linear_eval", encoder=encoder, image_size=9, **common), str(tmp_path / "eval9"))
    assert not os.path.exists(tmp_path / "eval9" / "metrics.json")


@pytest.mark.slow  # ~60 s
def test_the_cli_fine_tunes_with_layer_decay_under_zero3_as_unsharded(tmp_path):
    """`--task=finetune --layer_decay=0.75` on 2 replicas: `--sharding=zero3` ends with the unsharded run's loss and
    accuracy."""
    from tfmp import training
    from tfmp.config import Config

    common = dict(dataset="digits", model="vit_micro_p2", precision="float32", global_batch_size=128, label_fraction=0.05,
                  probe_epochs=2, flip=False)
    training.run(Config(task="mocov3", epochs=1, strategy="off", **common), str(tmp_path / "pretrain"))
    encoder = str(tmp_path / "pretrain" / "encoder.keras")
    runs = {sharding: training.run(Config(task="finetune", encoder=encoder, epochs=3, learning_rate=1e-3, layer_decay=0.75,
                                          sharding=sharding, strategy="mirrored", num_cpu_devices=2, **common),
                                   str(tmp_path / sharding)) for sharding in ("none", "zero3")}
    assert runs["zero3"]["train_loss"] == pytest.approx(runs["none"]["train_loss"], rel=1e-4)
    assert runs["zero3"]["eval_accuracy"] == pytest.approx(runs["none"]["eval_accuracy"], abs=0.01)


@pytest.mark.slow  # ~13 s: fp16 is TensorFlow's slow path on a CPU
def test_fp16_with_loss_scaling_trains_the_digits_vit_preset_model_without_overflow():
    """The digits ViT preset's encoder and method (MoCo v3) under mixed_float16 with tfmp's dynamic loss scale
    (starting at Keras' 2^15): a few steps, none skipped, so the scale never had to come down."""
    precision.set_policy("mixed_float16")
    model = _ssl_method_on_a_tiny_vit("mocov3", tf.distribute.get_strategy())
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    digits = data.load("digits")
    history = model.fit(data.classification_pipeline(digits.train, 64, training=True, indices=np.arange(256)), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert precision.skipped_steps(model.optimizer) == 0
    assert precision.current_loss_scale(model.optimizer) == 2.0 ** 15  # never halved (growth needs 2,000 steps)


PEER = os.path.join(REPO, "experiments", "benchmarks", "torch_vit_peer.py")


def test_the_pytorch_peer_builds_the_sizes_tfmp_builds():
    import dataclasses
    import runpy

    peer = runpy.run_path(PEER)
    assert peer["vit_sizes"]() == {name: dataclasses.asdict(size) for name, size in vit.SIZES.items()}
    torch = pytest.importorskip("torch")  # never a tfmp dependency: checked where it is installed
    network = peer["build"](torch, peer["vit_sizes"]()["vit_tiny_p4"], 32)
    encoder = models.build_encoder("vit_tiny_p4", (32, 32, 3))
    # + its 10-class head, + the patch convolution's bias (folded into the position embedding in tfmp's)
    assert sum(parameter.numel() for parameter in network.parameters()) == encoder.count_params() + (192 * 10 + 10) + 192


@pytest.mark.parametrize("replicas", [1, 2])
def test_layer_decay_scales_each_blocks_learning_rate(replicas):
    """`--layer_decay=0.5` on a 2-block ViT classifier, one SGD step: each variable moves by its gradient times the
    learning rate times 0.5^3 (patch embedding), 0.5^2 (block 0), 0.5 (block 1), 1 (final norm, head)."""
    from tfmp import optimizers

    size = vit.ViTSize(patch=2, width=8, depth=2, heads=2, mlp_width=16)
    images = np.random.default_rng(0).normal(size=(8, 8, 8, 1)).astype(np.float32)
    labels = np.arange(8) % 10

    def classifier(strategy):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = models.build_classifier(vit.vision_transformer((8, 8, 1), size, "tiny"), 10)
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    reference = classifier(tf.distribute.get_strategy())
    with tf.GradientTape() as tape:
        loss = reference.compute_loss(y=labels, y_pred=reference(images, training=True))
    gradients = [gradient.numpy() for gradient in tape.gradient(loss, reference.trainable_variables)]
    model = classifier(distribute.get_strategy("mirrored") if replicas == 2 else tf.distribute.get_strategy())
    optimizers.decay_learning_rate_by_layer(model.optimizer, model.trainable_variables, 0.5)
    # Again, as a compiled model trained once per label draw is (`CompiledOnce`): decayed once, not 0.25, 0.0625, ...
    optimizers.decay_learning_rate_by_layer(model.optimizer, model.trainable_variables, 0.5)
    with pytest.raises(ValueError, match="decays its learning rate by layer at 0.5 already, not 0.75"):
        optimizers.decay_learning_rate_by_layer(model.optimizer, model.trainable_variables, 0.75)
    before = [variable.numpy().copy() for variable in model.trainable_variables]
    model.fit(images, labels, batch_size=8, epochs=1, shuffle=False, verbose=0)
    expected = {"patch_embedding": 0.125, "block0": 0.25, "block1": 0.5, "final_norm": 1.0, "logits": 1.0}
    seen = set()
    for variable, start, gradient in zip(model.trainable_variables, before, gradients):
        part = next(name for name in expected if f"{name}/" in variable.path or f"{name}_" in variable.path)
        seen.add(part)
        np.testing.assert_allclose(start - variable.numpy(), 0.1 * expected[part] * gradient, rtol=2e-4, atol=1e-7,
                                   err_msg=variable.path)
    assert seen == set(expected)
    with pytest.raises(ValueError, match="--layer_decay is for ViT encoders"):
        optimizers.layer_decay_factors(models.build_encoder("small_cnn", (8, 8, 1)).trainable_variables, 0.5)
    from tfmp.config import Config, UsageError, validate

    with pytest.raises(UsageError, match=r"^--layer_decay=0.5 is for --task=finetune or --compare_finetune of a ViT encoder, "
                                         r"above 0 \(got --task=simclr\)$"):
        validate(Config(task="simclr", layer_decay=0.5))
    validate(Config(task="mae", model="vit_micro_p2", compare_finetune=True, layer_decay=0.5, sharding="zero3"))  # sharded


@pytest.mark.parametrize("stage, replicas", [("zero1", 2), ("zero3", 2), pytest.param("zero1", 1, marks=pytest.mark.slow)])
def test_layer_decay_under_sharding_ends_where_the_unsharded_optimizer_does(stage, replicas):
    """SGD with momentum and decoupled weight decay (which keeps the schedule's learning rate) and `--layer_decay=0.5`,
    3 steps of `fit()`: each sharded stage's weights equal the unsharded optimizer's within float32 rounding, on 2
    replicas (the sharded step's own rule) and on 1 (the wrapped optimizer's step). (Not Adam: the attention's key bias
    has a zero gradient up to round-off, which Adam's normalisation turns into steps of either sign.)"""
    from tfmp import optimizers
    from tfmp.sharding import ShardedOptimizer

    size = vit.ViTSize(patch=2, width=8, depth=2, heads=2, mlp_width=16)
    images = np.random.default_rng(0).normal(size=(8, 8, 8, 1)).astype(np.float32)
    labels = np.arange(8) % 10
    strategy = distribute.get_strategy("mirrored") if replicas == 2 else tf.distribute.get_strategy()

    def trained(stage):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = models.build_classifier(vit.vision_transformer((8, 8, 1), size, "tiny"), 10)
            optimizer = keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.1)
            model.compile(optimizer=optimizer if stage == "none" else ShardedOptimizer(optimizer, stage=stage),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        optimizers.decay_learning_rate_by_layer(model.optimizer, model.trainable_variables, 0.5)
        model.fit(images, labels, batch_size=8, epochs=3, shuffle=False, verbose=0)
        return {variable.path: variable.numpy() for variable in model.trainable_variables}

    unsharded, sharded = trained("none"), trained(stage)
    assert sharded.keys() == unsharded.keys()
    for path, weight in unsharded.items():
        np.testing.assert_allclose(sharded[path], weight, rtol=1e-5, atol=1e-6, err_msg=path)
