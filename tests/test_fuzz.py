"""The fuzzing tier: every parser the agent and the tools expose to outside input, under
Hypothesis (issue 37 item 2).

For each: the claim JSON as the API server returns it and its opaque configs, the body of an API
answer, the kubelet's gRPC requests (bytes on the wire, then the claims they name), the
registration status the kubelet sends, the checkpoint snapshot and journal, CDI specs read
back, the ``--simulate`` spec, ``explain``'s documents and CEL selectors, and quantities. The
properties: no exception but the documented error type of that parser; no call slower than
``BOUND_S``; and a bad claim in a batch never changes another claim's answer. Inputs are
mutations of valid ones (so that the checks past the first are reached) and arbitrary values.

Bounded in time: each test draws at most ``EXAMPLES`` inputs (``FUZZ_EXAMPLES`` in the
environment raises it for a longer local run), with no example database (nothing written to
the tree), so the tier takes about a minute on a CI machine; docs/development.md "Fuzzing".
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.pluginregistration_v1 import api_pb2 as reg
from dra_driver.cdi.spec import device_names_in_spec
from dra_driver.errors import (
    CdiError,
    CelCompileError,
    CheckpointCorrupt,
    ConfigDecodeError,
    ExplainError,
    KubeError,
    PrepareError,
    SimulationSpecError,
)
from dra_driver.kube.connection import _decoded
from dra_driver.plugin.registration import RegistrationServicer
from dra_driver.prepare import ClaimRef
from dra_driver.prepare.deviceconfig import decode
from dra_driver.prepare.plan import plan_claim
from dra_driver.prepare.state.checkpoint import PREPARE_COMPLETED, ClaimRecord, PreparedDevice
from dra_driver.prepare.state.checkpointformat import (
    claim_member,
    decode_snapshot,
    encode_journal_line,
    encode_snapshot,
    parse_journal,
    record_json,
)
from dra_driver.prepare.targets import device_targets
from dra_driver.quantity import QuantityError, parse_quantity
from dra_driver.scheduling.cel import compile_selector
from dra_driver.scheduling.documents import load_documents
from dra_driver.sim.fakedriver import simulated_inventory
from dra_driver.sim.nvml.spec import parse_spec
from tests.claimdata import DRIVER, allocated_claim, new_uid, opaque
from tests.test_prepare import Env, build_env

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
BOUND_S = 1.0  # no call on one input may take longer (they take milliseconds)
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # the bound is checked below, once per call, not by re-running
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
TARGETS = device_targets(simulated_inventory("h100:4", node_name="node1"))

# -- strategies ----------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30)
    | st.sampled_from(["gpu-0", "node1", DRIVER, "GpuConfig", "MPS", "TimeSlicing", "1Gi", "all"])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=40,
)


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in a JSON value (dict keys, list indexes), the root first."""
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from paths(child, (*prefix, index))


def replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: replaced(value[head], rest, new)}
    copy = list(value)
    copy[head] = replaced(copy[head], rest, new)
    return copy


@st.composite
def mutated(draw: st.DrawFn, valid: Any) -> Any:
    """``valid`` with one to three places replaced by arbitrary JSON values."""
    value = valid
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(list(paths(value))))
        value = replaced(value, where, draw(json_values))
    return value


GPU_CONFIG = {
    "apiVersion": "resource.nvidia.com/v1beta1",
    "kind": "GpuConfig",
    "sharing": {
        "strategy": "MPS",
        "mpsConfig": {
            "defaultActiveThreadPercentage": 50,
            "defaultPinnedDeviceMemoryLimit": "10Gi",
            "defaultPerDevicePinnedMemoryLimit": {"gpu-0": "1Gi"},
        },
    },
    "driverCapabilities": ["compute", "utility"],
}


def valid_claim(uid: str = "0f2e8a4c-1111-4222-8333-944455556666") -> dict[str, Any]:
    return allocated_claim(
        name="c",
        uid=uid,
        devices=["gpu-0", ("big", "gpu-1")],
        configs=[opaque(GPU_CONFIG, requests=["gpus"]), opaque({"x": 1}, driver="other")],
    )


claims = mutated(valid_claim()) | json_values


def bounded(call: Callable[[], Any]) -> Any:
    started = time.perf_counter()
    try:
        return call()
    finally:
        took = time.perf_counter() - started
        assert took < BOUND_S, f"one call took {took:.2f} s"


# -- the claim and its configs -------------------------------------------------------------------


@FUZZ
@given(claim=claims)
def test_a_claim_of_any_shape_is_planned_or_refused_with_a_prepare_error(claim: Any) -> None:
    ref = ClaimRef(namespace="default", name="c", uid="0f2e8a4c-1111-4222-8333-944455556666")
    with contextlib.suppress(PrepareError):
        bounded(
            lambda: plan_claim(ref, claim, driver_name=DRIVER, node_name="node1", targets=TARGETS)
        )


@FUZZ
@given(parameters=mutated(GPU_CONFIG) | json_values)
def test_an_opaque_config_of_any_shape_decodes_or_is_a_config_error(parameters: Any) -> None:
    with contextlib.suppress(ConfigDecodeError):
        bounded(lambda: decode(parameters))


@FUZZ
@given(
    status=st.sampled_from([200, 201, 400, 403, 404, 409, 410, 422, 429, 500, 503]),
    body=st.binary(max_size=200)
    | st.builds(lambda v: json.dumps(v).encode(), json_values)
    | st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n),
)
def test_an_api_answer_of_any_body_is_an_object_or_a_kube_error(status: int, body: bytes) -> None:
    try:
        answer = bounded(
            lambda: _decoded(status, body, verb="get", resource="resourceclaims",
                             namespace="default", name="c")
        )  # fmt: skip
    except KubeError:
        return
    assert isinstance(answer, dict)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    e = build_env(tmp_path_factory.mktemp("fuzz-batch"))
    yield e
    e.preparer.close()


@FUZZ
@given(bad=claims)
def test_a_bad_claim_never_changes_the_answer_of_another_in_its_batch(env: Env, bad: Any) -> None:
    good = env.store.add(allocated_claim(name="good", devices=["gpu-3"]))
    good_ref = env.ref(good)
    alone = env.preparer.prepare_batch([good_ref])[good_ref.uid]
    uid = new_uid()
    if isinstance(bad, dict) and isinstance(bad.get("metadata"), dict):
        bad["metadata"] = {**bad["metadata"], "namespace": "default", "name": "bad", "uid": uid}
    env.store.claims[("default", "bad")] = bad
    bad_ref = ClaimRef(namespace="default", name="bad", uid=uid)
    outcomes = bounded(lambda: env.preparer.prepare_batch([bad_ref, good_ref]))
    assert outcomes[good_ref.uid] == alone
    assert outcomes[uid].error or outcomes[uid].devices
    env.preparer.unprepare_batch([bad_ref, good_ref])
    env.store.delete(good)


# -- the kubelet's messages ----------------------------------------------------------------------


def valid_request() -> bytes:
    claims = [v1.Claim(namespace="default", name="c", uid=new_uid()) for _ in range(2)]
    return bytes(v1.NodePrepareResourcesRequest(claims=claims).SerializeToString())


@FUZZ
@given(
    data=st.binary(max_size=300)
    | st.builds(
        lambda b, i, x: b[:i] + x + b[i:],
        st.just(valid_request()),
        st.integers(0, 120),
        st.binary(max_size=8),
    )
)
def test_a_kubelet_request_of_any_bytes_parses_or_is_a_decode_error_and_each_claim_is_answered(
    env: Env, data: bytes
) -> None:
    try:
        request = v1.NodePrepareResourcesRequest.FromString(data)
    except DecodeError:
        return
    refs = [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in request.claims]
    outcomes = bounded(lambda: env.preparer.prepare_batch(refs))
    assert set(outcomes) == {r.uid for r in refs}


@FUZZ
@given(registered=st.booleans(), error=st.text(max_size=2000))
def test_any_registration_status_is_taken(registered: bool, error: str) -> None:
    servicer = RegistrationServicer(driver_name=DRIVER, endpoint="/x/dra.sock", versions=["v1"])
    status = reg.RegistrationStatus(plugin_registered=registered, error=error)
    bounded(lambda: servicer.NotifyRegistrationStatus(status, None))


# -- the node's files ---------------------------------------------------------------------------


def record(uid: str) -> ClaimRecord:
    device = PreparedDevice(
        request_names=("gpus",), pool="node1", device="gpu-0",
        cdi_device_ids=(f"k8s.gpu.nvidia.com/claim={uid}-gpu-0",),
    )  # fmt: skip
    return ClaimRecord(
        uid=uid, namespace="default", name="c", phase=PREPARE_COMPLETED, devices=(device,)
    )


def member(uid: str) -> str:
    return claim_member(uid, record_json(record(uid)))


SNAPSHOT = encode_snapshot(boot_id="boot-1", seq=1, claims=[member("u1")])
JOURNAL = encode_journal_line(seq=2, put=[member("u2")], delete=())


def damaged(valid: bytes) -> st.SearchStrategy[bytes]:
    return st.binary(max_size=400) | st.builds(
        lambda i, n, x: valid[:i] + x + valid[i + n :],
        st.integers(0, len(valid)), st.integers(0, 8), st.binary(max_size=8),
    )  # fmt: skip


@FUZZ
@given(raw=damaged(SNAPSHOT))
def test_a_damaged_snapshot_is_read_or_reported_corrupt(raw: bytes) -> None:
    with contextlib.suppress(CheckpointCorrupt):
        bounded(lambda: decode_snapshot(raw))


@FUZZ
@given(raw=damaged(JOURNAL + JOURNAL.replace(b'"seq":2', b'"seq":3')))
def test_a_damaged_journal_is_read_or_reported_corrupt(raw: bytes) -> None:
    with contextlib.suppress(CheckpointCorrupt):
        bounded(lambda: parse_journal(raw, after_seq=1))


SPEC = json.dumps(
    {
        "cdiVersion": "0.5.0",
        "kind": "k8s.gpu.nvidia.com/claim",
        "devices": [{"name": "u-gpu-0", "containerEdits": {}}],
    }
).encode()


@FUZZ
@given(
    content=damaged(SPEC) | st.builds(lambda v: json.dumps(v).encode(), mutated(json.loads(SPEC)))
)
def test_a_cdi_spec_read_back_gives_names_or_a_cdi_error(content: bytes) -> None:
    try:
        names = bounded(lambda: device_names_in_spec(content, claim_uid="u"))
    except CdiError:
        return
    assert all(isinstance(n, str) for n in names)


# -- the tools' input ----------------------------------------------------------------------------


@FUZZ
@given(
    spec=st.text(max_size=60)
    | st.from_regex(
        r"[a-z0-9]{1,6}(:[0-9]{1,3})?(:mig(=[0-9a-z.+]{0,12})?)?(,[a-z0-9:]{0,10})?", fullmatch=True
    )
)
def test_a_simulate_spec_parses_or_is_a_simulation_error(spec: str) -> None:
    with contextlib.suppress(SimulationSpecError):
        bounded(lambda: parse_spec(spec))


@FUZZ
@given(text=st.text(max_size=300) | st.builds(json.dumps, json_values)
       | st.builds(json.dumps, mutated(valid_claim())))  # fmt: skip
def test_explain_documents_of_any_text_load_or_are_an_explain_error(text: str) -> None:
    try:
        docs = bounded(lambda: load_documents("-", stdin=io.StringIO(text)))
    except ExplainError:
        return
    assert all(isinstance(d, dict) for d in docs)


SELECTORS = [
    "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
    "device.attributes['gpu.nvidia.com'].productName.matches('H100')",
    "device.attributes['gpu.nvidia.com'].type == 'gpu' && has(device.attributes['x'].y)",
]


@FUZZ
@given(
    expression=st.text(max_size=80)
    | st.builds(
        lambda s, i, x: s[:i] + x + s[i:],
        st.sampled_from(SELECTORS),
        st.integers(0, 70),
        st.text(max_size=4),
    )
)
def test_a_cel_selector_compiles_or_is_a_compile_error(expression: str) -> None:
    compile_selector(SELECTORS[0])  # the grammar is built once, on the first compile (cached)
    with contextlib.suppress(CelCompileError):
        bounded(lambda: compile_selector.__wrapped__(expression))


@FUZZ
@given(
    text=st.text(max_size=30)
    | st.from_regex(
        r"[+-]?[0-9.]{0,12}(e[+-]?[0-9]{0,4})?(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?", fullmatch=True
    )
)
def test_a_quantity_parses_or_is_a_quantity_error(text: str) -> None:
    with contextlib.suppress(QuantityError):
        bounded(lambda: parse_quantity(text))
