"""Consumable shares enforced by MPS: the ShareEnforcer (shares.py) on mpsdaemon.MpsDaemons.

Flow position: prepare/ (the first share of a device) -> here -> mpsdaemon.py. One MPS control
daemon per shared device (a full GPU or a MIG device), owned by ``shares.share_owner(device)``
and started like a claim's daemon (EXCLUSIVE_PROCESS compute mode on a full GPU, directories,
tmpfs, a Deployment outside the agent, adopted after a restart), but without default limits:
each share's limits come with its own CDI device (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` and
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, shares.share_env), which the MPS server applies per
client. The preparer decides when a daemon starts (first share) and goes (last share).
"""

from __future__ import annotations

from collections.abc import Callable

from dra_driver.errors import MpsFailed, ShareEnforcementFailed
from dra_driver.sharing import mps
from dra_driver.sharing.mpsdaemon import MpsDaemons

DeviceByUuid = Callable[[str], "mps.MpsDevice | None"]
"""The device of this node with a UUID (GPU-... or MIG-...), None when there is none."""


class MpsShareEnforcer:
    """shares.ShareEnforcer: a device's shared MPS daemon, started and stopped by ``daemons``."""

    def __init__(self, daemons: MpsDaemons, device_by_uuid: DeviceByUuid) -> None:
        self._daemons = daemons
        self._device_by_uuid = device_by_uuid

    def daemon(self, *, gpu_uuids: frozenset[str], owner: str) -> mps.MpsDaemon:
        """The daemon serving ``gpu_uuids`` for ``owner``; ShareEnforcementFailed if one of
        them is not a device of this node."""
        devices = []
        for uuid in sorted(gpu_uuids):
            device = self._device_by_uuid(uuid)
            if device is None:
                raise ShareEnforcementFailed(f"device {uuid} is not a device of this node")
            devices.append(device)
        try:
            return mps.MpsDaemon(owner=owner, devices=tuple(devices), base=self._daemons.base)
        except ValueError as exc:
            raise ShareEnforcementFailed(str(exc)) from None

    def acquire(self, *, gpu_uuids: frozenset[str], owner: str) -> None:
        """Start (or adopt) the daemon; idempotent."""
        try:
            self._daemons.start(self.daemon(gpu_uuids=gpu_uuids, owner=owner), mps.Limits())
        except MpsFailed as exc:
            raise ShareEnforcementFailed(f"the shared MPS daemon {owner}: {exc}") from exc

    def release(self, *, gpu_uuids: frozenset[str], owner: str) -> None:
        """Stop the daemon and remove what it had (``gpu_uuids`` is not needed: the daemon's
        own files say which GPUs it made exclusive); idempotent."""
        del gpu_uuids
        try:
            self._daemons.stop(owner)
        except MpsFailed as exc:
            raise ShareEnforcementFailed(f"the shared MPS daemon {owner}: {exc}") from exc
