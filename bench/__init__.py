"""Tools around a running federation: workloads, trace files, local runs, benchmarks.

* `generate` turns a `WorkloadConfig` into trace ops; `write_trace` and
  `read_trace_file` store and load them (JSON Lines or Parquet);
* `LocalFederation` runs one node process per broker on loopback;
* `Replayer` plays a trace through real clients (`geofed.client`);
* `scrape`, `metric`, `peer_message_counts` and `wait_quiescent` read the
  nodes' Prometheus metrics (the last one is the quiescence barrier;
  `Quiescence` is the same barrier across broker restarts);
* `History` records acknowledged publishes and deliveries of a live run and
  checks them against the oracle (`Report`: lost, duplicated, unexpected);
  `FaultProxy` cuts or flaps a peer link; `geofed.bench.faults` injects
  faults under load (``python -m geofed.bench.faults``);
* `geofed.bench.brokers` starts Debian's Mosquitto and nats-server on
  loopback (``Mosquitto``, ``NatsServer``) for side-by-side runs
  (``python -m geofed.bench.brokers_bench``) and bridges;
* ``geofed bench`` / ``geofed demo`` (`geofed.bench.compare`) and the node
  and index benchmarks build on them; the Spark analysis is its own
  subpackage, `geofed.bench.analysis` (``geofed analyze``; the ``analysis``
  extra), never imported from here.
"""

from .faultproxy import FaultProxy
from .history import History, Report
from .local import LocalFederation, LocalNode, free_ports
from .replay import Replayer
from .scrape import (
    Quiescence,
    delivered,
    metric,
    peer_message_counts,
    scrape,
    wait_quiescent,
)
from .trace import TraceSummary, read_ops, read_trace_file, write_trace
from .workload import SCENARIOS, WorkloadConfig, generate

__all__ = [
    # workloads and trace files
    "SCENARIOS",
    "TraceSummary",
    "WorkloadConfig",
    "generate",
    "read_ops",
    "read_trace_file",
    "write_trace",
    # a local federation and its clients
    "LocalFederation",
    "LocalNode",
    "Replayer",
    "free_ports",
    # the nodes' metrics
    "delivered",
    "metric",
    "peer_message_counts",
    "Quiescence",
    "scrape",
    "wait_quiescent",
    # fault injection and its history checker
    "FaultProxy",
    "History",
    "Report",
]
