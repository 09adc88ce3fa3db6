"""Trained drafting heads that read the target's features (Medusa, and next EAGLE and MTP),
and the reduced draft vocabulary they share."""
