"""State that changes what a rank computes with the same tensors: tensors left on meta, each
module's training flag, hooks and settings, buffers sharing storage, process numerics. Real
collectors on real (single-process) models, one record per simulated rank, through the gather's
selection (``gathered_from``) and the report: each failure and its clean twin."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import pytest
import torch
from synthetic import env
from torch import nn

from fsdpcheck.checks.gather_view import gathered_from
from fsdpcheck.checks.module_state import module_differences, numerics_differences
from fsdpcheck.model.build import _default_dtype
from fsdpcheck.model.module_state import module_state, numerics_record, qualified_name
from fsdpcheck.model.rank_state import model_record
from fsdpcheck.model.state import shared_buffers
from fsdpcheck.records import (
    ModuleKind,
    ModuleStateRecord,
    NumericsRecord,
    RankRecord,
    from_dict,
    to_dict,
)
from fsdpcheck.report import AuditOutcome, assemble
from fsdpcheck.vocab import FindingKind, Verdict


class Rope(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
        self.register_buffer("inv_freq", inv_freq, persistent=False)


class Tiny(nn.Module):
    def __init__(self, eps: float = 1e-5, p: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8, eps=eps)
        self.drop = nn.Dropout(p)
        self.proj = nn.Linear(8, 8)
        self.rope = Rope()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.drop(self.norm(self.embed(x)))) * self.rope.inv_freq.sum()


def _tiny(**kw) -> Tiny:
    torch.manual_seed(0)
    return Tiny(**kw)


def _report(*models: nn.Module, records: list[RankRecord] | None = None):
    records = records or [
        model_record(m, env(rank), param_values=True) for rank, m in enumerate(models)
    ]
    return assemble(AuditOutcome(gathered_from(dict(enumerate(records)))), None)


def _kinds(report) -> list[str]:
    return [f.kind for f in report.findings]


def _scale(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    return output * 2


# ---------------------------------------------------------------- tensors left on meta


def _assigned_on_meta() -> Tiny:
    """Built on meta, then load_state_dict(assign=True): the non-persistent buffer stays there."""
    source = _tiny().state_dict()
    with torch.device("meta"):
        model = Tiny()
    model.load_state_dict(source, assign=True)
    return model


def test_a_buffer_left_on_meta_after_an_assign_load_is_a_device_finding():
    model = _assigned_on_meta()
    assert model.rope.inv_freq.is_meta and not model.proj.weight.is_meta
    report = _report(_tiny(), model)
    assert report.verdict == Verdict.INCONSISTENT
    (finding,) = report.findings
    assert (finding.kind, finding.ranks, finding.cause) == ("device", (1,), "loading")
    assert finding.tensors == ("rope.inv_freq",)
    assert "rank 1 left rope.inv_freq on meta (cpu on rank 0)" in finding.summary


def test_the_same_rank_loaded_and_its_buffer_recomputed_is_consistent():
    model = _assigned_on_meta()
    model.rope = Rope()  # what a loader that rebuilds non-persistent buffers does
    assert _report(_tiny(), model).verdict == Verdict.CONSISTENT


def test_a_rank_wholly_on_meta_before_its_load_is_not_compared_not_a_finding():
    with torch.device("meta"):
        meta = Tiny()
    report = _report(_tiny(), meta)
    assert report.verdict == Verdict.CONSISTENT and report.findings == ()
    assert report.not_compared == (1,)


def test_parameters_on_meta_with_real_buffers_are_a_rank_before_its_load():
    # init_empty_weights (include_buffers=False): buffers computed for real, weights on meta.
    from fsdpcheck.model.fill import parameters_on_meta

    with parameters_on_meta():
        empty = _tiny()
    assert empty.proj.weight.is_meta and not empty.rope.inv_freq.is_meta
    assert _report(_tiny(), empty).findings == ()


def test_the_reference_rank_that_left_a_buffer_on_meta_is_named():
    report = _report(_assigned_on_meta(), _tiny())
    (finding,) = report.findings
    assert (finding.kind, finding.ranks) == ("device", (1,))  # the ranks that differ from 0
    assert finding.details["left_on_meta"] == [
        {"name": "rope.inv_freq", "ranks": [0], "device": "cpu", "real_on": [1]}
    ]


# ---------------------------------------------------------------- module state


def test_a_module_in_eval_mode_on_one_rank_is_a_module_state_finding():
    other = _tiny()
    other.eval()
    report = _report(_tiny(), other)
    (finding,) = report.findings
    assert (finding.kind, finding.ranks, finding.cause) == ("module-state", (1,), "set-up")
    assert "drop is in training mode on rank 0 but in eval mode on rank 1" in finding.summary
    # Only the dropout computes otherwise in eval mode; a module that never reads its flag
    # (embedding, norm, linear, the container) is no difference.
    assert [d["module"] for d in finding.details["differences"]] == ["drop"]
    assert _report(_tiny(), _tiny()).verdict == Verdict.CONSISTENT  # the clean twin


def test_eval_mode_where_nothing_depends_on_it_is_no_difference():
    # from_pretrained leaves a model in eval mode, from_config in training mode: with no
    # dropout (p = 0) nothing computes otherwise.
    other = _tiny(p=0.0)
    other.eval()
    assert _report(_tiny(p=0.0), other).verdict == Verdict.CONSISTENT


def test_the_flag_matters_where_a_modules_own_code_reads_it():
    class Gated(nn.Module):  # reads self.training, says nothing of a rate: assumed to matter
        def forward(self, x):
            return x * 2 if self.training else x

    class Attention(nn.Module):  # reads it for dropout at rate 0: nothing changes
        def __init__(self, rate: float) -> None:
            super().__init__()
            self.attention_dropout = rate

        def forward(self, x):
            return nn.functional.dropout(x, self.attention_dropout if self.training else 0.0)

    from fsdpcheck.model.module_state import mode_matters

    assert mode_matters(Gated()) and mode_matters(Attention(0.1))
    assert not mode_matters(Attention(0.0)) and not mode_matters(nn.Linear(2, 2))
    assert mode_matters(nn.BatchNorm1d(2)) and not mode_matters(nn.Dropout(0.0))


def test_a_forward_hook_on_one_rank_is_named_by_module_and_qualified_name():
    other = _tiny()
    other.norm.register_forward_hook(_scale)
    report = _report(_tiny(), other)
    (finding,) = report.findings
    assert finding.kind == "module-state" and finding.ranks == (1,)
    (diff,) = finding.details["differences"]
    assert diff["module"] == "norm" and diff["what"] == "hooks"
    assert diff["other"] == ["forward:test_module_state._scale"]
    assert "0x" not in finding.summary  # never an address
    # The same hook on every rank: consistent.
    ref = _tiny()
    ref.norm.register_forward_hook(_scale)
    assert _report(ref, other).verdict == Verdict.CONSISTENT


@pytest.mark.parametrize(
    "register",
    [
        lambda m: m.register_forward_pre_hook(lambda mod, args: None),
        lambda m: m.register_full_backward_hook(lambda mod, gi, go: None),
        lambda m: m.register_full_backward_pre_hook(lambda mod, go: None),
        lambda m: m._register_state_dict_hook(lambda mod, sd, prefix, local: None),
        lambda m: m.register_load_state_dict_post_hook(lambda mod, keys: None),
        lambda m: m._register_load_state_dict_pre_hook(lambda *a: None),
    ],
    ids=["forward-pre", "backward", "backward-pre", "state-dict", "load-post", "load-pre"],
)
def test_every_kind_of_module_hook_is_recorded(register: Callable[[nn.Module], object]):
    other = _tiny()
    register(other.proj)
    (diff,) = module_differences(module_state(_tiny()), module_state(other))
    assert diff["module"] == "proj" and len(diff["other"]) == 1
    assert "<lambda>" in diff["other"][0]


def test_a_global_module_hook_on_one_rank_is_found():
    from torch.nn.modules.module import register_module_forward_hook

    handle = register_module_forward_hook(_scale)
    try:
        other = module_state(_tiny())
    finally:
        handle.remove()
    (diff,) = module_differences(module_state(_tiny()), other)
    assert diff["what"] == "global hooks"
    assert diff["other"] == ["forward:test_module_state._scale"]


def test_hook_names_are_qualified_never_addresses():
    class Scaler:
        def __call__(self, *a):
            return None

        def method(self, *a):
            return None

    assert qualified_name(_scale) == "test_module_state._scale"
    assert qualified_name(functools.partial(_scale, None)) == "test_module_state._scale"
    assert qualified_name(Scaler()).endswith("<locals>.Scaler")
    assert qualified_name(Scaler().method).endswith("<locals>.Scaler.method")


def test_a_layernorm_eps_on_one_rank_is_a_setting_difference():
    report = _report(_tiny(), _tiny(eps=0.1))
    (finding,) = report.findings
    assert finding.kind == "module-state"
    (diff,) = finding.details["differences"]
    assert diff == {
        "module": "norm",
        "class": "torch.nn.modules.normalization.LayerNorm",
        "what": "setting eps",
        "reference": "1e-05",
        "other": "0.1",
    }
    assert "norm setting eps is 1e-05 on rank 0 but 0.1 on rank 1" in finding.summary


def test_dropout_p_activation_and_class_choices_are_compared():
    a, b = _tiny(), _tiny()
    b.drop.p = 0.5
    b.act = nn.GELU()
    a.act = nn.SiLU()
    whats = {(d["module"], d["what"]) for d in module_differences(module_state(a), module_state(b))}
    assert whats == {("drop", "setting p"), ("act", "class")}


def test_settings_leave_out_tensors_configs_devices_ranks_and_paths():
    model = _tiny()
    model.config = object()  # compared by the config check, not here
    model.device = torch.device("cpu")
    model.tp_rank = 1
    model.name_or_path = "/node-1/snapshot"
    model.scaling = 0.25
    model.activation = nn.functional.gelu
    (root,) = [k for k in module_state(model).kinds if k.cls.endswith("Tiny")]
    assert dict(root.settings) == {"scaling": "0.25", "activation": "torch._C._nn.gelu"}


def test_alike_modules_share_one_kind_in_the_record():
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(50)])
    record = module_state(model)
    assert len(record.kinds) == 2 and len(record.modules) == 51
    assert from_dict(ModuleStateRecord, to_dict(record)) == record


def test_a_module_without_tensors_on_one_rank_only_is_named_one_with_tensors_is_not():
    a, b = _tiny(), _tiny()
    b.act = nn.SiLU()  # no tensors: the layout cannot see it
    b.extra = nn.Linear(2, 2)  # tensors: the layout's param-set finding names it
    report = _report(a, b)
    kinds = _kinds(report)
    assert "module-state" in kinds and "param-set" in kinds
    (finding,) = [f for f in report.findings if f.kind == "module-state"]
    assert [d["module"] for d in finding.details["differences"]] == ["act"]


def test_wrapper_levels_fold_into_the_wrapped_module_name():
    from fsdpcheck.model.names import canonical_record
    from fsdpcheck.records import Renamed, WrapperRecord

    kinds = (ModuleKind("acme.Block"), ModuleKind("acme.Wrapper"))
    wrapped = ModuleStateRecord(kinds, (("layers.0", 1), ("layers.0._orig_mod", 0)))
    record = RankRecord(
        env=env(1),
        modules=wrapped,
        wrappers=WrapperRecord(renamed=(Renamed("_orig_mod", 1, 0),)),
    )
    assert canonical_record(record).modules.by_name() == {"layers.0": kinds[0]}


# ---------------------------------------------------------------- buffers sharing storage


class Views(nn.Module):
    def __init__(self, view: bool) -> None:
        super().__init__()
        table = torch.arange(8.0)
        self.register_buffer("table", table)
        self.register_buffer("head", table[:4] if view else table[:4].clone())


def test_a_buffer_that_is_a_view_on_one_rank_and_a_copy_on_another_is_a_tie_finding():
    assert shared_buffers(Views(view=True)) == (("head", "table"),)
    assert shared_buffers(Views(view=False)) == ()
    report = _report(Views(view=True), Views(view=False))
    (finding,) = report.findings
    assert (finding.kind, finding.ranks) == ("tie", (1,))
    assert "only rank 0 shares storage between head, table" in finding.summary
    assert _report(Views(view=True), Views(view=True)).verdict == Verdict.CONSISTENT


def test_buffer_views_are_seen_on_meta_too():
    with torch.device("meta"):
        assert shared_buffers(Views(view=True)) == (("head", "table"),)


def test_a_buffer_sharing_a_parameters_storage_is_recorded():
    model = nn.Linear(4, 4)
    model.register_buffer("row", model.weight.data[0])
    assert shared_buffers(model) == (("row", "weight"),)


# ---------------------------------------------------------------- process numerics


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@contextlib.contextmanager
def _tf32() -> Iterator[None]:
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


@pytest.mark.parametrize(
    ("switch", "names", "other"),
    [
        (lambda: _default_dtype(torch.float64), ["default_dtype"], "torch.float64"),
        (_deterministic, ["deterministic_algorithms"], "True"),
        (
            _tf32,  # the old switch and the new API both read it
            ["float32_matmul_precision", "cuda.matmul.allow_tf32", "cuda.matmul.fp32_precision"],
            "high",
        ),
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16), ["autocast.cpu"], "True"),
    ],
    ids=["default-dtype", "deterministic", "tf32", "autocast"],
)
def test_a_numerics_switch_on_one_rank_is_a_numerics_finding(switch, names, other: str):
    model = _tiny()
    reference = model_record(model, env(0))
    with switch():
        changed = model_record(model, env(1))
    report = _report(records=[reference, changed])
    (finding,) = report.findings
    assert (finding.kind, finding.ranks, finding.cause) == ("numerics", (1,), "set-up")
    assert [d["name"] for d in finding.details["differences"]] == names
    assert finding.details["differences"][0]["other"] == other
    assert _report(records=[reference, model_record(model, env(1))]).findings == ()


def test_numerics_record_reads_every_switch_on_this_cpu_build():
    flags = dict(numerics_record().flags)
    for name in ("cudnn.allow_tf32", "cuda.matmul.allow_tf32", "sdpa.flash", "autocast.cuda"):
        assert flags[name] in ("True", "False"), name
    assert flags["default_dtype"] == "torch.float32"


def test_a_switch_this_torch_lacks_is_unavailable_and_differs_from_a_value():
    a = NumericsRecord((("sdpa.cudnn", "unavailable"),))
    b = NumericsRecord((("sdpa.cudnn", "True"),))
    assert numerics_differences(a, b) == [
        {"name": "sdpa.cudnn", "reference": "unavailable", "other": "True"}
    ]
    assert FindingKind.NUMERICS.phrase == "numerics settings differ"
