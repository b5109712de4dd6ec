set -o pipefail
ROOT=$PWD
export PYTHONPATH=/tmp/site:$ROOT HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 PYTHONUNBUFFERED=1 NBKIT_CACHE=/tmp/nbkit-cache TOKENIZERS_PARALLELISM=false
for q in 16bit 4bit; do d=/tmp/v_$q; mkdir -p $d
  (cd $d && TMPDIR=$d timeout 250 python3 $ROOT/benchmarks/trainer_bench.py --longest --emulate T4 --configs unsloth:1 \
     --quant $q --unsloth-loss nbkit --shapes 64k --steps 1 --warmup 0 --time-limit 100 --launch-timeout 240 \
     --out $OUT/u_$q.json --md $OUT/u_$q.md > $OUT/u_$q.log 2>&1) &
done
wait
for q in 16bit 4bit; do grep "^| \|^- " $OUT/u_$q.md | cut -c1-400; tail -c 1500 /tmp/v_$q/trainer-bench-*/*.jsonl | grep -o '"error": "[^"]*' | tail -c 600; done
