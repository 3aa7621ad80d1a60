"""tfmp's callbacks on models written the way users write them, not the way tfmp builds its own.

A lazily built `Sequential`, a subclassed model, and a contrastive model with its own
`train_step`, two optimizers of its own (the one `compile()` makes never steps) and its own
loss names (`c_loss`, `p_loss`), trained with `fit(..., callbacks=default_callbacks(workdir))`
as the README's diff says: on one device, on 2 CPU replicas, under mixed_float16; resumed
after kill -9; and with an inf loss planted at a known step.
"""

import os
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfmp import accumulation, callbacks, precision

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "scripts"))

from contrastive_user_model import ContrastiveModel, digits  # noqa: E402


STEPS_PER_EPOCH = 15  # 1,797 digits in batches of 128, the last one partial


def _checkpoint_steps(workdir) -> list[int]:
    return [step for step, _ in callbacks.find_checkpoints(os.path.join(workdir, "checkpoints"))]


def _expected_checkpoints(epochs: int, every_steps: int, keep: int = 3) -> list[int]:
    """Steps of the checkpoints kept: every `every_steps` steps and at each epoch end."""
    steps = set(range(every_steps, epochs * STEPS_PER_EPOCH + 1, every_steps))
    steps |= {STEPS_PER_EPOCH * (epoch + 1) for epoch in range(epochs)}
    return sorted(steps)[-keep:]


def _strategy(replicas: int) -> tf.distribute.Strategy:
    """2 CPU replicas reducing through one device, as tfmp's own CPU split does: in one process,
    TF's collective ops fail a second strategy whose program differs from an earlier one's
    ("Shape mismatch in the collective instance 100", plain Keras alike; BUILD_NOTES known limits)."""
    if replicas == 1:
        return tf.distribute.get_strategy()
    return tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=tf.distribute.ReductionToOneDevice())


def _lazy_sequential():
    model = keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class SubclassedClassifier(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.logits = keras.layers.Dense(10)

    def call(self, images):
        return self.logits(self.hidden(keras.ops.reshape(images, (-1, 64))))


def _subclassed():
    model = SubclassedClassifier()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _subclassed_in_micro_batches():
    """The subclassed model taking each batch in 3 micro-batches (tfmp.accumulation): 128 is padded to 129, and the
    epoch's last batch of 5 to 6."""
    return accumulation.accumulate_gradients(_subclassed(), 3)


MODELS = [_lazy_sequential, _subclassed, _subclassed_in_micro_batches]
MODEL_IDS = ["lazy_sequential", "subclassed", "subclassed_in_micro_batches"]


@pytest.mark.parametrize("make_model", MODELS, ids=MODEL_IDS)
@pytest.mark.parametrize("replicas", [1, 2])
def test_models_built_lazily_train_checkpoint_and_resume(make_model, replicas, tmp_path):
    images, labels = digits()
    strategy = _strategy(replicas)
    with strategy.scope():
        model = make_model()
    first = model.fit(images, labels, batch_size=128, epochs=2, verbose=0,
                      callbacks=callbacks.default_callbacks(str(tmp_path), checkpoint_every_steps=5))
    steps_per_epoch = STEPS_PER_EPOCH
    assert _checkpoint_steps(tmp_path) == _expected_checkpoints(2, 5)  # distinct, increasing, by step (3 kept)

    with strategy.scope():
        resumed = make_model()
    run_callbacks = callbacks.default_callbacks(str(tmp_path))
    history = resumed.fit(images, labels, batch_size=128, epochs=3, verbose=0, callbacks=run_callbacks)
    checkpointing = run_callbacks.checkpointing
    assert checkpointing.restored_step == 2 * steps_per_epoch
    # The model is built from the input shape its first run kept, and restored before the first step.
    updates = 3 * steps_per_epoch
    assert _checkpoint_steps(tmp_path)[-1] == updates
    assert int(resumed.optimizer.iterations.numpy()) == updates  # the optimizer's count was restored too
    assert history.epoch == [0, 1, 2] and history.history["loss"][:2] == first.history["loss"]  # the whole run's history
    assert history.history["loss"][2] < first.history["loss"][-1]  # went on from the trained weights, not from scratch


@pytest.mark.parametrize("make_model", MODELS, ids=MODEL_IDS)
def test_a_finished_lazily_built_model_is_restored_by_a_rerun_with_nothing_left_to_train(make_model, tmp_path, new_process):
    images, labels = digits()
    model = make_model()
    first = model.fit(images, labels, batch_size=128, epochs=2, verbose=0, callbacks=callbacks.default_callbacks(str(tmp_path)))
    trained = model.evaluate(images, labels, verbose=0)
    new_process()

    rerun = make_model()  # a new process would build the same fresh model
    history = rerun.fit(images, labels, batch_size=128, epochs=2, verbose=0, callbacks=callbacks.default_callbacks(str(tmp_path)))
    assert rerun.evaluate(images, labels, verbose=0) == pytest.approx(trained, rel=1e-6)  # not fresh weights
    assert history.epoch == [0, 1] and history.history["loss"] == first.history["loss"]  # what the run logged


def _contrastive(strategy, images):
    """The contrastive model compiled with its two optimizers under `strategy`; on several
    replicas built up front (`ContrastiveModel.build_with_optimizers` says why)."""
    with strategy.scope():
        model = ContrastiveModel()
        model.compile(contrastive_optimizer=precision.wrap_optimizer(keras.optimizers.Adam(1e-3)),
                      probe_optimizer=precision.wrap_optimizer(keras.optimizers.Adam(1e-3)))
        if strategy.num_replicas_in_sync > 1:
            model.build_with_optimizers(images[:1])
    return model


def test_a_model_compiled_without_an_optimizer_is_rerun_on_one_device(tmp_path, new_process):
    """keras-io's DCGAN and SimCLR pattern: `compile()` calls `super().compile()` with no optimizer (Keras makes an
    RMSprop that never steps) and the model steps optimizers of its own. Built up front on one device, its rerun
    failed in the restore ("Found 2 Python objects that were not bound to checkpointed values": the unused RMSprop,
    built for the restore, has slots no checkpoint holds)."""
    images, labels = digits()
    strategy = _strategy(1)
    model = _contrastive(strategy, images)
    model.build_with_optimizers(images[:1])
    first = model.fit(images, labels, batch_size=128, epochs=2, verbose=0, callbacks=callbacks.default_callbacks(str(tmp_path)))
    assert not model.optimizer.built  # the compiled optimizer never stepped
    new_process()

    rerun = _contrastive(strategy, images)
    rerun.build_with_optimizers(images[:1])
    history = rerun.fit(images, labels, batch_size=128, epochs=2, verbose=0, callbacks=callbacks.default_callbacks(str(tmp_path)))
    assert history.history["c_loss"] == first.history["c_loss"]  # nothing trained again: the run's own history
    assert _checkpoint_steps(tmp_path)[-1] == 2 * STEPS_PER_EPOCH
    for name in ("contrastive_optimizer", "probe_optimizer"):  # their steps and slots restored, not fresh
        trained, restored = getattr(model, name), getattr(rerun, name)
        assert int(restored.iterations.numpy()) == int(trained.iterations.numpy()) == 2 * STEPS_PER_EPOCH
        for slot, expected in zip(restored.variables, trained.variables):
            np.testing.assert_array_equal(slot.numpy(), expected.numpy())
    for restored, trained in zip(rerun.weights, model.weights):
        np.testing.assert_array_equal(restored.numpy(), trained.numpy())


def test_a_second_fit_in_one_process_that_would_train_nothing_is_refused_in_one_line(tmp_path, new_process):
    """keras-io's distributed-training guide calls `run_training(epochs=1)` twice in one process: plain Keras trains a
    second epoch; with tfmp's checkpoints `epochs` is the run's total, so the second fit() trained nothing, silently.
    It is refused, saying what to pass; that call trains the second epoch, and a new process resumes as before."""
    images, labels = digits()

    def run_training(epochs):
        model = _lazy_sequential()  # the guide builds (or restores) its model in each call
        return model.fit(images, labels, batch_size=128, epochs=epochs, verbose=0,
                         callbacks=[keras.callbacks.TerminateOnNaN()] + callbacks.default_callbacks(str(tmp_path)))

    run_training(epochs=1)
    with pytest.raises(callbacks.RepeatedFit) as refused:
        run_training(epochs=1)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"fit(epochs=1) on {tmp_path} would train nothing")
    assert message.endswith("pass epochs=2 to train 1 more, or use another workdir")
    assert _checkpoint_steps(tmp_path) == [STEPS_PER_EPOCH]  # nothing written by the refused call

    history = run_training(epochs=2)
    assert history.epoch == [0, 1] and _checkpoint_steps(tmp_path)[-1] == 2 * STEPS_PER_EPOCH
    new_process()  # the same script rerun: its first call restores the finished run, trains nothing, is not refused
    assert run_training(epochs=2).epoch == [0, 1] and _checkpoint_steps(tmp_path)[-1] == 2 * STEPS_PER_EPOCH


@pytest.mark.parametrize("policy, replicas", [("float32", 1), ("mixed_float16", 1), ("float32", 2)])
def test_a_contrastive_model_with_its_own_optimizers(policy, replicas, tmp_path):
    keras.mixed_precision.set_global_policy(policy)
    images, labels = digits()
    strategy = _strategy(replicas)
    model = _contrastive(strategy, images)
    run_callbacks = callbacks.default_callbacks(str(tmp_path), checkpoint_every_steps=4)
    history = model.fit(images, labels, batch_size=128, epochs=2, verbose=0, callbacks=run_callbacks)

    steps = 2 * STEPS_PER_EPOCH
    assert _checkpoint_steps(tmp_path) == _expected_checkpoints(2, 4)
    assert int(model.contrastive_optimizer.iterations.numpy()) == steps
    assert history.history["c_loss"][-1] < history.history["c_loss"][0]  # it learns
    if policy == "mixed_float16":  # the two optimizers that step, not the one compile() made
        assert {"contrastive_optimizer_loss_scale", "probe_optimizer_loss_scale"} <= set(history.history)
        assert "loss_scale" not in history.history
    else:
        assert not any("loss_scale" in key for key in history.history)

    resumed = _contrastive(strategy, images)
    resumed.fit(images, labels, batch_size=128, epochs=3, verbose=0, callbacks=callbacks.default_callbacks(str(tmp_path)))
    updates = steps + steps // 2 - (1 if replicas == 1 else 0)  # built before fit on 2 replicas; lazily on one (see above)
    for name in ("contrastive_optimizer", "probe_optimizer"):  # both optimizers were in the checkpoint
        assert int(getattr(resumed, name).iterations.numpy()) == updates, name


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_the_guard_fires_on_a_custom_loss_at_the_step_it_goes_inf(policy, tmp_path):
    keras.mixed_precision.set_global_policy(policy)
    images, labels = digits()
    model = ContrastiveModel(inf_loss_at_step=7)
    model.compile(contrastive_optimizer=precision.wrap_optimizer(keras.optimizers.Adam(2e-3)),
                  probe_optimizer=precision.wrap_optimizer(keras.optimizers.Adam(1e-3)))
    run_callbacks = callbacks.default_callbacks(str(tmp_path), checkpoint_every_steps=5, nan_retries=1)
    model.fit(images, labels, batch_size=128, epochs=2, verbose=0, callbacks=run_callbacks)
    guard = run_callbacks.guard
    # Restored to step 5 once, met the same inf at step 7 again, then stopped.
    assert guard.events == ["step 7: c_loss inf", "step 7: c_loss inf"]
    assert model.stop_training
    assert "lower --learning_rate" in guard.diagnosis and "step 7: c_loss inf" in guard.diagnosis
    assert "(contrastive_optimizer)" in guard.diagnosis and "ckpt-5" in guard.diagnosis
    assert _checkpoint_steps(tmp_path) == [5]  # nothing non-finite was saved
    if policy == "mixed_float16":  # loss scaling skipped the inf steps: the weights stayed finite
        assert all(np.isfinite(variable.numpy()).all() for variable in model.encoder.weights)
        assert precision.skipped_steps(model.contrastive_optimizer) == 1  # ckpt-5 held 0; one skip after the restore


def test_a_contrastive_run_killed_with_sigkill_resumes(tmp_path):
    script = os.path.join(HERE, "scripts", "contrastive_user_model.py")
    command = [sys.executable, script, str(tmp_path), "--epochs=6", "--checkpoint_every_steps=3"]
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not any(step >= 6 for step in _checkpoint_steps(tmp_path)) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for a file, not timing the test
    assert process.poll() is None, process.communicate()[1][-2000:]
    process.send_signal(signal.SIGKILL)
    process.wait()
    before = _checkpoint_steps(tmp_path)
    assert before and before[-1] < 6 * STEPS_PER_EPOCH

    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    resumed_from = int(result.stdout.split("resumed_from_step=")[1].split()[0])
    assert resumed_from == before[-1] > 0
    # A mid-epoch checkpoint resumes at the start of its epoch, counting on from its step; the
    # first step after the resume is spent building the lazily built model (see above).
    remaining_epochs = 6 - resumed_from // STEPS_PER_EPOCH
    assert _checkpoint_steps(tmp_path)[-1] == resumed_from + remaining_epochs * STEPS_PER_EPOCH - 1


@pytest.mark.parametrize("name, code, what, where, step", [
    ("SIGTERM", 143, "SIGTERM", "step", 4),
    pytest.param("SIGINT", 130, "Ctrl-C (SIGINT)", "step", 4, marks=pytest.mark.slow),
    # After the last training batch: during the last epoch's validation, and in its epoch-end callbacks. Before,
    # fit() returned normally and the script went on (exit 0).
    ("SIGTERM", 143, "SIGTERM", "last_validation", 16),
    ("SIGINT", 130, "Ctrl-C (SIGINT)", "last_epoch_end", 16),
    pytest.param("SIGINT", 130, "Ctrl-C (SIGINT)", "last_validation", 16, marks=pytest.mark.slow),
    pytest.param("SIGTERM", 143, "SIGTERM", "last_epoch_end", 16, marks=pytest.mark.slow)])
def test_a_signal_stops_a_users_script_like_the_cli(tmp_path, name, code, what, where, step):
    """Exit 128 + the signal with one line on stderr, wherever in fit() it lands; the step checkpointed, and the
    rerun resumes from it."""
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    script = os.path.join(HERE, "scripts", "stop_by_signal.py")
    command = [sys.executable, script, str(tmp_path), name, where]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == code, result.stderr[-2000:]
    assert "Traceback" not in result.stderr  # TensorFlow's own start-up lines aside, tfmp's one line:
    assert [line for line in result.stderr.splitlines() if line.startswith("tfmp")] == [
        f"tfmp: warning: stopped by {what} at step {step}: checkpoint saved; rerun the same command to resume"]
    assert "not reached" not in result.stdout and _checkpoint_steps(tmp_path)[-1] == step
    assert callbacks.Checkpointing(str(tmp_path / "checkpoints")).saved_progress() == (step // 8, step)
    if where != "step":  # the rerun finds the run finished: restores, trains nothing, and the script goes on
        rerun = subprocess.run([*command[:4], "none"], env=environment, capture_output=True, text=True, timeout=300)
        assert rerun.returncode == 0 and "not reached" in rerun.stdout, rerun.stderr[-2000:]
        assert _checkpoint_steps(tmp_path)[-1] == step
