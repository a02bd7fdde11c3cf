"""The one owner of prepare's state on this node: the checkpoint (``checkpoint``: the claim table
and group commit; ``checkpointfiles``: its snapshot, journal and lock files;
``checkpointrecords``, ``checkpointformat``, ``checkpointlocks``: the records, the files' format,
the per-claim locks) and switching a node in place from NVIDIA's driver or an earlier release
(``switchover``).

Flow position: node/ opens the state; prepare's core reads and records claims through it.
"""
