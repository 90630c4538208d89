"""One rank of the architecture sweep: a default audit of a tiny config of each architecture
transformers ships, in turn, in one 2-rank job (issue 19, "No false alarms").

Each architecture is a tiny config built from transformers' own config class and saved with
``save_pretrained`` (config.json only, no weights: the audit fills deterministically), then
audited by ``run_audit(AuditOptions(model=<dir>))``, every default as ``fsdpcheck audit --model
<dir>`` gives it on CPU (``--init`` picks another init mode, to explore). The worker joins one
gloo process group first and every audit reuses it (``distributed.init`` joins or reuses the
default group, as ``check_model`` does for a script's own): a ``run_audit`` that creates and
destroys its own group on the same MASTER_PORT, again and again in one process, fails at the
second or third call (gloo ``connectFullMesh ... Connect timeout`` under torch 2.13).

Rank 0 writes ``--out``: ``{"transformers": version, "ran": [...], "skipped": {name: why}}``,
one entry per audited architecture with its verdict, exit code on every rank and findings. A
config class this transformers lacks is skipped by name, with the reason recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fsdpcheck.process import exit_skipping_teardown

# The smallest configs that build: 2 layers (one of each kind where layers differ), hidden 32,
# 2 heads of 16 over 1 KV head, a small vocabulary, 4 experts of which 2 are routed per token.
TINY: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)
HEAD = dict(head_dim=16)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
LOCAL_EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2)
SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=16)
PAD = dict(pad_token_id=0)  # their default pad id (32000, 128004, ...) is past a tiny vocabulary
# Gated delta net layers (linear attention) beside a full-attention one.
GATED_DELTA = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)
MAMBA2 = dict(
    mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16
)
# DeepSeek-style routing: one dense layer first, then routed experts plus a shared one.
ROUTED = dict(
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
)
# Multi-head latent attention: low-rank query and key/value projections, a split RoPE head.
MLA = dict(
    **ROUTED,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
)

# name: (transformers config class, what it adds to TINY), grouped by kind. Also consistent
# under the default audit and --init all|meta with transformers 5.24, and left out to keep the
# job short (near-twins of the ones here): helium, seed_oss, apertus, nemotron, olmo, bitnet,
# glm4, stablelm, gemma, cohere, gptj, exaone4 (dense and sliding); minimax_m2, dots1,
# hunyuan_v1_moe, ernie4_5_moe, phimoe, granitemoe, deepseek_v2, qwen3_5_moe_text (experts,
# latent attention); mamba2.
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    # dense
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", HEAD),
    "phi3": ("Phi3Config", PAD),
    "granite": ("GraniteConfig", {}),
    "olmo2": ("Olmo2Config", {}),
    "smollm3": ("SmolLM3Config", PAD),
    "glm": ("GlmConfig", {**HEAD, **PAD}),
    "ernie4_5": ("Ernie4_5Config", HEAD),
    "falcon": ("FalconConfig", dict(num_kv_heads=1, new_decoder_architecture=True)),
    "gpt_neox": ("GPTNeoXConfig", {}),
    "phi": ("PhiConfig", {}),
    # the older layouts: fused QKV, learned positions, Conv1D
    "gpt2": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=2, n_positions=64)),
    "bloom": ("BloomConfig", dict(n_layer=2, n_head=2)),
    "opt": ("OPTConfig", dict(ffn_dim=64, word_embed_proj_dim=32)),
    # mixture of experts
    "qwen3_moe": ("Qwen3MoeConfig", {**HEAD, **MOE}),
    "qwen2_moe": ("Qwen2MoeConfig", {**MOE, "shared_expert_intermediate_size": 32}),
    "mixtral": ("MixtralConfig", LOCAL_EXPERTS),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2)),
    "gpt_oss": ("GptOssConfig", {**LOCAL_EXPERTS, **HEAD, "sliding_window": 16}),
    "glm4_moe": ("Glm4MoeConfig", {**HEAD, **ROUTED}),
    "llama4_text": (
        "Llama4TextConfig",
        {**HEAD, **PAD, "num_local_experts": 4, "num_experts_per_tok": 1},
    ),
    "jetmoe": ("JetMoeConfig", {**LOCAL_EXPERTS, "kv_channels": 16}),
    # multi-head latent attention (+ experts)
    "deepseek_v3": ("DeepseekV3Config", MLA),
    # sliding window
    "mistral": ("MistralConfig", dict(sliding_window=16)),
    "gemma2": ("Gemma2Config", {**HEAD, "sliding_window": 16}),
    "gemma3": ("Gemma3TextConfig", {**HEAD, **SLIDING}),
    "cohere2": ("Cohere2Config", {**SLIDING, "sliding_window_pattern": 2}),
    "starcoder2": ("Starcoder2Config", dict(sliding_window=16)),
    "olmo3": ("Olmo3Config", dict(sliding_window=16)),
    "gemma4_text": (
        "Gemma4TextConfig",
        {
            **HEAD,
            **SLIDING,
            "global_head_dim": 32,
            "vocab_size_per_layer_input": 128,
            "hidden_size_per_layer_input": 8,
        },
    ),
    "gemma3n_text": (
        "Gemma3nTextConfig",
        {
            **HEAD,
            **SLIDING,
            "vocab_size_per_layer_input": 128,
            "hidden_size_per_layer_input": 8,
            "laurel_rank": 8,
            "altup_num_inputs": 2,
            "num_kv_shared_layers": 0,
            "activation_sparsity_pattern": [0.0, 0.0],
            "intermediate_size": [64, 64],
        },
    ),
    # linear attention (gated delta net) + experts
    "qwen3_next": (
        "Qwen3NextConfig",
        {
            **HEAD,
            **MOE,
            **GATED_DELTA,
            "shared_expert_intermediate_size": 32,
        },
    ),
    "qwen3_5_text": ("Qwen3_5TextConfig", {**HEAD, **GATED_DELTA}),
    "minimax": (
        "MiniMaxConfig",
        {**LOCAL_EXPERTS, **HEAD, "layer_types": ["linear_attention", "full_attention"]},
    ),
    # state-space and recurrent layers, alone or beside attention
    "mamba": ("MambaConfig", {**PAD, "state_size": 4, "expand": 2}),
    "jamba": (
        "JambaConfig",
        {
            **PAD,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "mamba_d_state": 4,
            "mamba_dt_rank": 4,
        },
    ),
    "bamba": ("BambaConfig", {**PAD, **MAMBA2, "attn_layer_indices": [1]}),
    "falcon_h1": ("FalconH1Config", {**PAD, **HEAD, **MAMBA2, "mamba_d_ssm": 64}),
    "nemotron_h": (
        "NemotronHConfig",
        {
            **PAD,
            **HEAD,
            "hybrid_override_pattern": "M*",
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "ssm_state_size": 8,
            "n_groups": 1,
            "chunk_size": 16,
        },
    ),
    "lfm2": ("Lfm2Config", {**PAD, "layer_types": ["conv", "full_attention"]}),
    "recurrent_gemma": (
        "RecurrentGemmaConfig",
        {
            **PAD,
            **HEAD,
            "lru_width": 32,
            "attention_window_size": 16,
            "block_types": ["recurrent", "attention"],
        },
    ),
}


# The presets a newcomer audits first, as `--model NAME`.
PRESETS_AUDITED = ("tiny-llama", "tiny-qwen3", "tiny-gemma3", "tiny-gemma4")


def _save_config(name: str, root: Path) -> str | None:
    """Write ``name``'s tiny config.json under ``root``; the reason it was skipped, or None."""
    import transformers

    class_name, extra = ARCHITECTURES[name]
    config_class = getattr(transformers, class_name, None)
    if config_class is None:
        return f"transformers {transformers.__version__} has no {class_name}"
    config_class(**{**TINY, **extra}).save_pretrained(root / name)
    return None


def _audit(path: Path | str, init: str | None, probe: int = 0) -> dict[str, Any]:
    from fsdpcheck.audit import AuditOptions, run_audit

    started = time.monotonic()
    options = {"init": init} if init else {}
    result = run_audit(AuditOptions(model=str(path), probe=probe, **options))
    codes: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(codes, result.exit_code)
    entry: dict[str, Any] = {"exit_codes": codes, "seconds": round(time.monotonic() - started, 2)}
    report = result.report
    if report is not None:
        entry["verdict"] = str(report.verdict)
        entry["architecture"] = report.model.architecture if report.model else None
        entry["findings"] = [
            {"kind": str(f.kind), "ranks": list(f.ranks), "summary": f.summary}
            for f in report.findings
        ]
        entry["errors"] = [e.message for e in report.errors]
        entry["warnings"] = list(report.warnings)
        entry["verified"] = report.verify.passed if report.verify else None
        entry["wrap"] = {"found": list(report.wrap.found), "wrapped": list(report.wrap.wrapped)}
        entry["probe"] = report.probe
    return entry


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", action="append", default=[], help="these architectures alone")
    parser.add_argument("--init", help="instead of the audit's default (rank0)")
    args = parser.parse_args()
    import transformers

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    names = args.only or [*PRESETS_AUDITED, *ARCHITECTURES]
    ran: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix=f"fsdpcheck-arch-rank{rank}-") as tmp:
        for name in names:
            if name in PRESETS_AUDITED:  # fsdpcheck's own tiny models, by preset name
                # tiny-llama also under --probe 2: a stable order stays consistent.
                ran[name] = _audit(name, args.init, probe=2 if name == "tiny-llama" else 0)
                continue
            why = _save_config(name, Path(tmp))  # every rank alike: no collective is skipped
            if why is not None:
                skipped[name] = why
                continue
            ran[name] = _audit(Path(tmp) / name, args.init)
    if rank == 0:
        payload = {"transformers": transformers.__version__, "ran": ran, "skipped": skipped}
        Path(args.out).write_text(json.dumps(payload, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return max((max(e["exit_codes"]) for e in ran.values()), default=0)


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    exit_skipping_teardown(main())
