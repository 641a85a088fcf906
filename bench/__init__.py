"""geofed benchmarks: synthetic workload traces and their files.

`generate` turns a `WorkloadConfig` into trace ops (DESIGN §4); `write_trace`
and `read_trace_file` store and load them as JSON Lines or Parquet.
"""

from .workload import (
    SCENARIOS,
    TraceSummary,
    WorkloadConfig,
    generate,
    read_trace_file,
    write_trace,
)

__all__ = [
    "SCENARIOS",
    "TraceSummary",
    "WorkloadConfig",
    "generate",
    "read_trace_file",
    "write_trace",
]
