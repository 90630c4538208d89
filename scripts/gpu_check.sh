#!/usr/bin/env bash
# NCCL smoke check on a host with CUDA GPUs; CI has none, so this runs by hand:
#   scripts/gpu_check.sh [OUT_DIR]      (uses $PYTHON, default python3)
# The audit on NCCL with one rank per GPU, the library's loader on CUDA tensors, and one rank too
# many for the GPUs (bad input, exit 2, no hang). Everything lands in OUT_DIR/gpu-check.log.
set -u
out=${1:-${OUT:-/tmp/fsdpcheck-gpu}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$out/gpu-check.log"
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
echo "== $(date -u +%FT%TZ) $("$py" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "nccl", torch.cuda.nccl.version())') gpus=$gpus" | tee "$log"
step() {  # step NAME EXPECTED_EXIT COMMAND...
    local name=$1 want=$2
    shift 2
    local start=$SECONDS
    timeout 240 "$@" >"$out/step.log" 2>&1
    local code=$?
    local verdict=ok
    [ "$code" = "$want" ] || verdict=UNEXPECTED
    echo "== $name: exit $code (expected $want) in $((SECONDS - start))s: $verdict" | tee -a "$log"
    tail -n 25 "$out/step.log" >>"$log"
}
run="$py -m torch.distributed.run --nproc-per-node"
for model in tiny-llama hazard tiny-gemma4; do
    step "audit $model, nccl, $gpus rank(s)" 0 \
        $run "$gpus" -m fsdpcheck audit --model "$model" --backend nccl --json "$out/$model.json"
done
step "audit tiny-gemma4 bfloat16, nccl" 0 \
    $run "$gpus" -m fsdpcheck audit --model tiny-gemma4 --dtype bfloat16 --backend nccl \
    --json "$out/tiny-gemma4-bf16.json"
step "audit, one rank more than GPUs (bad input)" 1 \
    $run "$((gpus + 1))" -m fsdpcheck audit --model tiny-llama --backend nccl --timeout 20
step "library on CUDA tensors" 0 $run "$gpus" scripts/gpu_check.py
grep -h "^@gpu" "$out/step.log" >"$out/library.jsonl" 2>/dev/null
# Issue 13's GPU row: a Gemma3-27B-shaped bfloat16 config, no weights, --init rank0 (rank 0 fills
# 54 GB on the host with every core, shards onto its GPU, loads and verifies); target < 60 s,
# read off the step's time in the log (the summary below also prints its report's timings).
mkdir -p "$out/gemma3-27b-shaped"
"$py" - "$out/gemma3-27b-shaped/config.json" <<'PY'
import json, sys
json.dump({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
           "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
           "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
           "vocab_size": 262208, "sliding_window": 1024, "rope_theta": 1000000.0,
           "rope_local_base_freq": 10000.0, "max_position_embeddings": 131072,
           "query_pre_attn_scalar": 168, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
           "torch_dtype": "bfloat16"}, open(sys.argv[1], "w"))
PY
step "audit gemma3-27b-shaped bfloat16, --init rank0, nccl, 1 rank" 0 \
    $run 1 -m fsdpcheck audit --model "$out/gemma3-27b-shaped" --backend nccl --init rank0 \
    --timeout 200 --json "$out/gemma3-27b-shaped.json"
"$py" - "$out" <<'PY' | tee -a "$log"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in sorted(out.glob("*.json")):
    r = json.loads(path.read_text())
    load = r.get("load") or {}
    print(f"{path.name}: verdict={r['verdict']} exit={r['exit_code']} load={load.get('outcome')}"
          f"/{load.get('method')} fallback={load.get('fallback_reason')} "
          f"verify={(r.get('verify') or {}).get('passed')} env={r['environment'][0]['torch'] if r.get('environment') else None}"
          f" init_values={(r.get('model') or {}).get('init_values')} stage_seconds={r.get('timings')}")
PY
