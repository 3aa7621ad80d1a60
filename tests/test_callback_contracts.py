"""tfmp's callbacks talk through narrow interfaces and run in a declared order (tfmp/callbacks/interfaces.py).

Two contracts a new callback cannot silently break: one callback uses only the `Protocol` it takes of
another (read from the source, so every path counts, not only the ones a fit happens to walk), and a
callback list out of the declared order is refused.
"""

import ast
import importlib
import inspect
import pkgutil
import textwrap
import typing

import keras
import numpy as np
import pytest

import tfmp
from tfmp import callbacks
from tfmp.callbacks import interfaces


def _callback_classes() -> list[type]:
    found = {}
    for module_info in pkgutil.walk_packages(tfmp.__path__, "tfmp."):
        if module_info.name.startswith(("tfmp.train", "tfmp.launch", "tfmp.doctor", "tfmp.bench")):
            continue  # entry points: they parse flags at import
        module = importlib.import_module(module_info.name)
        for _, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, keras.callbacks.Callback) and value.__module__ == module.__name__):
                found[value.__qualname__] = value
    return list(found.values())


def _protocol_members(protocol: type) -> set[str]:
    return {name for name in dir(protocol) if not name.startswith("_")}


def _collaborators(cls: type) -> dict[str, type]:
    """`self.<attribute>` -> the Protocol of the constructor argument stored there, for every argument typed with one.

    Raises AssertionError when an argument is typed with a concrete callback class instead."""
    stored = {}
    for base in reversed(cls.__mro__):  # what tfmp's own base classes store counts too
        if (base is cls or base.__module__.startswith("tfmp.")) and "__init__" in vars(base):
            stored.update(_stored_by(base))
    return stored


def _stored_by(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls.__init__)
    typed = {}
    for parameter, hint in hints.items():
        for candidate in typing.get_args(hint) or (hint,):
            if inspect.isclass(candidate) and issubclass(candidate, keras.callbacks.Callback):
                raise AssertionError(f"{cls.__name__}.__init__ takes {parameter}: {candidate.__name__}, a whole callback; "
                                     "take the narrow interface it needs (tfmp.callbacks.interfaces)")
            if getattr(candidate, "_is_protocol", False):
                typed[parameter] = candidate
    source = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    stored = {}
    for node in ast.walk(source):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        value = node.value if targets else None
        if isinstance(value, ast.BoolOp) and isinstance(value.op, ast.Or):  # `counter or StepCounter()`
            value = value.values[0]
        used = {value.id} if isinstance(value, ast.Name) else set()
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                for parameter in used & typed.keys():
                    stored[target.attr] = typed[parameter]
    return stored


def interface_breaches(cls: type, source: str | None = None) -> list[str]:
    """Attributes `cls` reads of a collaborator beyond the Protocol it was given (`source`: the class's, by default)."""
    stored = _collaborators(cls)
    tree = ast.parse(textwrap.dedent(source or inspect.getsource(cls)))
    breaches = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "self" and node.value.attr in stored
                and node.attr not in _protocol_members(stored[node.value.attr])):
            breaches.append(f"{cls.__name__}: self.{node.value.attr}.{node.attr} is not in "
                            f"{stored[node.value.attr].__name__}")
    return breaches


def test_every_callback_uses_only_the_interfaces_it_is_given():
    classes = _callback_classes()
    names = {cls.__name__ for cls in classes}
    assert {"Checkpointing", "NaNGuard", "PreemptionCheckpoint", "ReplicaConsistencyCheck", "KNNMonitor", "PlateauWatch"} <= names
    assert [breach for cls in classes for breach in interface_breaches(cls)] == []
    # The ones that take another callback's help do take it as a Protocol.
    assert _collaborators(callbacks.NaNGuard) == {"checkpointing": interfaces.RestorePoint, "counter": interfaces.StepCount}
    assert _collaborators(callbacks.PreemptionCheckpoint) == {"checkpointing": interfaces.SavesNow, "counter": interfaces.StepCount}


def test_the_contract_check_sees_a_callback_reaching_past_its_interface():
    # The preemption handler reading the checkpoints' step (what it did before the interfaces) is a breach ...
    reaching = inspect.getsource(callbacks.PreemptionCheckpoint).replace("self.counter.step", "self.checkpointing.step")
    assert interface_breaches(callbacks.PreemptionCheckpoint, reaching) == [
        "PreemptionCheckpoint: self.checkpointing.step is not in SavesNow"]

    # ... and so is a constructor typed with a whole callback.
    class Greedy(keras.callbacks.Callback):
        def __init__(self, checkpointing: callbacks.Checkpointing):
            super().__init__()
            self.checkpointing = checkpointing

    with pytest.raises(AssertionError, match="takes checkpointing: Checkpointing, a whole callback"):
        _collaborators(Greedy)


def test_default_callbacks_run_in_the_declared_order_and_a_broken_order_is_refused(tmp_path):
    run = callbacks.default_callbacks(str(tmp_path))
    callbacks.check_order(run)  # as built
    assert run.index(run.step_counter) < min(run.index(run.checkpointing), run.index(run.guard), run.index(run.preemption))
    assert run.index(run.checkpointing) < run.index(run.preemption)
    swapped = list(run)
    first, second = swapped.index(run.checkpointing), swapped.index(run.preemption)
    swapped[first], swapped[second] = swapped[second], swapped[first]
    with pytest.raises(callbacks.CallbackOrderError, match="Checkpointing must run before PreemptionCheckpoint"):
        callbacks.check_order(swapped)
    loggers_first = [run.history, *[callback for callback in run if callback is not run.history]]
    with pytest.raises(callbacks.CallbackOrderError, match="LossScaleMonitor must run before HistoryCSV"):
        callbacks.check_order(loggers_first)


def test_the_knn_monitor_runs_before_the_plateau_watch_and_the_loggers(tmp_path):
    from tfmp.ssl import guard, probes

    images = np.zeros((4, 8, 8, 1), "float32")
    labelled = __import__("tensorflow").data.Dataset.from_tensor_slices((images, np.zeros(4, "int32"))).batch(2)
    knn = probes.KNNMonitor(keras.Sequential([keras.layers.Flatten()]), labelled, labelled, num_classes=2)
    watch = guard.PlateauWatch()
    run = callbacks.default_callbacks(str(tmp_path), monitors=[knn, watch])
    callbacks.check_order(run)
    with pytest.raises(callbacks.CallbackOrderError, match="KNNMonitor must run before PlateauWatch"):
        callbacks.check_order([watch, knn])
    with pytest.raises(callbacks.CallbackOrderError, match="KNNMonitor must run before HistoryCSV"):
        callbacks.check_order([run.history, knn])


def test_default_callbacks_behave_as_the_list_users_combine_them_into(tmp_path):
    """keras-io's scripts build callback lists with `+`: `[TerminateOnNaN()] + default_callbacks(w)` failed with
    "can only concatenate list (not "RunCallbacks") to list" before fit() started."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    data = (np.ones((8, 2), "float32"), np.ones((8, 1), "float32"))
    run = callbacks.default_callbacks(str(tmp_path / "a"))
    terminate = keras.callbacks.TerminateOnNaN()
    combined = [terminate] + run
    assert type(combined) is list and combined[0] is terminate and combined[1:] == list(run)
    assert len(run) == len(list(iter(run))) == 9 and run.checkpointing in run
    extended = [terminate]
    extended.extend(run)
    assert extended == combined and (run + [terminate])[-1] is terminate
    model.fit(*data, epochs=2, verbose=0, callbacks=combined)
    assert run.checkpointing.step == 1 * 2  # 8 examples, batch 32: one step an epoch

    # fit(callbacks=...) takes it as it is, and inside a nested list too (Keras flattens it).
    rerun = callbacks.default_callbacks(str(tmp_path / "b"))
    model.fit(*data, epochs=1, verbose=0, callbacks=rerun)
    model.fit(*data, epochs=2, verbose=0, callbacks=[callbacks.default_callbacks(str(tmp_path / "b")), terminate])
    assert callbacks.find_checkpoints(str(tmp_path / "b" / "checkpoints"))[-1][0] == 2
