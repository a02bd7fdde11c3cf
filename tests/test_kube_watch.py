"""kube/watch.py through the real client: a watch's events, its end, and closing it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from dra_driver.errors import (
    KubeGone,
    KubeUnavailable,
)
from dra_driver.kube import KubeClient
from dra_driver.sim.localapi import FakeKubeApi
from tests.kubedata import DRIVER, slice_body


@pytest.fixture
def kube(kubeapi: FakeKubeApi) -> Iterator[KubeClient]:
    assert kubeapi.kubeconfig_path is not None
    client = KubeClient.from_config(kubeconfig=kubeapi.kubeconfig_path, timeout_s=2)
    yield client
    client.close()


def test_watch_reports_creates_and_deletes_and_close_unblocks_it(
    kubeapi: FakeKubeApi, kube: KubeClient
) -> None:
    start = kube.list_slices(driver_name=DRIVER, node_name="node1").resource_version
    stream = kube.watch_slices(
        driver_name=DRIVER, node_name="node1", resource_version=start, timeout_s=30
    )
    seen: list[tuple[str, str]] = []

    def read() -> None:
        for event in stream:
            seen.append((event.type, event.object["spec"]["nodeName"]))

    reader = threading.Thread(target=read)
    reader.start()
    kube.create_slice(slice_body("node2"))  # filtered out by the field selector
    stored = kube.create_slice(slice_body("node1"))
    kubeapi.delete_slices(node_name="node1")
    deadline = time.monotonic() + 5
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    began = time.monotonic()
    stream.close()
    reader.join(5)
    assert not reader.is_alive()
    assert time.monotonic() - began < 1.0
    assert seen == [("ADDED", "node1"), ("DELETED", "node1")]
    assert stored["metadata"]["name"]


def test_a_watch_from_a_compacted_version_raises_gone(
    kubeapi: FakeKubeApi, kube: KubeClient
) -> None:
    start = kube.list_slices(driver_name=DRIVER, node_name="node1").resource_version
    kube.create_slice(slice_body())
    kubeapi.compact()
    with (
        kube.watch_slices(
            driver_name=DRIVER, node_name="node1", resource_version=start, timeout_s=5
        ) as stream,
        pytest.raises(KubeGone, match="too old resource version"),
    ):
        list(stream)


def test_a_watch_broken_by_the_server_raises_unavailable_and_closes_cleanly(
    kubeapi: FakeKubeApi, kube: KubeClient
) -> None:
    start = kube.list_slices(driver_name=DRIVER, node_name="node1").resource_version
    stream = kube.watch_slices(
        driver_name=DRIVER, node_name="node1", resource_version=start, timeout_s=30
    )
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            list(stream)
            outcome.append(None)
        except BaseException as exc:  # recorded and asserted below
            outcome.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.1)
    kubeapi.kill_connections()  # the API server goes away mid-watch (no final chunk)
    reader.join(5)
    assert not reader.is_alive()
    (error,) = outcome
    assert isinstance(error, KubeUnavailable), repr(error)
    assert "watch resourceslices" in str(error)
    # The reader's cleanup closes the stream after the break, and so may stop() from another
    # thread: neither may raise (a raise here killed the publisher's watch thread).
    stream.close()
    stream.close()
