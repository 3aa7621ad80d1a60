"""Distribution: `tf.distribute` strategies by name, CPU splitting, batch checks, seeds.

tfmp never runs a home-made cluster runtime: every name maps to TensorFlow's own strategy.

| name                    | strategy                                                        |
|-------------------------|-----------------------------------------------------------------|
| `off`                   | TF's default strategy (no distribution)                         |
| `one_device`            | `OneDeviceStrategy` on the first GPU, else the CPU              |
| `mirrored`              | `MirroredStrategy` over all GPUs, else over the logical CPUs    |
| `multi_worker_mirrored` | `MultiWorkerMirroredStrategy` (cluster from `TF_CONFIG`)         |
| `tpu`                   | `TPUStrategy` via `TPUClusterResolver` (TPU VM, Colab, named)   |
| `auto`                  | `tpu` if a TPU is present, `mirrored` if >1 device, else `off`  |

`num_cpu_devices=N` splits the one physical CPU into N logical devices before TF
initialises its runtime, so `mirrored` runs N replicas on a CPU: that is how tfmp
shows, and tests, multi-replica behaviour on machines without accelerators.

`check_replica_consistency` and `augmentation_streams_differ` verify the two RNG
invariants of data parallelism: identical model copies, different augmentations.
"""

from __future__ import annotations

import json
import logging
import os

import keras
import numpy as np
import tensorflow as tf

from tfmp import hardware, keras_internals, logs
from tfmp.config import STRATEGIES

logger = logging.getLogger(__name__)


def split_cpu(num_devices: int) -> None:
    """Splits the physical CPU into `num_devices` logical devices.

    Must run before TensorFlow initialises its devices (before the first op or
    strategy); afterwards only a request that matches the existing split succeeds.

    Raises:
        ValueError: `num_devices` < 1.
        RuntimeError: TF's devices are already initialised with a different count.
    """
    if num_devices < 1:
        raise ValueError(f"num_cpu_devices must be >= 1, got {num_devices}")
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices)
    except RuntimeError:
        existing = len(tf.config.list_logical_devices("CPU"))
        if existing != num_devices:
            raise RuntimeError(
                f"cannot split the CPU into {num_devices} devices: TensorFlow already initialised {existing}; "
                "split before creating any tensor or strategy"
            ) from None


def _tpu_strategy(tpu: str | None) -> tf.distribute.TPUStrategy:
    """Connects to a TPU and returns a `TPUStrategy` (untested here: no TPU on the dev machines).

    Args:
        tpu: "local" on a TPU VM; "" or None to auto-detect (a TPU VM's own chips,
            else Colab's / GKE's TPU from the environment); otherwise a TPU name or
            a `grpc://host:port` address.
    """
    if not tpu and hardware.tpu_vm_chips_present():
        tpu = "local"
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu or "")
        if tpu != "local":
            tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, tf.errors.OpError) as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"strategy tpu: no TPU found for --tpu={tpu or ''!r} ({detail}); "
            "use --tpu=local on a TPU VM, leave it empty on Colab, or pick another --strategy"
        ) from None
    return tf.distribute.TPUStrategy(resolver)


def set_tf_config(worker_hosts: list[str], task_index: int) -> None:
    """Writes TF_CONFIG for a cluster of equal workers (worker 0 is the chief)."""
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": list(worker_hosts)}, "task": {"type": "worker", "index": task_index}})


def is_chief(strategy: tf.distribute.Strategy) -> bool:
    """Whether this process writes the run's files: always, except on non-chief workers of a multi-worker run."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return True
    task_type, task_id = resolver.task_type, resolver.task_id
    return task_type == "chief" or (task_type == "worker" and task_id == 0 and "chief" not in resolver.cluster_spec().as_dict())


def get_strategy(name: str = "auto", *, num_cpu_devices: int | None = None, tpu: str | None = None,
                 worker_hosts: list[str] | None = None, task_index: int = 0) -> tf.distribute.Strategy:
    """Returns the `tf.distribute.Strategy` called `name`.

    Args:
        name: one of `STRATEGIES`.
        num_cpu_devices: split the CPU into this many logical devices first
            (only meaningful for `mirrored` / `auto` on a machine without GPUs).
        tpu: TPU address for `tpu` (see `_tpu_strategy`).
        worker_hosts, task_index: the cluster for `multi_worker_mirrored` (written to
            TF_CONFIG); without them TF_CONFIG is read as it is.

    Raises:
        ValueError: unknown name, or a TPU asked for but absent.
    """
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; valid: {', '.join(STRATEGIES)}")
    if name == "multi_worker_mirrored":
        # Before anything lists devices: collectives must be configured before TF initialises.
        if worker_hosts:
            set_tf_config(worker_hosts, task_index)
        if "TF_CONFIG" not in os.environ:
            raise ValueError("strategy multi_worker_mirrored needs a cluster: set TF_CONFIG or pass --worker_hosts and --task_index")
        # gRPC collectives: TF's own multi-worker runtime. Keras' fit() needs two upstream
        # fixes under it (tfmp/upstream.py); they touch multi-worker strategies only.
        from tfmp import upstream

        upstream.apply_multi_worker_fixes()
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        logs.once(logger, logging.INFO, "strategy: multi_worker_mirrored (asked for), %d replicas in all",
                  strategy.num_replicas_in_sync)
        return strategy
    if num_cpu_devices:
        split_cpu(num_cpu_devices)
    gpus = tf.config.list_logical_devices("GPU")
    cpus = tf.config.list_logical_devices("CPU")

    reason = "asked for"
    if name == "auto":
        if hardware.tpu_present():
            name, reason = "tpu", "auto: a TPU is attached"
        elif len(gpus) > 1 or (not gpus and len(cpus) > 1):
            name = "mirrored"
            reason = f"auto: {len(gpus)} GPUs" if gpus else f"auto: the CPU is split into {len(cpus)} logical devices"
        else:
            name, reason = "off", f"auto: one {'GPU' if gpus else 'CPU'} device"
    strategy = _make_strategy(name, gpus, cpus, tpu)
    replicas = strategy.num_replicas_in_sync
    logs.once(logger, logging.INFO, "strategy: %s (%s), %d replica%s", name, reason, replicas, "" if replicas == 1 else "s")
    return strategy


def _make_strategy(name: str, gpus: list, cpus: list, tpu: str | None) -> tf.distribute.Strategy:
    """The strategy object for a resolved `name` (not `auto`, not `multi_worker_mirrored`)."""
    if name == "off":
        return tf.distribute.get_strategy()
    if name == "one_device":
        return tf.distribute.OneDeviceStrategy((gpus or cpus)[0].name)
    if name == "mirrored":
        keras_internals.fresh_collective_keys()
        if gpus:
            return tf.distribute.MirroredStrategy([device.name for device in gpus])
        # NCCL is GPU-only; on logical CPUs reduce through one device.
        return tf.distribute.MirroredStrategy([device.name for device in cpus], cross_device_ops=tf.distribute.ReductionToOneDevice())
    return _tpu_strategy(tpu)


def strategy_name(strategy: tf.distribute.Strategy) -> str:
    """The tfmp name of a strategy object (`off` for TF's default strategy)."""
    kinds = {
        tf.distribute.MirroredStrategy: "mirrored",
        tf.distribute.MultiWorkerMirroredStrategy: "multi_worker_mirrored",
        tf.distribute.TPUStrategy: "tpu",
        tf.distribute.OneDeviceStrategy: "one_device",
    }
    for kind, kind_name in kinds.items():
        if isinstance(strategy, kind):
            return kind_name
    return "off"


def per_replica_batch_size(global_batch_size: int, num_replicas: int) -> int:
    """The per-replica batch for a global batch.

    Raises:
        ValueError: the global batch is not positive or not divisible by the replicas.
    """
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size}")
    if global_batch_size % num_replicas:
        raise ValueError(
            f"global_batch_size {global_batch_size} is not divisible by {num_replicas} replicas; "
            f"use a multiple of {num_replicas}"
        )
    return global_batch_size // num_replicas


def set_seed(seed: int) -> None:
    """Seeds Python, NumPy and TensorFlow (Keras' `set_random_seed`) for a reproducible run."""
    keras.utils.set_random_seed(seed)


# ------------------------------------------------------------------- replica consistency


def replica_values(variable) -> list:
    """The per-replica copies of a (Keras or TF) variable, as NumPy arrays (one for plain variables)."""
    strategy = tf.distribute.get_strategy()
    tf_variable = getattr(variable, "value", variable)  # a Keras variable wraps the tf.Variable
    if isinstance(tf_variable, tf.distribute.DistributedValues):
        return [component.numpy() for component in tf_variable.values]
    return [v.numpy() for v in strategy.experimental_local_results(tf_variable)]


def replica_local_statistics(model) -> list:
    """The moving statistics that Keras' own BatchNormalization, when not synchronized, updates on each replica from
    that replica's part of the batch (Keras 3.15: mirrored variables, aggregation NONE), so that they differ across
    replicas by Keras' design and a saved model keeps the first replica's. tfmp's BatchNormalization on its fused
    path averages them over the replicas, and a synchronized one computes them over the global batch: neither is
    listed."""
    found = []
    for layer in keras_internals.nested_layers(model):
        if (isinstance(layer, keras.layers.BatchNormalization) and not layer.synchronized
                and not getattr(layer, "uses_fused_kernel", False)):
            found += [variable for variable in (layer.moving_mean, layer.moving_variance) if variable is not None]
    return found


def check_replica_consistency(model, atol: float = 0.0, variables: list | None = None) -> list[str]:
    """Names (paths) of the model's variables (or of `variables`) whose per-replica copies differ.

    Mirrored training keeps every replica's copy of every variable identical: same
    initialisation, same all-reduced update. A difference means a broken invariant
    (a replica-local update, a non-synchronised statistic, corrupted memory) that
    would otherwise show up only as an unexplained accuracy gap.

    Variables synchronised on read (e.g. the moving statistics of a BatchNorm that is
    not synchronized, which Keras keeps per replica and averages when read) differ by
    design and are not compared.

    Args:
        model: a Keras model, typically built under a multi-replica strategy.
        atol: largest absolute difference tolerated (0: bit-identical).

    Returns:
        Variable paths, empty when all replicas agree.
    """
    differing = []
    for variable in model.variables if variables is None else variables:
        if getattr(variable, "sharded_storage", False):  # a zero3 weight: each replica holds another chunk
            continue
        tf_variable = getattr(variable, "value", variable)
        if getattr(tf_variable, "synchronization", None) == tf.VariableSynchronization.ON_READ:
            continue
        copies = replica_values(variable)
        if any(not np.allclose(copy, copies[0], rtol=0.0, atol=atol, equal_nan=True) for copy in copies[1:]):
            differing.append(getattr(variable, "path", variable.name))
    return differing


def augmentation_streams_differ(strategy: tf.distribute.Strategy, augment_fn, images, jit_compile: bool = False) -> bool:
    """Whether replicas augment *the same* images differently (they must, or data parallelism
    multiplies one augmentation instead of drawing new ones).

    Args:
        strategy: the strategy whose replicas to compare.
        augment_fn: images -> augmented images, run in replica context.
        images: one batch, given identically to every replica.
        jit_compile: compile each replica's augmentation with XLA (as a TPU or `--jit_compile` step does).
    """
    replica_fn = tf.function(lambda: augment_fn(images), jit_compile=jit_compile)
    results = strategy.experimental_local_results(strategy.run(replica_fn))
    outputs = [np.asarray(result) for result in results]
    return all(not np.allclose(outputs[i], outputs[j]) for i in range(len(outputs)) for j in range(i + 1, len(outputs)))

