"""How each replica receives the summed gradients of its chunks: NCCL reduce-scatter where every replica is a GPU,
an all-reduce of which each replica keeps its chunk elsewhere (TensorFlow has no CPU or TPU reduce-scatter)."""

from __future__ import annotations

import tensorflow as tf

from tfmp import keras_internals

GRADIENT_REDUCTIONS = ("auto", "all_reduce", "reduce_scatter")


def all_replicas_local(strategy) -> bool:
    """Every replica is in this process (one machine): nothing has to cross to another worker."""
    return len(strategy.extended.worker_devices) == strategy.num_replicas_in_sync


class AllReduceShares:
    """Every device: all-reduce the packed gradients (tf.distribute's public collective) and keep the replica's chunk.
    Each replica receives every gradient, as in plain data parallelism; the chunks are dealt in replica order."""

    name = "all_reduce"

    def rank_order(self, context):
        """The global replica id whose chunks each part of the packed vector must hold; None: replica order."""
        del context
        return None

    def own_chunk(self, context, packed, replicas: int):
        total = context.all_reduce(tf.distribute.ReduceOp.SUM, packed)
        # A gather, not a slice: TensorFlow's CPU slice along the first axis returns a view that keeps the whole
        # reduced bucket alive for as long as the chunk lives (zero2 keeps chunks across micro-batches).
        return tf.gather(tf.reshape(total, [replicas, -1]), context.replica_id_in_sync_group)


class NcclReduceScatter:
    """Every replica on a GPU: NCCL reduce-scatter through the strategy's own collective group, so each replica
    receives only its chunk (1/N of the gradient bytes instead of all of them). NCCL deals chunks by the devices'
    rank in the group, which TensorFlow may order by the GPUs' interconnect, so the ranks are gathered every step
    (one int per replica) and the chunks packed in that order. Untested here: there is no GPU on the machines
    tfmp is built on (tests/test_sharding.py marks its test `requires_gpu`)."""

    name = "reduce_scatter"

    def __init__(self, launchers: list):
        self.launchers = launchers

    def _launcher(self, context):
        replica_id = tf.get_static_value(context.replica_id_in_sync_group)
        return self.launchers[int(replica_id) % len(self.launchers)]  # local replicas run in worker_devices order

    def rank_order(self, context):
        replica_id = tf.cast(context.replica_id_in_sync_group, tf.float32)[None]
        return tf.cast(keras_internals.nccl_all_gather(self._launcher(context), replica_id), tf.int32)

    def own_chunk(self, context, packed, replicas: int):
        del replicas
        return keras_internals.nccl_reduce_scatter(self._launcher(context), packed)


def choose_gradient_reduction(strategy, choice: str = "auto"):
    """`NcclReduceScatter` where every replica is a physical GPU with NCCL, `AllReduceShares` elsewhere ("auto"); or
    the one named (a reduce-scatter asked for where it cannot run is refused in one line)."""
    if choice not in GRADIENT_REDUCTIONS:
        raise ValueError(f"gradient_reduction must be one of {', '.join(GRADIENT_REDUCTIONS)}, not {choice!r}")
    if choice == "all_reduce" or strategy.num_replicas_in_sync == 1:  # one replica: the inner optimizer runs as it is
        return AllReduceShares()
    found = keras_internals.collective_launchers(strategy)
    on_gpus = all("GPU" in device.upper() for device in strategy.extended.worker_devices)
    if found is not None and on_gpus and found[1] != "RING":  # RING: virtual GPUs, where NCCL does not run
        return NcclReduceScatter(found[0])
    if choice == "reduce_scatter":
        raise ValueError("gradient_reduction='reduce_scatter' needs every replica on a physical GPU with NCCL "
                         "(TensorFlow has no CPU or TPU reduce-scatter); use 'auto' or 'all_reduce'")
    return AllReduceShares()
