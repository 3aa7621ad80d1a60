"""tfmp.distribute: strategies by name, batch checks, and mirrored == single device."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp import distribute, models
from conftest import NUM_TEST_DEVICES


def test_unknown_strategy_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown strategy 'horovod'; valid: auto, off, one_device, mirrored"):
        distribute.get_strategy("horovod")


@pytest.mark.parametrize("name, kind, replicas", [
    ("off", "off", 1),
    ("one_device", "one_device", 1),
    ("mirrored", "mirrored", NUM_TEST_DEVICES),
    ("auto", "mirrored", NUM_TEST_DEVICES),  # >1 logical CPU device and no GPU
])
def test_strategies_by_name(name, kind, replicas):
    strategy = distribute.get_strategy(name)
    assert distribute.strategy_name(strategy) == kind
    assert strategy.num_replicas_in_sync == replicas


def test_tpu_without_a_tpu_is_a_clear_error():
    with pytest.raises(ValueError, match="strategy tpu: no TPU found for --tpu='local'"):
        distribute.get_strategy("tpu", tpu="local")


def test_splitting_again_with_another_count_is_refused():
    tf.constant(0)  # TF is initialised
    with pytest.raises(RuntimeError, match=f"already initialised {NUM_TEST_DEVICES}"):
        distribute.split_cpu(NUM_TEST_DEVICES + 1)
    distribute.split_cpu(NUM_TEST_DEVICES)  # the same count is fine


@pytest.mark.parametrize("global_batch, replicas, message", [(0, 1, "positive"), (-8, 2, "positive"), (9, 2, "not divisible by 2")])
def test_bad_global_batch(global_batch, replicas, message):
    with pytest.raises(ValueError, match=message):
        distribute.per_replica_batch_size(global_batch, replicas)


def test_per_replica_batch():
    assert distribute.per_replica_batch_size(64, 2) == 32


LEARNING_RATE = 0.05


def _train(strategy, initial_weights, images, labels, steps):
    """Trains small_cnn (synchronized BatchNorm) for `steps` SGD steps on fixed global batches.

    BatchNorm takes Keras' code path on both sides (`fused=False`): on one replica tfmp
    would use the fused kernel, whose float32 round-off differs from Keras' moments
    (compared in test_batch_norm.py); here only the strategy may differ."""
    with strategy.scope():
        encoder = models.build_encoder("small_cnn", (8, 8, 1), models.NormSettings(synchronized=True, fused=False))
        model = models.build_classifier(encoder, 10)
        model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if initial_weights is not None:
        model.set_weights(initial_weights)
    dataset = tf.data.Dataset.from_tensor_slices((images, labels)).batch(32)
    model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False)
    return model.get_weights()


def test_mirrored_on_two_cpu_devices_matches_one_device():
    """Same init, same global batches, same steps: each variable ends where one device's does,
    to within 1% of how far training moved it.

    Not bit-equal: two replicas sum in another order, and synchronized BatchNorm's cross-replica
    variance is the one-pass E[x^2] - E[x]^2 where one device takes the two-pass moments. Measured:
    0.04% of the movement after one step, 0.3% after four (momentum carries it). A 2% error in
    the update (learning rate x 1.02 on the mirrored side) measured 2.9%, so 1% still fails on
    a wrong gradient average or a wrong batch split."""
    rng = np.random.default_rng(0)
    images = rng.random((128, 8, 8, 1), dtype=np.float32)
    labels = rng.integers(0, 10, 128).astype(np.int32)
    keras.utils.set_random_seed(0)
    with tf.distribute.get_strategy().scope():
        initial = models.build_classifier(models.build_encoder("small_cnn", (8, 8, 1)), 10).get_weights()

    single = _train(distribute.get_strategy("off"), initial, images, labels, steps=4)
    mirrored_strategy = distribute.get_strategy("mirrored")
    assert mirrored_strategy.num_replicas_in_sync == 2
    mirrored = _train(mirrored_strategy, initial, images, labels, steps=4)

    for index, (before, one, two) in enumerate(zip(initial, single, mirrored)):
        movement = np.linalg.norm(one - before)
        assert movement > 1e-3, f"variable {index} did not move: the comparison would mean nothing"
        assert np.linalg.norm(two - one) <= 0.01 * movement, (index, np.linalg.norm(two - one) / movement)


def test_multi_worker_fixes_leave_other_strategies_to_keras():
    """tfmp/upstream.py replaces two Keras functions; for non-multi-worker strategies they are Keras' own."""
    from keras.src.backend.tensorflow import trainer as keras_tf_trainer

    from tfmp import upstream

    upstream.apply_multi_worker_fixes()
    upstream.apply_multi_worker_fixes()  # idempotent
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    values = strategy.run(lambda: 2.0 * tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32))
    assert float(keras_tf_trainer.reduce_per_replica(values, strategy, "auto")) == 3.0  # mean of 2 and 4
    assert float(keras_tf_trainer.reduce_per_replica(values, strategy, "sum")) == 6.0


def test_each_mirrored_strategy_gets_collective_keys_of_its_own():
    """TensorFlow keeps each collective (group, instance) key's type for the process' life, and every new strategy
    would start again at the same keys: a second strategy whose first collective is a gather where the first
    strategy's was an all-reduce failed ("Collective instance 100 expected type 0 ... but got type 2")."""
    from tfmp import keras_internals

    results = []
    for first in ("all_reduce", "all_gather"):
        strategy = distribute.get_strategy("mirrored")
        launchers = keras_internals.collective_launchers(strategy)[0]

        def replica_fn(first=first, launchers=launchers):
            replica = int(tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group))
            value = tf.fill([2], float(replica + 1))
            if first == "all_reduce":
                return launchers[replica].all_reduce(value)
            return keras_internals.nccl_all_gather(launchers[replica], value)  # "nccl" is a hint: CPU devices run a ring

        per_replica = tf.function(lambda replica_fn=replica_fn, strategy=strategy: strategy.run(replica_fn))()
        results.append(strategy.experimental_local_results(per_replica)[0].numpy().tolist())
    assert results == [[3.0, 3.0], [1.0, 1.0, 2.0, 2.0]]
