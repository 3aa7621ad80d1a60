"""Guardrails: the NaN guard, loss-scale collapse, replica consistency, augmentation streams."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import checkpoint_steps_on_disk

from tfmp import callbacks, distribute, models, optimizers, precision
from tfmp.config import Config
from tfmp.data import augment


def test_absurd_learning_rate_stops_with_a_diagnosis_and_leaves_a_good_checkpoint(run_cli, tmp_path):
    workdir = tmp_path / "run"
    result = run_cli(f"--workdir={workdir}", "--precision=fp32", "--strategy=off", "--optimizer=sgd", "--learning_rate=1e8",
                     "--warmup_epochs=3", "--epochs=3", "--checkpoint_every_steps=2")
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("tfmp.train: error: training failed: training diverged")
    assert "not a precision problem but divergence: lower --learning_rate" in last_line
    assert "a rerun in this workdir may change learning_rate" in last_line
    assert not (workdir / "metrics.json").exists() and (workdir / "failure.json").exists()

    # The newest checkpoint is the last good one: it restores into a fresh model, all finite.
    model = models.build_classifier(models.build_encoder("small_cnn", (8, 8, 1)), 10)
    model.compile(optimizer=optimizers.make_optimizer(Config(optimizer="sgd", learning_rate=1e8, epochs=3), 11), loss="mse")
    checkpointing = callbacks.Checkpointing(str(workdir / "checkpoints"))
    checkpointing.set_model(model)
    assert checkpointing.restore_last_good()
    assert checkpointing.restored_step > 0
    assert all(np.isfinite(weight).all() for weight in model.get_weights())

    # The advice can be followed: the same command with a lower learning rate, in the same workdir, resumes and finishes.
    lowered = run_cli(f"--workdir={workdir}", "--precision=fp32", "--strategy=off", "--optimizer=sgd", "--learning_rate=0.01",
                      "--warmup_epochs=3", "--epochs=3", "--checkpoint_every_steps=2")
    assert lowered.returncode == 0, lowered.stderr[-2000:]
    assert "rerunning a failed run with learning_rate: 100000000.0 -> 0.01" in lowered.stdout
    assert (workdir / "metrics.json").exists() and not (workdir / "failure.json").exists()
    other = run_cli(f"--workdir={workdir}", "--precision=fp32", "--strategy=off", "--optimizer=adamw", "--learning_rate=0.01",
                    "--warmup_epochs=3", "--epochs=3", "--checkpoint_every_steps=2")
    assert other.returncode == 2 and "optimizer: 'sgd' -> 'adamw'" in other.stderr  # what is trained may not change


def _overflowing_fp16_model(min_scale):
    precision.set_policy("mixed_float16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, kernel_initializer="ones"),
                              keras.layers.Dense(1, dtype="float32", kernel_initializer="ones")])
    # Scaled by 2**15, these gradients overflow float16 (max 65504) on every step.
    model.compile(optimizer=precision.wrap_optimizer(keras.optimizers.SGD(1e-6), initial_loss_scale=2.0**15, min_scale=min_scale),
                  loss="mse")
    return model


def test_persistent_fp16_overflow_keeps_the_floor_skips_every_step_and_is_diagnosed(tmp_path):
    model = _overflowing_fp16_model(min_scale=2.0**14)
    x, y = np.ones((64, 4), np.float32), np.zeros((64, 1), np.float32)
    model.optimizer.build(model.trainable_variables)
    before = [w.copy() for w in model.get_weights()]
    guard_callbacks = callbacks.default_callbacks(str(tmp_path), max_skipped_steps=5)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=guard_callbacks)
    guard = guard_callbacks.guard

    assert precision.current_loss_scale(model.optimizer) == 2.0**14  # halved once, then held at the floor
    assert precision.skipped_steps(model.optimizer) >= 6
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)  # every step was skipped
    assert guard.diagnosis and "fp16 overflow" in guard.diagnosis and "mixed_bfloat16" in guard.diagnosis
    assert model.stop_training


def test_floor_and_skips_hold_under_mirrored_strategy():
    """The scale update runs in Keras' merge_call across replicas: both replicas' overflow is
    seen, the floor holds, and `current_loss_scale` / `skipped_steps` read the mirrored state."""
    strategy = distribute.get_strategy("mirrored")
    assert strategy.num_replicas_in_sync == 2
    with strategy.scope():
        model = _overflowing_fp16_model(min_scale=2.0**14)
        model.optimizer.build(model.trainable_variables)
    before = [w.copy() for w in model.get_weights()]
    model.fit(np.ones((64, 4), np.float32), np.zeros((64, 1), np.float32), batch_size=16, epochs=1, verbose=0)

    assert precision.current_loss_scale(model.optimizer) == 2.0**14
    assert precision.skipped_steps(model.optimizer) == 4  # 64 examples / global batch 16
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)


def test_without_a_floor_the_scale_recovers_and_training_proceeds(tmp_path):
    model = _overflowing_fp16_model(min_scale=1.0)
    x, y = np.ones((64, 4), np.float32), np.zeros((64, 1), np.float32)
    guard_callbacks = callbacks.default_callbacks(str(tmp_path))  # the default limit of 20 skipped steps
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=guard_callbacks)
    guard = guard_callbacks.guard
    assert guard.diagnosis is None
    assert precision.current_loss_scale(model.optimizer) < 2.0**15
    skipped = precision.skipped_steps(model.optimizer)
    assert 0 < skipped < 20 and 2.0**15 / precision.current_loss_scale(model.optimizer) == 2.0**skipped  # each skip halved


def _mirrored_model(synchronized=True, fused=True):
    strategy = distribute.get_strategy("mirrored")
    with strategy.scope():
        norm = models.NormSettings(synchronized=synchronized, fused=fused)
        model = models.build_classifier(models.build_encoder("small_cnn", (8, 8, 1), norm), 10)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return strategy, model


def test_a_planted_replica_divergence_is_named():
    strategy, model = _mirrored_model()
    assert strategy.num_replicas_in_sync == 2
    assert distribute.check_replica_consistency(model) == []
    kernel = model.get_layer("logits").kernel
    kernel.value.values[1].assign(kernel.value.values[1] + 1e-3)  # replica 1's copy only
    assert distribute.check_replica_consistency(model) == [kernel.path]
    assert distribute.check_replica_consistency(model, atol=1e-2) == []

    check = callbacks.ReplicaConsistencyCheck(replica_check_every_steps=1)
    check.set_model(model)
    with pytest.raises(callbacks.ReplicaDivergenceError, match=f"on 1 variable\\(s\\): {kernel.path}"):
        check.on_epoch_end(0)


def _train_one_epoch(model, checks=()):
    x = np.random.default_rng(0).random((64, 8, 8, 1), dtype=np.float32)
    model.fit(x, np.arange(64) % 10, batch_size=16, epochs=1, verbose=0, callbacks=list(checks))


def test_training_on_two_replicas_with_synchronized_batchnorm_stays_consistent():
    _, model = _mirrored_model(synchronized=True)
    _train_one_epoch(model, [callbacks.ReplicaConsistencyCheck(replica_check_every_steps=1)])
    assert distribute.check_replica_consistency(model) == []


def test_plain_batchnorm_lets_moving_statistics_drift_apart_and_the_check_says_so():
    """Keras 3 keeps a non-synchronized BatchNorm's moving statistics per replica (mirrored,
    aggregation NONE): each replica averages its own half-batches. tfmp's fused layer averages them over
    the replicas (tests/test_batch_norm.py); Keras' own code path (fused=False) still drifts, and the check
    catches it."""
    _, model = _mirrored_model(synchronized=False, fused=False)
    _train_one_epoch(model)
    differing = distribute.check_replica_consistency(model)
    assert differing and all("moving_mean" in name or "moving_variance" in name for name in differing)


def test_a_users_keras_batchnorm_model_trains_through_default_callbacks_on_two_replicas_with_one_warning(tmp_path, caplog):
    """Keras' own non-synchronized BatchNormalization lets each replica's moving statistics drift (by Keras' design):
    the replica check warns once, naming the layer, and does not stop the user's fit() (it did, at step 2)."""
    import logging

    strategy = distribute.get_strategy("mirrored")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, use_bias=False),
                                  keras.layers.BatchNormalization(name="user_bn"), keras.layers.ReLU(), keras.layers.Flatten(),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).random((64, 8, 8, 1), dtype=np.float32)
    with caplog.at_level(logging.WARNING, logger="tfmp.callbacks.guards"):
        model.fit(x, np.arange(64) % 10, batch_size=16, epochs=2, verbose=0,
                  callbacks=callbacks.default_callbacks(str(tmp_path / "run"), replica_check_every_steps=1))
    assert int(model.optimizer.iterations.numpy()) == 8
    warnings = [record.getMessage() for record in caplog.records if "BatchNorm moving statistics" in record.getMessage()]
    assert len(warnings) == 1 and re.search(r"in 1 layer\(s\) \(sequential(_\d+)?/user_bn\)", warnings[0]), warnings
    drifting = distribute.check_replica_consistency(model)  # the drift is real, and only there
    assert drifting and all("user_bn/moving_" in path for path in drifting), drifting
    # A trainable weight that differs still stops training.
    kernel = model.layers[0].kernel
    kernel.value.values[1].assign(kernel.value.values[1] + 1e-3)
    check = callbacks.ReplicaConsistencyCheck()
    check.set_model(model)
    with pytest.raises(callbacks.ReplicaDivergenceError, match=f"on 1 variable\\(s\\): {kernel.path}$"):
        check.on_epoch_end(0)


def test_augmentation_streams_differ_across_replicas_only_when_seeded_by_replica():
    strategy = distribute.get_strategy("mirrored")
    images = tf.random.stateless_uniform((4, 8, 8, 1), seed=[0, 0])

    def per_replica(batch):
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        return augment.simclr_augment(batch, augment.step_seed(0, 0, replica))

    def same_everywhere(batch):  # the classic mistake: one seed for every replica
        return augment.simclr_augment(batch, augment.step_seed(0, 0, 0))

    assert distribute.augmentation_streams_differ(strategy, per_replica, images)
    assert not distribute.augmentation_streams_differ(strategy, same_everywhere, images)


@pytest.mark.parametrize("guard_first", [True, False])
def test_non_finite_weights_at_the_last_save_fail_the_run_whatever_the_callback_order(tmp_path, guard_first):
    """The guard is the checkpoints' save gate: a vetoed save at the very end writes nothing and fails the run."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    checkpointing = callbacks.Checkpointing(str(tmp_path / "checkpoints"))
    guard = callbacks.NaNGuard(checkpointing)
    assert guard.counter is checkpointing.counter  # used on their own, the guard reads the count a restore rewinds
    order = (guard, checkpointing) if guard_first else (checkpointing, guard)
    for callback in order:
        callback.set_model(model)
        callback.set_params({"epochs": 1})
    model.layers[0].kernel.assign(np.full((2, 1), np.inf, np.float32))
    for callback in order:
        callback.on_epoch_end(0)
    for callback in order:
        callback.on_train_end()
    assert guard.diagnosis is not None and "non-finite weights" in guard.diagnosis
    assert callbacks.find_checkpoints(str(tmp_path / "checkpoints")) == []


def _linear_regression_that_diverges_in_epoch(diverging_epoch, tmp_path, loss_explosion_factor):
    """Least squares with SGD: learning rate 0.1 converges; from `diverging_epoch` (0-based) on, 1.5
    makes every step multiply the error by ~2, so the loss grows ~4x per step and stays finite for a while."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="zeros")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch: 1.5 if epoch >= diverging_epoch else 0.1)
    guard_callbacks = callbacks.default_callbacks(str(tmp_path), loss_explosion_factor=loss_explosion_factor)
    history = model.fit(x, y, batch_size=8, epochs=diverging_epoch + 3, shuffle=False, verbose=0,
                        callbacks=[schedule, *guard_callbacks])
    guard = guard_callbacks.guard
    return model, guard, history


def test_a_finite_loss_explosion_restores_then_stops_with_a_diagnosis(tmp_path):
    model, guard, _ = _linear_regression_that_diverges_in_epoch(3, tmp_path, loss_explosion_factor=1000.0)
    assert guard.retries == 2 and model.stop_training
    assert "x the best epoch's" in guard.events[0] and "lower --learning_rate" in guard.diagnosis
    assert all(np.isfinite(weight).all() for weight in model.get_weights())


def test_without_the_explosion_check_the_same_run_ends_with_a_huge_finite_loss(tmp_path):
    """The control: what the check stopped above is a finite loss, which the other triggers miss."""
    model, guard, history = _linear_regression_that_diverges_in_epoch(3, tmp_path, loss_explosion_factor=0)
    losses = history.history["loss"]
    assert guard.diagnosis is None and np.isfinite(losses[-1])
    assert losses[-1] > 1000 * min(losses[:3])


def test_callbacks_count_steps_with_steps_per_execution(tmp_path):
    """With steps_per_execution=4 callbacks see one batch end per 4 steps: a checkpoint is due at
    every execution that passed a multiple of checkpoint_every_steps, and throughput counts steps."""
    precision.set_policy("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse", steps_per_execution=4)
    x, y = np.ones((64, 4), np.float32), np.zeros((64, 1), np.float32)
    run_callbacks = callbacks.default_callbacks(str(tmp_path), checkpoint_every_steps=3, keep_checkpoints=10)
    throughput = callbacks.Throughput(8)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[throughput, *run_callbacks])
    # Multiples of 3 passed by the executions ending at steps 4 (3), 8 (6), 12 (9), 16 (15); 8 and 16 end epochs too.
    assert checkpoint_steps_on_disk(tmp_path) == [4, 8, 12, 16]
    assert throughput.epoch_steps == [8, 8]
    assert run_callbacks.checkpointing.step == 16


def test_a_skip_streak_counts_every_step_of_an_execution(tmp_path):
    model = _overflowing_fp16_model(min_scale=2.0**14)
    model.compile(optimizer=model.optimizer, loss="mse", steps_per_execution=4)
    x, y = np.ones((64, 4), np.float32), np.zeros((64, 1), np.float32)
    guard_callbacks = callbacks.default_callbacks(str(tmp_path), max_skipped_steps=5)
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=guard_callbacks)
    guard = guard_callbacks.guard
    # Counted per call, the streak would have reached 6 only after 24 steps.
    assert guard.diagnosis and "(step 8: 8 fp16 steps skipped in a row)" in guard.diagnosis, guard.diagnosis


def test_the_finite_check_is_traced_once_per_model_whatever_the_number_of_guards(tmp_path, monkeypatch):
    """An SSL run's baseline draws train one compiled model, each draw with guards of its own: the check of the weights
    was traced anew for every draw."""
    made = []
    original = tf.function
    monkeypatch.setattr(tf, "function", lambda *args, **kwargs: made.append(original(*args, **kwargs)) or made[-1])
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    for draw in range(3):
        guard = callbacks.NaNGuard(callbacks.Checkpointing(str(tmp_path / f"draw{draw}")))
        guard.set_model(model)
        assert guard.save_veto({"loss": 1.0}) is None
    model.layers[0].kernel.assign(np.full((3, 2), np.inf, np.float32))
    assert guard.save_veto({"loss": 1.0}) == "non-finite weights"  # the one check still reads the weights
    assert len(made) == 1 and made[0].experimental_get_tracing_count() == 1
