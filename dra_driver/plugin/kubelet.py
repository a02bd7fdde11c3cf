"""``KubeletPlugin``: the kubelet-facing sockets of one node, from start to stop.

It serves a ``prepare.ClaimPreparer`` it is given (node/ opens prepare's state and hands it
over) and builds nothing: start() (spec A.3 order, checklist H)
1. serves DRA v1 + v1beta1 and the health stream v1 + v1alpha1 on ``dra.sock`` (services.py);
2. only then serves registration on ``<driver>-reg.sock`` (the kubelet calls the DRA service as
   soon as it registers us); both stay up for the life of the process.

The health stream reports each device of ``device_names`` with its health from ``health`` (the
agent's health.monitor.HealthMonitor) every ``health_interval_s``, and at once when
:meth:`KubeletPlugin.health_changed` is called (health_stream.py). readiness_problems() feeds
``/readyz`` (node/probes.py). With ``metrics`` (metrics.DriverMetrics), the DRA servicers count
and time the kubelet's calls.

stop() stops both servers and removes both socket files (the kubelet then deregisters us at
once instead of after two failed 10 s probes).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from dra_driver.plugin import services, sockets
from dra_driver.plugin.dra import ClaimLog, ClaimObserver, Told
from dra_driver.plugin.health_stream import DEFAULT_INTERVAL_S, HealthFeed, HealthStates
from dra_driver.plugin.registration import RegistrationServicer
from dra_driver.prepare import ClaimPreparer

if TYPE_CHECKING:
    from dra_driver.metrics import DriverMetrics

log = logging.getLogger(__name__)


class KubeletPlugin:
    """The registration and DRA services of one node, serving ``preparer``.

    ``registrar_dir``/``plugin_dir``/``pod_uid`` name the sockets (sockets.py); ``pool`` is the
    node's pool name the health stream reports devices in; ``device_names`` gives the devices
    at each report. ``health`` gives each device's health (without it every device is
    reported UNKNOWN). Each claim the DRA services prepared or unprepared is logged once its
    answer is sent (dra.ClaimLog), then told to ``claim_observer`` if one is set before
    ``start`` (node/ gives it claimstatus/'s reporter).
    """

    claim_observer: ClaimObserver | None = None

    def __init__(
        self,
        *,
        preparer: ClaimPreparer,
        driver_name: str,
        pool: str,
        registrar_dir: Path,
        plugin_dir: Path,
        device_names: Callable[[], Sequence[str]],
        pod_uid: str | None = None,
        metrics: DriverMetrics | None = None,
        health: HealthStates | None = None,
        health_interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        self._preparer = preparer
        self.driver_name = driver_name
        self._registrar_dir = registrar_dir
        self._plugin_dir = plugin_dir
        self.paths = sockets.socket_paths(
            registrar_dir=registrar_dir,
            plugin_dir=plugin_dir,
            driver_name=driver_name,
            pod_uid=pod_uid,
        )
        self.metrics = metrics
        self._stopping = threading.Event()
        self._health = HealthFeed(
            pool=pool,
            device_names=device_names,  # the current devices, at each report
            health=health,
            stopping=self._stopping,
            interval_s=health_interval_s,
        )
        self.registration: RegistrationServicer | None = None
        self._told: Told | None = None
        self._dra_server: grpc.Server | None = None
        self._reg_server: grpc.Server | None = None

    def start(self) -> None:
        """Serve dra.sock, then the registration socket. Not re-entrant."""
        self._plugin_dir.mkdir(parents=True, exist_ok=True)
        self._registrar_dir.mkdir(parents=True, exist_ok=True)
        self._told = Told(ClaimLog(self.claim_observer))
        self._dra_server = services.serve_dra(
            preparer=self._preparer,
            metrics=self.metrics,
            health=self._health,
            path=self.paths.dra,
            told=self._told,
        )
        log.info("serving DRA", extra={"socket": str(self.paths.dra)})
        self.registration = RegistrationServicer(
            driver_name=self.driver_name,
            endpoint=str(self.paths.dra),
            versions=services.ADVERTISED_VERSIONS,
        )
        self._reg_server = services.serve_registration(self.registration, self.paths.registration)
        log.info("serving registration", extra={"socket": str(self.paths.registration)})

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving and remove both sockets. Safe to call twice or before start()."""
        self._stopping.set()
        self._health.wake()  # open health streams end now, not at their next report
        for server, path in (
            (self._reg_server, self.paths.registration),
            (self._dra_server, self.paths.dra),
        ):
            if server is not None:
                server.stop(grace_s).wait()
            path.unlink(missing_ok=True)
        self._reg_server = self._dra_server = None
        if self._told is not None:
            self._told.flush()  # the claims of answers whose callbacks the stop cut off

    def health_changed(self) -> None:
        """A device's health or the device list changed: open health streams report now.
        Never blocks."""
        self._health.wake()

    def readiness_problems(self) -> list[str]:
        """Empty once the kubelet registered the plugin; otherwise why not (for ``/readyz``)."""
        if self.registration is None:
            return ["kubelet: the registration socket is not served yet"]
        problem = self.registration.readiness_problem()
        return [] if problem is None else [problem]
