"""Self-supervised pieces: NT-Xent across replicas, augmentation RNG discipline, SimCLR steps, LARS, probes, guard."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp import compilation, data, distribute, models, optimizers, precision
from tfmp.data import augment
from tfmp.ssl import guard, probes
from tfmp.ssl.losses import nt_xent
from tfmp.ssl.simclr import SimCLR


def _reference_nt_xent(z1, z2, temperature):
    """NumPy transcription of the PyTorch peer's loss (shared/bench/torch_simclr_peer.py)."""
    z = np.concatenate([z1, z2]).astype(np.float64)
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    n = len(z1)
    logits = z @ z.T / temperature
    np.fill_diagonal(logits, -np.inf)
    labels = np.concatenate([np.arange(n, 2 * n), np.arange(n)])
    log_softmax = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
    return -log_softmax[np.arange(2 * n), labels].mean()


def test_nt_xent_matches_the_reference_formula():
    rng = np.random.default_rng(0)
    z1, z2 = rng.normal(size=(6, 5)).astype(np.float32), rng.normal(size=(6, 5)).astype(np.float32)
    loss, _ = nt_xent(tf.constant(z1), tf.constant(z2), 0.5)
    assert float(loss) == pytest.approx(_reference_nt_xent(z1, z2, 0.5), rel=1e-5)


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_nt_xent_is_float32_for_low_precision_inputs(dtype):
    z = tf.cast(tf.random.stateless_normal((8, 16), seed=[1, 2]) * 30.0, dtype)
    loss, accuracy = nt_xent(z, z + tf.cast(0.1, dtype), 0.05)
    assert loss.dtype == tf.float32 and np.isfinite(float(loss)) and float(accuracy) == 1.0


def test_nt_xent_on_two_replicas_equals_one_device_loss_and_gradients():
    """Negatives gathered across replicas: same loss and gradients as one device on the global batch."""
    rng = np.random.default_rng(0)
    images = rng.normal(size=(8, 5)).astype(np.float32)
    noise = 0.1 * rng.normal(size=(8, 5)).astype(np.float32)
    initial = rng.normal(size=(5, 4)).astype(np.float32)

    weights = tf.Variable(initial)
    with tf.GradientTape() as tape:
        loss, _ = nt_xent(images @ weights, (images + noise) @ weights, 0.5)
    gradient = tape.gradient(loss, weights)

    strategy = distribute.get_strategy("mirrored")
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        mirrored_weights = tf.Variable(initial)

    def replica_step():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        rows = tf.range(4) + 4 * replica
        local_images, local_noise = tf.gather(images, rows), tf.gather(noise, rows)
        with tf.GradientTape() as tape:
            local_loss, _ = nt_xent(local_images @ mirrored_weights, (local_images + local_noise) @ mirrored_weights, 0.5)
            scaled = local_loss / 2  # Keras' convention: each replica's loss / N, gradients summed
        return local_loss, tape.gradient(scaled, mirrored_weights)

    losses, gradients = tf.function(lambda: strategy.run(replica_step))()
    replica_losses = [float(value) for value in strategy.experimental_local_results(losses)]
    assert np.mean(replica_losses) == pytest.approx(float(loss), rel=1e-6)
    assert replica_losses[0] != pytest.approx(replica_losses[1], rel=1e-3), "each replica has its own anchors"
    np.testing.assert_allclose(strategy.reduce("SUM", gradients, axis=None).numpy(), gradient.numpy(), atol=1e-6)


# ------------------------------------------------------------------------------ augmentations

@pytest.mark.parametrize("channels", [1, 3])
def test_augment_is_a_function_of_its_seed(channels):
    images = tf.random.stateless_uniform((6, 32, 32, channels), seed=[0, 0])
    first = augment.simclr_augment(images, tf.constant([1, 2]))
    again = augment.simclr_augment(images, tf.constant([1, 2]))
    other = augment.simclr_augment(images, tf.constant([1, 3]))
    assert first.shape == images.shape and first.dtype == tf.float32
    assert 0.0 <= float(tf.reduce_min(first)) and float(tf.reduce_max(first)) <= 1.0
    np.testing.assert_array_equal(first.numpy(), again.numpy())
    assert not np.allclose(first.numpy(), other.numpy())
    # Per-example draws: the same image twice in a batch gets two different views.
    twins = augment.simclr_augment(tf.concat([images[:1], images[:1]], 0), tf.constant([4, 4]))
    assert not np.allclose(twins[0].numpy(), twins[1].numpy())


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_augment_under_low_precision_policies(policy):
    precision.set_policy(policy)
    images = tf.random.stateless_uniform((4, 16, 16, 3), seed=[0, 1])
    views = augment.simclr_augment(images, tf.constant([5, 6]))
    assert views.dtype == tf.float32 and np.isfinite(views.numpy()).all()
    encoder = models.build_encoder("small_cnn", (16, 16, 3))
    assert np.isfinite(encoder(views).numpy().astype(np.float32)).all()


def test_step_seed_differs_by_step_and_replica():
    seeds = {tuple(augment.step_seed(0, step, replica).numpy()) for step in range(3) for replica in range(2)}
    assert len(seeds) == 6
    np.testing.assert_array_equal(augment.step_seed(7, 3, 1).numpy(), augment.step_seed(7, 3, 1).numpy())


def _simclr(strategy, seed=0, num_classes=10):
    with strategy.scope():
        encoder = models.build_encoder("small_cnn", (8, 8, 1), models.NormSettings(synchronized=True))
        model = SimCLR(encoder, num_classes=num_classes, projection_dim=16, seed=seed,
                       augment_config=augment.AugmentConfig(crop_scale=(0.4, 1.0), flip=False, noise_stddev=0.05))
        model.build((None, 8, 8, 1))
        model.compile(optimizer=precision.wrap_optimizer(keras.optimizers.SGD(0.05, momentum=0.9)))
    return model


def test_replicas_start_identical_and_draw_different_augmentations():
    strategy = distribute.get_strategy("mirrored")
    keras.utils.set_random_seed(0)
    model = _simclr(strategy)
    for variable in model.weights:
        copies = [value.numpy() for value in strategy.experimental_local_results(variable.value)]
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0])

    images = tf.random.stateless_uniform((4, 8, 8, 1), seed=[3, 3])  # the SAME images on both replicas
    views = strategy.run(tf.function(lambda: model.views(images)[0]))
    first, second = (value.numpy() for value in strategy.experimental_local_results(views))
    assert not np.allclose(first, second), "replicas must not draw the same augmentations"


def test_simclr_run_is_reproducible_from_its_seed():
    digits = data.load("digits")

    def train(seed):
        keras.utils.set_random_seed(seed)
        pipeline = data.classification_pipeline(digits.train, 64, training=True, seed=seed, indices=np.arange(256))
        model = _simclr(tf.distribute.get_strategy(), seed=seed)
        history = model.fit(pipeline, epochs=1, verbose=0, shuffle=False)
        return history.history["loss"][-1], [w.numpy() for w in model.encoder.weights]

    loss_a, weights_a = train(0)
    loss_b, weights_b = train(0)
    loss_c, _ = train(1)
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    for a, b in zip(weights_a, weights_b):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert loss_c != pytest.approx(loss_a, rel=1e-4)


@pytest.mark.slow  # ~45 s (fp16 is TF's slow CPU path); overflow skipping stays in the default suite through
# tests/test_loss_scale_replicas.py, test_accumulation.py, test_sharding.py and test_zero2.py
def test_simclr_under_fp16_scales_the_loss_and_skips_a_planted_overflow():
    precision.set_policy("mixed_float16")
    model = _simclr(tf.distribute.get_strategy())
    optimizer = model.optimizer
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    digits = data.load("digits")
    # Two fp16 steps (TensorFlow's slow path on a CPU: this test's cost is its step count).
    history = model.fit(data.classification_pipeline(digits.train, 64, training=True, indices=np.arange(128)), epochs=1, verbose=0)
    assert all(np.isfinite(history.history["loss"])) and "probe_accuracy" in history.history

    # A scale no fp16 gradient survives: both steps are skipped on every weight, the second halves it (hysteresis 2).
    optimizer.dynamic_scale.assign(2.0**40)
    images, labels = digits.train.dataset(np.arange(64)).batch(64).get_single_element()
    before, skipped = [weight.numpy() for weight in model.trainable_weights], precision.skipped_steps(optimizer)
    model.train_on_batch(images, labels)
    assert precision.skipped_steps(optimizer) == skipped + 1 and precision.current_loss_scale(optimizer) == 2.0**40
    model.train_on_batch(images, labels)
    assert precision.skipped_steps(optimizer) == skipped + 2 and precision.current_loss_scale(optimizer) == 2.0**39
    for old, new in zip(before, model.trainable_weights):
        np.testing.assert_array_equal(old, new.numpy())


def test_simclr_on_two_replicas_trains():
    strategy = distribute.get_strategy("mirrored")
    model = _simclr(strategy)
    digits = data.load("digits")
    history = model.fit(data.classification_pipeline(digits.train, 64, training=True, indices=np.arange(256)), epochs=2, verbose=0)
    chance = np.log(2 * 64 - 1)  # NT-Xent when every one of the 127 other views is as likely as the positive
    # Measured 3.82-3.95 after 2 epochs (seeds 0-2), with contrastive accuracy 0.18-0.21 (chance: 1/127).
    assert history.history["loss"][-1] < chance - 0.5 and history.history["loss"][-1] < history.history["loss"][0]
    assert history.history["contrastive_accuracy"][-1] > 0.1


# ------------------------------------------------------------------------------ LARS

def test_lars_adapts_matrices_and_leaves_biases_to_momentum_sgd():
    kernel = keras.Variable(np.full((2, 2), 2.0, np.float32), name="kernel")
    bias = keras.Variable(np.ones(2, np.float32), name="bias")
    optimizer = optimizers.LARS(learning_rate=0.1, momentum=0.9, weight_decay=0.5, eta=0.01)
    optimizer.build([kernel, bias])
    gradient = np.full((2, 2), 1.0, np.float32)
    optimizer.apply([tf.constant(gradient), tf.ones(2)], [kernel, bias])
    decayed = gradient + 0.5 * 2.0  # g + wd * w = 2 everywhere
    trust = 0.01 * np.linalg.norm(np.full((2, 2), 2.0)) / np.linalg.norm(np.full((2, 2), decayed))
    np.testing.assert_allclose(kernel.numpy(), 2.0 - 0.1 * trust * decayed, rtol=1e-6)
    np.testing.assert_allclose(bias.numpy(), 1.0 - 0.1 * 1.0, rtol=1e-6)  # no decay, no trust ratio


@pytest.mark.parametrize("scaling, expected", [("none", 0.3), ("linear", 0.6), ("sqrt", 0.3 * 512 ** 0.5)])
def test_learning_rate_scaling(scaling, expected):
    assert optimizers.scaled_learning_rate(0.3, 512, scaling) == pytest.approx(expected)


def test_warmup_then_cosine():
    schedule = optimizers.warmup_cosine(1.0, total_steps=110, warmup_steps=10)
    assert float(schedule(0)) == pytest.approx(0.0)
    assert float(schedule(10)) == pytest.approx(1.0)
    assert float(schedule(60)) == pytest.approx(0.5, abs=1e-3)
    assert float(schedule(110)) == pytest.approx(0.0, abs=1e-6)


# ------------------------------------------------------------------------------ labels, probes, guard

def test_balanced_subset_is_seeded_and_class_balanced():
    labels = data.load("digits").train.labels
    subset = data.balanced_subset(labels, 0.05, seed=0)
    counts = np.bincount(labels[subset], minlength=10)
    assert counts.min() >= 6 and counts.max() <= 8 and 65 <= len(subset) <= 75
    np.testing.assert_array_equal(subset, data.balanced_subset(labels, 0.05, seed=0))
    assert not np.array_equal(subset, data.balanced_subset(labels, 0.05, seed=1))
    assert len(data.balanced_subset(labels, 1.0, seed=0)) == len(labels)


def test_hidden_labels_become_minus_one():
    digits = data.load("digits")
    visible = np.array([0, 5])
    labels = np.concatenate([y for _, y in data.classification_pipeline(digits.train, 10, training=False, indices=np.arange(10),
                                                                          visible_labels=visible).as_numpy_iterator()])
    expected = np.full(10, -1)
    expected[visible] = digits.train.labels[visible]
    np.testing.assert_array_equal(labels, expected)


def test_knn_and_linear_probe_on_separable_features():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 8)) * 5
    labels = np.repeat(np.arange(3), 20)
    features = (centres[labels] + rng.normal(size=(60, 8))).astype(np.float32)
    assert probes.knn_accuracy(features[::2], labels[::2], features[1::2], labels[1::2], 3, k=5) == 1.0
    assert probes.linear_probe(features[::2], labels[::2], features[1::2], labels[1::2], 3, epochs=100) >= 0.95
    shuffled = rng.permutation(labels)  # features say nothing about these labels
    assert probes.knn_accuracy(features[::2], shuffled[::2], features[1::2], shuffled[1::2], 3, k=5) < 0.7


def test_small_data_guard():
    assert guard.check(100_000, 100, 256, 11_000_000) == []
    assert guard.check(1437, 100, 128, 93_000) == []  # the main job
    warnings = guard.check(150, 10, 128, 11_000_000)
    assert len(warnings) == 3
    assert "only 150 unlabeled images (guard: >= 200" in warnings[0]
    assert "10 pretraining steps" in warnings[1]
    assert "73,333 per image" in warnings[2]


def test_linear_probe_runs_the_same_steps_as_one_step_epochs():
    """linear_probe runs its epochs as one fit() in long executions; a full-batch probe must match
    Keras' plain epochs over NumPy arrays (an epoch = one step on all examples) step for step."""
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 3, 90)
    features = (rng.normal(size=(90, 6)) + 0.6 * labels[:, None]).astype(np.float32)  # overlapping classes
    train, test = slice(0, 30), slice(30, 90)
    for epochs in (1, 40):
        keras.utils.set_random_seed(0)
        normalization = keras.layers.Normalization(dtype="float32")
        normalization.adapt(features[train])
        reference = keras.Sequential([keras.Input((6,)), normalization, keras.layers.Dense(3, dtype="float32")])
        reference.compile(optimizer=keras.optimizers.AdamW(1e-2, weight_decay=1e-4),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        reference.fit(features[train], labels[train], epochs=epochs, batch_size=30, verbose=0)
        expected = reference.evaluate(features[test], labels[test], verbose=0)[1]
        assert probes.linear_probe(features[train], labels[train], features[test], labels[test], 3, epochs=epochs) == expected


def test_linear_probes_sharing_one_compiled_model_match_probes_of_their_own():
    """evaluate_over_draws traces one probe for all label draws (compilation.CompiledOnce): each
    draw's probe must start from the seeded weights with a fresh optimizer, as one of its own does."""
    rng = np.random.default_rng(2)
    labels = rng.integers(0, 3, 150)
    features = (rng.normal(size=(150, 6)) + 0.5 * labels[:, None]).astype(np.float32)
    test = slice(90, 150)
    draws = [slice(0, 30), slice(30, 60), slice(60, 90)]
    shared = compilation.CompiledOnce()
    with_shared = [probes.linear_probe(features[draw], labels[draw], features[test], labels[test], 3, epochs=30, compiled=shared)
                   for draw in draws]
    alone = [probes.linear_probe(features[draw], labels[draw], features[test], labels[test], 3, epochs=30) for draw in draws]
    assert with_shared == alone
    assert shared.model.optimizer.iterations.numpy() == 30  # the last draw's steps only
