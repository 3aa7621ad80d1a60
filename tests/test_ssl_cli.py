"""`python -m tfmp.train --task=simclr|linear_eval|finetune` end to end on tiny settings."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import AUTO_PRECISION
from tfmp import train, training
from tfmp.config import Config

TINY = ["--flagfile=experiments/digits_simclr.cfg", "--epochs=2", "--global_batch_size=128", "--warmup_epochs=0",
        "--probe_epochs=5", "--baseline_epochs=2", "--knn_every_epochs=1", "--label_fraction=0.1", "--label_draws=2"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """One tiny SimCLR run on 2 logical CPU devices in a fresh process; its workdir."""
    workdir = tmp_path_factory.mktemp("simclr") / "run"
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, "-m", "tfmp.train", *TINY, f"--workdir={workdir}", "--strategy=mirrored",
                             "--num_cpu_devices=2", f"--precision={AUTO_PRECISION}"], capture_output=True, text=True, env=environment,
                            cwd=os.path.dirname(os.path.dirname(__file__)), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


def _labeled_count(fraction=0.1):
    from tfmp import data

    return len(data.balanced_subset(data.load("digits").train.labels, fraction, seed=0))


def _metrics(workdir):
    with open(os.path.join(workdir, "metrics.json"), encoding="utf-8") as file:
        return json.load(file)


def test_simclr_writes_the_ssl_metrics(pretrained):
    metrics = _metrics(pretrained)
    assert (metrics["task"], metrics["strategy"], metrics["num_replicas"]) == ("simclr", "mirrored", 2)
    # The probe and kNN far above chance (0.1) after 2 epochs, in every label draw; the baseline, trained for only
    # 2 epochs here, measured at chance (0.097-0.117): the probe beats it in every draw.
    for key in ("linear_probe_accuracy", "knn_accuracy"):
        assert min(metrics[f"{key}_per_draw"]) > 0.2, (key, metrics[f"{key}_per_draw"])
    assert metrics["linear_probe_accuracy"] > 0.3
    for probe, baseline in zip(metrics["linear_probe_accuracy_per_draw"], metrics["supervised_baseline_accuracy_per_draw"]):
        assert probe > baseline + 0.1
    assert metrics["steps"] == 2 * (1437 // 128)
    assert metrics["labeled_examples"] == _labeled_count() and metrics["unlabeled_examples"] == 1437
    assert len(metrics["linear_probe_accuracy_per_draw"]) == 2  # --label_draws (the preset's 5, cut for time)
    assert metrics["linear_probe_accuracy"] == pytest.approx(np.mean(metrics["linear_probe_accuracy_per_draw"]))
    with open(pretrained / "history.csv", encoding="utf-8") as file:
        assert "knn_accuracy" in file.readline()
    # Every stage's curves in one TensorBoard logdir: pretraining, and each label draw's baseline.
    assert {"train", "baseline"} <= set(os.listdir(pretrained / "tensorboard"))
    assert os.listdir(pretrained / "tensorboard" / "baseline" / "draw0" / "train")
    # 1,437 images x 2 epochs / 128 = 22 steps: the guard must say so.
    assert any("pretraining steps" in warning for warning in metrics["small_data_warnings"])


def test_the_saved_encoder_loads_without_tfmp(pretrained, tmp_path):
    """`encoder.keras` holds Keras' own layers only (`tfmp.models.export`): plain Keras loads it in
    safe mode in a process that never imports tfmp; tfmp's fused-BatchNorm copy of it computes the same."""
    images = np.random.default_rng(0).random((4, 8, 8, 1), np.float32)
    np.save(tmp_path / "images.npy", images)
    code = ("import sys, keras, numpy as np; "
            f"encoder = keras.saving.load_model({str(pretrained / 'encoder.keras')!r}, safe_mode=True); "
            "assert not any(name.split('.')[0] == 'tfmp' for name in sys.modules); "
            f"np.save({str(tmp_path / 'features.npy')!r}, np.asarray(encoder(np.load({str(tmp_path / 'images.npy')!r})), 'float32'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stderr[-2000:]
    features = np.load(tmp_path / "features.npy")
    assert features.shape == (4, 128)

    from tfmp.models import export

    import keras

    adopted = export.adopt(keras.saving.load_model(str(pretrained / "encoder.keras")))
    tolerance = 1e-4 if AUTO_PRECISION == "float32" else 5e-2
    np.testing.assert_allclose(np.asarray(adopted(images), "float32"), features, rtol=tolerance, atol=tolerance)


def test_linear_eval_of_the_saved_encoder(pretrained, tmp_path):
    workdir = tmp_path / "eval"
    metrics = training.run(Config(task="linear_eval", encoder=str(pretrained / "encoder.keras"),
                                                          label_fraction=0.1, probe_epochs=5, strategy="off"), str(workdir))
    assert metrics["linear_probe_accuracy"] > 0.3 and metrics["labeled_examples"] == _labeled_count()


def test_finetune_of_the_saved_encoder(pretrained, tmp_path):
    workdir = tmp_path / "finetune"
    metrics = training.run(Config(task="finetune", encoder=str(pretrained / "encoder.keras"),
                                                          label_fraction=0.1, epochs=30, strategy="off"), str(workdir))
    assert metrics["eval_accuracy"] > 0.3 and metrics["labeled_examples"] == _labeled_count()


def test_linear_eval_needs_an_encoder(tmp_path, capsys):
    assert train.main(["tfmp.train", "--task=linear_eval", f"--workdir={tmp_path / 'x'}"]) == 2
    assert "--task=linear_eval needs --encoder=PATH" in capsys.readouterr().err
    assert train.main(["tfmp.train", "--task=finetune", "--encoder=/no/such.keras", f"--workdir={tmp_path / 'x'}"]) == 2
    assert "encoder /no/such.keras: no such file" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_simclr_pretrains_on_a_tfds_unlabeled_split(tmp_path):
    import tensorflow_datasets as tfds

    config = Config(task="simclr", dataset="tfds:stl10", unlabeled_split="unlabelled", image_size=16,
                                      global_batch_size=8, epochs=1, probe_epochs=2, strategy="off", precision="bf16")
    with tfds.testing.mock_data(num_examples=16):
        metrics = training.run(config, str(tmp_path / "run"))
    assert metrics["unlabeled_examples"] == 16 and metrics["steps"] == 2
    assert np.isfinite(metrics["train_loss"]) and len(metrics["small_data_warnings"]) >= 2
