#!/usr/bin/env bash
# GPU call 1 (not committed): install, quick GPU tests, the T4 matrix concurrently (4 x 15 GiB), probes.
set -o pipefail
ROOT=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -3
touch /tmp/site/.nbkit-installed
export PYTHONPATH=/tmp/site:$ROOT HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 PYTHONUNBUFFERED=1
export NBKIT_CACHE=/tmp/nbkit-cache TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers, trl, peft, accelerate; print('versions', torch.__version__, transformers.__version__, trl.__version__, peft.__version__, accelerate.__version__)"
python3 -c "import nbkit, time; t=time.time(); print(nbkit.resolve_model('random:qwen3-vl-2b'), round(time.time()-t,1))"
echo "=== tests A $(date -u +%T)"
timeout 120 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_emulation.py tests/test_guard.py 2>&1 | tail -15
echo "=== matrix start $(date -u +%T)"
for cfg in unsloth transformers; do for q in 16bit 4bit; do
  d=/tmp/w_${cfg}_$q; mkdir -p $d
  (cd $d && TMPDIR=$d timeout 430 python3 $ROOT/benchmarks/trainer_bench.py --longest --emulate T4 --configs $cfg:1 \
     --quant $q --unsloth-loss nbkit --shapes 64k,96k --steps 1 --warmup 0 --time-limit 300 --launch-timeout 415 \
     --out $OUT/m_${cfg}_$q.json --md $OUT/m_${cfg}_$q.md > $OUT/m_${cfg}_$q.log 2>&1) &
done; done
sleep 5
echo "=== offload probe $(date -u +%T)"
timeout 90 python3 $ROOT/offload_probe.py 2>&1 | tail -12
echo "=== tests B $(date -u +%T)"
timeout 150 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_savers_gpu.py -k "offload" 2>&1 | tail -8
timeout 150 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_unsloth_loss_gpu.py 2>&1 | tail -25
echo "=== waiting for matrix $(date -u +%T)"
wait
echo "=== matrix done $(date -u +%T)"
for f in $OUT/m_*.md; do echo "--- $f"; cat $f; done
for f in $OUT/m_*.log; do echo "--- $f"; grep -i "error\|Traceback\|emulating\|===" $f | tail -8; done
