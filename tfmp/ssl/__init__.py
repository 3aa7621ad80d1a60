"""Self-supervised pretraining: SimCLR (`simclr.py`), NT-Xent (`losses.py`), probes
(`probes.py`), the small-data guard (`guard.py`) and the CLI tasks (`tasks.py`)."""

from tfmp.ssl.losses import nt_xent
from tfmp.ssl.simclr import SimCLR

__all__ = ["SimCLR", "nt_xent"]
