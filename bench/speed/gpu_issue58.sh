#!/usr/bin/env bash
# Issue 58 on a lent GPU (bench/gpu_recipe/README.md, bench/credit/README.md "With learned critics"). Run from the repository
# root with the wheels of transformers 5.24.0, peft 0.21.2 (and gguf for part 1) in .whl/; OUT is where results go.
#   bash bench/speed/gpu_issue58.sh decode   # part 2: the decode step before / after packed attention, and token identity
#   bash bench/speed/gpu_issue58.sh fsdp     # part 3: stage 3 at the 8B LoRA recipe, one iteration, without and with FSDP
#   bash bench/speed/gpu_issue58.sh learned  # part 1: bench/credit/credit_learned.py's train phase; needs SmolLM2's GGUF in two
#       halves (over one call's 64 MiB): .g58a/part_a carried on an earlier call (kept in /tmp), .g58b/ the rest and
#       data.tgz (the CPU's data phase); returns learned.tgz: the runs and the reward models' records, not their weights
# TINY=1 runs decode and fsdp on a CPU at tiny shapes (a dry run of the script itself; learned: LIMIT=45 on a CPU).
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
  decode) timeout ${LIMIT:-400} python3 bench/gpu_recipe/gpu_recipe.py $FLAGS --out $G --phases ${PHASES:-bandwidth,decode,tokens} \
            ${VARIANTS:+--variants $VARIANTS} > "$OUT/decode.log" 2>&1 ;;
  fsdp) timeout 190 python3 bench/gpu_recipe/gpu_recipe.py $FLAGS --out $G --phases stage3 --steps 1 > "$OUT/stage3.log" 2>&1
        timeout 190 python3 bench/gpu_recipe/gpu_recipe.py $FLAGS --out $G --phases stage3 --steps 1 --shard fsdp \
          > "$OUT/stage3_fsdp.log" 2>&1 ;;
  learned) R=/work/main  # the CPU's path: 03's adapters name their base by it
    { [ "$PWD" = $R ] || { mkdir -p $R && cp -a . $R/ && cd $R; }
      tar xzf .g58b/data.tgz
      if [ ! -f runs/smollm2/model.safetensors ]; then
        cat /tmp/.g58a/part_a .g58b/part_b > /tmp/smol.gguf 2>/dev/null || cat .g58a/part_a .g58b/part_b > /tmp/smol.gguf
        [ "$(sha256sum < /tmp/smol.gguf | cut -d' ' -f1)" = "$(cat .g58b/gguf.sha256)" ] || { echo "bad gguf"; exit 1; }
        python3 tools/smollm2.py runs/smollm2 /tmp/smol.gguf
      fi
      setsid python3 bench/credit/credit_learned.py --stop-after train --jobs 16 & P=$!
      ( sleep ${LIMIT:-480}; kill -TERM -- -$P ) & W=$!; wait $P; echo "bench exit $?"; kill $W
      find bench/out/credit_learned \( -path '*/rms/*' -name '*.json' \) -o -path '*/runs/*' ! -name 'checkpoint*' \
        -type f -o -path '*/logs/*' -o -name runs.json | tar czf "$OUT/learned.tgz" -T -
    } > "$OUT/learned.log" 2>&1 ;;
esac
echo "exit $?"; cp $G/*.json "$OUT/" 2>/dev/null; ls "$OUT"
