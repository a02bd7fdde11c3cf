"""The MIG instances of prepared claims (dynamic MIG): which instance a device name stands
for, which devices overlap, and creating/destroying them safely.

Flow position: prepare/ -> instance_step.py, modeswitch_step.py -> here -> gpus/migmanager.py
(NVML). With ``--mig-mode=dynamic`` a
MIG-enabled GPU offers every placement of every GPU-instance profile as a device
(``gpu-<minor>-mig-<slug>-<giProfileId>-<start>``, devices.mig_device_name; what is published is
mig/dynamic.py's). Prepare creates the device's GPU instance at its placement and a compute
instance of the full compute profile; unprepare destroys them (docs/plugin.md "Dynamic MIG").

Rules kept here:
- an instance no claim record names was not made by this driver: it is never destroyed, and no
  dynamic device is prepared on its GPU (prepare records the claim ``PrepareStarted`` before it
  creates anything, so every instance the driver makes is named by a record);
- a GPU is not repartitioned while processes run where the change would hit them: no instance
  is created while processes run on the full GPU (outside MIG instances), none is destroyed
  while processes run in it.

The name functions are pure (a placement's DynamicSlot, and every placement of a GPU, are
targets.py's: the devices a claim may be allocated name them); :class:`DynamicMig` does its
NVML through a :class:`MigBackend`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from dra_driver.devices import gpu_device_name, mig_device_name, parse_mig_device_name
from dra_driver.errors import DeviceModelError, ForeignMigInstances, MigFailed
from dra_driver.gpus.info import GpuInfo, MigInstance
from dra_driver.mig.targets import DynamicSlot

if TYPE_CHECKING:  # the NVML side is imported by whoever builds the backend
    from dra_driver.gpus.migmanager import MigSlot
    from dra_driver.mig.modeswitch import MigOffMarks


def slot_of(gpu: GpuInfo, name: str) -> DynamicSlot | None:
    """The slot a dynamic device ``name`` of ``gpu`` stands for; None when it is not one."""
    try:
        minor, profile_id, start, _ = parse_mig_device_name(name)
    except DeviceModelError:
        return None
    if minor != gpu.minor:
        return None
    for profile in gpu.mig_profiles:
        if profile.profile_id == profile_id:
            for placement in profile.placements:
                if placement.start == start:
                    return DynamicSlot(profile, placement)
    return None


def _memory_slices(gpu: GpuInfo, name: str) -> frozenset[int] | None:
    """The memory slices of ``gpu`` the device ``name`` takes (the full GPU: all of them)."""
    if name == gpu_device_name(gpu.minor):
        return frozenset(
            s for p in gpu.mig_profiles for pl in p.placements
            for s in range(pl.start, pl.start + pl.size)
        )  # fmt: skip
    slot = slot_of(gpu, name)
    return None if slot is None else slot.memory_slices


def overlaps(gpu: GpuInfo, wanted: str, held: str) -> bool:
    """Whether two devices of ``gpu`` (dynamic MIG devices, or the full GPU) share memory
    slices, so both cannot be prepared at once. Devices of other GPUs never do."""
    a, b = _memory_slices(gpu, wanted), _memory_slices(gpu, held)
    return a is not None and b is not None and bool(a & b)


def instance_of(slot: DynamicSlot, found: MigSlot) -> MigInstance:
    """The MIG device a created instance is, as discovery would report it."""
    assert found.compute_instance_id is not None and found.uuid is not None
    return MigInstance(
        uuid=found.uuid,
        gpu_instance_id=found.gpu_instance_id,
        compute_instance_id=found.compute_instance_id,
        profile=slot.profile,
        placement=slot.placement,
        memory_bytes=slot.profile.memory_bytes,
        multiprocessors=slot.profile.multiprocessors,
    )


class MigBackend(Protocol):
    """The NVML side (gpus/migmanager.MigManager)."""

    def instances(self, gpu_uuid: str, profile_ids: Iterable[int]) -> tuple[MigSlot, ...]: ...

    def create(
        self, gpu_uuid: str, *, profile_id: int, start: int, size: int, slices: int, name: str
    ) -> tuple[MigSlot, bool]: ...

    def destroy(self, gpu_uuid: str, *, profile_id: int, start: int, name: str) -> bool: ...

    def processes(self, gpu_uuid: str, *, gpu_instance_id: int | None) -> tuple[int, ...]: ...

    def set_mig_mode(self, gpu_uuid: str, enabled: bool, *, why: str) -> None: ...

    def mig_mode(self, gpu_uuid: str) -> tuple[bool, bool]: ...

    def close(self) -> None: ...


class DynamicMig:
    """Creates and destroys the instances of dynamic MIG devices (thread-safe as its backend)."""

    def __init__(self, backend: MigBackend) -> None:
        self.backend = backend

    def existing(self, gpu: GpuInfo) -> dict[str, MigSlot]:
        """Device name -> instance, for every GPU instance of ``gpu`` now (none while the GPU
        is out of MIG mode: taken out for a whole-GPU claim)."""
        return self._in_mig_mode(gpu) or {}

    def _in_mig_mode(self, gpu: GpuInfo) -> dict[str, MigSlot] | None:
        """:meth:`existing`, or None when the GPU is out of MIG mode (one NVML mode query)."""
        if not self.backend.mig_mode(gpu.uuid)[0]:
            return None
        return self._listed(gpu)

    def _listed(self, gpu: GpuInfo) -> dict[str, MigSlot]:
        """Device name -> instance, for a GPU known to be in MIG mode."""
        found = self.backend.instances(gpu.uuid, (p.profile_id for p in gpu.mig_profiles))
        by_id = {p.profile_id: p for p in gpu.mig_profiles}
        return {
            mig_device_name(
                parent_minor=gpu.minor,
                profile=by_id[s.profile_id].name,
                profile_id=s.profile_id,
                placement_start=s.start,
            ): s
            for s in found
        }

    def check_foreign(
        self, gpu: GpuInfo, name: str, *, recorded: Callable[[], frozenset[str]]
    ) -> None:
        """ForeignMigInstances when ``gpu`` has an instance outside ``recorded()`` (read after
        the instances are listed, as in :meth:`create`). Prepare asks before it records the
        claim, so that no record ever names an instance this driver did not create."""
        present = self.existing(gpu)
        self._refuse_foreign(gpu, name, present, recorded())

    @staticmethod
    def _refuse_foreign(
        gpu: GpuInfo, name: str, present: dict[str, MigSlot], owned: frozenset[str]
    ) -> None:
        foreign = tuple(sorted(set(present) - owned))
        if foreign:
            raise ForeignMigInstances(
                f"cannot prepare {name}: GPU {gpu_device_name(gpu.minor)} has MIG instances "
                f"this driver did not create ({', '.join(foreign)}); its MIG devices are not "
                "prepared in dynamic MIG mode until they are removed",
                devices=foreign,
            )

    def create(
        self, gpu: GpuInfo, name: str, *, recorded: Callable[[], frozenset[str]]
    ) -> MigInstance:
        """Create (or complete, or find) the instance of dynamic device ``name``; idempotent.

        ``recorded()``: the device names the claim records name that may own an instance (for
        a new prepare, those of the other claims; for a prepared claim, all of them, its own
        included). It is read after the GPU's instances are listed: a claim is recorded before
        its instance is made, so an instance seen then is named by a record read after. An
        instance outside them was not made by this driver: the GPU is refused (a device that
        exists and no other claim holds included). So is creating one while processes run on
        the full GPU (outside MIG instances).
        """
        slot = slot_of(gpu, name)
        if slot is None:
            raise MigFailed(f"{name} is not a MIG placement of GPU {gpu_device_name(gpu.minor)}")
        listed = self._in_mig_mode(gpu)
        if listed is None:
            raise MigFailed(
                f"cannot create {name}: GPU {gpu_device_name(gpu.minor)} is not in MIG mode (a "
                "claim of the whole GPU holds it, or turning MIG mode on failed)"
            )
        present = listed
        owned = recorded()
        mine = present.get(name)
        if (
            mine is not None
            and name in owned
            and mine.uuid
            and mine.compute_instance_id is not None
        ):
            return instance_of(slot, mine)  # made already: nothing to check or change
        self._refuse_foreign(gpu, name, present, owned)
        if name not in present:
            self._refuse_processes(
                gpu, f"cannot create {name}", "outside MIG instances", "it is not repartitioned"
            )
        found, _ = self.backend.create(
            gpu.uuid,
            profile_id=slot.profile.profile_id,
            start=slot.placement.start,
            size=slot.placement.size,
            slices=slot.profile.slice_count,
            name=name,
        )
        if found.uuid is None or found.compute_instance_id is None:
            raise MigFailed(f"created {name}, but NVML does not list its MIG device")
        return instance_of(slot, found)

    def _refuse_processes(self, gpu: GpuInfo, what: str, where: str, effect: str) -> None:
        """MigFailed (``what``: ...) while NVML lists processes on the full GPU, outside MIG
        instances (``where`` says so in the message, ``effect`` what is not done meanwhile)."""
        pids = self.backend.processes(gpu.uuid, gpu_instance_id=None)
        if pids:
            runs = f"runs processes {where} " if where else "runs processes "
            raise MigFailed(
                f"{what}: GPU {gpu_device_name(gpu.minor)} {runs}"
                f"(PIDs {', '.join(map(str, pids))}); {effect} while they run"
            )

    def destroy(self, gpu: GpuInfo, name: str) -> bool:
        """Destroy the instance of dynamic device ``name`` (a half-made one too); False when
        there is none. Refused (MigFailed) while processes run in it. The caller makes sure a
        record names ``name``: an instance no record names is never passed here."""
        slot = slot_of(gpu, name)
        if slot is None:
            return False
        found = self.existing(gpu).get(name)
        if found is None:
            return False
        pids = self.backend.processes(gpu.uuid, gpu_instance_id=found.gpu_instance_id)
        if pids:
            raise MigFailed(
                f"cannot destroy {name}: processes run in it (PIDs "
                f"{', '.join(map(str, pids))}); it is destroyed once they end"
            )
        return self.backend.destroy(
            gpu.uuid, profile_id=slot.profile.profile_id, start=slot.placement.start, name=name
        )

    def leave_mig_mode(
        self,
        gpu: GpuInfo,
        name: str,
        marks: MigOffMarks,
        *,
        recorded: Callable[[], frozenset[str]],
        turned_on: MigOffMarks | None = None,
    ) -> None:
        """Take ``gpu`` out of MIG mode for its whole-GPU device ``name``; idempotent (a GPU
        already out of MIG mode is left so). Refused (MigFailed) while the GPU has MIG instances
        (ForeignMigInstances for those ``recorded()`` does not name) or runs processes; NVML's
        refusal (a GPU that needs a reset, processes) leaves it in MIG mode. A GPU the
        administrator had in MIG mode gets the mark (mig/modeswitch.py) durably before the mode
        changes; one this driver put into MIG mode (its mark in ``turned_on``) goes back to the
        administrator's mode, off: that mark is removed after the change. A GPU not in MIG mode
        and unmarked is the administrator's, off: nothing to do or mark."""
        current, _ = self.backend.mig_mode(gpu.uuid)
        if current:
            present = self._listed(gpu)
            self._refuse_foreign(gpu, name, present, recorded())
            if present:
                raise MigFailed(
                    f"cannot prepare {name}: GPU {gpu_device_name(gpu.minor)} has MIG devices "
                    f"({', '.join(sorted(present))}); it leaves MIG mode only when it has none"
                )
            self._refuse_processes(gpu, f"cannot prepare {name}", "", "it does not leave MIG mode")
        if turned_on is not None and turned_on.path(gpu.uuid).exists():
            if current:
                self.backend.set_mig_mode(
                    gpu.uuid, False, why=f"taking GPU {gpu_device_name(gpu.minor)} out of MIG mode"
                )
            self._remove_mark(gpu, turned_on)
            return
        if not current:
            return  # out of MIG mode: marked already (a repair pass, a restart), or never on
        try:
            marks.write(gpu)
        except OSError as exc:
            raise MigFailed(
                f"cannot prepare {name}: cannot mark GPU {gpu_device_name(gpu.minor)} as taken "
                f"out of MIG mode ({marks.path(gpu.uuid)}): {exc}"
            ) from exc
        if current:
            self.backend.set_mig_mode(
                gpu.uuid, False, why=f"taking GPU {gpu_device_name(gpu.minor)} out of MIG mode"
            )

    def _remove_mark(self, gpu: GpuInfo, marks: MigOffMarks) -> None:
        try:
            marks.remove(gpu.uuid)
        except OSError as exc:
            raise MigFailed(
                f"GPU {gpu_device_name(gpu.minor)} is back in its MIG mode, but its mark "
                f"{marks.path(gpu.uuid)} cannot be removed: {exc}"
            ) from exc

    def turn_on_for(
        self, gpu: GpuInfo, name: str, *, turned_on: MigOffMarks, taken_out: MigOffMarks
    ) -> bool:
        """Put ``gpu`` into MIG mode for its dynamic device ``name``; idempotent. True when the
        mode changed. A GPU taken out of MIG mode for a whole-GPU claim (its mark in
        ``taken_out``) goes back as :meth:`enter_mig_mode` puts it back. Otherwise its mark in
        ``turned_on`` is written durably before the mode changes, so that whatever a crash
        interrupts, reconcile knows the driver turned it on (mig/ondemand_step.py). MigFailed
        while processes run on the GPU, or when NVML refuses (it stays out of MIG mode)."""
        if self.backend.mig_mode(gpu.uuid)[0]:
            return False
        if taken_out.path(gpu.uuid).exists():
            return self.enter_mig_mode(gpu, taken_out)
        self._refuse_processes(gpu, f"cannot prepare {name}", "", "its MIG mode is not turned on")
        try:
            turned_on.write(gpu)
        except OSError as exc:
            raise MigFailed(
                f"cannot prepare {name}: cannot mark GPU {gpu_device_name(gpu.minor)} as put into "
                f"MIG mode ({turned_on.path(gpu.uuid)}): {exc}"
            ) from exc
        self.backend.set_mig_mode(gpu.uuid, True, why=f"turning MIG mode on for {name}")
        return True

    def turn_off_after(self, gpu: GpuInfo, turned_on: MigOffMarks) -> bool:
        """Take ``gpu``, which this driver put into MIG mode (its mark in ``turned_on``), out
        of MIG mode again and remove the mark; the caller made sure no recorded claim holds a
        MIG device of it. True when the mode changed; False without a mark. MigFailed (the mark
        stays: reconcile tries again) while it has MIG devices or processes run on it, or when
        NVML refuses."""
        if not turned_on.path(gpu.uuid).exists():
            return False
        current, _ = self.backend.mig_mode(gpu.uuid)
        if current:
            present = self._listed(gpu)
            if present:
                raise MigFailed(
                    f"GPU {gpu_device_name(gpu.minor)} stays in MIG mode: it has MIG devices "
                    f"({', '.join(sorted(present))})"
                )
            self._refuse_processes(gpu, "cannot turn its MIG mode off", "", "it stays in MIG mode")
            self.backend.set_mig_mode(
                gpu.uuid,
                False,
                why=f"turning MIG mode off again on GPU {gpu_device_name(gpu.minor)}",
            )
        self._remove_mark(gpu, turned_on)
        return current

    def enter_mig_mode(self, gpu: GpuInfo, marks: MigOffMarks) -> bool:
        """Put ``gpu`` back into MIG mode and remove its mark; idempotent. False when it was in
        MIG mode already. MigFailed while processes run on it (the mark stays: try again)."""
        current, _ = self.backend.mig_mode(gpu.uuid)
        if not current:
            self._refuse_processes(
                gpu, "cannot put it back into MIG mode", "", "it stays out of MIG mode"
            )
            self.backend.set_mig_mode(
                gpu.uuid, True, why=f"putting GPU {gpu_device_name(gpu.minor)} back into MIG mode"
            )
        try:
            marks.remove(gpu.uuid)
        except OSError as exc:
            raise MigFailed(
                f"GPU {gpu_device_name(gpu.minor)} is back in MIG mode, but its mark "
                f"{marks.path(gpu.uuid)} cannot be removed: {exc}"
            ) from exc
        return not current
