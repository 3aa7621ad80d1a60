"""ZeRO stage 2 (`tfmp.sharding.ShardedOptimizer(stage="zero2")`) with gradient accumulation on 2 CPU replicas: each
micro-batch's gradients reduced to their owners and only each replica's chunks summed, ending where the unsharded
optimizer does — AdamW, SGD, LARS; bf16; fp16 with an overflow on one replica; `fit()`, a `strategy.run` loop, a
lazily built model with sizes 2 does not divide, gradient caching — and the chunks themselves checked."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from test_accumulation import _Overflow, _one_step_gradient
from test_sharding import STEPS, ScaledModel, _data, _optimizer
from tfmp import accumulation, distribute, precision, sharding
from tfmp.diagnostics import memory

MICRO_BATCHES = 2


def _compiled(strategy, kind, stage, model=None, steps=MICRO_BATCHES):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = model() if model else keras.Sequential([
            keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, activation="relu", name="conv"), keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu", name="hidden"), keras.layers.Dense(10, name="logits")])
        optimizer = _optimizer(kind)
        model.compile(optimizer=optimizer if stage == "none" else sharding.ShardedOptimizer(optimizer, stage=stage),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return accumulation.accumulate_gradients(model, steps)


def _fitted(strategy, kind, stage, model=None, labels_modulo=10):
    images, labels = _data()
    model = _compiled(strategy, kind, stage, model)
    model.fit(images, labels % labels_modulo, batch_size=32, epochs=STEPS * 32 // len(images), shuffle=False, verbose=0)
    return model


def _assert_same_weights(expected, actual, tolerance=1e-5):
    for a, b in zip(expected.trainable_weights, actual.trainable_weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=tolerance, atol=tolerance / 10, err_msg=a.name)


def test_each_replica_receives_its_chunks_of_the_summed_gradient_and_none_stays_none():
    strategy = distribute.get_strategy("mirrored")
    with strategy.scope():
        # Sizes 2 replicas do not divide (a bias of 5, a kernel of 15), and a variable without a gradient.
        kernel, bias, unused = (tf.Variable(np.arange(15.0, dtype=np.float32).reshape(5, 3)),
                                tf.Variable(np.zeros(5, np.float32)), tf.Variable(np.ones(4, np.float32)))
        optimizer = sharding.ShardedOptimizer(keras.optimizers.SGD(0.1), stage="zero2")
    variables = [kernel, bias, unused]
    optimizer.build(variables)
    gradients = {0: [np.full((5, 3), 1.0, np.float32), np.arange(5.0, dtype=np.float32)],
                 1: [np.arange(15.0, dtype=np.float32).reshape(5, 3), np.full(5, 2.0, np.float32)]}

    def replica_step():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        mine = [tf.where(tf.equal(replica, 0), gradients[0][index], gradients[1][index]) for index in range(2)]
        everything = optimizer.owned_gradients([*mine, None], variables)
        heads_only = optimizer.owned_gradients([mine[1]], [bias])  # a subset, as gradient caching's heads
        return everything[0], everything[1], tf.constant(everything[2] is None), heads_only[0]

    results = tf.function(lambda: strategy.run(replica_step))()
    kernel_chunks, bias_chunks, kept_none, subset_chunks = (strategy.experimental_local_results(value) for value in results)
    summed = [gradients[0][index] + gradients[1][index] for index in range(2)]
    for replica in range(2):
        assert bool(kept_none[replica].numpy())
        for chunks, whole, size in ((kernel_chunks, summed[0], 15), (bias_chunks, summed[1], 5), (subset_chunks, summed[1], 5)):
            chunk = -(-size // 2)
            expected = np.pad(whole.ravel(), (0, 2 * chunk - size))[replica * chunk:(replica + 1) * chunk]
            assert chunks[replica].shape == (chunk,)
            np.testing.assert_array_equal(chunks[replica].numpy(), expected)


@pytest.mark.parametrize("kind", ["adamw", "sgd", "lars"])
def test_zero2_with_micro_batches_ends_where_the_unsharded_optimizer_does(kind):
    strategy = distribute.get_strategy("mirrored")
    plain, zero2 = _fitted(strategy, kind, "none"), _fitted(strategy, kind, "zero2")
    assert int(zero2.optimizer.iterations.numpy()) == STEPS
    _assert_same_weights(plain, zero2)
    start = _compiled(strategy, kind, "none")
    assert all(not np.allclose(a.numpy(), b.numpy()) for a, b in zip(zero2.trainable_weights, start.trainable_weights))
    for variable in zero2.weights:  # every replica holds the same weights afterwards
        first, second = strategy.experimental_local_results(variable.value)
        np.testing.assert_array_equal(first.numpy(), second.numpy())


def test_a_zero1_checkpoint_restores_into_zero2_and_both_hold_the_same_state(tmp_path):
    strategy = distribute.get_strategy("mirrored")
    zero1, zero2 = _fitted(strategy, "adamw", "zero1"), _fitted(strategy, "adamw", "zero2")
    first, second = zero1.optimizer.gathered_state(), zero2.optimizer.gathered_state()
    assert first.keys() == second.keys() and any(np.abs(value).max() > 0 for value in first.values())
    for key in first:
        np.testing.assert_allclose(second[key], first[key], rtol=1e-5, atol=1e-7, err_msg=key)
    path = tf.train.Checkpoint(model=zero1, optimizer=zero1.optimizer).write(str(tmp_path / "zero1"))
    restored = _compiled(strategy, "adamw", "zero2")
    restored.optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).read(path).assert_existing_objects_matched()
    for key, value in restored.optimizer.gathered_state().items():
        np.testing.assert_array_equal(value, first[key], err_msg=key)
    assert int(restored.optimizer.iterations.numpy()) == STEPS


def test_zero2_under_bf16_matches_the_unsharded_optimizer():
    precision.set_policy("mixed_bfloat16")
    strategy = distribute.get_strategy("mirrored")
    images, labels = _data()
    results = []
    for stage in ("none", "zero2"):
        model = _compiled(strategy, "sgd", stage)
        model.fit(images, labels, batch_size=32, epochs=1, shuffle=False, verbose=0)  # 2 steps: before rounding drifts
        results.append(model)
    _assert_same_weights(*results, tolerance=1e-5)
    assert results[1].layers[0].compute_dtype == "bfloat16"


def test_a_lazily_built_subclassed_model_with_sizes_not_divisible_by_the_replicas():
    strategy = distribute.get_strategy("mirrored")
    plain = _fitted(strategy, "lars", "none", model=ScaledModel, labels_modulo=5)
    zero2 = _fitted(strategy, "lars", "zero2", model=ScaledModel, labels_modulo=5)
    assert sorted(int(np.prod(w.shape)) for w in zero2.trainable_weights) == [1, 3, 5, 15, 64 * 3]
    _assert_same_weights(plain, zero2)


def test_fp16_overflow_in_one_micro_batch_on_one_replica_skips_the_step_on_both():
    precision.set_policy("mixed_float16")
    strategy = distribute.get_strategy("mirrored")
    images, labels = _data()
    images, labels = images[:32], labels[:32]
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8, 8, 1)), _Overflow(), keras.layers.Flatten(), keras.layers.Dense(10)])
        sharded = sharding.ShardedOptimizer(keras.optimizers.AdamW(1e-2), stage="zero2")
        model.compile(optimizer=precision.wrap_optimizer(sharded, initial_loss_scale=1024.0),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    accumulation.accumulate_gradients(model, 4)
    before = [w.numpy() for w in model.trainable_weights]
    poisoned = images.copy()
    poisoned[16 + 5, 0, 0, 0] = 1234.0  # replica 1's second micro-batch
    model.fit(poisoned, labels, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert precision.skipped_steps(model.optimizer) == 1
    assert float(model.optimizer.dynamic_scale.numpy()) == 512.0  # halved once
    for old, variable in zip(before, model.trainable_weights):
        for component in strategy.experimental_local_results(variable.value):
            np.testing.assert_array_equal(component.numpy(), old)
    assert not any(np.abs(value).max() for value in sharded.gathered_state().values())  # no moment moved
    model.fit(images, labels, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert precision.skipped_steps(model.optimizer) == 1
    assert all(np.isfinite(w.numpy()).all() for w in model.trainable_weights)
    assert not np.array_equal(model.trainable_weights[-1].numpy(), before[-1])


def test_a_strategy_run_loop_written_with_the_library_pieces():
    """A user's own loop: `sum_gradients` with the owner `gradient_owner` finds, `apply_gradients` to update."""
    strategy = distribute.get_strategy("mirrored")
    images, labels = _data()
    results = []
    for stage in ("none", "zero2"):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(10)])
            optimizer = _optimizer("sgd")
            model.optimizer = optimizer if stage == "none" else sharding.ShardedOptimizer(optimizer, stage=stage)
            model.optimizer.build(model.trainable_variables)

        def replica_step(step):
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            rows = tf.reshape((tf.range(32) + replica * 32 + step * 7) % 64, [MICRO_BATCHES, -1])
            owner = accumulation.gradient_owner(model.optimizer, MICRO_BATCHES)

            def gradients_of(index):
                with tf.GradientTape() as tape:
                    logits = model(tf.gather(images, rows[index]), training=True)
                    loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                        tf.gather(labels, rows[index]), logits, from_logits=True)) / (2 * MICRO_BATCHES)
                return tape.gradient(loss, model.trainable_variables)

            gradients = accumulation.sum_gradients(gradients_of, MICRO_BATCHES, model.trainable_variables, owner)
            accumulation.apply_gradients(model.optimizer, gradients, model.trainable_variables, owner)
            return tf.size(gradients[0])  # what this replica sums: the kernel, or its chunk of it

        step_function = tf.function(lambda step: strategy.run(replica_step, args=(step,)))
        for step in range(5):
            summed = step_function(tf.constant(step))
        results.append((model, int(strategy.experimental_local_results(summed)[0])))
    (plain, plain_elements), (zero2, zero2_elements) = results
    assert plain_elements == 64 * 10 and zero2_elements == 64 * 10 // 2
    _assert_same_weights(plain, zero2)


def test_gradient_caching_under_zero2_gives_the_global_batch_gradient():
    """SimCLR on 2 replicas: the encoder's chunks summed over 4 micro-batches, the heads' reduced once."""
    strategy = distribute.get_strategy("mirrored")
    big = _one_step_gradient("simclr", strategy, 1, encoder="plain_cnn")
    cached = _one_step_gradient("simclr", strategy, 4, encoder="plain_cnn", stage="zero2")
    assert np.linalg.norm(big) > 0
    assert np.linalg.norm(cached - big) / np.linalg.norm(big) < 1e-5


def test_the_estimate_counts_each_replicas_chunks_of_the_accumulated_gradients():
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(11)])
    trainable = (64 * 11 + 11) * 4
    whole = memory.estimate_memory(model, (8, 8, 1), 32, accumulation_steps=4)
    sharded = memory.estimate_memory(model, (8, 8, 1), 32, accumulation_steps=4, gradient_shards=2)
    assert whole.accumulator_bytes == 2 * trainable
    assert sharded.accumulator_bytes == 2 * -(-trainable // 2)
    assert sharded.total_bytes == whole.total_bytes - (whole.accumulator_bytes - sharded.accumulator_bytes)


@pytest.mark.parametrize("micro_batches, said", [(1, True), (4, False)])
def test_zero2_without_micro_batches_says_once_that_its_step_is_zero1s(tmp_path, caplog, monkeypatch, micro_batches, said):
    from tfmp import logs, train
    from tfmp.run_directory import check_before_run

    monkeypatch.setattr(logs, "_SAID", set())
    with caplog.at_level("WARNING"):
        check_before_run(*train.parse(["tfmp.train", "--sharding=zero2", f"--gradient_accumulation_steps={micro_batches}",
                                       f"--workdir={tmp_path}"]))
    notes = [record.getMessage() for record in caplog.records if "zero2" in record.getMessage()]
    assert notes == (["--sharding=zero2 with --gradient_accumulation_steps=1: no gradient outlives a step, so the step "
                      "is zero1's (zero2 holds each replica's chunks of the accumulated gradients)"] if said else [])
