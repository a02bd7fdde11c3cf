"""Sharing a GPU between claims: time slicing, MPS (one control daemon per claim, run as a
Deployment) and consumable shares enforced by MPS. Each is a prepare step (prepare.step.Step)
beside its pure model: ``timeslice_step`` (``timeslice``), ``mps_step`` (``mps``, ``mpsdaemon``),
``share_step`` (``shares``, ``mpsshares``)."""
