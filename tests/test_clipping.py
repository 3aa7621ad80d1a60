"""Gradient clipping by the global norm of the summed, unscaled gradient (`tfmp.clipping`, and the sharded step), on
2 CPU replicas against one device on the whole batch: Keras' own `global_clipnorm` clips each replica's gradient."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp import clipping, distribute, precision, sharding

CLIPNORM = 0.05  # well below the gradient norm of these steps (checked): every step is clipped
STEPS = 5


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 8, 8, 1)).astype(np.float32), (np.arange(32) % 10).astype(np.int64)


def _model(strategy, make_optimizer):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu", name="conv"),
                                  keras.layers.Flatten(), keras.layers.Dense(10, name="logits")])
        model.optimizer = make_optimizer()
        model.optimizer.build(model.trainable_variables)
    return model


def _loss(model, images, labels, replicas):
    logits = model(images, training=True)
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)) / replicas


def _train(model, strategy, images, labels, steps=STEPS, poison_step=-1):
    """A custom `strategy.run` loop: each replica its slice of one batch of 32; the loss of replica 1 (or of the one
    device) is made infinite at `poison_step`."""
    replicas = strategy.num_replicas_in_sync
    per_replica = images.shape[0] // replicas

    def replica_step(step):
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        rows = tf.range(per_replica) + replica * per_replica
        with tf.GradientTape() as tape:
            loss = _loss(model, tf.gather(images, rows), tf.gather(labels, rows), replicas)
            poisoned = tf.logical_and(tf.equal(step, poison_step), tf.equal(replica, min(1, replicas - 1)))
            loss = loss * tf.where(poisoned, tf.constant(np.inf, loss.dtype), tf.constant(1.0, loss.dtype))
            if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
                loss = model.optimizer.scale_loss(loss)
        model.optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    step_function = tf.function(lambda step: strategy.run(replica_step, args=(step,)))
    for step in range(steps):
        step_function(tf.constant(step))


def _weights(model):
    return [w.numpy() for w in model.trainable_variables]


def _assert_close(actual, expected, tolerance=2e-6):
    for a, b in zip(actual, expected):
        np.testing.assert_allclose(a, b, rtol=tolerance, atol=tolerance)


def _one_device_reference(make_optimizer, images, labels):
    model = _model(tf.distribute.get_strategy(), make_optimizer)
    with tf.GradientTape() as tape:
        loss = _loss(model, images, labels, 1)
    gradients = tape.gradient(loss, model.trainable_variables)
    norm = float(tf.linalg.global_norm(gradients))
    assert norm > 3 * CLIPNORM, norm  # the clipping acts
    _train(model, tf.distribute.get_strategy(), images, labels)
    return _weights(model)


def test_keras_clips_each_replicas_gradient_and_tfmp_clips_their_sum():
    images, labels = _data()
    keras_own = lambda: keras.optimizers.SGD(0.5, global_clipnorm=CLIPNORM)  # noqa: E731
    reference = _one_device_reference(keras_own, images, labels)
    strategy = distribute.get_strategy("mirrored")

    per_replica = _model(strategy, keras_own)  # Keras: each replica clips its half-batch gradient by its own norm
    _train(per_replica, strategy, images, labels)
    assert max(float(np.abs(a - b).max()) for a, b in zip(_weights(per_replica), reference)) > 1e-3

    summed = _model(strategy, lambda: clipping.clip_after_reduction(keras_own()))
    assert summed.optimizer.global_clipnorm is None  # Keras' own clipping is off: clipped once, after the sum
    _train(summed, strategy, images, labels)
    _assert_close(_weights(summed), reference)


@pytest.mark.parametrize("kind", ["adamw", "lars"])
def test_the_sharded_step_clips_by_the_norm_summed_across_its_chunks(kind):
    from tfmp import optimizers

    images, labels = _data()

    def inner():
        if kind == "lars":
            return optimizers.LARS(0.05, momentum=0.9, weight_decay=1e-4)
        return keras.optimizers.AdamW(1e-2, weight_decay=0.05)

    reference = _one_device_reference(lambda: clipping.clip_after_reduction(inner(), CLIPNORM), images, labels)
    strategy = distribute.get_strategy("mirrored")
    sharded = _model(strategy, lambda: sharding.ZeroOneOptimizer(inner(), global_clipnorm=CLIPNORM))
    _train(sharded, strategy, images, labels)
    _assert_close(_weights(sharded), reference, tolerance=1e-5)
    # The inner optimizer's own setting is taken the same way (Keras' name, on Keras' optimizer).
    adopted = _model(strategy, lambda: sharding.ZeroOneOptimizer(
        optimizers.LARS(0.05, momentum=0.9, weight_decay=1e-4, global_clipnorm=CLIPNORM) if kind == "lars"
        else keras.optimizers.AdamW(1e-2, weight_decay=0.05, global_clipnorm=CLIPNORM)))
    _train(adopted, strategy, images, labels)
    _assert_close(_weights(adopted), _weights(sharded), tolerance=0)


@pytest.mark.parametrize("zero1", [False, True], ids=["none", "zero1"])
def test_fp16_an_overflow_on_one_replica_is_skipped_before_clipping_and_the_true_gradient_is_clipped(zero1):
    """fp16: the step whose loss overflows on replica 1 only is skipped on both replicas (the weights stay); the
    others clip the unscaled gradient: the weights follow one float32 device that never saw the poisoned step."""
    images, labels = _data()
    make_inner = lambda: keras.optimizers.SGD(0.5)  # noqa: E731
    reference_model = _model(tf.distribute.get_strategy(), lambda: clipping.clip_after_reduction(make_inner(), CLIPNORM))
    start = _weights(reference_model)
    _train(reference_model, tf.distribute.get_strategy(), images, labels, steps=STEPS - 1)
    moved = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(_weights(reference_model), start)))
    assert moved == pytest.approx((STEPS - 1) * 0.5 * CLIPNORM, rel=0.05)  # 4 clipped steps of lr 0.5, roughly in line
    precision.set_policy("mixed_float16")  # tests/conftest.py puts float32 back
    strategy = distribute.get_strategy("mirrored")

    def make_optimizer():
        inner = (sharding.ZeroOneOptimizer(make_inner(), global_clipnorm=CLIPNORM) if zero1
                 else clipping.clip_after_reduction(make_inner(), CLIPNORM))
        return precision.wrap_optimizer(inner)

    model = _model(strategy, make_optimizer)
    _train(model, strategy, images, labels, poison_step=2)
    assert precision.skipped_steps(model.optimizer) == 1
    # float16 activations: within fp16 rounding of the float32 device, far below the distance the steps moved (a
    # gradient clipped while still scaled, or an unskipped overflow, would be off by about all of it).
    off = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(_weights(model), _weights(reference_model))))
    assert off < 0.02 * moved, (off, moved)


def test_fit_clips_the_summed_gradient_like_one_device():
    """The user's shape: `compile(optimizer=...)` and `fit()` on 2 replicas against 1 device, the whole batch."""
    images, labels = _data()
    results = []
    for strategy in (tf.distribute.get_strategy(), distribute.get_strategy("mirrored")):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(10)])
            model.compile(optimizer=clipping.clip_after_reduction(keras.optimizers.AdamW(1e-2), CLIPNORM),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(images, labels, batch_size=32, epochs=3, shuffle=False, verbose=0)
        results.append(_weights(model))
    _assert_close(results[1], results[0], tolerance=1e-5)


def test_clipping_refuses_what_it_cannot_honour_in_one_line():
    with pytest.raises(ValueError, match=r"^global_clipnorm must be above 0, got None$"):
        clipping.clip_after_reduction(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match=r"^SGD also clips per tensor \(clipnorm / clipvalue\); use one clipping$"):
        clipping.clip_after_reduction(keras.optimizers.SGD(0.1, clipnorm=1.0), 1.0)
    with pytest.raises(ValueError, match=r"^sharding=zero1: clipnorm=1.0 and global_clipnorm=2.0; use one clipping$"):
        sharding.ZeroOneOptimizer(keras.optimizers.SGD(0.1, clipnorm=1.0), global_clipnorm=2.0)
    with pytest.raises(ValueError, match=r"^sharding=zero3 does not support clipvalue \(set on SGD\)$"):
        sharding.ShardedOptimizer(keras.optimizers.SGD(0.1, clipvalue=1.0), stage="zero3")


def test_the_setting_reaches_the_optimizer_the_run_builds():
    from tfmp import optimizers
    from tfmp.config import Config, UsageError, validate

    with pytest.raises(UsageError, match=r"^global_clipnorm must be >= 0, got -1.0$"):
        validate(Config(global_clipnorm=-1.0))
    plain = optimizers.make_optimizer(validate(Config(global_clipnorm=1.5)), steps_per_epoch=10)
    assert plain.clipped_after_reduction == 1.5 and plain.global_clipnorm is None
    sharded = optimizers.make_optimizer(validate(Config(global_clipnorm=1.5, sharding="zero1")), steps_per_epoch=10)
    assert isinstance(sharded, sharding.ShardedOptimizer) and sharded.stage == "zero1" and sharded.global_clipnorm == 1.5
    assert sharded.inner.global_clipnorm is None
    unclipped = optimizers.make_optimizer(validate(Config()), steps_per_epoch=10)
    assert not unclipped.global_clipnorm and not hasattr(unclipped, "clipped_after_reduction")


def test_per_variable_clipping_acts_on_the_summed_gradient_like_keras_clipnorm_on_one_device():
    """`--clipnorm` (DINO's clip_grad): each variable's gradient clipped by its own norm, after the replicas' sum — on 2
    replicas the steps of Keras' `clipnorm` on one device; Keras' own on 2 replicas clips each half-batch gradient."""
    from tfmp import optimizers
    from tfmp.config import Config, UsageError, validate

    images, labels = _data()
    keras_own = lambda: keras.optimizers.SGD(0.5, clipnorm=CLIPNORM)  # noqa: E731
    reference = _one_device_reference(keras_own, images, labels)
    strategy = distribute.get_strategy("mirrored")
    per_replica = _model(strategy, keras_own)
    _train(per_replica, strategy, images, labels)
    assert max(float(np.abs(a - b).max()) for a, b in zip(_weights(per_replica), reference)) > 1e-3
    summed = _model(strategy, lambda: clipping.clip_after_reduction(keras.optimizers.SGD(0.5), CLIPNORM, per_tensor=True))
    _train(summed, strategy, images, labels)
    _assert_close(_weights(summed), reference)
    built = optimizers.make_optimizer(validate(Config(clipnorm=3.0)), steps_per_epoch=10)
    assert built.clipped_after_reduction == 3.0 and not built.clipnorm
    sharded = optimizers.make_optimizer(validate(Config(clipnorm=3.0, sharding="zero3")), steps_per_epoch=10)
    assert isinstance(sharded, sharding.ShardedOptimizer) and sharded.clipnorm == 3.0 and not sharded.inner.clipnorm
    with pytest.raises(UsageError, match=r"^--clipnorm \(per variable\) cannot be combined with --global_clipnorm; "
                                         r"use one clipping$"):
        validate(Config(clipnorm=3.0, global_clipnorm=1.0))


@pytest.mark.parametrize("stage", ["zero1", "zero3"])
def test_the_sharded_step_clips_each_variable_by_its_norm_summed_across_its_chunks(stage):
    """Per-variable clipping under sharding, on 2 replicas: the steps of Keras' `clipnorm` on one device, at a
    threshold that clips some variables' gradients and not others."""
    images, labels = _data()
    probe = _model(tf.distribute.get_strategy(), lambda: keras.optimizers.SGD(0.5))
    with tf.GradientTape() as tape:
        loss = _loss(probe, images, labels, 1)
    norms = sorted(float(tf.norm(gradient)) for gradient in tape.gradient(loss, probe.trainable_variables))
    threshold = (norms[1] + norms[2]) / 2  # two variables clipped at the first step, two not
    reference = _one_device_reference(lambda: keras.optimizers.SGD(0.5, momentum=0.9, clipnorm=threshold), images, labels)
    strategy = distribute.get_strategy("mirrored")
    sharded = _model(strategy, lambda: sharding.ShardedOptimizer(keras.optimizers.SGD(0.5, momentum=0.9), stage=stage,
                                                                 clipnorm=threshold))
    _train(sharded, strategy, images, labels)
    _assert_close(_weights(sharded), reference, tolerance=1e-5)
    unclipped = _model(strategy, lambda: sharding.ShardedOptimizer(keras.optimizers.SGD(0.5, momentum=0.9), stage=stage))
    _train(unclipped, strategy, images, labels)
    assert max(float(np.abs(a - b).max()) for a, b in zip(_weights(unclipped), reference)) > 1e-3
