"""Sharing a GPU between claims: time slicing, MPS (one control daemon per claim, run as a
Deployment) and consumable shares enforced by MPS. Each is a prepare step beside its pure model."""
