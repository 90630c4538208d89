"""``--tp N``: the model's own transformers tensor-parallel plan on the mesh's ``tp`` dim, then
FSDP2 over its data dims, the way 2-D jobs are built (torchtitan's ``parallelize``: TP first,
then ``fully_shard`` on ``mesh["dp_shard"]``, or ``mesh["dp_replicate", "dp_shard"]`` for HSDP).

``config.base_model_tp_plan`` maps module name patterns under the base model (``layers.*.mlp
.up_proj``) to transformers' style names; the styles with a plain torch equivalent
(``ColwiseParallel`` / ``RowwiseParallel``, applied with ``parallelize_module``) are applied, and
a plan that names any other style is refused rather than approximated.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from fsdpcheck.errors import InputError
from fsdpcheck.options import DATA_DIMS

log = logging.getLogger(__name__)

# Dims across which a sub-mesh's siblings hold the same tensor: a parameter that tensor
# parallelism left alone is replicated over tp, so FSDP2 shards it over the data dims alone and
# each TP rank's copy lives on its own sibling sub-mesh.
_REPLICATED_DIMS = ("tp",)


# Replicated styles: every TP rank keeps the whole tensor, so FSDP2 over the data dims alone.
_REPLICATED = ("replicate", "replicated_with_grad_allreduce")


def _styles() -> dict[str, Callable[[], Any]]:
    """transformers' style names (transformers/distributed/tensor_parallel.py) as torch styles
    with the same input and output layouts."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    }


def sibling_root(mesh: Any) -> Any:
    """The root mesh of which ``mesh`` is one of several siblings across tp dims, each holding
    the same tensor; None when ``mesh`` has no such siblings."""
    root_of = getattr(mesh, "_get_root_mesh", None)  # private API: no sibling without it
    root = root_of() if callable(root_of) else None
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    root_names = tuple(getattr(root, "mesh_dim_names", None) or ()) if root is not None else ()
    if root is None or root is mesh or not names or not set(names) <= set(root_names):
        return None
    dropped = [n for n in root_names if n not in names]
    if not dropped or any(n not in _REPLICATED_DIMS for n in dropped):
        return None  # siblings across an ep (or any other) dim hold other tensors
    return root


def tp_size(mesh: Any) -> int:
    """The size of the mesh's ``tp`` dim (1 where it has none)."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return int(mesh["tp"].size()) if "tp" in names else 1


def data_mesh(mesh: Any) -> Any:
    """The dims FSDP2 shards over: ``dp_shard``, or (``dp_replicate``, ``dp_shard``) for HSDP; the
    whole mesh where it names no parallel dim (1-D, or positional replicate, shard)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if not any(n in names for n in DATA_DIMS):
        return mesh
    data = tuple(n for n in DATA_DIMS if n in names)
    return mesh[data] if data != names else mesh


def tp_plan(model: nn.Module, tp: int) -> dict[str, Any]:
    """Module name (under the model) → torch parallel style, from the model's own plan; an
    :class:`InputError` (one paragraph, naming the fix) when it has none, when a style has no
    torch equivalent, or when ``tp`` does not divide the attention heads."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None) if config is not None else None
    name = type(config).__name__ if config is not None else type(model).__name__
    if not plan:
        raise InputError(
            f"--tp {tp}: {name} has no tensor-parallel plan (config.base_model_tp_plan), so "
            "fsdpcheck cannot shard it over tp; audit it without --tp, or pass a --builder that "
            "applies your own plan."
        )
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % tp:
            raise InputError(
                f"--tp {tp}: {name}.{field} is {heads}, which {tp} tensor-parallel ranks cannot "
                f"split evenly; pick a --tp that divides {heads}."
            )
    styles = _styles()
    unknown = sorted({s for s in plan.values() if s not in styles and s not in _REPLICATED})
    if unknown:
        raise InputError(
            f"--tp {tp}: {name}'s plan uses {', '.join(map(repr, unknown))}, which fsdpcheck does "
            f"not map to torch's parallel styles (it maps {', '.join(sorted(styles))}); audit "
            "it with a --builder that applies the plan your trainer uses."
        )
    base = getattr(model, "base_model_prefix", "") or ""
    prefix = f"{base}." if base and hasattr(model, base) else ""
    found: dict[str, Any] = {}
    modules = dict(model.named_modules())
    for pattern, style in plan.items():
        if style in _REPLICATED:
            continue
        regex = re.compile(re.escape(prefix + pattern).replace(r"\*", r"[^.]+") + "$")
        for module_name in modules:
            if regex.match(module_name):
                found[module_name] = styles[style]()
    if not found:
        raise InputError(
            f"--tp {tp}: {name}'s plan names no module of this model (patterns "
            f"{', '.join(sorted(plan))}); audit it with a --builder that applies your own plan."
        )
    return found


def apply_tp(model: nn.Module, tp_mesh: Any, plan: Mapping[str, Any]) -> None:
    """``parallelize_module`` over ``plan``, each rank from its own values: no scatter from TP
    rank 0 (``src_data_rank=None``), so a rank still on ``meta`` is fine and no collective runs
    outside the audit's timeouts; the loader puts rank 0's weights in afterwards."""
    import inspect

    from torch.distributed.tensor.parallel import parallelize_module

    kwargs = {}
    if "src_data_rank" in inspect.signature(parallelize_module).parameters:
        kwargs["src_data_rank"] = None  # torch >= 2.6 scatters from TP rank 0 by default
    parallelize_module(model, tp_mesh, dict(plan), **kwargs)
    log.info("tensor parallel: %d modules over tp=%d", len(plan), tp_mesh.size())


def ep_problem(model: nn.Module, ep: int) -> str:
    """Why fsdpcheck cannot apply ``--ep`` to this model (always, for now): one paragraph."""
    config = getattr(model, "config", None)
    name = type(config).__name__ if config is not None else type(model).__name__
    plan = getattr(config, "base_model_ep_plan", None) if config is not None else None
    if not plan:
        return (
            f"--ep {ep}: {name} has no expert-parallel plan (config.base_model_ep_plan); audit "
            "it without --ep, or pass a --builder that places your experts."
        )
    styles = ", ".join(sorted(set(map(str, plan.values()))))
    return (
        f"--ep {ep}: {name}'s expert-parallel plan uses transformers' own styles ({styles}), "
        "which have no plain torch parallel style fsdpcheck could apply; --ep is not supported "
        "for this model: pass a --builder that builds your expert-parallel model on ctx.mesh "
        "(its ep dim), and fsdpcheck checks that."
    )


def shard(
    model: nn.Module, targets: list[tuple[str, nn.Module]], mesh: Any, *, cpu_offload: bool = False
) -> None:
    """The audit's wrap: the model's TP plan where the mesh has a ``tp`` dim over more than one
    rank, then ``fully_shard`` on ``targets`` over the data dims. Every problem is raised before
    the model is touched."""
    from fsdpcheck.model import wrap

    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "ep" in names and int(mesh["ep"].size()) > 1:
        raise InputError(ep_problem(model, int(mesh["ep"].size())))
    tp = tp_size(mesh)
    plan = tp_plan(model, tp) if tp > 1 else {}
    if plan:
        apply_tp(model, mesh["tp"], plan)
    wrap.apply(targets, data_mesh(mesh), cpu_offload=cpu_offload)
