"""A ShareEnforcer for tests: keeps which owners' daemons run and records every call.

It implements the contract of ``shares.ShareEnforcer`` (idempotent acquire and release) with a
set instead of MPS daemons, so tests can check what the preparer asked for and when; it fails
on demand like a daemon that does not come up.
"""

from __future__ import annotations

import threading

from dra_driver.errors import ShareEnforcementFailed


class RecordingEnforcer:
    def __init__(self, *, fail_acquire: bool = False, fail_release: bool = False) -> None:
        self.calls: list[tuple[str, str, frozenset[str]]] = []  # (verb, owner, gpu uuids)
        self.running: dict[str, frozenset[str]] = {}  # owner -> gpu uuids
        self.fail_acquire = fail_acquire
        self.fail_release = fail_release
        self._lock = threading.Lock()

    def acquire(self, *, gpu_uuids: frozenset[str], owner: str) -> None:
        with self._lock:
            self.calls.append(("acquire", owner, gpu_uuids))
            if self.fail_acquire:
                raise ShareEnforcementFailed(f"MPS daemon {owner} did not start")
            self.running[owner] = gpu_uuids

    def release(self, *, gpu_uuids: frozenset[str], owner: str) -> None:
        with self._lock:
            self.calls.append(("release", owner, gpu_uuids))
            if self.fail_release:
                raise ShareEnforcementFailed(f"MPS daemon {owner} did not stop")
            self.running.pop(owner, None)

    def verbs(self) -> list[tuple[str, str]]:
        with self._lock:
            return [(verb, owner) for verb, owner, _ in self.calls]
