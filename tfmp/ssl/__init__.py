"""Self-supervised pretraining, one module per method, and what measures its result.

    two_view.py   `TwoViewModel`: views, per-replica seeded augmentations, online probe,
                  loss and replica scaling — what every method shares
    momentum.py   `MomentumTwoViewModel`: the EMA target network of BYOL, MoCo v3 and DINO
    simclr.py, byol.py, vicreg.py (VICReg, Barlow Twins), mocov3.py   the two-view methods
    dino.py       DINO: multi-crop self-distillation (its own step: 2 global + N local crops)
    mae.py        MAE: masked autoencoding, the ViT encoder on the visible patches only (one view)
    losses.py     their losses, float32, over the global batch
    probes.py     linear probe, kNN, the kNN monitor
    guard.py      the small-data guard

Methods are registered by name in `tfmp.registry.SSL_METHODS` (`--task=NAME` pretrains with it):
adding one is a module with a `TwoViewModel` subclass (its `settings` name the config fields it
reads) and one registry line.
"""

from tfmp.ssl.byol import BYOL
from tfmp.ssl.dino import DINO
from tfmp.ssl.mae import MAE
from tfmp.ssl.losses import barlow_twins_loss, byol_loss, info_nce, nt_xent, vicreg_loss
from tfmp.ssl.mocov3 import MoCoV3
from tfmp.ssl.momentum import MomentumTwoViewModel
from tfmp.ssl.simclr import SimCLR
from tfmp.ssl.two_view import TwoViewModel
from tfmp.ssl.vicreg import BarlowTwins, VICReg

__all__ = ["BYOL", "BarlowTwins", "DINO", "MAE", "MoCoV3", "MomentumTwoViewModel", "SimCLR", "TwoViewModel", "VICReg",
           "barlow_twins_loss", "byol_loss", "info_nce", "nt_xent", "vicreg_loss"]
