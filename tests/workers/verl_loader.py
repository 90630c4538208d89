"""verl's own released ``fsdp2_load_full_state_dict``, run as one more loader job of
:mod:`fsdpcheck.children.loaders` (the same ranks, stages, records and classifier).

The function comes from verl's wheels, downloaded by ``make install`` into ``.venv/verl-wheels``
(``VERL_VERSIONS`` in the Makefile): ``--loader verl-0.7.1`` runs 0.7.1's, before verl's PR #6405
(one broadcast per buffer in ``named_buffers()`` order), ``verl-0.8.0`` runs 0.8.0's (sorted by
name). Why not ``import verl``: ``verl/__init__.py`` and ``verl/utils/fsdp_utils.py`` import Ray,
tensordict, FSDP1 internals and verl's model registry, none of which the function touches. So the
function's own source is taken from the wheel with ``ast``, byte for byte, and run with the
names it uses: ``torch``, ``torch.distributed``, ``packaging.version`` and ``get_device_id``,
which comes from the wheel's own ``verl/utils/device.py`` (it imports only torch and packaging;
on a host without CUDA it returns ``"cpu"``).
"""

from __future__ import annotations

import ast
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / ".venv" / "verl-wheels"
VERSIONS = ("0.7.1", "0.8.0")
FUNCTION = "fsdp2_load_full_state_dict"


def wheel(release: str) -> Path:
    return WHEELS / f"verl-{release}-py3-none-any.whl"


def function_source(release: str) -> str:
    """The function's source exactly as the wheel ships it."""
    with zipfile.ZipFile(wheel(release)) as z:
        source = z.read("verl/utils/fsdp_utils.py").decode()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == FUNCTION:
            segment = ast.get_source_segment(source, node)
            assert segment is not None
            return segment
    raise LookupError(f"verl {release}: no {FUNCTION} in verl/utils/fsdp_utils.py")


def released_loader(release: str) -> Any:
    import torch
    import torch.distributed as dist
    from packaging import version

    with zipfile.ZipFile(wheel(release)) as z:
        device_source = z.read("verl/utils/device.py").decode()
    device = types.ModuleType(f"verl_{release.replace('.', '_')}_device")
    exec(compile(device_source, f"{wheel(release)}/verl/utils/device.py", "exec"), device.__dict__)
    names = {
        "torch": torch,
        "dist": dist,
        "version": version,
        "get_device_id": device.get_device_id,
    }
    filename = f"{wheel(release)}/verl/utils/fsdp_utils.py"
    exec(compile(function_source(release), filename, "exec"), names)
    return names[FUNCTION]


def _runner(release: str):
    def run_verl(run: Any) -> Any:
        from fsdpcheck.checks.observed import LOADING
        from fsdpcheck.children.loaders import _audit_built

        load = released_loader(release)
        model = _audit_built(run)  # rank 0 real, the others on meta, fully_shard: as verl
        run.stage(LOADING)
        load(model, dict(run.source) if run.source is not None else {})
        return model

    return run_verl


RUNNERS = {f"verl-{release}": _runner(release) for release in VERSIONS}


if __name__ == "__main__":
    from fsdpcheck.children.loaders import main

    sys.exit(main(sys.argv[1:], runners=RUNNERS))
