"""The private Keras / TensorFlow hooks tfmp relies on exist in the installed versions (tfmp/keras_internals.py)."""

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


def test_no_other_tfmp_module_reaches_into_keras_internals():
    """Private Keras / TF names are read in keras_internals.py only (upstream.py and precision.py
    override the hooks it lists, by name, and that is all)."""
    import pathlib
    import re

    import tfmp

    private_access = re.compile(r"\._initial_epoch|\._flatten_layers|keras\.src|__internal__|\._collective_all_reduce|\._maybe_symbolic_build\(")
    offenders = []
    for path in pathlib.Path(tfmp.__file__).parent.rglob("*.py"):
        if path.name != "keras_internals.py":
            offenders += [f"{path.name}: {match}" for match in private_access.findall(path.read_text(encoding="utf-8"))]
    assert offenders == []
