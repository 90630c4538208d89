"""The words fsdpcheck's reports are made of: one ``str`` Enum per vocabulary.

Members are strings: records type their fields with these Enums, the JSON carries the plain
values, and ``member == "hang"`` holds. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum, IntEnum


class Word(str, Enum):
    """A ``str`` Enum whose ``str()`` and ``format()`` are its value (``StrEnum`` is 3.11+)."""

    # Hash and compare as the plain string, so a member and its value are one dict key.
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class _Described(Word):
    """A word with a one-line description (and, for finding kinds, a headline phrase)."""

    def __new__(cls, value: str, description: str, phrase: str = ""):
        member = str.__new__(cls, value)
        member._value_ = value
        member.description = description
        member.phrase = phrase or value
        return member


class Agreement(_Described):
    """What may differ between ranks, for each field of the per-rank record
    (:data:`fsdpcheck.records.AGREEMENT`)."""

    EVERY_RANK = ("every-rank", "must agree on every rank: in the group digest")
    REPLICAS = (
        "replicas",
        "must agree between the ranks the meshes pair (replicas of one shard, ranks on one "
        "mesh): in the value digests and the per-parameter mesh layout",
    )
    PER_PROCESS = (
        "per-process",
        "differs per process by nature (who and where the rank is, its place on the meshes): "
        "never compared",
    )
    INFORMATIONAL = ("informational", "a hint or what a rank was given: never compared")


class ExitCode(IntEnum):
    CONSISTENT = 0
    FINDINGS = 1
    BAD_INPUT = 2
    RUNTIME = 3

    def __str__(self) -> str:  # "3", on every Python (3.10's IntEnum says "ExitCode.RUNTIME")
        return str(int(self))


class ChildExit(IntEnum):
    """How a rank of a ``--reproduce`` loader child job ends: not a command's :class:`ExitCode`
    (none of them is one). The parent reads only "finished or not" from it; what went wrong
    is in the rank's record (its error's kind), so these only keep the two apart in ``ps``/logs."""

    DONE = 0
    REFUSED = 4  # the loader raised a clear exception
    COLLECTIVE = 124  # a collective failed or timed out (the peer is gone or out of step)


class Verdict(Word):
    CONSISTENT = "consistent"
    INCONSISTENT = "inconsistent"
    LATENT = "latent"  # the ranks agree now, but only because they share a hash seed
    ERROR = "error"

    def exit_code(self, error_kinds: Iterable[str] = ()) -> ExitCode:
        """The one mapping of a result to its exit code (audit, probe, scan): 0 consistent,
        1 inconsistent or latent; an error's is 2 when every error is bad input, else 3."""
        if self is Verdict.ERROR:
            return errors_exit_code(error_kinds)
        return ExitCode.CONSISTENT if self is Verdict.CONSISTENT else ExitCode.FINDINGS


class Stage(Word):
    """Where a rank is, in the order every rank passes them (liveness marks, errors)."""

    LAUNCH = "launch"
    DOWNLOAD = "download"
    RESOLVE = "resolve"
    BUILD = "build"
    FINGERPRINT_PRE = "fingerprint-pre"
    WRAP_PLAN = "wrap-plan"
    WRAP = "wrap"
    FINGERPRINT_POST = "fingerprint-post"
    FINGERPRINT = "fingerprint"  # check_model: the script's model, as it is
    GATHER = "gather"
    LOAD = "load"
    VERIFY = "verify"
    STATE_AFTER_LOAD = "state-after-load"  # every rank's ties and buffers, after the load
    SOURCE = "source"  # --source: every rank's tensors against their slices of the checkpoint
    STEP = "step"  # check_step / audit --step: the training step, under the collective watch
    STEP_REPORT = "step-report"  # every rank's step record, gathered
    PROBE = "probe"  # rank 0's --probe K: the model built under K hash seeds
    REPRODUCE = "reproduce"  # rank 0's --reproduce: every known loader in its own child job
    ABORT = "abort"


STAGE_ORDER = tuple(Stage)


class MemoryPeak(Word):
    """How a rank's peak host memory was read (``MemoryRecord.method``)."""

    # VmHWM of /proc/self/status, reset to the current RSS before each stage (/proc/self/
    # clear_refs): the stage's own peak.
    STAGE = "stage"
    # getrusage's ru_maxrss, which cannot be reset: where a stage set no new process peak, its
    # peak is only known to be at least its start and end RSS (a lower bound).
    LIFETIME = "lifetime"
    # check_model: the process's peak so far (VmHWM, else ru_maxrss) and its RSS now, read
    # without resetting anything (the script owns the process).
    PROCESS = "process"


class Snapshot(Word):
    """When a fingerprint was taken, or where a finding was seen."""

    PRE_WRAP = "pre-wrap"
    POST_WRAP = "post-wrap"
    LOAD = "load"
    PROBE = "probe"
    REPRODUCE = "reproduce"  # --reproduce: the real loaders' child jobs
    STEP = "step"  # during or after a training step (check_step, audit --step)
    TRACE = "trace"  # explain: the Flight Recorder dumps of a job that already ran


class ErrorKind(Word):
    INPUT = "input"  # exit 2
    RUNTIME = "runtime"  # exit 3

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.BAD_INPUT if self is ErrorKind.INPUT else ExitCode.RUNTIME


def errors_exit_code(kinds: Iterable[str]) -> ExitCode:
    """Exit 2 when every error is bad input, else 3 (a runtime failure outranks input)."""
    return max((ErrorKind(k).exit_code for k in kinds), default=ExitCode.RUNTIME)


class Backend(Word):
    """``--backend``: the process group fsdpcheck creates (``auto``: nccl with CUDA, else gloo)."""

    AUTO = "auto"
    NCCL = "nccl"
    GLOO = "gloo"


# The backends a group actually runs on (what ``auto`` resolves to).
RESOLVED_BACKENDS = (Backend.NCCL, Backend.GLOO)


class Init(Word):
    """``--init``: which ranks build real tensors."""

    RANK0 = "rank0"  # rank 0 real, the others on meta (as verl)
    META = "meta"  # every rank on meta
    ALL = "all"  # every rank real


class DType(Word):
    """``--dtype``: the dtypes a model can be built in."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class Annotations(Word):
    """``--annotations``: GitHub workflow commands for findings (``auto``: on GitHub Actions)."""

    AUTO = "auto"
    GITHUB = "github"
    NONE = "none"


class ModelKind(Word):
    """Where a model came from (``ModelInfo.kind``)."""

    PRESET = "preset"
    LOCAL = "local"
    HUB = "hub"
    SCRIPT = "script"  # a training script's own model (check_model, save_fingerprint)
    BUILDER = "builder"  # audit --builder: the trainer's own function built it


class InitValues(Word):
    """Where a rank's values came from (``ModelInfo.init_values``)."""

    CHECKPOINT = "checkpoint"
    FILL = "deterministic-fill"  # a seeded pattern at memory speed (fsdpcheck.model.fill)
    TRANSFORMERS_INIT = "transformers-init"  # the model's own init, when the fill cannot build it


class WrapSource(Word):
    """Where the wrap plan's layer classes came from (``WrapPlan.source``)."""

    WRAP_CLASS = "--wrap-class"
    NO_SPLIT_MODULES = "_no_split_modules"
    NONE = "none"


class Wrapper(Word):
    """How a module is wrapped (``WrappedModule.how``): activation checkpointing or compile."""

    CHECKPOINT_WRAPPER = "checkpoint_wrapper"  # torch.distributed...checkpoint_wrapper: renames
    CHECKPOINT = "checkpoint"  # torch.distributed._composable.checkpoint: hooks, no new names
    GRADIENT_CHECKPOINTING = "gradient_checkpointing"  # transformers' gradient_checkpointing_enable
    COMPILE = "torch.compile"  # torch.compile(module): an OptimizedModule, names under _orig_mod
    COMPILE_IN_PLACE = "module.compile"  # module.compile(): compiled in place, no new names


class BufferReason(Word):
    """Why a buffer is not what its module computes (``BufferProblem.reason``)."""

    DIFFERS = "differs"  # from the value the module recomputes
    NAN = "nan"
    INF = "inf"
    DENORMAL = "denormal"
    UNWRITTEN = "unwritten"  # nothing wrote it since ``to_empty()`` (``fsdpcheck run``)


class LoaderVerdict(Word):
    """What a loader does to these ranks, mildest first."""

    OK = "ok"
    UNINITIALIZED = "uninitialized"
    SILENT_CORRUPTION = "silent-corruption"
    REFUSED = "refused"
    HANG = "hang"

    @property
    def severity(self) -> int:
        return list(LoaderVerdict).index(self)


class ScanVerdict(Word):
    """One architecture's row in ``fsdpcheck scan``, worst first."""

    HANG = "hang"
    SILENT_CORRUPTION = "silent-corruption"
    OK = "ok"
    SKIPPED = "skipped"


class ScanFamily(Word):
    """Where a ``fsdpcheck scan`` row comes from."""

    CAUSAL_LM = "causal-lm"
    MASKED_LM = "masked-lm"
    PRESET = "preset"  # an fsdpcheck preset, asked for by name


class ChildStage(Word):
    """Where one rank of a child job got to: the stage marks it prints, in order."""

    START = "start"  # nothing marked yet
    INIT = "init"  # importing torch, joining its group
    BUILD = "build"
    LOADING = "loading"  # inside the loader's own collectives: the only stage a loader hangs in
    RECORDING = "recording"
    DONE = "done"

    @property
    def before_loader(self) -> bool:
        """A rank that failed here never reached the loader: its job says nothing about it."""
        return self in (ChildStage.START, ChildStage.INIT, ChildStage.BUILD)


class SeedFailure(Word):
    """Why a hash-seed child (probe, scan) built nothing."""

    INPUT = "input"  # bad input, e.g. an unknown preset (exit 2)
    RUNTIME = "runtime"
    TIMEOUT = "timeout"  # killed at its deadline (a runtime failure, for the exit code)


class LoaderFailure(Word):
    """How a real loader failed on a child rank."""

    COLLECTIVE = "collective"  # a collective failed or timed out: the peer is gone or out of step
    REFUSED = "refused"  # the loader raised a clear exception of its own


class LoadStatus(Word):
    LOADED = "loaded"
    REFUSED = "refused"
    FAILED = "failed"
    SKIPPED = "skipped"


class LoadMethod(Word):
    BUCKETED = "bucketed"  # each rank receives only its own shards, in flat buckets
    DCP = "dcp"  # torch.distributed.checkpoint's set_model_state_dict
    RESUME = "resume"  # audit --resume: every rank's own shards from the checkpoint, by dcp.load


class SyncDifference(Word):
    """How a tensor differs between two sides of a weight sync (``compare_digests``)."""

    MISSING = "missing"  # on one side only
    SHAPE = "shape"
    DTYPE = "dtype"
    VALUE = "value"
    UNREAD = "unread"  # no digest on a side: on meta, or shards that do not cover the tensor


class Loader(Word):
    """The weight loaders fsdpcheck predicts (and ``--reproduce`` runs), in report order."""

    NAMED_BUFFERS_ORDER = "named-buffers-order"
    STATE_DICT_ORDER = "state-dict-order"
    DDP_SYNC = "ddp-sync"
    DCP_BROADCAST = "dcp-broadcast"
    SORTED_NAMES = "sorted-names"


class Cause(_Described):
    CONSTRUCTION_TIME = (
        "construction-time",
        "already present before wrapping: the model was built differently",
    )
    WRAPPING = "wrapping", "appeared only after fully_shard"
    ENVIRONMENT = "environment", "the ranks run different software"
    CONFIGURATION = "configuration", "how the audit was asked to run"
    LOADING = "loading", "the loader itself left ranks different"
    DIVERGENT = (
        "divergent",
        "the ranks' code or data took different paths (a batch, a branch, a flag) and issued "
        "different collectives; no fingerprint shows a model difference behind it",
    )
    FSDPCHECK = "fsdpcheck", "fsdpcheck's own model of a loader was wrong"
    LAUNCH = (
        "launch",
        "the ranks were started differently: another command line, launch variable or resume "
        "checkpoint",
    )
    UNKNOWN = (
        "unknown",
        "seen after wrapping; no pre-wrap fingerprint to tell construction from wrapping",
    )
    SET_UP = (
        "set-up",
        "the ranks built or set up their modules or process differently: a mode (eval), a hook, "
        "a module setting, a numerics switch",
    )


class FindingKind(_Described):
    """Every finding's ``kind``, in headline priority order; ``phrase`` opens its summary."""

    BUFFER_ORDER = (
        "buffer-order",
        "same buffers on both sides, iterated in a different order",
        "buffer order differs",
    )
    BUFFER_SET = "buffer-set", "buffer names present on one side only", "buffer names differ"
    BUFFER_SHAPE = (
        "buffer-shape",
        "a buffer with the same name has a different shape",
        "buffer shapes differ",
    )
    BUFFER_DTYPE = (
        "buffer-dtype",
        "a buffer with the same name has a different dtype",
        "buffer dtypes differ",
    )
    BUFFER_PERSISTENCE = (
        "buffer-persistence",
        "a buffer is persistent on one side and not on the other",
        "buffer persistence differs",
    )
    PARAM_ORDER = (
        "param-order",
        "same parameters, iterated in a different order",
        "parameter order differs",
    )
    PARAM_SET = "param-set", "parameter names present on one side only", "parameter names differ"
    PARAM_SHAPE = (
        "param-shape",
        "a parameter with the same name has a different shape",
        "parameter shapes differ",
    )
    PARAM_DTYPE = (
        "param-dtype",
        "a parameter with the same name has a different dtype",
        "parameter dtypes differ",
    )
    PARAM_PLACEMENT = (
        "param-placement",
        "a parameter is sharded differently after wrapping",
        "parameter placements differ",
    )
    STATE_DICT_ORDER = (
        "state-dict-order",
        "the same state-dict keys, walked in a different order",
        "state-dict order differs",
    )
    STATE_DICT_KEYS = (
        "state-dict-keys",
        "state-dict keys present on one side only, with the same buffers and parameters",
        "state-dict keys differ",
    )
    WRAPPER = (
        "wrapper",
        "activation checkpointing or torch.compile wraps different modules, or wrapper levels "
        "(_orig_mod., _checkpoint_wrapped_module.) rename tensors on some ranks only",
        "wrappers differ",
    )
    REQUIRES_GRAD = (
        "requires-grad",
        "a parameter is trainable on one side and frozen on the other",
        "requires_grad differs",
    )
    WRAP_PLAN = (
        "wrap-plan",
        "the FSDP2 plan differs: parameter groups, mixed precision, resharding, offload or mesh",
        "FSDP2 wrap plan differs",
    )
    DEVICE = (
        "device",
        "a tensor sits on a device the job cannot use, or on different device types",
        "tensors on the wrong device",
    )
    MODULE_STATE = (
        "module-state",
        "a module's training flag, hooks, class or non-tensor settings (eps, dropout p, "
        "activation, attention scaling) differ between ranks",
        "module state differs",
    )
    CONFIG = "config", "the resolved model config differs between ranks", "model config differs"
    HASH_SEED = (
        "hash-seed",
        "tensor order depends on the interpreter's string-hash seed (PYTHONHASHSEED)",
        "tensor order depends on PYTHONHASHSEED",
    )
    ENV = "env", "library or interpreter versions differ between ranks", "software versions differ"
    NUMERICS = (
        "numerics",
        "process-wide numerics switches differ: TF32, cuDNN, deterministic algorithms, the "
        "default dtype, SDPA backends, autocast",
        "numerics settings differ",
    )
    VERIFY = (
        "verify",
        "after the project's loader ran, a rank's tensor differs from rank 0's source",
        "ranks differ after loading",
    )
    SOURCE = (
        "source",
        "a rank's shard or buffer differs from its slice of the checkpoint on disk (--source): "
        "a load wrong the same way on every rank",
        "tensors differ from the checkpoint",
    )
    VALUE = (
        "value",
        "a tensor that must be identical on every rank (or HSDP replica) holds other values",
        "values differ",
    )
    OPTIMIZER = (
        "optimizer",
        "the optimizer differs between ranks (param-group settings such as lr, step counts, "
        "which parameters hold state, state values between replicas), or a resume left its "
        "state short of the checkpoint's (moments absent or zero, another step, the scheduler)",
        "optimizers differ or were not restored",
    )
    EXPERT = (
        "expert",
        "expert-parallel slots hold identical experts (collapsed), or the experts held in all "
        "differ from the config's count",
        "experts differ",
    )
    UNINITIALIZED = (
        "uninitialized",
        "a buffer is not what its module computes (garbage after to_empty, NaN, Inf), or "
        "a tensor nothing wrote after to_empty (fsdpcheck run)",
        "tensors are not initialised",
    )
    NON_FINITE = (
        "non-finite",
        "a loss, gradient, parameter or buffer holds NaN or Inf (after a load, as check_model "
        "saw it, or after a step)",
        "tensors hold NaN or Inf",
    )
    TIE = (
        "tie",
        "parameters the config ties hold separate storage, or ranks tie different names "
        "(parameters, or buffers that share storage with another buffer or a parameter)",
        "tied weights differ",
    )
    STEP = (
        "step",
        "ranks issued different collectives in a training step (a hang or an abort, unwatched)",
        "collectives differ in the step",
    )
    COLLECTIVE = (
        "collective",
        "ranks issued different collectives (from Flight Recorder dumps)",
        "ranks issued different collectives",
    )
    PREDICTION = (
        "prediction",
        "a real loader did not do what fsdpcheck predicted (a bug in fsdpcheck)",
        "a loader prediction was wrong",
    )
    CHECKPOINT = (
        "checkpoint",
        "ranks resumed from different checkpoints (path, step or DCP metadata), or one could not "
        "read its own",
        "resume checkpoints differ",
    )
    LAUNCH = (
        "launch",
        "ranks were started with different command-line arguments or launch variables",
        "launch flags differ",
    )
    MEMORY = (
        "memory",
        "a rank held about the full model in host memory where rank-0 loading was asked, or "
        "far more than the other ranks, while building, wrapping or loading",
        "a rank held the full model",
    )
    UNEXPLAINED = (
        "unexplained",
        "the ranks' records differ in a field no other check explains (the last resort)",
        "records differ",
    )

    @property
    def order(self) -> int:
        return list(FindingKind).index(self)


def finding_kind(kind: str) -> FindingKind | None:
    """The member for a kind's value; ``None`` for a word this version does not know."""
    try:
        return FindingKind(kind)
    except ValueError:
        return None


class SourceLook(Word):
    """What a tensor that differs from its slice of the checkpoint (``source``) looks like."""

    VALUES = "values"  # other values, nothing more to tell
    CAST = "cast"  # equal once the checkpoint's values are cast to the model's dtype
    TRANSPOSED = "transposed"  # the transpose of the checkpoint's slice
    SHARD_DIM = "shard-dim"  # the checkpoint's slice cut along another dim
    PERMUTED_ROWS = "permuted-rows"  # the same rows in another order (q/k heads permuted)
    OTHER_TENSOR = "other-tensor"  # another checkpoint entry's slice
    SHAPE = "shape"  # a local shape other than the checkpoint's slice
    MISSING = "missing"  # no checkpoint entry for it
    META = "meta"  # never materialised
    UNREADABLE = "unreadable"  # the rank could not read the checkpoint
