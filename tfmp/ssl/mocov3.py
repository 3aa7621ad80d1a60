"""`MoCoV3` (Chen, Xie & He 2021, "An Empirical Study of Training Self-Supervised Vision Transformers").

The online network (encoder, projector, predictor) makes queries; the momentum network
(encoder, projector; `tfmp.ssl.momentum`) makes keys; each view's queries are contrasted with
the other view's keys of the global batch (negatives from every replica, no queue;
`tfmp.ssl.losses.info_nce`). Loss: the two directions summed, as in MoCo v3.
"""

from __future__ import annotations

import keras

from tfmp.models.layers import NormSettings
from tfmp.ssl.losses import info_nce
from tfmp.ssl.momentum import MomentumTwoViewModel
from tfmp.ssl.two_view import mlp_head


class MoCoV3(MomentumTwoViewModel):
    """MoCo v3 around any encoder that maps images to a feature vector.

    Args:
        encoder: a Keras model, images -> [batch, features].
        projection_dim: output size of projector and predictor.
        projection_hidden_dim: hidden size of projector and predictor (default: the feature size).
        temperature: InfoNCE temperature.
        norm: BatchNorm settings of the heads.
        **kwargs: `MomentumTwoViewModel`'s and `TwoViewModel`'s arguments.
    """

    metric_names = ("contrastive_accuracy",)

    settings = ("projection_dim", "projection_hidden_dim", "temperature", "target_momentum")

    def __init__(self, encoder: keras.Model, *, projection_dim: int = 128, projection_hidden_dim: int = 0, temperature: float = 1.0,
                 norm: NormSettings = NormSettings(synchronized=True), **kwargs):
        super().__init__(encoder, **kwargs)
        hidden = projection_hidden_dim or self.feature_dim
        self.projector = mlp_head(hidden, projection_dim, norm, "projector", self.feature_dim)
        self.predictor = mlp_head(hidden, projection_dim, norm, "predictor", projection_dim)
        self.temperature = temperature
        self.make_target()


    def ssl_loss(self, features, batch_size, targets):
        queries = self.predictor(self.projector(features, training=True), training=True)
        loss_1, accuracy_1 = info_nce(queries[:batch_size], targets[batch_size:], self.temperature)
        loss_2, accuracy_2 = info_nce(queries[batch_size:], targets[:batch_size], self.temperature)
        return loss_1 + loss_2, {"contrastive_accuracy": 0.5 * (accuracy_1 + accuracy_2)}
