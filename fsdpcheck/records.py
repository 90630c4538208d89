"""Plain, frozen records that travel between ranks and into the JSON report.

Every record round-trips through JSON (``to_dict`` / ``from_dict``); nothing here is pickled.
Fields that hold a word of :mod:`fsdpcheck.vocab` are typed with its Enum: the JSON carries the
plain value, and ``from_dict`` turns it back into the member.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, TypeVar

from fsdpcheck.vocab import (
    Agreement,
    BufferReason,
    Cause,
    ChildStage,
    ErrorKind,
    ExitCode,
    FindingKind,
    InitValues,
    LoaderFailure,
    LoaderVerdict,
    LoadMethod,
    LoadStatus,
    MemoryPeak,
    ModelKind,
    ScanFamily,
    SeedFailure,
    Snapshot,
    Stage,
    SyncDifference,
    Verdict,
    Wrapper,
    WrapSource,
)

SCHEMA = "fsdpcheck.report/2"


def _declare(**classes: Mapping[Agreement, str]) -> dict[str, Agreement]:
    return {
        f"{cls}.{name}": agreement
        for cls, by_agreement in classes.items()
        for agreement, names in by_agreement.items()
        for name in names.split()
    }


_EVERY, _REPLICAS = Agreement.EVERY_RANK, Agreement.REPLICAS
_PROCESS, _INFO = Agreement.PER_PROCESS, Agreement.INFORMATIONAL

# The one model of what may differ between ranks: every field of the per-rank record and of the
# records it holds, as "Class.field", declared as one of fsdpcheck.vocab.Agreement. The group
# digest (compared), the value digests and mesh layout, and the last-resort check (unexplained)
# all read it; tests/unit/test_invariant.py fails on a field it does not declare, and mutates
# each declared field in turn. docs/checks.md has it as a table, with why.
AGREEMENT: Mapping[str, Agreement] = _declare(
    RankRecord={
        _EVERY: "env pre_wrap post_wrap error fsdp_plan config misplaced ties uninitialized "
        "non_finite source checkpoint launch wrappers modules numerics optimizer",
        # Which ranks are replicas and where this rank's DTensors live: who is compared with
        # whom, not what they hold (expert groups, HSDP shard groups differ by design). What of
        # the meshes must agree is compared per parameter (the REPLICAS fields of MeshRecord).
        _PROCESS: "shard_key peer_key sibling_key meshes",
        # Host and CUDA memory differ per rank by nature (rank 0 holds the full model under
        # rank-0 loading); the memory check reads the numbers, they are never compared raw.
        _INFO: "memory",
    },
    EnvRecord={
        _EVERY: "backend python torch transformers accelerate nccl cuda",
        _PROCESS: "rank local_rank host",
        # The world size is one number for one process group; the hash seed's order under
        # other seeds is the probe's question (hash-seed), not a difference by itself.
        _INFO: "world_size hash_seed",
    },
    Fingerprint={_EVERY: "snapshot buffers params state_dict_keys aliases"},
    TensorRecord={
        _EVERY: "name shape dtype persistent placements requires_grad non_finite",
        # Values and devices only where both ranks hold values (on meta there are none), and
        # shards only between replicas of one shard (fsdpcheck.checks.value.value_digests).
        _REPLICAS: "digest device",
        # Uneven shards (the last rank may hold fewer rows); the mesh by this rank's id for it.
        _PROCESS: "local_shape mesh",
        _INFO: "head",  # the first values, a hint: the digest carries the values
    },
    MeshRecord={
        # Per parameter: shape and dim names always; the global ranks where the mesh spans the
        # job, else between ranks that share it (each sub-mesh's rank list differs by design).
        _REPLICAS: "shape dim_names ranks",
        _PROCESS: "id coordinate family",
    },
    NonFinite={_EVERY: "name snapshot count buffer"},
    RankError={_EVERY: "rank stage message kind"},  # an error is its own group
    FsdpGroupRecord={
        _EVERY: "modules params param_dtype reduce_dtype output_dtype cast_forward_inputs "
        "reshard_after_forward offload pin_memory mesh_shape mesh_dim_names mesh_device_type",
        # Which policy fields this torch keeps nowhere fsdpcheck looks: unknown, not unset, and
        # a property of the torch release (compared by the env check), not of the rank.
        _INFO: "unread",
    },
    FsdpPlanRecord={_EVERY: "groups unavailable"},
    ConfigRecord={_EVERY: "digest canonical"},  # canonical: no paths, no addresses
    TieRecord={_EVERY: "snapshot shared expected buffers"},
    ModuleKind={_EVERY: "cls training hooks settings"},  # settings: no addresses, paths, ranks
    ModuleStateRecord={_EVERY: "kinds modules global_hooks"},
    NumericsRecord={_EVERY: "flags"},
    BufferProblem={
        _EVERY: "name snapshot reason",
        # Garbage differs per rank, and so may the line that wrote the rest; the problem itself
        # is compared.
        _INFO: "got expected detail",
    },
    # Where a rank built from: per-node paths differ by design, and what the files hold is
    # compared (config, tensors); a child job standing for the rank builds the same.
    SourceRecord={_PROCESS: "path", _INFO: "model dtype"},
    CheckpointRecord={
        _EVERY: "path step metadata shard_files saved_ranks problem index",
        # As the rank was given it: a LATEST root and its step directory are one resume.
        _INFO: "given",
    },
    # Normalised before any digest (fsdpcheck.distributed.environment.launch_record): the
    # rank's own numbers, host, pid and memory addresses become placeholders, per-host
    # variables and the launcher's own arguments (a Ray worker's) are left out.
    LaunchRecord={_EVERY: "argv env", _PROCESS: "numbers"},
    WrapperRecord={_EVERY: "modules renamed"},
    WrappedModule={_EVERY: "name how"},
    Renamed={_EVERY: "level names keys"},
    OptimizerRecord={_EVERY: "cls groups states scheduler resumed checkpoint_entries"},
    ParamGroupRecord={_EVERY: "index params hyper"},
    OptimizerState={_EVERY: "param group scalars tensors"},
    OptimizerTensor={
        _EVERY: "key shape dtype placements",
        # Like a parameter's: between replicas of one shard, or every peer where unsharded
        # (fsdpcheck.checks.value.value_digests); uneven shards differ in size by design.
        _REPLICAS: "digest",
        _PROCESS: "local_shape",
    },
    SchedulerRecord={_EVERY: "cls last_epoch step_count lrs"},
    ResumeMismatch={_EVERY: "param field loaded saved"},
    MemoryRecord={
        _INFO: "rank method stages process_peak current cuda_peak cuda_current model_bytes "
        "shard_bytes trimmed"
    },
    StageMemory={_INFO: "stage start peak end cuda_start cuda_peak"},
)

# Never compared: the fields that may differ between ranks that agree.
NOT_COMPARED = frozenset(k for k, a in AGREEMENT.items() if a in (_PROCESS, _INFO))


T = TypeVar("T")


def to_dict(record: Any) -> Any:
    """A JSON-ready view of a record (dataclasses, tuples and mappings, recursively)."""
    if isinstance(record, Enum):
        return record.value
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {f.name: to_dict(getattr(record, f.name)) for f in dataclasses.fields(record)}
    if isinstance(record, (list, tuple)):
        return [to_dict(item) for item in record]
    if isinstance(record, Mapping):
        return {str(key): to_dict(value) for key, value in record.items()}
    return record


def from_dict(cls: type[T], data: Any) -> T:
    """Rebuild a record of type ``cls`` from :func:`to_dict` output."""
    return _convert(cls, data)


def _convert(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(options) == 1:
            return _convert(options[0], value)
        for option in options:  # the first that takes the value, e.g. LoadMethod | Literal[""]
            if _is_word(option) and value in option._value2member_map_:
                return option(value)
        return value
    if _is_word(hint):
        return hint(value)  # ValueError for a word this version does not know
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ValueError(f"{value!r}: expected one of {typing.get_args(hint)}")
        return value
    if dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        known = {f.name for f in dataclasses.fields(hint)}
        return hint(**{k: _convert(hints[k], v) for k, v in value.items() if k in known})
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], item) for item in value)
        return tuple(_convert(arg, item) for arg, item in zip(args, value, strict=True))
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        args = typing.get_args(hint)
        if len(args) != 2:
            return dict(value)
        key = int if args[0] is int else (lambda k: k)  # JSON keys are always strings
        return {key(k): _convert(args[1], v) for k, v in value.items()}
    return value


def _is_word(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, Enum)


# The REPLICAS fields, by where they are compared: through the value digests
# (fsdpcheck.checks.value.value_digests), where both ranks hold values (on meta a tensor has
# neither, and ranks > 0 of --init rank0 must not split off); per parameter through the mesh it
# lives on (mesh_layout, in the group digest; named by the placement check).
IN_VALUE_DIGEST = frozenset(
    k
    for k, a in AGREEMENT.items()
    if a is _REPLICAS and k.startswith(("TensorRecord.", "OptimizerTensor."))
)
IN_MESH_LAYOUT = frozenset(
    k for k, a in AGREEMENT.items() if a is _REPLICAS and k.startswith("MeshRecord.")
)

# Fields compared by what they say rather than their raw value: a non-finite count of None (the
# values were not read, e.g. on meta) and of 0 both say "no NaN or Inf seen", and how many NaN
# a rank holds is the finding's detail, not a second difference.
COMPARED_AS: Mapping[str, Callable[[Any], Any]] = {"TensorRecord.non_finite": bool}


def compared(record: Any) -> Any:
    """:func:`to_dict` of ``record`` without the fields the group digest leaves out:
    :data:`NOT_COMPARED`, :data:`IN_VALUE_DIGEST` and a rank's error (an error is its own
    digest)."""
    if isinstance(record, Enum):
        return record.value
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        name = type(record).__name__
        return {
            f.name: compared(COMPARED_AS.get(f"{name}.{f.name}", _same)(getattr(record, f.name)))
            for f in dataclasses.fields(record)
            if AGREEMENT.get(f"{name}.{f.name}", _EVERY) is _EVERY
            and f"{name}.{f.name}" != "RankRecord.error"
        }
    if isinstance(record, (list, tuple)):
        return [compared(item) for item in record]
    if isinstance(record, Mapping):
        return {str(key): compared(value) for key, value in record.items()}
    return record


def _same(value: Any) -> Any:
    return value


def _canonical(view: Any) -> str:
    return json.dumps(view, sort_keys=True, separators=(",", ":"), default=repr)


def short_digest(*parts: str, size: int = 16) -> str:
    h = hashlib.blake2b(digest_size=size)
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


@dataclass(frozen=True)
class TensorRecord:
    """One parameter or buffer as one rank sees it, in iteration order."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    persistent: bool | None = None  # buffers only
    digest: str | None = None  # of the values, when materialised (not on meta)
    placements: tuple[str, ...] | None = None  # DTensor placements, after wrapping
    local_shape: tuple[int, ...] | None = None  # this rank's shard, after wrapping
    head: tuple[str, ...] | None = None  # first values ("%.6g"), when materialised: a hint only
    requires_grad: bool | None = None  # parameters only
    mesh: str | None = None  # DTensors: the id of the MeshRecord their mesh is (RankRecord.meshes)
    # NaN and ±Inf elements among the values digested (the local shard, for DTensors); None
    # where they were not read. A buffer of only 0 and ±inf (an attention mask) counts 0.
    non_finite: int | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def layout(self) -> tuple:
        """What must agree across ranks (not values, devices or per-rank shard sizes)."""
        return (self.name, self.shape, self.dtype, self.persistent, self.placements)


@dataclass(frozen=True)
class Fingerprint:
    """A rank's tensors at one stage of the audit (``pre-wrap`` or ``post-wrap``)."""

    snapshot: Snapshot  # PRE_WRAP or POST_WRAP
    buffers: tuple[TensorRecord, ...]
    params: tuple[TensorRecord, ...]
    state_dict_keys: tuple[str, ...] = ()  # ``model.state_dict()`` order, as loaders walk it
    # Tied weights: (name, the parameter it is), for names named_parameters() deduplicates.
    aliases: tuple[tuple[str, str], ...] = ()

    def layout_digest(self) -> str:
        return short_digest(
            self.snapshot,
            repr([t.layout() for t in self.buffers]),
            repr([t.layout() for t in self.params]),
            repr(self.state_dict_keys),
            repr([t.requires_grad for t in self.params]),
            repr(self.aliases),
        )


@dataclass(frozen=True)
class EnvRecord:
    """A rank's environment, from an allowlist only (no arbitrary variables, no secrets)."""

    rank: int
    local_rank: int
    world_size: int
    host: str
    backend: str
    python: str
    torch: str
    transformers: str | None
    hash_seed: str  # PYTHONHASHSEED as set, or "random"
    accelerate: str | None = None  # installed version, when installed
    nccl: str | None = None  # torch.cuda.nccl.version(), when torch has NCCL
    cuda: str | None = None  # torch.version.cuda (None on CPU builds)

    def versions(self) -> tuple[str | None, ...]:
        """In the order of ``fsdpcheck.checks.layout.ENV_FIELDS``."""
        return (
            self.python,
            self.torch,
            self.transformers,
            self.backend,
            self.accelerate,
            self.nccl,
            self.cuda,
        )

    def _digest_part(self) -> str:
        return repr(self.versions())


@dataclass(frozen=True)
class MeshRecord:
    """A DeviceMesh this rank's DTensors live on: its global ranks and this rank's place on it.
    ``id`` is equal on every rank of the same mesh (same shape, same ranks) and on no other."""

    id: str
    shape: tuple[int, ...]
    ranks: tuple[int, ...]  # ``mesh.mesh`` flattened, row-major: the global ranks
    coordinate: tuple[int, ...] | None = None  # this rank's place (None: not on this mesh)
    dim_names: tuple[str, ...] | None = None
    # Equal on each TP rank's sibling sub-mesh (the same data dims of one root mesh, across tp):
    # they hold the same tensor, cut alike. None: the mesh has no such siblings.
    family: str | None = None


@dataclass(frozen=True)
class NonFinite:
    """A tensor holding NaN or ±Inf, counted outside a fingerprint (after the audit's load)."""

    name: str
    snapshot: Snapshot
    count: int  # NaN and ±Inf elements in this rank's values (its local shard for a DTensor)
    buffer: bool = False

    def digest_part(self) -> str:
        # The count stays out, as buffer problems' values do: which tensors, not how many.
        return repr((self.name, str(self.snapshot), self.buffer))


@dataclass(frozen=True)
class RankError:
    rank: int
    stage: Stage
    message: str
    kind: ErrorKind = ErrorKind.RUNTIME


@dataclass(frozen=True)
class FsdpGroupRecord:
    """One FSDP2 parameter group: what ``fully_shard`` was applied to and how."""

    modules: tuple[str, ...]  # names of the module(s) passed to fully_shard ("" = the root)
    params: tuple[str, ...]  # names of the parameters it manages
    param_dtype: str | None = None  # MixedPrecisionPolicy
    reduce_dtype: str | None = None
    output_dtype: str | None = None
    cast_forward_inputs: bool | None = None
    reshard_after_forward: bool | int | None = None  # int: the world size it reshards to
    offload: str | None = None  # offload policy class, e.g. "OffloadPolicy", "CPUOffloadPolicy"
    pin_memory: bool | None = None  # CPUOffloadPolicy only
    mesh_shape: tuple[int, ...] | None = None
    mesh_dim_names: tuple[str, ...] | None = None
    mesh_device_type: str | None = None
    # Fields this torch keeps where fsdpcheck could not find them: never compared (an unread
    # value is not an equal one), and said in the report's warnings.
    unread: tuple[str, ...] = ()


@dataclass(frozen=True)
class FsdpPlanRecord:
    """A rank's live FSDP2 plan, read after wrapping. Fields the installed torch does not
    expose are ``None``; ``groups`` come in ``named_modules()`` order."""

    groups: tuple[FsdpGroupRecord, ...]
    unavailable: str | None = None  # why the plan could not be read (private API changed)

    def digest(self) -> str:
        return short_digest(json.dumps(to_dict(self), sort_keys=True, separators=(",", ":")))


@dataclass(frozen=True)
class ConfigRecord:
    """A rank's resolved model config: ``canonical`` is its ``to_dict()`` with volatile keys
    (versions, paths, attention backends) dropped and secret-looking values redacted."""

    digest: str
    canonical: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TieRecord:
    """Which parameter names share storage on one rank at one stage, and which ties the model's
    config asks for (``tie_word_embeddings``, ``_tied_weights_keys``). Names sorted."""

    snapshot: Snapshot  # PRE_WRAP, POST_WRAP or LOAD
    shared: tuple[tuple[str, ...], ...] = ()  # groups of two or more names on one storage
    expected: tuple[tuple[str, str], ...] = ()  # (tied name, its source)
    # The buffer side of ties: groups of names (buffers, and parameters sharing with a buffer)
    # on one storage, any view of it: a write to one is seen through the others.
    buffers: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class ModuleKind:
    """What modules hold beyond their tensors that changes what they compute: the module's own
    class (FSDP2's ``FSDP<class>`` left out), its ``training`` flag, its hooks as
    ``"<kind>:<qualified name>"`` in the order they run (FSDP2's and TP's own left out: the wrap
    plan and placements compare them), and its non-tensor scalar attributes (``eps``, ``p``,
    head counts, ``scaling``, an activation function's qualified name) as ``(name, text)``,
    sorted. Never an address, a device or a rank."""

    cls: str
    # None where nothing the module computes depends on it (model/module_state.mode_matters)
    training: bool | None = True
    hooks: tuple[str, ...] = ()
    settings: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ModuleStateRecord:
    """Every module's :class:`ModuleKind`, each distinct kind stored once: ``modules`` is
    ``(qualified module name, index into kinds)`` in ``named_modules()`` order, so a model of
    a hundred alike layers holds a few kinds, not a hundred. ``global_hooks``: hooks registered
    for every module (``register_module_forward_hook`` and the like)."""

    kinds: tuple[ModuleKind, ...] = ()
    modules: tuple[tuple[str, int], ...] = ()
    global_hooks: tuple[str, ...] = ()

    def by_name(self) -> dict[str, ModuleKind]:
        """Each module's kind (an index no kind has, from a damaged record, names none)."""
        return {
            name: self.kinds[index] for name, index in self.modules if 0 <= index < len(self.kinds)
        }


@dataclass(frozen=True)
class NumericsRecord:
    """Process-wide switches that change what kernels compute, as ``(name, text)`` in a fixed
    order: TF32 and reduced-precision matmul, cuDNN, deterministic algorithms, the default
    dtype, the SDPA backends enabled, autocast per device type. A switch this torch does not
    have reads ``"unavailable"``."""

    flags: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class BufferProblem:
    """A buffer whose value is not what its module computes, or is garbage (NaN, Inf, denormal)."""

    name: str
    snapshot: Snapshot  # PRE_WRAP, POST_WRAP or LOAD
    reason: BufferReason
    got: tuple[str, ...] = ()  # first values on this rank ("%.6g")
    expected: tuple[str, ...] = ()  # first values of the reference, for "differs"
    detail: str = ""  # "unwritten": where to_empty() ran and what wrote the other tensors


@dataclass(frozen=True)
class SourceRecord:
    """What a rank built its model from, as it resolved it: what a child job that stands for
    the rank (``--reproduce``) builds in turn."""

    model: str  # --model as given on the rank
    path: str | None = None  # the directory it resolved to on the rank's host (None: a preset)
    dtype: str | None = None  # the dtype it built in


@dataclass(frozen=True)
class CheckpointRecord:
    """The checkpoint a rank resumed from (``check_model(checkpoint=)``, ``audit --resume``),
    as the rank itself resolved and read it; nothing in it is unpickled."""

    given: str  # the path as the rank was given it
    path: str | None = None  # its realpath, after a LATEST/latest file (None: not found)
    step: int | None = None  # from the resolved directory's name (step-100, global_step100, ...)
    metadata: str | None = None  # digest of DCP's ``.metadata`` bytes (None: no such file)
    shard_files: int | None = None  # ``*.distcp`` files in the directory
    saved_ranks: int | None = None  # ranks that wrote them (``__R_*.distcp``): world size at save
    problem: str | None = None  # why the rank could not read it (missing, not a directory, ...)
    # What ``metadata`` digests: ".metadata" (DCP), "trainer_state.json" (an HF Trainer
    # checkpoint-N), "zip directory" (a torch.save/Lightning .ckpt file), "file bytes"; None: none.
    index: str | None = None


@dataclass(frozen=True)
class ParamGroupRecord:
    """One optimizer param group: its parameters by name and every other setting by name, as
    text that compares exactly (``repr`` of a float; a tensor lr as its value)."""

    index: int
    params: tuple[str, ...]
    hyper: tuple[tuple[str, str], ...]  # (key, text), sorted by key


@dataclass(frozen=True)
class OptimizerTensor:
    """One tensor of a parameter's optimizer state (``exp_avg``, ``momentum_buffer``)."""

    key: str
    shape: tuple[int, ...]  # global (a DTensor's whole)
    dtype: str
    placements: tuple[str, ...] | None = None  # a DTensor's (FSDP2: sharded like its parameter)
    local_shape: tuple[int, ...] | None = None  # this rank's shard
    digest: str | None = None  # of this rank's local values


@dataclass(frozen=True)
class OptimizerState:
    """A parameter's optimizer state on one rank (absent: the parameter has none)."""

    param: str  # its name in model.named_parameters() ("#group.index" where the model lacks it)
    group: int
    scalars: tuple[tuple[str, str], ...] = ()  # (key, text): ``step`` and other single values
    tensors: tuple[OptimizerTensor, ...] = ()


@dataclass(frozen=True)
class SchedulerRecord:
    """An lr scheduler's position: what resumes must carry on."""

    cls: str
    last_epoch: int
    step_count: int | None = None  # ``_step_count``
    lrs: tuple[str, ...] = ()  # ``get_last_lr()``, as text


@dataclass(frozen=True)
class ResumeMismatch:
    """Where the loaded optimizer (or scheduler) differs from the checkpoint's."""

    param: str  # the parameter ("" for the scheduler)
    field: str  # exp_avg, step, last_epoch, ...
    loaded: str  # "absent", "all zero", "3"
    saved: str  # "non-zero", "100"


@dataclass(frozen=True)
class OptimizerRecord:
    """A rank's optimizer (``check_model(optimizer=)``): param groups, per-parameter state and
    the lr scheduler; with a checkpoint, where the loaded state falls short of the saved one."""

    cls: str
    groups: tuple[ParamGroupRecord, ...] = ()
    states: tuple[OptimizerState, ...] = ()
    scheduler: SchedulerRecord | None = None
    resumed: tuple[ResumeMismatch, ...] = ()
    # The checkpoint's optimizer entries compared with this optimizer's (None: none read).
    checkpoint_entries: int | None = None


# What a rank's own rank, local rank or node rank became in its launch record (r1.json →
# r<rank>.json on rank 1): written by fsdpcheck.distributed.environment, read by checks.launch.
RANK_WORD = "<rank>"
HOST_WORD = "<host>"  # ... and its host name (EnvRecord.host)


@dataclass(frozen=True)
class LaunchRecord:
    """How a rank was started: its command line (secret-looking values redacted, the program
    by its base name) and an allowlist of the launcher, torch and NCCL variables that change
    behaviour (see ``fsdpcheck.distributed.environment.LAUNCH_VARIABLES``); nothing else."""

    argv: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    # This process's own rank, local rank and node rank: where argv or env say <rank>, the rank
    # had one of these there (for the launch check to compare ranks word by word).
    numbers: tuple[int, ...] = ()


@dataclass(frozen=True)
class WrappedModule:
    """A module activation checkpointing or ``torch.compile`` wraps on one rank."""

    name: str  # as named_modules() names it, wrapper levels left out ("" = the root)
    how: Wrapper


@dataclass(frozen=True)
class Renamed:
    """A wrapper level in a rank's tensor names (``_orig_mod``, ``_checkpoint_wrapped_module``;
    ``module`` for a DDP root): how many parameter and buffer names, and state-dict keys, hold it.
    Loaders see these raw names; the checks pair tensors without them."""

    level: str
    names: int
    keys: int


@dataclass(frozen=True)
class WrapperRecord:
    """Which modules a rank checkpoints or compiles, and the levels wrappers add to its names."""

    modules: tuple[WrappedModule, ...] = ()  # named_modules() order
    renamed: tuple[Renamed, ...] = ()


@dataclass(frozen=True)
class ExpertKey:
    """Where a rank's expert parameters sit (fsdpcheck.checks.expert): ``place``, its position
    inside its expert-parallel slot (mesh shape, coordinates along sharded non-EP dims);
    ``slot``, which slot (the coordinates along EP dims, or the mesh's global ranks);
    ``digest``, of their values (None: not read, e.g. on meta)."""

    place: str
    slot: str
    digest: str | None = None


@dataclass(frozen=True)
class StageMemory:
    """One rank's memory over one stage (build, wrap, load), in bytes: host RSS on entering,
    its peak over the stage and on leaving; CUDA allocated on entering and its peak (None where
    the rank did not use CUDA)."""

    stage: Stage
    start: int
    peak: int
    end: int
    cuda_start: int | None = None
    cuda_peak: int | None = None

    @property
    def growth(self) -> int:
        """What the stage itself added at its peak, above what the rank held before it
        (imports and the interpreter cost every rank alike, and stay out)."""
        return max(0, self.peak - self.start)


@dataclass(frozen=True)
class MemoryRecord:
    """One rank's memory over the audit's build, wrap and load stages (``stages``), or, from
    ``check_model``, the process's peak so far and its RSS at the check (it cannot see where the
    script's own stages began). ``method`` says how the peaks were read. ``model_bytes``: the
    model in full (every tensor's global numel x element size); ``shard_bytes``: what this rank
    holds of it after wrapping (its local shards)."""

    rank: int
    method: MemoryPeak
    stages: tuple[StageMemory, ...] = ()
    process_peak: int | None = None  # check_model: host peak RSS over the process's life so far
    current: int | None = None  # check_model: host RSS at the check
    cuda_peak: int | None = None  # check_model: torch.cuda.max_memory_allocated so far
    cuda_current: int | None = None
    model_bytes: int | None = None
    shard_bytes: int | None = None
    # check_model: ``current`` was read after glibc's malloc_trim handed back the free memory
    # malloc kept resident (False: no malloc_trim here, what it keeps counts as held).
    trimmed: bool | None = None


@dataclass(frozen=True)
class RankRecord:
    """Everything one rank contributes to the gather."""

    env: EnvRecord
    pre_wrap: Fingerprint | None = None
    post_wrap: Fingerprint | None = None
    error: RankError | None = None
    fsdp_plan: FsdpPlanRecord | None = None  # after wrapping
    config: ConfigRecord | None = None
    # "name:device" of this rank's tensors on a device its job cannot use, as the rank itself
    # judged them (fsdpcheck.checks.flags.misplaced): in the digest, so such a rank sends its
    # record even when its layout agrees.
    misplaced: tuple[str, ...] = ()
    ties: tuple[TieRecord, ...] = ()  # per stage: which names share storage
    uninitialized: tuple[BufferProblem, ...] = ()  # buffers that are not what the module computes
    # Equal on ranks that must hold the same local shards: the same device mesh (its ranks) and
    # the same place on its non-Replicate dims, for every sharded parameter (see checks/value.py).
    shard_key: str | None = None
    # Equal on ranks whose unsharded tensors must agree: the same set of device meshes (None:
    # no DTensor, so every such rank).
    peer_key: str | None = None
    # Equal on ranks that hold the same local shards of what tensor parallelism left whole (on a
    # TP sibling sub-mesh, or Replicate along tp: checks.value.tp_whole), whatever their TP
    # coordinate (None: none).
    sibling_key: str | None = None
    meshes: tuple[MeshRecord, ...] = ()  # the meshes this rank's DTensors live on
    non_finite: tuple[NonFinite, ...] = ()  # NaN/Inf counted after the audit's load
    source: SourceRecord | None = None  # the audit's build (None: a training script's model)
    checkpoint: CheckpointRecord | None = None  # what the rank resumed from (None: not given)
    launch: LaunchRecord | None = None  # how the rank was started (None: not recorded)
    wrappers: WrapperRecord | None = None  # checkpointed and compiled modules (None: not read)
    modules: ModuleStateRecord | None = None  # training flags, hooks, settings (None: not read)
    numerics: NumericsRecord | None = None  # process-wide numerics switches (None: not read)
    optimizer: OptimizerRecord | None = None  # check_model(optimizer=) (None: not given)
    memory: MemoryRecord | None = None  # host and CUDA memory so far (None: not read)

    def non_finite_tensors(self) -> tuple[NonFinite, ...]:
        """Every tensor this rank holds NaN or Inf in: its fingerprints' counts, then those
        counted after the audit's load."""
        found = [
            NonFinite(t.name, fp.snapshot, t.non_finite, buffer=is_buffer)
            for fp in self.fingerprints()
            for is_buffer, tensors in ((True, fp.buffers), (False, fp.params))
            for t in tensors
            if t.non_finite
        ]
        return (*found, *self.non_finite)

    def group_digest(self) -> str:
        """Equal for ranks that must be treated alike: every field :data:`AGREEMENT` declares
        every-rank (same layouts, versions, state flags, wrap plan, config, launch, ties and
        buffer problems, no error). Values and devices are the value digests' (see
        :func:`fsdpcheck.checks.value.value_digests`): ranks on meta hold none."""
        if self.error is not None:
            error = self.error
            return short_digest("error", str(self.env.rank), error.stage, error.message, error.kind)
        view = compared(self)
        # Buffer problems come in whatever order each rank found them; what counts is which.
        view["uninitialized"] = sorted(view["uninitialized"], key=_canonical)
        view["mesh_layout"] = mesh_layout(self)
        return short_digest(_canonical(view))

    def fingerprints(self) -> tuple[Fingerprint, ...]:
        return tuple(fp for fp in (self.pre_wrap, self.post_wrap) if fp is not None)


def param_mesh(record: RankRecord, t: TensorRecord) -> MeshRecord | None:
    """The mesh ``t`` (one of ``record``'s parameters) lives on, where the record has it."""
    if t.mesh is None:
        return None
    return next((m for m in record.meshes if m.id == t.mesh), None)


def spans_job(record: RankRecord, mesh: MeshRecord) -> bool:
    """The mesh holds every rank of the job: its rank list is the same on every rank."""
    return len(mesh.ranks) == record.env.world_size


def mesh_layout(record: RankRecord) -> list:
    """What every rank must agree on about the meshes its parameters live on after wrapping
    (in :meth:`RankRecord.group_digest`): per such parameter, by name, its mesh's shape and dim
    names, and its global ranks where the mesh spans the job. The rank list of a sub-mesh
    (an HSDP replica group, each TP rank's sibling, each expert group) differs per rank by
    design, so it stays out; the placement check compares it where two ranks share one."""
    if record.post_wrap is None or not record.meshes:
        return []
    by_id = {m.id: m for m in record.meshes}
    index: dict[str, int] = {}
    meshes: list = []
    per_param = []
    for t in record.post_wrap.params:
        mesh = by_id.get(t.mesh) if t.mesh is not None else None
        if mesh is None:
            continue
        if mesh.id not in index:
            index[mesh.id] = len(meshes)
            ranks = list(mesh.ranks) if spans_job(record, mesh) else None
            meshes.append([list(mesh.shape), list(mesh.dim_names or ()), ranks])
        per_param.append([t.name, index[mesh.id]])
    return [meshes, per_param]


@dataclass(frozen=True)
class ValueKeys:
    """Per rank, what the value check (:mod:`fsdpcheck.checks.value`) compares, as the gather's
    slots carry it; None where a rank holds none."""

    values: dict[int, str | None]  # digest of what must agree on every peer
    replicas: dict[int, str | None] = field(default_factory=dict)  # of its local shards
    shard_keys: dict[int, str | None] = field(default_factory=dict)  # which shards it holds
    # RankRecord.peer_key: unsharded values are compared among equal keys only (None: all peers).
    peer_keys: dict[int, str | None] | None = None
    # RankRecord.sibling_key and the digest of its local shards of what tensor parallelism left
    # whole (fsdpcheck.model.keys.sibling_digest), compared among equal keys.
    sibling_keys: dict[int, str | None] | None = None
    siblings: dict[int, str | None] | None = None


@dataclass(frozen=True)
class Gathered:
    """What rank 0 holds after the gather: every rank's digest and host, and one record per
    distinct digest (keyed by its representative, the lowest rank with that digest)."""

    digests: dict[int, str]
    hosts: dict[int, str]
    records: dict[int, RankRecord]
    bytes_sent: int  # by this rank
    meta_ranks: tuple[int, ...] = ()  # ranks whose tensors were on meta before loading
    value_keys: ValueKeys | None = None  # what the value check compares; None: not gathered
    extra: dict[int, RankRecord] | None = None  # records of value senders that are no group's
    # Per rank, where its experts sit and their digest (fsdpcheck.checks.expert); None: none.
    expert_keys: dict[int, ExpertKey | None] | None = None
    # Per rank, its hash-seed tag (fsdpcheck.checks.hash_seed.seed_tag): 0 where hash
    # randomisation is on; equal tags for equal PYTHONHASHSEED values.
    seed_tags: dict[int, int] | None = None

    @property
    def errors(self) -> tuple[RankError, ...]:
        found = (r.error for r in self.records.values() if r.error is not None)
        return tuple(sorted(found, key=lambda e: e.rank))


@dataclass(frozen=True)
class Group:
    """Ranks whose records share one digest; ``representative`` is the lowest rank."""

    ranks: tuple[int, ...]
    digest: str
    hosts: tuple[str, ...] = ()

    @property
    def representative(self) -> int:
        return self.ranks[0]


@dataclass(frozen=True)
class Finding:
    """One cross-rank difference; ``kind`` and ``cause`` are words of :mod:`fsdpcheck.vocab`."""

    kind: FindingKind
    ranks: tuple[int, ...]
    reference_rank: int
    snapshot: Snapshot
    cause: Cause
    summary: str
    tensors: tuple[str, ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def about(
        cls,
        kind: FindingKind,
        ranks: Iterable[int],
        reference_rank: int,
        summary: str,
        *,
        snapshot: Snapshot | None = None,
        cause: Cause | None = None,
        tensors: Iterable[str] = (),
        details: Mapping[str, Any] | None = None,
    ) -> Finding:
        """A ``kind`` finding on ``ranks`` against ``reference_rank``'s, seen at the kind's usual
        snapshot for its usual cause (:data:`USUAL`) unless told otherwise."""
        usual_snapshot, usual_cause = USUAL.get(kind, (None, None))
        snapshot, cause = snapshot or usual_snapshot, cause or usual_cause
        if snapshot is None or cause is None:
            raise ValueError(f"a {kind} finding says its own snapshot and cause")
        return cls(
            kind,
            tuple(ranks),
            reference_rank,
            snapshot,
            cause,
            summary,
            tuple(tensors),
            details or {},
        )


# Where the findings of a kind are seen and why, whatever the ranks hold (Finding.about); None:
# each finding of the kind says its own.
USUAL: dict[FindingKind, tuple[Snapshot | None, Cause | None]] = {
    FindingKind.ENV: (Snapshot.PRE_WRAP, Cause.ENVIRONMENT),
    FindingKind.LAUNCH: (Snapshot.PRE_WRAP, Cause.LAUNCH),
    FindingKind.CHECKPOINT: (Snapshot.PRE_WRAP, Cause.LAUNCH),
    FindingKind.CONFIG: (Snapshot.PRE_WRAP, Cause.CONSTRUCTION_TIME),
    FindingKind.WRAP_PLAN: (Snapshot.POST_WRAP, Cause.WRAPPING),
    FindingKind.HASH_SEED: (Snapshot.PROBE, Cause.CONSTRUCTION_TIME),
    FindingKind.VERIFY: (Snapshot.LOAD, Cause.LOADING),
    FindingKind.SOURCE: (Snapshot.LOAD, Cause.LOADING),
    FindingKind.MEMORY: (Snapshot.LOAD, Cause.LOADING),
    FindingKind.OPTIMIZER: (Snapshot.LOAD, Cause.LOADING),
    FindingKind.UNINITIALIZED: (None, Cause.LOADING),
    FindingKind.PREDICTION: (Snapshot.REPRODUCE, Cause.FSDPCHECK),
    FindingKind.STEP: (Snapshot.STEP, Cause.DIVERGENT),
}


@dataclass(frozen=True)
class LoaderPrediction:
    """What one known loader would do on these ranks (see ``fsdpcheck.checks.predict.LOADERS``)."""

    name: str
    verdict: LoaderVerdict
    summary: str
    ranks: tuple[int, ...] = ()  # ranks affected
    first_issue: Mapping[str, Any] | None = None
    products: str = ""  # the products and versions this row stands for
    # The backend ``verdict`` is for: the one the audited ranks run on. Where the other backend
    # would do otherwise (a broadcast into a larger buffer: gloo fills its front, NCCL blocks),
    # its verdict beside it: ``on_nccl`` when the audit runs on gloo (a CPU job auditing an
    # NCCL one), ``on_gloo`` when it runs on NCCL (--reproduce's child jobs run on gloo).
    on_gloo: LoaderVerdict | None = None
    backend: str = ""
    on_nccl: LoaderVerdict | None = None
    # --reproduce: what the real loader did in a child job (same vocabulary; None: not run), and
    # the job's evidence: each rank's exit and stage, what differs, each rank's buffers value by
    # value (which buffer holds whose values), the summary
    observed: LoaderVerdict | None = None
    observed_detail: Mapping[str, Any] | None = None

    @property
    def gloo_verdict(self) -> LoaderVerdict:
        """What the loader does on gloo: what a --reproduce child job is compared with."""
        return self.on_gloo or self.verdict

    @property
    def beside(self) -> str:
        """The other backend's verdict where it differs, as a reader sees it ("" if none)."""
        if self.on_nccl:
            return f"NCCL: {self.on_nccl}"
        if self.on_gloo:
            return f"gloo: {self.on_gloo}"
        return ""

    def verdict_text(self) -> str:
        """``hang``, or ``silent-corruption on gloo (NCCL: hang)`` where the backends differ."""
        if not self.beside:
            return str(self.verdict)
        return f"{self.verdict} on {self.backend or 'this backend'} ({self.beside})"

    @property
    def worst(self) -> LoaderVerdict:
        """The worse of this backend's verdict and the other's: what CI fails on."""
        return max(
            (LoaderVerdict(v) for v in (self.verdict, self.on_gloo, self.on_nccl) if v),
            key=lambda v: v.severity,
        )


@dataclass(frozen=True)
class LoadOutcome:
    """What the project's loader did in the audit."""

    ran: bool
    outcome: LoadStatus
    message: str = ""
    params_loaded: int = 0  # state-dict entries
    buffers_broadcast: int = 0  # non-persistent buffers
    collectives: int = 0  # fsdpcheck's own: 2 checks + one flat broadcast per buffer dtype
    seconds: float = 0.0
    method: LoadMethod | Literal[""] = ""  # how the state dict moved ("" when not loaded)
    fallback_reason: str | None = None  # why the bucketed path was not taken
    state_messages: int = 0  # bucketed: point-to-point messages rank 0 sent
    state_bytes: int = 0  # bucketed: their bytes (each rank's own shards only)
    # A failed load's errors: "input" (the checkpoint: --resume) or "runtime" (None: runtime).
    error_kind: ErrorKind | None = None


@dataclass(frozen=True)
class VerifyResult:
    """``mismatches`` hold ``{"name", "kind", "ranks", "reason"}``; ``passed`` and ``checked``
    are the same on every rank, the mismatches are known on rank 0."""

    ran: bool
    passed: bool
    checked: int  # parameters + buffers checked on every rank
    mismatches: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class TensorDigest:
    """One tensor as a side of a weight sync holds it, whole: its shape, dtype and value
    checksum (None: not read, see ``SyncDifference.UNREAD``)."""

    shape: tuple[int, ...]
    dtype: str
    digest: str | None


@dataclass(frozen=True)
class StateDigests:
    """``fsdpcheck.state_digests``: every tensor by name, the same from shards as from whole
    tensors. ``sharded``: how many were digested from DTensor shards (combined across ranks)."""

    tensors: Mapping[str, TensorDigest]
    sharded: int = 0


@dataclass(frozen=True)
class DigestDifference:
    name: str
    difference: SyncDifference
    detail: str  # the two sides, as a sentence


@dataclass(frozen=True)
class DigestComparison:
    """``fsdpcheck.compare_digests``: ``verdict`` ``consistent`` when every tensor agrees."""

    verdict: Verdict
    compared: int  # names on both sides
    differences: tuple[DigestDifference, ...] = ()

    @property
    def consistent(self) -> bool:
        return self.verdict == Verdict.CONSISTENT

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.CONSISTENT if self.consistent else ExitCode.FINDINGS

    # Shown as is in a log line or an assertion: the verdict and what differs, not the repr.
    _LISTED = 8

    def __str__(self) -> str:
        tensors = f"{self.compared} tensor{'' if self.compared == 1 else 's'} compared"
        if not self.differences:
            return f"{self.verdict}: {tensors}, every one agrees"
        n = len(self.differences)
        lines = [f"{self.verdict}: {n} difference{'' if n == 1 else 's'} over {tensors}"]
        lines += [
            f"  {d.name}: {d.difference} ({d.detail})" for d in self.differences[: self._LISTED]
        ]
        if n > self._LISTED:
            lines.append(f"  ... and {n - self._LISTED} more")
        return "\n".join(lines)


@dataclass(frozen=True)
class WrapPlan:
    requested: tuple[str, ...]
    source: WrapSource
    found: tuple[str, ...]
    missing: tuple[str, ...]
    wrapped: tuple[str, ...]  # module names passed to fully_shard, root last
    fallback: bool
    min_params: int


@dataclass(frozen=True)
class ModelInfo:
    spec: str  # what the user passed to --model
    kind: ModelKind
    name: str
    path: str | None
    architecture: str | None
    dtype: str | None
    init: str  # an fsdpcheck.vocab.Init, or "script" for a training script's own model
    checkpoint: bool  # weights came from a checkpoint (else random init)
    text_only: bool = False
    init_values: InitValues | None = None  # None: built on meta


@dataclass(frozen=True)
class StepRun:
    """Which training step ran under the collective watch (``audit --step``)."""

    source: str  # "builder": the --builder's own step; "synthetic": fsdpcheck's token step
    description: str  # what it did, in words (the batch, the loss, the optimizer)
    seed: int | None = None  # the synthetic batch's seed


@dataclass(frozen=True)
class Report:
    verdict: Verdict
    exit_code: ExitCode
    world_size: int
    model: ModelInfo | None
    wrap: WrapPlan | None
    groups: tuple[Group, ...]
    findings: tuple[Finding, ...]
    errors: tuple[RankError, ...]
    loaders: tuple[LoaderPrediction, ...] = ()
    load: LoadOutcome | None = None
    verify: VerifyResult | None = None
    probe: Mapping[str, Any] | None = None  # --probe K: orders under K hash seeds, rank 0's host
    hosts: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # host → its ranks
    warnings: tuple[str, ...] = ()
    environment: tuple[EnvRecord, ...] = ()  # one per group representative
    options: Mapping[str, Any] = field(default_factory=dict)
    timings: Mapping[str, float] = field(default_factory=dict)
    schema: str = SCHEMA
    # Ranks whose tensors were all on meta when gathered: their values were not compared.
    not_compared: tuple[int, ...] = ()
    checkpoint: CheckpointRecord | None = None  # the reference rank's resume checkpoint
    memory: tuple[MemoryRecord, ...] = ()  # every rank's, in rank order (empty: not measured)
    # --source / check_model(source=): every rank's tensors against the checkpoint on disk
    source_check: VerifyResult | None = None
    step: StepRun | None = None  # audit --step: the step that ran (None: none ran)


# ---------------------------------------------------------------- child jobs' JSON lines
# What a child job's rank prints (``children.launch``: one JSON line each, never pickle) and
# the parent reads back with ``from_dict``.


@dataclass(frozen=True)
class ChildLine:
    """One line a child rank prints: where it is now, or one result record."""

    stage: ChildStage | None = None
    result: Mapping[str, Any] | None = None  # a record of the job's own type, as ``to_dict``


@dataclass(frozen=True)
class ScanTarget:
    """One row of ``fsdpcheck scan``, as its children are told to build it."""

    id: str  # the row's name: model_type, "<model_type> (masked-lm)" or "preset:<name>"
    model_type: str
    class_name: str
    family: ScanFamily


@dataclass(frozen=True)
class SeedBuild:
    """One model a hash-seed child built on meta (probe: the model; scan: each target), or why
    it did not build."""

    target: str  # the probed model or builder, or the scan row's id
    fingerprint: Fingerprint | None = None  # None: it did not build
    architecture: str | None = None  # the model class
    config: str | None = None  # scan: the small-config attempt that built
    layer_types: tuple[str, ...] = ()  # distinct layer types of the built config
    failure: SeedFailure | None = None
    message: str = ""  # why it did not build
    seconds: float = 0.0

    @property
    def built(self) -> bool:
        return self.fingerprint is not None


@dataclass(frozen=True)
class HeldTensor:
    """What a loader child's rank holds under one name after its loader."""

    kind: Literal["param", "buffer"]
    dtype: str
    shape: tuple[int, ...]
    digest: str | None  # of the local values; None on meta
    persistent: bool | None = None  # buffers only
    placements: tuple[str, ...] | None = None  # a DTensor's
    values: tuple[float | str, ...] | None = None  # a small buffer's ("nan" where not finite)


@dataclass(frozen=True)
class LoaderError:
    kind: LoaderFailure
    stage: ChildStage  # where the rank was when it raised
    message: str


@dataclass(frozen=True)
class LoaderRecord:
    """One rank of a real loader's child job: what it holds after the loader, or its error."""

    rank: int
    loader: str
    error: LoaderError | None = None
    tensors: Mapping[str, HeldTensor] = field(default_factory=dict)
    order: tuple[str, ...] = ()  # its buffers, in its own named_buffers() order
    # Rank 0: per rank, per source entry, the digest of the part that rank must hold, per dtype.
    expected: Mapping[int, Mapping[str, Mapping[str, str | None]]] = field(default_factory=dict)
    reference: Mapping[str, str | None] = field(default_factory=dict)  # own non-persistent buffers
    meta_built: bool = False  # some buffers were built on meta
