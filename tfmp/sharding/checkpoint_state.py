"""The sharded optimizer state in checkpoints: written from where it lives, read back into any replica layout.

Every variable's state is stored flat under its own key, `tfmp_sharded/<object>/<slot>/<index>` (the index in the
trainable variables' order: paths carry auto-generated model names), whole or as the slices the replicas held
(TensorFlow's bundle format keeps slices of one tensor and reads any slice back across them), so a checkpoint does
not depend on the layout that wrote it, and a run resumes on any number of replicas. The state goes through TensorFlow's registered
checkpoint savers (the mechanism TensorFlow's own sharded variables and DTensor use: a save function writes tensor
bundles with `SaveV2`, TensorFlow merges them into the checkpoint, a restore function reads with `RestoreV2`):

* one machine (one device, or every replica in this process): each replica's chunks are written from its own slot
  variables as slices, one bundle per replica — nothing is gathered, no copy of the state is made on the host;
* several workers: each holds only its replicas' chunks, and only the chief's checkpoint is kept, so the chunks
  travel to the chief bucket by bucket (the layout's buckets: one all-gather each) and the chief writes each bucket
  as it arrives: no process holds the whole state at any time;
* restoring, each replica reads with `RestoreV2` exactly the slices its layout gives it.

Under zero3 on several workers the same saver also streams the sharded weights to the chief, a bucket at a time, under
their own Keras keys (`tfmp.sharding.weights.stream_to_chief`): TensorFlow's own save would gather them all at once.

The registration is TensorFlow's `saved_model.registration.register_checkpoint_saver`, not exported as `tf.*` in
TF 2.21: reached through `tfmp.keras_internals`, whose `missing_hooks` checks it at start-up.

Checkpoints written before this (the whole state as one NumPy archive in a `PythonState` under the optimizer's
`sharded_state` attribute, gathered to every worker at each save) still restore through `LegacyWholeState`; new
checkpoints leave that attribute empty.
"""

from __future__ import annotations

import io

import numpy as np
import tensorflow as tf

from tfmp import keras_internals
from tfmp.sharding import collectives, weights



class ShardedState(keras_internals.checkpoint_trackable_base()):
    """The optimizer state a `ZeroOneOptimizer` holds, as its checkpoints see it (see the module docstring)."""

    def __init__(self, owner):
        self.owner = owner
        self.pending_prefix: tuple[str, str] | None = None  # restored before the optimizer was built: read at build


def _key(identifier: str, name: str, index: int) -> str:
    return f"tfmp_sharded/{identifier}/{name}/{index}"


def _save(trackables: dict, file_prefix) -> list:
    prefixes = []
    for number, (identifier, state) in enumerate(sorted(trackables.items())):
        optimizer = state.owner
        if not optimizer.built:
            continue
        prefix = tf.strings.join([file_prefix, f"_{number}"])
        if optimizer.stage == "zero3":  # writes only weights sharded across workers (on one machine their saveables do)
            prefixes += weights.stream_to_chief(optimizer.variables_in_order, optimizer.layout, prefix)
        if not optimizer.slot_names:
            continue
        if optimizer.replicas == 1:
            prefixes.append(_save_one_device(identifier, optimizer, prefix))
        elif collectives.all_replicas_local(optimizer.held.strategy):
            prefixes += _save_each_replica(identifier, optimizer, prefix)
        else:
            prefixes += _save_through_the_chief(identifier, optimizer, prefix)
    return prefixes


def _save_one_device(identifier: str, optimizer, prefix):
    """The inner optimizer's own slots, each whole and flat."""
    names, tensors = [], []
    for name in optimizer.slot_names:
        for index, variable in enumerate(optimizer.variables_in_order):
            names.append(_key(identifier, name, index))
            tensors.append(tf.reshape(keras_internals.optimizer_slot(optimizer.inner, name, variable), [-1]))
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names), tensors=tensors)
    return prefix


def _save_each_replica(identifier: str, optimizer, prefix) -> list:
    """One bundle per replica, written from the replica's own slot variables: each variable's chunk as a slice of it."""
    strategy, layout, prefixes = optimizer.held.strategy, optimizer.layout, []
    for replica in range(optimizer.replicas):
        names, slices, tensors = [], [], []
        for name, chunks in optimizer.slot_variables.items():
            for index, size in enumerate(layout.sizes):
                start, stop = layout.held_range(index, replica)
                if stop > start:
                    component = strategy.experimental_local_results(chunks[index])[replica]
                    names.append(_key(identifier, name, index))
                    slices.append(f"{size} {start},{stop - start}")
                    tensors.append(component[:stop - start])
        if names:
            replica_prefix = tf.strings.join([prefix, f"_replica{replica}"])
            with tf.device(component.device):
                tf.raw_ops.SaveV2(prefix=replica_prefix, tensor_names=names, shape_and_slices=slices, tensors=tensors)
            prefixes.append(replica_prefix)
    return prefixes


def _save_through_the_chief(identifier: str, optimizer, prefix) -> list:
    """Several workers: each bucket's chunks are all-gathered and the chief writes the bucket's variables whole; the
    others write nothing (their checkpoints are not kept). At most one bucket of state is in flight."""
    strategy, layout = optimizer.held.strategy, optimizer.layout
    chief = strategy.extended.should_checkpoint
    if optimizer.held.bucket_gathers is None:
        optimizer.held.bucket_gathers = {}
    prefixes = []
    for number, bucket in enumerate(layout.buckets):
        function = optimizer.held.bucket_gathers.get(number)
        if function is None:  # traced once per bucket, not at every save
            function = tf.function(lambda bucket=bucket: strategy.run(_gather_bucket, args=(optimizer, bucket)))
            optimizer.held.bucket_gathers[number] = function
        gathered = strategy.experimental_local_results(function())[0]  # per slot: [replicas, bucket chunk]
        if chief:
            names, tensors = [], []
            for name, chunks in zip(optimizer.slot_variables, gathered):
                start = 0
                for index in bucket:
                    chunk = layout.chunks[index]
                    names.append(_key(identifier, name, index))
                    tensors.append(tf.reshape(chunks[:, start:start + chunk], [-1])[:layout.sizes[index]])
                    start += chunk
            bucket_prefix = tf.strings.join([prefix, f"_bucket{number}"])
            tf.raw_ops.SaveV2(prefix=bucket_prefix, tensor_names=names, shape_and_slices=[""] * len(names), tensors=tensors)
            prefixes.append(bucket_prefix)
            del tensors
        del gathered  # released before the next bucket is gathered, not when its result replaces this one
    return prefixes


def _gather_bucket(optimizer, bucket) -> list:
    context = tf.distribute.get_replica_context()
    return [context.all_gather(tf.concat([tf.convert_to_tensor(chunks[index]) for index in bucket], axis=0)[None], axis=0)
            for chunks in optimizer.slot_variables.values()]


def _restore(trackables: dict, merged_prefix) -> None:
    prefix = merged_prefix.numpy().decode() if isinstance(merged_prefix, tf.Tensor) else str(merged_prefix)
    for identifier, state in sorted(trackables.items()):
        if state.owner.built:
            read_into(state.owner, prefix, identifier)
        else:
            state.pending_prefix = (prefix, identifier)


def read_into(optimizer, prefix: str, identifier: str) -> None:
    """Reads, for each replica of this process, exactly the chunks its layout gives it (any layout wrote them)."""
    if not optimizer.slot_names:
        return
    shapes = tf.train.load_checkpoint(prefix).get_variable_to_shape_map()
    variables, layout = optimizer.variables_in_order, optimizer.layout
    for name in optimizer.slot_names:
        for index, variable in enumerate(variables):
            stored = shapes.get(_key(identifier, name, index))
            if stored != [layout.sizes[index]]:
                raise ValueError(f"the checkpoint's sharded optimizer state does not fit this model: {name} of variable "
                                 f"{index} ({variable.path}, {layout.sizes[index]} elements) is "
                                 f"{'missing' if stored is None else stored}")

    def restore(name: str, ranges: list) -> list:
        names = [_key(identifier, name, index) for index, _, _ in ranges]
        slices = [f"{layout.sizes[index]} {start},{stop - start}" for index, start, stop in ranges]
        values = tf.raw_ops.RestoreV2(prefix=prefix, tensor_names=names, shape_and_slices=slices, dtypes=[tf.float32] * len(names))
        return [value.numpy() for value in values]

    write_state(optimizer, restore)


def write_state(optimizer, read) -> None:
    """Writes into this process's replicas the state their layout gives them. `read(slot, ranges)` returns, for each
    `(index, start, stop)` of `ranges`, elements `[start, stop)` of that variable's slot, flat (from a checkpoint's
    slices, or from whole arrays)."""
    layout, variables = optimizer.layout, optimizer.variables_in_order
    if optimizer.replicas == 1:  # the inner optimizer's own slots, whole
        for name in optimizer.slot_names:
            values = read(name, [(index, 0, size) for index, size in enumerate(layout.sizes)])
            for variable, value in zip(variables, values):
                keras_internals.optimizer_slot(optimizer.inner, name, variable).assign(np.reshape(value, variable.shape))
        return
    strategy = optimizer.held.strategy
    for name, chunks in optimizer.slot_variables.items():
        for position, replica in enumerate(local_replica_ids(strategy)):
            ranges = [(index, *layout.held_range(index, replica)) for index in range(len(variables))]
            ranges = [(index, start, stop) for index, start, stop in ranges if stop > start]
            values = dict(zip([index for index, _, _ in ranges], read(name, ranges) if ranges else []))
            for index, chunk in enumerate(chunks):
                content = np.zeros([layout.chunks[index]], np.float32)  # the padding past the variable's end: zeros
                value = values.get(index)
                if value is not None:
                    content[:len(value)] = value
                strategy.experimental_local_results(chunk)[position].assign(content)


def read_pending(optimizer) -> None:
    """At build: the state a restore found before the optimizer had its layout."""
    state = optimizer.state_shards
    if state.pending_prefix is not None:
        (prefix, identifier), state.pending_prefix = state.pending_prefix, None
        read_into(optimizer, prefix, identifier)


def local_replica_ids(strategy) -> list[int]:
    """The global replica id of each of this process's replicas (under several workers they are not 0..n-1)."""
    ids = strategy.experimental_local_results(strategy.run(
        tf.function(lambda: tf.distribute.get_replica_context().replica_id_in_sync_group)))
    return [int(replica_id.numpy()) for replica_id in ids]


class LegacyWholeState(tf.train.experimental.PythonState):
    """Reads checkpoints written before `ShardedState`: the whole state as a NumPy archive (`{slot}:{index}` arrays).
    New checkpoints store an empty string here."""

    def __init__(self, owner):
        self.owner = owner

    def serialize(self):
        return b""

    def deserialize(self, string_value):
        if string_value:
            with np.load(io.BytesIO(string_value)) as archive:
                self.owner.scatter_state({key: archive[key] for key in archive.files})


keras_internals.register_checkpoint_saver(package="tfmp", name="ShardedOptimizerState",
                                          predicate=lambda trackable: isinstance(trackable, ShardedState),
                                          save_fn=_save, restore_fn=_restore)
