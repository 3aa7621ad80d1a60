"""`VICReg` (Bardes, Ponce & LeCun 2022) and its sibling `BarlowTwins` (Zbontar et al. 2021).

Both regularise the statistics of the two views' projections instead of contrasting
examples: VICReg keeps each dimension's variance up and the dimensions decorrelated while
pulling the views together; Barlow Twins pushes the views' cross-correlation matrix to the
identity. Both statistics are taken over the *global* batch in float32
(`tfmp.ssl.losses`), so N replicas compute what one device would.
"""

from __future__ import annotations

import keras

from tfmp.models.layers import NormSettings
from tfmp.ssl.losses import barlow_twins_loss, vicreg_loss
from tfmp.ssl.two_view import TwoViewModel, mlp_head


class VICReg(TwoViewModel):
    """VICReg around any encoder that maps images to a feature vector.

    Args:
        encoder: a Keras model, images -> [batch, features].
        projection_dim: output size of the projector ("expander").
        projection_hidden_dim: its hidden size (default: the feature size).
        invariance_weight, variance_weight, covariance_weight: the loss terms' weights (paper: 25, 25, 1).
        norm: BatchNorm settings of the projector.
        **kwargs: `TwoViewModel`'s arguments.
    """

    metric_names = ("invariance", "variance", "covariance")
    settings = ("projection_dim", "projection_hidden_dim", "invariance_weight", "variance_weight", "covariance_weight")

    def __init__(self, encoder: keras.Model, *, projection_dim: int = 128, projection_hidden_dim: int = 0,
                 invariance_weight: float = 25.0, variance_weight: float = 25.0, covariance_weight: float = 1.0,
                 norm: NormSettings = NormSettings(synchronized=True), **kwargs):
        super().__init__(encoder, **kwargs)
        self.projector = mlp_head(projection_hidden_dim or self.feature_dim, projection_dim, norm, "projector", self.feature_dim)
        self.weights_of_terms = (invariance_weight, variance_weight, covariance_weight)


    def ssl_loss(self, features, batch_size, targets):
        projections = self.projector(features, training=True)
        return vicreg_loss(projections[:batch_size], projections[batch_size:], *self.weights_of_terms)


class BarlowTwins(TwoViewModel):
    """Barlow Twins around any encoder that maps images to a feature vector.

    Args:
        encoder: a Keras model, images -> [batch, features].
        projection_dim: output size of the projector.
        projection_hidden_dim: its hidden size (default: the feature size).
        redundancy_weight: weight of the off-diagonal terms (paper: 0.0051 for 8192 dimensions).
        norm: BatchNorm settings of the projector.
        **kwargs: `TwoViewModel`'s arguments.
    """

    metric_names = ("on_diagonal", "off_diagonal")
    settings = ("projection_dim", "projection_hidden_dim", "redundancy_weight")

    def __init__(self, encoder: keras.Model, *, projection_dim: int = 128, projection_hidden_dim: int = 0,
                 redundancy_weight: float = 0.0051, norm: NormSettings = NormSettings(synchronized=True), **kwargs):
        super().__init__(encoder, **kwargs)
        self.projector = mlp_head(projection_hidden_dim or self.feature_dim, projection_dim, norm, "projector", self.feature_dim)
        self.redundancy_weight = redundancy_weight


    def ssl_loss(self, features, batch_size, targets):
        projections = self.projector(features, training=True)
        return barlow_twins_loss(projections[:batch_size], projections[batch_size:], self.redundancy_weight)
