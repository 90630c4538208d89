"""``python scripts/bench``: the benchmarks' command line (see ``bench/__init__.py``)."""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Python puts this folder first on sys.path; its modules are meant as ``bench.*``, not as
# top-level names (``bench/rows/cli.py`` must never stand in for another ``cli``).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent)]  # this checkout's fsdpcheck; ``bench``

from bench.main import main  # noqa: E402

sys.exit(main())
