"""The resource.k8s.io API as Kubernetes defines it: its group, the versions this driver speaks,
the kinds it uses and the limits the API server enforces. Names only, no behaviour.

At the bottom of the layers, so that both the API client (kube/) and the slice builder (publish/)
take these names from one place (spec D.0, D.1; k8s:pkg/apis/resource/types.go).
"""

from __future__ import annotations

from typing import Any, Final

JsonDict = dict[str, Any]
"""An API object (or part of one) as plain JSON, in resource.k8s.io/v1 shape unless said."""

GROUP: Final = "resource.k8s.io"

API_VERSIONS: Final = ("v1", "v1beta2", "v1beta1")
"""Versions of resource.k8s.io this driver can publish with, most preferred first."""

DEVICE_TAINT_RULE_VERSIONS: Final = ("v1", "v1beta2", "v1alpha3")
"""resource.k8s.io versions that can serve DeviceTaintRule, preferred first (spec D.4: v1alpha3
since 1.33, v1beta2 since 1.36, v1 since 1.37; each only with the DRADeviceTaintRules gate on)."""

RESOURCE_SLICE: Final = "ResourceSlice"
RESOURCE_CLAIM: Final = "ResourceClaim"
DEVICE_CLASS: Final = "DeviceClass"
DEVICE_TAINT_RULE: Final = "DeviceTaintRule"

# ResourceSlice limits (spec D.1, nvidia-compat.md "API limits").
MAX_DEVICES_PER_SLICE: Final = 128
MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS: Final = 64
MAX_COUNTER_SETS_PER_SLICE: Final = 8
MAX_COUNTERS_PER_SET: Final = 32

# Device limits (spec D.1, k8s:pkg/apis/resource/validation/validation.go).
MAX_NAME_LENGTH: Final = 63  # DNS label
MAX_ATTRIBUTES_AND_CAPACITIES: Final = 32
MAX_STRING_LENGTH: Final = 64
MAX_VERSION_LENGTH: Final = 64
MAX_IDENTIFIER_LENGTH: Final = 32
MAX_DOMAIN_LENGTH: Final = 63
MAX_TAINTS: Final = 16
MAX_COUNTER_CONSUMPTIONS: Final = 2
MAX_COUNTERS: Final = 32
MAX_VALID_VALUES: Final = 10
