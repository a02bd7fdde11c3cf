"""``PrepareState``: the one owner of prepare's state on this node, from open to close.

open() (spec A.3 order, checklist H; node/ opens it before the kubelet plugin serves):
1. find the driver's files under the driver root (once; CDI specs are built from them);
2. open the checkpoint (on the names switchover.py chooses: NVIDIA's, an earlier release's
   shared with its agent, or ours); a damaged one is set aside, reported as a Node Event, and
   the state is rebuilt from the CDI specs on disk;
3. build the Preparer (the steps node/wiring.py gives), adopt NVIDIA's prepared claims, then
   ``reconcile`` repairs leftovers of a crash/reboot;
4. re-run ``reconcile`` periodically (claims deleted from the API, orphaned specs), compact the
   checkpoint and move it to its own name once an earlier release's agent is gone.

It is the ``ClaimPreparer`` the kubelet plugin serves (plugin/kubelet.py): prepare_batch and
unprepare_batch go to its Preparer.

set_inventory() (re-discovery changed the GPUs) swaps what prepare accepts in one step;
prepared claims holding a device that is gone are reported (log, Warning Event
``PreparedDeviceMissing`` on the Node, ``gpu_dra_prepared_devices_missing``). With ``metrics``
(metrics.DriverMetrics), ``nvidia_dra_prepared_devices`` is read from the checkpoint at each
scrape.

close() stops the reconcile loop, lists (or with ``unprepare_on_exit`` unprepares) the claims
left prepared, and closes the checkpoint, moving it to its own name when it is alone on the old.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from dra_driver import cdi
from dra_driver.cdi import hook as cdihook
from dra_driver.errors import CdiError, CheckpointError, DraError, KubeError
from dra_driver.gpus.info import Inventory
from dra_driver.heartbeat import Heartbeat
from dra_driver.kube.events import EventReporter
from dra_driver.prepare.outcome import Outcome
from dra_driver.prepare.plan import ClaimRef, ClaimSource
from dra_driver.prepare.preparer import Preparer
from dra_driver.prepare.repair import Repair
from dra_driver.prepare.state import switchover
from dra_driver.prepare.state.checkpoint import (
    BOOT_ID_PATH,
    PREPARE_COMPLETED,
    Checkpoint,
    ClaimLocks,
    ClaimRecord,
    LoadReport,
    read_boot_id,
    read_state,
)
from dra_driver.prepare.state.instances import Instances
from dra_driver.prepare.state.settings import StateSettings
from dra_driver.prepare.step import StepFactory, no_steps
from dra_driver.prepare.targets import DeviceTarget, TargetsOf, device_targets

if TYPE_CHECKING:
    from dra_driver.metrics import DriverMetrics

log = logging.getLogger(__name__)

DEFAULT_RECONCILE_INTERVAL_S = 60.0
# A reconcile pass GETs every prepared claim, each within the client's timeout: with a black-
# holed API server and many claims a healthy pass can take minutes.
RECONCILE_STALL_S = 1800.0
MIG_MINORS = "driver/nvidia-caps/mig-minors"  # under proc_root, as cdi.find_driver_files reads it


def missing_devices(
    records: Iterable[ClaimRecord], targets: Mapping[str, DeviceTarget]
) -> list[tuple[ClaimRecord, tuple[str, ...]]]:
    """``PrepareCompleted`` claims holding devices this node no longer has (not in ``targets``),
    each with those device names. Pure."""
    missing = []
    for record in records:
        if record.phase != PREPARE_COMPLETED:
            continue
        gone = tuple(sorted({d.device for d in record.devices} - targets.keys()))
        if gone:
            missing.append((record, gone))
    return missing


def prepared_devices_by_type(
    records: Iterable[ClaimRecord], targets: Mapping[str, DeviceTarget]
) -> dict[str, int]:
    """How many of our devices ``PrepareCompleted`` claims hold, as ``{"gpu": n, "mig": m}``
    (both keys always present). A device shared by admin-access claims counts once; a device
    this node no longer has is typed by its name. Pure."""
    held: set[str] = set()
    for record in records:
        if record.phase == PREPARE_COMPLETED:
            held.update(d.device for d in record.devices)
    counts = {"gpu": 0, "mig": 0}
    for name in held:
        target = targets.get(name)
        counts[target.type if target else ("mig" if "-mig-" in name else "gpu")] += 1
    return counts


def recorded_device_names(records: Iterable[ClaimRecord]) -> frozenset[str]:
    """Every device name in the claim records, in either phase (read from the checkpoint, so
    claims another instance recorded count too). In dynamic MIG mode these are the MIG devices
    this driver created or is creating (mig/dynamic.py). Pure."""
    return frozenset(d.device for record in records for d in record.devices)


def recorded_device_names_on_disk(
    checkpoint_path: Path, *, boot_id_path: Path = BOOT_ID_PATH
) -> frozenset[str]:
    """Every device name the checkpoint at ``checkpoint_path`` records, read-only, and those
    the ``checkpoint.json`` beside it records for this boot: NVIDIA's, whose claims the plugin
    adopts when it opens (their MIG devices are then its own), or an earlier release's, shared
    while its agent still runs (switchover.py).

    A missing checkpoint records nothing, and so does one from an earlier boot (the plugin
    discards it; MIG devices that exist now were made since, by someone else). A damaged one
    counts as recording nothing here: the plugin sets it aside and reports it when it opens it,
    and the next discovery pass reads the opened state (:func:`recorded_device_names`).
    """
    own = _own_names(checkpoint_path, boot_id_path=boot_id_path)
    legacy = checkpoint_path.with_name(switchover.LEGACY_NAME)
    if legacy == checkpoint_path:
        return own
    try:
        return own | switchover.recorded_names(legacy, boot_id=read_boot_id(boot_id_path))
    except (DraError, OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("cannot read checkpoint.json before the plugin opens it",
                    extra={"path": str(legacy), "reason": str(exc)})  # fmt: skip
        return own


def _own_names(checkpoint_path: Path, *, boot_id_path: Path) -> frozenset[str]:
    try:
        boot_id, claims = read_state(checkpoint_path)
        if boot_id != read_boot_id(boot_id_path):
            return frozenset()
    except FileNotFoundError:
        return frozenset()
    except (DraError, OSError, ValueError, KeyError) as exc:
        log.warning(
            "cannot read the checkpoint before the plugin opens it; treating no MIG device as "
            "the driver's own until the next discovery pass",
            extra={"path": str(checkpoint_path), "reason": str(exc)},
        )
        return frozenset()
    return frozenset(d.device for record in claims.values() for d in record.devices)


class PrepareState:
    """Prepare's state on one node: checkpoint, claim locks, CDI spec directory and the Preparer
    over them; the ClaimPreparer the kubelet plugin serves.

    ``settings`` say where things are (node/wiring.py fills them from the agent's Config);
    ``steps`` builds the preparer's feature steps (node/wiring.py: none, devices and driver
    files only); ``targets`` makes the devices prepare accepts of an inventory (node/ chooses:
    mig/ has its own under ``--mig-mode=dynamic``). ``claims`` is where ResourceClaims are
    read (kube.KubeClient).
    ``report_event`` posts a Warning Event on the Node (used when the checkpoint was damaged).
    ``metrics``, when given, reads the prepared devices at each scrape. ``proc_root`` and
    ``boot_id_path`` exist so tests can point them at fake files.
    """

    def __init__(
        self,
        *,
        settings: StateSettings,
        inventory: Inventory,
        claims: ClaimSource,
        steps: StepFactory = no_steps,
        targets: TargetsOf = device_targets,
        report_event: EventReporter | None = None,
        metrics: DriverMetrics | None = None,
        proc_root: Path = Path("/proc"),
        boot_id_path: Path = BOOT_ID_PATH,
        reconcile_interval_s: float = DEFAULT_RECONCILE_INTERVAL_S,
    ) -> None:
        self.settings = settings
        self._steps = steps
        self._targets = targets
        self.inventory = inventory
        self._claims = claims
        self._report_event = report_event
        self.metrics = metrics
        self._proc_root = proc_root
        self._reconcile_interval_s = reconcile_interval_s
        self._stopping = threading.Event()
        self._boot_id_path = boot_id_path
        # whether another plugin instance shares the state (a rolling update): instances.py
        self.instances = Instances(settings.plugin_data_dir / "instances.lock")
        self.checkpoint = Checkpoint(
            settings.checkpoint_path, boot_id_path=boot_id_path, instances=self.instances
        )
        self.checkpoint.on_corrupt = self._checkpoint_corrupt
        self.locks = ClaimLocks(settings.plugin_data_dir / "claims.lock", instances=self.instances)
        self.specs = cdi.CdiSpecDir(settings.cdi_root, vendor=settings.cdi_vendor)
        self.preparer: Preparer | None = None
        self.repair: Repair | None = None  # of the preparer, once opened
        self._reconciler: threading.Thread | None = None
        self._rebuild_needed = False
        self.reconcile_heartbeat = Heartbeat("reconcile", stall_s=RECONCILE_STALL_S)
        self._missing_reported: set[tuple[str, str]] = set()  # (claim uid, device)

    # -- lifecycle -------------------------------------------------------------------------

    def open(self) -> None:
        """Open the state, build the Preparer, adopt, recover and reconcile; then reconcile
        periodically. Not re-entrant."""
        cfg = self.settings
        files = self.driver_files()
        cfg.plugin_data_dir.mkdir(parents=True, exist_ok=True)
        files = dataclasses.replace(files, hook_path=self._hook_path())
        log.info(
            "found driver files",
            extra={"driver_root": str(cfg.nvidia_driver_root),
                   "scanned_at": str(cfg.driver_root_in_container), "mounts": len(files.mounts),
                   "dev_root": str(files.dev_root), "cdi_hook": files.hook_path},
        )  # fmt: skip
        if not files.mounts_by_capability.get("compute"):
            log.warning(
                "no CUDA driver library (libcuda.so) found under the driver root: containers "
                "get device nodes but cannot run CUDA programs; check --nvidia-driver-root and "
                "the driver root mount",
                extra={"scanned_at": str(cfg.driver_root_in_container)},
            )
        self.instances.open()  # waits while another instance is solo: before any state
        self.specs.ensure()
        self.locks.open()
        legacy = cfg.plugin_data_dir / switchover.LEGACY_NAME  # NVIDIA's, or an earlier ours
        with switchover.checkpoint_names(legacy, cfg.checkpoint_path) as names:
            if names != self.checkpoint.path:  # shared with an earlier release's agent
                self.checkpoint = Checkpoint(
                    names, boot_id_path=self._boot_id_path, instances=self.instances
                )
                self.checkpoint.on_corrupt = self._checkpoint_corrupt
            stale = switchover.stale_state(legacy, names)
            report = self.checkpoint.open()
        self.preparer = Preparer(
            driver_name=cfg.driver_name,
            node_name=cfg.node_name,
            cdi_vendor=cfg.cdi_vendor,
            targets=self._targets(self.inventory),
            files=files,
            specs=self.specs,
            checkpoint=self.checkpoint,
            locks=self.locks,
            claims=self._claims,
            steps=self._steps,
        )
        self.repair = Repair(self.preparer)
        self._adopt(legacy, stale)
        self._recover(report)
        self._report_missing_devices()
        if self.metrics is not None:
            self.metrics.prepared_devices.set_collector(self._prepared_devices)
            self.metrics.prepared_devices_missing.set_collector(self._missing_devices)
        if self.checkpoint.path == cfg.checkpoint_path:  # no earlier release's agent beside us
            self.instances.allow_solo()
        self._reconciler = threading.Thread(
            target=self._reconcile_loop, name="reconcile", daemon=True
        )
        self._reconciler.start()

    def close(self) -> None:
        """Stop reconciling, leave the prepared claims as the settings say, close the files.
        Safe to call twice or before open(); call it once nothing is served any more."""
        self._stopping.set()
        if self._reconciler is not None:
            self._reconciler.join(timeout=5)
            self._reconciler = None
        if self.preparer is not None:
            self._leave_prepared_claims()
            self.preparer.close()
        self.specs.close()
        self.checkpoint.close()
        if self.checkpoint.path != self.settings.checkpoint_path:  # alone now? then move
            switchover.migrate_own_checkpoint(self.checkpoint.path, self.settings.checkpoint_path)
        self.locks.close()
        self.instances.close()

    # -- the ClaimPreparer the kubelet plugin serves -------------------------------------

    def prepare_batch(self, refs: Sequence[ClaimRef]) -> dict[str, Outcome]:
        """Prepare.prepare_batch; only after open()."""
        assert self.preparer is not None
        return self.preparer.prepare_batch(refs)

    def unprepare_batch(self, refs: Sequence[ClaimRef]) -> dict[str, Outcome]:
        """Prepare.unprepare_batch; only after open()."""
        assert self.preparer is not None
        return self.preparer.unprepare_batch(refs)

    def device_names(self) -> list[str]:
        """The devices prepare accepts now, sorted (the health stream's list); empty before
        open()."""
        return [] if self.preparer is None else sorted(self.preparer.targets)

    def set_inventory(self, inventory: Inventory) -> None:
        """Make ``inventory`` (a re-discovery's) what prepare accepts.

        The devices, their device nodes and the MIG capability minors (read again: a driver
        reload renumbers them) are built first and swapped into the preparer in one step, so a
        prepare sees the old devices or the new ones, never a mix. Prepared claims holding a
        device that is gone now are reported. Before open() only the inventory is kept. Raises
        CdiError when the capability table cannot be read; the previous devices then stay.
        Called from one thread (the agent's re-discovery).
        """
        if self.preparer is None:
            self.inventory = inventory
            return
        minors = cdi.read_mig_cap_minors(self._proc_root / MIG_MINORS)
        files = replace(self.preparer.files, mig_cap_minors=minors)
        self.preparer.set_targets(self._targets(inventory), files)
        self.inventory = inventory
        self._report_missing_devices()

    @property
    def heartbeats(self) -> tuple[Heartbeat, ...]:
        """The state's background loop, for ``/healthz``."""
        return (self.reconcile_heartbeat,)

    # -- steps -----------------------------------------------------------------------------

    def _report_missing_devices(self) -> None:
        """Log and post an Event for each prepared claim that newly holds a device this node no
        longer has (its containers lose that device; unprepare still works)."""
        assert self.preparer is not None
        missing = missing_devices(self.checkpoint.snapshot().values(), self.preparer.targets)
        now = {(record.uid, name) for record, names in missing for name in names}
        for record, names in missing:
            new = [n for n in names if (record.uid, n) not in self._missing_reported]
            if not new:
                continue
            claim = f"{record.namespace}/{record.name}" if record.namespace else record.uid
            log.warning(
                "a prepared claim holds devices this node no longer has",
                extra={"claim_uid": record.uid, "claim": claim, "devices": new},
            )
            self._post_event(
                "PreparedDeviceMissing",
                f"ResourceClaim {claim} (UID {record.uid}) is prepared with "
                f"{', '.join(new)}, which this node no longer has (GPUs re-discovered); its "
                "containers cannot use it. Unpreparing the claim still works.",
            )
        self._missing_reported = now

    def _missing_devices(self) -> dict[tuple[str, ...], float]:
        """``gpu_dra_prepared_devices_missing`` at scrape time: (node, driver) -> n."""
        assert self.preparer is not None
        records = self.checkpoint.snapshot().values()
        names = {
            name for _, gone in missing_devices(records, self.preparer.targets) for name in gone
        }
        return {(self.settings.node_name, self.settings.driver_name): float(len(names))}

    def _post_event(self, reason: str, message: str) -> None:
        if self._report_event is None:
            return
        try:
            self._report_event(reason, message)
        except KubeError as exc:
            log.warning(
                "cannot post an Event on the Node", extra={"reason": reason, "error": str(exc)}
            )

    def driver_files(self) -> cdi.DriverFiles:
        """The driver install's files and device nodes, scanned where this process sees the
        install and named in specs as the host sees it (without the CDI hook)."""
        cfg = self.settings
        driver_version = self.inventory.gpus[0].driver_version if self.inventory.gpus else None
        files = cdi.find_driver_files(
            driver_root=cfg.driver_root_in_container,
            host_driver_root=cfg.nvidia_driver_root,
            driver_version=driver_version,
            proc_root=self._proc_root,
        )
        if cfg.simulated_gpus and files.dev_root_here == Path("/"):
            # simulated GPUs, the node's own /dev: no nodes made (PluginSettings.simulated_gpus)
            files = dataclasses.replace(files, dev_root_here=None)
        return files

    def _hook_path(self) -> str | None:
        """The host path of the CDI hook the specs name (installs the builtin one)."""
        hook = self.settings.cdi_hook
        if hook == cdihook.NONE:
            return None
        if hook == cdihook.BUILTIN:
            return str(cdihook.install(self.settings.hook_dir))
        return hook  # a host path we cannot see from here: taken as given

    def _leave_prepared_claims(self) -> None:
        """At a clean stop: list the claims left prepared (NVIDIA's plugin, should the node
        switch back, does not know them: docs/migration.md), or with ``unprepare_on_exit``
        unprepare every one of them. A failure is logged; the stop goes on."""
        assert self.preparer is not None
        try:
            records = self.checkpoint.snapshot()
        except CheckpointError as exc:
            log.warning("cannot read the prepared claims at stop", extra={"error": str(exc)})
            return
        if not records:
            return
        if not self.settings.unprepare_on_exit:
            log.info(
                "claims left prepared at stop (the next start keeps them)",
                extra={"claims": len(records),
                       "cdi_specs": [str(self.specs.path_for(u)) for u in sorted(records)[:50]]},
            )  # fmt: skip
            return
        for uid, record in sorted(records.items()):
            try:
                self.preparer.unprepare(
                    ClaimRef(namespace=record.namespace, name=record.name, uid=uid)
                )
            except DraError as exc:
                log.error(
                    "cannot unprepare a claim at exit; remove what is left by hand",
                    extra={"claim_uid": uid, "error": str(exc)},
                )
        log.info("unprepared every claim at exit (--unprepare-on-exit)",
                 extra={"claims": sorted(records)})  # fmt: skip

    def _adopt(self, legacy: Path, stale: tuple[dict[str, ClaimRecord], Path | None]) -> None:
        """Take over the claims NVIDIA's driver prepared (prepare/switchover.py), before the
        first reconcile rolls back its half-done ones; ``stale``: our own state, set aside."""
        assert self.preparer is not None
        adoption = switchover.adopt_nvidia_checkpoint(
            legacy,
            checkpoint=self.checkpoint,
            specs=self.specs,
            targets=self.preparer.targets,
            driver_name=self.settings.driver_name,
            node_name=self.settings.node_name,
            cdi_vendor=self.settings.cdi_vendor,
            steps=self.preparer.steps,
            stale=stale[0],
            stale_moved_to=stale[1],
        )
        if adoption.found and self._report_event is not None:
            try:
                self._report_event(
                    "NvidiaCheckpointAdopted", adoption.message(), event_type="Normal"
                )
            except KubeError as exc:
                log.warning("cannot post the adoption Event", extra={"error": str(exc)})

    def _recover(self, report: LoadReport) -> None:
        assert self.repair is not None
        if report.corrupt_moved_to is not None:
            rebuilt = self.repair.rebuild_from_specs(booted_at_s=self._booted_at_s())
            log.warning(
                "rebuilt the prepared-claim state from the CDI specs on disk",
                extra={"claims": rebuilt},
            )
        if report.discarded_after_reboot:
            log.info(
                "the node rebooted since the last checkpoint: prepared claims were dropped",
                extra={"claims": report.discarded_after_reboot},
            )
        done = self.repair.reconcile()
        log.info("reconciled prepared claims at start", extra=done)

    def _prepared_devices(self) -> dict[tuple[str, ...], float]:
        """``nvidia_dra_prepared_devices`` at scrape time: (node, driver, device_type) -> n."""
        assert self.preparer is not None
        cfg = self.settings
        return {
            (cfg.node_name, cfg.driver_name, device_type): float(n)
            for device_type, n in prepared_devices_by_type(
                self.checkpoint.snapshot().values(), self.preparer.targets
            ).items()
        }

    def _booted_at_s(self) -> float:
        """When the node booted (0 when <proc>/uptime cannot be read: trust every spec)."""
        try:
            uptime_s = float((self._proc_root / "uptime").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 0.0
        return time.time() - uptime_s

    def _checkpoint_corrupt(self, moved_to: Path, reason: str) -> None:
        # A damaged checkpoint found later (written by another instance) is rebuilt too.
        if self.preparer is not None and self._reconciler is not None:
            self._rebuild_needed = True
        message = (
            f"The DRA plugin's checkpoint {self.settings.checkpoint_path} was damaged ({reason}); "
            f"it was moved to {moved_to.name} and the state is rebuilt from the CDI specs."
        )
        if self._report_event is None:
            return
        try:
            self._report_event("CheckpointCorrupt", message)
        except KubeError as exc:
            log.warning("cannot post the checkpoint Event", extra={"error": str(exc)})

    def _reconcile_loop(self) -> None:
        beat = self.reconcile_heartbeat
        with beat.running():
            while not self._stopping.wait(self._reconcile_interval_s):
                with beat.busy():
                    self._reconcile_pass()

    def _relocate_checkpoint(self) -> None:
        """On the old names while an earlier release's agent shared them (a rolling update):
        move to our own once it is gone (prepare/switchover.py)."""
        target = self.settings.checkpoint_path
        if self.checkpoint.path != target and self.checkpoint.relocate(
            target, alone=switchover.sole_user
        ):
            legacy = self.settings.plugin_data_dir / switchover.LEGACY_NAME
            legacy.with_suffix(".lock").unlink(missing_ok=True)
            self.instances.allow_solo()
            log.info(
                "the earlier release's agent is gone: moved the checkpoint to its own name",
                extra={"path": str(target)},
            )

    def _reconcile_pass(self) -> None:
        assert self.preparer is not None and self.repair is not None
        try:
            if self._rebuild_needed:
                self._rebuild_needed = False
                self.repair.rebuild_from_specs(booted_at_s=self._booted_at_s())
            done = self.repair.reconcile()
            self.checkpoint.compact()  # off the prepare path
            self._relocate_checkpoint()
        except (CdiError, CheckpointError, KubeError, OSError) as exc:
            log.warning("reconcile failed; will retry", extra={"error": str(exc)})
            return
        except Exception:  # the repair loop must outlive a bug in one pass
            log.exception("reconcile failed unexpectedly; will retry")
            return
        if any(done.values()):
            log.info("reconciled prepared claims", extra=done)
