"""Who holds each device: the prepared claims (from the checkpoint), the pods they are reserved
for and those pods' containers that use them, and the last XID of each device.

Place in the flow: telemetry's inputs, read once per sampling pass (sampler.py), never per
scrape. ``holders_from_records`` turns the plugin's checkpoint into device -> claims;
``PodMapper`` reads each (claim, pod) pair once through an injected ``GetPod`` (the node agent
passes the Kubernetes client's Pod GET) and keeps the answer until the claim or its pods change
(prepare, unprepare, a reconcile that finds another pod), as dcgm-exporter's pod mapper labels a
device with the pod and container using it; ``XidHistory`` derives the last XID of each device
from the health watcher's counts (DCGM_FI_DEV_XID_ERRORS).

Pure: no Kubernetes API, no NVML (the Pod GET is injected).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from dra_driver.errors import DraError
from dra_driver.telemetry.model import ClaimHolder, Holders, PodUse, PodUses

if TYPE_CHECKING:
    from dra_driver.prepare.state.checkpointrecords import ClaimRecord

log = logging.getLogger(__name__)

GetPod = Callable[[str, str], Mapping[str, Any] | None]
"""(namespace, name) -> the Pod object, None when there is none; raises DraError when it cannot
be read."""

XidCounts = Callable[[], Mapping[tuple[str, int], int]]
"""(device name, XID) -> events seen since the agent started; from the health watcher."""


def holders_from_records(
    records: Iterable[ClaimRecord], *, pods: Mapping[str, tuple[str, ...]]
) -> dict[str, tuple[ClaimHolder, ...]]:
    """Device name -> holders, from the checkpoint's records (``PrepareCompleted`` only) and the
    pods each claim uid is reserved for. A claim rebuilt without its name shows its uid only."""
    held: dict[str, list[ClaimHolder]] = {}
    for record in records:
        if record.phase != "PrepareCompleted":
            continue
        holder = ClaimHolder(record.namespace, record.name, record.uid, pods.get(record.uid, ()))
        for device in dict.fromkeys(d.device for d in record.devices):
            held.setdefault(device, []).append(holder)
    return {
        device: tuple(sorted(hs, key=lambda h: (h.namespace, h.name, h.uid)))
        for device, hs in held.items()
    }


def claim_containers(pod: Mapping[str, Any], claim_name: str) -> tuple[str, ...]:
    """The containers of ``pod`` that use the ResourceClaim ``claim_name``: the pod names the
    claim in ``spec.resourceClaims`` (``resourceClaimName``) or, for a claim made from a
    template, in ``status.resourceClaimStatuses``; a container uses it when its
    ``resources.claims`` name that entry."""
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    entries = {
        entry.get("name")
        for entry in (
            *(spec.get("resourceClaims") or ()),
            *(status.get("resourceClaimStatuses") or ()),
        )
        if entry.get("resourceClaimName") == claim_name
    }
    return tuple(
        container["name"]
        for container in spec.get("containers") or ()
        if any(
            claim.get("name") in entries
            for claim in (container.get("resources") or {}).get("claims") or ()
        )
    )


class PodMapper:
    """(claim, pod) -> the pod's containers using the claim, read once per pair.

    ``refresh(holders)`` (once per sampling pass) forgets pairs no claim names any more and reads
    the new ones; a pod that cannot be read now is shown without containers and read again at
    the next refresh, and the pods after it wait for that refresh too (one failing GET per pass
    while the API server is unreachable, not one per pod). Not thread-safe: the sampling loop
    calls it.
    """

    def __init__(self, get_pod: GetPod) -> None:
        self._get_pod = get_pod
        self._known: dict[tuple[str, str], PodUse] = {}
        self._failing: set[tuple[str, str]] = set()

    def refresh(self, holders: Holders) -> PodUses:
        wanted = {
            (holder.uid, pod): holder
            for held in holders.values()
            for holder in held
            for pod in holder.pods
        }
        self._known = {key: use for key, use in self._known.items() if key in wanted}
        uses: dict[tuple[str, str], PodUse] = {}
        reachable = True  # after one failed read, the others wait for the next pass
        for key, holder in wanted.items():
            use = self._known.get(key)
            if use is None:
                use = self._read(key, holder) if reachable else None
                reachable = use is not None
            uses[key] = use or PodUse(holder.namespace, key[1], ())
        return uses

    def _read(self, key: tuple[str, str], holder: ClaimHolder) -> PodUse | None:
        """The pod's use of the claim, kept; None when the pod cannot be read now."""
        name = key[1]
        try:
            pod = self._get_pod(holder.namespace, name)
        except DraError as exc:
            if key not in self._failing:
                log.warning(
                    "telemetry: cannot read the pod of a claim; its containers are left out",
                    extra={"pod": f"{holder.namespace}/{name}", "error": str(exc)},
                )
            self._failing.add(key)
            return None
        self._failing.discard(key)
        containers = claim_containers(pod, holder.name) if pod is not None else ()
        use = PodUse(holder.namespace, name, containers)
        self._known[key] = use
        return use


class XidHistory:
    """Per device: the XID events seen in total, and the last XID, from the health watcher's
    running counts per (device, XID). The last XID is the one whose count went up since the
    previous ``update`` (several at once, e.g. between two scrapes: the one seen first of them).
    Thread-safe (scrapes and the sampling loop call it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, int], int] = {}
        self._last: dict[str, int] = {}

    def update(
        self, counts: Mapping[tuple[str, int], int]
    ) -> tuple[dict[str, int], dict[str, int]]:
        """(device -> events in total, device -> last XID) after ``counts``."""
        totals: dict[str, int] = {}
        with self._lock:
            newest: dict[str, int] = {}
            for (device, xid), count in counts.items():
                totals[device] = totals.get(device, 0) + count
                if count > self._seen.get((device, xid), 0):
                    newest.setdefault(device, xid)
            self._last.update(newest)
            self._seen = dict(counts)
            return totals, dict(self._last)


__all__ = [
    "GetPod",
    "PodMapper",
    "XidCounts",
    "XidHistory",
    "claim_containers",
    "holders_from_records",
]
