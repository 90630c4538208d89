"""fsdpcheck's benchmarks (``make bench``): each comparison measured side by side in one run.

Every row runs its variants interleaved (A, B, A, B, ...) so that drift on a shared machine hits
both alike, takes the median of the repeats, and reports the ratio and the raw figures. Ranks are
started by ``fsdpcheck.children.launch`` with the env:// variables and ``OMP_NUM_THREADS=1``
(as torchrun sets it). Writes ``docs/benchmarks.md`` and ``scripts/bench/results.json`` (the raw
figures, which ``--merge`` reads back).

    .venv/bin/python scripts/bench                  # every row, 3 repeats (make bench)
    .venv/bin/python scripts/bench --quick          # smoke run: 1 repeat, a smaller model
    .venv/bin/python scripts/bench --only load      # one row (repeatable)

``--quick`` and ``--only`` write to a temporary directory unless ``--out`` is given, so a smoke
run never replaces the committed figures.

Layout: ``rows/`` holds one module per row (``ROWS`` in ``rows/__init__.py`` names them in
report order), ``workers/`` the scripts each rank or child process runs, and the modules here
what the rows share: ``settings`` (paths, environment, one run's settings), ``result`` (a row and
its lines), ``measure`` (launching, collecting and summarising runs), ``text`` (formatting),
``machine`` (the host), ``markdown`` and ``store`` (the two outputs), ``main`` (the command).
"""
