"""The background writer of claims' ``status.devices`` entries (KEP-4817).

The DRA servicer tells the reporter, once its answer to the kubelet is sent (plugin/dra.py's
``Told``), which claims were prepared (their devices) and which unprepared; that only queues the
wish and returns, so a slow or failing API server never delays or fails a prepare. One thread
applies the wishes with server-side apply (kube/resourceclaims.py), the latest wish of a claim
replacing any not yet written (a prepare and its unprepare in quick succession write only the
removal). Writes wait for a pause in the kubelet's calls (``quiet_s`` without a new prepare or
unprepare, at most ``max_delay_s``), so that a burst of prepares does not share the CPU with them.
Queuing a wish wakes the writer only when that wish is due before the writer would wake anyway (it
sleeps until the first pending wish is due, or idle): a writer woken by every call took the
interpreter lock from the servicer in the middle of its answer to the kubelet, for nothing, since a
new call only postpones the pending writes (as node/log.py's writer, for the same reason). A claim
unprepared before its entries were written needs no write at all: the reporter knows which claims'
entries may be on the server (those it wrote, and those an earlier agent may have: the claims
prepared when it started), and drops the removal of any other (a pod that came and went within a
burst costs the API server nothing). A failed write is retried after each of ``retry_delays_s``,
then logged as a warning and counted (``gpu_dra_claim_status_writes_total{result="failed"}``); a
claim that is gone needs nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from dra_driver.claimstatus.entries import StatusDevice, status_entries
from dra_driver.errors import KubeError
from dra_driver.gpus.info import Inventory

log = logging.getLogger(__name__)

DEFAULT_RETRY_DELAYS_S = (0.5, 2.0, 8.0)
DEFAULT_QUIET_S = 0.05
DEFAULT_MAX_DELAY_S = 1.0


class StatusClient(Protocol):
    """The one API call the reporter makes (kube.KubeClient has it)."""

    def apply_resource_claim_status(
        self,
        *,
        namespace: str,
        name: str,
        uid: str,
        devices: Sequence[Mapping[str, Any]],
        field_manager: str,
    ) -> bool: ...


@dataclass(frozen=True)
class _Wish:
    namespace: str
    name: str
    uid: str
    devices: tuple[StatusDevice, ...]  # () removes this driver's entries
    attempt: int = 0
    not_before_s: float = 0.0
    queued_s: float = 0.0


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ClaimStatusReporter:
    """Queues and writes claim status; ``prepared``/``unprepared`` never block or raise.

    Thread-safe. ``inventory`` gives the node's GPUs as of the last discovery (for ``data``);
    ``count(result)`` counts a finished write ("ok" or "failed").
    """

    def __init__(
        self,
        *,
        client: StatusClient,
        driver_name: str,
        inventory: Callable[[], Inventory],
        count: Callable[[str], None] = lambda result: None,
        retry_delays_s: Sequence[float] = DEFAULT_RETRY_DELAYS_S,
        quiet_s: float = DEFAULT_QUIET_S,
        max_delay_s: float = DEFAULT_MAX_DELAY_S,
    ) -> None:
        self._client = client
        self._driver = driver_name
        self._inventory = inventory
        self._count = count
        self._delays = tuple(retry_delays_s)
        self._quiet_s = quiet_s
        self._max_delay_s = max_delay_s
        self._last_call_s = 0.0
        self._pending: dict[str, _Wish] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._busy = False
        # the earliest a fresh wish can be due, after its call
        self._first_due_s = min(quiet_s, max_delay_s)
        # when the writer, asleep on _cond, wakes by itself (None: it is not asleep)
        self._asleep_until_s: float | None = None
        self._thread: threading.Thread | None = None
        # uids whose entries may be on the server; None (not started): unknown, so every
        # removal is written
        self._on_server: set[str] | None = None

    # -- the servicer's side --------------------------------------------------------------------

    def prepared(
        self,
        *,
        namespace: str,
        name: str,
        uid: str,
        devices: Sequence[tuple[str, str, str | None]],
    ) -> None:
        """The claim is prepared with ``devices`` ((pool, device, share ID), this driver's):
        write their entries."""
        wanted = tuple(StatusDevice(pool, device, share) for pool, device, share in devices)
        self._queue(namespace, name, uid, wanted)

    def unprepared(
        self,
        *,
        namespace: str,
        name: str,
        uid: str,
        devices: Sequence[tuple[str, str, str | None]] = (),
    ) -> None:
        """The claim is unprepared: remove this driver's entries (whatever ``devices`` it
        held here: an earlier agent may have written entries of a claim this one does not
        know)."""
        self._queue(namespace, name, uid, ())

    def _queue(
        self, namespace: str, name: str, uid: str, devices: tuple[StatusDevice, ...]
    ) -> None:
        now_s = time.monotonic()
        with self._cond:
            self._last_call_s = now_s
            if not devices and self._on_server is not None and uid not in self._on_server:
                self._pending.pop(uid, None)  # its entries were never written: none to remove
                return
            old = self._pending.get(uid)
            queued_s = old.queued_s if old is not None else now_s
            self._pending[uid] = _Wish(namespace, name, uid, devices, queued_s=queued_s)
            # Due at the pause after this call at the earliest (a call only postpones the
            # others): wake the writer only when it sleeps past that (idle, or till a retry).
            asleep_until_s = self._asleep_until_s
            if asleep_until_s is not None and now_s + self._first_due_s < asleep_until_s:
                self._cond.notify_all()  # idle() may wait on it too

    # -- the writer -----------------------------------------------------------------------------

    def start(self, *, written_before: Iterable[str] | None = None) -> None:
        """Start the writer. ``written_before``: the claims whose entries an earlier agent may
        have written (those prepared when this one started; their removal is always written).
        Without it, every removal is written, none known to be needless."""
        if written_before is not None:
            with self._cond:
                self._on_server = set(written_before)
        self._thread = threading.Thread(target=self._run, name="claim-status", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Write what is due now (bounded by ``timeout_s``), then stop; retries left are
        dropped (the next agent writes a claim's status again at its next prepare)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def idle(self, timeout_s: float) -> bool:
        """Wait until nothing is queued or being written (tests, benchmarks)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                wish = self._next_due()
                while wish is None:
                    if self._stopping:
                        return
                    wait_s = self._wait_s()
                    self._asleep_until_s = time.monotonic() + wait_s
                    try:
                        self._cond.wait(wait_s)
                    finally:
                        self._asleep_until_s = None
                    wish = self._next_due()
                if wish.devices and self._on_server is not None:
                    self._on_server.add(wish.uid)  # from now on, it may be on the server
                self._busy = True
            try:
                self._write(wish)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _next_due(self) -> _Wish | None:
        now_s = time.monotonic()
        quiet = now_s - self._last_call_s >= self._quiet_s
        for uid, wish in self._pending.items():
            if self._stopping and wish.attempt == 0:
                return self._pending.pop(uid)
            late = now_s - wish.queued_s >= self._max_delay_s
            if wish.not_before_s <= now_s and (quiet or late):
                return self._pending.pop(uid)
        return None

    def _wait_s(self) -> float:
        if not self._pending:
            return 1.0
        pause_s = self._last_call_s + self._quiet_s
        due = [
            max(w.not_before_s, min(pause_s, w.queued_s + self._max_delay_s))
            for w in self._pending.values()
        ]
        return max(0.005, min(due) - time.monotonic())

    def _write(self, wish: _Wish) -> None:
        try:
            entries = (
                status_entries(
                    driver=self._driver,
                    devices=wish.devices,
                    inventory=self._inventory(),
                    now=_now(),
                )
                if wish.devices
                else []
            )
            self._client.apply_resource_claim_status(
                namespace=wish.namespace,
                name=wish.name,
                uid=wish.uid,
                devices=entries,
                field_manager=self._driver,
            )
        except KubeError as exc:
            self._failed(wish, exc)
            return
        if not wish.devices:
            with self._cond:
                if self._on_server is not None:
                    self._on_server.discard(wish.uid)  # removed (a later prepare adds it back)
        self._count("ok")

    def _failed(self, wish: _Wish, exc: KubeError) -> None:
        if wish.attempt < len(self._delays) and not self._stopping:
            retry = _Wish(
                wish.namespace,
                wish.name,
                wish.uid,
                wish.devices,
                attempt=wish.attempt + 1,
                not_before_s=time.monotonic() + self._delays[wish.attempt],
                queued_s=wish.queued_s,
            )
            with self._cond:
                self._pending.setdefault(wish.uid, retry)  # a newer wish wins
            return
        self._count("failed")
        log.warning(
            "could not write the claim's device status (the claim itself is prepared)",
            extra={
                "claim": f"{wish.namespace}/{wish.name}",
                "uid": wish.uid,
                "error": str(exc),
                "devices": [d.device for d in wish.devices],
            },
        )
