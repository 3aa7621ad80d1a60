"""Self-supervised pretraining, one module per method, and what measures its result.

    two_view.py   `TwoViewModel`: views, per-replica seeded augmentations, online probe,
                  loss and replica scaling — what every method shares
    momentum.py   `MomentumTwoViewModel`: the EMA target network of BYOL and MoCo v3
    simclr.py, byol.py, vicreg.py (VICReg, Barlow Twins), mocov3.py   the methods
    losses.py     their losses, float32, over the global batch
    probes.py     linear probe, kNN, the kNN monitor
    guard.py      the small-data guard

`METHODS` is the registry: `--task=NAME` pretrains with `METHODS[NAME]`. Adding a method is a
module with a `TwoViewModel` subclass (with `from_run_config`) and one entry here.
"""

from tfmp.ssl.byol import BYOL
from tfmp.ssl.losses import barlow_twins_loss, byol_loss, info_nce, nt_xent, vicreg_loss
from tfmp.ssl.mocov3 import MoCoV3
from tfmp.ssl.momentum import MomentumTwoViewModel
from tfmp.ssl.simclr import SimCLR
from tfmp.ssl.two_view import TwoViewModel
from tfmp.ssl.vicreg import BarlowTwins, VICReg

METHODS = {"simclr": SimCLR, "byol": BYOL, "vicreg": VICReg, "barlow_twins": BarlowTwins, "mocov3": MoCoV3}

__all__ = ["BYOL", "BarlowTwins", "METHODS", "MoCoV3", "MomentumTwoViewModel", "SimCLR", "TwoViewModel", "VICReg",
           "barlow_twins_loss", "byol_loss", "info_nce", "nt_xent", "vicreg_loss"]
