"""The check's report: one JSON file and a summary a person reads, both in the ``--out``
directory. Pure text building (:func:`summary`) plus :func:`write`.

How to read it: docs/gpu-check.md. The JSON is also test data: a real run's report, committed as
``tests/data/real/<product>.json``, holds the simulated profile of that product to every field
the hardware answered (tests/test_gpucheck_real.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPORT_FILE = "gpu-check.json"
SUMMARY_FILE = "gpu-check.txt"
CONTAINER_SCRIPT = "container.sh"


def product_file_name(product_name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3.json``: the name under
    tests/data/real/ a real run's report is committed as."""
    return re.sub(r"[^a-z0-9]+", "-", product_name.lower()).strip("-") + ".json"


def _mark(entry: Mapping[str, Any]) -> str:
    if "error" in entry:
        return "FAIL"
    if "skipped" in entry:
        return "SKIP"
    if entry.get("ok") is False:
        return "FAIL"
    return "ok"


def summary(report: Mapping[str, Any]) -> str:
    """The report in a few lines per section: what ran, what failed, every difference."""
    sections = report["sections"]
    lines = [
        f"gpu-dra gpu-check {report['gpu_dra']} at {report['started_at']}"
        + (f" (simulated: {report['simulated']})" if report.get("simulated") else ""),
        f"wall time: {report['wall_s']} s; driver roots: "
        + (", ".join(report["driver_roots"]) or "none found"),
    ]
    for name, entry in sections.items():
        detail = entry.get("error") or entry.get("skipped") or ""
        lines.append(f"[{_mark(entry):>4}] {name} ({entry['seconds']} s) {detail}".rstrip())
    for gpu in report["gpus"]:
        facts = gpu["facts"]
        found = facts["discovery"]
        mode = facts["mig"]["mode"]
        lines.append(
            f"GPU {found['index']} (gpu-{found['minor']}): {gpu['product_name']}, "
            f"driver {found['driver_version']}, CUDA {found['cuda_driver_version']}, "
            f"MIG mode {mode.get('value', mode.get('error'))}, "
            f"{len(facts['devices']['static'])} device(s) published"
        )
        twin = gpu.get("twin", {})
        if twin.get("error"):
            lines.append(f"  simulated twin: {twin['error']}")
        elif "differences" in twin:
            diffs = twin["differences"]
            lines.append(f"  simulated twin {twin['spec']}: {len(diffs)} difference(s)")
            lines += [
                f"    {d['path']}: real {d['real']!r}, simulated {d['simulated']!r}" for d in diffs
            ]
    for root, scan in sections.get("driver_files", {}).items():
        if not isinstance(scan, dict):
            continue
        for script in scan.get("scripts", []):
            lines.append(f"  {root}: mounts a script as a program: {scan['host_paths'][script]}")
        for capabilities, spec in scan["specs"].items():
            missing = spec["missing_host_paths"]
            state = "every host path exists" if not missing else f"missing: {', '.join(missing)}"
            lines.append(f"  spec for {root} [{capabilities}]: {state}")
    load = sections.get("cuda_load", {})
    for step, result in load.get("steps", {}).items():
        lines.append(f"  cuda load {step}: rc {result['rc']}")
        lines += [f"    {line}" for line in result["output"][-12:]]
    lines += _mps_lines(sections.get("mps", {}))
    if report["gpus"] and not report.get("simulated"):
        name = product_file_name(report["gpus"][0]["product_name"])
        lines.append(f"as test data: tests/data/real/{name} (docs/gpu-check.md)")
    slowest = sorted(report.get("nvml_calls", []), key=lambda c: -c["ms"])[:5]
    if slowest:
        lines.append(
            "slowest NVML calls: " + ", ".join(f"{c['name']} {c['ms']} ms" for c in slowest)
        )
    return "\n".join(lines) + "\n"


def _mps_lines(entry: Mapping[str, Any]) -> list[str]:
    if "allowed" not in entry:
        return []
    allowed, reached = entry["allowed"], entry["reached"]
    gib = 1 << 30

    def size(n: int | None) -> str:
        return "-" if n is None else f"{n / gib:.2f} GiB"

    alone = reached["without_mps"]
    lines = [
        f"  mps daemon: {entry.get('daemon', {})}; quit: {entry['quit']}",
        *(
            f"  mps command {c['command']!r}: rc {c['rc']} {c['reply']}".rstrip()
            for c in entry.get("commands", [])
        ),
        f"  mps memory: allowed {size(allowed['memory_bytes'])}, client saw free "
        f"{size(reached['memory_free_seen_bytes'])} and allocated "
        f"{size(reached['allocated_bytes'])} (without MPS: {size(alone['allocated_bytes'])}); "
        f"enforced: {entry['enforced']['memory']}",
        f"  mps threads: allowed {allowed['thread_percentage']} %, SMs seen "
        f"{reached['context_sms']} of {reached['multiprocessors']}, kernel {reached['kernel_ms']}"
        f" ms (without MPS: {alone['kernel_ms']} ms); enforced: {entry['enforced']['threads']}",
    ]
    return lines


def write(report: Mapping[str, Any], out: Path) -> tuple[Path, Path]:
    """Write the report (without the container script, which goes beside it) and its summary
    into ``out`` (created); returns both paths."""
    out.mkdir(parents=True, exist_ok=True)
    body = dict(report)
    load = dict(body.get("sections", {}).get("cuda_load", {}))
    script = load.pop("script", None)
    if script is not None:
        (out / CONTAINER_SCRIPT).write_text(script)
        load["script"] = CONTAINER_SCRIPT
        body["sections"] = {**body["sections"], "cuda_load": load}
    report_path, summary_path = out / REPORT_FILE, out / SUMMARY_FILE
    report_path.write_text(json.dumps(body, indent=1, sort_keys=False) + "\n")
    summary_path.write_text(summary(body))
    return report_path, summary_path


__all__ = ["REPORT_FILE", "SUMMARY_FILE", "product_file_name", "summary", "write"]
