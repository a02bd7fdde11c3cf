"""Reading a Prometheus text exposition in tests, with prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Series:
    """Every line of ``text``: (sample name, its labels) -> value. Raises on a malformed line."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(series: Series, name: str, **labels: str) -> float | None:
    """The value of ``name{labels}`` (exactly these labels), or None."""
    return series.get((name, frozenset(labels.items())))


def find(series: Series, name: str, **labels: str) -> dict[frozenset[tuple[str, str]], float]:
    """Every ``name`` line whose labels include ``labels``: label set -> value."""
    wanted = set(labels.items())
    return {got: v for (sample, got), v in series.items() if sample == name and wanted <= set(got)}


def types(text: str) -> dict[str, str]:
    """Metric name as written in the exposition -> its # TYPE."""
    out = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            out[name] = kind
    return out
