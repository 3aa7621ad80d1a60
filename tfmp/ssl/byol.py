"""`BYOL` (Grill et al. 2020, "Bootstrap Your Own Latent").

An online network (encoder, projector, predictor) predicts, for each view, the projection the
momentum target network (encoder, projector; `tfmp.ssl.momentum`) makes of the *other* view.
No negatives: the predictor and the slowly moving target keep the representation from
collapsing. Loss: `2 - 2 cos(prediction, target)`, symmetrised over the two views and averaged.
"""

from __future__ import annotations

import keras

from tfmp.models.layers import NormSettings
from tfmp.ssl.losses import byol_loss
from tfmp.ssl.momentum import MomentumTwoViewModel
from tfmp.ssl.two_view import mlp_head


class BYOL(MomentumTwoViewModel):
    """BYOL around any encoder that maps images to a feature vector.

    Args:
        encoder: a Keras model, images -> [batch, features].
        projection_dim: output size of projector and predictor.
        projection_hidden_dim: hidden size of projector and predictor (default: the feature size).
        norm: BatchNorm settings of the heads.
        **kwargs: `MomentumTwoViewModel`'s (`target_momentum`, `total_steps`, `target_encoder`) and
            `TwoViewModel`'s (`num_classes`, `augment_config`, `seed`).
    """

    settings = ("projection_dim", "projection_hidden_dim", "target_momentum")
    batch_coupled_loss = False  # a mean over examples: micro-batches accumulate their own losses

    def __init__(self, encoder: keras.Model, *, projection_dim: int = 128, projection_hidden_dim: int = 0,
                 norm: NormSettings = NormSettings(synchronized=True), **kwargs):
        super().__init__(encoder, **kwargs)
        hidden = projection_hidden_dim or self.feature_dim
        self.projector = mlp_head(hidden, projection_dim, norm, "projector", self.feature_dim)
        self.predictor = mlp_head(hidden, projection_dim, norm, "predictor", projection_dim)
        self.make_target()


    def ssl_loss(self, features, batch_size, targets):
        predictions = self.predictor(self.projector(features, training=True), training=True)
        loss = 0.5 * (byol_loss(predictions[:batch_size], targets[batch_size:]) +
                      byol_loss(predictions[batch_size:], targets[:batch_size]))
        return loss, {}
