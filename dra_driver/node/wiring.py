"""Which prepare steps this node runs, and the kubelet plugin that serves them, built from the
agent's Config.

Flow position: node/agent.py -> here -> nodeplugin.NodePlugin: prepare.PrepareState (given its
settings, a step factory and what the node's devices are as targets: :func:`config_targets`, or
the agent's mig.dynamic.ManagedMig.targets; it builds the prepare.Preparer, which calls the
factory with what the steps may read of it), served by plugin.kubelet.KubeletPlugin.

The steps, in prepare order (the preparer undoes them in reverse): the whole-GPU MIG-mode
switch, MIG mode on demand and dynamic MIG instances (``--mig-mode=dynamic`` only: a device's
instance exists before anything runs on it), time slicing, MPS, consumable shares. A new
feature is one step module in its package and one line in :func:`prepare_steps`.

The modules of dynamic MIG and of the MPS daemons are imported where those are built, so an
agent without them does not hold their code: about 110 KB of its memory in static MIG mode (the
chart's default), 60 KB more without ``--mps-image`` (docs/benchmarks.md, "Memory after the
restructuring"). The steps that refuse what this node does not run (MPS, shares) are always
built.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dra_driver.kube.events import EventReporter
from dra_driver.node.nodeplugin import NodePlugin
from dra_driver.plugin.health_stream import HealthStates
from dra_driver.plugin.kubelet import KubeletPlugin
from dra_driver.prepare import (
    BOOT_ID_PATH,
    DEFAULT_RECONCILE_INTERVAL_S,
    ClaimSource,
    NodeState,
    PrepareState,
    StateSettings,
    Step,
    StepFactory,
    TargetsOf,
    device_targets,
)
from dra_driver.sharing import shares
from dra_driver.sharing.mps_step import NVIDIA_NAMESPACE, MpsStep
from dra_driver.sharing.share_step import ShareStep, device_by_uuid
from dra_driver.sharing.timeslice import NvidiaSmi, TimeSlicer
from dra_driver.sharing.timeslice_step import TimeSliceStep

if TYPE_CHECKING:
    from dra_driver.gpus.info import Inventory
    from dra_driver.metrics import DriverMetrics
    from dra_driver.mig.instances import DynamicMig
    from dra_driver.node.config import Config
    from dra_driver.sharing.mpsdaemon import DeploymentApi, MpsDaemons


def prepare_steps(
    *,
    timeslicer: TimeSlicer | None = None,
    mps_daemons: MpsDaemons | None = None,
    consumable_shares: shares.SharesMode = shares.DISABLED,
    share_enforcer: shares.ShareEnforcer | None = None,
    mig: DynamicMig | None = None,
    deployments: DeploymentApi | None = None,
    nvidia_namespace: str = NVIDIA_NAMESPACE,
) -> StepFactory:
    """The step factory of a node with these features (None: claims asking for it are
    refused; ``mig`` None: static MIG, no MIG step). Without an enforcer, shares are enforced
    by ``mps_daemons`` (one shared MPS daemon per device). ``deployments`` and
    ``nvidia_namespace``: where the MPS daemons NVIDIA's driver started for adopted claims are
    deleted."""

    def build(node: NodeState) -> list[Step]:
        steps: list[Step] = [] if mig is None else _dynamic_mig_steps(node, mig)
        enforcer = share_enforcer
        if enforcer is None and mps_daemons is not None:
            from dra_driver.sharing.mpsshares import MpsShareEnforcer  # noqa: PLC0415

            enforcer = MpsShareEnforcer(mps_daemons, device_by_uuid(node))
        share = ShareStep(
            node,
            mode=consumable_shares,
            enforcer=enforcer,
            mps_base=None if mps_daemons is None else mps_daemons.base,
        )
        steps += [
            TimeSliceStep(node, timeslicer),
            MpsStep(
                node,
                mps_daemons,
                keep=share.owners,
                deployments=deployments,
                nvidia_namespace=nvidia_namespace,
            ),
            share,
        ]
        return steps

    return build


def _dynamic_mig_steps(node: NodeState, mig: DynamicMig) -> list[Step]:
    """Dynamic MIG's steps, in prepare order: the whole-GPU MIG-mode switch, MIG mode on demand
    for placements (one lock for both: one mode change at a time), then the MIG instances."""
    import threading  # noqa: PLC0415

    from dra_driver.mig import ondemand_step  # noqa: PLC0415
    from dra_driver.mig.instance_step import MigInstanceStep  # noqa: PLC0415
    from dra_driver.mig.modeswitch import MARKS_DIRECTORY, MigOffMarks  # noqa: PLC0415
    from dra_driver.mig.modeswitch_step import MigModeStep  # noqa: PLC0415

    marks = MigOffMarks(node.state_dir / MARKS_DIRECTORY)
    turned_on = MigOffMarks(node.state_dir / ondemand_step.MARKS_DIRECTORY)
    lock = threading.Lock()
    return [
        MigModeStep(node, mig, marks=marks, turned_on=turned_on, lock=lock),
        ondemand_step.MigOnDemandStep(node, mig, turned_on=turned_on, taken_out=marks, lock=lock),
        MigInstanceStep(node, mig),
    ]


def mps_daemons(config: Config, deployments: DeploymentApi | None) -> MpsDaemons | None:
    """The MPS control daemons of this node (None without an image or API access: MPS
    claims are then refused)."""
    if config.mps_image is None or deployments is None:
        return None
    from dra_driver.sharing.mpsdaemon import MpsDaemons  # noqa: PLC0415

    return MpsDaemons(
        api=deployments,
        namespace=config.pod_namespace,
        node_name=config.node_name,
        driver_name=config.driver_name,
        image=config.mps_image,
        image_pull_secrets=config.mps_image_pull_secrets,
        image_pull_policy=config.mps_image_pull_policy,
        base=config.mps_dir,
        driver_root=config.driver_root_in_container,
        host_driver_root=config.nvidia_driver_root,
        start_timeout_s=config.mps_start_timeout_s,
    )


def config_steps(
    config: Config,
    *,
    deployments: DeploymentApi | None = None,
    share_enforcer: shares.ShareEnforcer | None = None,
) -> StepFactory:
    """The steps ``config`` asks for. NVML's MIG session (dynamic MIG) is opened when the
    preparer is built, at the plugin's start, and closed with it."""

    def build(node: NodeState) -> Sequence[Step]:
        mig = None
        if config.mig_mode == "dynamic":
            from dra_driver.gpus.migmanager import MigManager  # noqa: PLC0415  (NVML: only then)
            from dra_driver.mig.instances import DynamicMig  # noqa: PLC0415

            mig = DynamicMig(MigManager())
        return prepare_steps(
            # run from the agent's view of the driver root, as the files were scanned
            timeslicer=NvidiaSmi(config.driver_root_in_container),
            mps_daemons=mps_daemons(config, deployments),
            consumable_shares=config.shares_mode,
            share_enforcer=share_enforcer,
            mig=mig,
            deployments=deployments,  # NVIDIA's MPS daemons of adopted claims, image or not
            nvidia_namespace=config.nvidia_namespace,
        )(node)

    return build


def state_settings(config: Config) -> StateSettings:
    """What prepare's state needs of ``config``."""
    return StateSettings(
        node_name=config.node_name,
        driver_name=config.driver_name,
        cdi_vendor=config.cdi_vendor,
        nvidia_driver_root=config.nvidia_driver_root,
        driver_root_in_container=config.driver_root_in_container,
        plugin_data_dir=config.plugin_data_dir,
        checkpoint_path=config.checkpoint_path,
        cdi_root=config.cdi_root,
        cdi_hook=config.cdi_hook,
        hook_dir=config.hook_dir,
        unprepare_on_exit=config.unprepare_on_exit,
        simulated_gpus=config.simulate is not None,
    )


def config_targets(config: Config) -> TargetsOf:
    """The devices prepare accepts of an inventory under ``config``'s ``--mig-mode`` (dynamic:
    mig/'s, with no GPU left static; the agent hands its mig.dynamic.ManagedMig's instead)."""
    if config.mig_mode == "static":
        return device_targets
    from dra_driver.mig.targets import dynamic_targets  # noqa: PLC0415

    return dynamic_targets


def kubelet_plugin(
    *,
    config: Config,
    inventory: Inventory,
    claims: ClaimSource,
    targets: TargetsOf | None = None,
    deployments: DeploymentApi | None = None,
    share_enforcer: shares.ShareEnforcer | None = None,
    report_event: EventReporter | None = None,
    metrics: DriverMetrics | None = None,
    health: HealthStates | None = None,
    proc_root: Path = Path("/proc"),
    boot_id_path: Path = BOOT_ID_PATH,
    health_interval_s: float | None = None,
    reconcile_interval_s: float = DEFAULT_RECONCILE_INTERVAL_S,
) -> NodePlugin:
    """Prepare's state of ``config``, its settings and steps wired, and the kubelet plugin that
    serves it (``targets``: the devices prepare accepts of an inventory, by default
    :func:`config_targets`; ``deployments``: the API the MPS daemons are Deployments in;
    ``share_enforcer``: instead of MPS's; ``health_interval_s``: tests only, instead of
    ``--health-report-interval``); the rest as PrepareState and KubeletPlugin take it.
    Raises ConfigError when a socket path cannot be made short enough."""
    state = PrepareState(
        settings=state_settings(config),
        inventory=inventory,
        claims=claims,
        steps=config_steps(config, deployments=deployments, share_enforcer=share_enforcer),
        targets=config_targets(config) if targets is None else targets,
        report_event=report_event,
        metrics=metrics,
        proc_root=proc_root,
        boot_id_path=boot_id_path,
        reconcile_interval_s=reconcile_interval_s,
    )
    kubelet = KubeletPlugin(
        preparer=state,
        driver_name=config.driver_name,
        pool=config.node_name,
        registrar_dir=config.kubelet_registrar_directory_path,
        plugin_dir=config.plugin_data_dir,
        pod_uid=config.pod_uid,
        device_names=state.device_names,
        metrics=metrics,
        health=health,
        health_interval_s=(
            config.health_report_interval_s if health_interval_s is None else health_interval_s
        ),
    )
    return NodePlugin(state=state, kubelet=kubelet)
