#!/usr/bin/env bash
# GPU call 2 (not committed): the T4 matrix with the attention fix (4 concurrent x 15 GiB), GPU tests, probe.
set -o pipefail
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -3
export PYTHONPATH=/tmp/site:$ROOT HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 PYTHONUNBUFFERED=1
export NBKIT_CACHE=/tmp/nbkit-cache TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import nbkit; print(nbkit.resolve_model('random:qwen3-vl-2b'))" 2>&1 | tail -1
echo "=== matrix start $(date -u +%T)"
for cfg in unsloth transformers; do for q in 16bit 4bit; do
  d=/tmp/w_${cfg}_$q; mkdir -p $d
  (cd $d && TMPDIR=$d timeout 345 python3 $ROOT/benchmarks/trainer_bench.py --longest --emulate T4 --configs $cfg:1 \
     --quant $q --unsloth-loss nbkit --shapes 64k --steps 1 --warmup 0 --time-limit 200 --launch-timeout 335 \
     --out $OUT/m_${cfg}_$q.json --md $OUT/m_${cfg}_$q.md > $OUT/m_${cfg}_$q.log 2>&1) &
done; done
sleep 3
echo "=== tests $(date -u +%T)"
timeout 100 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_attention.py 2>&1 | tail -4
timeout 60 python3 $ROOT/offload_probe.py 2>&1 | grep -v Warning | tail -9
timeout 160 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_savers_gpu.py 2>&1 | tail -8
echo "=== waiting for matrix $(date -u +%T)"
wait
echo "=== matrix done $(date -u +%T)"
for f in $OUT/m_*.md; do echo "--- $f"; grep "^| \|^- " $f | cut -c1-330; done
