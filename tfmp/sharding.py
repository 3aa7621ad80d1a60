"""Optimizer-state sharding across replicas: ZeRO stage 1 on tf.distribute's own collectives.

`ZeroOneOptimizer(inner)` wraps AdamW/Adam, SGD (with or without momentum) or tfmp's LARS. Under a strategy with N
replicas, each replica keeps the optimizer state (Adam's two moments, the momentum) of its share of the variables
only — whole variables, balanced by bytes, so per-layer rules (LARS' trust ratio, weight-decay exclusions) still see
whole layers. A step:

1. packs the gradients share by share into one flat vector (N chunks as long as the largest share) and reduces it so
   that each replica receives the sum of its own chunk (SUM, as Keras does: each replica's loss is already divided by
   N): a reduce-scatter where every replica is a GPU with NCCL (each replica receives 1/N of the gradients' bytes),
   elsewhere an all-reduce of the packed vector, of which each replica keeps its chunk (`NcclReduceScatter`, `AllReduceShares`);
2. on each replica, updates its share of the variables with its share of the state (a `tf.switch_case` on the replica
   id: each branch is one share's update, and only the replica's own branch runs);
3. all-gathers the updated shares (`ReplicaContext.all_gather`) and writes every variable on every replica
   (`merge_call` + `extended.update`, Keras' own way of writing mirrored variables).

The state lives in per-replica (`ON_READ`) flat buffers as long as the largest share. What each update computes is
the optimizer's rule from `tfmp.update_rules` (Keras' own update written once as a function of weight, gradient and
state; LARS steps with it too): tests hold it equal to the unsharded optimizer within float32 rounding. On one
replica the wrapper applies the inner optimizer unchanged.

Checkpoints hold the state layout-free: per variable, whole, all-gathered from every replica (every worker) when a
checkpoint is written (`tf.train.experimental.PythonState`), so a run resumes on another number of replicas.

Not sharded: weights and gradients stay whole on every replica (ZeRO stages 2 and 3, FSDP). Limits (refused with
one line where they apply, `update_rules.check_supported`): gradient clipping, EMA, gradient accumulation, AMSGrad,
and optimizers other than the three above.
"""

from __future__ import annotations

import io
import logging

import keras
import numpy as np
import tensorflow as tf

from tfmp import keras_internals, logs, update_rules

logger = logging.getLogger(__name__)


def assign_shards(sizes: list[int], count: int) -> list[list[int]]:
    """Variable indices per replica: whole variables, largest first onto the lightest replica (balanced by bytes)."""
    shards: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        lightest = loads.index(min(loads))
        shards[lightest].append(index)
        loads[lightest] += sizes[index]
    return [sorted(shard) for shard in shards]


GRADIENT_REDUCTIONS = ("auto", "all_reduce", "reduce_scatter")


class AllReduceShares:
    """Every device: all-reduce the packed gradients (tf.distribute's public collective) and keep the replica's chunk.
    Each replica receives every gradient, as in plain data parallelism; the chunks are dealt in replica order."""

    name = "all_reduce"

    def rank_order(self, context):
        """The global replica id whose share each chunk of the packed vector must hold; None: replica order."""
        del context
        return None

    def own_chunk(self, context, packed, replicas: int):
        total = context.all_reduce(tf.distribute.ReduceOp.SUM, packed)
        return tf.reshape(total, [replicas, -1])[context.replica_id_in_sync_group]


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


class ShardedState(tf.train.experimental.PythonState):
    """The sharded optimizer state in a checkpoint: whole per variable path, whatever the replica layout."""

    def __init__(self, owner: "ZeroOneOptimizer"):
        self.owner = owner

    def serialize(self):
        arrays = self.owner.gathered_state()
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        return buffer.getvalue()

    def deserialize(self, string_value):
        with np.load(io.BytesIO(string_value)) as archive:
            self.owner.scatter_state({key: archive[key] for key in archive.files})


@keras.saving.register_keras_serializable(package="tfmp")
class ZeroOneOptimizer(keras.optimizers.Optimizer):
    """ZeRO stage 1: each replica holds and updates the optimizer state of its share of the variables.

    Args:
        inner: the optimizer whose update rule is applied (AdamW, Adam, SGD or `tfmp.optimizers.LARS`); it owns the
            learning rate (and its schedule) and the step count.
        gradient_reduction: how each replica receives its share's summed gradients: "auto" (NCCL reduce-scatter
            where every replica is a GPU, an all-reduce elsewhere), "all_reduce" or "reduce_scatter".
    """

    def __init__(self, inner: keras.optimizers.Optimizer, gradient_reduction: str = "auto", name: str = "zero1", **kwargs):
        super().__init__(learning_rate=0.0, name=name, **kwargs)
        self.gradient_reduction = gradient_reduction
        update_rules.check_supported(inner, "optimizer_sharding=zero1")
        self.slot_names = update_rules.slot_names(inner)
        # The per-replica buffers and the inner optimizer (whose slots exist on one replica only) are kept out of
        # TensorFlow's checkpoint tracking: the state goes through `sharded_state`, whole per variable, so a
        # checkpoint holds the same objects whatever the number of replicas that wrote or reads it.
        self.held = _Untracked()
        self.held.inner = inner
        self.sharded_state = ShardedState(self)
        self.inner_iterations = inner.iterations  # tracked: the step count of the inner optimizer's schedule
        if isinstance(inner.learning_rate, keras.Variable):  # tracked: a learning rate a callback may have changed
            self.inner_learning_rate = inner.learning_rate
        self.held.strategy = tf.distribute.get_strategy()  # built under this strategy's scope, as Keras optimizers are
        self.held.reduction = choose_gradient_reduction(self.held.strategy, gradient_reduction)
        self.replicas = 1
        if self.held.strategy.num_replicas_in_sync == 1:  # said here, before fit() prints its first epoch line
            logs.once(logger, logging.WARNING, "optimizer_sharding=zero1 on one replica: nothing is sharded (the optimizer "
                      "runs unchanged)")

    # ------------------------------------------------------------------------------ layout

    @property
    def inner(self) -> keras.optimizers.Optimizer:
        return self.held.inner

    @property
    def learning_rate(self):
        return self.inner.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):  # Keras' constructor sets it; the inner optimizer's is the one used
        del value

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self.variables_in_order = list(variables)
        strategy = self.held.strategy  # the one it was made under: a callback may build it outside the scope
        self.replicas = strategy.num_replicas_in_sync
        if self.replicas == 1:
            with strategy.scope():
                self.inner.build(variables)
            self.built = True
            self._scatter_pending_state()
            return
        sizes = [int(np.prod(variable.shape)) for variable in variables]
        self.shards = assign_shards(sizes, self.replicas)
        self.offsets, self.owners = {}, {}
        for replica, shard in enumerate(self.shards):
            offset = 0
            for index in shard:
                self.offsets[index], self.owners[index] = offset, replica
                offset += sizes[index]
        self.shard_elements = max(1, max(sum(sizes[index] for index in shard) for shard in self.shards))
        self.sizes = sizes
        # Per-replica buffers: each replica's copy holds its own share's state (not a copy of the others').
        with strategy.scope():
            self.held.buffers = {name: tf.Variable(tf.zeros([self.shard_elements]), trainable=False, name=f"zero1_{name}",
                                                   synchronization=tf.VariableSynchronization.ON_READ,
                                                   aggregation=tf.VariableAggregation.NONE) for name in self.slot_names}
        self.built = True
        self._scatter_pending_state()

    def _scatter_pending_state(self):
        pending, self.held.pending = self.held.pending, None
        if pending:
            self.scatter_state(pending)

    @property
    def buffers(self) -> dict:
        return self.held.buffers

    def state_bytes_per_replica(self) -> list[int]:
        """Bytes of optimizer state each replica holds, from where the variables are placed."""
        if self.replicas == 1:
            return [sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in self.inner.variables if len(v.shape))]
        strategy = self.held.strategy
        per_replica = [0] * self.replicas
        for buffer in self.buffers.values():
            for replica, component in enumerate(strategy.experimental_local_results(buffer)):
                per_replica[replica] += int(np.prod(component.shape)) * component.dtype.size
        return per_replica

    # ------------------------------------------------------------------------------ the step

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is not None and not self.built:
            self.build(list(trainable_variables))
        if self.replicas == 1:
            self.inner.apply(grads, trainable_variables if trainable_variables is not None else self.variables_in_order)
            self.iterations.assign_add(1)  # the step count Keras and tfmp's callbacks read is this optimizer's
            return
        context = tf.distribute.get_replica_context()
        if context is None:
            raise ValueError("optimizer_sharding=zero1 applies gradients inside strategy.run (replica context)")
        variables = self.variables_in_order
        grads = list(grads)
        present = [index for index, gradient in enumerate(grads) if gradient is not None]
        if not present:  # as Keras' own optimizers refuse it
            raise ValueError(f"No gradients provided for any variable ({len(variables)} variables)")
        # A variable without a gradient is left as it is (no decay, its state unchanged), as Keras does; its place in
        # the packed vector holds zeros.
        present = set(present)
        reduction = self.held.reduction
        shares = tf.stack([self._pack(shard, grads) for shard in self.shards])  # [replicas, shard_elements]
        order = reduction.rank_order(context)
        packed = tf.reshape(shares if order is None else tf.gather(shares, order), [-1])
        own = reduction.own_chunk(context, packed, self.replicas)  # the summed gradients of this replica's share
        learning_rate = tf.cast(self.inner.learning_rate, tf.float32)
        branches = [lambda shard=shard: self._update_share(shard, own, present, learning_rate) for shard in self.shards]
        share = tf.switch_case(context.replica_id_in_sync_group, branches)
        gathered = context.all_gather(share[None], axis=0)  # [replicas, shard_elements]
        new_values = []
        for index, variable in enumerate(variables):
            start = self.offsets[index]
            new_values.append(tf.reshape(gathered[self.owners[index], start:start + self.sizes[index]], variable.shape))
        context.merge_call(_write_all, args=(variables, new_values))
        self.inner.iterations.assign_add(1)
        self.iterations.assign_add(1)

    def _pack(self, shard: list[int], grads):
        """One share's gradients, flat, in float32 (zeros for a missing gradient), padded to `shard_elements`."""
        pieces = [tf.zeros([self.sizes[index]]) if grads[index] is None else
                  tf.reshape(tf.cast(tf.convert_to_tensor(grads[index]), tf.float32), [-1]) for index in shard]
        used = sum(self.sizes[index] for index in shard)
        return tf.concat(pieces + [tf.zeros([self.shard_elements - used])], axis=0)

    def _update_share(self, shard: list[int], own_gradients, present: set, learning_rate):
        """The update of one share: new weights (flat, padded) returned, new state written to this replica's buffers."""
        states = {name: [] for name in self.slot_names}
        weights = []
        step = tf.cast(self.inner.iterations + 1, tf.float32)
        for index in shard:
            variable = self.variables_in_order[index]
            start, size = self.offsets[index], self.sizes[index]
            slots = {name: tf.reshape(buffer[start:start + size], variable.shape) for name, buffer in self.buffers.items()}
            weight = tf.convert_to_tensor(variable.value)
            if index in present:
                gradient = tf.cast(tf.reshape(own_gradients[start:start + size], variable.shape), variable.dtype)
                weight, slots = update_rules.update(self.inner, variable, weight, gradient, slots, learning_rate, step)
            weights.append(tf.reshape(weight, [-1]))
            for name in self.slot_names:
                states[name].append(tf.reshape(slots[name], [-1]))
        used = sum(self.sizes[index] for index in shard)
        padding = [tf.zeros([self.shard_elements - used])]
        for name, buffer in self.buffers.items():
            buffer.assign(tf.concat(states[name] + padding, axis=0))
        return tf.concat(weights + padding, axis=0)

    # ------------------------------------------------------------------------------ checkpoints

    def gathered_state(self) -> dict[str, np.ndarray]:
        """Every variable's optimizer state, whole, by `{slot}:{index}` in the trainable variables' order (read on the
        host; indices rather than paths, which carry auto-generated model names)."""
        if not self.built:
            return {}
        if self.replicas == 1:  # the inner optimizer's own slots, so that more replicas can resume from them
            return {f"{name}:{index}": keras_internals.optimizer_slot(self.inner, name, variable).numpy()
                    for name in self.slot_names for index, variable in enumerate(self.variables_in_order)}
        strategy = self.held.strategy
        names = list(self.buffers)
        if getattr(self.held, "gather", None) is None:  # traced once, not at every checkpoint save

            def gather():  # every replica's buffers, on every replica (across workers too): one collective per slot
                context = tf.distribute.get_replica_context()
                return [context.all_gather(tf.convert_to_tensor(self.buffers[name])[None], axis=0) for name in names]

            # strategy.run of a tf.function wraps it anew at each call; run inside one function, it is traced once.
            self.held.gather = tf.function(lambda: strategy.run(gather))
        gathered = self.held.gather()
        arrays = {}
        for name, per_replica in zip(names, gathered):
            shares = strategy.experimental_local_results(per_replica)[0].numpy()  # [replicas, shard_elements]
            for replica, shard in enumerate(self.shards):
                for index in shard:
                    start, variable = self.offsets[index], self.variables_in_order[index]
                    arrays[f"{name}:{index}"] = shares[replica, start:start + self.sizes[index]].reshape(variable.shape)
        return arrays

    def scatter_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Writes whole per-variable state (from `gathered_state`, any layout) into this layout's buffers (at build,
        when the optimizer is not built yet)."""
        if not arrays:
            return
        if not self.built:
            self.held.pending = arrays
            return
        if self.replicas == 1:
            for name in self.slot_names:
                for index, variable in enumerate(self.variables_in_order):
                    keras_internals.optimizer_slot(self.inner, name, variable).assign(_whole(arrays, name, index, variable))
            return
        strategy = self.held.strategy
        # The global replica id of each of this machine's replicas (under several workers they are not 0..n-1).
        replica_ids = strategy.experimental_local_results(strategy.run(
            tf.function(lambda: tf.distribute.get_replica_context().replica_id_in_sync_group)))
        for name, buffer in self.buffers.items():
            for replica_id, component in zip(replica_ids, strategy.experimental_local_results(buffer)):
                replica = int(replica_id.numpy())
                content = np.zeros([self.shard_elements], np.float32)
                for index in self.shards[replica]:
                    variable, start = self.variables_in_order[index], self.offsets[index]
                    content[start:start + self.sizes[index]] = _whole(arrays, name, index, variable).reshape(-1)
                component.assign(content)

    def get_config(self):
        return {"name": self.name, "inner": keras.saving.serialize_keras_object(self.inner),
                "gradient_reduction": self.gradient_reduction}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        return cls(keras.saving.deserialize_keras_object(config.pop("inner")), **config)


def _whole(arrays: dict, name: str, index: int, variable) -> np.ndarray:
    """Slot `name` of the `index`-th trainable variable, checked against the variable's shape."""
    value = arrays.get(f"{name}:{index}")
    if value is None or tuple(value.shape) != tuple(variable.shape):
        raise ValueError(f"the checkpoint's sharded optimizer state does not fit this model: {name} of variable {index} "
                         f"({variable.path}, shape {tuple(variable.shape)}) is {None if value is None else value.shape}")
    return value


class _Untracked:
    """A plain holder: TensorFlow's checkpoint tracking does not look inside it."""

    def __init__(self):
        self.buffers: dict = {}
        self.strategy = None
        self.reduction = None
        self.inner = None
        self.pending: dict | None = None  # state restored before the optimizer was built


def _write_all(strategy, variables, values):
    for variable, value in zip(variables, values):
        strategy.extended.update(variable.value, lambda target, new: target.assign(new), args=(value,), group=False)
