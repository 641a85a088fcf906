"""The Spark analysis behind ``geofed analyze``: what each routing strategy costs.

Needs the ``analysis`` extra (pyspark, pandas, pyarrow, h3, matplotlib);
importing this package imports pyspark, so the broker, the client and the
rest of `geofed.bench` never do. The command line is
`geofed.bench.analyze`.

* `analyze` runs the job described by an `AnalysisConfig` in a SparkSession
  (`build_session` makes one as the command line does) and returns an
  `Analysis`: a JSON-able summary and the message tables; `Progress`
  prints its stages; `load_federation` checks the federation file before any
  JVM starts;
* `write_outputs` writes summary.json, the Parquet tables and the plots into
  a folder or URI (`out_check` refuses a non-empty one first,
  `storage_options` configures the driver's writes from Spark's ``fs.s3a.*``
  settings), `print_table` the summary as a table;
* the DataFrame -> DataFrame steps the job is made of (reading numbered
  lines, subscription state over time, matching), each testable on small
  hand-made frames;
* the executors' vectorized geometry (no Spark), which answers exactly as
  `geofed.routing` does: responsible broker, geofence cover, H3 cells, topic
  filters.

See README.md, section "Analysis" for inputs, outputs and the node message
trace format.
"""

from geofed.routing import h3_cover

from ._fs import join, out_check, storage_options
from ._geo import (
    FederationIndex,
    FilterMatcher,
    choose_resolution,
    covers_many,
    extent_km,
    h3_cell,
    h3_parent_int,
)
from ._io import LINE_BITS, read_numbered
from ._job import Analysis, AnalysisConfig, Progress, analyze, load_federation
from ._match import (
    h3_parent,
    subscriber_locations,
    with_step_index,
    world_positions,
    world_steps,
)
from ._report import print_table, write_outputs
from ._session import build_session, is_local, package_zip
from ._state import (
    accepted_subscription_ops,
    rehomings,
    segments,
    subscription_message_sources,
    version_rehomings,
    versions,
)

__all__ = [
    # the job
    "Analysis",
    "AnalysisConfig",
    "Progress",
    "analyze",
    "build_session",
    "load_federation",
    "is_local",
    "package_zip",
    # its outputs
    "join",
    "out_check",
    "print_table",
    "storage_options",
    "write_outputs",
    # the steps (DataFrame -> DataFrame)
    "LINE_BITS",
    "accepted_subscription_ops",
    "h3_parent",
    "read_numbered",
    "rehomings",
    "segments",
    "subscriber_locations",
    "subscription_message_sources",
    "version_rehomings",
    "versions",
    "with_step_index",
    "world_positions",
    "world_steps",
    # the executors' geometry (no Spark)
    "FederationIndex",
    "FilterMatcher",
    "choose_resolution",
    "covers_many",
    "extent_km",
    "h3_cell",
    "h3_cover",
    "h3_parent_int",
]
