"""The moving average of the weights (`tfmp.averaging`, `--ema_momentum`): Keras' own average, kept beside the trained
weights (Keras' `fit()` would overwrite them), evaluated and exported, skipped with the steps fp16 skips, resumed."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp import averaging, distribute, precision, sharding, train

MOMENTUM = 0.9


class _Trajectory(keras.callbacks.Callback):
    """The trained weights after every step."""

    def on_train_begin(self, logs=None):
        self.weights = []

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append([variable.numpy().copy() for variable in self.model.trainable_weights])


def _expected_average(trajectory):
    average = None
    for weights in trajectory:  # Keras' rule: the first step copies the weights
        average = [w.copy() for w in weights] if average is None else [MOMENTUM * a + (1 - MOMENTUM) * w for a, w in zip(average, weights)]
    return average


def _model(strategy, make_optimizer, wrap=lambda optimizer: optimizer):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
        model.compile(optimizer=wrap(averaging.average_weights(make_optimizer(), MOMENTUM)),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 8)).astype(np.float32), (np.arange(64) % 3).astype(np.int64)


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_average_follows_the_trained_weights_and_fit_leaves_the_trained_weights_in_the_model(replicas):
    strategy = distribute.get_strategy("mirrored") if replicas == 2 else tf.distribute.get_strategy()
    x, y = _data()
    model = _model(strategy, lambda: keras.optimizers.SGD(0.1, momentum=0.9))
    trajectory = _Trajectory()
    model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0, callbacks=[trajectory])
    trained = [variable.numpy() for variable in model.trainable_weights]
    for last, now in zip(trajectory.weights[-1], trained):  # Keras' fit() would have copied the average in
        np.testing.assert_array_equal(now, last)
    raw_loss = model.evaluate(x, y, verbose=0)[0]
    with averaging.averaged(model):
        for average, expected in zip(model.trainable_weights, _expected_average(trajectory.weights)):
            np.testing.assert_allclose(average.numpy(), expected, rtol=1e-5, atol=1e-6)
            for component in strategy.experimental_local_results(average.value):  # every replica's copy
                np.testing.assert_array_equal(component.numpy(), average.numpy())
        average_loss = model.evaluate(x, y, verbose=0)[0]
    assert average_loss != raw_loss
    for variable, value in zip(model.trainable_weights, trained):  # the trained weights back
        np.testing.assert_array_equal(variable.numpy(), value)
    # A second fit() continues from the trained weights, not from the average.
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[trajectory])
    assert not np.array_equal(model.trainable_weights[0].numpy(), trained[0])


def test_an_fp16_step_that_overflows_leaves_the_average_as_it_was():
    precision.set_policy("mixed_float16")
    x, y = _data()
    model = _model(tf.distribute.get_strategy(), lambda: precision.wrap_optimizer(keras.optimizers.SGD(0.1)))
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    with averaging.averaged(model):
        before = [w.numpy() for w in model.trainable_weights]
    poisoned = x.copy()
    poisoned[0, 0] = np.inf
    model.fit(poisoned[:32], y[:32], batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert precision.skipped_steps(model.optimizer) == 1
    with averaging.averaged(model):
        for old, new in zip(before, model.trainable_weights):
            np.testing.assert_array_equal(new.numpy(), old)


def test_under_zero1_each_replica_averages_its_chunks_and_the_checkpoint_resumes_on_one_device(tmp_path):
    strategy = distribute.get_strategy("mirrored")
    x, y = _data()
    sgd = lambda: keras.optimizers.SGD(0.1, momentum=0.9)  # noqa: E731
    plain = _model(strategy, sgd)
    sharded = _model(strategy, sgd, wrap=sharding.ZeroOneOptimizer)
    for model in (plain, sharded):
        model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    assert sharded.optimizer.slot_names == ("momentum", "average")
    # Each replica holds half the average (its chunks), as it holds half the momentum.
    halves = [sum(int(np.prod(component.shape)) for component in components) for components in zip(
        *[strategy.experimental_local_results(chunk) for chunk in sharded.optimizer.slot_variables["average"]])]
    assert halves == [sharded.optimizer.layout.elements] * 2
    whole = sum(int(np.prod(v.shape)) for v in sharded.trainable_weights)
    assert whole / 2 <= sharded.optimizer.layout.elements < 0.6 * whole
    with averaging.averaged(plain):
        expected = [w.numpy() for w in plain.trainable_weights]
    with averaging.averaged(sharded):
        for weight, value in zip(sharded.trainable_weights, expected):
            np.testing.assert_allclose(weight.numpy(), value, rtol=1e-5, atol=1e-6)
    assert list(sharded.optimizer.held.gathers) == [("average",)]  # the momentum stayed in its chunks
    path = tf.train.Checkpoint(model=sharded).write(str(tmp_path / "ckpt"))
    single = _model(tf.distribute.get_strategy(), sgd, wrap=sharding.ZeroOneOptimizer)
    single.optimizer.build(single.trainable_variables)
    tf.train.Checkpoint(model=single).read(path).assert_existing_objects_matched()
    with averaging.averaged(single):
        for weight, value in zip(single.trainable_weights, expected):
            np.testing.assert_allclose(weight.numpy(), value, rtol=1e-5, atol=1e-6)


def test_a_bad_momentum_a_built_optimizer_and_an_already_sharded_one_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"ema_momentum must be in \[0, 1\), got 1.0"):
        averaging.average_weights(keras.optimizers.SGD(), 1.0)
    built = keras.optimizers.SGD()
    built.build([keras.Variable([1.0])])
    with pytest.raises(ValueError, match="not been built yet"):
        averaging.average_weights(built, 0.9)
    with pytest.raises(ValueError, match="before wrapping it in ShardedOptimizer"):
        averaging.average_weights(sharding.ZeroOneOptimizer(keras.optimizers.SGD()), 0.9)


def test_the_cli_reports_the_average_beside_the_trained_weights(tmp_path):
    workdir = tmp_path / "run"
    assert train.main(["tfmp.train", f"--workdir={workdir}", "--strategy=off", "--precision=float32", "--epochs=3",
                       "--ema_momentum=0.9"]) == 0
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert 0.0 < metrics["ema_eval_accuracy"] <= 1.0 and metrics["ema_eval_loss"] != metrics["eval_loss"]
    # Checkpointed with the optimizer (9 trainable variables: 9 averages beside AdamW's 18 slots); resumed exactly:
    # tests/test_exact_resume.py.
    reader = tf.train.load_checkpoint(str(workdir / "checkpoints"))
    slots = [name for name in reader.get_variable_to_shape_map() if name.startswith("model/optimizer/_variables/")]
    trainable = [name for name in reader.get_variable_to_shape_map() if name.startswith("model/optimizer/_trainable_variables/")]
    assert len(slots) >= 3 * len(trainable) > 0


def test_an_ssl_run_exports_and_measures_the_averaged_encoder_beside_the_trained_one(tmp_path):
    workdir = tmp_path / "run"
    assert train.main(["tfmp.train", f"--workdir={workdir}", "--task=byol", "--smoke", "--flip=false", "--strategy=off",
                       "--ema_momentum=0.99", "--label_draws=1", "--compare_supervised=false"]) == 0
    metrics = json.loads((workdir / "metrics.json").read_text())
    for name in ("linear_probe_accuracy", "knn_accuracy"):
        assert 0.0 < metrics[f"ema_{name}"] <= 1.0
    trained = keras.saving.load_model(workdir / "encoder.keras")
    average = keras.saving.load_model(workdir / "encoder_ema.keras")
    assert [w.shape for w in trained.weights] == [w.shape for w in average.weights]
    assert any(not np.array_equal(a, b) for a, b in zip(trained.get_weights(), average.get_weights()))
