"""plugin/dra.py's ``Told`` and ``ClaimLog``: the claims the DRA services answered for are told
(logged, then given to the claim status reporter) once the answer is sent, in the order the
answers were built; over real gRPC, the kubelet's answer never waits for them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from dra_driver._proto.dra_v1 import api_pb2 as v1
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver.kube import KubeClient
from dra_driver.kube.events import node_event_reporter
from dra_driver.node.nodeplugin import NodePlugin
from dra_driver.node.wiring import kubelet_plugin
from dra_driver.plugin.dra import ClaimLog, Told
from dra_driver.prepare import ClaimRef, PreparedDevice
from dra_driver.sim.localapi import FakeKubeApi
from tests.claimdata import allocated_claim, new_uid
from tests.test_plugin_server import inventory, kube, make_config, v1_claim

__all__ = ["kube"]  # test_plugin_server's fixture: the local API server with node1, its client

Held = tuple[tuple[str, str, str | None], ...]


class Recording:
    """A ClaimObserver that notes each call (``gate``: prepared waits till it is set)."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.calls: list[tuple[str, str, Held, str]] = []
        self.gate = gate
        self.told = threading.Condition()

    def prepared(
        self,
        *,
        namespace: str,
        name: str,
        uid: str,
        devices: Held | list[tuple[str, str, str | None]],
    ) -> None:
        if self.gate is not None:
            self.gate.wait(10)
        self._note("prepared", uid, tuple(devices))

    def unprepared(
        self,
        *,
        namespace: str,
        name: str,
        uid: str,
        devices: Held | list[tuple[str, str, str | None]] = (),
    ) -> None:
        self._note("unprepared", uid, tuple(devices))

    def _note(self, what: str, uid: str, devices: Held) -> None:
        with self.told:
            self.calls.append((what, uid, devices, threading.current_thread().name))
            self.told.notify_all()

    def wait_for(self, n: int, timeout_s: float = 10) -> None:
        with self.told:
            assert self.told.wait_for(lambda: len(self.calls) >= n, timeout_s), self.calls


class Context:
    """A gRPC ServicerContext's ``add_callback``: callbacks kept till ``done()`` (the RPC's
    end); ``over``: the RPC already ended (add_callback says False)."""

    def __init__(self, *, over: bool = False) -> None:
        self.callbacks: list[Callable[[], None]] = []
        self.over = over

    def add_callback(self, callback: Callable[[], None]) -> bool:
        if self.over:
            return False
        self.callbacks.append(callback)
        return True

    def done(self) -> None:
        for callback in self.callbacks:
            callback()


def device(name: str, share: str | None = None) -> PreparedDevice:
    return PreparedDevice(
        request_names=("gpus",),
        pool="node1",
        device=name,
        cdi_device_ids=(f"k8s.gpu.nvidia.com/claim=x-{name}",),
        share_id=share,
    )


def ref(name: str) -> ClaimRef:
    return ClaimRef(namespace="default", name=name, uid=new_uid())


def test_claims_are_told_after_the_answer_in_the_order_answered() -> None:
    observer = Recording()
    told = Told(observer)
    first, second = ref("a"), ref("b")
    context = Context()
    told.prepared(first, (device("gpu-0"), device("gpu-1", share="s1")))
    told.unprepared(second, (device("gpu-2"),))
    told.after_answer(context)
    assert observer.calls == []  # the answer is not sent yet
    later = Context()
    told.prepared(second, ())
    told.after_answer(later)
    later.done()  # a later RPC's end tells what an earlier one queued, first
    assert [(what, uid, devices) for what, uid, devices, _ in observer.calls] == [
        ("prepared", first.uid, (("node1", "gpu-0", None), ("node1", "gpu-1", "s1"))),
        ("unprepared", second.uid, (("node1", "gpu-2", None),)),
        ("prepared", second.uid, ()),
    ]
    context.done()  # nothing left for the first RPC's own callback
    assert len(observer.calls) == 3


@pytest.mark.parametrize("context", [None, Context(over=True)], ids=["no-rpc", "rpc-over"])
def test_without_a_live_rpc_claims_are_told_at_once(context: Context | None) -> None:
    observer = Recording()
    told = Told(observer)
    claim = ref("a")
    told.unprepared(claim, ())
    told.after_answer(context)
    assert [(what, uid) for what, uid, _, _ in observer.calls] == [("unprepared", claim.uid)]


def test_an_observer_that_fails_is_logged_and_the_next_claims_are_still_told(
    caplog: pytest.LogCaptureFixture,
) -> None:
    observer = Recording()
    failing = ref("bad")

    class Failing(Recording):
        def unprepared(self, *, namespace: str, name: str, uid: str, devices: Held = ()) -> None:
            if uid == failing.uid:
                raise RuntimeError("the reporter broke")
            observer.unprepared(namespace=namespace, name=name, uid=uid, devices=devices)

    told = Told(Failing())
    after = ref("after")
    told.unprepared(failing, ())
    told.unprepared(after, ())
    with caplog.at_level(logging.ERROR, logger="dra_driver.plugin.dra"):
        told.after_answer(None)  # raises nothing
    assert [uid for _, uid, _, _ in observer.calls] == [after.uid]
    (record,) = caplog.records
    assert record.getMessage() == "a claim observer failed"
    assert record.__dict__["claim_uid"] == failing.uid
    assert "the reporter broke" in caplog.text


def test_the_claim_log_names_the_devices_and_skips_unprepares_of_claims_that_held_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    then = Recording()
    claim_log = ClaimLog(then)
    uid = new_uid()
    held = (("node1", "gpu-0", None), ("node1", "gpu-1", "s1"))
    with caplog.at_level(logging.INFO, logger="dra_driver.plugin.dra"):
        claim_log.prepared(namespace="ns", name="c", uid=uid, devices=held)
        claim_log.unprepared(namespace="ns", name="c", uid=uid, devices=held)
        claim_log.unprepared(namespace="ns", name="c", uid=uid)  # the kubelet's retry
    lines = [
        (r.getMessage(), r.__dict__["claim_uid"], r.__dict__["devices"]) for r in caplog.records
    ]
    assert lines == [
        ("prepared claim", uid, ["gpu-0", "gpu-1"]),
        ("unprepared claim", uid, ["gpu-0", "gpu-1"]),
    ]
    assert all(r.__dict__["claim"] == "ns/c" for r in caplog.records)
    # every call reaches the next observer (the reporter removes what an earlier agent wrote)
    assert [(what, devices) for what, _, devices, _ in then.calls] == [
        ("prepared", held),
        ("unprepared", held),
        ("unprepared", ()),
    ]
    ClaimLog().unprepared(namespace="ns", name="c", uid=uid)  # alone: logs, tells nobody


def observed_plugin(tmp: Path, kube: KubeClient, observer: Recording) -> NodePlugin:
    plugin = kubelet_plugin(
        config=make_config(tmp),
        inventory=inventory(),
        claims=kube,
        report_event=node_event_reporter(kube, node_name="node1"),
        proc_root=tmp / "proc",
        boot_id_path=tmp / "boot_id",
    )
    plugin.kubelet.claim_observer = observer
    plugin.start()
    return plugin


def test_over_grpc_the_kubelet_has_its_answer_before_the_claim_is_told(
    tmp_path: Path, kube: KubeClient, kubeapi: FakeKubeApi
) -> None:
    gate = threading.Event()
    observer = Recording(gate)
    plugin = observed_plugin(tmp_path, kube, observer)
    try:
        claim = kubeapi.add_claim(allocated_claim(name="c1", devices=["gpu-2"]))
        uid = claim["metadata"]["uid"]
        with grpc.insecure_channel(f"unix://{plugin.paths.dra}") as ch:
            stub = v1_grpc.DRAPluginStub(ch)
            # the observer is held: had the answer waited for it, this would time out
            answer = stub.NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[v1_claim(claim)]), timeout=5
            )
            assert [d.device_name for d in answer.claims[uid].devices] == ["gpu-2"]
            time.sleep(0.2)
            assert observer.calls == []
            gate.set()
            observer.wait_for(1)
            stub.NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=[v1_claim(claim)]), timeout=5
            )
            observer.wait_for(2)
        assert [(what, who, devices) for what, who, devices, _ in observer.calls] == [
            ("prepared", uid, (("node1", "gpu-2", None),)),
            ("unprepared", uid, (("node1", "gpu-2", None),)),
        ]
        # told by gRPC's server thread, not by the worker that built the answer
        assert not any(thread.startswith("dra-grpc") for *_, thread in observer.calls)
    finally:
        gate.set()
        plugin.stop()


def test_stop_tells_the_claims_whose_answers_ended_with_the_server(
    tmp_path: Path, kube: KubeClient
) -> None:
    observer = Recording()
    plugin = observed_plugin(tmp_path, kube, observer)
    told = plugin.kubelet._told  # an answer whose callback the stop cut off
    assert told is not None
    claim = ref("c")
    told.prepared(claim, (device("gpu-0"),))
    plugin.stop()
    assert [(what, uid) for what, uid, _, _ in observer.calls] == [("prepared", claim.uid)]
