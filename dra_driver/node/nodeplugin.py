"""``NodePlugin``: prepare's state and the kubelet plugin that serves it, opened and closed in
the order the kubelet needs.

Flow position: node/wiring.py builds one -> start(): prepare/state's PrepareState opens (the
checkpoint, adoption, recovery, the reconcile loop) -> plugin/kubelet.py's KubeletPlugin serves
it on dra.sock, then registers; stop(): the sockets go first, then the state closes. The plugin
knows sockets and gRPC, the state knows claims: this is where the two meet, and where the
agent's other parts (probes, telemetry, re-discovery) reach them.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING

from dra_driver.gpus.info import Inventory
from dra_driver.heartbeat import Heartbeat
from dra_driver.plugin.kubelet import KubeletPlugin
from dra_driver.plugin.registration import RegistrationServicer
from dra_driver.plugin.sockets import SocketPaths
from dra_driver.prepare import (
    Checkpoint,
    ClaimLocks,
    Preparer,
    PrepareState,
    StateSettings,
    recorded_device_names,
)

if TYPE_CHECKING:
    from dra_driver import cdi
    from dra_driver.metrics import DriverMetrics
    from dra_driver.telemetry.model import ClaimHolder

log = logging.getLogger(__name__)


class NodePlugin:
    """``state`` served by ``kubelet``; what the agent and the tests hold of the two."""

    def __init__(self, *, state: PrepareState, kubelet: KubeletPlugin) -> None:
        self.state = state
        self.kubelet = kubelet

    def start(self) -> None:
        """Open the state, then serve (dra.sock, then registration). Not re-entrant."""
        self.state.open()
        self.kubelet.start()

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving and remove both sockets, then close the state. Safe to call twice or
        before start()."""
        self.kubelet.stop(grace_s)
        self.state.close()

    def serve_until_signal(self) -> None:
        """start(), wait for SIGTERM or SIGINT, stop(). For the main thread only."""
        done = threading.Event()

        def handler(signum: int, frame: FrameType | None) -> None:
            log.info("stopping on signal", extra={"signal": signal.Signals(signum).name})
            done.set()

        previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.start()
            done.wait()
        finally:
            self.stop()
            for s, h in previous.items():
                signal.signal(s, h)

    def set_inventory(self, inventory: Inventory) -> None:
        """What prepare accepts and the health stream lists, from a re-discovery's inventory
        (PrepareState.set_inventory); open health streams get the new list at once."""
        self.state.set_inventory(inventory)
        self.kubelet.health_changed()

    def health_changed(self) -> None:
        """A device's health changed: open health streams report now. Never blocks."""
        self.kubelet.health_changed()

    def readiness_problems(self) -> list[str]:
        """Empty once the kubelet registered the plugin; otherwise why not (for ``/readyz``)."""
        return self.kubelet.readiness_problems()

    def device_holders(self) -> dict[str, tuple[ClaimHolder, ...]]:
        """Device name -> the prepared claims holding it, with the pods they are reserved for
        (telemetry's claim labels). Empty before start(); CheckpointError once stopped."""
        from dra_driver.telemetry.holders import holders_from_records  # noqa: PLC0415

        preparer = self.state.preparer
        if preparer is None:
            return {}
        return holders_from_records(
            self.state.checkpoint.snapshot().values(), pods=preparer.claim_pods()
        )

    def prepared_claim_uids(self) -> frozenset[str]:
        """The uid of every claim prepare's state records now; none before start()."""
        if self.state.preparer is None:
            return frozenset()
        return frozenset(self.state.checkpoint.snapshot())

    def recorded_device_names(self) -> frozenset[str]:
        """Every device name prepare's state records now (nodestate.recorded_device_names);
        none before start()."""
        if self.state.preparer is None:
            return frozenset()
        return recorded_device_names(self.state.checkpoint.snapshot().values())

    # -- what the probes, the metrics and the tests read -----------------------------------

    @property
    def heartbeats(self) -> tuple[Heartbeat, ...]:
        """The background loops, for ``/healthz`` (the gRPC servers are probed over their
        sockets)."""
        return self.state.heartbeats

    @property
    def reconcile_heartbeat(self) -> Heartbeat:
        return self.state.reconcile_heartbeat

    @property
    def paths(self) -> SocketPaths:
        return self.kubelet.paths

    @property
    def registration(self) -> RegistrationServicer | None:
        return self.kubelet.registration

    @property
    def settings(self) -> StateSettings:
        return self.state.settings

    @property
    def preparer(self) -> Preparer | None:
        return self.state.preparer

    @property
    def checkpoint(self) -> Checkpoint:
        return self.state.checkpoint

    @property
    def specs(self) -> cdi.CdiSpecDir:
        return self.state.specs

    @property
    def locks(self) -> ClaimLocks:
        return self.state.locks

    @property
    def metrics(self) -> DriverMetrics | None:
        return self.state.metrics

    def driver_files(self) -> cdi.DriverFiles:
        return self.state.driver_files()
