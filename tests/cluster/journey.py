"""What a user does with the cluster, and what the tests read back: apply a file, wait for its pods,
read the allocation the real scheduler made, the CDI devices the real kubelet got, the CDI specs
on the node, and ``gpu-dra explain`` against the same cluster."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dra_driver.scheduling.explain import main as explain_main
from dra_driver.sharing.mps import APP, APP_LABEL
from tests.cluster import DRIVER, NAMESPACE, Cluster, objects
from tests.test_examples_explain import expectation

ORDER = ("Namespace", "ResourceClaimTemplate", "ResourceClaim", "Pod", "Deployment")


def load(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return sorted(docs, key=lambda d: ORDER.index(d["kind"]) if d["kind"] in ORDER else 99)


def namespace_of(doc: dict[str, Any]) -> str:
    return str(doc["metadata"].get("namespace", "default"))


def apply(cluster: Cluster, docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        if doc["kind"] == "Namespace" and objects.get(
            cluster.control, "Namespace", doc["metadata"]["name"]
        ):
            continue
        copy = json.loads(json.dumps(doc))
        copy["metadata"].setdefault("namespace", "default")
        objects.create(cluster.control, copy)


def pods_of(cluster: Cluster, docs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(namespace, name) of the pods the documents make: their Pods and their Deployments'."""
    out: list[tuple[str, str]] = []
    for doc in docs:
        ns = namespace_of(doc)
        if doc["kind"] == "Pod":
            out.append((ns, doc["metadata"]["name"]))
        elif doc["kind"] == "Deployment":
            labels = doc["spec"]["selector"]["matchLabels"]
            selector = ",".join(f"{k}={v}" for k, v in labels.items())
            want = int(doc["spec"].get("replicas", 1))

            def probe(ns: str = ns, selector: str = selector, want: int = want) -> list[str] | None:
                names = [
                    p["metadata"]["name"]
                    for p in objects.items(cluster.control, "Pod", ns, selector)
                    if p["metadata"].get("deletionTimestamp") is None
                ]
                return names if len(names) == want else None

            names = objects.wait(f"{want} pods of deployment {ns}/{doc['metadata']['name']}", probe)
            out += [(ns, n) for n in names]
    return out


def wait_running(cluster: Cluster, ns: str, name: str, *, timeout_s: float = 90) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        pod = objects.get(cluster.control, "Pod", name, ns)
        if pod is not None and pod.get("status", {}).get("phase") == "Running":
            return pod
        return None

    try:
        return objects.wait(f"pod {ns}/{name} Running", probe, timeout_s=timeout_s)
    except AssertionError:
        pod = objects.get(cluster.control, "Pod", name, ns)
        events = [
            f"{e.get('reason')}: {e.get('message')}"
            for e in objects.items(cluster.control, "Event", ns)
            if e.get("involvedObject", {}).get("name") == name
        ]
        raise AssertionError(
            f"pod {ns}/{name} not Running: {json.dumps((pod or {}).get('status'))[:1500]}\n"
            f"events: {events[-8:]}\n{cluster.logs()}"
        ) from None


def claim_names(pod: dict[str, Any]) -> list[str]:
    """The ResourceClaims a pod uses: named ones, those made from its templates, and the one
    the scheduler made for its extended resources."""
    status = pod.get("status", {})
    made = {s["name"]: s.get("resourceClaimName") for s in status.get("resourceClaimStatuses", [])}
    names = []
    for ref in pod["spec"].get("resourceClaims", []):
        name = ref.get("resourceClaimName") or made.get(ref["name"])
        if name:
            names.append(name)
    extended = status.get("extendedResourceClaimStatus", {}).get("resourceClaimName")
    if extended:
        names.append(extended)
    return names


@dataclass(frozen=True)
class Allocated:
    node: str
    devices: list[str]  # in result order
    results: list[dict[str, Any]]


def allocation(cluster: Cluster, ns: str, claim: str) -> Allocated:
    obj = objects.get(cluster.control, "ResourceClaim", claim, ns)
    assert obj is not None, f"claim {ns}/{claim} is gone"
    alloc = obj.get("status", {}).get("allocation")
    assert alloc, f"claim {ns}/{claim} is not allocated: {obj.get('status')}"
    results = alloc["devices"]["results"]
    terms = alloc.get("nodeSelector", {}).get("nodeSelectorTerms", [])
    node = ""
    for term in terms:
        for field in term.get("matchFields", []):
            if field["key"] == "metadata.name":
                node = field["values"][0]
    return Allocated(node=node, devices=[r["device"] for r in results], results=results)


def cdi_specs(cluster: Cluster, node: str) -> dict[str, set[str]]:
    """The CDI spec files in the node's CDI directory: file name -> qualified device names."""
    specs: dict[str, set[str]] = {}
    for path in sorted((cluster.nodes[node].work / "cdi").glob("*")):
        if path.suffix not in (".json", ".yaml"):
            continue
        spec = yaml.safe_load(path.read_text())
        specs[path.name] = {f"{spec['kind']}={d['name']}" for d in spec.get("devices", [])}
    return specs


def recorded_claims(cluster: Cluster, node: str) -> set[str]:
    """The claim UIDs the node's agent has recorded as prepared: its checkpoint's snapshot with
    the journal's later changes applied (the format: prepare/state/checkpointformat.py)."""
    state = cluster.nodes[node].work / "k" / "plugins" / DRIVER
    snapshot = state / "gpu-dra-checkpoint.json"  # node/config.py checkpoint_path
    claims: set[str] = set()
    if snapshot.exists():
        claims = set(json.loads(snapshot.read_text())["data"]["claims"])
    journal = state / "gpu-dra-checkpoint.journal"
    if journal.exists():
        for line in journal.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)["entry"]
                claims |= set(entry.get("put", {}))
                claims -= set(entry.get("del", []))
    return claims


def mps_deployments(cluster: Cluster) -> list[str]:
    """The MPS control daemon Deployments the agents made that are still there."""
    return [
        d["metadata"]["name"]
        for d in objects.items(cluster.control, "Deployment", NAMESPACE, f"{APP_LABEL}={APP}")
    ]


def explain(cluster: Cluster, source: Path, node: str) -> tuple[int, dict[str, Any]]:
    """``gpu-dra explain FILE --kubeconfig ... --node NODE -o json`` against the cluster."""
    out, err = io.StringIO(), io.StringIO()
    rc = explain_main(
        [str(source), "--kubeconfig", str(cluster.control.admin_kubeconfig), "--node", node,
         "-o", "json"],
        stdout=out, stderr=err,
    )  # fmt: skip
    assert rc in (0, 1), err.getvalue()
    return rc, json.loads(out.getvalue())


def explained_devices(result: dict[str, Any]) -> list[list[str]]:
    """Per claim, the devices ``explain`` allocates (in result order)."""
    return [
        [r["device"] for r in claim["allocation"]["devices"]["results"]]
        for claim in result["allocation"]["claims"]
    ]


def delete_all(cluster: Cluster, docs: list[dict[str, Any]]) -> None:
    for doc in reversed(docs):
        if doc["kind"] == "Namespace":
            continue  # kept: a namespace's deletion is the namespace controller's slow job
        objects.delete(cluster.control, doc["kind"], doc["metadata"]["name"], namespace_of(doc))


def wait_gone(cluster: Cluster, kind: str, ns: str, name: str, *, timeout_s: float = 90) -> None:
    objects.wait(
        f"{kind} {ns}/{name} gone",
        lambda: objects.get(cluster.control, kind, name, ns) is None,
        timeout_s=timeout_s,
    )


@contextmanager
def applied(cluster: Cluster, path: Path) -> Iterator[list[dict[str, Any]]]:
    """The file's objects created; on exit deleted, and their pods and claims waited out."""
    docs = load(path)
    apply(cluster, docs)
    try:
        yield docs
    finally:
        pods = [(namespace_of(d), d["metadata"]["name"]) for d in docs if d["kind"] == "Pod"]
        claims: list[tuple[str, str]] = []
        for ns, name in pods:
            pod = objects.get(cluster.control, "Pod", name, ns)
            if pod is not None:
                claims += [(ns, c) for c in claim_names(pod)]
        delete_all(cluster, docs)
        for ns, name in pods:
            wait_gone(cluster, "Pod", ns, name)
        for ns, name in claims:
            wait_gone(cluster, "ResourceClaim", ns, name)


def driver_results(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in results if r["driver"] == DRIVER]


def settle(seconds: float) -> None:
    time.sleep(seconds)


def run_example(cluster: Cluster, path: Path) -> None:
    satisfiable, _ = expectation(path)
    assert satisfiable, f"{path.name}: an unsatisfiable example has no pod to run"
    before = {node: cdi_specs(cluster, node) for node in cluster.nodes}
    predicted = {}
    for node in cluster.nodes:
        rc, result = explain(cluster, path, node)
        assert rc == 0, f"explain says {path.name} does not fit {node}: {result}"
        predicted[node] = explained_devices(result)
    docs = load(path)
    apply(cluster, docs)
    pods = []
    try:
        pods = pods_of(cluster, docs)
        assert pods, f"{path.name} makes no pod"
        allocated: dict[str, list[list[str]]] = {}
        for ns, name in pods:
            pod = wait_running(cluster, ns, name)
            node = pod["spec"]["nodeName"]
            assert node in cluster.nodes
            claims = claim_names(pod)
            assert claims, f"{ns}/{name} uses no claim"
            got = []
            for claim in claims:
                alloc = allocation(cluster, ns, claim)
                assert alloc.node in ("", node)
                got.append(alloc.devices)
            allocated.setdefault(node, []).extend(got)
            # the kubelet handed the runtime CDI IDs, each declared by a spec on the node
            ids = cluster.nodes[node].cdi_devices(pod)
            assert ids, f"the kubelet passed no CDI device for {ns}/{name}"
            declared = set().union(*cdi_specs(cluster, node).values())
            assert set(ids) <= declared, (ids, sorted(declared))
        if len(pods) == 1:
            ((node, claims),) = allocated.items()
            assert sorted(claims) == sorted(predicted[node]), (path.name, node, predicted[node])
        else:  # several pods: each claim explain predicted was made on the node it was for
            assert any(
                claim in claims for node, claims in allocated.items() for claim in predicted[node]
            ), (path.name, allocated, predicted)
    finally:
        delete_all(cluster, docs)
        for ns, name in pods:
            wait_gone(cluster, "Pod", ns, name)
    # unprepared: the claims the file made are gone and the specs are as before
    for node in cluster.nodes:
        objects.wait(
            f"{node}'s CDI specs back to before {path.name}",
            lambda node=node: cdi_specs(cluster, node) == before[node],
            timeout_s=60,
        )
