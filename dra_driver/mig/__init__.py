"""Dynamic MIG (``--mig-mode dynamic``): which MIG devices are the driver's own, creating and
destroying a placement's MIG device on prepare and unprepare, and switching a whole GPU out of MIG
mode and back. Each is a prepare step (prepare.step.Step): ``instance_step`` (on ``instances``)
and ``modeswitch_step`` (on ``instances`` and the marks of ``modeswitch``); ``dynamic`` decides
what is published. NVML calls go through ``gpus.migmanager``."""
