"""libgomp's idle spin for specloop's processes, set before torch loads libgomp.

Torch's own parallel ops run on libgomp, whose idle workers spin for 300,000 iterations (about a
millisecond here) after each parallel op before they sleep. Our native kernels run on workers of
their own (kernels/native/pool.h), and on a 2-core machine a spinning libgomp worker takes the
core that a kernel's worker needs: wherever torch ops and our kernels alternate (a learned
drafter's layers, the engine's prefill) the kernels ran up to 2x slower. Measured on a 2-core Xeon
(``infra.costs.measure_costs``, as the trainer's gate times them): a selfspec draft token cost
0.29-0.31 of a target step with the default spin and 0.17-0.20 with 10,000; a standalone one
0.24-0.25 and 0.12-0.13; a verify of 5 tokens 1.25-1.35 and 1.01-1.06.

Only where the user has not set GOMP_SPINCOUNT or OMP_WAIT_POLICY themselves; libgomp reads them
once, when it loads, so this must run before the first ``import torch``.
"""

from __future__ import annotations

import os

GOMP_SPINCOUNT = "10000"


def configure() -> None:
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
