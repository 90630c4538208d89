#!/usr/bin/env bash
# `fsdpcheck run` on a CUDA host (CI has none, so this runs by hand):
#   scripts/gpu_run_check.sh [OUT_DIR]      (uses $PYTHON, default python3)
# One rank per GPU on NCCL: examples/scripts/fsdp2_train.py plain twice (is the host's own run
# deterministic?), then under `fsdpcheck run` (the same losses and weights?), then its twin
# whose layers reset_parameters never reaches (exit 1, `uninitialized`, on CUDA memory). Then
# the gloo multi-rank tests of `run` on this host's torch, GPUs hidden (tests/ranks/test_run.py).
set -u
out=${1:-${OUT:-/tmp/fsdpcheck-gpu-run}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$out/gpu-run-check.log"
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
echo "== $(date -u +%FT%TZ) $("$py" -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())') gpus=$gpus" | tee "$log"
run="$py -m torch.distributed.run --nproc-per-node $gpus"
step() {  # step NAME EXPECTED_EXIT COMMAND...
    local name=$1 want=$2
    shift 2
    local start=$SECONDS
    timeout 240 "$@" >"$out/step.log" 2>&1
    local code=$?
    local verdict=ok
    [ "$code" = "$want" ] || verdict=UNEXPECTED
    echo "== $name: exit $code (expected $want) in $((SECONDS - start))s: $verdict" | tee -a "$log"
    grep -v "Warning\|warn(" "$out/step.log" | tail -n 12 >>"$log"
}
train=examples/scripts/fsdp2_train.py
step "plain, nccl" 0 $run "$train" --steps 3 --out "$out/plain"
step "plain again, nccl" 0 $run "$train" --steps 3 --out "$out/plain2"
step "fsdpcheck run, nccl" 0 $run -m fsdpcheck run --json "$out/run.json" "$train" --steps 3 \
    --out "$out/run"
sed 's/            layer.reset_parameters()/            pass/' "$train" >"$out/unreached.py"
step "fsdpcheck run, layers never initialised, nccl" 1 $run -m fsdpcheck run \
    --json "$out/unreached.json" "$out/unreached.py" --steps 3
"$py" - "$out" <<'PY' | tee -a "$log"
import json, pathlib, sys
from safetensors.torch import load_file
out = pathlib.Path(sys.argv[1])
def same(a, b):
    la, lb = (json.loads((out / d / "losses.json").read_text()) for d in (a, b))
    wa, wb = (load_file(out / d / "weights.safetensors") for d in (a, b))
    bitwise = la == lb and wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)
    return f"{a} vs {b}: losses {la} / {lb}, bitwise {bitwise}"
print(same("plain", "plain2")); print(same("plain", "run"))
for name in ("run", "unreached"):
    r = json.loads((out / f"{name}.json").read_text())
    print(name, r["verdict"], r["exit_code"], r["environment"][0]["backend"],
          [(f["kind"], f["summary"][:240]) for f in r["findings"]])
PY
start=$SECONDS
CUDA_VISIBLE_DEVICES= timeout 300 "$py" -m pytest -q -p no:cacheprovider tests/unit/test_run_parts.py \
    tests/ranks/test_run.py >"$out/pytest.log" 2>&1
echo "== pytest test_run (gloo, this torch): exit $? in $((SECONDS - start))s" | tee -a "$log"
tail -n 30 "$out/pytest.log" >>"$log"
