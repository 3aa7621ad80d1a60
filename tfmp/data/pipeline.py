"""Input pipelines: shuffling, batching, caching and prefetching of a `Split`.

Pipelines are batched at the *global* batch size. Under a `tf.distribute` strategy,
Keras' `fit()` distributes the dataset itself (each replica gets
`global_batch_size / num_replicas` examples of every batch), so the same pipeline
serves one device, N mirrored replicas and a TPU.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfmp.data.datasets import Split

SHUFFLE_BUFFER = 10_000


def in_memory_options() -> tf.data.Options:
    """Options for a pipeline over arrays already in memory: tf.data's autotuning off.

    Autotuning sizes parallel reads, decodes and prefetch buffers; over arrays in memory there is
    nothing for it to tune, and its background work competes with training for the cores and can
    hold a short `fit()` at its end (measured in BUILD_NOTES.md, "Performance, round two").
    Pipelines that read and decode files keep it.
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return options


def classification_pipeline(
    split: Split,
    batch_size: int,
    *,
    training: bool,
    seed: int = 0,
    indices: np.ndarray | None = None,
    visible_labels: np.ndarray | None = None,
) -> tf.data.Dataset:
    """Batched `(image, label)` pairs from `split` (or its examples at `indices`).

    Args:
        split: the split to read.
        batch_size: global batch size.
        training: shuffle (seeded, reshuffled every epoch) and drop the last partial
            batch, so every step has the same shape on every replica (TPUs need it).
        seed: shuffle seed.
        indices: optional subset of the split.
        visible_labels: optional sorted indices of the examples whose labels may be
            seen; every other label becomes -1 (SSL pretraining on all images with
            only a fraction of the labels, e.g. for the online probe).
    """
    dataset = split.dataset(indices)
    if visible_labels is not None:
        visible = np.zeros(len(split) if indices is None else len(indices), dtype=bool)
        visible[visible_labels] = True
        visible_table = tf.constant(visible)
        dataset = dataset.enumerate().map(
            lambda index, pair: (pair[0], tf.where(visible_table[index], pair[1], -1)), num_parallel_calls=tf.data.AUTOTUNE)
    if split.cacheable:
        dataset = dataset.cache()
    if training:
        size = len(split) if indices is None else len(indices)
        dataset = dataset.shuffle(min(size, SHUFFLE_BUFFER), seed=seed, reshuffle_each_iteration=True)
    dataset = dataset.batch(batch_size, drop_remainder=training).prefetch(tf.data.AUTOTUNE)
    return dataset.with_options(in_memory_options()) if split.in_memory else dataset
