"""``--tp N``: the model's own transformers tensor-parallel plan on the mesh's ``tp`` dim, then
FSDP2 over its data dims, the way 2-D jobs are built (torchtitan's ``parallelize``: TP first,
then ``fully_shard`` on ``mesh["dp_shard"]``, or ``mesh["dp_replicate", "dp_shard"]`` for HSDP).

``config.base_model_tp_plan`` maps module name patterns under the base model (``layers.*.mlp
.up_proj``) to transformers' style names; the styles with a plain torch equivalent
(``ColwiseParallel`` / ``RowwiseParallel``, applied with ``parallelize_module``) are applied, and
a plan that names any other style is refused rather than approximated.

``--ep N``: the model's own ``config.base_model_ep_plan`` applied with transformers' own
``apply_expert_parallelism`` (transformers 5.x; feature-detected), laid out as torchtitan lays
out expert parallelism: EP borrows its ranks from data parallelism. On a mesh
``(dp_replicate,) dp_shard, ep``:

- the experts' fused weights (``grouped_gemm``) are ``Shard(0)`` over ``ep`` (each EP rank its
  own experts, ``num_experts`` set to the local count), and the experts modules
  (``ep_dispatch_experts``) get transformers' all-to-all token dispatch; FSDP2 then shards each
  experts module over ``dp_shard`` (HSDP: ``dp_replicate, dp_shard``), with the gradient divided
  by every data rank and summed, not pre-multiplied (gloo has no PREMUL_SUM), as transformers'
  ``apply_fully_sharded_data_parallelism`` does for its ``efsdp`` mesh;
- every other parameter is FSDP2-sharded over ``dp_shard`` and ``ep`` together: the flattened
  ``dp_shard_ep`` dim (HSDP: ``dp_replicate, dp_shard_ep``), built with ``DeviceMesh._flatten``
  when the mesh is (:func:`ep_meshes`, a collective, before any stage can fail).

``--ep`` with ``--tp`` is refused for fsdpcheck's own wrap (a ``--builder`` can build it).
"""

from __future__ import annotations

import inspect
import logging
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fsdpcheck.errors import InputError
from fsdpcheck.model import wrap
from fsdpcheck.options import DATA_DIMS, TP_DIMS

log = logging.getLogger(__name__)


# Replicated styles: every TP rank keeps the whole tensor, so FSDP2 over the data dims alone.
_REPLICATED = ("replicate", "replicated_with_grad_allreduce")


def _styles() -> dict[str, Callable[[], Any]]:
    """transformers' style names (transformers/distributed/tensor_parallel.py) as torch styles
    with the same input and output layouts."""
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
    if not dropped or any(n not in TP_DIMS for n in dropped):
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

    kwargs = {}
    if "src_data_rank" in inspect.signature(parallelize_module).parameters:
        kwargs["src_data_rank"] = None  # torch >= 2.6 scatters from TP rank 0 by default
    parallelize_module(model, tp_mesh, dict(plan), **kwargs)
    log.info("tensor parallel: %d modules over tp=%d", len(plan), tp_mesh.size())


# transformers' expert-parallel styles (transformers/distributed/expert_parallel.py).
EP_STYLES = ("grouped_gemm", "ep_dispatch_experts")
_DISPATCH = "ep_dispatch_experts"
FLAT_DIM = "dp_shard_ep"  # dp_shard and ep flattened: what the non-expert parameters shard over
_LAYER_NUMBER = re.compile(r"\.\d+(\.|$)")


def wildcard(name: str) -> str:
    """``layers.3.mlp`` → ``layers.*.mlp``: a module list's indices as a plan's ``*`` (as
    transformers' ``replace_layer_number_by_wildcard``)."""
    return _LAYER_NUMBER.sub(lambda m: ".*" + m.group(1), name)


def expand_plan(
    plan: Mapping[str, str], modules: Iterable[tuple[str, Iterable[str]]]
) -> dict[str, str]:
    """A plan's patterns as concrete names, in the model's module order: each module's own
    parameters (to shard) before the module (to hook), as transformers' ``_expand_parallel_plan``
    lists them. ``modules``: (module name, its own parameter names)."""
    expanded: dict[str, str] = {}
    for module_name, params in modules:
        module_style = plan.get(wildcard(module_name))
        for param in params:
            name = f"{module_name}.{param}" if module_name else param
            style = plan.get(wildcard(name), module_style)
            if style is not None:
                expanded[name] = style
        if module_style is not None:
            expanded[module_name] = module_style
    return expanded


@dataclass(frozen=True)
class EpLayout:
    """Which dims of a mesh with an ``ep`` dim each part of the model is FSDP2-sharded over."""

    flatten: tuple[str, ...]  # flattened together into FLAT_DIM
    dense: tuple[str, ...]  # non-expert parameters (FSDP2; HSDP with dp_replicate)
    experts: tuple[str, ...]  # experts modules, after EP's Shard(0) over ep


def ep_layout(names: Iterable[str]) -> EpLayout | None:
    """torchtitan's layout: EP borrows its ranks from dp_shard; None without an ep dim."""
    names = tuple(names)
    if "ep" not in names:
        return None
    replicate = ("dp_replicate",) if "dp_replicate" in names else ()
    return EpLayout(("dp_shard", "ep"), (*replicate, FLAT_DIM), (*replicate, "dp_shard"))


@dataclass(frozen=True)
class EpMeshes:
    """The meshes ``--ep`` runs on, built when the job's mesh is (:func:`ep_meshes`)."""

    ep: Any
    tp: Any  # the ranks that share one batch: this rank alone (fsdpcheck's --ep has no tp)
    dense: Any
    experts: Any
    data_ranks: int  # every data-parallel rank: what an expert's gradient is divided by


def ep_size(mesh: Any) -> int:
    """The size of the mesh's ``ep`` dim (1 where it has none)."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return int(mesh["ep"].size()) if "ep" in names else 1


def ep_meshes(mesh: Any, override: Any = None) -> EpMeshes | None:
    """Collective on every rank of ``mesh``: the flattened ``dp_shard_ep`` dim and a one-rank
    tp mesh, for a mesh with an ``ep`` dim over more than one rank and no ``tp`` dim over more
    than one; None otherwise, or where this torch's DeviceMesh cannot flatten (then
    :func:`shard` refuses ``--ep``)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    layout = ep_layout(names)
    if layout is None or ep_size(mesh) < 2 or tp_size(mesh) > 1:
        return None
    if not all(callable(getattr(mesh, f, None)) for f in ("_flatten", "_unflatten")):
        log.info("DeviceMesh has no _flatten/_unflatten: --ep cannot be applied here")
        return None
    try:
        dense, tp = _ep_views(mesh, layout, override)
    except Exception:  # private API: then --ep is refused with one paragraph, never a crash
        log.debug("DeviceMesh could not flatten: --ep cannot be applied", exc_info=True)
        return None
    ranks = 1
    for n in names:
        ranks *= int(mesh[n].size())
    return EpMeshes(
        ep=mesh["ep"],
        tp=tp,
        dense=dense,
        experts=mesh[layout.experts],
        data_ranks=ranks,
    )


def _ep_views(mesh: Any, layout: EpLayout, override: Any = None) -> tuple[Any, Any]:
    """(the mesh non-experts shard over, a tp mesh of this rank alone). ``override``: the
    flattened dim's group ``(backend, options)``, so it carries the run's timeout."""
    # private API (torch >= 2.4), detected
    flatten = mesh[layout.flatten]._flatten
    if override is not None and "backend_override" in inspect.signature(flatten).parameters:
        flat = flatten(FLAT_DIM, backend_override=override)
    else:  # torch before 2.7: the flattened group takes the default group's options
        flat = flatten(FLAT_DIM)
    dense = flat
    if layout.dense != (FLAT_DIM,):
        with warnings.catch_warnings():  # HSDP: the flattened dim under dp_replicate, by name
            warnings.filterwarnings("ignore", "Slicing a flattened dim", UserWarning)
            dense = mesh[layout.dense]
    if "tp" in (mesh.mesh_dim_names or ()):
        return dense, mesh["tp"]
    # transformers' dispatch takes the ranks that share one batch as a mesh: here, one rank.
    ep = ep_size(mesh)
    return dense, mesh["ep"]._unflatten(0, (ep, 1), ("ep_groups", "ep_batch"))["ep_batch"]


def _config_name(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return type(config).__name__ if config is not None else type(model).__name__


_EP_FIX = "pass a --builder that builds your expert-parallel model on ctx.mesh (its ep dim)"


def ep_problem(model: nn.Module, ep: int, *, tp: int = 1) -> str:
    """Why fsdpcheck cannot apply ``--ep`` to this model: one paragraph, naming the fix; "" when
    it can (:func:`ep_plan`)."""
    name = _config_name(model)
    fix = _EP_FIX
    if tp > 1:
        return (
            f"--ep {ep} with --tp {tp}: fsdpcheck's own wrap applies expert parallelism with "
            f"data parallelism only, not with tensor parallelism; drop --tp, or {fix}."
        )
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_ep_plan", None) if config is not None else None
    if not plan:
        return (
            f"--ep {ep}: {name} has no expert-parallel plan (config.base_model_ep_plan); audit "
            "it without --ep, or pass a --builder that places your experts."
        )
    try:  # transformers 5 only, and only with --ep (a --builder model needs no transformers)
        from transformers.distributed.expert_parallel import apply_expert_parallelism  # noqa: F401
    except ImportError:
        import transformers

        return (
            f"--ep {ep}: transformers {transformers.__version__} has no expert parallelism "
            "(transformers.distributed.expert_parallel, in transformers 5); upgrade "
            f"transformers, or {fix}."
        )
    unknown = sorted({str(s) for s in plan.values() if s not in EP_STYLES})
    if unknown:
        return (
            f"--ep {ep}: {name}'s expert-parallel plan uses {', '.join(map(repr, unknown))}, "
            f"which fsdpcheck does not apply (it applies {', '.join(EP_STYLES)}); {fix}."
        )
    params = dict(model.named_parameters())
    for param, style in ep_plan(model).items():
        if style != _DISPATCH and param in params:
            experts = int(params[param].shape[0])
            if experts % ep:
                return (
                    f"--ep {ep}: {param} holds {experts} experts, which {ep} expert-parallel "
                    f"ranks cannot split evenly; pick an --ep that divides {experts}."
                )
    return ""


def ep_plan(model: nn.Module) -> dict[str, str]:
    """The model's ``base_model_ep_plan`` as concrete names under the model (parameters before
    their module)."""
    config = getattr(model, "config", None)
    plan = dict(getattr(config, "base_model_ep_plan", None) or {})
    base = getattr(model, "base_model_prefix", "") or ""
    prefix = f"{base}." if base and hasattr(model, base) else ""
    rules = {prefix + k: v for k, v in plan.items()}
    modules = (
        (name, [p for p, _ in module.named_parameters(recurse=False)])
        for name, module in model.named_modules()
    )
    return expand_plan(rules, modules)


def apply_ep(
    model: nn.Module, meshes: EpMeshes, plan: Mapping[str, str], *, cpu_offload: bool = False
) -> list[tuple[str, nn.Module]]:
    """transformers' ``apply_expert_parallelism`` over ``plan`` (no collective: each rank keeps
    its own chunk, ``src_data_rank=None``), then FSDP2 on each experts module over the expert
    data dims; the experts modules, which the dense wrap must leave alone."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism  # see ep_problem

    try:
        apply_expert_parallelism(model, meshes.ep, meshes.tp, dict(plan))
    except TypeError as exc:  # another transformers 5.x signature: the fix is the same
        log.debug("apply_expert_parallelism refused its arguments", exc_info=True)
        raise InputError(
            f"--ep {meshes.ep.size()}: this transformers' apply_expert_parallelism does not take "
            f"(model, ep_mesh, tp_mesh, plan) ({exc}); {_EP_FIX}."
        ) from exc
    experts = [(n, model.get_submodule(n)) for n, s in plan.items() if s == _DISPATCH]
    wrap.apply(experts, meshes.experts, cpu_offload=cpu_offload)
    shards = int(meshes.experts["dp_shard"].size())
    for _, module in experts:
        # Each expert's gradient sums the tokens of every data rank: divide by all of them. A
        # factor other than the group size is a PREMUL_SUM, which gloo rejects: sum, then
        # divide locally. With dp_shard 1 there is no reduce-scatter and FSDP2 divides locally
        # already, so a forced sum would divide twice. Both or neither: a factor without the
        # forced sum would fail the step on gloo.
        divide = getattr(module, "set_gradient_divide_factor", None)
        force_sum = getattr(module, "set_force_sum_reduction_for_comms", None)
        if callable(divide) and (shards == 1 or callable(force_sum)):
            divide(float(meshes.data_ranks))
            if shards > 1:
                force_sum(True)
        else:
            log.warning(
                "this torch's FSDP2 cannot divide %s's gradient by all %d data ranks: a --step "
                "scales the experts' gradients by dp_shard alone",
                type(module).__name__,
                meshes.data_ranks,
            )
    log.info(
        "expert parallel: %d experts modules over ep=%d, FSDP2 over %s",
        len(experts),
        meshes.ep.size(),
        meshes.experts.mesh_dim_names,
    )
    return experts


def shard(
    model: nn.Module,
    targets: list[tuple[str, nn.Module]],
    mesh: Any,
    *,
    cpu_offload: bool = False,
    ep_meshes: EpMeshes | None = None,
) -> tuple[str, ...]:
    """The audit's wrap: the model's TP plan where the mesh has a ``tp`` dim over more than one
    rank, or its EP plan where it has an ``ep`` dim over more than one (``ep_meshes``: built
    with the mesh), then ``fully_shard`` on ``targets`` over the data dims. Every problem is
    raised before the model is touched. Returns the experts modules sharded first (--ep)."""
    ep, tp = ep_size(mesh), tp_size(mesh)
    if ep > 1:
        problem = ep_problem(model, ep, tp=tp)
        if not problem and ep_meshes is None:
            problem = (
                f"--ep {ep}: this torch's DeviceMesh cannot flatten dp_shard and ep into one dim "
                f"(DeviceMesh._flatten), which the non-expert parameters shard over; {_EP_FIX}."
            )
        if problem:
            raise InputError(problem)
        experts = apply_ep(model, ep_meshes, ep_plan(model), cpu_offload=cpu_offload)
        done = {id(m) for _, m in experts}
        rest = [(n, m) for n, m in targets if id(m) not in done]
        wrap.apply(rest, ep_meshes.dense, cpu_offload=cpu_offload)
        return tuple(n for n, _ in experts)
    plan = tp_plan(model, tp) if tp > 1 else {}
    if plan:
        apply_tp(model, mesh["tp"], plan)
    wrap.apply(targets, data_mesh(mesh), cpu_offload=cpu_offload)
    return ()
