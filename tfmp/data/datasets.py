"""Dataset sources (registered in `tfmp.registry.DATASET_SOURCES`) and what every source yields.

Every source yields an `ImageData`: a train and a test `Split`, each able to produce
an unbatched `tf.data.Dataset` of `(image, label)` pairs, images float32 in [0, 1]
with shape `image_shape`, labels int32. The labels of each split are also held as a
NumPy array, so that label subsets (e.g. 5% of the labels for a linear probe) can be
drawn by index, seeded and class balanced, whatever the source.

* `digits` — scikit-learn's bundled 8x8 digits (1,797 images, no download): the
  offline default. Split 80/20, stratified, with `DIGITS_SPLIT_SEED` (fixed, so the
  test set never changes with `--seed`): 1,437 train / 360 test.
* `folder:PATH` — the user's images, one subfolder per class; `PATH/train` and
  `PATH/test` if present, otherwise a seeded stratified 80/20 split of `PATH`.
* `tfds:NAME` — tensorflow-datasets (`--data_dir` for prepared data; never downloads
  at run time). Splits `train` and `test`, plus an optional split of extra
  unlabeled images for pretraining (`--unlabeled_split=unlabelled` for STL-10).
* `synthetic` — seeded uniform-noise images with random labels, for benchmarks.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import re
from typing import Callable

import numpy as np
import tensorflow as tf

from tfmp import registry, tf_environment

logger = logging.getLogger(__name__)
DIGITS_SPLIT_SEED = 0
TEST_FRACTION = 0.2
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif")
SYNTHETIC_SIZES = {"train": 2048, "test": 512}
# Decoded images up to this many bytes are cached in memory after the first epoch.
CACHE_LIMIT_BYTES = 2 << 30
MAX_IMAGE_SIDE = 1024  # a folder whose images are mostly larger needs --image_size
MAX_IMAGE_PIXELS = 100_000_000  # one image above this is refused (decoding it takes >= 300 MB, every step)


@dataclasses.dataclass
class Split:
    """One split of a data set.

    Attributes:
        labels: int labels of all examples, in the order `make` yields them
            (-1 where a split is unlabeled).
        make: returns the unbatched `(image, label)` dataset of the examples at
            `indices` (all when None), in index order.
        cacheable: whether the decoded split fits in memory (see `CACHE_LIMIT_BYTES`).
        in_memory: the examples are arrays in memory already (nothing to read or decode).
    """

    labels: np.ndarray
    make: Callable[[np.ndarray | None], tf.data.Dataset]
    cacheable: bool = True
    in_memory: bool = False

    def __len__(self) -> int:
        return len(self.labels)

    def dataset(self, indices: np.ndarray | None = None) -> tf.data.Dataset:
        return self.make(indices)


@dataclasses.dataclass
class ImageData:
    """A loaded data set: splits plus what a model needs to know about it."""

    name: str
    train: Split
    test: Split
    num_classes: int
    image_shape: tuple[int, int, int]
    unlabeled: Split | None = None


def _resize(images: np.ndarray, image_size: int) -> np.ndarray:
    if not image_size or images.shape[1] == image_size:
        return images
    return tf.image.resize(images, (image_size, image_size), method="bilinear").numpy()


def array_split(images: np.ndarray, labels: np.ndarray) -> Split:
    """A split of images and labels held in memory (what a dataset source of arrays returns)."""
    images = images.astype(np.float32)
    labels = labels.astype(np.int32)

    def make(indices):
        if indices is None:
            return tf.data.Dataset.from_tensor_slices((images, labels))
        return tf.data.Dataset.from_tensor_slices((images[indices], labels[indices]))

    return Split(labels=labels, make=make, in_memory=True)


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded stratified train/test indices (sorted), the same on every machine."""
    from sklearn.model_selection import train_test_split

    indices = np.arange(len(labels))
    train, test = train_test_split(indices, test_size=test_fraction, random_state=seed, stratify=labels)
    return np.sort(train), np.sort(test)


def balanced_subset(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Sorted indices of a seeded, class-balanced `fraction` of the examples (at least one per class).

    The same (labels, fraction, seed) always gives the same subset, so a probe, a
    fine-tune and a supervised baseline of one run all see the same labeled examples.
    """
    if fraction >= 1.0:
        return np.arange(len(labels))
    rng = np.random.default_rng(seed)
    chosen = []
    for label in np.unique(labels[labels >= 0]):
        members = np.flatnonzero(labels == label)
        count = max(1, int(round(fraction * len(members))))
        chosen.append(rng.choice(members, size=count, replace=False))
    return np.sort(np.concatenate(chosen))


def load_digits(*, image_size: int = 0, seed: int = 0) -> ImageData:
    """scikit-learn's 8x8 digits, scaled to [0, 1], optionally resized to `image_size`. The split is
    fixed (`DIGITS_SPLIT_SEED`), not drawn from `seed`, so the test set never changes with it."""
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    images = (bunch.images / 16.0).astype(np.float32)[..., None]
    images = _resize(images, image_size)
    train, test = stratified_split(bunch.target, TEST_FRACTION, DIGITS_SPLIT_SEED)
    return ImageData(
        name="digits",
        train=array_split(images[train], bunch.target[train]),
        test=array_split(images[test], bunch.target[test]),
        num_classes=10,
        image_shape=tuple(images.shape[1:]),
    )


def load_synthetic(*, image_size: int = 0, seed: int = 0, num_classes: int = 10) -> ImageData:
    """Uniform-noise RGB images with random labels (for benchmarks; nothing to learn)."""
    size = image_size or 32
    rng = np.random.default_rng(seed)
    splits = {}
    for split, count in SYNTHETIC_SIZES.items():
        images = rng.random((count, size, size, 3), dtype=np.float32)
        splits[split] = array_split(images, rng.integers(0, num_classes, count))
    return ImageData("synthetic", splits["train"], splits["test"], num_classes, (size, size, 3))


FOLDER_LAYOUT = ("one subfolder of images per class, either directly in PATH (split 80/20 by --seed) or in both "
                 "PATH/train/<class>/ and PATH/test/<class>/")
UNBALANCED_RATIO = 10  # largest class / smallest class above which a folder is called unbalanced


def _hidden(name: str) -> bool:
    return name.startswith(".")  # .ipynb_checkpoints, .DS_Store, .git, ...


def _class_folders(root: str, ignored: list[str]) -> list[str]:
    """The class folders in `root`, sorted; hidden entries and plain files go to `ignored`."""
    classes = []
    for name in sorted(os.listdir(root)):
        if not _hidden(name) and os.path.isdir(os.path.join(root, name)):
            classes.append(name)
        else:
            ignored.append(os.path.join(root, name))
    return classes


def _list_images(root: str, classes: list[str], ignored: list[str]) -> tuple[list[str], list[int]]:
    """Image files of each class folder (label = index in `classes`); other entries go to `ignored`."""
    paths, labels = [], []
    for label, class_name in enumerate(classes):
        class_dir = os.path.join(root, class_name)
        if not os.path.isdir(class_dir):
            continue
        for file_name in sorted(os.listdir(class_dir)):
            if file_name.lower().endswith(IMAGE_EXTENSIONS) and not _hidden(file_name):
                paths.append(os.path.join(class_dir, file_name))
                labels.append(label)
            else:
                ignored.append(os.path.join(class_dir, file_name))
    return paths, labels


def describe_folder(name: str, classes: list[str], train_labels, test_labels, ignored: list[str]) -> list[str]:
    """What a folder data set holds, as it is logged (first line) and the warnings it deserves."""
    train_counts = np.bincount(np.asarray(train_labels, dtype=np.int64), minlength=len(classes))
    test_counts = np.bincount(np.asarray(test_labels, dtype=np.int64), minlength=len(classes))
    shown = ", ".join(f"{class_name} {train}/{test}" for class_name, train, test in
                      list(zip(classes, train_counts, test_counts))[:10]) + (", ..." if len(classes) > 10 else "")
    ignored_text = ""
    if ignored:
        named = ", ".join(os.path.basename(path) for path in ignored[:3]) + (", ..." if len(ignored) > 3 else "")
        ignored_text = f"; ignored {len(ignored)} hidden or non-image entr{'y' if len(ignored) == 1 else 'ies'} ({named})"
    lines = [f"dataset {name}: {len(classes)} classes, {int(train_counts.sum())} train / {int(test_counts.sum())} test images "
             f"(train/test per class: {shown}){ignored_text}"]
    if len(classes) == 1:
        lines.append(f"dataset {name}: only one class ({classes[0]}): a classifier is trivially right on it; "
                     f"expected {FOLDER_LAYOUT}")
    elif train_counts.min() == 0 or train_counts.max() > UNBALANCED_RATIO * train_counts.min():
        largest, smallest = int(np.argmax(train_counts)), int(np.argmin(train_counts))
        lines.append(f"dataset {name}: unbalanced classes: {classes[largest]} has {train_counts[largest]} training images, "
                     f"{classes[smallest]} {train_counts[smallest]}; accuracy will favour the large classes")
    return lines


def _file_split(paths: list[str], labels: list[int], image_size: int, channels: int) -> Split:
    paths_array = np.asarray(paths)
    labels_array = np.asarray(labels, dtype=np.int32)

    def decode(path, label):
        image = tf.io.decode_image(tf.io.read_file(path), channels=channels, expand_animations=False)
        image = tf.image.resize(tf.image.convert_image_dtype(image, tf.float32), (image_size, image_size))
        image.set_shape((image_size, image_size, channels))
        return image, label

    def make(indices):
        selected = slice(None) if indices is None else indices
        dataset = tf.data.Dataset.from_tensor_slices((paths_array[selected], labels_array[selected]))
        return dataset.map(decode, num_parallel_calls=tf.data.AUTOTUNE)

    cacheable = len(paths) * image_size * image_size * channels * 4 < CACHE_LIMIT_BYTES
    return Split(labels=labels_array, make=make, cacheable=cacheable)


def scan_images(paths: list[str]) -> tuple[dict[str, tuple[int, int, int]], dict[str, str]]:
    """Every file of `paths` decoded once: the (height, width, channels) of those that decode, and for the
    others the reason (TF's message).

    Decoded in parallel through tf.data (errors dropped), and only the missing ones again to read their
    error: a corrupt file found during training would end the run with a traceback mid-epoch, after hours."""
    if not paths:
        return {}, {}
    # libjpeg writes its own lines to fd 2 for a bad file ("Input file read error", "Improper call to JPEG library
    # in state 201"); TF's error for the file says the same, and is what the one-line refusal names.
    with tf_environment.captured_stderr():
        return _scan_images(paths)


def _scan_images(paths: list[str]) -> tuple[dict[str, tuple[int, int, int]], dict[str, str]]:
    def decode(index, path):
        # The shape depends on the decode, so the decode runs (an unused result would be pruned and never fail).
        return index, tf.shape(tf.io.decode_image(tf.io.read_file(path), expand_animations=False))

    decoded = (tf.data.Dataset.from_tensor_slices((np.arange(len(paths)), np.asarray(paths)))
               .map(decode, num_parallel_calls=tf.data.AUTOTUNE).ignore_errors().batch(4096))
    shapes = {paths[int(index)]: tuple(int(side) for side in shape)
              for indices, batch_shapes in decoded.as_numpy_iterator() for index, shape in zip(indices, batch_shapes)}
    reasons = {}
    for path in paths:
        if path in shapes:
            continue
        try:
            tf.io.decode_image(tf.io.read_file(path), expand_animations=False)
        except (tf.errors.OpError, ValueError) as error:
            message = getattr(error, "message", str(error)).strip().splitlines()
            # TF's op errors wrap the reason: "{{function_node ...}} jpeg::Uncompress failed. ... [Op:DecodeImage] name:"
            reason = re.sub(r"^\{\{[^}]*\}\}\s*|\s*\[Op:\w+\].*$", "", message[0]) if message else ""
            reasons[path] = reason or type(error).__name__
    return shapes, reasons


def choose_image_shape(name: str, shapes: dict[str, tuple[int, int, int]], image_size: int) -> tuple[int, int, int]:
    """The one shape every image of a folder is decoded to, said in one log line with what it takes.

    Side: `--image_size`, else the most common side among the images (the larger side of a non-square
    one). Channels: 3 when any image has colour (gray ones are converted), else 1 (colour channels
    beyond RGB, e.g. alpha, are dropped). Images far larger than anything trained on here are refused
    with their path and size rather than decoded per step.

    Raises:
        ValueError: an image of more than `MAX_IMAGE_PIXELS` pixels, or a most common side above
            `MAX_IMAGE_SIDE` with no `--image_size`.
    """
    huge = [(path, shape) for path, shape in shapes.items() if shape[0] * shape[1] > MAX_IMAGE_PIXELS]
    if huge:
        path, (height, width, _) = huge[0]
        raise ValueError(f"dataset {name}: {path} is {width}x{height} ({width * height / 1e6:.0f} megapixels, over "
                         f"{MAX_IMAGE_PIXELS / 1e6:.0f}); shrink or remove it ({len(huge)} such file(s))")
    sides = collections.Counter(max(height, width) for height, width, _ in shapes.values())
    side, count = sides.most_common(1)[0]
    if not image_size and side > MAX_IMAGE_SIDE:
        raise ValueError(f"dataset {name}: most images are {side}px; set --image_size (at most {MAX_IMAGE_SIDE}) to train on them")
    asked, image_size = image_size, image_size or side
    channels = 3 if any(shape[2] >= 3 for shape in shapes.values()) else 1
    resized = sum(1 for height, width, _ in shapes.values() if (height, width) != (image_size, image_size))
    converted = sum(1 for shape in shapes.values() if (shape[2] >= 3) != (channels == 3))
    source = "--image_size" if asked else f"the most common size, {count} of {len(shapes)} images"
    logger.info("dataset %s: images as %dx%dx%d (%s); %d resized, %d converted to %s", name, image_size, image_size, channels,
                source, resized, converted, "RGB" if channels == 3 else "gray")
    return image_size, image_size, channels


def _drop(paths: list[str], labels: list[int], unreadable: dict[str, str]) -> tuple[list[str], list[int]]:
    kept = [(path, label) for path, label in zip(paths, labels) if path not in unreadable]
    return [path for path, _ in kept], [label for _, label in kept]


def load_folder(path: str, *, image_size: int = 0, seed: int = 0, skip_unreadable_images: bool = False) -> ImageData:
    """Images in class subfolders of `path` (or of `path/train` and `path/test`).

    Every file is decoded once before training (`scan_images`); every image is then decoded to the one
    shape `choose_image_shape` states.

    Raises:
        ValueError: the folder does not exist, holds no images in class subfolders, or holds
            files that do not decode (named, unless `skip_unreadable_images`, which drops them
            with a warning giving their count).
    """
    if not os.path.isdir(path):
        raise ValueError(f"dataset folder:{path}: no such directory; expected PATH/<class>/*.png|jpg or PATH/train and PATH/test")
    split_folders = [split for split in ("train", "test") if os.path.isdir(os.path.join(path, split))]
    if len(split_folders) == 1:
        raise ValueError(f"dataset folder:{path}: has {split_folders[0]}/ but no {({'train', 'test'} - set(split_folders)).pop()}/; "
                         f"expected {FOLDER_LAYOUT}")
    has_splits = len(split_folders) == 2
    train_root = os.path.join(path, "train") if has_splits else path
    ignored: list[str] = []
    classes = _class_folders(train_root, ignored)
    paths, labels = _list_images(train_root, classes, ignored)
    if not paths:
        raise ValueError(f"dataset folder:{path}: no images ({', '.join(IMAGE_EXTENSIONS)}) in class subfolders of {train_root}; "
                         f"expected {FOLDER_LAYOUT}")
    test_paths, test_labels = _list_images(os.path.join(path, "test"), classes, ignored) if has_splits else ([], [])

    shapes, unreadable = scan_images(paths + test_paths)
    if unreadable and not skip_unreadable_images:
        named = "; ".join(f"{file}: {reason}" for file, reason in list(unreadable.items())[:3])
        more = f" and {len(unreadable) - 3} more" if len(unreadable) > 3 else ""
        raise ValueError(f"dataset folder:{path}: {len(unreadable)} unreadable image file(s): {named}{more}; "
                         "fix or remove them, or pass --skip_unreadable_images to train without them")
    if unreadable:
        logger.warning("dataset folder:%s: skipping %d unreadable image file(s) (--skip_unreadable_images)", path, len(unreadable))
        paths, labels = _drop(paths, labels, unreadable)
        test_paths, test_labels = _drop(test_paths, test_labels, unreadable)
        if not paths:
            raise ValueError(f"dataset folder:{path}: no readable images left in {train_root}")

    image_size, _, channels = choose_image_shape(f"folder:{path}", shapes, image_size)

    if not has_splits:
        train_index, test_index = stratified_split(np.asarray(labels), TEST_FRACTION, seed)
        test_paths, test_labels = [paths[i] for i in test_index], [labels[i] for i in test_index]
        paths, labels = [paths[i] for i in train_index], [labels[i] for i in train_index]
    description, *warnings = describe_folder(f"folder:{path}", classes, labels, test_labels, ignored)
    logger.info("%s", description)
    for warning in warnings:
        logger.warning("%s", warning)
    return ImageData(
        name=f"folder:{path}",
        train=_file_split(paths, labels, image_size, channels),
        test=_file_split(test_paths, test_labels, image_size, channels),
        num_classes=len(classes),
        image_shape=(image_size, image_size, channels),
    )


def _tfds_split(builder, split: str, image_size: int, channels: int, labeled: bool) -> Split:
    import tensorflow_datasets as tfds

    def to_pair(image, label):
        image = tf.image.convert_image_dtype(image, tf.float32)
        if image_size and image.shape[0] != image_size:
            image = tf.image.resize(image, (image_size, image_size))
        return image, tf.cast(label, tf.int32) if labeled else tf.constant(-1, tf.int32)

    def raw():
        # shuffle_files=False: the order must match `labels` for index subsets.
        return builder.as_dataset(split=split, as_supervised=True, shuffle_files=False)

    # Labels only: skip decoding the images (ImageNet's 1.28M JPEGs would take an hour).
    label_only = builder.as_dataset(split=split, shuffle_files=False, decoders={"image": tfds.decode.SkipDecoding()})
    label_key = "label" if "label" in builder.info.features else None
    if labeled and label_key:
        labels = np.concatenate([batch for batch in label_only.map(lambda example: example[label_key]).batch(8192).as_numpy_iterator()])
        labels = labels.astype(np.int32)
    else:
        labels = np.full(int(label_only.reduce(0, lambda count, _: count + 1)), -1, dtype=np.int32)

    def make(indices):
        dataset = raw()
        if indices is not None:
            keep = np.zeros(len(labels), dtype=bool)
            keep[indices] = True
            keep_table = tf.constant(keep)
            dataset = dataset.enumerate().filter(lambda i, pair: keep_table[i]).map(lambda i, pair: pair)
        return dataset.map(to_pair, num_parallel_calls=tf.data.AUTOTUNE)

    side = image_size or builder.info.features["image"].shape[0]
    cacheable = len(labels) * side * side * channels * 4 < CACHE_LIMIT_BYTES
    return Split(labels=labels, make=make, cacheable=cacheable)


def load_tfds(name: str, *, image_size: int = 0, seed: int = 0, data_dir: str = "", unlabeled_split: str = "") -> ImageData:
    """A tensorflow-datasets image classification set that is already prepared.

    `unlabeled_split` (e.g. STL-10's "unlabelled") becomes `ImageData.unlabeled`.

    Raises:
        ValueError: unknown name, or the data set is not prepared in `data_dir`.
    """
    import tensorflow_datasets as tfds

    try:
        builder = tfds.builder(name, data_dir=data_dir or None)
        image_shape = builder.info.features["image"].shape
        num_classes = builder.info.features["label"].num_classes
        channels = int(image_shape[-1])
        return ImageData(
            name=f"tfds:{name}",
            train=_tfds_split(builder, "train", image_size, channels, labeled=True),
            test=_tfds_split(builder, "test", image_size, channels, labeled=True),
            num_classes=num_classes,
            image_shape=(image_size or image_shape[0], image_size or image_shape[1], channels),
            unlabeled=_tfds_split(builder, unlabeled_split, image_size, channels, labeled=False) if unlabeled_split else None,
        )
    except (tfds.core.registered.DatasetNotFoundError, AssertionError, KeyError, ValueError, tf.errors.NotFoundError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"dataset tfds:{name}: {first_line}; prepare it with `tfds build {name} --data_dir=DIR` "
            "and pass --data_dir=DIR (tfmp never downloads at run time)"
        ) from None


def load(name: str, *, image_size: int = 0, seed: int = 0, **source_settings) -> ImageData:
    """Loads a data set by its tfmp name (`digits`, `folder:PATH`, ...; `tfmp.registry.DATASET_SOURCES`).

    Args:
        name: the data set, as `--dataset` spells it.
        image_size, seed: as `Config`'s fields.
        **source_settings: `Config` fields only some sources read (`data_dir`, `unlabeled_split`,
            `skip_unreadable_images`); a source gets the ones it declares.

    Raises:
        ValueError: unknown name, or a source that cannot be read; the message says
            what was wrong and lists the valid names.
    """
    source, argument = registry.dataset_source(name)
    loader = source.load()
    settings = {key: value for key, value in source_settings.items() if key in source.settings}
    return loader(*([argument] if source.argument else []), image_size=image_size, seed=seed, **settings)


def load_for(config) -> ImageData:
    """The data set a `tfmp.config.Config` names, with every setting its source reads."""
    source, _ = registry.dataset_source(config.dataset)
    return load(config.dataset, image_size=config.image_size, seed=config.seed,
                **{name: getattr(config, name) for name in source.settings})
