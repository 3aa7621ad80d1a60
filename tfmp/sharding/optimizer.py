"""ZeRO stages 1, 2 and 3: the optimizer step with each replica holding the optimizer state of its chunk of every variable.

`ShardedOptimizer(inner, stage="zero1")` (also spelled `ZeroOneOptimizer(inner)`) wraps AdamW/Adam, SGD (with or
without momentum) or tfmp's LARS. Under a strategy with N replicas, each replica keeps the optimizer state (Adam's
two moments, the momentum) of its 1/N chunk of every variable (`tfmp.sharding.layout`), in one per-replica (`ON_READ`)
variable per slot and variable (`slot_variables`). A step goes bucket by bucket
(at most `layout.BUCKET_BYTES` of gradients each, the last layers first, as the backward pass produces them):

1. the bucket's gradients, each cut into N equal chunks, are reduced so that each replica receives the sum of its
   own chunks (SUM, as Keras does: each replica's loss is already divided by N): an NCCL reduce-scatter where every
   replica is a GPU (`NcclReduceScatter`), elsewhere an all-reduce of which each replica keeps its chunks
   (`AllReduceShares`: TensorFlow has no CPU or TPU reduce-scatter);
2. each replica updates its chunks with its state, by the optimizer's rule from `tfmp.update_rules` (Keras' own
   update written once; LARS' trust ratio takes whole-variable norms, summed across replicas);
3. the updated chunks are all-gathered (`ReplicaContext.all_gather`) and every variable written on every replica
   (`merge_call` + `extended.update`, Keras' own way of writing mirrored variables).

No step holds more than one bucket of packed gradients or gathered weights at a time: the transient memory of the
sharded step is bounded by a bucket, where a packed vector of all gradients (this module's first version) cost
more than zero1 saved. Tests hold the weights equal to the unsharded optimizer's within float32 rounding. On one
replica the wrapper applies the inner optimizer unchanged.

Checkpoints hold the state layout-free, per variable, written from where each chunk lives and read back into any
layout (`tfmp.sharding.checkpoint_state`), so a run resumes on another number of replicas.

With `global_clipnorm` the step first sums every bucket (each replica keeps its chunks: 1/N of the gradients), then
scales them by the global norm summed across replicas, then updates (`tfmp.clipping`). With `clipnorm` (per variable,
Keras' name; DINO's clip_grad) each bucket's chunks are scaled by their variables' own norms, summed across replicas
in one collective per bucket, just before the bucket's update.

The moving average of the weights (the inner optimizer's `use_ema`, `tfmp.averaging`) is one more slot: each
replica averages its chunks after updating them.

**zero2** (`stage="zero2"`) also keeps only the replica's chunks of the gradients where gradients persist: across the
micro-batches of `--gradient_accumulation_steps` (`tfmp.accumulation`), each micro-batch's gradients are reduced to
their owners bucket by bucket (`owned_gradients`) as soon as they exist, and each replica sums only its chunks — 1/N
of a gradient instead of the whole running sum. The summed chunks go through the loss-scale optimizer as they are
(its overflow check and unscaling are element-wise; the check is all-reduced) and `apply` updates from them with no
second reduction (`receiving_owned`). It pays K reductions a step instead of one, as DeepSpeed's stage 2 does. Without
accumulation the gradients of a step do not outlive it and zero2's step is zero1's (each bucket reduced and updated
on its own: no replica holds more than one bucket of reduced gradients).

**zero3** (`stage="zero3"`, FSDP) also shards the weights: at `build` each trainable weight becomes per-replica
chunks (`tfmp.sharding.weights`), gathered where a layer reads it; the gathers' gradients are each replica's chunks
summed over the replicas, so the step updates each replica's chunks in place with no collective of its own. Build the
optimizer before the first step (`fit()` does; a `strategy.run` loop calls `optimizer.build(model.trainable_variables)`):
the forward pass must read the chunks. Limits (refused with
one line where they apply, `update_rules.check_supported`): per-tensor clipping, Keras' `gradient_accumulation_steps`
(tfmp's own accumulation composes: `tfmp.accumulation`), `ema_overwrite_frequency`, AMSGrad, and optimizers other
than the three above.
"""

from __future__ import annotations

import contextlib
import logging

import keras
import numpy as np
import tensorflow as tf

from tfmp import clipping, keras_internals, logs, update_rules
from tfmp.config import SHARDING_STAGES
from tfmp.sharding import checkpoint_state
from tfmp.sharding import weights as weights_module
from tfmp.sharding.collectives import choose_gradient_reduction
from tfmp.sharding.layout import Layout

logger = logging.getLogger(__name__)


STAGES = tuple(stage for stage in SHARDING_STAGES if stage != "none")


@keras.saving.register_keras_serializable(package="tfmp")
class ShardedOptimizer(keras_internals.ShardedVariableKeys, keras.optimizers.Optimizer):
    """ZeRO stages 1 to 3: each replica holds and updates the optimizer state of its chunk of every variable
    (under zero2 it also sums only its chunks of the accumulated gradients; under zero3 it also holds only its chunks
    of the weights, `tfmp.sharding.weights`).

    Args:
        inner: the optimizer whose update rule is applied (AdamW, Adam, SGD or `tfmp.optimizers.LARS`); it owns the
            learning rate (and its schedule) and the step count.
        gradient_reduction: how each replica receives its chunks' summed gradients: "auto" (NCCL reduce-scatter
            where every replica is a GPU, an all-reduce elsewhere), "all_reduce" or "reduce_scatter".
        global_clipnorm: clip the summed gradient to this global norm (`tfmp.clipping`: the norm summed across every
            replica's chunks); None takes the inner optimizer's own `global_clipnorm`.
        clipnorm: clip each variable's summed gradient to this norm by its own norm (`tfmp.clipping`'s `per_tensor`);
            None takes the inner optimizer's own `clipnorm`. Not with `global_clipnorm`.
        stage: "zero1", "zero2" or "zero3" (see the module docstring). Their checkpoints hold the same state: one
            restores into another.
        units: zero3 only — FSDP's units, the weights gathered together in one collective where their layers read
            them (`tfmp.sharding.units`): a list whose entries are each a Keras layer, a variable, or a list of them
            (one unit each: the layers' trainable weights), or a function of a variable returning the name of its
            unit (weights with equal names form one; None: not in any), as `tfmp.models.block_of` names tfmp's
            encoders' blocks. The weights in no unit are grouped by size (a layer call whose weights fit 32 MiB).
            Kept out of `get_config` (layers and functions do not serialise).
    """

    def __init__(self, inner: keras.optimizers.Optimizer, gradient_reduction: str = "auto", name: str | None = None,
                 global_clipnorm: float | None = None, stage: str = "zero1", clipnorm: float | None = None, units=None,
                 **kwargs):
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {', '.join(STAGES)}, not {stage!r}")
        if units is not None and stage != "zero3":
            raise ValueError(f"units name the weights zero3 gathers together; sharding={stage} gathers no weights")
        _check_units(units)
        super().__init__(learning_rate=0.0, name=name or stage, **kwargs)
        self.stage = stage
        self.gradient_reduction = gradient_reduction
        # Clipping is the step's, after the sum; the inner optimizer would clip each replica's gradient (on one
        # replica it runs unchanged: the clipping is done here before it).
        self.global_clipnorm = global_clipnorm if global_clipnorm is not None else getattr(inner, "global_clipnorm", None)
        self.clipnorm = clipnorm if clipnorm is not None else getattr(inner, "clipnorm", None)
        if self.clipnorm and self.global_clipnorm:
            raise ValueError(f"sharding={stage}: clipnorm={self.clipnorm} and global_clipnorm={self.global_clipnorm}; "
                             "use one clipping")
        inner.global_clipnorm = inner.clipnorm = None
        update_rules.check_supported(inner, f"sharding={stage}")
        self.slot_names = update_rules.slot_names(inner)
        # The per-replica slot variables and the inner optimizer (whose slots exist on one replica only) are kept out of
        # TensorFlow's checkpoint tracking: the state goes through `state_shards`, whole per variable, so a
        # checkpoint holds the same objects whatever the number of replicas that wrote or reads it.
        self.held = _Untracked()
        self.held.inner = inner
        self.held.learning_rate_factors = {}  # by variable path: `tfmp.optimizers.decay_learning_rate_by_layer`
        self.sharded_state = checkpoint_state.LegacyWholeState(self)  # checkpoints written before ShardedState
        self.state_shards = checkpoint_state.ShardedState(self)
        self.inner_iterations = inner.iterations  # tracked: the step count of the inner optimizer's schedule
        if isinstance(inner.learning_rate, keras.Variable):  # tracked: a learning rate a callback may have changed
            self.inner_learning_rate = inner.learning_rate
        self.held.strategy = tf.distribute.get_strategy()  # built under this strategy's scope, as Keras optimizers are
        self.held.reduction = choose_gradient_reduction(self.held.strategy, gradient_reduction)
        self.held.units = units
        self.replicas = 1
        if self.held.strategy.num_replicas_in_sync == 1:  # said here, before fit() prints its first epoch line
            logs.once(logger, logging.WARNING, f"sharding={stage} on one replica: nothing is sharded (the optimizer runs "
                      "unchanged)")

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

    @property
    def layout(self) -> Layout:
        return self.held.layout

    @property
    def slot_variables(self) -> dict[str, list]:
        """Per slot name, one per-replica variable per trainable variable (in their order): each replica's chunk of
        that slot (on several replicas; empty on one, where the inner optimizer holds its own slots)."""
        return self.held.slot_variables

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self.variables_in_order = list(variables)
        self.held.index_of = {id(variable): index for index, variable in enumerate(self.variables_in_order)}
        strategy = self.held.strategy  # the one it was made under: a callback may build it outside the scope
        self.replicas = strategy.num_replicas_in_sync
        self.held.layout = Layout(tuple(int(np.prod(variable.shape)) for variable in variables), self.replicas)
        if self.replicas == 1:
            with strategy.scope():
                self.inner.build(variables)
        else:
            if self.stage == "zero3":  # the weights themselves become per-replica chunks, in place
                unshardable = [getattr(variable, "path", variable.name) for variable in variables
                               if not weights_module.shardable(variable)]
                if unshardable:  # their gradients would arrive whole where the step expects chunks
                    raise ValueError(f"sharding=zero3 shards trainable float32 weights; not: {', '.join(unshardable)}")
                # Keras decides weight decay by a variable's storage: decided while the storage is whole.
                self.held.decays = [keras_internals.uses_weight_decay(self.inner, variable) for variable in variables]
                weights_module.shard_weights(self.variables_in_order, self.layout, strategy, self.held.reduction,
                                             checkpoint_state.local_replica_ids(strategy),
                                             unit_keys(self.held.units, self.variables_in_order))
            # One per-replica variable per slot and weight, as Keras keeps slots: each replica's copy holds its own
            # chunk's state (not a copy of the others'), and the step assigns each one whole. A single flat buffer per
            # slot cost the step two more copies of the state: written by concatenating every chunk, or slice by slice
            # in place, which TensorFlow 2.21 performs on a copy of the buffer (BUILD_NOTES).
            with strategy.scope():
                self.held.slot_variables = {
                    name: [tf.Variable(tf.zeros([chunk]), trainable=False, name=f"sharded_{name}_{index}",
                                       synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.NONE)
                           for index, chunk in enumerate(self.layout.chunks)]
                    for name in self.slot_names}
        self.built = True
        pending, self.held.pending = self.held.pending, None
        if pending:
            self.scatter_state(pending)
        checkpoint_state.read_pending(self)

    def state_bytes_per_replica(self) -> list[int]:
        """Bytes of optimizer state each replica holds, from where the variables are placed."""
        if self.replicas == 1:
            return [sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in self.inner.variables if len(v.shape))]
        strategy = self.held.strategy
        per_replica = [0] * self.replicas
        for variables in self.slot_variables.values():
            for variable in variables:
                for replica, component in enumerate(strategy.experimental_local_results(variable)):
                    per_replica[replica] += int(np.prod(component.shape)) * component.dtype.size
        return per_replica

    # ------------------------------------------------------------------------------ the step

    def apply(self, grads, trainable_variables=None):
        if not self.built and self.stage == "zero3" and self.held.strategy.num_replicas_in_sync > 1:
            raise ValueError("sharding=zero3: build the optimizer before the first step (optimizer.build(model."
                             "trainable_variables)); the forward pass must read the sharded weights (fit() builds it)")
        if trainable_variables is not None and not self.built:
            self.build(list(trainable_variables))
        if self.replicas == 1:
            if self.global_clipnorm or self.clipnorm:
                grads = clipping.clipped(grads, self.global_clipnorm or self.clipnorm, per_tensor=bool(self.clipnorm))
            self.inner.apply(grads, trainable_variables if trainable_variables is not None else self.variables_in_order)
            self.iterations.assign_add(1)  # the step count Keras and tfmp's callbacks read is this optimizer's
            return
        context = tf.distribute.get_replica_context()
        if context is None:
            raise ValueError(f"sharding={self.stage} applies gradients inside strategy.run (replica context)")
        grads = list(grads)
        if all(gradient is None for gradient in grads):  # as Keras' own optimizers refuse it
            raise ValueError(f"No gradients provided for any variable ({len(self.variables_in_order)} variables)")
        learning_rate = tf.cast(self.inner.learning_rate, tf.float32)
        step = tf.cast(self.inner.iterations + 1, tf.float32)
        order = self.held.reduction.rank_order(context)
        buckets = list(reversed(self.layout.buckets))  # the last layers' gradients are ready first
        if self.held.receiving_owned or self.stage == "zero3":  # reduced already (zero2's accumulation, zero3's
            # gathers): each gradient is this replica's chunk
            chunks = [[self._owned_or_zeros(grads[index], index) for index in bucket] for bucket in buckets]
        elif self.global_clipnorm:  # the global norm needs every bucket's sum first: each replica keeps its chunks
            chunks = [self._reduce_bucket(context, bucket, grads, order) for bucket in buckets]
        else:
            chunks = None  # each bucket reduced just before its update, so one bucket of reduced gradients is alive
        if self.global_clipnorm:
            chunks = self._clipped(context, chunks)
        updated = []  # each bucket starts when the one before is updated: its packed, reduced and gathered copies
        for position, bucket in enumerate(buckets):  # are not made ahead while the others wait their turn
            with tf.control_dependencies(updated):
                own = chunks[position] if chunks is not None else self._reduce_bucket(context, bucket, grads, order)
                updated = self._update_bucket(context, bucket, own, grads, learning_rate, step)
        self.inner.iterations.assign_add(1)
        self.iterations.assign_add(1)

    # ------------------------------------------------------------------------------ zero2: gradients held as chunks

    @property
    def shards_gradients(self) -> bool:
        """Whether accumulated gradients are held as this replica's chunks: zero2 and zero3 on several replicas."""
        return self.stage in ("zero2", "zero3") and self.held.strategy.num_replicas_in_sync > 1

    def owned_gradients(self, grads, variables) -> list:
        """This replica's chunks of `grads` summed over the replicas (call in replica context, on several replicas).

        `variables` are the trainable variables `grads` belong to, all of them or some (a gradient-caching step
        reduces the encoder's gradients per micro-batch and the heads' once); an unbuilt optimizer is built from
        them, so pass all of them the first time. Returns, for each variable, a float32 vector of its chunk length
        (`layout.chunks`), or None where the gradient is None. Each bucket is reduced on its own, as soon as its
        gradients exist (no bucket waits for another), the last layers first."""
        if not self.built:
            self.build(list(variables))
        context = tf.distribute.get_replica_context()
        if self.stage == "zero3":  # the gathers' gradients are this replica's chunks already
            return [None if gradient is None else tf.cast(gradient, tf.float32) for gradient in grads]
        positions = [self.held.index_of[id(variable)] for variable in variables]
        by_index = [None] * len(self.variables_in_order)
        for index, gradient in zip(positions, grads):
            by_index[index] = gradient
        order = self.held.reduction.rank_order(context)
        owned = {}
        for bucket in reversed(self.layout.buckets):
            present = [index for index in bucket if by_index[index] is not None]
            if not present:  # the same on every replica: the graph is the same
                continue
            owned.update(zip(bucket, self._reduce_bucket(context, bucket, by_index, order)))
        return [owned[index] if by_index[index] is not None else None for index in positions]

    def owned_zeros(self, variable) -> tf.Tensor:
        """Zeros the shape of `variable`'s chunk (what `owned_gradients` gives it), for a running sum."""
        return tf.zeros([self.layout.chunks[self.held.index_of[id(variable)]]])

    @contextlib.contextmanager
    def receiving_owned(self):
        """Inside it, `apply` (directly or through a loss-scale optimizer) takes gradients that `owned_gradients`
        reduced already: each replica's chunks, summed over the replicas. A count, not a flag: MirroredStrategy traces
        each replica in a thread of its own, and the update may run in threads started after every replica entered."""
        self.held.receiving_owned += 1
        try:
            yield
        finally:
            self.held.receiving_owned -= 1

    def _owned_or_zeros(self, chunk, index: int):
        return tf.zeros([self.layout.chunks[index]]) if chunk is None else tf.cast(chunk, tf.float32)

    def _chunked(self, tensor, index: int):
        """Variable `index`'s tensor flat in float32, padded and cut into [replicas, chunk] (zeros for None)."""
        chunk = self.layout.chunks[index]
        if tensor is None:
            return tf.zeros([self.replicas, chunk])
        flat = tf.reshape(tf.cast(tf.convert_to_tensor(tensor), tf.float32), [-1])
        return tf.reshape(tf.pad(flat, [[0, self.replicas * chunk - self.layout.sizes[index]]]), [self.replicas, chunk])

    def _reduce_bucket(self, context, bucket, grads, order) -> list:
        """This replica's chunk of each of the bucket's gradients, summed over the replicas."""
        packed = tf.concat([self._chunked(grads[index], index) for index in bucket], axis=1)  # [replicas, bucket chunk]
        packed = tf.reshape(packed if order is None else tf.gather(packed, order), [-1])
        own = self.held.reduction.own_chunk(context, packed, self.replicas)
        starts = np.cumsum([0] + [self.layout.chunks[index] for index in bucket])
        return [own[start:start + self.layout.chunks[index]] for start, index in zip(starts, bucket)]

    def _clipped(self, context, chunks: list) -> list:
        """Every replica's chunks (a list per bucket) scaled by `min(1, clipnorm / norm)`, the norm of the whole summed
        gradient."""
        squares = tf.add_n([tf.reduce_sum(tf.square(chunk)) for bucket in chunks for chunk in bucket])
        norm = tf.sqrt(context.all_reduce(tf.distribute.ReduceOp.SUM, squares))
        factor = self.global_clipnorm / tf.maximum(norm, self.global_clipnorm)
        return [[chunk * factor for chunk in bucket] for bucket in chunks]

    def _clipped_per_variable(self, context, chunks: list) -> list:
        """One bucket's chunks, each scaled by `min(1, clipnorm / norm)` of its variable's whole summed gradient."""
        squares = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.stack([tf.reduce_sum(tf.square(chunk)) for chunk in chunks]))
        factors = self.clipnorm / tf.maximum(tf.sqrt(squares), self.clipnorm)
        return [chunk * factors[position] for position, chunk in enumerate(chunks)]

    def _update_bucket(self, context, bucket, gradients, grads, learning_rate, step) -> list:
        """Updates the bucket's chunks of the weights and their slots from this replica's chunks of the summed
        `gradients`, and writes the weights; returns the new weight chunks (the next bucket waits for them)."""
        layout, variables = self.layout, self.variables_in_order
        replica = context.replica_id_in_sync_group
        weights = [self._own_weight(variables[index], index, replica, after=gradients) for index in bucket]
        if self.clipnorm:
            gradients = self._clipped_per_variable(context, gradients)
        norms = self._lars_norms(context, bucket, weights, gradients)
        new_weights = []
        for position, index in enumerate(bucket):
            variable = variables[index]
            slots = {name: tf.convert_to_tensor(chunks[index]) for name, chunks in self.slot_variables.items()}
            weight, new_slots = weights[position], {}
            if grads[index] is not None:  # a variable without a gradient is left as it is (no decay), as Keras does
                weight, new_slots = update_rules.update(self.inner, variable, weight, gradients[position], slots,
                                                        learning_rate, step, norms=None if norms is None else norms[position],
                                                        decays=None if self.held.decays is None else self.held.decays[index],
                                                        learning_rate_factor=self.held.learning_rate_factors.get(variable.path, 1.0))
            if "average" in slots:  # every variable's, as Keras averages every trainable variable
                new_slots["average"] = update_rules.moving_average(slots["average"], weight, momentum=self.inner.ema_momentum,
                                                                   step=step)
            new_weights.append(weight)
            for name, value in new_slots.items():  # assigned whole, as soon as computed: the old state is released
                self.slot_variables[name][index].assign(value)
        if self.stage == "zero3":  # each replica keeps its updated chunks (every weight is one: `build`); the next
            for index, weight in zip(bucket, new_weights):  # forward pass gathers them
                variables[index].sharded.assign_chunk(weight)
            return new_weights
        starts = np.cumsum([0] + [layout.chunks[index] for index in bucket])
        gathered = context.all_gather(tf.concat(new_weights, axis=0)[None], axis=0)  # [replicas, bucket chunk]
        values = []
        for start, index in zip(starts, bucket):
            whole = tf.reshape(gathered[:, start:start + layout.chunks[index]], [-1])[:layout.sizes[index]]
            values.append(tf.cast(tf.reshape(whole, variables[index].shape), variables[index].dtype))
        context.merge_call(_write_all, args=([variables[index] for index in bucket], values))
        return new_weights

    def _own_weight(self, variable, index: int, replica, after: list):
        """This replica's chunk of a variable's weight, float32: under zero3 its own storage, read for free (made to
        wait as well, it cost memory); else cut from the whole weight — a copy, made once `after` (the bucket's reduced
        gradients) exist, not for every bucket at the step's start."""
        if self.stage == "zero3":
            return tf.convert_to_tensor(variable.sharded.storage)
        with tf.control_dependencies(after):
            return tf.gather(self._chunked(variable.value, index), replica)

    def _lars_norms(self, context, bucket, weights, gradients):
        """LARS' whole-variable norms `(|w|, |g + decay * w|)` from every replica's chunks (None for other rules)."""
        if not update_rules.is_lars(self.inner):
            return None
        squares = []
        for weight, gradient in zip(weights, gradients):
            decayed = update_rules.lars_gradient(weight, gradient, weight_decay=self.inner.lars_weight_decay)
            squares.append(tf.stack([tf.reduce_sum(tf.square(weight)), tf.reduce_sum(tf.square(decayed))]))
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.stack(squares))
        return [(tf.sqrt(pair[0]), tf.sqrt(pair[1])) for pair in tf.unstack(summed)]

    # ------------------------------------------------------------------------------ the whole state (tests, old checkpoints)

    def gathered_state(self, slots: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
        """Every variable's optimizer state (or only `slots` of it), whole, by `{slot}:{index}` in the trainable
        variables' order: a whole copy on the host, for tests, inspection and the moving average's evaluation
        (checkpoints never call it: `checkpoint_state`)."""
        if not self.built:
            return {}
        variables = self.variables_in_order
        names = tuple(slots or self.slot_names)
        if self.replicas == 1:
            return {f"{name}:{index}": keras_internals.optimizer_slot(self.inner, name, variable).numpy()
                    for name in names for index, variable in enumerate(variables)}
        strategy = self.held.strategy
        if names not in self.held.gathers:  # traced once per set of slots

            def gather():
                context = tf.distribute.get_replica_context()
                return [context.all_gather(tf.concat([tf.convert_to_tensor(chunk) for chunk in self.slot_variables[name]],
                                                     axis=0)[None], axis=0) for name in names]

            self.held.gathers[names] = tf.function(lambda: strategy.run(gather))
        arrays = {}
        for name, per_replica in zip(names, self.held.gathers[names]()):
            chunks = strategy.experimental_local_results(per_replica)[0].numpy()  # [replicas, every chunk end to end]
            for index, variable in enumerate(variables):
                offset, chunk = self.layout.offsets[index], self.layout.chunks[index]
                whole = chunks[:, offset:offset + chunk].reshape(-1)[:self.layout.sizes[index]]
                arrays[f"{name}:{index}"] = whole.reshape(variable.shape)
        return arrays

    def whole_averages(self) -> list[np.ndarray]:
        """The moving average of every trainable variable (`use_ema` on the inner optimizer), whole, in their order:
        gathered from every replica's chunks, the other slots left where they are (`tfmp.averaging.averaged` evaluates
        and exports it)."""
        arrays = self.gathered_state(slots=("average",))
        return [arrays[f"average:{index}"] for index in range(len(self.variables_in_order))]

    def scatter_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Writes whole per-variable state (`{slot}:{index}` arrays, any layout) into this layout (at build, when the
        optimizer is not built yet)."""
        if not arrays:
            return
        if not self.built:
            self.held.pending = arrays
            return
        variables = self.variables_in_order
        checkpoint_state.write_state(self, lambda name, ranges: [
            _whole(arrays, name, index, variables[index]).reshape(-1)[start:stop] for index, start, stop in ranges])

    def get_config(self):
        return {"name": self.name, "inner": keras.saving.serialize_keras_object(self.inner), "stage": self.stage,
                "gradient_reduction": self.gradient_reduction, "global_clipnorm": self.global_clipnorm, "clipnorm": self.clipnorm}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        return cls(keras.saving.deserialize_keras_object(config.pop("inner")), **config)


def _check_units(units) -> None:
    """`ShardedOptimizer`'s `units` argument, refused in one line where it is not one of the forms it takes."""
    if units is None or callable(units):
        return
    form = "units must be a function of a variable or a list of layers, variables or lists of them"
    if not isinstance(units, (list, tuple)):
        raise ValueError(f"{form}, not {type(units).__name__}")
    for number, entry in enumerate(units):
        for part in entry if isinstance(entry, (list, tuple)) else [entry]:
            if not isinstance(part, (keras.layers.Layer, keras.Variable)):
                raise ValueError(f"{form}; unit {number} holds a {type(part).__name__}")


def unit_keys(units, variables: list) -> list | None:
    """The declared FSDP unit of each of `variables` (None: in none) from `ShardedOptimizer`'s `units` argument — a
    list entry's position, or the name a function gives — or None where no units were given.

    Raises:
        ValueError: a weight in two list entries, or an entry holding none of `variables` (an unbuilt layer, another
            model's): each named.
    """
    if units is None:
        return None
    if callable(units):
        return [units(variable) for variable in variables]
    positions = {id(variable): index for index, variable in enumerate(variables)}
    keys = [None] * len(variables)
    for number, entry in enumerate(units):
        parts = entry if isinstance(entry, (list, tuple)) else [entry]
        held = {id(variable) for part in parts
                for variable in (part.trainable_weights if isinstance(part, keras.layers.Layer) else [part])}
        indices = [positions[key] for key in held if key in positions]
        if not indices:
            names = ", ".join(getattr(part, "path", None) or part.name for part in parts)
            raise ValueError(f"units: unit {number} ({names}) holds none of the weights this optimizer trains "
                             "(a layer not built yet, or another model's)")
        for index in indices:
            if keys[index] is not None:
                raise ValueError(f"units: {variables[index].path} is in unit {keys[index]} and in unit {number}; "
                                 "a weight belongs to one unit")
            keys[index] = number
    return keys


@keras.saving.register_keras_serializable(package="tfmp")
class ZeroOneOptimizer(ShardedOptimizer):
    """`ShardedOptimizer` (stage zero1 by default), by the name it had before zero2: optimizers saved under it load."""


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
        self.slot_variables: dict = {}
        self.strategy = None
        self.reduction = None
        self.inner = None
        self.layout: Layout | None = None
        self.pending: dict | None = None  # state restored before the optimizer was built
        self.gathers: dict = {}  # traced functions by the slots they gather, kept out of checkpoint tracking too
        self.bucket_gathers = None
        self.receiving_owned = 0  # > 0 while a step applies gradients reduced already (`receiving_owned`)
        self.index_of: dict = {}  # id of each trainable variable -> its position, from build
        self.decays: list | None = None  # zero3: whether each variable takes weight decay, decided before sharding
        self.units = None  # zero3: the FSDP units the user declared (`unit_keys`)


def _write_all(strategy, variables, values):
    for variable, value in zip(variables, values):
        strategy.extended.update(variable.value, lambda target, new: target.assign(new), args=(value,), group=False)

