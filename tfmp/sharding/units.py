"""FSDP units: which sharded weights are gathered together where a layer reads them, in one collective.

Under zero3 (`tfmp.sharding.weights`) each replica holds a chunk of every trainable weight; where a layer reads one
inside `strategy.run` it is all-gathered — with the rest of its unit (`UnitGather`: one all-gather for the unit's
weights, cast to the compute dtype first where Keras' autocast would cast them anyway, and one reduction for their
gradients). One collective per unit instead of one per weight: between processes each collective and each traced
gradient costs time (on 2 workers ViT-B/16's 196 per-weight gathers took ~1.05 s a step, in 17 groups ~0.55 s;
BUILD_NOTES).

What a unit is (`unit_of`), from the Keras layer calls in progress when the weight is read
(`tfmp.keras_internals.layer_calls`):

* **Declared units** — the `units` a `ShardedOptimizer(stage="zero3", units=...)` was given (a list of layers or
  weights, or a function naming each weight's unit; tfmp's CLI names its encoders' blocks, `tfmp.models.block_of`):
  a declared unit's weights under the outermost call in progress are gathered together, in the innermost call that
  holds them all — a transformer or ResNet block inside the encoder's call (each call of the encoder, each view,
  gathers again), or a `--remat` block's own call (its recomputation gathers again). A follower (a momentum target,
  `weights.follow`) is in its leader's unit's twin, never gathered with the leader.
* **Otherwise by size** — the outermost call whose (undeclared) sharded weights fit one bucket (32 MiB of float32,
  `Layout.bucket_bytes`): a `--remat` block, a user's small sub-model, else each layer (attention's 8 weights, Dense's
  2), a small model whole. A weight read outside any layer call (a user's own train step) is gathered alone.

Members are grouped by the dtype their own layer's policy reads them in (bf16 and float32 islands apart); a weight read
against its layer's policy (a tied weight) is gathered alone in the dtype read. When: a gather's only inputs are
chunks, so left alone TensorFlow's executor issues a step's gathers as it starts; where no tape keeps the copies
(inference, a momentum target's forward pass, `--remat`'s blocks) each unit's gather waits for the unit before
(`gather_waits`).
"""

from __future__ import annotations

import weakref

import tensorflow as tf

from tfmp import keras_internals
from tfmp.models import remat


def gathered(chunks, dtype) -> tf.Tensor:
    """The whole weight `chunks` describes, read by a layer inside `strategy.run` in `dtype` (the dtype the reading
    layer's autocast gives it): gathered with its unit where one is found (`unit_of`), else alone."""
    unit = unit_of(chunks)
    if unit is None:
        return UnitGather([chunks], dtype).whole(chunks)
    scope, key, members = unit
    # A copy gathered where no tape recorded has no gradient path for a recording tape (and back): kept by state.
    recording = keras_internals.tape_recording()
    gathers = _UNIT_GATHERS.setdefault(scope, {})
    gather = gathers.get((key, dtype, recording))
    if gather is None:
        group = [member for member, read_as in members.values() if read_as == dtype]
        if not any(member is chunks for member in group):  # its layer reads it against its policy: gathered alone
            return UnitGather([chunks], dtype).whole(chunks)
        gather = gathers[key, dtype, recording] = UnitGather(group, dtype)
    elif chunks in gather:
        # This read of the chunk tells TensorFlow the weight is used here: where it sits inside a function with
        # its own gradient (`tf.recompute_grad`'s first pass, a user's `tf.custom_gradient`), that function's
        # gradient then covers the weight, although its copy was gathered before, in another such function.
        tf.convert_to_tensor(chunks.storage)
    if chunks not in gather:  # its layer reads it in another dtype than its policy says: gathered alone
        return UnitGather([chunks], dtype).whole(chunks)
    return gather.whole(chunks)


class UnitGather:
    """One all-gather of several sharded weights' chunks, cast to `dtype` first, traced where the first of them is
    read; `whole(chunks)` hands each weight its part.

    The gradient is one reduction for the unit's weights: each replica receives the sum over replicas of its chunks'
    gradients (`collectives`), so `tape.gradient` returns chunks. A member its layers never read in this call gets
    no gradient (None, as an unused weight gets unsharded), not the zeros TensorFlow passes for an unused output; one
    read but not connected to the loss gets zeros where unsharded it gets None (not told apart here). Made inside
    `strategy.run` only."""

    def __init__(self, members: list, dtype):
        self.members, self.dtype, self.read = members, tf.as_dtype(dtype), set()
        self.position = {id(chunks): index for index, chunks in enumerate(members)}
        # The waits first: they are found from the newest op on the device, which must be the model's, not a read here.
        waits = gather_waits(members[0].storage.device, kept=keras_internals.tape_recording())
        owns = [tf.convert_to_tensor(chunks.storage) for chunks in members]
        with tf.control_dependencies(waits):
            self.wholes = self._gather(tf.distribute.get_replica_context())(*owns)

    def __contains__(self, chunks) -> bool:
        return id(chunks) in self.position

    def whole(self, chunks) -> tf.Tensor:
        index = self.position[id(chunks)]
        self.read.add(index)
        return self.wholes[index]

    def _gather(self, context):
        members, dtype, read = self.members, self.dtype, self.read
        replicas, device, reduction = members[0].layout.replicas, members[0].storage.device, members[0].reduction

        @tf.custom_gradient
        def gather(*owns):
            low = [tf.cast(own, dtype) for own in owns]
            low = placed(tf.concat(low, axis=0) if len(low) > 1 else low[0], device)
            if dtype == tf.bfloat16:  # TensorFlow's CPU collective gather has no bf16 kernel: the same 16 bits move
                gathered = tf.bitcast(context.all_gather(tf.bitcast(low, tf.float16), axis=0), tf.bfloat16)
            else:
                gathered = context.all_gather(low, axis=0)  # replica r's chunks of every member, in replica order
            wholes = wholes_from_gathered(gathered, members)

            def gradient(*upstreams):
                present = [index for index in sorted(read) if upstreams[index] is not None]
                gradients = [None] * len(members)
                if not present:
                    return gradients
                parts = []
                for index in present:
                    chunks = members[index]
                    flat = tf.reshape(tf.cast(upstreams[index], tf.float32), [-1])
                    parts.append(tf.reshape(tf.pad(flat, [[0, replicas * chunks.chunk - chunks.size]]),
                                            [replicas, chunks.chunk]))
                packed = tf.concat(parts, axis=1) if len(parts) > 1 else parts[0]  # row r: what replica r keeps
                order = reduction.rank_order(context)
                packed = placed(tf.reshape(packed if order is None else tf.gather(packed, order), [-1]), device)
                own = reduction.own_chunk(context, packed, replicas)
                pieces = tf.split(own, [members[index].chunk for index in present]) if len(present) > 1 else [own]
                for index, piece in zip(present, pieces):
                    gradients[index] = piece
                return gradients

            return wholes, gradient

        return gather


# Per traced graph, each layer's sharded weights (`_LayerWeights`); per layer call in progress (its Keras name scope),
# the unit gathers made in it, by unit, dtype and tape state. Weak keys: a graph, a layer or a call gone takes its
# entries with it.
_LAYER_WEIGHTS: "weakref.WeakKeyDictionary[tf.Graph, weakref.WeakKeyDictionary]" = weakref.WeakKeyDictionary()
_UNIT_GATHERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _LayerWeights:
    """The sharded weights under one layer: `{id(chunks): (chunks, dtype read)}`, each with the dtype its own layer's
    policy reads it in (the compute dtype where that layer autocasts it, else float32); `undeclared`, those in no
    declared unit, and their float32 bytes."""

    def __init__(self, layer):
        self.members = {}
        for owner, variable in keras_internals.weights_by_owner(layer):
            chunks = getattr(variable, "sharded", None)
            if not getattr(variable, "sharded_storage", False) or id(chunks) in self.members:
                continue
            compute = tf.as_dtype(owner.compute_dtype)
            casts = owner.autocast and keras_internals.variable_autocasts(variable) and compute.is_floating
            self.members[id(chunks)] = (chunks, compute if casts else tf.float32)
        self.undeclared = {key: member for key, member in self.members.items() if member[0].unit_key is None}
        self.undeclared_bytes = sum(chunks.size for chunks, _ in self.undeclared.values()) * 4
        self.declared: dict = {}  # unit key -> its members here, filled as asked

    def of_unit(self, key) -> dict:
        if key not in self.declared:
            self.declared[key] = {index: member for index, member in self.members.items() if member[0].unit_key == key}
        return self.declared[key]


def unit_of(chunks):
    """`(scope, unit key, members)` of the unit `chunks`' weight is read in — `members` as `_LayerWeights.members`,
    `scope` the layer call the unit's gathers are kept for, the key None for a unit chosen by size — or None where no
    layer call is in progress (a read from a user's own train step) or, by size, none that holds the weight fits."""
    known = _LAYER_WEIGHTS.setdefault(tf.compat.v1.get_default_graph(), weakref.WeakKeyDictionary())

    def weights_of(layer) -> _LayerWeights:
        if layer not in known:
            known[layer] = _LayerWeights(layer)
        return known[layer]

    calls = keras_internals.layer_calls()
    if chunks.unit_key is not None:
        if not calls:
            return None
        members = weights_of(calls[0][1]).of_unit(chunks.unit_key)  # the unit's weights under the outermost call
        # Kept for the innermost call holding them all (the outermost one does): a `--remat` block's own call, so
        # that its recomputation gathers again; else the encoder's, so that each call of it (each view) does.
        scope = next(scope for scope, layer in reversed(calls) if members.keys() <= weights_of(layer).members.keys())
        return scope, chunks.unit_key, members
    for scope, layer in calls:  # outermost first: the largest call that fits a bucket
        weights = weights_of(layer)
        if id(chunks) in weights.undeclared and weights.undeclared_bytes <= chunks.layout.bucket_bytes:
            return scope, None, weights.undeclared
    return None


def wholes_from_gathered(gathered, members: list) -> list[tf.Tensor]:
    """Each member's whole value from an all-gather of every replica's chunks of `members` laid end to end (row r of
    `[replicas, sum of chunks]`: replica r's chunks, in member order)."""
    if len(members) == 1:
        return [tf.reshape(gathered[:members[0].size], members[0].shape)]
    rows, wholes, start = tf.reshape(gathered, [members[0].layout.replicas, -1]), [], 0
    for chunks in members:
        wholes.append(tf.reshape(tf.reshape(rows[:, start:start + chunks.chunk], [-1])[:chunks.size], chunks.shape))
        start += chunks.chunk
    return wholes


# Per traced graph and device: (the name of the replica's newest op when a weight was last read there, the
# recomputation then). Names, not ops: an op refers to its graph, which would keep every traced graph alive as a key.
_PREVIOUS_READS: "weakref.WeakKeyDictionary[tf.Graph, dict]" = weakref.WeakKeyDictionary()


def gather_waits(device: str, kept: bool) -> list:
    """The ops a gather traced now on `device` must wait for, so that its copies are made shortly before their unit
    runs where nothing keeps them for a backward pass.

    A gather's only input is the replica's chunk, which exists when the step starts, so TensorFlow's executor would
    issue every gather of a step at once and hold every gathered copy together. Where a backward pass keeps the copy
    anyway (`kept`: a tape records it) that costs nothing and lets the gathers overlap the forward pass; there no
    wait. Elsewhere each gather waits for the replica's newest op when the previous gather was made: about one unit
    of prefetch, as FSDP's. That is inference, a momentum target's forward pass, and `--remat`'s blocks — their
    first forward pass runs unrecorded, and a block's recomputation (`remat.current_recomputation()`) gathers after
    the backward pass reached it (its first gather waits for the newest op then, which follows the block's incoming
    gradient; `tf.recompute_grad` orders only the block's inputs after it, not its weight reads). Ops created earlier
    cannot depend on the gather, so no wait deadlocks; each replica waits for its own ops only."""
    if tf.executing_eagerly():
        return []
    graph = tf.compat.v1.get_default_graph()
    newest = next((op for op in reversed(graph.get_operations()) if op.device == device), None)
    recomputation = remat.current_recomputation()
    reads = _PREVIOUS_READS.setdefault(graph, {})
    previous, reads[device] = reads.get(device), (None if newest is None else newest.name, recomputation)
    if recomputation is not None and (previous is None or previous[1] is not recomputation):
        return [newest] if newest is not None else []
    if kept and recomputation is None:
        return []
    return [graph.get_operation_by_name(previous[0])] if previous is not None and previous[0] is not None else []


def placed(tensor, device) -> tf.Tensor:
    """`tensor` on `device`: a multi-worker collective finds where it runs from its input's device, which a tensor
    read in a traced replica function may lack."""
    with tf.device(device):
        return tf.identity(tensor)
