"""The chart's alerts (charts/gpu-dra/rules/gpu-dra-alerts.yaml): promtool checks them and runs
their unit tests (tests/prometheus/*.yaml); every alert is tested firing and clearing; the
chart's PrometheusRule carries exactly that file."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_chart import HELM, render, render_error

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "charts" / "gpu-dra" / "rules" / "gpu-dra-alerts.yaml"
UNIT_TESTS = sorted((REPO / "tests" / "prometheus").glob("*.yaml"))
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not on PATH: install Debian's prometheus package (.ci/run does)",
)


def alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def test_the_rules_have_the_alerts_the_chart_promises() -> None:
    assert [a["alert"] for a in alerts()] == [
        "GpuDraGpuLost",
        "GpuDraFatalXid",
        "GpuDraDoubleBitEccError",
        "GpuDraRowRemapFailed",
        "GpuDraThermalSlowdown",
        "GpuDraDeviceTainted",
        "GpuDraAgentNotReady",
        "GpuDraAgentAbsent",
        "GpuDraTelemetryStale",
        "GpuDraPrepareErrors",
        "GpuDraUnprepareErrors",
        "GpuDraXidBurst",
    ]
    for alert in alerts():
        assert alert["labels"]["severity"] in ("critical", "warning"), alert["alert"]
        assert {"summary", "description"} <= set(alert["annotations"]), alert["alert"]


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    result = promtool("check", "rules", str(RULES), cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


@needs_promtool
@pytest.mark.parametrize("unit", UNIT_TESTS, ids=[p.name for p in UNIT_TESTS])
def test_promtool_unit_tests_pass(unit: Path) -> None:
    result = promtool("test", "rules", unit.name, cwd=unit.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_unit_tested_firing_and_clearing() -> None:
    fired: dict[str, list[tuple[str, bool]]] = {}
    for unit in UNIT_TESTS:
        spec = yaml.safe_load(unit.read_text())
        assert [str((unit.parent / f).resolve()) for f in spec["rule_files"]] == [str(RULES)]
        for case in spec["tests"]:
            for check in case.get("alert_rule_test", []):
                fired.setdefault(check["alertname"], []).append(
                    (check["eval_time"], bool(check["exp_alerts"]))
                )
    for alert in alerts():
        checks = fired.get(alert["alert"], [])
        firing = [i for i, (_, fires) in enumerate(checks) if fires]
        assert firing, f"{alert['alert']}: no unit test expects it to fire"
        assert any(not fires for _, fires in checks[firing[0] + 1 :]), (
            f"{alert['alert']}: no unit test expects it to clear after firing"
        )


@pytest.mark.skipif(HELM is None, reason="helm not on PATH nor at .tools/bin/helm")
def test_the_chart_ships_the_rules_file_as_an_optional_prometheus_rule() -> None:
    assert not [o for o in render() if o["kind"] == "PrometheusRule"]  # off by default
    objects = render(
        "--set", "metrics.prometheusRule.enabled=true",
        "--set", "metrics.prometheusRule.labels.release=kps",
    )  # fmt: skip
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    error = render_error("--set", "metrics.prometheusRule.enabled=true", "--set", "metricsPort=0")
    assert "metrics.prometheusRule.enabled needs metricsPort" in error
