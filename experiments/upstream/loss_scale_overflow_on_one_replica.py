"""Minimal reproducer: Keras 3's LossScaleOptimizer applies a step whose gradients overflow on one replica only.

    python experiments/upstream/loss_scale_overflow_on_one_replica.py            # stock Keras
    python experiments/upstream/loss_scale_overflow_on_one_replica.py --tfmp     # tfmp's LossScaleOptimizer

Two logical CPU devices, MirroredStrategy, `mixed_float16`. One global batch of 8 examples: the half that
goes to one replica is multiplied by 1e5, so that replica's float16 gradients overflow while the other's do
not. A correct loss-scale optimizer skips the step on every replica and halves the scale. Keras 3.15 checks
`isfinite` per replica *before* the gradients are all-reduced and takes replica 0's answer
(`LossScaleOptimizer._tf_apply`: "Each replica computed the same `finite` value, since `grads` is
all-reduced across replicas" — true in Keras 2 / tf.keras, not in Keras 3, where the inner optimizer
all-reduces later). With the overflow on replica 1 the step is applied and every weight becomes NaN.
No TPU or GPU needed; prints one line per case and exits 1 if any case is wrong.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
keras.mixed_precision.set_global_policy("mixed_float16")
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice())


def loss_scale_optimizer():
    if "--tfmp" in sys.argv:
        from tfmp import precision

        return precision.LossScaleOptimizer(keras.optimizers.SGD(0.01), hysteresis=1)
    return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01))


def run(overflowing_replica: int) -> bool:
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(1, dtype="float32")])
        model.compile(optimizer=loss_scale_optimizer(), loss="mse")
    x = np.ones((8, 4), np.float32)
    x[4 * overflowing_replica: 4 * overflowing_replica + 4] *= 1e5  # examples 0-3 go to replica 0, 4-7 to replica 1
    y = np.zeros((8, 1), np.float32)
    before = model.get_weights()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    after = model.get_weights()
    unchanged = all(np.array_equal(a, b) for a, b in zip(before, after))
    finite = all(np.isfinite(w).all() for w in after)
    scale = float(model.optimizer.dynamic_scale.numpy())
    ok = unchanged and finite and scale == 2.0**14
    print(f"overflow on replica {overflowing_replica}: weights unchanged={unchanged} finite={finite} "
          f"loss scale {scale:g} (expected 16384) -> {'ok' if ok else 'WRONG'}")
    return ok


if __name__ == "__main__":
    print(f"keras {keras.__version__}, tensorflow {tf.__version__}, "
          f"optimizer: {'tfmp' if '--tfmp' in sys.argv else 'keras'} LossScaleOptimizer")
    results = [run(0), run(1)]
    sys.exit(0 if all(results) else 1)
