"""draftadapt: keep a speculative-decoding draft aligned with a policy that RL keeps moving."""

__version__ = "0.1.0"
