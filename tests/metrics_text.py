"""Reading Prometheus text in tests: scrape an endpoint (or render a registry) into samples that
can be compared before and after some traffic.

    before = Samples.parse(text)
    ...
    assert after.delta(before, "edgefire_router_placements_total", kind="split") == 1
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(slots=True)
class Samples:
    values: dict[tuple[str, frozenset], float]

    @classmethod
    def parse(cls, text: str) -> Samples:
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[(sample.name, frozenset(sample.labels.items()))] = sample.value
        return cls(values)

    def names(self) -> set[str]:
        return {name for name, _ in self.values}

    def get(self, name: str, **labels) -> float:
        """The sum over every series of `name` whose labels include `labels` (0 when there is none)."""
        wanted = set(labels.items())
        return sum(value for (n, have), value in self.values.items() if n == name and wanted <= have)

    def delta(self, before: Samples, name: str, **labels) -> float:
        return self.get(name, **labels) - before.get(name, **labels)

    def series(self, name: str) -> list[dict]:
        """The label sets of every series of `name`."""
        return [dict(labels) for n, labels in self.values if n == name]
