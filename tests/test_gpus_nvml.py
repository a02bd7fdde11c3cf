"""Discovery asks NVML (through pynvml) about every GPU and reports facts as NVML states them.

Simulated GPUs stand in for the NVML C library only; pynvml's wrappers and discovery run as in
production. Expected facts come from tests/data/gpu_profiles.json, transcribed separately from
public nvidia-smi output.
"""

from __future__ import annotations

import ctypes.util
import json
import logging
import os
import re
from pathlib import Path

import pynvml
import pytest

from dra_driver.errors import DiscoveryError, NoGpusFound, NvmlLibraryNotFound
from dra_driver.gpus.info import GpuInfo, Inventory
from dra_driver.gpus.nvml import (
    discover,
    library_candidates,
    mig_profile_name,
    normalize_pci_bus_id,
    numa_node,
    pcie_root,
)
from dra_driver.sim.nvml import SimulatedNode, simulated_nvml

DATA = json.loads((Path(__file__).parent / "data" / "gpu_profiles.json").read_text())
PRODUCTS = [key for key in DATA if key not in ("_comment", "lgipp")]
MIG_PRODUCTS = [key for key in PRODUCTS if DATA[key]["lgip"]]
MIB = 1024 * 1024


def run_discovery(spec: str, *, node_name: str = "node-1") -> tuple[Inventory, SimulatedNode]:
    with simulated_nvml(spec, node_name=node_name) as node:
        inventory = discover(driver_root=Path("/nonexistent"), sysfs_root=node.sysfs_root)
    return inventory, node


def parse_lgipp(text: str) -> list[tuple[int, int]]:
    match = re.fullmatch(r"\{([\d,]+)\}:(\d+)", text)
    assert match is not None
    return [(int(start), int(match[2])) for start in match[1].split(",")]


@pytest.mark.parametrize("product", PRODUCTS)
def test_discovery_reports_each_product_as_nvidia_smi_shows_it(product: str) -> None:
    expected = DATA[product]
    inventory, node = run_discovery(f"{product}:2")

    assert inventory.failures == ()
    assert [g.index for g in inventory.gpus] == [0, 1]
    for gpu, simulated in zip(inventory.gpus, node.gpus, strict=True):
        assert gpu.product_name == expected["product_name"]
        assert gpu.brand == expected["brand"]
        assert gpu.architecture == expected["architecture"]
        major, minor = expected["cuda_compute_capability"].split(".")
        assert gpu.cuda_compute_capability == (int(major), int(minor))
        assert gpu.memory_bytes == expected["memory_mib"] * MIB
        assert gpu.driver_version == "570.124.06"
        assert gpu.cuda_driver_version == 12080
        assert gpu.mig_capable == bool(expected["lgip"])
        assert (gpu.mig_enabled, gpu.mig_pending) == (False, False)
        # profiles are read in either MIG mode (as NVIDIA's driver reads them); MIG devices
        # exist only in MIG mode
        assert bool(gpu.mig_profiles) == gpu.mig_capable
        assert gpu.mig_instances == ()
        assert gpu.addressing_mode is None
        assert gpu.numa_node == 0  # two GPUs share one root complex, so one socket
        assert re.fullmatch(
            r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", gpu.uuid
        )
        assert (gpu.uuid, gpu.minor, gpu.pci_bus_id) == (
            simulated.uuid,
            simulated.minor,
            simulated.pci_bus_id,
        )
    assert inventory.gpus[0].uuid != inventory.gpus[1].uuid


@pytest.mark.parametrize("product", MIG_PRODUCTS)
def test_mig_profiles_carry_real_nvml_ids_names_engines_and_placements(product: str) -> None:
    inventory, _ = run_discovery(f"{product}:1:mig")

    (gpu,) = inventory.gpus
    assert (gpu.mig_capable, gpu.mig_enabled, gpu.mig_pending) == (True, True, True)
    found = {p.profile_id: p for p in gpu.mig_profiles}
    rows = DATA[product]["lgip"]
    assert sorted(found) == sorted(row[1] for row in rows)
    for name, pid, instances, gib, sms, dec, enc, ce, jpeg, ofa in rows:
        profile = found[pid]
        assert profile.name == name
        assert profile.instance_count == instances
        assert f"{profile.memory_bytes / 1024**3:.2f}" == gib
        assert (profile.multiprocessors, profile.decoders, profile.encoders) == (sms, dec, enc)
        assert (profile.copy_engines, profile.jpeg_engines, profile.ofa_engines) == (ce, jpeg, ofa)
        assert profile.slice_count == int(name[0])
        placements = [(p.start, p.size) for p in profile.placements]
        assert placements == parse_lgipp(DATA["lgipp"][str(pid)])


def test_existing_mig_instances_are_reported_with_profile_placement_and_uuid() -> None:
    inventory, node = run_discovery("a100-40gb:1:mig=3g.20gb+2g.10gb+1g.5gb+me")

    (gpu,) = inventory.gpus
    instances = sorted(gpu.mig_instances, key=lambda m: m.placement.start)
    assert [(m.profile.name, m.profile.profile_id) for m in instances] == [
        ("3g.20gb", 9),
        ("2g.10gb", 14),
        ("1g.5gb+me", 20),
    ]
    assert [(m.placement.start, m.placement.size) for m in instances] == [(0, 4), (4, 2), (6, 1)]
    assert [m.memory_bytes for m in instances] == [19968 * MIB, 9856 * MIB, 4864 * MIB]
    assert [m.multiprocessors for m in instances] == [42, 28, 14]
    assert all(m.compute_instance_id == 0 for m in instances)
    simulated = {m.uuid: m.gpu_instance_id for m in node.gpus[0].migs}
    assert {m.uuid: m.gpu_instance_id for m in instances} == simulated
    assert all(re.fullmatch(r"MIG-[0-9a-f-]{36}", m.uuid) for m in instances)
    assert len({m.uuid for m in instances}) == 3


def test_mig_enabled_without_instances_reports_profiles_but_no_devices() -> None:
    inventory, _ = run_discovery("h100:1:mig")

    (gpu,) = inventory.gpus
    assert len(gpu.mig_profiles) == 7
    assert gpu.mig_instances == ()


def test_pending_mig_mode_is_reported_and_profiles_read_before_it_applies() -> None:
    inventory, _ = run_discovery("h200:1:mig-pending")

    (gpu,) = inventory.gpus
    assert (gpu.mig_capable, gpu.mig_enabled, gpu.mig_pending) == (True, False, True)
    assert len(gpu.mig_profiles) == 7 and gpu.mig_instances == ()


def _placements_answering(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """nvmlDeviceGetGpuInstancePossiblePlacements answers ``code`` for the 1g.10gb profile
    (id 19); the other profiles answer as the simulated NVML does."""
    real = pynvml.nvmlDeviceGetGpuInstancePossiblePlacements

    def placements(handle: object, profile_id: int, *args: object) -> object:
        if profile_id == 19:
            raise pynvml.NVMLError(code)
        return real(handle, profile_id, *args)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetGpuInstancePossiblePlacements", placements)


def test_a_profile_whose_placements_are_not_supported_is_skipped_as_nvidia_skips_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _placements_answering(monkeypatch, pynvml.NVML_ERROR_NOT_SUPPORTED)
    inventory, _ = run_discovery("h100:1")
    (gpu,) = inventory.gpus
    assert gpu.mig_profiles and all(p.profile_id != 19 for p in gpu.mig_profiles)


def test_profiles_nvml_cannot_read_fail_a_gpu_in_mig_mode_and_leave_one_not_in_it_plain(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _placements_answering(monkeypatch, pynvml.NVML_ERROR_NO_PERMISSION)
    inventory, _ = run_discovery("h100:1,h100:1:mig")
    (plain,) = inventory.gpus
    assert (plain.minor, plain.mig_enabled, plain.mig_profiles) == (0, False, ())
    assert "cannot read the MIG profiles of GPU 0 (not in MIG mode)" in caplog.text
    (failure,) = inventory.failures
    assert failure.index == 1
    assert "nvmlDeviceGetGpuInstancePossiblePlacements failed: Insufficient Permissions" in (
        failure.error
    )


def test_failing_gpu_is_recorded_and_logged_while_the_others_are_returned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="dra_driver.gpus.nvml")

    inventory, node = run_discovery("h100:1,h100:1:fail,l4:1")

    assert [g.index for g in inventory.gpus] == [0, 2]
    assert [g.product_name for g in inventory.gpus] == ["NVIDIA H100 80GB HBM3", "NVIDIA L4"]
    (failure,) = inventory.failures
    assert failure.index == 1
    assert "GPU is lost" in failure.error
    assert "nvmlDevice" in failure.error  # names the NVML call that failed
    assert any("GPU 1" in r.getMessage() for r in caplog.records)
    assert node.library.calls[-1] == "nvmlShutdown"


def test_discovery_runs_pynvml_against_the_library_symbols() -> None:
    _, node = run_discovery("a100-80gb:1:mig=7g.80gb")

    calls = node.library.calls
    assert calls[0] == "nvmlInitWithFlags"
    assert calls[-1] == "nvmlShutdown"
    for symbol in (
        "nvmlDeviceGetCount_v2",
        "nvmlDeviceGetHandleByIndex_v2",
        "nvmlDeviceGetPciInfo_v3",
        "nvmlDeviceGetGpuInstanceProfileInfoV",
        "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
        "nvmlDeviceGetMigDeviceHandleByIndex",
        "nvmlGpuInstanceGetInfo",
        "nvmlDeviceGetAttributes_v2",
    ):
        assert symbol in calls


def test_no_gpus_raises_no_gpus_found_and_still_shuts_nvml_down() -> None:
    with simulated_nvml("l4:0", node_name="empty") as node:
        with pytest.raises(NoGpusFound, match="no GPU"):
            discover(driver_root=Path("/"), sysfs_root=node.sysfs_root)
        assert node.library.calls[-1] == "nvmlShutdown"


def test_pci_bus_id_is_the_lowercase_extended_bdf() -> None:
    inventory, _ = run_discovery("t4:3")

    for gpu in inventory.gpus:
        assert re.fullmatch(r"0000:[0-9a-f]{2}:00\.0", gpu.pci_bus_id)
    assert normalize_pci_bus_id("00000000:1B:00.0") == "0000:1b:00.0"
    assert normalize_pci_bus_id(b"00000001:C3:1F.7") == "0001:c3:1f.7"
    with pytest.raises(DiscoveryError, match="unexpected PCI bus id"):
        normalize_pci_bus_id("1B:00.0")


def test_pcie_root_is_read_from_the_sysfs_tree() -> None:
    inventory, node = run_discovery("h100:4")

    assert [g.pcie_root for g in inventory.gpus] == [g.pcie_root for g in node.gpus]
    # Pairs of GPUs sit behind one root complex, as on HGX boards.
    roots = [g.pcie_root for g in inventory.gpus]
    assert roots[0] == roots[1] and roots[2] == roots[3] and roots[0] != roots[2]


def test_pcie_root_follows_a_kernel_style_symlink(tmp_path: Path) -> None:
    device = tmp_path / "devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:1b:00.0"
    device.mkdir(parents=True)
    links = tmp_path / "bus/pci/devices"
    links.mkdir(parents=True)
    (links / "0000:1b:00.0").symlink_to(
        "../../../devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:1b:00.0"
    )

    assert pcie_root("0000:1b:00.0", sysfs_root=tmp_path) == "pci0000:15"
    assert pcie_root("0000:2c:00.0", sysfs_root=tmp_path) is None


def test_pcie_root_is_unknown_when_sysfs_has_no_entry(tmp_path: Path) -> None:
    with simulated_nvml("l4:1", node_name="n") as node:
        inventory = discover(driver_root=Path("/"), sysfs_root=tmp_path)

    assert inventory.gpus[0].pci_bus_id == node.gpus[0].pci_bus_id
    assert inventory.gpus[0].pcie_root is None


def test_numa_node_is_read_from_the_sysfs_tree() -> None:
    inventory, node = run_discovery("h100:8,l4:1:numa=none,t4:1:numa=5")

    # Ten GPUs behind five root complexes: the first three on NUMA node 0, the other two on
    # node 1 unless the spec pins the node.
    assert [g.numa_node for g in inventory.gpus] == [0] * 6 + [1, 1, None, 5]
    assert [g.numa_node for g in node.gpus] == [0] * 6 + [1, 1, -1, 5]


def test_numa_node_follows_the_bus_symlink_to_the_device_directory(tmp_path: Path) -> None:
    device = tmp_path / "devices/pci0000:15/0000:15:01.0/0000:1b:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text("1\n")
    links = tmp_path / "bus/pci/devices"
    links.mkdir(parents=True)
    (links / "0000:1b:00.0").symlink_to("../../../devices/pci0000:15/0000:15:01.0/0000:1b:00.0")

    assert numa_node("0000:1b:00.0", sysfs_root=tmp_path) == 1


@pytest.mark.parametrize(
    ("content", "logged"),
    [("-1\n", "no NUMA affinity"), ("x\n", "not a NUMA node"), ("", "not a NUMA node"), (None, "")],
)
def test_numa_node_is_none_for_minus_one_garbage_or_a_missing_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str | None, logged: str
) -> None:
    caplog.set_level(logging.INFO, logger="dra_driver.gpus.nvml")
    device = tmp_path / "bus/pci/devices/0000:1b:00.0"
    device.mkdir(parents=True)
    if content is not None:
        (device / "numa_node").write_text(content)

    assert numa_node("0000:1b:00.0", sysfs_root=tmp_path) is None
    assert logged in caplog.text
    assert "0000:1b:00.0" in caplog.text


def test_numa_node_is_unknown_when_sysfs_has_no_entry(tmp_path: Path) -> None:
    with simulated_nvml("h100:2", node_name="n"):
        inventory = discover(driver_root=Path("/"), sysfs_root=tmp_path)

    assert [g.numa_node for g in inventory.gpus] == [None, None]


@pytest.mark.parametrize(("option", "mode"), [("addressing=hmm", "HMM"), ("addressing=ats", "ATS")])
def test_addressing_mode_is_reported_on_coherent_platforms(option: str, mode: str) -> None:
    inventory, _ = run_discovery(f"h100:1:{option}")

    assert inventory.gpus[0].addressing_mode == mode


@pytest.mark.parametrize(
    ("index", "slices", "memory_mib", "gpu_mib", "name"),
    [
        (0, 1, 9984, 81559, "1g.10gb"),
        (7, 1, 4864, 40960, "1g.5gb+me"),
        (9, 1, 20096, 81559, "1g.20gb"),
        (2, 3, 71168, 143771, "3g.71gb"),  # 70.5 rounds half away from zero, as Go does
        (4, 7, 143104, 143771, "7g.141gb"),
        (9, 1, 33280, 143771, "1g.35gb"),  # what a real H200 answered (tests/data/real)
        (4, 7, 143360, 143771, "7g.141gb"),
        (0xD, 1, 23680, 97871, "1g.24gb-me"),
        (0xF, 1, 23680, 97871, "1g.24gb+me.all"),
        (0xA, 1, 23680, 97871, "1g.24gb+gfx"),
    ],
)
def test_mig_profile_names_are_derived_as_nvidias_driver_derives_them(
    index: int, slices: int, memory_mib: int, gpu_mib: int, name: str
) -> None:
    derived = mig_profile_name(
        profile_index=index,
        slice_count=slices,
        memory_mib=memory_mib,
        gpu_memory_bytes=gpu_mib * MIB,
    )
    assert derived == name


def test_simulated_library_is_removed_from_pynvml_after_the_block() -> None:
    before = pynvml.nvmlLib
    with simulated_nvml("t4:1", node_name="outer") as outer:
        assert pynvml.nvmlLib is outer.library
        with simulated_nvml("l4:1", node_name="inner") as inner:
            assert pynvml.nvmlLib is inner.library
            inventory = discover(driver_root=Path("/"), sysfs_root=inner.sysfs_root)
            assert inventory.gpus[0].product_name == "NVIDIA L4"
        assert pynvml.nvmlLib is outer.library
        # pynvml's symbol cache must not keep functions of the inner library.
        inventory = discover(driver_root=Path("/"), sysfs_root=outer.sysfs_root)
        assert inventory.gpus[0].product_name == "Tesla T4"
    assert pynvml.nvmlLib is before
    assert not outer.sysfs_root.exists()


def _system_has_nvml() -> bool:
    return ctypes.util.find_library("nvidia-ml") is not None or any(
        p.exists() for p in library_candidates(Path("/"))
    )


@pytest.mark.skipif(_system_has_nvml(), reason="this machine has a real NVML library")
def test_real_nvml_without_a_driver_raises_library_not_found_naming_the_paths(
    tmp_path: Path,
) -> None:
    assert pynvml.nvmlLib is None
    with pytest.raises(NvmlLibraryNotFound) as caught:
        discover(driver_root=tmp_path)

    message = str(caught.value)
    assert f"NVIDIA_DRIVER_ROOT={tmp_path}" in message
    assert str(tmp_path / "usr/lib64/libnvidia-ml.so.1") in message
    assert str(tmp_path / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1") in message
    assert "--simulate" in message
    assert pynvml.nvmlLib is None


@pytest.mark.skipif(_system_has_nvml(), reason="this machine has a real NVML library")
def test_a_library_file_that_cannot_be_loaded_is_named_in_the_error(tmp_path: Path) -> None:
    broken = tmp_path / "usr/lib64/libnvidia-ml.so.1"
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"not an ELF file")

    with pytest.raises(NvmlLibraryNotFound) as caught:
        discover(driver_root=tmp_path)

    assert f"{broken}: " in str(caught.value)


@pytest.mark.skipif(not _system_has_nvml(), reason="needs a real NVIDIA driver")
def test_real_nvml_discovers_this_machines_gpus() -> None:
    root = Path(os.environ.get("NVIDIA_DRIVER_ROOT", "/"))
    inventory = discover(driver_root=root)

    assert inventory.gpus
    gpu: GpuInfo = inventory.gpus[0]
    assert gpu.uuid.startswith("GPU-")
    assert re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", gpu.pci_bus_id)


def test_gpus_of_one_model_share_their_profile_table_and_other_models_keep_theirs() -> None:
    """The profile table (profiles and placements) read from every GPU in MIG mode is one
    object for equal tables, not a copy per GPU; a GPU of another model keeps its own."""
    model, other_model = MIG_PRODUCTS[-1], MIG_PRODUCTS[0]
    inventory, _ = run_discovery(f"{model}:3:mig")
    first, second, third = (gpu.mig_profiles for gpu in inventory.gpus)
    assert first and first is second is third
    other, _ = run_discovery(f"{other_model}:1:mig")
    assert other.gpus[0].mig_profiles != first
