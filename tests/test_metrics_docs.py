"""docs/metrics.md against the dashboard files it describes (charts/gpu-dra/dashboards/*.json and
the template that ships them): its variable and panel tables say exactly what the files have, so
that the page cannot describe a panel or a variable the chart does not ship (issue 35)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "gpu-dra"
DOC = REPO / "docs" / "metrics.md"
SECTION = "## Chart: PodMonitor and Grafana dashboard"
# The agent's series, by prefix: its own, NVIDIA's driver names and the DCGM-compatible ones.
SERIES = re.compile(r"\b(?:gpu_dra|nvidia_dra|DCGM_FI)_[A-Za-z0-9_]+\b")


def section() -> str:
    text = DOC.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start : end if end >= 0 else None]


def table(text: str, header: tuple[str, ...]) -> list[list[str]]:
    """The rows of the Markdown table whose header row starts with ``header``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if tuple(cells[: len(header)]) == header:
            rows = []
            for row in lines[i + 2 :]:  # past the |---| line
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip().strip("|").split("|")])
            return rows
    raise AssertionError(f"docs/metrics.md has no table headed {header} under {SECTION!r}")


def dashboards() -> list[Path]:
    found = sorted((CHART / "dashboards").glob("*.json"))
    assert found
    return found


def panels(board: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(row title, panel) of every panel, in the file's order; a collapsed row keeps its panels
    inside it."""
    found = []
    row = ""
    for panel in board["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            found += [(row, inner) for inner in panel.get("panels", ())]
        else:
            found.append((row, panel))
    return found


def queried_series(panel: dict[str, Any]) -> set[str]:
    return {name for t in panel.get("targets", ()) for name in SERIES.findall(t.get("expr", ""))}


def test_the_doc_names_each_dashboard_file_and_its_uid() -> None:
    text = section()
    for path in dashboards():
        board = json.loads(path.read_text())
        assert f"`charts/gpu-dra/dashboards/{path.name}`" in text
        assert f"uid `{board['uid']}`" in text


def test_each_dashboard_file_is_shipped_by_the_chart_unchanged() -> None:
    templates = "".join(p.read_text() for p in (CHART / "templates").glob("*.yaml"))
    for path in dashboards():
        assert f'.Files.Get "dashboards/{path.name}"' in templates


def test_the_variable_table_is_the_dashboards_variables() -> None:
    (path,) = dashboards()  # the tables describe one dashboard; a second needs its own
    board = json.loads(path.read_text())
    documented = table(section(), ("variable", "what it picks"))
    variables = board["templating"]["list"]
    assert [row[0] for row in documented] == [f"`{v['name']}`" for v in variables]
    for row, variable in zip(documented, variables, strict=True):
        query = variable.get("query")
        if isinstance(query, dict):
            assert f"`{query['query']}`" in row[1], (variable["name"], row[1])
        if variable.get("includeAll") and variable.get("allValue"):
            assert f"`{variable['allValue']}`" in row[1], (variable["name"], row[1])


def test_the_panel_table_is_the_dashboards_rows_panels_and_series() -> None:
    (path,) = dashboards()
    board = json.loads(path.read_text())
    documented = table(section(), ("row", "panel", "shows", "series"))
    in_file = panels(board)
    assert [(row[0], row[1]) for row in documented] == [(r, p["title"]) for r, p in in_file]
    for row, (_, panel) in zip(documented, in_file, strict=True):
        named = set(re.findall(r"`([^`]+)`", row[3]))
        assert named == queried_series(panel), panel["title"]
        assert named or not panel.get("targets"), f"{panel['title']}: no series of the agent's"
