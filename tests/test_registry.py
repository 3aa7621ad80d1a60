"""Plug-ins are one module and one registry line: an SSL method and a dataset source defined here,
registered with one call each, run end to end through `tfmp.training.run` without tfmp knowing them."""

import dataclasses
import os

import keras
import numpy as np
import pytest
from absl import flags

from tfmp import registry, ssl, training
from tfmp.config import Config, UsageError, define_flags, validate
from tfmp.data import ImageData, datasets
from tfmp.ssl.losses import nt_xent


class PlainContrastive(ssl.TwoViewModel):
    """NT-Xent on the encoder's features themselves, no projection head: the smallest method there is."""

    settings = ("temperature",)

    def __init__(self, encoder: keras.Model, *, temperature: float = 0.2, norm=None, **kwargs):
        super().__init__(encoder, **kwargs)
        self.temperature = temperature

    def ssl_loss(self, features, batch_size, targets):
        loss, _ = nt_xent(features[:batch_size], features[batch_size:], self.temperature)
        return loss, {}


def load_stripes(*, image_size: int = 0, seed: int = 0) -> ImageData:
    """8x8 gray images whose class is the bright row, in noise."""
    rng = np.random.default_rng(seed)

    def split(count):
        labels = rng.integers(0, 8, count)
        images = 0.3 * rng.random((count, 8, 8, 1), dtype=np.float32)
        images[np.arange(count), labels, :, 0] += 0.7
        return datasets.array_split(images, labels)

    return ImageData("stripes", split(512), split(128), num_classes=8, image_shape=(8, 8, 1))


@pytest.fixture
def registered():
    registry.SSL_METHODS.register("plain_contrastive", f"{__name__}:PlainContrastive")
    registry.DATASET_SOURCES.register("stripes", f"{__name__}:load_stripes")
    yield
    registry.SSL_METHODS.unregister("plain_contrastive")
    registry.DATASET_SOURCES.unregister("stripes")


SMALL = dict(model="small_cnn", precision="float32", strategy="off", global_batch_size=64, flip=False)


def test_a_method_registered_by_the_user_pretrains_end_to_end(registered, tmp_path):
    config = Config(task="plain_contrastive", epochs=2, label_fraction=0.05, probe_epochs=5, temperature=0.5, **SMALL)
    metrics = training.run(config, str(tmp_path / "run"))
    assert metrics["method"] == "plain_contrastive" and metrics["steps"] == 2 * (1437 // 64)
    assert np.isfinite(metrics["train_loss"]) and os.path.exists(tmp_path / "run" / "encoder.keras")
    assert metrics["knn_accuracy"] > 0.3  # digits has 10 classes: the features carry them


def test_a_dataset_source_registered_by_the_user_trains_end_to_end(registered, tmp_path):
    metrics = training.run(Config(task="supervised", dataset="stripes", epochs=3, learning_rate=1e-2, **SMALL), str(tmp_path / "run"))
    assert metrics["dataset"] == "stripes" and metrics["steps"] == 3 * (512 // 64)
    assert metrics["eval_accuracy"] > 0.5  # 8 classes: chance is 0.125


def test_names_are_refused_until_registered_and_after_unregistering():
    with pytest.raises(UsageError, match="unknown task 'plain_contrastive'; valid: supervised, linear_eval, finetune, simclr"):
        validate(Config(task="plain_contrastive"))
    registry.SSL_METHODS.register("plain_contrastive", f"{__name__}:PlainContrastive")
    try:
        assert validate(Config(task="plain_contrastive")).task == "plain_contrastive"
        with pytest.raises(ValueError, match="already registered as tfmp.ssl.simclr:SimCLR"):
            registry.SSL_METHODS.register("simclr", f"{__name__}:PlainContrastive")
    finally:
        registry.SSL_METHODS.unregister("plain_contrastive")
    with pytest.raises(UsageError, match="unknown dataset 'stripes:x'"):
        validate(Config(dataset="stripes:x"))


def test_every_registered_plug_in_loads():
    for kind in (registry.TASKS, registry.SSL_METHODS, registry.ENCODERS, registry.DATASET_SOURCES):
        for name in kind.names():
            assert callable(kind.load(name)) or hasattr(kind.load(name), "run"), f"{kind.kind} {name}"
    assert all(issubclass(registry.SSL_METHODS.load(name), ssl.TwoViewModel) for name in registry.SSL_METHODS.names())
    fields = set(Config.__dataclass_fields__)
    for name in registry.SSL_METHODS.names():
        assert set(registry.SSL_METHODS.load(name).settings) <= fields, name


def test_each_method_declares_the_settings_its_class_reads_and_help_groups_them():
    """A method's settings are declared once in the TensorFlow-free schema (`_method_field`, which names the methods)
    and read by its class (`settings`): the two must agree, and `--help` lists them under the method's heading."""
    declared: dict[str, set] = {}
    for field in dataclasses.fields(Config):
        for method in field.metadata.get("methods", ()):
            declared.setdefault(method, set()).add(field.name)
    builtin = [name for name in registry.SSL_METHODS.names() if registry.SSL_METHODS.entry(name).target.startswith("tfmp.")]
    assert "mae" in builtin and "dino" in builtin
    for name in builtin:
        assert set(registry.SSL_METHODS.load(name).settings) == declared.get(name, set()), name
    flag_values = flags.FlagValues()
    define_flags(flag_values)
    mae_flags = {flag.name for flag in flag_values.get_flags_for_module("settings of --task=mae")}
    assert mae_flags == {"mask_ratio", "decoder_width", "decoder_depth", "decoder_heads", "norm_pixel_loss"}
    shared = {flag.name for flag in flag_values.get_flags_for_module("settings of --task=byol|mocov3|dino")}
    assert shared == {"target_momentum"}
    assert "epochs" in {flag.name for flag in flag_values.get_flags_for_module("run settings (tfmp.config)")}
