"""fp16 loss scaling across replicas: an overflow on any one replica skips the step on all of them.

Two logical CPU devices (conftest), `mixed_float16`, one global batch of 8 whose half on one
replica is multiplied by 1e5 so that only that replica's float16 gradients overflow. Keras 3.15
alone applies such a step when the overflow is on replica 1 and every weight turns NaN
(experiments/upstream/loss_scale_overflow_on_one_replica.py); tfmp decides over all replicas.
"""

import logging
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import REPO
from tfmp import distribute, precision

GLOBAL_BATCH = 8


def _batch(overflowing_replica):
    x = np.ones((GLOBAL_BATCH, 4), np.float32)
    half = GLOBAL_BATCH // 2
    x[half * overflowing_replica: half * (overflowing_replica + 1)] *= 1e5  # examples 0-3 -> replica 0, 4-7 -> replica 1
    return x, np.zeros((GLOBAL_BATCH, 1), np.float32)


def _fp16_model(strategy, hysteresis):
    precision.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer=precision.wrap_optimizer(keras.optimizers.SGD(0.01), hysteresis=hysteresis), loss="mse")
        model.optimizer.build(model.trainable_variables)
    return model


def _assert_skipped_everywhere(model, before, expected_scale):
    after = model.get_weights()
    for old, new in zip(before, after):
        np.testing.assert_array_equal(old, new)
    for variable in model.trainable_variables:  # every replica's copy, not just the first
        for copy in distribute.replica_values(variable):
            assert np.isfinite(copy).all()
    assert precision.skipped_steps(model.optimizer) == 1
    assert precision.current_loss_scale(model.optimizer) == expected_scale


@pytest.mark.parametrize("overflowing_replica", [0, 1])
@pytest.mark.parametrize("hysteresis, expected_scale", [(1, 2.0**14), (2, 2.0**15)])
def test_fit_skips_the_step_on_every_replica(overflowing_replica, hysteresis, expected_scale):
    strategy = distribute.get_strategy("mirrored")
    assert strategy.num_replicas_in_sync == 2
    model = _fp16_model(strategy, hysteresis)
    # One applied step first: before it, every overflow halves the scale (the start's search), whatever the hysteresis.
    model.fit(np.ones((GLOBAL_BATCH, 4), np.float32), np.zeros((GLOBAL_BATCH, 1), np.float32), batch_size=GLOBAL_BATCH,
              epochs=1, shuffle=False, verbose=0)
    before = model.get_weights()
    model.fit(*_batch(overflowing_replica), batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    _assert_skipped_everywhere(model, before, expected_scale)
    # With hysteresis 2, the second overflow in a row halves the scale (once, not once per replica).
    model.fit(*_batch(overflowing_replica), batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    assert precision.current_loss_scale(model.optimizer) == (2.0**14 if hysteresis == 2 else 2.0**13)


@pytest.mark.parametrize("overflowing_replica", [0, 1])
def test_a_custom_strategy_run_loop_skips_the_step_on_every_replica(overflowing_replica):
    """A user's own loop: `strategy.run` of a step that scales the loss and calls `optimizer.apply`."""
    strategy = distribute.get_strategy("mirrored")
    model = _fp16_model(strategy, hysteresis=1)
    optimizer = model.optimizer
    before = model.get_weights()
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(_batch(overflowing_replica)).batch(GLOBAL_BATCH))

    @tf.function
    def train_step(inputs):
        def replica_step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True) - y)) / strategy.num_replicas_in_sync
                scaled = optimizer.scale_loss(loss)
            optimizer.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)
            return loss

        return strategy.reduce("SUM", strategy.run(replica_step, args=inputs), axis=None)

    for inputs in dataset:
        train_step(inputs)
    _assert_skipped_everywhere(model, before, 2.0**14)


def test_a_finite_step_on_both_replicas_is_applied_once():
    strategy = distribute.get_strategy("mirrored")
    model = _fp16_model(strategy, hysteresis=1)
    before = model.get_weights()
    x = np.ones((GLOBAL_BATCH, 4), np.float32)
    model.fit(x, np.zeros((GLOBAL_BATCH, 1), np.float32), batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    assert precision.skipped_steps(model.optimizer) == 0 and int(model.optimizer.iterations.numpy()) == 1
    assert any(not np.array_equal(old, new) for old, new in zip(before, model.get_weights()))
    assert distribute.check_replica_consistency(model) == []


WORKER_SCRIPT = os.path.join(REPO, "tests", "scripts", "fp16_overflow_on_one_worker.py")


@pytest.mark.parametrize("overflowing_worker", [1])
def test_two_workers_skip_a_step_that_overflows_on_one_worker(tmp_path, overflowing_worker):
    """`python -m tfmp.launch --num_workers=2 SCRIPT`: TF's gRPC collectives between two processes on 127.0.0.1."""
    result = subprocess.run([sys.executable, "-m", "tfmp.launch", "--num_workers=2", WORKER_SCRIPT,
                             f"--overflowing_worker={overflowing_worker}", f"--out={tmp_path}"],
                            cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    for worker in (0, 1):
        lines = (tmp_path / f"worker{worker}.txt").read_text().split()
        facts = dict(line.split("=") for line in lines)
        assert facts["replicas"] == "2"
        assert facts["weights_unchanged"] == "True" and facts["finite"] == "True"
        assert facts["skipped_steps"] == "1" and float(facts["loss_scale"]) == 2.0**14


class ForgetfulModel(keras.Model):
    """A custom train_step that forgets `optimizer.scale_loss` (the mistake the warning is for)."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1, dtype="float32")

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": loss}


def test_a_train_step_that_forgets_scale_loss_gets_one_warning_line(caplog):
    precision.set_policy("mixed_float16")
    model = ForgetfulModel()
    model.compile(optimizer=precision.wrap_optimizer(keras.optimizers.SGD(0.1)))
    x, y = np.ones((32, 4), np.float32), np.ones((32, 1), np.float32)
    with caplog.at_level(logging.WARNING, logger="tfmp"):
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    warnings = [record.getMessage() for record in caplog.records if "scale_loss" in record.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "loss = self.optimizer.scale_loss(loss)" in warnings[0]


def test_keras_own_train_step_scales_the_loss_and_gets_no_warning(caplog):
    model = _fp16_model(tf.distribute.get_strategy(), hysteresis=2)
    with caplog.at_level(logging.WARNING, logger="tfmp"):
        model.fit(np.ones((32, 4), np.float32), np.zeros((32, 1), np.float32), batch_size=8, epochs=1, verbose=0)
    assert not [record for record in caplog.records if "scale_loss" in record.getMessage()]
