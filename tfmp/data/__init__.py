"""Data: the dataset sources, input pipelines and SimCLR augmentations (`datasets.py`, `pipeline.py`, `augment.py`)."""

from tfmp.data import augment, datasets, pipeline
from tfmp.data.datasets import ImageData, Split, balanced_subset, load, load_for
from tfmp.data.pipeline import classification_pipeline

__all__ = ["augment", "datasets", "pipeline", "ImageData", "Split", "balanced_subset", "load", "load_for", "classification_pipeline"]
