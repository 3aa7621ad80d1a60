"""ZeRO-3 / FSDP: each replica holds 1/N of every trainable weight, gathered with its unit where it is read.

`shard_weights(variables, layout, ...)` (called by `ShardedOptimizer(stage="zero3").build`) gives each trainable
float32 Keras variable a new storage in place — the same Python object, so the model, its layers, its optimizer and
its checkpoints keep their references, paths and logical shapes: the replica's chunk of it (`tfmp.sharding.layout`'s
flat chunks, one per-replica `ON_READ` variable). The whole mirrored copy is released. `Chunks` is how such a weight
reads, writes and checkpoints; `tfmp.keras_internals.shard_variable` routes the Keras variable's own methods to it.

Where a layer reads the weight inside `strategy.run` (Keras converts `self.kernel` to a tensor in `call`), it is
gathered with the rest of its FSDP unit in one all-gather, in the compute dtype where Keras' autocast would cast it
anyway (bf16/fp16 copies: half the bytes moved) — `tfmp.sharding.units`: which weights form a unit (a block, a layer,
or the units the optimizer was given) and when their gather runs. Nothing keeps the gathered copies but the ops that
need them: released after their last use — in the backward pass when that pass needs them (a matmul's input gradient
does) — and under `--remat` the recomputed forward gathers again instead of keeping them; where no tape keeps them,
a replica holds about two units' copies at a time (one computing, the next). The gradient is the reduce-scatter ZeRO
needs: each replica receives the sum over replicas of its chunk's gradient (a float32 all-reduce of which each replica
keeps its chunk off GPUs; NCCL's reduce-scatter where `collectives.choose_gradient_reduction` finds GPUs), so
`tape.gradient(loss, model.trainable_weights)` returns chunks, and `ShardedOptimizer(stage="zero3")` updates each
replica's chunks in place, with no collective.

Outside a replica context (eager reads: `get_weights`, `numpy()`, export, evaluation callbacks) a weight reads whole:
the local replicas' chunks concatenated on one machine, across workers one all-gather for a group of weights
(`whole_weights`). Assigning a whole value (a restore, `set_weights`, the moving average swapped in) writes each
replica its chunk. Where Keras traces for shapes only (`compute_output_spec`, as in fit()'s symbolic build: a scratch
graph never run) the weight reads as a stand-in of its shape, never gathered.

Checkpoints: each weight is saved under its own key with its logical shape, as the slices its replicas hold (a flat
chunk is a few rectangular boxes of the tensor: `flat_boxes`), and TensorFlow's bundle reader assembles any slice from
whatever was stored — so a zero3 checkpoint restores into an unsharded model on one device and an unsharded checkpoint
into zero3 on any number of replicas, with the same keys as Keras' own. Several workers: only the chief's checkpoint is
kept, so each weight must reach the chief whole. TensorFlow evaluates all of a save's tensors before writing any (every
worker would hold the whole float32 weights for the length of a save), so the sharded optimizer's registered saver
streams them instead (`stream_to_chief`): a bucket of weights gathered, written by the chief under the weights' own
keys, released, the next. The weights' own saveables then write nothing; in a checkpoint without the optimizer they
still gather each weight whole (TensorFlow's way). A restore on several workers made inside `reading_own_slices()`
(tfmp's checkpoints restore so) reads only the boxes this worker's replicas hold, as on one machine; elsewhere (a
user's own `tf.train.Checkpoint.restore`) each weight whole. The saveable cannot tell a restore from a save — TensorFlow
makes it the same way for both — and a save across workers must name the weight whole, hence the explicit context.

Followers: a momentum target (BYOL's, MoCo v3's, DINO's teacher) is a second copy of the weights, averaged from
them each step. `follow(targets, online)` keeps each target weight in its online weight's layout — sharded when that
one is — so each replica holds the same chunk of both, the average runs chunk by chunk with no collective
(`average_chunks`), the target is gathered where its layers read it, and it is checkpointed (and streamed to the
chief, after its leaders' bucket) as any sharded weight. The target costs each replica W/N, not W.

Not sharded: non-trainable variables (BatchNorm's moving statistics: small, and per replica as Keras keeps them),
variables not in float32 (integer counters), and anything on one replica (nothing to shard).
"""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import tensorflow as tf

from tfmp import keras_internals
from tfmp.sharding import collectives, units
from tfmp.sharding.layout import Layout


_READING_OWN_SLICES = False
_TARGETS = itertools.count()  # each `follow` call's target: its weights' units are twins of their leaders'


@contextlib.contextmanager
def reading_own_slices():
    """Checkpoint restores made inside read, on several workers, only the slices of each zero3 weight that this
    process's replicas hold (TensorFlow's bundle reader cuts them from a weight saved whole or in other slices). On
    several workers a save inside is refused: each worker would write its own slices, and only the chief's are kept."""
    global _READING_OWN_SLICES
    previous, _READING_OWN_SLICES = _READING_OWN_SLICES, True
    try:
        yield
    finally:
        _READING_OWN_SLICES = previous


def _refuse_save():
    raise RuntimeError("a checkpoint saved inside tfmp.sharding.weights.reading_own_slices() on several workers would "
                       "keep only the chief's slices of each zero3 weight; save outside it")


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements `[start, stop)` of a row-major tensor of `shape`, flattened, as rectangular boxes `(offsets, lengths)`
    in flat order: each box is a contiguous run of the range, so the range's values cut in order fill the boxes."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))]
    row = int(np.prod(shape[1:]))
    first, last = start // row, (stop - 1) // row
    if first == last:
        return [((first, *offsets), (1, *lengths)) for offsets, lengths in flat_boxes(shape[1:], start - first * row,
                                                                                     stop - first * row)]
    boxes = []
    if start % row:
        boxes += [((first, *offsets), (1, *lengths)) for offsets, lengths in flat_boxes(shape[1:], start % row, row)]
        first += 1
    whole_rows_end = stop // row
    if whole_rows_end > first:
        boxes.append(((first,) + (0,) * (len(shape) - 1), (whole_rows_end - first, *shape[1:])))
    if stop % row:
        boxes += [((whole_rows_end, *offsets), (1, *lengths)) for offsets, lengths in flat_boxes(shape[1:], 0, stop % row)]
    return boxes


def slice_spec(shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> str:
    """TensorFlow's checkpoint slice string: "d0 d1 o0,l0:o1,l1"."""
    return " ".join(str(dim) for dim in shape) + " " + ":".join(f"{o},{n}" for o, n in zip(offsets, lengths))


class Chunks:
    """How one sharded weight is read, written and checkpointed: its place in the layout, the strategy and the
    reduction it was sharded under (`tfmp.keras_internals.shard_variable` hands the variable's reads and writes here)."""

    def __init__(self, variable, layout: Layout, index: int, strategy, reduction, replica_ids: list[int], unit_key=None):
        self.variable, self.layout, self.index = variable, layout, index
        self.unit_key = unit_key  # the declared FSDP unit it is gathered with (`tfmp.sharding.units`), None: by size
        self.strategy, self.reduction, self.replica_ids = strategy, reduction, replica_ids
        self.shape = tuple(variable.shape)
        self.size, self.chunk = layout.sizes[index], layout.chunks[index]
        self.whole_gathers: dict = {}  # `whole_weights`' traced all-gathers of the groups this weight leads
        # Several workers: the key this weight is being saved under (its saveable, made for each save, sets it) and
        # whether `stream_to_chief` has written it in that save already (then TensorFlow's own save writes nothing).
        self.checkpoint_key: str | None = None
        self.written_by_stream = False
        self.followers: list[Chunks] = []  # the weights that average this one, in its layout (`follow`)

    def saveable_made(self, key: str) -> None:
        """A checkpoint saveable of this weight was made under `key`: recorded for the save in progress
        (`stream_to_chief`), but not inside `reading_own_slices()`, which only restores — there a weight with no slice
        on this worker gets no restore call to clear it, and a key left behind would make this worker alone gather it
        in the next save of the optimizer."""
        self.checkpoint_key = None if _READING_OWN_SLICES else key

    @property
    def storage(self):
        """This replica's chunk (in replica context), or the per-replica variable holding every local one."""
        return keras_internals.variable_storage(self.variable)

    def local_chunks(self) -> list:
        return list(self.strategy.experimental_local_results(self.storage))

    @property
    def one_machine(self) -> bool:
        return collectives.all_replicas_local(self.strategy)

    # -------------------------------------------------------------------- reads

    @staticmethod
    def in_replica_context() -> bool:
        context = tf.distribute.get_replica_context()
        return context is not None and context.num_replicas_in_sync > 1

    def read(self, autocast):
        """The whole weight where a layer reads it: inside `strategy.run`, gathered from every replica's chunk in the
        dtype the reading layer's `autocast` gives it, with the rest of its unit (`tfmp.sharding.units`); outside,
        `whole()`."""
        if not self.in_replica_context():  # cross-replica or the default context: eager reads
            return self.whole()
        del autocast  # the dtype it casts to is the variable's dtype inside the reading layer's autocast scope:
        return units.gathered(self, tf.as_dtype(self.variable.dtype))  # read so: no op before the gather's waits

    def whole(self) -> tf.Tensor:
        """The whole weight in float32, outside a replica context (`whole_weights`)."""
        return whole_weights([self])[0]

    def chunk_of(self, whole, replica) -> tf.Tensor:
        """Replica `replica`'s chunk of a whole value of this weight (float32, padded)."""
        flat = tf.pad(tf.reshape(tf.cast(whole, tf.float32), [-1]), [[0, self.layout.replicas * self.chunk - self.size]])
        return tf.reshape(flat, [self.layout.replicas, self.chunk])[replica]

    # -------------------------------------------------------------------- writes

    def assign_whole(self, value) -> None:
        """A whole value written (a restore, `set_weights`, an average swapped in): each replica takes its chunk."""
        if self.in_replica_context():
            self.storage.assign(self.chunk_of(value, tf.distribute.get_replica_context().replica_id_in_sync_group))
            return
        for replica, chunk in zip(self.replica_ids, self.local_chunks()):
            chunk.assign(self.chunk_of(value, replica))

    def assign_chunk(self, chunk) -> None:
        """This replica's updated chunk (inside `strategy.run`: the sharded optimizer's update)."""
        self.storage.assign(chunk)

    # -------------------------------------------------------------------- checkpoints

    def _boxes(self, replica: int):
        return flat_boxes(self.shape, *self.layout.held_range(self.index, replica))

    def saved_slices(self) -> list:
        """`(slice spec, tensor or a function giving it, device)` for each slice this process saves or restores: the
        boxes of its replicas' chunks on one machine, or restoring inside `reading_own_slices()`; else, with several
        workers, the whole weight (the chief's checkpoint is kept) — nothing when `stream_to_chief` wrote it in this
        save already, gathered here when it did not (a checkpoint without the sharded optimizer)."""
        if not self.shape or not (self.one_machine or _READING_OWN_SLICES):
            device = self.local_chunks()[0].device
            return [("", self._whole_unless_streamed, device)]
        slices = []
        for replica, chunk in zip(self.replica_ids, self.local_chunks()):
            position = 0
            for offsets, lengths in self._boxes(replica):
                count = int(np.prod(lengths))
                read = (lambda chunk=chunk, position=position, count=count, lengths=lengths:
                        tf.reshape(tf.convert_to_tensor(chunk)[position:position + count], lengths))
                slices.append((slice_spec(self.shape, offsets, lengths), read if self.one_machine else _refuse_save,
                               chunk.device))
                position += count
        return slices

    def _whole_unless_streamed(self):
        if self.written_by_stream:
            self.written_by_stream = False
            return None  # TensorFlow records the weight in the object graph and writes no tensor for it
        self.checkpoint_key = None
        return self.whole()

    def restore_slices(self, tensors: list, whole: bool) -> None:
        """Writes back what `saved_slices` named (the whole weight, or this process's boxes), read by TensorFlow from
        whatever layout saved it."""
        if whole:
            self.assign_whole(tensors[0])
            return
        position = 0
        for replica, chunk in zip(self.replica_ids, self.local_chunks()):
            boxes = self._boxes(replica)
            parts = [tf.reshape(tensor, [-1]) for tensor in tensors[position:position + len(boxes)]]
            position += len(boxes)
            # No copy where none is needed (one box, no padding): the restore holds every slice until its end, so
            # each temporary here adds a chunk to its peak.
            if len(parts) == 1:
                values = parts[0]
            else:  # several boxes, or none (a replica holding only padding)
                values = tf.concat(parts, axis=0) if parts else tf.zeros([0])
            values = tf.cast(values, tf.float32)
            missing = self.chunk - int(values.shape[0])
            chunk.assign(tf.pad(values, [[0, missing]]) if missing else values)


def whole_weights(members: list[Chunks]) -> list[tf.Tensor]:
    """The whole float32 values of sharded weights, outside a replica context: on one machine each weight's local
    chunks concatenated; across workers one all-gather of all their chunks (every worker must call it with the same
    weights), traced once per group of weights and kept for the next call — a collective and a traced function for
    each weight would cost ~0.1 s each on 2 workers (ViT-B/16's 196 weights: 14 s of a checkpoint save)."""
    if members[0].one_machine:
        return [tf.reshape(tf.concat([tf.convert_to_tensor(chunk) for chunk in chunks.local_chunks()], axis=0)[:chunks.size],
                           chunks.shape) for chunks in members]
    key = tuple(id(chunks) for chunks in members)  # the function keeps the members, so their ids stay theirs
    gather = members[0].whole_gathers.get(key)
    if gather is None:
        strategy = members[0].strategy

        def gather_in_replica():
            own = [tf.convert_to_tensor(chunks.storage) for chunks in members]
            device = members[0].storage.device
            gathered = tf.distribute.get_replica_context().all_gather(
                units.placed(tf.concat(own, axis=0) if len(own) > 1 else own[0], device), axis=0)
            return units.wholes_from_gathered(gathered, members)

        gather = members[0].whole_gathers[key] = tf.function(lambda: strategy.run(gather_in_replica))
    return [members[0].strategy.experimental_local_results(whole)[0] for whole in gather()]


def stream_to_chief(variables: list, layout: Layout, prefix) -> list:
    """Several workers: writes the sharded weights of `variables` (in `layout`'s order) and their followers (`follow`)
    that the save in progress holds, a bucket at a time — each weight all-gathered (every worker takes part), the chief
    writing the bucket under the weights' own checkpoint keys, whole, before the next bucket is gathered; a bucket's
    followers are a bucket of their own. No process holds more than one bucket of whole weights (TensorFlow's own save
    would evaluate every weight's tensor before writing any). Returns the bundles written (the chief's; TensorFlow
    merges them into the checkpoint), to be called from a registered saver, which TensorFlow runs after the save's
    saveables are made (they set the keys) and before their tensors are read."""
    leaders = {variable.sharded.index: variable.sharded for variable in variables
               if is_sharded(variable) and not variable.sharded.one_machine}
    groups = []
    for bucket in layout.buckets:
        members = [leaders[index] for index in bucket if index in leaders]
        groups += [[chunks for chunks in members if chunks.checkpoint_key],
                   [follower for chunks in members for follower in chunks.followers if follower.checkpoint_key]]
    groups = [group for group in groups if group]
    if not groups:
        return []
    chief = groups[0][0].strategy.extended.should_checkpoint
    prefixes = []
    for number, members in enumerate(groups):
        names = [chunks.checkpoint_key for chunks in members]
        tensors = whole_weights(members)
        for chunks in members:
            chunks.checkpoint_key, chunks.written_by_stream = None, True
        if chief:
            bucket_prefix = tf.strings.join([prefix, f"_weights{number}"])
            tf.raw_ops.SaveV2(prefix=bucket_prefix, tensor_names=names, shape_and_slices=[""] * len(names), tensors=tensors)
            prefixes.append(bucket_prefix)
        del tensors
    return prefixes


def is_sharded(variable) -> bool:
    return getattr(variable, "sharded_storage", False)


def shardable(variable) -> bool:
    """Trainable float32 weights are sharded; the rest stays whole on every replica."""
    return bool(variable.trainable) and tf.dtypes.as_dtype(variable.dtype) == tf.float32


def shard_weights(variables: list, layout: Layout, strategy, reduction, replica_ids: list[int],
                  unit_keys: list | None = None) -> None:
    """Replaces each shardable variable's whole mirrored storage with per-replica chunks, in place (see the module
    docstring), and so its followers' (`follow`). `layout` is over all `variables` (their logical sizes); `replica_ids`
    are this process's replicas' global ids, in `experimental_local_results` order; `unit_keys`, beside `variables`,
    the declared FSDP unit of each (`tfmp.sharding.units`; None: chosen by size)."""
    for index, variable in enumerate(variables):
        if is_sharded(variable) or not shardable(variable):
            continue
        unit_key = unit_keys[index] if unit_keys else None
        chunks = _shard(variable, Chunks(variable, layout, index, strategy, reduction, replica_ids, unit_key))
        for follower, target in getattr(variable, "sharded_followers", ()):
            _shard_as(follower, chunks, target)


def follow(followers: list, leaders: list) -> None:
    """Declares each of `followers` an average of the leader beside it: a momentum target's weights (BYOL's, MoCo v3's,
    DINO's teacher) and the online weights they follow. Under zero3 a follower is kept in its leader's layout — sharded
    when its leader is, now or when the sharded optimizer shards it — so each replica holds the same chunk of both: the
    average updates chunk by chunk with no collective (`average_chunks`), the follower is gathered where a layer reads
    it as its leader is, and it is checkpointed and streamed to the chief the same way. Elsewhere nothing changes."""
    mismatched = [follower.path for follower, leader in zip(followers, leaders) if tuple(follower.shape) != tuple(leader.shape)]
    if len(followers) != len(leaders) or mismatched:
        raise ValueError(f"the target weights do not match the weights they follow ({len(followers)} vs {len(leaders)} "
                         f"weights{', first mismatch ' + mismatched[0] if mismatched else ''})")
    target = next(_TARGETS)
    for follower, leader in zip(followers, leaders):
        if is_sharded(leader):
            _shard_as(follower, leader.sharded, target)
        else:
            leader.sharded_followers = [*getattr(leader, "sharded_followers", ()), (follower, target)]


def average_chunks(follower, leader, momentum: tf.Tensor) -> None:
    """`follower <- momentum * follower + (1 - momentum) * leader` on this replica's chunks (inside `strategy.run`), or
    on every local replica's (outside): both are in one layout (`follow`), so no collective. The padding averages
    zeros into zeros."""
    own, leading = follower.sharded, leader.sharded
    if Chunks.in_replica_context():
        pairs = [(own.storage, leading.storage)]
    else:
        pairs = list(zip(own.local_chunks(), leading.local_chunks()))
    for target, online in pairs:
        target.assign(momentum * tf.convert_to_tensor(target) + (1.0 - momentum) * tf.convert_to_tensor(online))


def _shard_as(follower, chunks: Chunks, target: int) -> None:
    """`follower` sharded in the layout of the weight `chunks` describes (`follow`), in the twin of its declared unit
    for the target `target`."""
    if is_sharded(follower):
        return
    if tf.dtypes.as_dtype(follower.dtype) != tf.float32:
        raise ValueError(f"sharding=zero3 shards float32 weights; {follower.path} follows a sharded weight but is "
                         f"{tf.dtypes.as_dtype(follower.dtype).name}")
    unit_key = None if chunks.unit_key is None else ("target", target, chunks.unit_key)
    chunks.followers.append(_shard(follower, Chunks(follower, chunks.layout, chunks.index, chunks.strategy,
                                                    chunks.reduction, chunks.replica_ids, unit_key)))


def _shard(variable, chunks: Chunks) -> Chunks:
    """`variable`'s whole storage replaced by its replicas' chunks, which `chunks` (over `variable`) describes."""
    layout, strategy, chunk = chunks.layout, chunks.strategy, chunks.chunk
    whole = tf.reshape(tf.convert_to_tensor(keras_internals.variable_storage(variable)), [-1])  # every copy is equal
    padded = tf.reshape(tf.pad(whole, [[0, layout.replicas * chunk - chunks.size]]), [layout.replicas, chunk])
    with strategy.scope():
        storage = tf.Variable(tf.zeros([chunk]), trainable=True, name=variable.name,
                              synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.NONE)
    for replica, component in zip(chunks.replica_ids, strategy.experimental_local_results(storage)):
        component.assign(padded[replica])
    del whole, padded
    keras_internals.shard_variable(variable, storage, chunks)
    return chunks
