"""The first training step, rehearsed: the collectives each rank issues, agreed on before they
are issued, compared and named (``check_step``, ``audit --step``)."""
