"""Plug-ins by name: tasks, SSL methods, encoders and dataset sources, each `name -> "module:attribute"`.

The config validates names here without importing a plug-in (so bad input is refused before
TensorFlow loads); the code that runs a plug-in loads it by its target, on first use. Adding an
SSL method, encoder, task or dataset source is one module and one line below (or one
`register` call from a user's own code); nothing else learns its name.

Every SSL method is also a task of the same name (`--task=simclr` pretrains with SimCLR), run by
`tfmp.tasks.pretrain`. A dataset source is named alone (`digits`) or takes an argument after a
colon (`folder:PATH`, `tfds:NAME`). Sources and encoders name the config settings only some of them
read (`unlabeled_split`, `drop_path_rate`): setting one that the chosen one does not read is refused.
"""

from __future__ import annotations

import dataclasses
import importlib


class UnknownName(ValueError):
    """A name no plug-in of that kind is registered under; the message lists the valid ones."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One plug-in: its name, where its code is (`"module:attribute"`), and what else the registry knows of it.

    Attributes:
        argument: dataset sources only: what follows `name:` (`"PATH"`, `"NAME"`), empty when none.
        settings: dataset sources and encoders: the config settings only some of them read (setting one that the
            chosen source or encoder does not read is refused).
    """

    name: str
    target: str
    argument: str = ""
    settings: tuple[str, ...] = ()

    @property
    def spelling(self) -> str:
        """How a user writes it (`folder:PATH`)."""
        return f"{self.name}:{self.argument}" if self.argument else self.name

    def load(self):
        """The plug-in itself (imports its module)."""
        module_name, _, attribute = self.target.partition(":")
        return getattr(importlib.import_module(module_name), attribute)


class Registry:
    """Names of one kind of plug-in, in registration order."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, target: str, *, argument: str = "", settings: tuple[str, ...] = ()) -> None:
        """Registers `target` (`"package.module:attribute"`) under `name`; a name is registered once."""
        if ":" not in target:
            raise ValueError(f"{self.kind} {name!r}: target must be 'module:attribute', got {target!r}")
        existing = self._entries.get(name)
        if existing is not None and existing.target != target:
            raise ValueError(f"{self.kind} {name!r} is already registered as {existing.target}")
        self._entries[name] = Entry(name, target, argument, tuple(settings))

    def unregister(self, name: str) -> None:
        """Removes `name` (for tests that register a plug-in of their own)."""
        self._entries.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def spellings(self) -> tuple[str, ...]:
        return tuple(entry.spelling for entry in self._entries.values())

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def entry(self, name: str) -> Entry:
        """The entry for `name`.

        Raises:
            UnknownName: no such entry; the message lists the valid ones.
        """
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownName(f"unknown {self.kind} {name!r}; valid: {', '.join(self.spellings())}") from None

    def load(self, name: str):
        return self.entry(name).load()


TASKS = Registry("task")
SSL_METHODS = Registry("SSL method")
ENCODERS = Registry("model")
DATASET_SOURCES = Registry("dataset")

TASKS.register("supervised", "tfmp.tasks.supervised:TASK")
TASKS.register("linear_eval", "tfmp.tasks.evaluation:LINEAR_EVAL")
TASKS.register("finetune", "tfmp.tasks.evaluation:FINETUNE")
PRETRAINING_TASK = Entry("pretraining", "tfmp.tasks.pretrain:TASK")  # runs every SSL method

SSL_METHODS.register("simclr", "tfmp.ssl.simclr:SimCLR")
SSL_METHODS.register("byol", "tfmp.ssl.byol:BYOL")
SSL_METHODS.register("vicreg", "tfmp.ssl.vicreg:VICReg")
SSL_METHODS.register("barlow_twins", "tfmp.ssl.vicreg:BarlowTwins")
SSL_METHODS.register("mocov3", "tfmp.ssl.mocov3:MoCoV3")
SSL_METHODS.register("dino", "tfmp.ssl.dino:DINO")
SSL_METHODS.register("mae", "tfmp.ssl.mae:MAE")

ENCODERS.register("small_cnn", "tfmp.models.cnn:small_cnn")
ENCODERS.register("resnet18_cifar", "tfmp.models.resnet:resnet18_cifar")
ENCODERS.register("resnet50", "tfmp.models.resnet:resnet50")
ENCODERS.register("vit_micro_p2", "tfmp.models.vit:vit_micro_p2", settings=("drop_path_rate",))
ENCODERS.register("vit_tiny_p4", "tfmp.models.vit:vit_tiny_p4", settings=("drop_path_rate",))
ENCODERS.register("vit_small_p16", "tfmp.models.vit:vit_small_p16", settings=("drop_path_rate",))
ENCODERS.register("vit_base_p16", "tfmp.models.vit:vit_base_p16", settings=("drop_path_rate",))

DATASET_SOURCES.register("digits", "tfmp.data.datasets:load_digits")
DATASET_SOURCES.register("folder", "tfmp.data.datasets:load_folder", argument="PATH", settings=("skip_unreadable_images",))
DATASET_SOURCES.register("tfds", "tfmp.data.datasets:load_tfds", argument="NAME", settings=("data_dir", "unlabeled_split"))
DATASET_SOURCES.register("synthetic", "tfmp.data.datasets:load_synthetic")


def task_names() -> tuple[str, ...]:
    """Every `--task`: the registered tasks and one pretraining task per SSL method."""
    return (*TASKS.names(), *SSL_METHODS.names())


def task_entry(name: str) -> Entry:
    """The entry of `--task=name` (an SSL method's name gives the pretraining task).

    Raises:
        UnknownName: no such task; the message lists the valid ones.
    """
    if name in SSL_METHODS:
        return PRETRAINING_TASK
    if name in TASKS:
        return TASKS.entry(name)
    raise UnknownName(f"unknown task {name!r}; valid: {', '.join(task_names())}")


def dataset_source(dataset: str) -> tuple[Entry, str]:
    """The source of `--dataset` and its argument (`folder:/data` -> the folder entry and `/data`).

    Raises:
        UnknownName: no such source, or one missing (or given) its argument.
    """
    name, colon, argument = dataset.partition(":")
    entry = DATASET_SOURCES.entry(name) if name in DATASET_SOURCES else None
    if entry is None or bool(entry.argument) != bool(colon) or (colon and not argument):
        raise UnknownName(f"unknown dataset {dataset!r}; valid: {', '.join(DATASET_SOURCES.spellings())}")
    return entry, argument
