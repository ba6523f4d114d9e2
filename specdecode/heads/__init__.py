"""Drafter heads trained on the target's own features: corpus -> features -> training -> weights."""
