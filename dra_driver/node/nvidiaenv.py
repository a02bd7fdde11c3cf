"""NVIDIA's kubelet-plugin environment, read as NVIDIA's driver reads it (pure; used by cli.py).

A pod spec written for NVIDIA's DRA driver (k8s-dra-driver-gpu v0.5, its chart's
``kubeletplugin.yaml``) sets variables of NVIDIA's names. This module turns them into the agent's
own settings, so such a pod spec runs this agent unchanged: aliases of our variables
(``HOST_DRIVER_ROOT``, ``DRIVER_ROOT_CTR_PATH``, ``NAMESPACE``, ``IMAGE_NAME``,
``NVIDIA_CDI_HOOK_PATH``), ``ADDITIONAL_XIDS_TO_IGNORE`` (added to the ignored XIDs, as NVIDIA
adds it to its built-in list), ``FEATURE_GATES`` (Kubernetes' ``Name=true,Other=false`` form)
and ``LOG_VERBOSITY`` (klog's -v). Our own variable wins where both are set to the same effect;
where they contradict, the start fails with both names. docs/migration.md has the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from dra_driver.errors import ConfigError
from dra_driver.health.decisions import parse_xids

# NVIDIA's variable -> ours, where the meaning is the same (NVIDIA's kubelet plugin main.go).
ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "HOST_DRIVER_ROOT": "NVIDIA_DRIVER_ROOT",
        "DRIVER_ROOT_CTR_PATH": "CONTAINER_DRIVER_ROOT",
        # NVIDIA: "the namespace used for the custom resources" (its MPS daemons, Events).
        "NAMESPACE": "POD_NAMESPACE",
        # NVIDIA renders its MPS daemon Deployments with this image, as we do with MPS_IMAGE.
        "IMAGE_NAME": "MPS_IMAGE",
        "NVIDIA_CDI_HOOK_PATH": "CDI_HOOK",
    }
)

# NVIDIA's chart spells it ADDITIONAL_XIDs_TO_IGNORE (lowercase s); its docs the upper-case form.
ADDITIONAL_XIDS_VARIABLES = ("ADDITIONAL_XIDS_TO_IGNORE", "ADDITIONAL_XIDs_TO_IGNORE")

# Accepted with no effect here: what each one switches in NVIDIA's driver is always on in this
# one, or concerns a part this driver does not have (ComputeDomains, IMEX, klog's options).
NO_EFFECT_GATES = frozenset(
    {
        "TimeSlicingSettings",
        "NVMLDeviceHealthCheck",
        "DeviceHealthCheck",
        "ConsumableShares",
        "DRAListTypeAttributes",
        "PassthroughSupport",
        "HostManagedIMEXDaemon",
        "IMEXDaemonsWithDNSNames",
        "ComputeDomainCliques",
        "CrashOnNVLinkFabricErrors",
        "ContextualLogging",
        "LoggingAlphaOptions",
        "LoggingBetaOptions",
        "AllAlpha",
        "AllBeta",
    }
)
EFFECT_GATES = frozenset({"DynamicMIG", "MPSSupport"})
KNOWN_GATES = NO_EFFECT_GATES | EFFECT_GATES

# klog verbosity -> our level: NVIDIA's chart default is 4, its debugging advice 6 and above.
DEBUG_VERBOSITY = 6


@dataclass(frozen=True)
class NvidiaEnvironment:
    """What NVIDIA's variables ask of the agent, before the command line is applied."""

    # the environment with NVIDIA's variables turned into ours
    environ: Mapping[str, str]
    additional_ignored_xids: frozenset[int] = frozenset()
    feature_gates: Mapping[str, bool] = field(default_factory=dict)


def parse_feature_gates(text: str) -> dict[str, bool]:
    """``"DynamicMIG=true,MPSSupport=false,"`` -> {DynamicMIG: True, MPSSupport: False}.

    Raises ValueError for an unknown gate (as Kubernetes' feature gate flag does) or a value
    other than true/false. Empty entries (NVIDIA's chart ends the list with a comma) are skipped.
    """
    gates: dict[str, bool] = {}
    for part in text.split(","):
        item = part.strip()
        if not item:
            continue
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip().lower()
        if not sep or value not in ("true", "false"):
            raise ValueError(f"{item!r}: use Name=true or Name=false")
        if name not in KNOWN_GATES:
            raise ValueError(
                f"unrecognized feature gate {name!r} (known: {', '.join(sorted(KNOWN_GATES))})"
            )
        gates[name] = value == "true"
    return gates


def log_level_of_verbosity(text: str) -> str:
    """klog's -v (``"4"``) -> our log level: debug from 6, else info."""
    if not text.strip().isdigit():
        raise ValueError("must be a klog verbosity, a number 0 or greater")
    return "debug" if int(text) >= DEBUG_VERBOSITY else "info"


def read_nvidia_environment(environ: Mapping[str, str]) -> NvidiaEnvironment:
    """Translate NVIDIA's variables in ``environ``; raises ConfigError naming the variable."""
    fallbacks: dict[str, str] = {}
    for theirs, ours in ALIASES.items():
        value = environ.get(theirs)
        if not value:
            continue
        mine = environ.get(ours)
        if mine and mine != value and not _same_default(ours, mine):
            raise ConfigError(
                f"{theirs} (NVIDIA's name for {ours})",
                f"{value!r} contradicts {ours}={mine!r}: set one of them",
            )
        fallbacks[ours] = value
    xids: frozenset[int] = frozenset()
    for name in ADDITIONAL_XIDS_VARIABLES:
        if environ.get(name, "").strip():
            try:
                xids |= parse_xids(environ[name])
            except ValueError as exc:
                raise ConfigError(name, f"{environ[name]!r} is not valid: {exc}") from exc
    gates: dict[str, bool] = {}
    if environ.get("FEATURE_GATES", "").strip():
        try:
            gates = parse_feature_gates(environ["FEATURE_GATES"])
        except ValueError as exc:
            raise ConfigError("FEATURE_GATES", str(exc)) from exc
    if "DynamicMIG" in gates:
        wanted = "dynamic" if gates["DynamicMIG"] else "static"
        mine = environ.get("MIG_MODE")
        if mine and mine != wanted:
            raise ConfigError(
                "FEATURE_GATES",
                f"DynamicMIG={str(gates['DynamicMIG']).lower()} contradicts MIG_MODE={mine!r}",
            )
        fallbacks["MIG_MODE"] = wanted
    if environ.get("LOG_VERBOSITY", "").strip():
        try:
            fallbacks["LOG_LEVEL"] = log_level_of_verbosity(environ["LOG_VERBOSITY"])
        except ValueError as exc:
            raise ConfigError("LOG_VERBOSITY", f"{environ['LOG_VERBOSITY']!r}: {exc}") from exc
    if gates.get("MPSSupport") is False:
        # NVIDIA refuses MPS claims with the gate off; here that is MPS without an image.
        fallbacks["MPS_IMAGE"] = ""
    merged = dict(environ)
    for ours, value in fallbacks.items():
        if not merged.get(ours) or _same_default(ours, merged[ours]) or ours == "MPS_IMAGE":
            merged[ours] = value
    return NvidiaEnvironment(environ=merged, additional_ignored_xids=xids, feature_gates=gates)


def _same_default(ours: str, mine: str) -> bool:
    """Our chart always sets CDI_HOOK (default builtin): NVIDIA's path then replaces it."""
    return ours == "CDI_HOOK" and mine == "builtin"
