"""The ``pluginregistration.Registration`` service the kubelet's plugin watcher calls (spec A).

GetInfo answers constants at once (the kubelet allows 1 s, and re-asks every 10 s for the
plugin's whole life). NotifyRegistrationStatus tells us whether the kubelet accepted us; a
refusal is logged with the kubelet's reason, which is the only place that reason shows up.
Until the kubelet said it registered us the agent is not ready (``/readyz``): during a rolling
update the new pod must not count as available before the kubelet can call it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from dra_driver._proto.pluginregistration_v1 import api_pb2 as reg_pb2
from dra_driver._proto.pluginregistration_v1 import api_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

DRA_PLUGIN_TYPE = "DRAPlugin"
# The kubelet takes the first entry it knows, in our order: v1 first (spec A.4).
DRA_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
# The health service is chosen apart from those: a 1.37+ kubelet picks v1 whenever it is listed
# (its TestPickHealthService), 1.34 to 1.36 know only v1alpha1 and skip the entry they do not
# know (spec A.4). Both are served on dra.sock (health_stream.py).
HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")


class RegistrationServicer(reg_grpc.RegistrationServicer):
    def __init__(self, *, driver_name: str, endpoint: str, versions: Sequence[str]) -> None:
        self._info = reg_pb2.PluginInfo(
            type=DRA_PLUGIN_TYPE,
            name=driver_name,
            endpoint=endpoint,
            supported_versions=list(versions),
        )
        self._lock = threading.Lock()
        self.registered = threading.Event()
        self.last_error = ""

    def GetInfo(self, request: reg_pb2.InfoRequest, context: object) -> reg_pb2.PluginInfo:  # noqa: N802
        return self._info

    def readiness_problem(self) -> str | None:
        """None once the kubelet's last NotifyRegistrationStatus said ``plugin_registered``;
        otherwise why we are not registered (never told yet, or refused with a reason)."""
        with self._lock:
            if self.registered.is_set():
                return None
            if self.last_error:
                return f"kubelet refused the plugin registration: {self.last_error}"
            return "kubelet has not registered the plugin yet (no NotifyRegistrationStatus)"

    def NotifyRegistrationStatus(  # noqa: N802
        self, request: reg_pb2.RegistrationStatus, context: object
    ) -> reg_pb2.RegistrationStatusResponse:
        with self._lock:
            if request.plugin_registered:
                self.last_error = ""
                self.registered.set()
                log.info(
                    "kubelet registered the plugin",
                    extra={"driver": self._info.name, "endpoint": self._info.endpoint},
                )
            else:
                self.last_error = request.error
                self.registered.clear()
                log.error(
                    "kubelet REFUSED the plugin registration",
                    extra={
                        "driver": self._info.name,
                        "endpoint": self._info.endpoint,
                        "supported_versions": list(self._info.supported_versions),
                        "kubelet_error": request.error,
                    },
                )
        return reg_pb2.RegistrationStatusResponse()
