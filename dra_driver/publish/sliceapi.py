"""What the publisher needs from the API server, and how it retries a failed call.

Place in the flow: publish/publisher.py (the syncer) and publish/watcher.py (the watcher) call the
API server through :class:`SliceApi`, which kube.KubeClient provides (kube/resourceslices.py,
kube/watch.py); both threads wait out a failed call with :class:`Backoff`. Pure (types and the
retry arithmetic; the caller owns the random source).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from dra_driver.resourceapi import JsonDict


class SliceListing(Protocol):
    @property
    def items(self) -> tuple[JsonDict, ...]: ...

    @property
    def resource_version(self) -> str: ...


class SliceEvent(Protocol):
    @property
    def type(self) -> str: ...

    @property
    def object(self) -> JsonDict: ...

    @property
    def resource_version(self) -> str: ...


class SliceWatch(Protocol):
    def __iter__(self) -> Iterator[SliceEvent]: ...

    def close(self) -> None: ...


class SliceApi(Protocol):
    """What the publisher needs from the API (kube.KubeClient provides it)."""

    def list_slices(self, *, driver_name: str, node_name: str) -> SliceListing: ...

    def watch_slices(
        self, *, driver_name: str, node_name: str, resource_version: str, timeout_s: int = ...
    ) -> SliceWatch: ...

    def create_slice(self, body: Mapping[str, Any]) -> JsonDict: ...

    def update_slice(self, body: Mapping[str, Any]) -> JsonDict: ...

    def delete_slice(self, *, name: str, uid: str, resource_version: str) -> bool: ...

    def get_node(self, name: str) -> JsonDict: ...


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter: ``initial_s * factor**(attempt-1)``, capped, +/- jitter."""

    initial_s: float = 0.2
    max_s: float = 30.0
    factor: float = 2.0
    jitter: float = 0.2

    def delay_s(self, attempt: int, rng: random.Random) -> float:
        base = min(self.max_s, self.initial_s * self.factor ** max(0, attempt - 1))
        return base * (1 + self.jitter * (2 * rng.random() - 1))
