"""``stepprof report``: stream one or more logs into figures and diagnoses.

One pass over each log, in bounded memory (each run's records go into a
:class:`~stepprof._aggregate.RunAggregate`).  The modules, in the order data flows:

- :mod:`.read`: a log into runs (:class:`~.read.RunBoundaries`, shared with
  ``stepprof plot``), read in parallel byte ranges when it is large;
- :mod:`.sweeps`: the log's sweep records back into sweep results;
- :mod:`.build`: each run's tables, roofline and diagnoses, and the cross-rank view,
  into the records of :mod:`.model` (``--json`` prints them as they are);
- :mod:`.diagnose`: one function per diagnosis;
- :mod:`.render`: the records as text.
"""

from __future__ import annotations

from .build import build_report
from .model import Report
from .render import render

__all__ = ["Report", "build_report", "render"]
