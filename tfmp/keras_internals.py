"""Every private Keras / TensorFlow hook tfmp touches, in one place, with the versions it was checked on.

tfmp builds on Keras' public API wherever one exists. Where it does not, the private
name is used here and nowhere else, so an upgrade has one file to re-check:

hook — who uses it — why there is no public way:

* `Model._initial_epoch` — `Checkpointing` (resume) — the hook Keras' own `BackupAndRestore` sets.
* `Layer._flatten_layers` — `--float32_layers`, the precision doctor, FLOP counting — nested layers of
  any depth, Functional or subclassed.
* `BatchNormalization._moments` — tfmp's `BatchNormalization` under recomputation — Keras' own
  (masked, synchronized) batch statistics.
* `Optimizer._get_variable_index` — `tfmp.optimizers.LARS`, `tfmp.sharding` — where a variable's slots are, as
  Keras' own optimizers find them.
* A Keras variable's `_value`, `_maybe_autocast`, `_direct_assign`, `_shared_name`, TensorFlow's
  `_gather_saveables_for_checkpoint` and `SaveableObject` / `SaveSpec`, Keras' stateless scope, `Optimizer._var_key`,
  a `tf.Variable`'s `_unique_id` — `tfmp.sharding.weights` (zero3) — a weight whose storage is per-replica chunks,
  gathered where it is read and checkpointed as slices: Keras has no public way to give a variable another storage.
* `Optimizer._use_weight_decay` — `tfmp.sharding` — Keras' own weight-decay exclusions (lists and pattern) for
  a variable, so the sharded update decays exactly what the unsharded one does.
* `Adam._momentums`, `Adam._velocities` (AdamW's too; SGD's are public `momentums`) — `tfmp.sharding` — the slot
  variables of a variable, to move an optimizer's state into shards and back.
* `Trainer._compute_loss`, `Trainer._loss_tracker` — `tfmp.accumulation.accumulating_train_step` — Keras'
  default `train_step` in micro-batches: the same loss call (with or without a user's `training` argument) and the
  same `loss` tracker the default step updates.
* `Optimizer._model_variables_moving_average`, `Optimizer._trainable_variables` — `tfmp.averaging` — the average
  Keras' `use_ema` keeps, and the variables it belongs to (in the same order), to evaluate and export it.
* `keras.src.tree.register_tree_node_class` — `tfmp.callbacks.RunCallbacks` — `fit(callbacks=...)` flattens its
  argument with `keras.tree`, to which a list subclass is one leaf; Keras 3 exports no way to register one.
* `vars(model)` (`model_attributes`) — `tfmp.callbacks.model_state` — the optimizers a model holds as attributes;
  public Python, fenced because it relies on Keras keeping a model's tracked attributes in its instance dict.
* `LossScaleOptimizer._tf_apply`, `_stateful_handle_finite_grads`, `_stateful_handle_non_finite_grads`,
  `_overwrite_variable_with_gradient`, `_trainable_variables` — `LossScaleOptimizerHooks`, the base
  of `tfmp.precision.LossScaleOptimizer` — floor, hysteresis, skip count and the all-replica overflow
  decision (`tfmp/upstream.py`) override these; here they call public hooks.
* `keras.src.backend.tensorflow.trainer` (`TensorFlowTrainer._maybe_symbolic_build`, `_symbolic_build`,
  `reduce_per_replica`, `_collective_all_reduce_multi_worker`) — `tfmp/upstream.py` — the two
  multi-worker `fit()` fixes patch them (`patch_multi_worker_trainer`).
* `tf.__internal__.distribute.strategy_supports_no_merge_call` — `tfmp/upstream.py` — which
  cross-replica path an optimizer step takes.
* `tf.__internal__.distribute.interim.maybe_merge_call` — `tfmp/ssl/momentum.py` (EMA target
  update) — the cross-replica update path Keras' optimizers take, with and without merge calls.
* `MirroredStrategy._collective_key_base` — `tfmp.distribute.get_strategy` — each MirroredStrategy tfmp makes
  gets collective keys no earlier one in the process used (as TensorFlow's own tests do): TF keeps each
  (group, instance) key's collective type for the process' life and every new strategy starts again at group 1,
  instance 100, so a second strategy whose collectives come in another order fails.
* `CollectiveAllReduce._launchers` and a launcher's `_device`, `_group_size`, `_group_key`,
  `_next_instance_key`, `_get_ordering_token`, `_options` (TensorFlow's `cross_device_ops` /
  `cross_device_utils`) — `tfmp.sharding`'s NCCL reduce-scatter — tf.distribute offers all-reduce
  and all-gather in public but no reduce-scatter; TF's `CollectiveReduceScatterV2` op is run with the
  strategy's own group, instance keys and ordering token, as its launchers run all-reduce.

Public enough to stay outside: checkpoint keys such as `epoch/.ATTRIBUTES/VARIABLE_VALUE`
(`tfmp/callbacks/checkpoint_files.py`): the format `tf.train.Checkpoint` writes and TensorFlow's "Training
checkpoints" guide shows and reads by name (`tf.train.list_variables`).

`CHECKED_KERAS_VERSIONS` names the Keras releases these were read and tested against
(tests/test_keras_internals.py fails if a hook disappears, and its AST scan fails if any other
module of tfmp touches a private Keras or TensorFlow name). Outside them, the first use warns
once; tfmp keeps working as long as the hooks exist.
"""

from __future__ import annotations

import functools
import logging

import keras

logger = logging.getLogger(__name__)

CHECKED_KERAS_VERSIONS = ("3.15",)  # major.minor releases read and tested
LOSS_SCALE_HOOKS = ("_tf_apply", "_stateful_handle_finite_grads", "_stateful_handle_non_finite_grads",
                    "_overwrite_variable_with_gradient", "check_finite")


@functools.lru_cache(maxsize=None)
def warn_if_unchecked() -> bool:
    """Warns once when the installed Keras is not a release these hooks were checked on; returns whether it is."""
    major_minor = ".".join(keras.__version__.split(".")[:2])
    if major_minor in CHECKED_KERAS_VERSIONS:
        return True
    logger.warning("tfmp: Keras %s is not a release tfmp's Keras hooks were checked on (%s); see tfmp/keras_internals.py",
                   keras.__version__, ", ".join(CHECKED_KERAS_VERSIONS))
    return False


def _hooks() -> list[tuple[str, object, str]]:
    """Every private name this module touches: (where it is looked up, the object that must have it, the name).
    `missing_hooks` checks each; tests/test_keras_internals.py fails when this module uses a private name not listed."""
    import tensorflow as tf

    from keras.src import tree as keras_tree
    from keras.src.backend.common import global_state
    from tensorflow.python.eager import record
    from tensorflow.python.saved_model import registration as saved_model_registration

    trainer = tensorflow_trainer()
    # Slot lists and the built variables exist on a built optimizer only (Keras 3.15 sets them in build()).
    variables = [keras.Variable([1.0])]
    adam, scaled = keras.optimizers.Adam(), keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    averaging = keras.optimizers.SGD(use_ema=True)
    adam.build(variables)
    averaging.build(variables)
    scaled.build(variables)
    hooks = [("Model (an instance)", keras.Sequential(), "_initial_epoch"),
             ("LossScaleOptimizer (built)", scaled, "_trainable_variables"),
             ("Adam (built)", adam, "_momentums"), ("Adam (built)", adam, "_velocities"),
             ("Adam (built)", adam, "_trainable_variables"), ("Optimizer (built, use_ema)", averaging, "_model_variables_moving_average"),
             *(("LossScaleOptimizer", keras.optimizers.LossScaleOptimizer, name) for name in LOSS_SCALE_HOOKS),
             ("trainer", trainer, "reduce_per_replica"), ("trainer", trainer, "_collective_all_reduce_multi_worker"),
             ("TensorFlowTrainer", trainer.TensorFlowTrainer, "_maybe_symbolic_build"),
             ("TensorFlowTrainer", trainer.TensorFlowTrainer, "_symbolic_build"),
             ("Layer", keras.layers.Layer, "_flatten_layers"),
             ("Model", keras.Model, "_compute_loss"), ("Model (an instance)", keras.Sequential(), "_loss_tracker"),
             ("BatchNormalization", keras.layers.BatchNormalization, "_moments"),
             ("Optimizer", keras.optimizers.Optimizer, "_get_variable_index"),
             ("Optimizer", keras.optimizers.Optimizer, "_use_weight_decay"),
             ("Optimizer (TensorFlow)", keras.optimizers.Optimizer, "_all_reduce_sum_gradients"),
             ("keras.src.tree", keras_tree, "register_tree_node_class"),
             ("tf", tf, "__internal__"),
             ("tf.__internal__.distribute", tf.__internal__.distribute, "strategy_supports_no_merge_call"),
             ("tf.__internal__.distribute", tf.__internal__.distribute, "interim"),
             ("tf.__internal__.distribute.interim", tf.__internal__.distribute.interim, "maybe_merge_call"),
             ("MirroredStrategy", tf.distribute.MirroredStrategy, "_collective_key_base"),
             ("tf.__internal__.tracking", tf.__internal__.tracking, "Trackable"),
             ("tensorflow.python.saved_model.registration", saved_model_registration, "register_checkpoint_saver"),
             ("tensorflow.python.eager.record", record, "could_possibly_record"),
             ("keras.src.backend.common.global_state", global_state, "get_global_attribute"),
             ("Keras variable", variables[0], "_autocast"),
             *(("Keras variable (TensorFlow)", variables[0], name) for name in SHARDED_VARIABLE_HOOKS),
             ("tf.Variable", variables[0].value, "_unique_id"), ("Optimizer (TensorFlow)", keras.optimizers.Optimizer, "_var_key")]
    if isinstance(getattr(tf.distribute.MirroredStrategy, "_collective_key_base", None), int):
        fresh_collective_keys()  # this throwaway strategy's keys collide with no other's
    extended = tf.distribute.MirroredStrategy(tf.config.list_logical_devices("CPU")[:1]).extended
    hooks.append(("MirroredExtended", extended, "_collective_ops"))
    collective_ops = getattr(extended, "_collective_ops", None)
    hooks += [("CollectiveAllReduce", collective_ops, "_launchers"), ("CollectiveAllReduce", collective_ops, "_options")]
    launchers = collective_launchers_of(collective_ops)
    if launchers:
        hooks += [("CollectiveReplicaLauncher", launchers[0], name) for name in _LAUNCHER_HOOKS]
    return hooks


# Looked up on objects only a running multi-worker job builds; `collective_launchers` tries both names.
UNCHECKABLE_HERE = ("_cross_device_ops",)


def missing_hooks() -> list[str]:
    """Private names tfmp relies on that the installed Keras / TensorFlow lacks (empty when all are there)."""
    return [f"{where}.{name}" for where, owner, name in _hooks() if owner is None or not hasattr(owner, name)]


def hook_names() -> set[str]:
    """The private names `missing_hooks` checks, and those it cannot check here (`UNCHECKABLE_HERE`)."""
    return {name for _, _, name in _hooks()} | set(UNCHECKABLE_HERE)


def register_tree_node(cls, flatten, unflatten) -> None:
    """Makes Keras' nested-structure utilities (`keras.tree`, which `fit(callbacks=...)` flattens with) see into
    `cls`: `flatten(instance)` gives its children, `unflatten(children)` rebuilds one. Keras 3 exports no register
    function; a list subclass is otherwise one leaf to it."""
    from keras.src import tree as keras_tree

    cls.tree_flatten = lambda self: (flatten(self), None, None)  # optree's protocol: children, metadata, entries
    cls.tree_unflatten = classmethod(lambda cls_, metadata, children: unflatten(children))
    try:
        keras_tree.register_tree_node_class(cls)
    except ValueError:
        pass  # registered already (the module imported twice)


def model_attributes(model: keras.Model) -> dict:
    """The attributes a model (a user's subclass) holds, by name: Keras keeps them in the instance dict."""
    return dict(vars(model))


def set_initial_epoch(model: keras.Model, epoch: int) -> None:
    """Makes the running `fit()` start at `epoch` (what Keras' `BackupAndRestore` does on resume)."""
    warn_if_unchecked()
    model._initial_epoch = epoch


def nested_layers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """Every layer inside `layer`, at any depth (not `layer` itself)."""
    return list(layer._flatten_layers(include_self=False, recursive=True))


def leaf_layers(model: keras.layers.Layer) -> list[keras.layers.Layer]:
    """The layers inside `model` that hold no other layers."""
    return [layer for layer in nested_layers(model) if not list(layer._flatten_layers(include_self=False))]


def tensorflow_trainer():
    """Keras' TensorFlow trainer module (patched by `tfmp.upstream` for multi-worker `fit()`)."""
    from keras.src.backend.tensorflow import trainer

    warn_if_unchecked()
    return trainer


def strategy_supports_no_merge_call() -> bool:
    """Whether the current strategy runs optimizer updates without `merge_call` (XLA on all-GPU mirrored strategies)."""
    import tensorflow as tf

    return tf.__internal__.distribute.strategy_supports_no_merge_call()


def maybe_merge_call(fn, strategy, *args):
    """Runs `fn(distribution, *args)` in cross-replica context (or directly where the strategy needs no merge
    call), as Keras' TensorFlow optimizer applies its updates."""
    import tensorflow as tf

    return tf.__internal__.distribute.interim.maybe_merge_call(fn, strategy, *args)


def is_multi_worker(strategy) -> bool:
    """Keras' own test for a multi-worker collective strategy (the branch `tfmp.upstream` fixes)."""
    return tensorflow_trainer()._collective_all_reduce_multi_worker(strategy)


def batch_statistics(layer: keras.layers.BatchNormalization, inputs, mask):
    """Keras' batch mean and variance for `layer` (masked and synchronized as the layer is)."""
    return layer._moments(inputs, mask)


def variable_index(optimizer: keras.optimizers.Optimizer, variable) -> int:
    """The index of `variable`'s slots in `optimizer`'s per-variable lists (as Keras' optimizers look it up)."""
    return optimizer._get_variable_index(variable)


def uses_weight_decay(optimizer: keras.optimizers.Optimizer, variable) -> bool:
    """Whether Keras' decoupled weight decay applies to `variable` (its exclusion lists and pattern)."""
    return optimizer._use_weight_decay(variable)


# Where Keras 3.15 keeps each optimizer's slot variables, by the name tfmp.sharding gives them.
_SLOT_ATTRIBUTES = {"momentum": ("_momentums", "momentums"), "velocity": ("_velocities",),
                    "average": ("_model_variables_moving_average",)}


def optimizer_slot(optimizer: keras.optimizers.Optimizer, name: str, variable):
    """The slot variable `name` (momentum, velocity, average) of a built optimizer for `variable`."""
    for attribute in _SLOT_ATTRIBUTES[name]:
        slots = getattr(optimizer, attribute, None)
        if slots:
            return slots[variable_index(optimizer, variable)]
    raise KeyError(f"{type(optimizer).__name__} has no {name} slots")


def transform_after_reduction(optimizer: keras.optimizers.Optimizer, transform) -> None:
    """Makes `optimizer` pass the replicas' summed gradients through `transform` (a function of the list of the
    gradients present) before its update. Keras' TensorFlow optimizers sum them in `_all_reduce_sum_gradients`, which
    `_backend_update_step` calls after `apply` has clipped each replica's own gradients; on one device the sum is
    the gradient itself."""
    reduce = optimizer._all_reduce_sum_gradients

    def reduce_then_transform(grads_and_vars):
        pairs = list(reduce(grads_and_vars))
        present = [index for index, (gradient, _) in enumerate(pairs) if gradient is not None]
        for index, gradient in zip(present, transform([pairs[index][0] for index in present])):
            pairs[index] = (gradient, pairs[index][1])
        return pairs

    optimizer._all_reduce_sum_gradients = reduce_then_transform


# ------------------------------------------------------------------ checkpoint extension points of TensorFlow


def checkpoint_trackable_base():
    """The base class of objects `tf.train.Checkpoint` tracks (`tf.__internal__.tracking.Trackable`): what an object
    saved by a registered checkpoint saver derives from."""
    import tensorflow as tf

    return tf.__internal__.tracking.Trackable


def register_checkpoint_saver(*, package: str, name: str, predicate, save_fn, restore_fn) -> None:
    """TensorFlow's registered checkpoint savers (`tensorflow.python.saved_model.registration`; not exported as
    `tf.*` in TF 2.21): objects passing `predicate` are written by `save_fn(trackables, file_prefix)` (tensor bundles
    with SaveV2, merged into the checkpoint) and read by `restore_fn(trackables, merged_prefix)` (RestoreV2)."""
    from tensorflow.python.saved_model import registration

    registration.register_checkpoint_saver(package=package, name=name, predicate=predicate, save_fn=save_fn,
                                           restore_fn=restore_fn)


def tape_recording() -> bool:
    """Whether a `tf.GradientTape` records on this thread now (not stopped: `tf.recompute_grad`'s first pass and
    `tape.stop_recording()` are not), asked without making an op (`record.could_possibly_record`)."""
    from tensorflow.python.eager import record

    return bool(record.could_possibly_record())


# ------------------------------------------------------------------ ZeRO-3's sharded weights (tfmp.sharding.weights)

# A Keras variable keeps its storage in `_value` and reads it through its `value` property (with `_maybe_autocast`
# inside a layer's call); TensorFlow finds its checkpoint tensors through `_shared_name` and, on its older saveable
# route, `_gather_saveables_for_checkpoint`; Keras writes it through `_direct_assign`. Keras has no public way to give
# a variable another storage: `shard_variable` replaces the storage and mixes `_ShardedVariable` into the variable's
# class, whose methods hand every read, write and checkpoint to `sharded` (a `tfmp.sharding.weights.Chunks`).
SHARDED_VARIABLE_HOOKS = ("_value", "_maybe_autocast", "_direct_assign", "_shared_name",
                          "_gather_saveables_for_checkpoint")


class _ShardedVariable:
    sharded_storage = True  # `tfmp.distribute.check_replica_consistency`: the chunks differ by design

    @property
    def value(self):  # Keras' own `numpy`, `__array__` and `__tf_tensor__` read through it: whole outside a step
        from keras.src.backend.common import stateless_scope, symbolic_scope

        if symbolic_scope.in_symbolic_scope():
            # Keras tracing shapes only (`compute_output_spec`, e.g. fit()'s symbolic build: a scratch graph never
            # run): a stand-in of the weight's shape, not a gather — which on several workers traced one
            # collective function per weight into the process (~0.4 GiB RSS for ViT-B/16's 198 weights).
            import tensorflow as tf

            return self._maybe_autocast(tf.zeros(self.shape, self.dtype))
        if stateless_scope.in_stateless_scope():
            mapped = stateless_scope.get_stateless_scope().get_current_value(self)
            if mapped is not None:
                return self._maybe_autocast(mapped)
        return self._maybe_autocast(self.sharded.read(self._maybe_autocast))

    @property
    def handle(self):  # what GradientTape watches: this replica's chunk
        return self._value.handle

    @property
    def _shared_name(self):
        return self._value._shared_name

    def _direct_assign(self, value):
        self.sharded.assign_whole(value)

    def _gather_saveables_for_checkpoint(self):
        # TensorFlow's older saveable route, on purpose: its restore hands back one tensor per slice, where the newer
        # `_serialize_to_tensors` route passes only a key's first slice (TF 2.21, `TrackableSaveable.restore`).
        return {"VARIABLE_VALUE": lambda name: _ChunkSaveable(self, name)}


def _saveable_base():
    from tensorflow.python.training.saving import saveable_object

    return saveable_object.SaveableObject, saveable_object.SaveSpec


class _ChunkSaveable(_saveable_base()[0]):
    """A sharded weight in a checkpoint: one spec per slice `sharded.saved_slices()` gives (the boxes its replicas
    hold, or the whole weight), restored from TensorFlow's slices in the same order."""

    def __init__(self, variable, name):
        save_spec = _saveable_base()[1]
        self.variable = variable
        variable.sharded.saveable_made(name)  # the key of the save in progress (`weights.stream_to_chief`)
        specs = [save_spec(tensor, spec, name, dtype="float32", device=device)
                 for spec, tensor, device in variable.sharded.saved_slices()]
        super().__init__(variable, specs, name)

    def restore(self, restored_tensors, restored_shapes):
        del restored_shapes
        self.variable.sharded.checkpoint_key = None  # made for a restore, not a save
        self.variable.sharded.restore_slices(list(restored_tensors), whole=self.specs[0].slice_spec == "")


class ShardedVariableKeys:
    """Mixed into the optimizers that hold sharded weights (tfmp's sharded and loss-scale optimizers): Keras identifies
    a variable by its storage (`Optimizer._var_key` reads `variable.value`, a gathered tensor for a sharded weight);
    a sharded weight is identified by its chunks' variable instead."""

    def _var_key(self, variable):
        if getattr(variable, "sharded_storage", False):
            return variable._value._unique_id
        return super()._var_key(variable)


_SHARDED_CLASSES: dict = {}


def shard_variable(variable, storage, sharded) -> None:
    """Makes `variable` (a Keras variable) read, write and checkpoint through `sharded`, its storage now `storage`
    (the whole copy it held is released)."""
    keras_class = type(variable)
    if keras_class not in _SHARDED_CLASSES:
        _SHARDED_CLASSES[keras_class] = type(f"Sharded{keras_class.__name__}", (_ShardedVariable, keras_class), {})
    variable._value = storage
    variable.sharded = sharded
    variable.__class__ = _SHARDED_CLASSES[keras_class]


def layer_calls() -> list:
    """The Keras layer calls in progress in this thread, outermost first, as `(scope, layer)`: `Layer.__call__` opens
    a name scope naming the layer its caller (Keras' `name_scope_stack`, thread-local as each replica's thread is), a
    new scope object for each call — so a scope names one call of its layer (zero3's unit gathers are kept per call)."""
    from keras.src.backend.common import global_state

    stack = global_state.get_global_attribute("name_scope_stack") or []
    return [(scope, scope.caller) for scope in stack if isinstance(scope.caller, keras.layers.Layer)]


def weights_by_owner(layer) -> list:
    """`(owner, variable)` for each trainable variable under `layer`, with the (sub)layer that created it — whose
    dtype policy and `autocast` decide the dtype the variable is read in (Keras' `_flatten_layers` and per-layer
    `_trainable_variables`; the variable's own `_autocast`)."""
    return [(owner, variable) for owner in layer._flatten_layers(include_self=True, recursive=True)
            for variable in owner._trainable_variables]


def variable_autocasts(variable) -> bool:
    """Whether a layer's autocast scope casts `variable` when it is read (Keras' `Variable(autocast=...)`)."""
    return bool(variable._autocast)


def variable_storage(variable):
    """The TensorFlow variable a Keras variable keeps its value in (a sharded weight's: this replica's chunk)."""
    return variable._value


# ------------------------------------------------------------------ tf.distribute's collective launchers

_LAUNCHER_HOOKS = ("_device", "_group_size", "_group_key", "_next_instance_key", "_get_ordering_token", "_options")


def collective_launchers(strategy):
    """`(launchers, implementation)` of a Mirrored- or MultiWorkerMirroredStrategy's collective ops — one
    launcher per local replica, in `extended.worker_devices` order; implementation "AUTO", "RING" or "NCCL" — or
    None for a strategy without them (one device, TPUStrategy)."""
    extended = strategy.extended
    for attribute in ("_collective_ops", "_cross_device_ops"):  # MirroredStrategy's, MultiWorkerMirroredStrategy's
        collective_ops = getattr(extended, attribute, None)
        launchers = collective_launchers_of(collective_ops)
        if launchers:
            return launchers, collective_ops._options.implementation.name
    return None


def collective_launchers_of(collective_ops) -> list | None:
    """The per-replica launchers of a strategy's collective ops object, or None."""
    launchers = getattr(collective_ops, "_launchers", None)
    return list(launchers) if launchers else None


COLLECTIVE_KEY_STRIDE = 100_000  # group keys per strategy, as TensorFlow's strategy_combinations spaces them


def fresh_collective_keys() -> None:
    """Makes the next `tf.distribute.MirroredStrategy` built in this process use collective group keys no earlier one
    used. Without it, a notebook that builds a second strategy whose collectives come in another order than the
    first's fails with "Collective instance 100 expected type 0 and data_type 1 but got type 2" (measured). Not for
    MultiWorkerMirroredStrategy: its workers must agree on the keys."""
    import tensorflow as tf

    tf.distribute.MirroredStrategy._collective_key_base += COLLECTIVE_KEY_STRIDE


def _collective_arguments(launcher) -> dict:
    token = launcher._get_ordering_token()
    return {"group_size": launcher._group_size, "group_key": launcher._group_key, "instance_key": launcher._next_instance_key(),
            "ordering_token": [] if token is None else [token], "communication_hint": "nccl",
            "timeout_seconds": launcher._options.timeout_seconds or 0}


def nccl_reduce_scatter(launcher, tensor):
    """The group's `tensor`s summed, split into group-size chunks along axis 0; this device gets the chunk at its
    rank. NCCL only: TensorFlow registers no other implementation of `CollectiveReduceScatterV2`."""
    import tensorflow as tf

    with tf.device(launcher._device):
        return tf.raw_ops.CollectiveReduceScatterV2(input=tensor, merge_op="Add", final_op="Id", **_collective_arguments(launcher))


def nccl_all_gather(launcher, tensor):
    """The group's `tensor`s concatenated along axis 0 in rank order (the order `nccl_reduce_scatter` deals chunks)."""
    import tensorflow as tf

    with tf.device(launcher._device):
        return tf.raw_ops.CollectiveGatherV2(input=tensor, **_collective_arguments(launcher))


class LossScaleOptimizerHooks(ShardedVariableKeys, keras.optimizers.LossScaleOptimizer):
    """Keras' `LossScaleOptimizer` whose private steps call public hooks, for subclasses to override.

    `apply_scaled_step` is one distributed step (Keras' `_tf_apply`); `on_finite_gradients` and
    `on_non_finite_gradients` are what it does when the gradients are finite or not (Keras'
    `_stateful_handle_finite_grads` / `_stateful_handle_non_finite_grads`). The defaults are Keras' own.
    """

    def _tf_apply(self, grads, trainable_variables=None):
        self.apply_scaled_step(grads, trainable_variables)

    def _stateful_handle_finite_grads(self, grads, trainable_variables):
        self.on_finite_gradients(grads, trainable_variables)

    def _stateful_handle_non_finite_grads(self):
        self.on_non_finite_gradients()

    def apply_scaled_step(self, grads, trainable_variables=None):
        keras.optimizers.LossScaleOptimizer._tf_apply(self, grads, trainable_variables)

    def on_finite_gradients(self, grads, trainable_variables):
        keras.optimizers.LossScaleOptimizer._stateful_handle_finite_grads(self, grads, trainable_variables)

    def on_non_finite_gradients(self):
        keras.optimizers.LossScaleOptimizer._stateful_handle_non_finite_grads(self)

    def stepped_variables(self, trainable_variables=None) -> list:
        """`trainable_variables`, or the ones the optimizer was built for."""
        return trainable_variables or self._trainable_variables

    def overwrites_with_gradient(self, variable) -> bool:
        """Whether Keras assigns this variable its "gradient" instead of applying an update (e.g. a float8 scale)."""
        return self._overwrite_variable_with_gradient(variable)


def patch_multi_worker_trainer(symbolic_build, reduce_per_replica) -> None:
    """Installs `tfmp.upstream`'s two multi-worker fixes on Keras' TensorFlow trainer, once.

    Args:
        symbolic_build: `(model, original, iterator, data_batch)`, called in place of
            `TensorFlowTrainer._maybe_symbolic_build` (`original` is Keras' own).
        reduce_per_replica: `(values, strategy, reduction, original)`, called in place of the
            trainer module's `reduce_per_replica`.
    """
    trainer = tensorflow_trainer()
    if getattr(trainer.reduce_per_replica, "tfmp_fix", False):
        return
    original_build = trainer.TensorFlowTrainer._maybe_symbolic_build
    original_reduce = trainer.reduce_per_replica

    def maybe_symbolic_build(self, iterator=None, data_batch=None):
        return symbolic_build(self, original_build, iterator, data_batch)

    def reduce(values, strategy, reduction):
        return reduce_per_replica(values, strategy, reduction, original_reduce)

    reduce.tfmp_fix = True
    trainer.TensorFlowTrainer._maybe_symbolic_build = maybe_symbolic_build
    trainer.reduce_per_replica = reduce


def compute_loss(model: keras.Model, x, y, y_pred, sample_weight):
    """The loss Keras' default `train_step` computes (its `compute_loss`, with `training=True` where it takes it)."""
    return model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)


def loss_tracker(model: keras.Model):
    """The `loss` metric Keras' default `train_step` updates (a compiled model's)."""
    return model._loss_tracker


def weight_averages(optimizer: keras.optimizers.Optimizer) -> list:
    """The moving averages an optimizer built with `use_ema` keeps, one per trainable variable."""
    return optimizer._model_variables_moving_average


def optimizer_trainable_variables(optimizer: keras.optimizers.Optimizer) -> list:
    """The variables a built optimizer trains, in the order of its per-variable state."""
    return optimizer._trainable_variables


def build_from_batch(model: keras.Model, data_batch) -> None:
    """Builds `model` (and its optimizer and metrics) from one batch, as Keras does before its first step."""
    model._symbolic_build(data_batch=data_batch)
