"""`SimCLR` (Chen et al. 2020, "A Simple Framework for Contrastive Learning of Visual Representations").

Each step encodes two augmented views of every image, projects them with an MLP head and
pulls the two views of each image together against all other images in the *global* batch
(NT-Xent with negatives from every replica, `tfmp.ssl.losses.nt_xent`). The views, probe,
replica scaling and loss scaling are `TwoViewModel`'s.
"""

from __future__ import annotations

import keras

from tfmp.models.layers import NormSettings
from tfmp.ssl.losses import nt_xent
from tfmp.ssl.two_view import TwoViewModel, mlp_head


class SimCLR(TwoViewModel):
    """SimCLR around any encoder that maps images to a feature vector.

    Args:
        encoder: a Keras model, images -> [batch, features].
        projection_dim: output size of the projection head.
        projection_hidden_dim: hidden size of the projection head (default: the feature size).
        temperature: NT-Xent temperature.
        norm: BatchNorm settings of the projection head (synchronized on several replicas).
        **kwargs: `TwoViewModel`'s (`num_classes`, `augment_config`, `seed`) and Keras'.
    """

    metric_names = ("contrastive_accuracy",)

    settings = ("projection_dim", "projection_hidden_dim", "temperature")

    def __init__(self, encoder: keras.Model, *, projection_dim: int = 128, projection_hidden_dim: int = 0, temperature: float = 0.2,
                 norm: NormSettings = NormSettings(synchronized=True), **kwargs):
        super().__init__(encoder, **kwargs)
        self.projector = mlp_head(projection_hidden_dim or self.feature_dim, projection_dim, norm, "projector", self.feature_dim)
        self.temperature = temperature


    def ssl_loss(self, features, batch_size, targets):
        projections = self.projector(features, training=True)
        loss, accuracy = nt_xent(projections[:batch_size], projections[batch_size:], self.temperature)
        return loss, {"contrastive_accuracy": accuracy}
