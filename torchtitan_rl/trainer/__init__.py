"""The policy trainer: a torchtitan model built from a model spec."""
