"""One module per benchmark row; ``ROWS`` is the report's order, ``RUNNERS`` runs one by name."""

from __future__ import annotations

from collections.abc import Callable

from bench.result import Row
from bench.rows.audit import row_audit
from bench.rows.buffers import row_buffers
from bench.rows.cli import row_cli
from bench.rows.digests import row_digests
from bench.rows.gather import row_gather
from bench.rows.init import row_init
from bench.rows.load import row_load
from bench.rows.probe import row_probe
from bench.rows.run import row_run
from bench.rows.scale import row_scale
from bench.rows.source import row_source
from bench.rows.step import row_step
from bench.rows.trainer import row_trainer
from bench.rows.verdict import row_verdict
from bench.rows.weight_sync import row_weight_sync
from bench.settings import Settings

RUNNERS: dict[str, Callable[[Settings], Row]] = {
    "audit": row_audit,
    "init": row_init,
    "trainer": row_trainer,
    "cli": row_cli,
    "buffers": row_buffers,
    "load": row_load,
    "gather": row_gather,
    "scale": row_scale,
    "digests": row_digests,
    "probe": row_probe,
    "verdict": row_verdict,
    "step": row_step,
    "run": row_run,
    "source": row_source,
    "weight_sync": row_weight_sync,
}
ROWS = tuple(RUNNERS)
