"""The task layer's shared stages (tfmp.tasks): how a classifier stage trains on a tiny labeled subset."""

import pytest
import tensorflow as tf

from tfmp import compilation, data, distribute, precision
from tfmp.config import Config
from tfmp.run_directory import RunDirectory
from tfmp.runtime import Runtime
from tfmp.tasks import supervised


def test_one_step_epochs_are_grouped_without_changing_the_optimisation(tmp_path, monkeypatch):
    """30 labeled examples in one batch: fit_classifier groups the one-step epochs into long fit()
    epochs; the same steps must end at the same test loss and accuracy as plain one-step epochs."""
    precision.set_policy("float32")
    digits = data.load("digits", seed=0)
    labeled = data.balanced_subset(digits.train.labels, 0.02, 0)
    config = Config(task="supervised", model="small_cnn", global_batch_size=128, epochs=12, warmup_epochs=1, precision="float32",
                    checkpoint_every_steps=0)
    strategy = Runtime.for_strategy(tf.distribute.get_strategy())

    def train(name):
        distribute.set_seed(0)
        return supervised.fit_classifier(config, digits, strategy, RunDirectory(str(tmp_path / name)), indices=labeled,
                                         validate_every=12, quiet=True)

    grouped = train("grouped")
    monkeypatch.setattr(supervised, "MAX_GROUPED_EPOCHS", 1)
    plain = train("plain")
    assert grouped["steps"] == plain["steps"] == 12
    assert abs(grouped["eval_loss"] - plain["eval_loss"]) < 1e-4 * plain["eval_loss"]
    assert grouped["eval_accuracy"] == plain["eval_accuracy"]


def test_draws_sharing_one_compiled_classifier_train_as_models_of_their_own(tmp_path):
    """The supervised baseline's draws train in one compiled model (compilation.CompiledOnce): each draw
    must start from its own seeded weights and an optimizer that has taken no step, and end where a
    model of its own ends."""
    precision.set_policy("float32")
    digits = data.load("digits", seed=0)
    config = Config(task="supervised", model="small_cnn", global_batch_size=128, epochs=6, warmup_epochs=1, precision="float32")
    strategy = Runtime.for_strategy(tf.distribute.get_strategy())
    compiled = compilation.CompiledOnce()

    def train(draw, name, shared):
        distribute.set_seed(draw)
        labeled = data.balanced_subset(digits.train.labels, 0.02, draw)
        return supervised.fit_classifier(config, digits, strategy, RunDirectory(str(tmp_path / name)), indices=labeled,
                                         validate_every=6, quiet=True, compiled=compiled if shared else None)

    shared = [train(draw, f"shared{draw}", True) for draw in (0, 1)]
    own = [train(draw, f"own{draw}", False) for draw in (0, 1)]
    assert [result["steps"] for result in shared] == [6, 6]  # the second draw's optimizer started again at step 0
    for mine, theirs in zip(shared, own):
        assert mine["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-6)
        assert mine["eval_accuracy"] == theirs["eval_accuracy"]
    assert shared[0]["eval_loss"] != shared[1]["eval_loss"]  # two different draws, not one result twice
