"""What the local API server holds: the stored objects by (resource, namespace, name), the event
history that watches replay, the injected faults, and the record of each request. Values only;
``server.FakeKubeApi`` changes them under its lock."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from dra_driver.sim.localapi.resources import JsonDict


class Request(NamedTuple):
    """One logged request. ``verb`` is the Kubernetes verb (get/list/watch/create/...)."""

    verb: str
    resource: str
    namespace: str
    name: str


@dataclass
class Fault:
    """An injected answer to one (verb, resource)."""

    status: int
    message: str
    times: int | None  # None = until cleared
    body: bytes | None = None  # sent as it is, in place of a Status object (answer_raw)
    name: str = ""  # only for this object ("": any)


@dataclass
class Event:
    """One change of a stored object, as a watch sends it."""

    rv: int
    resource: str
    type: str
    obj: JsonDict


@dataclass
class State:
    """The stored objects (v1 shape), their history since the last compaction, and the latest
    resourceVersion."""

    objects: dict[tuple[str, str, str], JsonDict] = field(default_factory=dict)
    history: list[Event] = field(default_factory=list)
    rv: int = 100
    compacted_rv: int = 0


class ServedApi(Protocol):
    """What the request handler (handler.py) and the router (routing.py) use of the server they
    serve: server.FakeKubeApi, which binds a handler class to itself at start. Named here, beside
    the state it holds, so that neither needs server.py, which imports them."""

    token: str | None
    validate: bool
    device_status: bool
    get_latency_s: float
    get_seconds: list[float]
    requests: list[Request]
    connections_accepted: int
    _state: State
    _cond: threading.Condition
    _connections: set[socket.socket]
    _closing: bool
    _send_s: float
    _status_owners: dict[tuple[str, str, str], dict[tuple[str, str, str, str], str]]

    @property
    def served_versions(self) -> tuple[str, ...]: ...

    def resources_served(self, version: str) -> tuple[str, ...]: ...

    def _store(
        self, resource: str, key: tuple[str, str, str], obj: JsonDict, kind: str
    ) -> None: ...

    def _remove(self, key: tuple[str, str, str]) -> JsonDict: ...

    def _take_fault(self, verb: str, resource: str, name: str = "") -> Fault | None: ...

    def _drop(self, obj: JsonDict) -> None: ...
