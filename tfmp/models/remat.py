"""Activation checkpointing (`--remat`): trade recomputation for activation memory.

Keras' remat support on the TF backend is `keras.remat(f)`, which is `tf.recompute_grad`:
the forward pass of `f` keeps only `f`'s inputs, and the backward pass runs `f` again to
get the activations its gradient needs. tfmp offers two granularities:

* `blocks`: each residual block (ResNets) or conv-BN-ReLU unit (small_cnn) is one
  checkpointed segment. The forward pass keeps one tensor per block; during the
  backward pass one block's activations are alive at a time. This is the classic
  choice for ResNets: ~one extra forward pass of compute for most of the activation memory.
* `full`: ResNets also checkpoint each stage around its checkpointed blocks, so the
  forward pass keeps only the four stage inputs; the backward pass recomputes a stage
  (keeping its block inputs), then each block: two extra forward passes of compute.
  Meant for deep stages (small_cnn has no stages: `full` is `blocks` there).

Keras' per-layer `keras.RematScope` fails on Keras 3.15 / TF 2.21 for layers called with
keyword arguments and under mixed precision, and kept more memory where it ran (BUILD_NOTES.md).

The recomputation must not update state a second time: tfmp's BatchNormalization skips
its moving-statistics update while `recomputing()` is active, which
`CheckpointedBlock` sets for every repeat of a forward pass.
"""

from __future__ import annotations

import contextlib
import threading

import keras

from tfmp.config import REMAT_MODES

_recomputation = threading.local()


@contextlib.contextmanager
def recomputing():
    """Marks a forward pass that activation checkpointing repeats in the backward pass.

    The repeat must compute what the first pass computed but must not update state a
    second time: tfmp's BatchNormalization skips its moving-statistics update inside
    this block (otherwise every checkpointed BatchNorm would average each batch in twice).
    """
    previous = getattr(_recomputation, "active", None)
    _recomputation.active = object()  # a token for this repeat: zero3's gathers tell one repeat from the next by it
    try:
        yield
    finally:
        _recomputation.active = previous


def is_recomputing() -> bool:
    return current_recomputation() is not None


def current_recomputation():
    """A token naming the repeat of a forward pass in progress (`recomputing()`), or None outside one."""
    return getattr(_recomputation, "active", None)


def first_call_updates_state(function):
    """`function`, run plainly on its first call and inside `recomputing()` on every later
    one: what a rematerialised function needs (its first call is the forward pass, later
    calls are the recomputation)."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(None)
        if len(calls) == 1:
            return function(*args, **kwargs)
        with recomputing():
            return function(*args, **kwargs)

    return wrapped


@keras.saving.register_keras_serializable(package="tfmp")
class CheckpointedBlock(keras.layers.Layer):
    """Runs `block` (a functional sub-model) and recomputes its activations in the backward pass.

    Outside training (inference, or `remat=False`) it is simply `block(inputs)`.
    """

    def __init__(self, block: keras.Model, remat: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.block = block
        self.remat = remat

    def build(self, input_shape):
        self.block.build(input_shape)
        self.built = True

    def call(self, inputs, training=None):
        if not (self.remat and training):
            return self.block(inputs, training=training)
        forward = first_call_updates_state(lambda block_inputs: self.block(block_inputs, training=True))
        return keras.remat(forward)(inputs)

    def compute_output_shape(self, input_shape):
        return self.block.compute_output_shape(input_shape)

    def get_config(self):
        return {**super().get_config(), "block": keras.saving.serialize_keras_object(self.block), "remat": self.remat}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["block"] = keras.saving.deserialize_keras_object(config["block"])
        return cls(**config)


def checkpointed(block_fn, x, name: str, remat: str, **block_kwargs):
    """`block_fn(x, name=name, **block_kwargs)`, as one checkpointed segment unless `remat == "none"`.

    The block's layers keep their names (inside a sub-model called `{name}_layers`), so
    `--float32_layers` and the precision doctor see the same names with or without remat.
    """
    if remat == "none":
        return block_fn(x, name=name, **block_kwargs)
    inputs = keras.Input(x.shape[1:], name=f"{name}_input")
    block = keras.Model(inputs, block_fn(inputs, name=name, **block_kwargs), name=f"{name}_layers")
    return CheckpointedBlock(block, name=name)(x)


def check_mode(remat: str) -> None:
    if remat not in REMAT_MODES:
        raise ValueError(f"unknown remat mode {remat!r}; valid: {', '.join(REMAT_MODES)}")
