#!/usr/bin/env bash
# Issue 58 on a lent GPU, parts 2 and 3 (bench/README.md "The 8B recipe on one GPU"). Run from the repository root
# with the wheels of transformers 5.24.0 and peft 0.21.2 in .whl/ (bench/README.md says how); OUT is where results go.
#   bash bench/gpu_issue58.sh decode   # part 2: the decode step before / after packed attention, and token identity
#   bash bench/gpu_issue58.sh fsdp     # part 3: stage 3 at the 8B LoRA recipe, one iteration, without and with FSDP
# TINY=1 runs the same on a CPU at tiny shapes (a dry run of the script itself).
set -u
OUT=${OUT:-/tmp/gpu58_out}; G=/tmp/g58; mkdir -p "$OUT"
if [ -d .whl ] && [ -z "${TINY:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
FLAGS=${TINY:+--tiny --device cpu}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  python3 -c "import torch, transformers, peft; print(torch.__version__, transformers.__version__, peft.__version__)"
} > "$OUT/env_$1.txt"
case "$1" in
  decode) timeout ${LIMIT:-400} python3 bench/gpu_recipe.py $FLAGS --out $G --phases ${PHASES:-bandwidth,decode,tokens} \
            ${VARIANTS:+--variants $VARIANTS} > "$OUT/decode.log" 2>&1 ;;
  fsdp) timeout 190 python3 bench/gpu_recipe.py $FLAGS --out $G --phases stage3 --steps 1 > "$OUT/stage3.log" 2>&1
        timeout 190 python3 bench/gpu_recipe.py $FLAGS --out $G --phases stage3 --steps 1 --shard fsdp \
          > "$OUT/stage3_fsdp.log" 2>&1 ;;
esac
echo "exit $?"; cp $G/*.json "$OUT/" 2>/dev/null; ls "$OUT"
