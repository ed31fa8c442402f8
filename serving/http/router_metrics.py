"""The data-parallel router's /metrics: its own counters (`RouterStats`, per replica from
`ReplicaSet`) and each replica's series with a `replica` label, one family at a time as
Prometheus requires.
"""

from __future__ import annotations

import dataclasses
import re

from serving.http.replicas import ReplicaSet


@dataclasses.dataclass
class RouterStats:
    retries: int = 0
    unroutable: int = 0


def router_metrics(replicas: ReplicaSet, stats: RouterStats) -> str:
    lines = []

    def family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{labels} {value}" for labels, value in samples)

    rs = replicas.replicas
    family("jdet_router_replica_up", "gauge", "1 while the replica serves",
           [(f'{{replica="{r.index}"}}', float(r.ready and r.alive)) for r in rs])
    family("jdet_router_requests_total", "counter", "requests sent to the replica",
           [(f'{{replica="{r.index}"}}', float(r.routed)) for r in rs])
    family("jdet_router_replica_failures_total", "counter", "requests the replica was lost in",
           [(f'{{replica="{r.index}"}}', float(r.failed)) for r in rs])
    family("jdet_router_replica_restarts_total", "counter", "restarts of the replica",
           [(f'{{replica="{r.index}"}}', float(r.restarts)) for r in rs])
    family("jdet_router_in_flight", "gauge", "requests in flight at the replica",
           [(f'{{replica="{r.index}"}}', float(r.in_flight)) for r in rs])
    family("jdet_router_retries_total", "counter", "requests retried on another replica",
           [("", float(stats.retries))])
    family("jdet_router_unroutable_total", "counter", "requests no replica could take (503)",
           [("", float(stats.unroutable))])  # fmt: skip
    return "\n".join(lines) + "\n"


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)$")


def label_series(text: str, index: int) -> str:
    """A replica's Prometheus text with `replica="index"` added to every sample."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if line.startswith("#") or m is None:
            out.append(line)
            continue
        name, labels, rest = m.groups()
        inner = labels[1:-1] if labels else ""
        joined = f'replica="{index}"' + ("," + inner if inner else "")
        out.append(f"{name}{{{joined}}}{rest}")
    return "\n".join(out) + "\n"


def merge_families(parts: list[str]) -> str:
    """Concatenate exposition texts, each HELP/TYPE line once and a family's samples together
    (Prometheus refuses a family split in two)."""
    order: list[str] = []
    meta: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    current = ""
    for text in parts:
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                current = line.split()[2]
                if current not in meta:
                    order.append(current)
                    meta[current], samples[current] = [], []
                if line not in meta[current]:
                    meta[current].append(line)
            elif not line.startswith("#"):
                if current not in samples:
                    order.append(current)
                    meta[current], samples[current] = [], []
                samples[current].append(line)
    return "".join("\n".join(meta[f] + samples[f]) + "\n" for f in order)
