"""Drafters that read the target's own hidden states through heads: one module per head method
(medusa.py, hydra.py, eagle.py, mtp.py; what they share in base.py), and ``DRAFTERS``, the drafter of
each method of specrun.heads.kinds."""

from specrun.drafters.heads.eagle import EagleDrafter
from specrun.drafters.heads.hydra import HydraDrafter
from specrun.drafters.heads.medusa import MedusaDrafter
from specrun.drafters.heads.mtp import MtpDrafter

DRAFTERS = {"medusa": MedusaDrafter, "hydra": HydraDrafter, "eagle": EagleDrafter, "mtp": MtpDrafter}
