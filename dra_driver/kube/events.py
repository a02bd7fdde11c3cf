"""Kubernetes Events on our Node: how the agent reports what an operator must see (a damaged
checkpoint, a prepared device that is gone, adopted claims). prepare/state's PrepareState takes
an :class:`EventReporter`; :func:`node_event_reporter` makes one from the API client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from dra_driver.kube import EventType


class EventReporter(Protocol):
    """Report something as a Kubernetes Event on our Node: (reason, message), a Warning unless
    ``event_type`` says Normal."""

    def __call__(self, reason: str, message: str, *, event_type: EventType = ...) -> None: ...


class NodeEventSink(Protocol):
    """What node_event_reporter needs from kube.KubeClient."""

    def get_node(self, name: str) -> dict[str, Any]: ...

    def create_event(
        self,
        *,
        node_name: str,
        node_uid: str,
        reason: str,
        message: str,
        event_type: EventType = ...,
    ) -> dict[str, Any]: ...


def node_event_reporter(kube: NodeEventSink, *, node_name: str) -> EventReporter:
    """An EventReporter posting Events on ``node_name`` (its UID is looked up once): Warning,
    unless ``event_type`` says Normal."""
    node_uid: list[str] = []

    def report(reason: str, message: str, *, event_type: EventType = "Warning") -> None:
        if not node_uid:
            node_uid.append(str(kube.get_node(node_name)["metadata"].get("uid", "")))
        kube.create_event(
            node_name=node_name,
            node_uid=node_uid[0],
            reason=reason,
            message=message,
            event_type=event_type,
        )

    return report
