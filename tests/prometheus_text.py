"""Reading a /metrics answer back with prometheus-client's own parser (which refuses text
that is not the exposition format)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def total(text: str, name: str, **labels: str) -> float | None:
    """The sum of `name`'s samples whose labels include `labels`; None when none has them."""
    found = [value for sample_name, sample_labels, value in samples(text)
             if sample_name == name and labels.items() <= sample_labels.items()]  # fmt: skip
    return sum(found) if found else None
