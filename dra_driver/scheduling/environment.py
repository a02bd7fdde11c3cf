"""The DRA selector CEL environment per Kubernetes minor, and its cost limits. Pure.

The one place that knows Kubernetes versions. ``cel`` compiles against an ``Environment`` from
here (this module imports nothing of ``cel``): the functions a version does not have are
refused as cel-go refuses them ("undeclared reference to 'reverse' (in container '')"), and a
selector whose estimated cost exceeds ``COST_LIMIT`` is refused.

Versions (spec ``shared/spec/dra-kubelet-plugin.md`` E.2, E.3). A claim that a user applies
holds *new* expressions: the API server compiles them in its "NewExpressions" environment,
which has only the libraries introduced at or below its compatibility version (normally its
own minor - 1; ``apiserver:pkg/cel/environment/base.go``) and not yet removed at it. So:

=======  ======  ================================================================
server   compat  new expressions have, beyond everything introduced by 1.33
=======  ======  ================================================================
1.34     1.33    (nothing more: ext.Lists v3 entered the base env in 1.34)
1.35     1.34    ext.Lists v3: slice flatten distinct reverse sort sortBy lists.range
1.36     1.35    the same, and DRA ``includes()`` when DRAListTypeAttributes is on
1.37     1.36    the same (Kubernetes Lists v0 is removed only at compat 1.37, and
                 Lists v1, which adds a library ``includes``, is introduced at 1.37:
                 neither changes for a 1.37 server's new expressions)
=======  ======  ================================================================

Everything else the engine implements is older than 1.33 and present in all four: the CEL
standard library and macros, ``cel.bind``, regex (RE2), Kubernetes Lists v0 (isSorted sum min
max indexOf lastIndexOf), optional types, quantity, ext.Strings v2 (with ``format``), ext.Sets,
two-variable comprehensions, semver. Unchanged *stored* expressions compile in a wider
environment; ``explain`` checks claims as new expressions, the case a user meets on apply.

Uncertain, said rather than guessed silently:

* DRA ``includes()``: E.3 lists it from 1.36 with the alpha DRAListTypeAttributes gate (off by
  default; off here unless ``feature_gates`` names it). The DRA compiler of 1.37
  (``dra:cel/compile.go``) declares it with IntroducedVersion 1.36, which under the rule above
  would keep it out of a 1.36 server's new expressions even with the gate on; we follow E.3
  (available in 1.36 with the gate), as an alpha feature that could not be used in its own
  release seems unlikely. Whether the gate is still alpha (off) in 1.37 is not in the spec;
  we assume so.
* Kubernetes Lists v1's ``includes`` (E.3: "v1 (1.37) adds includes") is not available to any
  server's new expressions here, per the compatibility rule.

The cost limit (E.2) is here too; ``cel.cost`` estimates a selector's cost against it.

Scheduler features that change an allocation, by default per version: ``DRADeviceBindingConditions``
(KEP-5007: devices whose ``bindingConditions`` the scheduler waits for before binding the pod)
is alpha and off in 1.34 and 1.35, beta and on from 1.36 (:func:`device_binding_conditions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

Version = tuple[int, int]

SUPPORTED_VERSIONS: Final = ("1.34", "1.35", "1.36", "1.37")
NEWEST_VERSION: Final = SUPPORTED_VERSIONS[-1]
LIST_TYPE_ATTRIBUTES_GATE: Final = "DRAListTypeAttributes"
DEVICE_BINDING_CONDITIONS_GATE: Final = "DRADeviceBindingConditions"
DEVICE_BINDING_CONDITIONS_ON_FROM: Final = (1, 36)  # beta, on by default

COST_LIMIT: Final = 1_000_000  # CELSelectorExpressionMaxCost, estimated and actual


@dataclass(frozen=True)
class Library:
    """A versioned part of the environment: functions it adds, base-env version, gate."""

    name: str
    introduced: Version
    functions: frozenset[str]
    removed: Version | None = None
    feature_gate: str | None = None
    # Set where the spec says a gated library is usable from this server version on, whatever
    # its compatibility version (see the module docstring on DRA includes()).
    server_version: Version | None = None


# Only the libraries that are not in every supported version's new-expression environment, or
# whose removal matters, are listed: everything else the engine implements entered by 1.33.
LIBRARIES: Final = (
    Library(
        "Kubernetes Lists v0",
        (1, 0),
        frozenset({"isSorted", "sum", "min", "max", "indexOf", "lastIndexOf"}),
        removed=(1, 37),
    ),
    Library(
        "ext.Lists v3",
        (1, 34),
        frozenset({"slice", "flatten", "distinct", "reverse", "sort", "sortBy", "lists.range"}),
    ),
    Library(
        "DRA includes()",
        (1, 36),
        frozenset({"includes"}),
        feature_gate=LIST_TYPE_ATTRIBUTES_GATE,
        server_version=(1, 36),
    ),
)
# Names also declared by libraries present in every version (ext.Strings v2's indexOf and
# lastIndexOf): never withheld by a library's removal.
_ALWAYS: Final = frozenset({"indexOf", "lastIndexOf"})


@dataclass(frozen=True)
class Environment:
    """The new-expression environment of one Kubernetes minor."""

    k8s_version: str
    compatibility_version: Version
    libraries: tuple[str, ...]
    withheld: frozenset[str]  # function and macro names this environment does not declare
    feature_gates: frozenset[str] = field(default=frozenset())


def parse_version(text: str) -> Version:
    """``"1.35"`` (or ``"v1.35.2"``) -> (1, 35); ValueError for anything not supported."""
    parts = text.strip().removeprefix("v").split(".")
    try:
        version = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        raise ValueError(f"invalid Kubernetes version {text!r}: expected MAJOR.MINOR") from None
    if f"{version[0]}.{version[1]}" not in SUPPORTED_VERSIONS:
        raise ValueError(
            f"Kubernetes version {text!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_VERSIONS)})"
        )
    return version


def environment(
    k8s_version: str = NEWEST_VERSION, *, feature_gates: frozenset[str] = frozenset()
) -> Environment:
    """The environment an API server of ``k8s_version`` compiles new selectors in."""
    major, minor = parse_version(k8s_version)
    compat = (major, minor - 1)
    present: list[str] = []
    withheld: set[str] = set()
    for lib in LIBRARIES:
        available = lib.introduced <= compat and (lib.removed is None or compat < lib.removed)
        if lib.server_version is not None:
            available = (major, minor) >= lib.server_version
        if lib.feature_gate is not None and lib.feature_gate not in feature_gates:
            available = False
        if available:
            present.append(lib.name)
        else:
            withheld |= lib.functions
    declared = {f for lib in LIBRARIES if lib.name in present for f in lib.functions}
    return Environment(
        f"{major}.{minor}",
        compat,
        tuple(present),
        frozenset(withheld - declared - _ALWAYS),
        frozenset(feature_gates),
    )


def device_binding_conditions(k8s_version: str = NEWEST_VERSION) -> bool:
    """Whether a scheduler of ``k8s_version`` has DRADeviceBindingConditions on by default."""
    return parse_version(k8s_version) >= DEVICE_BINDING_CONDITIONS_ON_FROM
