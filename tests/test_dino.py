"""DINO (tfmp/ssl/dino.py): its loss against NumPy, the centre across replicas, multi-crop views drawn per replica, the
frozen last layer, a tiny ViT trained under every policy and on 2 replicas, the XLA step, the checks before a run."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp import distribute, models, precision
from tfmp.config import Config, UsageError
from tfmp.data import augment
from tfmp.ssl import dino


def _softmax(logits):
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def _numpy_dino_loss(student, teacher, center, batch, student_temperature, teacher_temperature):
    """The paper's Algorithm 1, crop by crop: each global crop's centred, sharpened teacher against every other crop."""
    crops = student.shape[0] // batch
    log_student = [np.log(_softmax(student[v * batch:(v + 1) * batch] / student_temperature)) for v in range(crops)]
    teacher = [_softmax((teacher[q * batch:(q + 1) * batch] - center) / teacher_temperature) for q in range(2)]
    terms = [np.mean(-np.sum(teacher[q] * log_student[v], axis=-1)) for q in range(2) for v in range(crops) if v != q]
    return np.mean(terms)


@pytest.mark.parametrize("crops", [2, 5])
def test_the_loss_matches_numpy(crops):
    rng = np.random.default_rng(0)
    batch, prototypes = 3, 7
    student = rng.normal(size=(crops * batch, prototypes)).astype(np.float32)
    teacher = rng.normal(size=(2 * batch, prototypes)).astype(np.float32)
    center = rng.normal(size=(prototypes,)).astype(np.float32)
    loss = dino.dino_loss(tf.constant(student), tf.constant(teacher), tf.constant(center), tf.constant(batch), 0.1, tf.constant(0.04))
    expected = _numpy_dino_loss(student.astype(np.float64), teacher.astype(np.float64), center, batch, 0.1, 0.04)
    assert float(loss) == pytest.approx(expected, rel=1e-5)


def _dino(strategy, seed=0, **kwargs):
    keras.utils.set_random_seed(seed)
    options = dict(projection_dim=16, prototypes=32, local_crops=2, num_classes=10, seed=seed, total_steps=4, epochs=2,
                   augment_config=augment.AugmentConfig(crop_scale=(0.4, 1.0), flip=False))
    with strategy.scope():
        model = dino.DINO(models.build_encoder("vit_micro_p2", (8, 8, 1)), **{**options, **kwargs})
    return model


def test_the_centre_is_the_mean_over_every_replica_and_the_same_on_each():
    strategy = distribute.get_strategy("mirrored")
    model = _dino(strategy, center_momentum=0.75)
    teachers = np.random.default_rng(0).normal(size=(2, 6, 32)).astype(np.float32)  # replica 1's differ from replica 0's

    @tf.function
    def step():
        def replica():
            return model.update_center(tf.gather(tf.constant(teachers), tf.distribute.get_replica_context().replica_id_in_sync_group))
        strategy.run(replica)

    step()
    expected = 0.25 * teachers.reshape(12, 32).mean(axis=0)  # 0.75 x the zero centre + 0.25 x the global batch's mean
    copies = strategy.experimental_local_results(model.center.value)
    assert len(copies) == 2
    for copy in copies:
        np.testing.assert_allclose(copy.numpy(), expected, rtol=1e-5, atol=1e-7)


def test_the_crops_are_drawn_per_replica_and_reproducible():
    model = _dino(tf.distribute.get_strategy(), local_crops=3)
    images = tf.random.stateless_uniform((4, 8, 8, 1), seed=[0, 1])
    drawn = {replica: model._draw_views(images, augment.step_seed(0, tf.constant(5), replica)) for replica in (0, 1)}
    (global_0, local_0), (global_1, local_1) = drawn[0], drawn[1]
    assert global_0.shape == (8, 8, 8, 1) and local_0.shape == (12, 4, 4, 1)  # 96/224 of 8 px on 2-px patches: 4 px
    again = model._draw_views(images, augment.step_seed(0, tf.constant(5), 0))
    np.testing.assert_array_equal(again[0].numpy(), global_0.numpy())
    np.testing.assert_array_equal(again[1].numpy(), local_0.numpy())
    assert not np.allclose(global_0.numpy(), global_1.numpy()) and not np.allclose(local_0.numpy(), local_1.numpy())
    first, second, third = np.split(local_0.numpy(), 3)
    assert not np.allclose(first, second) and not np.allclose(second, third)


def _digits(count=64):
    rng = np.random.default_rng(0)
    return rng.random((count, 8, 8, 1)).astype(np.float32), np.arange(count) % 10


def test_the_last_layer_is_frozen_for_its_epochs_then_trains():
    model = _dino(tf.distribute.get_strategy(), freeze_last_layer_epochs=1.0)  # 4 steps in 2 epochs: frozen for 2
    model.compile(optimizer=keras.optimizers.Adam(1e-2))  # no weight decay: a frozen kernel must not move at all
    images, labels = _digits()
    last, hidden = model.last_layer(), model.projector.layers[0].kernel
    last_before, hidden_before = last.numpy().copy(), hidden.numpy().copy()
    model.fit(images, labels, batch_size=32, epochs=1, verbose=0)
    np.testing.assert_array_equal(last.numpy(), last_before)
    assert not np.allclose(hidden.numpy(), hidden_before)
    model.fit(images, labels, batch_size=32, epochs=1, verbose=0)
    assert not np.allclose(last.numpy(), last_before)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_a_tiny_vit_trains_under_every_policy(policy):
    precision.set_policy(policy)
    model = _dino(tf.distribute.get_strategy(), freeze_last_layer_epochs=0.0)
    model.compile(optimizer=precision.wrap_optimizer(keras.optimizers.AdamW(1e-3)))
    target_before = [weight.numpy().copy() for weight in model.target_weights()]
    images, labels = _digits(32 if policy == "mixed_float16" else 64)  # fp16 is TensorFlow's slow path on a CPU
    history = model.fit(images, labels, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all() and history.history["loss"][-1] > 0
    assert all(np.isfinite(weight.numpy()).all() for weight in model.weights)
    assert any(not np.allclose(weight.numpy(), before) for weight, before in zip(model.target_weights(), target_before))
    if policy == "mixed_float16":
        assert int(model.optimizer.iterations.numpy()) == 2  # no step skipped for an overflow
    assert model.center.numpy().any()


def test_two_replicas_train_and_the_step_compiles_with_xla():
    images, labels = _digits()
    strategy = distribute.get_strategy("mirrored")
    mirrored = _dino(strategy)
    with strategy.scope():
        mirrored.compile(optimizer=keras.optimizers.AdamW(1e-3))
    history = mirrored.fit(images, labels, batch_size=32, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    copies = strategy.experimental_local_results(mirrored.center.value)
    np.testing.assert_array_equal(copies[0].numpy(), copies[1].numpy())
    compiled = _dino(tf.distribute.get_strategy())
    compiled.compile(optimizer=keras.optimizers.AdamW(1e-3), jit_compile=True)
    assert np.isfinite(compiled.fit(images, labels, batch_size=32, epochs=1, verbose=0).history["loss"]).all()


# 2 replicas and the padded batch under -m slow: ~25 s each.
@pytest.mark.parametrize("batch, replicas", [(32, 1), pytest.param(32, 2, marks=pytest.mark.slow),
                                             pytest.param(30, 1, marks=pytest.mark.slow)])
def test_micro_batches_give_the_one_batch_step(batch, replicas):
    """--gradient_accumulation_steps=2 (and 4): each micro-batch takes its images' global and local crops and the
    teacher's outputs for them; the step equals the one-batch step, on one device and on 2 replicas. 30 images in 4
    micro-batches are padded to 32 (each crop with copies of its last row, which then count twice): that step is
    checked to run and stay finite."""
    digits_images = tf.random.stateless_uniform((batch, 8, 8, 1), seed=[5, 6])
    labels = tf.range(batch) % 10
    strategy = distribute.get_strategy("mirrored") if replicas == 2 else tf.distribute.get_strategy()
    after = {}
    for steps in ((1, 2) if batch == 32 else (4,)):
        model = _dino(strategy, gradient_accumulation_steps=steps, freeze_last_layer_epochs=0.0)
        with strategy.scope():
            model.compile(optimizer=keras.optimizers.SGD(1.0))
        model.fit(digits_images, labels, batch_size=batch, shuffle=False, epochs=1, verbose=0)
        after[steps] = model
    if batch == 30:
        assert all(np.isfinite(weight.numpy()).all() for weight in after[4].weights)
        return
    one, two = after[1], after[2]
    for a, b in zip(one.trainable_weights, two.trainable_weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-4, atol=1e-5, err_msg=a.path)
    np.testing.assert_allclose(two.center.numpy(), one.center.numpy(), rtol=1e-6)  # from the whole batch's teacher


def test_a_run_dino_cannot_take_is_refused_before_it_starts():
    with pytest.raises(UsageError, match=r"^--task=dino's local crops would be 3x3 px: model vit_micro_p2 cuts 2x2 patches: the "
                                         r"image size must be a multiple of 2, got 3x3; set --local_crop_size, --local_crops=0 or "
                                         r"a larger --image_size$"):
        dino.DINO.check_inputs(Config(task="dino", model="vit_micro_p2", local_crop_size=3), (8, 8, 1))
    with pytest.raises(UsageError, match=r"^--task=dino's local crops would be 3x3 px: model small_cnn needs images of at least "
                                         r"8px, got 3; set"):  # the default model and crops on 8x8 digits
        dino.DINO.check_inputs(Config(task="dino"), (8, 8, 1))
    dino.DINO.check_inputs(Config(task="dino", model="vit_micro_p2"), (8, 8, 1))  # 4-px local crops: fine


def test_the_memory_estimate_counts_the_local_crops_by_their_pixels():
    from tfmp import data, training
    from tfmp.runtime import Runtime

    digits = data.load("digits")
    runtime = Runtime.for_strategy(tf.distribute.get_strategy())
    assert dino.DINO.views_per_example(Config(task="dino", model="vit_micro_p2"), (8, 8, 1)) == 2 + 6 * (4 / 8) ** 2
    assert dino.DINO.views_per_example(Config(task="dino", local_crops=0), (8, 8, 1)) == 2
    with_locals = training._memory_estimate(Config(task="dino", model="vit_micro_p2", global_batch_size=64), digits, runtime)
    without = training._memory_estimate(Config(task="dino", model="vit_micro_p2", global_batch_size=64, local_crops=0), digits,
                                        runtime)
    per_view = (without.activations_bytes - without.fixed_activations_bytes) / 2
    assert with_locals.activations_bytes - with_locals.fixed_activations_bytes == pytest.approx(3.5 * per_view, rel=1e-6)
