"""What the local API server holds: the stored objects by (resource, namespace, name), the event
history that watches replay, the injected faults, and the record of each request. Values only;
``server.FakeKubeApi`` changes them under its lock."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

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
