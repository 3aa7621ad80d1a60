"""The private Keras / TensorFlow hooks tfmp relies on exist in the installed versions (tfmp/keras_internals.py)."""

import functools
import logging

import keras

from tfmp import keras_internals


def test_every_hook_exists_in_the_installed_keras_and_tensorflow():
    assert keras_internals.missing_hooks() == []


def test_the_installed_keras_is_a_checked_release_or_warns_once(caplog, monkeypatch):
    installed = ".".join(keras.__version__.split(".")[:2])
    assert keras_internals.warn_if_unchecked() is (installed in keras_internals.CHECKED_KERAS_VERSIONS)
    keras_internals.warn_if_unchecked.cache_clear()
    monkeypatch.setattr(keras, "__version__", "9.1.0")
    with caplog.at_level(logging.WARNING, logger="tfmp"):
        assert keras_internals.warn_if_unchecked() is False
        assert keras_internals.warn_if_unchecked() is False
    keras_internals.warn_if_unchecked.cache_clear()
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 1 and "Keras 9.1.0 is not a release" in messages[0]


# ------------------------------------------------------------------ the fence sees everything

PRIVATE_MODULES = ("keras.src", "tensorflow.python", "tensorflow.core")


@functools.cache  # the same for every call; made once (in a test process holding many models, 5 calls took 66 s)
def _keras_private_names() -> frozenset[str]:
    """Private attribute names of the Keras and TensorFlow objects tfmp's code holds or subclasses."""
    import tensorflow as tf

    model = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.Conv2D(2, 3), keras.layers.BatchNormalization(),
                              keras.layers.Flatten(), keras.layers.Dense(2)])
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    optimizer.build(model.trainable_variables)
    model.compile(optimizer=optimizer, loss="mse")
    objects = [model, *model.layers, optimizer, optimizer.inner_optimizer, keras.optimizers.AdamW(), keras.callbacks.Callback(),
               keras.callbacks.TensorBoard(), keras.metrics.Mean(), tf.distribute.get_strategy(), tf.Variable(1.0), tf.train.Checkpoint()]
    return frozenset(name for thing in objects for kind in (thing, type(thing)) for name in dir(kind)
                     if name.startswith("_") and not (name.startswith("__") and name.endswith("__")))


def _tfmp_own_private_names(trees) -> set[str]:
    """Private names tfmp defines itself: functions, classes, attributes it assigns, module globals."""
    import ast

    own = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
    return {name for name in own if name.startswith("_")}


def _on_self(node) -> bool:
    import ast

    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


@functools.cache  # each test plants into the same sources: parsed once (read-only trees)
def _parsed(source: str):
    import ast

    return ast.parse(source)


def private_accesses(sources: dict[str, str]) -> list[str]:
    """Where the given modules (name -> source) touch a private Keras / TensorFlow name: an attribute
    `._name` read of any object but `self` / `cls` (whose type cannot be told from the source, so
    any other object may be Keras' or TF's), or of `self` where tfmp does not define the name itself
    or Keras or TF also uses it (an override or a read of their state); `getattr` of a private name;
    `__internal__`; an import from Keras' or TF's private packages."""
    import ast

    trees = {name: _parsed(source) for name, source in sources.items()}
    keras_private = _keras_private_names()
    own = _tfmp_own_private_names(trees.values()) - keras_private
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            where = f"{name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
                dunder = node.attr.startswith("__") and node.attr.endswith("__")
                if (node.attr == "__internal__") or (not dunder and (node.attr not in own or not _on_self(node))):
                    found.append(f"{where} .{node.attr}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr", "hasattr")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_")):
                found.append(f"{where} {node.func.id}(..., {node.args[1].value!r})")
            elif isinstance(node, ast.FunctionDef) and node.name in keras_private:
                found.append(f"{where} def {node.name} (overrides a private Keras/TF method)")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PRIVATE_MODULES):
                found.append(f"{where} from {node.module}")
            elif isinstance(node, ast.Import):
                found += [f"{where} import {alias.name}" for alias in node.names if alias.name.startswith(PRIVATE_MODULES)]
    return found


def _tfmp_sources() -> dict[str, str]:
    import pathlib

    import tfmp

    root = pathlib.Path(tfmp.__file__).parent
    return {str(path.relative_to(root)): path.read_text(encoding="utf-8") for path in sorted(root.rglob("*.py"))
            if path.name != "keras_internals.py"}


def test_no_tfmp_module_but_keras_internals_touches_a_private_keras_or_tensorflow_name():
    assert private_accesses(_tfmp_sources()) == []


def test_the_fence_finds_a_planted_private_access():
    planted = dict(_tfmp_sources())
    planted["planted.py"] = "def f(keras_model):\n    return keras_model._something\n"
    assert private_accesses(planted) == ["planted.py:2 ._something"]
    overriding = dict(_tfmp_sources())
    overriding["planted.py"] = ("import keras\n\nclass Mine(keras.optimizers.SGD):\n"
                                "    def _get_variable_index(self, variable):\n        return 0\n")
    assert private_accesses(overriding) == ["planted.py:4 def _get_variable_index (overrides a private Keras/TF method)"]
    # A private name tfmp also uses for its own state (`Checkpointing._step`), read of another object.
    assert "_step" in _tfmp_own_private_names([__import__("ast").parse(source) for source in _tfmp_sources().values()])
    reaching = {**_tfmp_sources(), "planted.py": "def f(model):\n    return model._step\n"}
    assert private_accesses(reaching) == ["planted.py:2 ._step"]
    by_name = {**_tfmp_sources(), "planted.py": "def f(model):\n    return getattr(model, '_initial_epoch', 0)\n"}
    assert private_accesses(by_name) == ["planted.py:2 getattr(..., '_initial_epoch')"]
    importing = {"planted.py": "from keras.src.backend.tensorflow import trainer\n"}
    assert private_accesses(importing) == ["planted.py:1 from keras.src.backend.tensorflow"]


def test_missing_hooks_checks_every_private_name_the_fence_module_touches():
    """A private name used in keras_internals.py (an attribute, or a name looked up by string) that `missing_hooks`
    does not check would fail late, at its first use after a Keras upgrade, instead of at start-up."""
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(keras_internals.__file__).read_text(encoding="utf-8"))
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr.startswith("_")
            and not (node.attr.startswith("__") and node.attr.endswith("__")) and not _on_self(node)}
    used |= {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and node.value.startswith("_") and not node.value.startswith("__") and node.value.isidentifier()}
    defined_here = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    # Keras' private methods the fence's own LossScaleOptimizerHooks overrides are checked through LOSS_SCALE_HOOKS.
    unchecked = used - keras_internals.hook_names() - {name for name in defined_here if name not in keras_internals.hook_names()}
    assert unchecked == set()
