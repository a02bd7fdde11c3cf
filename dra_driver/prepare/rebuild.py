"""The prepared-claim state rebuilt from the CDI specs on disk, after the checkpoint was lost.

Flow position: plugin/ finds the checkpoint damaged (set aside) -> Preparer.rebuild_from_specs
-> here -> the checkpoint again, then reconcile repairs the rest.
"""

from __future__ import annotations

import logging

from dra_driver import cdi
from dra_driver.errors import CdiError
from dra_driver.prepare.checkpoint import (
    PREPARE_COMPLETED,
    Checkpoint,
    ClaimRecord,
    Claims,
    PreparedDevice,
)
from dra_driver.prepare.plan import parse_share_device_name

log = logging.getLogger("dra_driver.prepare")  # the one logger of prepare, steps included


def rebuild_from_specs(
    specs: cdi.CdiSpecDir,
    checkpoint: Checkpoint,
    *,
    node_name: str,
    cdi_vendor: str,
    booted_at_s: float = 0.0,
) -> int:
    """Record every claim that has a spec of ours on disk; returns how many were added.

    The spec names the claim's devices (and shares), so they stay protected against double
    use. The claim's namespace/name are unknown until the kubelet prepares it again, which then
    fetches the claim and re-answers from scratch (the spec content is deterministic). Specs
    written before ``booted_at_s`` (the node's boot time) are from an earlier boot: nothing is
    prepared after a reboot, so they are left for reconcile to remove. An unreadable spec is
    removed.
    """
    rebuilt: dict[str, ClaimRecord] = {}
    for uid in sorted(specs.claim_uids()):
        try:
            if specs.path_for(uid).stat().st_mtime < booted_at_s:
                continue
        except FileNotFoundError:
            continue
        content = specs.read(uid)
        if content is None:
            continue
        try:
            names = cdi.device_names_in_spec(content, claim_uid=uid)
        except CdiError as exc:
            log.warning(
                "removing an unreadable CDI spec", extra={"claim_uid": uid, "error": str(exc)}
            )
            specs.remove(uid)
            continue
        rebuilt[uid] = ClaimRecord(
            uid=uid,
            namespace="",
            name="",
            phase=PREPARE_COMPLETED,
            devices=tuple(
                PreparedDevice(
                    request_names=(),
                    pool=node_name,
                    device=parse_share_device_name(name)[0],
                    cdi_device_ids=(
                        cdi.cdi_device_id(vendor=cdi_vendor, claim_uid=uid, device_name=name),
                    ),
                    share_id=parse_share_device_name(name)[1],
                )
                for name in names
            ),
        )

    def op(claims: Claims) -> int:
        added = 0
        for uid, record in rebuilt.items():
            if uid not in claims:
                claims[uid] = record
                added += 1
        return added

    return checkpoint.transact(op)
