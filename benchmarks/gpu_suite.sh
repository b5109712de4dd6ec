#!/usr/bin/env bash
# Run nbkit's GPU work on an offline GPU host, one part or several per call, results under $OUT.
#
#   bash benchmarks/gpu_suite.sh env model planner    # versions, build random:qwen3-vl-2b, planner accuracy
#   bash benchmarks/gpu_suite.sh tests                # every gpu-marked test: the parts below in turn (~40 min)
#   bash benchmarks/gpu_suite.sh tests_faults         # one part of them (under 9 min each; TEST_PARTS below):
#     tests_watchdog tests_kernel tests_trl tests_a tests_b tests_savers_ddp tests_c tests_notebooks tests_notebooks4 tests_saving tests_split tests_fsdp_notebook  # SUITE_DRY_RUN=1: collected on the CPU
#   bash benchmarks/gpu_suite.sh soak                 # 20 live sets in a row on 2 GPUs: memory and processes per cycle (~9 min)
#   bash benchmarks/gpu_suite.sh matrix               # the 1K/16K launcher/backend matrix
#   bash benchmarks/gpu_suite.sh savers               # memory savers 8K-64K
#   bash benchmarks/gpu_suite.sh t4 t4notebooks       # T4 profile, one GPU: longest sequence per path, notebooks
#   bash benchmarks/gpu_suite.sh t4both               # the rest of the T4 matrix, both sets, six streams side by side (~9.5 min)
#   bash benchmarks/gpu_suite.sh scaling              # unsloth 1 -> 2 GPUs: checkpointing paths x DDP knobs, profiled
#   bash benchmarks/gpu_suite.sh launchers            # the same function via nbkit.launch, notebook_launcher, accelerate
#   bash benchmarks/gpu_suite.sh scaling2             # 1 -> 2 GPUs, transformers+peft+nbkit: nbkit.launch and a live set, bf16 and T4 profile (~8 min)
#   bash benchmarks/gpu_suite.sh scaling4             # SFTTrainer on 1, 2 and 4 GPUs, both backends (needs 4; ~9.5 min)
#   bash benchmarks/gpu_suite.sh accum                # 1K x 4 with gradient accumulation 4, 1 -> 2 GPUs
#   bash benchmarks/gpu_suite.sh ddp1k                # 1K x 4 under DDP: options that cut host work, profiled
#   bash benchmarks/gpu_suite.sh flat1k               # 1K x 4 on 2 GPUs: DDP's reducer against one flat all-reduce, both backends (~9 min)
#   bash benchmarks/gpu_suite.sh fp16                 # fp16 at 1K, and the plain transformers+peft anchor
#   bash benchmarks/gpu_suite.sh launched1            # unsloth on one GPU through nbkit.launch
#   bash benchmarks/gpu_suite.sh batch1k              # unsloth 1 -> 2 GPUs at 1K x 4 and 1K x 16
#   bash benchmarks/gpu_suite.sh long                 # the savers at 64K tokens
#   bash benchmarks/gpu_suite.sh trainer              # SFTTrainer, 1 -> 2 GPUs, three launchers, unsloth / transformers / Liger
#   bash benchmarks/gpu_suite.sh trainer_repeats      # SFTTrainer, unsloth 1 -> 2 GPUs at 1K x 4 and 16K x 1, repeated (median of 3 where time allows)
#   bash benchmarks/gpu_suite.sh trainer1             # SFTTrainer on 1 GPU: unsloth vs transformers+savers vs +Liger
#   bash benchmarks/gpu_suite.sh paths                # the same SFTTrainer code on 1 GPU and on 2 through every launcher
#                                                     # (nbkit.launch, live set, torchrun of an exported cell, accelerate
#                                                     # launch), host counters and a profile per launch (PATHS_* variables)
#   bash benchmarks/gpu_suite.sh hostcost             # 1K x 4 on 2 GPUs: syncs and collectives per Trainer step, SFTTrainer vs Trainer timed
#   bash benchmarks/gpu_suite.sh trainermem           # unsloth at 16K: peak memory by hand vs under SFTTrainer, largest allocations
#   bash benchmarks/gpu_suite.sh fsdp                 # FSDP-QLoRA vs device_map="balanced", T4 profile (1 GPU: the dry run)
#   bash benchmarks/gpu_suite.sh fsdp2                # 2 GPUs, one call (~7-9 min): Qwen3-14B shapes in 4-bit, FSDP vs balanced, T4 profile
#   bash benchmarks/gpu_suite.sh fsdp32               # 4 GPUs, one call (~10 min): Qwen3-32B shapes in 4-bit, T4 profile, FSDP on 2 (offloaded) and on 4 against balanced
#   bash benchmarks/gpu_suite.sh fsdphost             # 2 GPUs, one call: an FSDP rank's host time against a DDP rank's, by phase and library
#   bash benchmarks/gpu_suite.sh speed                # 1 GPU: unsloth vs transformers+savers+Liger+regional compile, bf16 and T4 profile (~9.8 min)
#   bash benchmarks/gpu_suite.sh speed_bf16 / speed_t4  # the same, one precision per call (up to ~9 minutes each)
#   bash benchmarks/gpu_suite.sh profile1k            # 1 GPU, 1K x 4: each backend's step taken apart (host, kernels), profiled
#   bash benchmarks/gpu_suite.sh vision_tests         # 1 GPU: the vision blocks compiled whole, against transformers' attention
#   bash benchmarks/gpu_suite.sh loss                 # 1 GPU: the loss alone, time and peak by rows per chunk, nbkit's and Liger's
#   bash benchmarks/gpu_suite.sh compilecheck         # 1 GPU: regional compilation's GPU tests, and 64K under the T4 profile compiled
#   bash benchmarks/gpu_suite.sh compile_steps        # 1 GPU: which flagship steps compile, sequence length marked and not (~4 min)
#   bash benchmarks/gpu_suite.sh compile16k           # regional compile where the tiled MLP splits (16K), 2 GPUs side by side
#   SUITE_DRY_RUN=1 bash benchmarks/gpu_suite.sh speed  # the same parts on the CPU with tiny:qwen3-vl (no wheels needed)
#   bash benchmarks/gpu_suite.sh kaggle               # 2 GPUs, the Kaggle image's set: the flagship's GPU test (~7.5 min)
#   bash benchmarks/gpu_pairs.sh 540 "fsdp2" "tests_faults"  # two GPU pairs of a 4-GPU host side by side (gpu_pairs.sh)
#   bash benchmarks/gpu_suite.sh kaggle_transformers  # 2 GPUs, the Kaggle image's set: the flagship, transformers backend (~5 min)
#   bash benchmarks/gpu_suite.sh flagship12           # the flagship under the T4 profile, gpus=1 then gpus=2: steady pace of each
#   bash benchmarks/gpu_suite.sh auto_ckpt            # 1 GPU, T4 profile: the flagship without checkpointing in 4-bit and on the oldest set (~5 min)
#   bash benchmarks/gpu_suite.sh ckpt_pair            # 1 GPU, T4 profile: the flagship alone without checkpointing, then with it (~4.5 min)
#
# Two sets of parts can share a 4-GPU machine, one GPU pair each (a separate TMPDIR keeps unsloth's
# compile caches apart):
#   CUDA_VISIBLE_DEVICES=0,1 TMPDIR=/tmp/a bash benchmarks/gpu_suite.sh scaling &
#   CUDA_VISIBLE_DEVICES=2,3 TMPDIR=/tmp/b bash benchmarks/gpu_suite.sh tests launchers; wait
#
# Needs .whl/ from ../shared/gpu/wheelhouse (carried along). Each part has its own time limit so
# that one hang cannot eat the whole call; a part that fails is reported and the next one runs.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
# Once per machine: sets of parts running side by side must not install into /tmp/site at once.
if [ -z "${SUITE_DRY_RUN:-}" ] && [ ! -e /tmp/site/.nbkit-installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  touch /tmp/site/.nbkit-installed
fi
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 PYTHONUNBUFFERED=1
# SUITE_SET=oldest: unsloth's Kaggle pins (transformers 4.57.1, trl 0.22.2 and what they need, from .whl-oldest/,
# see ../shared/gpu/README.md) go first on the path. unsloth writes the code it generates for the transformers it
# finds into UNSLOTH_COMPILE_LOCATION: one per set, so that both sets can run side by side.
if [ "${SUITE_SET:-newest}" = oldest ]; then
  if [ ! -e /tmp/oldest/.nbkit-installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/oldest .whl-oldest/*.whl || exit 1
    touch /tmp/oldest/.nbkit-installed
  fi
  export PYTHONPATH=/tmp/oldest:$PYTHONPATH UNSLOTH_COMPILE_LOCATION=/tmp/unsloth-cache-oldest
  # Its random checkpoints go to a cache of their own: a transformers 5 config does not load in 4.57. Set here and
  # not only where unset, since a part that runs another set's parts (t4both) passes its own cache down.
  export NBKIT_CACHE=/tmp/nbkit-cache-oldest
fi
# SUITE_SET=kaggle: the Kaggle image's set (constraints-kaggle.txt: transformers 5.5, trl 0.24, peft 0.19, accelerate
# 1.13), the same way, from .whl-kaggle/, which a machine with the package index fills (carry it with .whl/):
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl-kaggle -r constraints-kaggle.txt
# Its random checkpoints go to a cache of their own, as the oldest set's do.
if [ "${SUITE_SET:-newest}" = kaggle ]; then
  if [ ! -e /tmp/kaggle/.nbkit-installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kaggle .whl-kaggle/*.whl || exit 1
    touch /tmp/kaggle/.nbkit-installed
  fi
  export PYTHONPATH=/tmp/kaggle:$PYTHONPATH UNSLOTH_COMPILE_LOCATION=/tmp/unsloth-cache-kaggle
  export NBKIT_CACHE=/tmp/nbkit-cache-kaggle
fi
export NBKIT_CACHE=${NBKIT_CACHE:-/tmp/nbkit-cache} NBKIT_RESULTS_DIR=$OUT TOKENIZERS_PARALLELISM=false
# STACK_SAMPLES=1: every Python process samples its main thread's stack in Trainer's loop (the flagship's ranks
# included), into $OUT/stacks; benchmarks/stack_report.py summarises them (stack_sampler/sitecustomize.py says how).
if [ -n "${STACK_SAMPLES:-}" ]; then
  export PYTHONPATH=$PWD/benchmarks/stack_sampler:$PYTHONPATH NBKIT_STACK_SAMPLES=$OUT/stacks
fi
# RECOMPILE_LOGS=1: torch logs why each compiled graph was compiled again, every process into $OUT/recompiles.log.
if [ -n "${RECOMPILE_LOGS:-}" ]; then
  export TORCH_LOGS=recompiles TORCH_LOGS_OUT=$OUT/recompiles.log
fi

part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
  local start=$SECONDS
  timeout --signal=INT --kill-after=20 "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
  echo "=== $name: exit $? after $((SECONDS - start))s"
}

# The gpu-marked tests in parts that each end within 9 minutes on 2 GPUs: "NAME LIMIT PYTEST-ARGS...", one
# pytest process per PYTEST-ARGS (a file, or file:-k:expression for some of its tests), since files that
# launch ranks need a process without a CUDA context and files that test on the GPU directly create one.
# The seconds are estimates from earlier runs of each file on 2x H100 / H200 (benchmarks/RESULTS.md) and
# from the fault matrix's CPU dry run; `bash benchmarks/gpu_suite.sh tests` runs every part.
TEST_PARTS=(
  # the fault matrix through the API (18 cases: forked, spawned, live; 2x H100, 2026-11-26: about 460 s)
  "tests_faults 540 tests/faults/test_gpu_faults.py:-k:rank_that"
  # NCCL's watchdog ending a rank (2 cases, each its 5 s timeout plus the ranks' start), the guard's GPU launches
  "tests_watchdog 300 tests/faults/test_gpu_faults.py:-k:watchdog tests/test_guard.py"
  # the fault matrix in a kernel during trainer.train() (6 cases: 264 s on 2x H100, 2026-11-27)
  "tests_kernel 330 tests/faults/test_gpu_kernel_faults.py"
  # the short files (~3 minutes)
  "tests_a 500 tests/test_loss_gpu.py tests/test_magics.py tests/test_attention.py tests/test_emulation.py
   tests/test_live_set.py tests/test_reporting.py tests/test_fsdp_gpu.py tests/test_model_parallel_gpu.py
   tests/test_readme.py tests/test_gradient_averaging.py tests/test_trl_metrics.py"
  # 2 GPUs equal 1 with nbkit and unsloth (~3 minutes), the offline models (~1.5), the savers (~1.5)
  "tests_b 530 tests/test_gpu_ddp.py tests/test_offline.py tests/test_savers_gpu.py"
  # TRL's metrics averaged once per log against its own gathers, over NCCL (one launch, ~1 minute)
  "tests_trl 150 tests/test_trl_metrics.py"
  # the savers under DDP on two GPUs alone (tests_b's own limit has cut it before it ran)
  "tests_savers_ddp 400 tests/test_savers_gpu.py:-k:ddp_on_two_gpus"
  # Liger's kernels and regional compilation (~4 minutes), nbkit's loss on an unsloth model (~2), the vision blocks
  # compiled whole (~1.2)
  "tests_c 530 tests/test_liger_gpu.py tests/test_unsloth_loss_gpu.py tests/test_vision_attention.py"
  # the flagship notebook on two T4-capped GPUs, 16-bit by the planner and 4-bit, a part each (on 2x H100 beside
  # another part, 2026-11-27: 16-bit 275 s, 4-bit 324 s)
  "tests_notebooks 360 tests/test_notebooks_gpu.py:-k:trains_on_two_capped_gpus_with_unsloth_in_fp16[16bit"
  "tests_notebooks4 400 tests/test_notebooks_gpu.py:-k:trains_on_two_capped_gpus_with_unsloth_in_fp16[4bit"
  # the flagship saving merged 16-bit weights, then GGUF (unsloth's savers; GGUF skips on a host that is offline
  # and has no llama.cpp, which unsloth would download)
  "tests_saving 540 tests/test_notebooks_gpu.py:-k:saves_merged_or_gguf"
  # one process training on both GPUs: the model_parallel notebook with Qwen3-1.7B's shapes in 4-bit under the T4
  # profile (154 s on 2x H100), and a model split over both, or in 4-bit on one of the two (~40 s)
  "tests_split 360 tests/test_notebooks_gpu.py:-k:model_parallel_notebook tests/test_model_parallel_gpu.py"
  # the big-model notebook: FSDP-QLoRA on two T4-capped GPUs, the ranks loading their shares on the host
  "tests_fsdp_notebook 420 tests/test_notebooks_gpu.py:-k:big_model_fsdp_notebook"
)

test_part() {  # test_part NAME SECONDS PYTEST-ARGS...: see TEST_PARTS; SUITE_DRY_RUN=1 collects instead
  local name=$1 limit=$2; shift 2
  local mode=(-rs --durations=0)
  [ -z "${SUITE_DRY_RUN:-}" ] || mode=(--collect-only)
  part "$name" "$limit" bash -c 'status=0; mode=$1; shift; for args in "$@"; do
      python3 -m pytest -m gpu -q -p no:cacheprovider $mode ${args//:/ } || status=1; done; exit $status' \
    _ "${mode[*]}" "$@"
}

nbrun() {  # nbrun SUBDIR LIMIT NOTEBOOK PARAMETER...: one short notebook run under the T4 profile, one GPU (t4notebooks),
  # its log and executed copy under $OUT/SUBDIR; the PARAMETERs come last, so they may replace these defaults.
  local sub=$1 limit=$2 nbname=$3; shift 3
  OUT=$OUT/$sub T4_NB_LIMIT=$limit T4_NOTEBOOKS=$nbname T4_NB_PARAMS="-p max_seq_length=1024 -p save_steps=6 $*" \
    bash "$0" t4notebooks
}

nbsummary() {  # nbsummary SUBDIR [NOTEBOOK]: where nbrun's run of NOTEBOOK (the flagship) under SUBDIR left its summary.json
  echo "$OUT/$1/t4_notebooks/${2:-qwen3_vl_2xT4}/summary.json"
}

# The flagship with the transformers backend at one example of ~1,640 tokens per step (1,280-pixel images: 1,600 image
# tokens), against the plan's 2,048 x 1, so that its peak is near what the plan allows (auto_ckpt, ckpt_pair).
# SUITE_DRY_RUN=1: run.py's CPU parameters.
FLAGSHIP_LONG=(-p backend=transformers -p batch_size=1 -p max_seq_length=2048 -p image_size=1280)
[ -z "${SUITE_DRY_RUN:-}" ] || FLAGSHIP_LONG=(-p backend=transformers)

drop_weights() {  # drop_weights DIR...: the checkpoints and adapters nbrun's notebooks left under each DIR, which
  # the call would otherwise bring back (a call returns a limited number of files: their logs were left out)
  find "$@" -depth \( -name 'checkpoint-*' -o -name lora_model \) -type d -exec rm -rf {} +
}

model_part() {  # model_part MODEL SECONDS [NAME]: build MODEL's random checkpoint once, before the runs that load it
  part "${3:-speed_model}" "$2" python3 -c "import nbkit; print(nbkit.resolve_model('$1'))"
}

for what in "$@"; do
  case $what in
    env)
      part env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
        python3 -c "import torch, transformers, accelerate, peft; print(torch.__version__, transformers.__version__, accelerate.__version__, peft.__version__)";
        python3 -c "import torch, bitsandbytes; print(\"bitsandbytes import initialises CUDA:\", torch.cuda.is_initialized())"' ;;
    probe)
      part probe 90 python3 benchmarks/fork_probe.py ;;
    model)
      part model 150 python3 -c "import time, nbkit; t = time.time(); print(nbkit.resolve_model('random:qwen3-vl-2b'), round(time.time() - t, 1), 's')" ;;
    tests)
      # Every part below in turn (about 40 minutes), then any gpu-marked file no part names.
      for entry in "${TEST_PARTS[@]}"; do test_part $entry; done
      rest=()
      for f in $(grep -l "mark.gpu" tests/test_*.py tests/faults/test_*.py); do
        printf ' %s\n' "${TEST_PARTS[@]}" | grep -qF " $f" || rest+=("$f")
      done
      [ ${#rest[@]} -eq 0 ] || test_part tests_rest 540 "${rest[@]}" ;;
    tests_*)
      found=
      for entry in "${TEST_PARTS[@]}"; do
        [ "${entry%% *}" = "$what" ] && { found=1; test_part $entry; }
      done
      [ -n "$found" ] || echo "unknown part: $what" >&2 ;;
    soak)
      # 20 live sets in a row on 2 GPUs: start, load tiny:qwen3, 3 DDP steps, stop; GPU memory, GPU processes
      # and this process's children after each (~27 s a cycle on 2x H100, 2026-11-27: the set's start 17 s, the load
      # 8 s; the JSON is rewritten after every cycle). SUITE_DRY_RUN=1: 3 cycles on CPU ranks.
      cycles=${SOAK_CYCLES:-20}; [ -z "${SUITE_DRY_RUN:-}" ] || cycles=3
      part soak 580 python3 benchmarks/gpu_soak.py --cycles "$cycles" --out "$OUT/gpu_soak.json" ;;
    planner)
      part planner 150 python3 benchmarks/planner_accuracy.py --out "$OUT/planner_accuracy.json" ;;
    matrix)
      part matrix 560 python3 benchmarks/bench.py --matrix default --time-limit 470 \
        --out "$OUT/matrix.json" --md "$OUT/matrix.md" ;;
    savers)
      part savers 330 python3 benchmarks/savers.py --seq-lens 8k,16k,32k,64k --time-budget 300 \
        --out "$OUT/savers.json" --md "$OUT/savers.md" ;;
    t4)
      # The T4 profile (nbkit.emulate("T4"): 15 GiB per process, fp16, no bf16 / flash SDPA / TF32) on one GPU.
      # 1. The longest sequence (batch 1, one image per sample, SFTTrainer, Qwen3-VL-2B shapes) each shipped path
      #    trains, and its tokens/s: unsloth (nbkit's chunked loss in place of unsloth's, which keeps full fp32
      #    logits under SFTTrainer), transformers+peft+nbkit.savers, the same with Liger's kernels; 16-bit and
      #    4-bit weights. 64K first (the target), then longer, or bisected down to where it trains.
      # Sequentially ~20 min on an H100: give each step its own call with T4_CONFIGS / T4_QUANTS.
      for quant in ${T4_QUANTS:-16bit 4bit}; do
        part "t4_$quant" "${T4_LIMIT:-560}" python3 benchmarks/trainer_bench.py --longest --emulate T4 \
          --configs "${T4_CONFIGS:-unsloth:1,transformers:1,liger:1}" --quant "$quant" --unsloth-loss nbkit \
          --shapes "${T4_SHAPES:-64k,96k,128k}" --steps 1 --warmup "${T4_WARMUP:-1}" \
          --time-limit "$(( ${T4_LIMIT:-560} - 120 ))" --launch-timeout "${T4_LAUNCH_TIMEOUT:-400}" --out "$OUT/t4_$quant.json" --md "$OUT/t4_$quant.md"
      done ;;
    t4notebooks)
      # The notebooks, one GPU, under the T4 profile (the emulate parameter), short runs; T4_NB_PARAMS adds
      # parameters (e.g. "-p backend=transformers -p load_in_4bit=True"), T4_NB_LIMIT bounds each notebook.
      for nb in ${T4_NOTEBOOKS:-qwen3_vl_2xT4 qwen3_vl_2xT4_oneshot text_llm_ddp}; do
        # shellcheck disable=SC2086  # T4_NB_PARAMS holds several -p options
        part "t4_nb_$nb" "${T4_NB_LIMIT:-420}" python3 notebooks/run.py "$nb" --out "$OUT/t4_notebooks" \
          -p gpus=1 -p emulate=T4 -p max_steps=10 -p num_samples=80 ${T4_NB_PARAMS:-}
      done ;;
    t4both)
      # The rest of the T4 matrix in one call (~9.5 minutes): six streams side by side on one GPU, each process
      # capped at 15 GiB by the profile, so their step times say that a case trains, not how fast. The newest set:
      # the flagship (live set) with unsloth in 4-bit; the one-shot flagship and text_llm_ddp with unsloth (the
      # planner's choice of weights) and transformers in 4-bit; Liger's kernels at 64K in 16-bit and 4-bit. The
      # oldest set: unsloth and transformers at 64K in both weights, and the flagship with both backends in 4-bit.
      bash "$0" env
      SUITE_SET=oldest bash "$0" env_oldest
      ( nbrun nb_flagship_unsloth_4bit 330 qwen3_vl_2xT4 -p backend=unsloth -p load_in_4bit=True
        nbrun nb_oneshot_unsloth 240 qwen3_vl_2xT4_oneshot -p backend=unsloth ) &
      ( nbrun nb_text_unsloth 200 text_llm_ddp -p backend=unsloth
        nbrun nb_text_transformers_4bit 150 text_llm_ddp -p backend=transformers -p load_in_4bit=True
        nbrun nb_oneshot_transformers_4bit 150 qwen3_vl_2xT4_oneshot -p backend=transformers -p load_in_4bit=True ) &
      ( export SUITE_SET=oldest
        nbrun oldest_nb_flagship_unsloth_4bit 330 qwen3_vl_2xT4 -p backend=unsloth -p load_in_4bit=True
        nbrun oldest_nb_flagship_transformers_4bit 200 qwen3_vl_2xT4 -p backend=transformers -p load_in_4bit=True ) &
      OUT=$OUT/liger T4_CONFIGS=liger:1 T4_SHAPES=64k T4_WARMUP=0 T4_LIMIT=250 T4_LAUNCH_TIMEOUT=240 bash "$0" t4 &
      for quant in 4bit 16bit; do
        OUT=$OUT/oldest_$quant SUITE_SET=oldest T4_CONFIGS=unsloth:1,transformers:1 T4_QUANTS=$quant T4_SHAPES=64k \
          T4_WARMUP=0 T4_LIMIT=500 T4_LAUNCH_TIMEOUT=330 bash "$0" t4 &
      done
      wait ;;
    auto_ckpt)
      # The recipe's checkpointing="auto" where it turns checkpointing off, on the paths no GPU had run that way: 4-bit
      # weights, and the oldest set (transformers 4.57, trl 0.22, whose Trainer names the field
      # gradient_checkpointing). FLAGSHIP_LONG on one GPU under the T4 profile; four notebooks side by side (~5
      # minutes), so their step times say that a case trains, not how fast. SUITE_DRY_RUN=1: the same runs on CPU ranks.
      long=("${FLAGSHIP_LONG[@]}" -p max_steps=8)
      four=(-p load_in_4bit=True)
      # On the CPU the 4-bit runs train in 16 bits (bitsandbytes' 4-bit needs CUDA).
      [ -z "${SUITE_DRY_RUN:-}" ] || { long=("${FLAGSHIP_LONG[@]}" -p max_steps=2); four=(); }
      ( nbrun auto_16bit 330 qwen3_vl_2xT4 "${long[@]}"
        export SUITE_SET=oldest; nbrun auto_oldest_4bit 240 qwen3_vl_2xT4 "${long[@]}" "${four[@]}" ) &
      nbrun auto_4bit 330 qwen3_vl_2xT4 "${long[@]}" "${four[@]}" &
      ( export SUITE_SET=oldest; nbrun auto_oldest_16bit 330 qwen3_vl_2xT4 "${long[@]}" ) &
      wait
      summaries=()
      for run in auto_16bit auto_4bit auto_oldest_16bit auto_oldest_4bit; do
        summaries+=("$run=$(nbsummary "$run")")
      done
      python3 benchmarks/flagship_scaling.py "${summaries[@]}" | tee "$OUT/auto_ckpt.md"
      drop_weights "$OUT"/auto_* ;;
    ckpt_pair)
      # FLAGSHIP_LONG alone on one GPU under the T4 profile, trained without checkpointing and then with the offloaded
      # checkpoint: whether "auto"'s choice makes the notebook faster, its answer cell before training included (~4.5
      # minutes). CKPT_ORDER="offload None" runs them the other way round, "None offload None offload" twice
      # interleaved (a call's second notebook ran 11-21% faster than its first, whichever it was). SUITE_DRY_RUN=1: CPU
      # ranks.
      steps=12; [ -z "${SUITE_DRY_RUN:-}" ] || steps=3
      summaries=()
      declare -A runs_of=()  # how many runs each value has had: its next run's folder and label are ckpt_VALUE<count>
      for checkpointing in ${CKPT_ORDER:-None offload}; do
        run=ckpt_$checkpointing${runs_of[$checkpointing]:-0}
        runs_of[$checkpointing]=$(( ${runs_of[$checkpointing]:-0} + 1 ))
        nbrun "$run" 200 qwen3_vl_2xT4 "${FLAGSHIP_LONG[@]}" -p max_steps=$steps -p save_steps=1000 \
          -p checkpointing=$checkpointing
        summaries+=("$run=$(nbsummary "$run")")
      done
      python3 benchmarks/flagship_scaling.py "${summaries[@]}" | tee "$OUT/ckpt_pair.md"
      drop_weights "$OUT"/ckpt_* ;;
    kaggle)
      # The Kaggle image's set (SUITE_SET=kaggle above) on 2 GPUs: its versions, then the flagship notebook's GPU test
      # (two GPUs capped as T4s, unsloth in fp16), 16-bit by the planner or KAGGLE_WEIGHTS=4bit: 4.5-5.5 minutes each
      # on 2x H100 (2026-11-27), so one per call.
      SUITE_SET=kaggle bash "$0" env kaggle_tests ;;
    kaggle_transformers)
      # The flagship with the transformers backend on the Kaggle image's set, 2 GPUs under the T4 profile, 4-bit and
      # 16-bit: TRL 0.24's own vision collator and peft 0.19, which the unsloth runs above do not use.
      SUITE_SET=kaggle bash "$0" env kaggle_nb_4bit kaggle_nb_16bit ;;
    kaggle_tests|kaggle_nb_*)
      [ "${SUITE_SET:-}" = kaggle ] || { echo "$what: run it through the kaggle or kaggle_transformers part" >&2; continue; }
      if [ "$what" = kaggle_tests ]; then
        test_part kaggle_tests 400 "tests/test_notebooks_gpu.py:-k:trains_on_two_capped_gpus_with_unsloth_in_fp16[${KAGGLE_WEIGHTS:-16bit}"
      else
        quant=${what#kaggle_nb_}; four=False; [ "$quant" = 4bit ] && four=True
        part "kaggle_nb_transformers_$quant" 240 python3 notebooks/run.py qwen3_vl_2xT4 --out "$OUT/kaggle_$quant" \
          -p gpus=2 -p emulate=T4 -p backend=transformers -p load_in_4bit=$four -p max_steps=10 -p num_samples=80 \
          -p max_seq_length=1024 -p save_steps=5
      fi ;;
    env_oldest)
      part env_oldest 60 python3 -c "import transformers, trl, peft, accelerate; print('oldest set:', transformers.__version__, trl.__version__, peft.__version__, accelerate.__version__)" ;;
    scaling)
      # unsloth on one GPU (notebook_launcher runs one process in place: unsloth's single-GPU
      # path) and on 2 under nbkit.launch: with nbkit's default (unsloth's single-GPU checkpointing
      # kept under DDP) and with unsloth's own DDP checkpointing. Text-only batches: the vision
      # tower's LoRA weights get no gradient and are frozen (bench.py's default freeze_unused), as
      # finetune_vision_layers=False would; freeze_unused=false is Trainer's search for them instead.
      part scaling 300 python3 benchmarks/bench.py --configs unsloth:1@notebook,unsloth:2 \
        --seq-lens 1024x4,16384x1 --precisions bf16 ${SCALING_FLAGS:-} \
        --time-limit 290 --out "$OUT/scaling.json" --md "$OUT/scaling.md"
      NBKIT_UNSLOTH_VLM_DDP_CHECKPOINTING=unsloth part scaling_unsloth_ddp 170 python3 benchmarks/bench.py \
        --configs unsloth:2 --seq-lens 1024x4,16384x1 --precisions bf16 --ddp "" \
        --ddp freeze_unused=false ${SCALING_FLAGS:-} --time-limit 160 \
        --out "$OUT/scaling_unsloth_ddp.json" --md "$OUT/scaling_unsloth_ddp.md" ;;
    ddp1k)
      # Where the 1K x 4 step goes under DDP: unsloth on one GPU in place and on 2 GPUs with DDP
      # options that take host work off each step; every case profiled.
      part ddp1k 300 python3 benchmarks/bench.py --configs unsloth:1@notebook,unsloth:2 \
        --seq-lens 1024x4 --precisions bf16 --ddp freeze_unused=true --ddp gradient_as_bucket_view=true \
        --ddp broadcast_buffers=false --ddp gradient_as_bucket_view=true,broadcast_buffers=false,bucket_cap_mb=512 \
        --profile --time-limit 280 --out "$OUT/ddp1k.json" --md "$OUT/ddp1k.md" ;;
    flat1k)
      # 1K x 4: DDP's reducer against one flat all-reduce of the LoRA gradients after the backward (bench.py's
      # reducer=flat, benchmarks.stepping.FlatGradients: DDP launches ~3 kernels per LoRA tensor per step, 1,178
      # for 392 tensors, where the flat one launches a handful), beside one GPU in place, unsloth and then
      # transformers+peft+nbkit. Each 2-GPU launch runs its cases A B A B: the second pair repeats the first under
      # names that change nothing (find_unused_parameters=false is what "auto" gives once the unused tensors are
      # frozen), since cases of one launch spread by 14-23%. SUITE_DRY_RUN=1: transformers+peft+nbkit on CPU ranks.
      configs=unsloth:1@notebook,unsloth:2,nbkit:1@notebook,nbkit:2 run=(--seq-lens 1024x4 --precisions bf16)
      [ -z "${SUITE_DRY_RUN:-}" ] || { configs=nbkit:1@notebook,nbkit:2; run=(--model tiny:qwen3-vl --seq-lens 128x2 --precisions fp32 --steps 2 --warmup 1); }
      part flat1k 540 python3 benchmarks/bench.py --configs "$configs" "${run[@]}" --ddp "" --ddp reducer=flat \
        --ddp find_unused_parameters=false --ddp find_unused_parameters=false,reducer=flat --time-limit 520 \
        --out "$OUT/flat1k.json" --md "$OUT/flat1k.md" ;;
    fp16)
      # fp16 at 1K x 4: unsloth 1 -> 2 GPUs, and the plain transformers+peft anchor under
      # notebook_launcher in bf16 at both lengths and fp16 at 1K.
      part fp16 240 python3 benchmarks/bench.py --configs unsloth:1@notebook,unsloth:2 --seq-lens 1024x4 \
        --precisions fp16 --time-limit 230 --out "$OUT/fp16.json" --md "$OUT/fp16.md"
      part anchor 200 python3 benchmarks/bench.py --configs plain:2@notebook --seq-lens 1024x4,16384x1 \
        --time-limit 190 --out "$OUT/anchor.json" --md "$OUT/anchor.md" ;;
    batch1k)
      # 1K sequences with 4 and 16 per GPU: the 1K x 4 step is bound by host work; 16 per GPU is not.
      part batch1k 280 python3 benchmarks/bench.py --configs unsloth:1@notebook,unsloth:2 --seq-lens 1024x4,1024x16 \
        --precisions bf16 --time-limit 250 --out "$OUT/batch1k.json" --md "$OUT/batch1k.md" ;;
    launched1)
      # unsloth on one GPU through nbkit.launch (a forked rank that unsloth sees as distributed).
      part launched1 150 python3 benchmarks/bench.py --configs unsloth:1 --seq-lens 1024x4,16384x1 \
        --precisions bf16 --time-limit 140 --out "$OUT/launched1.json" --md "$OUT/launched1.md" ;;
    accum)
      # 1K x 4 with gradient accumulation 4 (unsloth's notebooks' default): DDP synchronises once per
      # 4 micro-batches, against once per micro-batch in `scaling`.
      part accum 300 python3 benchmarks/bench.py --configs unsloth:1@notebook,unsloth:2 --seq-lens 1024x4 \
        --precisions bf16 --grad-accum 4 --time-limit 290 --out "$OUT/accum.json" --md "$OUT/accum.md" ;;
    launchers)
      limit=${LAUNCHERS_LIMIT:-230}
      part launchers "$limit" python3 benchmarks/bench.py --configs nbkit:2,nbkit:2@accelerate,plain:2@notebook \
        --seq-lens 1024x4,16384x1 --precisions bf16 --time-limit $((limit - 10)) \
        --out "$OUT/launchers.json" --md "$OUT/launchers.md" ;;
    scaling4)
      # SFTTrainer on 1, 2 and 4 GPUs of one 4-GPU host, one call (~9.5 minutes on 4x H100), every ratio from it:
      # unsloth on 1 and 4 (its launches cost 100-140 s each, a second shape ~90 s of compilation more, so
      # SCALING4_UNSLOTH_SHAPES is 16K x 1 alone by default: GPU-bound, where DDP's scaling shows; 1K x 4 is bound
      # by the host, RESULTS.md), then transformers+peft+nbkit (Liger's kernels; ~40-70 s a launch) at 1K x 4 and
      # 16K x 1 through nbkit.launch on 1, 4 and 2 GPUs and a live set on 4. A launch that would start after its part's limit is
      # recorded as skipped. SUITE_DRY_RUN=1: the transformers path on CPU ranks, tiny:qwen3-vl.
      model=random:qwen3-vl-2b
      liger=${SCALING4_LIGER:-liger:1@notebook,liger:4,liger:2,liger:4@live}
      unsloth=${SCALING4_UNSLOTH-unsloth:1@notebook,unsloth:4}  # set empty: no unsloth launch
      run=(--steps 8 --warmup 3 --launch-timeout 240)
      shapes=1024x4,16384x1
      if [ -n "${SUITE_DRY_RUN:-}" ]; then
        model=tiny:qwen3-vl liger=${liger//liger/transformers} unsloth=
        run=(--model $model --device cpu --steps 2 --warmup 1 --launch-timeout 240) shapes=128x2
      fi
      model_part "$model" 120 scaling4_model
      [ -z "$unsloth" ] || part scaling4_unsloth 290 python3 benchmarks/trainer_bench.py --configs "$unsloth" \
        --shapes "${SCALING4_UNSLOTH_SHAPES:-16384x1}" "${run[@]}" --time-limit 150 \
        --out "$OUT/scaling4_unsloth.json" --md "$OUT/scaling4_unsloth.md"
      limit=${SCALING4_LIGER_LIMIT:-200}
      part scaling4_transformers "$limit" python3 benchmarks/trainer_bench.py --configs "$liger" --shapes "$shapes" \
        "${run[@]}" --time-limit $((limit - 80)) --out "$OUT/scaling4_transformers.json" --md "$OUT/scaling4_transformers.md" ;;
    scaling2)
      # One GPU against two on one 2-GPU host, every ratio from this call: transformers+peft+nbkit as a notebook
      # gets it on a GPU (nbkit.training.models.add_lora: Liger's loss, layers compiled) through nbkit.launch on 1 GPU
      # (a rank's one thread, as on 2: the harness's own process keeps a thread per core, whose other threads used
      # 0.6-1.0 s of CPU per step on 32 cores while its launches' steps spread by 39%, a launched one-GPU rank's by
      # 6-10%: RESULTS.md, "Two GPUs against one launched GPU"), through nbkit.launch and a live set (the shipped
      # notebooks' path) on 2, at 1K x 4 and 16K x 1, in bf16 and then under the T4 profile (fp16, 15 GiB per process). 100-170 s a launch of both shapes (their compilation
      # included), six launches; SCALING2_CONFIGS / SCALING2_SHAPES / SCALING2_PRECISIONS replace the defaults
      # (unsloth: 150-260 s a launch). SCALING2_REPEATS=3: each launch three times, interleaved (every
      # configuration once, then again), the report taking the median per configuration.
      # SUITE_DRY_RUN=1: the transformers path on CPU ranks, tiny:qwen3-vl, compiled without code generation.
      model=random:qwen3-vl-2b
      configs=${SCALING2_CONFIGS:-liger+compile:1,liger+compile:2,liger+compile:2@live}
      run=(--steps 8 --warmup 3 --launch-timeout 240)
      shapes=${SCALING2_SHAPES:-1024x4,16384x1}
      if [ -n "${SUITE_DRY_RUN:-}" ]; then
        model=tiny:qwen3-vl configs=${configs//liger/transformers}
        run=(--model $model --device cpu --steps 2 --warmup 1 --launch-timeout 240 --compile-backend aot_eager) shapes=128x2
      fi
      model_part "$model" 120 scaling2_model
      for precision in ${SCALING2_PRECISIONS:-bf16 t4}; do
        emulate=()
        [ "$precision" != t4 ] || emulate=(--emulate T4)
        [ -n "${SUITE_DRY_RUN:-}" ] || [ "$precision" = t4 ] || emulate=(--precision "$precision")
        part "scaling2_$precision" "${SCALING2_LIMIT:-240}" python3 benchmarks/trainer_bench.py --configs "$configs" \
          --shapes "$shapes" "${run[@]}" "${emulate[@]}" --repeats "${SCALING2_REPEATS:-1}" --time-limit $((${SCALING2_LIMIT:-240} - 60)) \
          --out "$OUT/scaling2_$precision.json" --md "$OUT/scaling2_$precision.md"
      done ;;
    splitprobe)
      # Two GPUs (~2 minutes): what transformers and Trainer make of a model split over both, 16-bit and 4-bit,
      # device_map="balanced" and an explicit map (benchmarks/split_probe.py). SUITE_DRY_RUN=1 does nothing.
      [ -n "${SUITE_DRY_RUN:-}" ] && continue
      model_part random:qwen3-1.7b 120 splitprobe_model
      part splitprobe 240 python3 benchmarks/split_probe.py --out "$OUT/splitprobe.json" ;;
    long)
      limit=${LONG_LIMIT:-330}
      part long "$limit" python3 benchmarks/savers.py --seq-lens 64k --configs ${LONG_CONFIGS:-all,plain,recompute} \
        --steps 3 --warmup 1 --time-budget $((limit - 30)) --out "$OUT/long.json" --md "$OUT/long.md" ;;
    paths)
      # Where a rank that nbkit starts loses time against other launchers of the same training code: each launch's
      # step times, rank 0's host counters (main-thread and process CPU, context switches, threads) and 2 profiled
      # steps. One-GPU configurations see one GPU (CUDA_VISIBLE_DEVICES), so scaling ratios come from this call.
      # A launch that trains two shapes under the T4 profile (unsloth's live set: its compile, 1K and 16K) needs
      # more than the default 240 s: PATHS_LAUNCH_TIMEOUT. SUITE_DRY_RUN=1: every configuration on the transformers
      # path (CPU ranks, tiny:qwen3-vl, compiled without code generation): the 2B model in fp32 took 8.5 GB a rank,
      # and two sets of gpu_pairs.sh side by side made this 24 GiB machine swap for minutes.
      limit=${PATHS_LIMIT:-480}
      configs=${PATHS_CONFIGS:-unsloth:1@notebook,unsloth:2,unsloth:2@live,unsloth:2@torchrun,unsloth:2@accelerate}
      # PATHS_PROFILE=0 leaves the profiled steps out: ~5 s a launch, so that 12 launches fit in one call.
      run=(--shapes "${PATHS_SHAPES:-1024x4}" --steps "${PATHS_STEPS:-8}" --warmup 3 --profile-steps "${PATHS_PROFILE:-2}")
      if [ -n "${SUITE_DRY_RUN:-}" ]; then
        configs=${configs//liger/transformers} configs=${configs//unsloth/transformers}
        run=(--model tiny:qwen3-vl --device cpu --compile-backend aot_eager --shapes 128x2 --steps 2 --warmup 1
          --profile-steps "${PATHS_PROFILE:-1}")
      fi
      # shellcheck disable=SC2086  # PATHS_ARGS holds several options
      part "paths${PATHS_TAG:-}" "$limit" python3 benchmarks/trainer_bench.py --configs "$configs" "${run[@]}" \
        --repeats "${PATHS_REPEATS:-1}" --launch-timeout "${PATHS_LAUNCH_TIMEOUT:-240}" --time-limit $((limit - 100)) ${PATHS_ARGS:-} \
        --out "$OUT/paths${PATHS_TAG:-}.json" --md "$OUT/paths${PATHS_TAG:-}.md" ;;
    trainer)
      # Issue 16's comparison with the flagship's training code (TRL SFTTrainer, one small image per sample):
      # unsloth on 1 GPU in place and on 2 under nbkit.launch, transformers+peft+nbkit.savers on 2 GPUs with
      # and without Liger's kernels, then unsloth on 2 under notebook_launcher and accelerate launch. 10 timed
      # steps after 2 per shape. Estimated on 2x H200 (from one H100 run of trainer1): ~120 s per unsloth
      # launch, ~50 s per transformers launch; launches that would start after 420 s are recorded as skipped.
      part trainer 540 python3 benchmarks/trainer_bench.py \
        --configs unsloth:1@notebook,unsloth:2,liger:2,transformers:2,unsloth:2@notebook,unsloth:2@accelerate \
        --shapes 1024x4,1024x16,16384x1 --steps 10 --warmup 2 --time-limit 420 --launch-timeout 180 \
        --out "$OUT/trainer.json" --md "$OUT/trainer.md" ;;
    trainer_repeats)
      part trainer_repeats 560 python3 benchmarks/trainer_bench.py --configs unsloth:1@notebook,unsloth:2 \
        --shapes 1024x4,16384x1 --steps 10 --warmup 2 --repeats 3 --time-limit 480 --launch-timeout 180 \
        --out "$OUT/trainer_repeats.json" --md "$OUT/trainer_repeats.md" ;;
    trainer1)
      # One GPU: how far transformers+peft+nbkit's savers (with Liger's kernels) are from unsloth.
      part trainer1 420 python3 benchmarks/trainer_bench.py --configs unsloth:1@notebook,liger:1@notebook,transformers:1@notebook \
        --shapes 1024x4,16384x1 --steps 10 --warmup 2 --time-limit 300 --launch-timeout 180 \
        --out "$OUT/trainer1.json" --md "$OUT/trainer1.md" ;;
    hostcost)
      # What a Trainer step at 1K x 4 on 2 GPUs spends outside GPU work (CPU counts in RESULTS.md).
      # host_cost.py: per optimizer step, collectives, host reads of tensor values and CUDA syncs, each with
      # the Python frame that caused it, for Trainer and SFTTrainer, with and without nbkit's reporting
      # callback and Trainer's NaN filter, both backends. Then trainer_bench times SFTTrainer against Trainer
      # without the NaN filter, which has none of TRL's per-micro-step metric syncs: the most that deferring
      # those (no clean patch exists: see RESULTS.md) could gain. ~9.5 minutes: run it alone in a call.
      part hostcost_transformers 120 python3 benchmarks/host_cost.py --variants hf,hf+nanfilter_off,hf+nanfilter_off+nobcast,sft,sft+noreport \
        --steps 6 --profile-steps 2 --out "$OUT/hostcost_transformers.json" --md "$OUT/hostcost_transformers.md"
      part hostcost_unsloth 160 python3 benchmarks/host_cost.py --backend unsloth --variants hf,hf+nanfilter_off,sft \
        --steps 6 --profile-steps 2 --out "$OUT/hostcost_unsloth.json" --md "$OUT/hostcost_unsloth.md"
      part hostcost_sft 150 python3 benchmarks/trainer_bench.py --configs transformers:2,unsloth:2 --shapes 1024x4 \
        --steps 20 --warmup 3 --time-limit 60 --launch-timeout 130 \
        --out "$OUT/hostcost_sft.json" --md "$OUT/hostcost_sft.md"
      part hostcost_hf 150 python3 benchmarks/trainer_bench.py --configs transformers:2,unsloth:2 --shapes 1024x4 \
        --trainer hf --trainer-option logging_nan_inf_filter=false --steps 20 --warmup 3 --time-limit 60 \
        --launch-timeout 130 --out "$OUT/hostcost_hf.json" --md "$OUT/hostcost_hf.md" ;;
    trainermem)
      # Why unsloth's peak at 16K is 18.4 GiB under SFTTrainer against 13.8 GiB in bench.py's loop: one process,
      # the same model stepped by hand, after SFTTrainer's __init__, through trainer.compute_loss, and trained;
      # peak, logits shape, UNSLOTH_RETURN_LOGITS and the largest allocations with their Python frames.
      part trainermem 240 python3 benchmarks/trainer_memory.py --backend unsloth --shape 16384x1 \
        --out "$OUT/trainer_memory.json" ;;
    fsdp)
      # FSDP-QLoRA against device_map="balanced" in one process, T4 profile (fp16, 15 GiB per GPU). On one GPU the
      # dry run (world size 1), which also compares the planner's per-rank estimate with the measured peak; on
      # several, Qwen3-14B and -32B shapes in 4-bit over all of them (their random checkpoints are built first:
      # 29.5 and 65.5 GB on disk).
      gpus=$(nvidia-smi -L | wc -l)
      if [ "$gpus" -lt 2 ]; then
        part fsdp "${FSDP_LIMIT:-540}" python3 benchmarks/fsdp_vs_balanced.py --model random:qwen3-1.7b --gpus 1 --t4 \
          --seq-len 1024 --batch 2 --out "$OUT/fsdp_vs_balanced.json" --md "$OUT/fsdp_vs_balanced.md"
      else
        for model in random:qwen3-14b random:qwen3-32b; do
          part "fsdp-${model#random:}" 570 python3 benchmarks/fsdp_vs_balanced.py --model "$model" --gpus "$gpus" \
            --t4 --seq-len 1024 --batch 1 --out "$OUT/fsdp_vs_balanced.json" --md "$OUT/fsdp_vs_balanced-${model#random:}.md"
        done
      fi ;;
    fsdp2)
      # Two GPUs, one call (~7-9 minutes on 2x H100): the random Qwen3-14B checkpoint (29.5 GB) is built in the
      # background while the split-model fp16 GPU test runs, then FSDP-QLoRA against the balanced split under the
      # T4 profile: Qwen3-14B shapes in 4-bit, 1K x 1 per GPU (the balanced process 1K x 2), 8 steps: 3 of warm-up,
      # 4 timed, the last profiled (kernel time by kind; rank 0's op table in fsdp2_profile/). Qwen3-32B shapes: the
      # fsdp32 part. SUITE_DRY_RUN=1: tiny:qwen3, 16-bit, CPU.
      model=${FSDP2_MODEL:-random:qwen3-14b}
      # FSDP2_T4=0: bf16 without the T4 profile's cap (no loss scaler: whether a difference is fp16's)
      bench=(--gpus 2 --seq-len 1024 --batch 1 --steps 8 --warmup 3)
      [ "${FSDP2_T4:-1}" = 0 ] || bench+=(--t4)
      if [ -n "${SUITE_DRY_RUN:-}" ]; then
        model=tiny:qwen3
        bench=(--gpus 2 --16bit --seq-len 64 --steps 4 --warmup 1)
      fi
      model_part "$model" "${FSDP2_BUILD_LIMIT:-240}" fsdp2_model &
      part fsdp2_tests 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_model_parallel_gpu.py
      wait
      # FSDP2_ARGS: more of the benchmark's options, e.g. "--seq-len 4096" (bound by the GPU rather than the host) or
      # "--compile none" (the ranks' layers eager, as the balanced process's are).
      part fsdp2 "${FSDP2_LIMIT:-300}" python3 benchmarks/fsdp_vs_balanced.py --model "$model" "${bench[@]}" ${FSDP2_ARGS:-} \
        --profile-dir "$OUT/fsdp2_profile" --out "$OUT/fsdp2.json" --md "$OUT/fsdp2.md" ;;
    fsdp32)
      # Qwen3-32B shapes in 4-bit under the T4 profile, one call on a 4-GPU host (~9 minutes): the random checkpoint
      # (65.5 GB, ~90 s) is built while the 2-GPU FSDP tests run on GPUs 2 and 3 (a load on the host among them); then
      # FSDP on GPUs 0 and 1, whose ranks load their shares of the weights on the host (the whole 4-bit model, 18.4
      # GiB, is over a T4's 15) and train with their shards in CPU memory (FSDP's CPU offload, which nbkit turns on
      # there: FSDP32_OFFLOAD=0 / 1 sets FSDP_OFFLOAD_PARAMS instead); then FSDP on 4 GPUs against the balanced split
      # over the same 4. 1K x 1 per FSDP rank, 6 steps (2 of warm-up); FSDP32_ARGS adds fsdp_vs_balanced.py options
      # (--memory-steps 2: what is live at the peak; --seq-len 4096). FSDP32_FOUR=0: the 2-GPU run alone, on the
      # GPUs the part is given (a gpu_pairs.sh set). SUITE_DRY_RUN=1: tiny:qwen3, 16-bit, CPU ranks.
      model=random:qwen3-32b
      four=${FSDP32_FOUR:-1} first_pair=(env CUDA_VISIBLE_DEVICES=0,1)
      [ "$four" = 1 ] || first_pair=()
      bench=(--t4 --seq-len 1024 --batch 1 --steps 6 --warmup 2)
      if [ -n "${SUITE_DRY_RUN:-}" ]; then
        model=tiny:qwen3
        bench=(--16bit --seq-len 64 --steps 3 --warmup 1)
      fi
      # shellcheck disable=SC2206  # FSDP32_ARGS holds several options
      bench+=(${FSDP32_ARGS:-})
      # The machine's CPU memory every 5 s (MiB, free's columns): the ranks' share of it loading on the host and
      # under offload, against the planner's fsdp_host_gib.
      (while :; do echo "$(date +%T) $(free -m | grep Mem:)"; sleep 5; done) > "$OUT/fsdp32_free.log" &
      sampler=$!
      model_part "$model" "${FSDP32_BUILD_LIMIT:-300}" fsdp32_model &
      build=$!
      tests=
      if [ -z "${SUITE_DRY_RUN:-}" ] && [ "$four" = 1 ]; then
        CUDA_VISIBLE_DEVICES=2,3 part fsdp32_tests 240 python3 -m pytest -m gpu -q -rs -p no:cacheprovider \
          tests/test_fsdp_gpu.py -k two_gpus &
        tests=$!
      fi
      wait $build
      offload=()
      case ${FSDP32_OFFLOAD:-} in 0) offload=(env FSDP_OFFLOAD_PARAMS=false) ;; 1) offload=(env FSDP_OFFLOAD_PARAMS=true) ;; esac
      part fsdp32_2gpus "${FSDP32_LIMIT:-200}" "${first_pair[@]}" "${offload[@]}" python3 benchmarks/fsdp_vs_balanced.py \
        --model "$model" --gpus 2 --modes fsdp "${bench[@]}" --out "$OUT/fsdp32_2gpus.json" --md "$OUT/fsdp32_2gpus.md"
      [ -z "$tests" ] || wait "$tests"  # on GPUs 2 and 3 (a bare wait would wait for the memory sampler too)
      [ "$four" != 1 ] || part fsdp32_4gpus "${FSDP32_LIMIT4:-300}" python3 benchmarks/fsdp_vs_balanced.py --model "$model" --gpus 4 \
        "${bench[@]}" --out "$OUT/fsdp32_4gpus.json" --md "$OUT/fsdp32_4gpus.md"
      kill "$sampler" ;;
    fsdpgrad)
      # Two GPUs, one call (~6 minutes): whether FSDP-QLoRA and the balanced split train alike, and which setting
      # parts them: Qwen3-1.7B shapes in 4-bit (a quick build), 1K x 1 per GPU, 5 steps, the LoRA weights' and
      # gradients' norms by layer at every step (--by-layer), once per FSDPGRAD_VARIANTS entry (';'-separated
      # fsdp_vs_balanced.py options). SUITE_DRY_RUN=1: tiny:qwen3, 16-bit, CPU.
      model=${FSDPGRAD_MODEL:-random:qwen3-1.7b}
      bench=(--gpus 2 --seq-len 1024 --batch 1 --steps 5 --warmup 1 --by-layer --compile none)
      if [ -n "${SUITE_DRY_RUN:-}" ]; then
        model=tiny:qwen3
        bench=(--gpus 2 --16bit --seq-len 64 --steps 3 --warmup 1 --by-layer)
      else
        model_part "$model" 120 fsdpgrad_model
      fi
      IFS=';' read -ra variants <<< "${FSDPGRAD_VARIANTS:---precision fp16;--precision fp16 --storage uint8;--precision bf16;--precision fp16 --gpus 1}"
      for i in "${!variants[@]}"; do
        # shellcheck disable=SC2086  # each variant is a list of options
        part "fsdpgrad$i" "${FSDPGRAD_LIMIT:-150}" python3 benchmarks/fsdp_vs_balanced.py --model "$model" "${bench[@]}" \
          ${variants[$i]} --out "$OUT/fsdpgrad$i.json" --md "$OUT/fsdpgrad$i.md"
        grep -h "The same training" "$OUT/fsdpgrad$i.md" 2>/dev/null | sed "s/^/fsdpgrad$i (${variants[$i]}): /"
      done ;;
    fp16checks)
      # Two GPUs (~4 minutes): the GPU tests of training in fp16 where it differs from one process in bf16: FSDP-QLoRA
      # on 2 GPUs against the balanced split, and regional compilation of 4-bit layers against eager.
      part fp16_fsdp 300 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_fsdp_gpu.py -k two_gpus
      part fp16_compile 200 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_liger_gpu.py -k fp16 ;;
    fsdphost)
      # Two GPUs, one call: where an FSDP rank's host time goes, against a DDP rank's (benchmarks/fsdp_host_cost.py;
      # the CPU figures are in RESULTS.md). Qwen3-14B shapes in 4-bit under the T4 profile at 1K x 1 per GPU, as
      # fsdp2's FSDP run: nbkit's FSDP, accelerate's two units per checkpointed layer, and DDP (a full 4-bit copy per
      # GPU: 13.7 GiB of a T4's 14.25 by the planner); FSDPHOST_VARIANTS for others (fsdp+nocompile, fsdp+keep, ...).
      # The JSON is rewritten after each variant. SUITE_DRY_RUN=1: tiny:qwen3 with 8 layers, CPU.
      model=${FSDPHOST_MODEL:-random:qwen3-14b}
      run=(--model "$model" --layers 0 --4bit --t4 --seq-len 1024 --steps 6 --warmup 3 --profile-steps 1)
      if [ -n "${SUITE_DRY_RUN:-}" ]; then
        run=(--model tiny:qwen3 --layers 8 --seq-len 64 --steps 2 --warmup 1 --profile-steps 1)
      else
        model_part "$model" "${FSDP2_BUILD_LIMIT:-240}" fsdphost_model
      fi
      # FSDPHOST_ARGS: more of the script's options (e.g. "--seq-len 4096").
      part fsdphost "${FSDPHOST_LIMIT:-330}" python3 benchmarks/fsdp_host_cost.py "${run[@]}" ${FSDPHOST_ARGS:-} \
        --variants "${FSDPHOST_VARIANTS:-fsdp,fsdp+twounits,ddp}" --stats-dir "$OUT/fsdphost_stats" \
        --out "$OUT/fsdphost.json" --md "$OUT/fsdphost.md" ;;
    speed|speed_bf16|speed_t4)
      # One GPU, one process each (notebook_launcher in place), SFTTrainer, one image per sample: unsloth against
      # transformers+peft+nbkit.savers with Liger's kernels, regional compilation of the decoder layers and vision
      # blocks (+compile) and Trainer's per-micro-step NaN check off (+lean), and (bf16, if time is left, or as
      # the fallback where +compile fails fast) without those two; at 1K x 4 and 16K x 1; bf16 (speed_bf16), then
      # the T4 profile (speed_t4: fp16, 15 GiB per process). Each run: 2 warm-up steps and 3 windows of 6 timed
      # steps per shape (SPEED_STEPS=18; median of the window medians, spread over windows): at 1K x 4 single
      # steps of both backends vary by up to 40% (host-bound), so windows of 3 made the medians noisy. Estimated on one H100: building
      # random:qwen3-vl-2b once ~30-60 s, unsloth ~100-150 s per launch (import and its compilation), Liger ~40 s,
      # +compile ~110 s (inductor compiles each shape once). A launch that would start after the part's start
      # limit is recorded as skipped; `speed` ends within ~9.8 minutes (limits below; SPEED_LIMITS overrides).
      # The optimizer is Trainer's default, adamw_torch_fused (transformers with torch >= 2.8), everywhere.
      # SPEED_CONFIGS replaces the configurations (both parts); SPEED_T4_ARGS adds trainer_bench options to the T4
      # part (--unsloth-loss nbkit: unsloth's own loss keeps fp32 logits that do not fit 15 GiB at 16K).
      configs=${SPEED_CONFIGS:-unsloth:1@notebook,liger+compile+lean:1@notebook,liger:1@notebook}
      # unsloth's launch takes up to ~250 s for both shapes (one H100: 128 s to its first step, then ~90 s of
      # compilation for the second shape), so 160 s cut it off at 16K. SPEED_SHAPES picks fewer shapes.
      # SPEED_REPEATS launches each configuration that many times, interleaved (the report: median over them).
      run=(--shapes "${SPEED_SHAPES:-1024x4,16384x1}" --steps "${SPEED_STEPS:-18}" --warmup 2 --windows 3 --launch-timeout 280
        --repeats "${SPEED_REPEATS:-1}")
      # Seconds: model; bf16 part, its last launch start; T4 part, its last launch start. Both parts in one call
      # fit in ~10 minutes only where unsloth's launches are at the fast end: the T4 part's +compile launch may be
      # skipped there; one part per call has room for all of its launches.
      limits="90 300 200 190 80"
      [ "$what" = speed ] || limits="120 420 300 420 300"
      read -r -a limits <<< "${SPEED_LIMITS:-$limits}"
      t4=(--emulate T4)
      model=random:qwen3-vl-2b
      if [ -n "${SUITE_DRY_RUN:-}" ]; then  # Liger needs CUDA: the same options on the plain transformers path
        configs=${configs//liger/transformers}
        model=tiny:qwen3-vl
        run=(--model $model --device cpu --shapes 128x2,192x1 --steps 3 --warmup 1 --windows 3
          --compile-backend aot_eager --launch-timeout 240)
        limits=(60 560 500 560 500)
        t4=(--precision fp32)
      fi
      model_part "$model" "${limits[0]}"
      [ "$what" != speed_t4 ] && part speed_bf16 "${limits[1]}" python3 benchmarks/trainer_bench.py \
        --configs "$configs" "${run[@]}" --time-limit "${limits[2]}" --out "$OUT/speed_bf16.json" --md "$OUT/speed_bf16.md"
      # shellcheck disable=SC2086  # SPEED_T4_ARGS holds several options
      [ "$what" != speed_bf16 ] && part speed_t4 "${limits[3]}" python3 benchmarks/trainer_bench.py \
        --configs "${SPEED_CONFIGS:-${configs%,*}}" "${run[@]}" "${t4[@]}" ${SPEED_T4_ARGS:-} --time-limit "${limits[4]}" \
        --out "$OUT/speed_t4.json" --md "$OUT/speed_t4.md" ;;
    compile16k)
      # Regional compilation where the tiled MLP splits the sequence (16K x 1), two streams side by side, one
      # per GPU (with one GPU, one after the other; ~9.5 minutes on two). GPU 0: liger+compile+lean (each
      # tiled layer compiled as its attention and its MLP) against +notile (whole layers compiled, the MLP
      # untiled) at 1K x 4 and 16K x 1, with dynamo's graph breaks logged. GPU 1, the references: unsloth,
      # Liger uncompiled, then +compile without Liger at 16K if time is left. Compare rows of one GPU.
      model=random:qwen3-vl-2b
      model_part "$model" 150
      gpus=$(nvidia-smi -L | wc -l)
      run=(--shapes 1024x4,16384x1 --steps 9 --warmup 2 --windows 3 --launch-timeout 280)
      second=1; [ "$gpus" -ge 2 ] || second=0
      CUDA_VISIBLE_DEVICES=0 TORCH_LOGS=graph_breaks part compile16k_split 420 python3 benchmarks/trainer_bench.py \
        --configs liger+compile+lean:1@notebook,liger+compile+lean+notile:1@notebook "${run[@]}" --time-limit 250 \
        --out "$OUT/compile16k_split.json" --md "$OUT/compile16k_split.md" &
      [ "$gpus" -ge 2 ] || wait
      CUDA_VISIBLE_DEVICES=$second part compile16k_refs 420 python3 benchmarks/trainer_bench.py \
        --configs unsloth:1@notebook,liger:1@notebook "${run[@]}" --time-limit 300 \
        --out "$OUT/compile16k_refs.json" --md "$OUT/compile16k_refs.md"
      CUDA_VISIBLE_DEVICES=$second part compile16k_noliger 150 python3 benchmarks/trainer_bench.py \
        --configs transformers+compile+lean:1@notebook --shapes 16384x1 --steps 6 --warmup 2 --windows 2 \
        --launch-timeout 140 --time-limit 10 --out "$OUT/compile16k_noliger.json" --md "$OUT/compile16k_noliger.md"
      wait ;;
    profile1k)
      # One GPU, 1K x 4, bf16: where each backend's step goes (host_cost.py: forward / backward / the rest on the
      # host, GPU kernel time and launches, the busiest host ops and kernels), under transformers' Trainer and TRL's
      # SFTTrainer, both without Trainer's NaN check; then the transformers path with its checkpointed inputs kept
      # on the GPU (+recompute) instead of offloaded. ~8 minutes.
      model_part random:qwen3-vl-2b 120
      common=(--gpus 1 --shape 1024x4 --warmup 4 --steps 8 --profile-steps 2)
      part profile_unsloth 230 python3 benchmarks/host_cost.py --backend unsloth --variants hf+nanfilter_off,sft+nanfilter_off \
        "${common[@]}" --out "$OUT/profile_unsloth.json" --md "$OUT/profile_unsloth.md"
      part profile_liger 150 python3 benchmarks/host_cost.py --backend liger+compile+lean --variants hf,sft \
        "${common[@]}" --out "$OUT/profile_liger.json" --md "$OUT/profile_liger.md"
      part profile_recompute 110 python3 benchmarks/host_cost.py --backend liger+compile+lean+recompute --variants sft \
        "${common[@]}" --out "$OUT/profile_recompute.json" --md "$OUT/profile_recompute.md" ;;
    compilecheck)
      # Regional compilation as nbkit.savers.apply now builds it (whole layers, the tiled MLP inside; with Liger's
      # kernels only its loss): the GPU tests (compiled against eager, the tiled MLP split in 3, 16- and 4-bit),
      # then one step at 64K tokens under the T4 profile, where the automatic tiled MLP splits in 4 and each
      # compiled layer's graph breaks around it. ~5 minutes.
      model_part random:qwen3-vl-2b 120
      part compile_tests 150 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_liger_gpu.py -k regional
      part compile_64k 200 python3 benchmarks/trainer_bench.py --longest --emulate T4 --configs liger+compile+lean:1 \
        --shapes 65536x1 --steps 1 --warmup 0 --launch-timeout 190 --time-limit 10 \
        --out "$OUT/compile_64k.json" --md "$OUT/compile_64k.md" ;;
    compile_steps)
      # Which of the flagship's training steps compile the layers, with the sequence length marked dynamic (nbkit's
      # default) and left to dynamo (--no-mark), on one GPU under the T4 profile, each with an inductor cache of its
      # own so that neither reuses the other's compilations (~4 minutes). SUITE_DRY_RUN=1: tiny:qwen3-vl, aot_eager.
      cargs=(--model random:qwen3-vl-2b --backend inductor --emulate T4 --steps 20)
      [ -z "${SUITE_DRY_RUN:-}" ] || cargs=(--steps 4)
      for mark in "" --no-mark; do
        TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) CUDA_VISIBLE_DEVICES=0 part "compile_steps${mark}" 200 \
          python3 benchmarks/compile_steps.py "${cargs[@]}" $mark --out "$OUT/compile_steps${mark}.json"
      done ;;
    vision_tests)
      # nbkit.savers.vision_attention's GPU test alone (tests_c runs it too): the vision blocks compiled by inductor as
      # one graph each, against transformers' attention uncompiled, on images of several sizes (71 s on one H200,
      # 2026-11-29, with the set's installation before it). Its speed: the paths part with
      # PATHS_CONFIGS=liger+compile:1,liger+compile+gpusplit:1 (gpusplit: transformers' own split).
      part vision_tests 150 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_vision_attention.py ;;
    loss)
      # The causal-LM loss alone by rows per chunk (nbkit's loop and Liger's fused loss, Qwen3-VL-2B's head,
      # 4K and 16K tokens, bf16 and fp16): time and peak memory. ~1-2 minutes.
      part loss_chunks 240 python3 benchmarks/loss_chunks.py --out "$OUT/loss_chunks.json" --md "$OUT/loss_chunks.md" ;;
    liger)
      part liger 240 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_liger_gpu.py ;;
    savers_checks)
      # The savers' GPU tests after a change to them (~5 minutes): Liger's DDP cases, then the same with every
      # process under the stack sampler (their interpreter aborted at exit, "terminate called without an active
      # exception", in two calls that both ran the sampler), the savers' and FSDP's GPU tests.
      pytest=(python3 -m pytest -m gpu -q -rs -p no:cacheprovider)
      part liger_ddp 200 "${pytest[@]}" tests/test_liger_gpu.py -k under_ddp
      part liger_ddp_sampled 200 env PYTHONPATH="$PWD/benchmarks/stack_sampler:$PYTHONPATH" \
        NBKIT_STACK_SAMPLES="$OUT/stacks_liger" "${pytest[@]}" tests/test_liger_gpu.py -k under_ddp
      part savers_gpu 150 "${pytest[@]}" tests/test_savers_gpu.py
      part fsdp_gpu 150 "${pytest[@]}" tests/test_fsdp_gpu.py ;;
    flagship12)
      # The flagship notebook under the T4 profile on one GPU (the other hidden) and then on two, in one call: each
      # summary.json's steady seconds per step and tokens/s, the first step apart (unsloth on 2x H200: 191 s and 196 s).
      # FLAGSHIP_PARAMS adds parameters (e.g. "-p backend=transformers"); checkpoints only at the end. FLAGSHIP_GPUS
      # picks the runs ("1" on a one-GPU machine), FLAGSHIP_TAG names them (two variants in one call keep apart).
      both=${CUDA_VISIBLE_DEVICES:-0,1}
      summaries=()
      for n in ${FLAGSHIP_GPUS:-1 2}; do
        visible=$both; [ "$n" = 1 ] && visible=${both%%,*}
        run_out="$OUT/flagship${FLAGSHIP_TAG:-}_gpus$n"
        # unsloth's generated code goes to /tmp, not into $OUT beside the notebook (hundreds of files to bring back).
        # shellcheck disable=SC2086  # FLAGSHIP_PARAMS holds several -p options
        CUDA_VISIBLE_DEVICES=$visible UNSLOTH_COMPILE_LOCATION=${UNSLOTH_COMPILE_LOCATION:-/tmp/unsloth-cache} \
          part "flagship${FLAGSHIP_TAG:-}_gpus$n" "${FLAGSHIP_LIMIT:-270}" python3 notebooks/run.py \
          qwen3_vl_2xT4 --out "$run_out" -p gpus=$n -p emulate=T4 -p max_steps="${FLAGSHIP_STEPS:-20}" \
          -p num_samples=80 -p max_seq_length=1024 -p save_steps=1000 ${FLAGSHIP_PARAMS:-}
        summaries+=("$run_out/qwen3_vl_2xT4/summary.json")
      done
      python3 benchmarks/flagship_scaling.py "${summaries[@]}" | tee "$OUT/flagship12${FLAGSHIP_TAG:-}.md" ;;
    *) echo "unknown part: $what" >&2 ;;
  esac
done
if [ -d "${NBKIT_STACK_SAMPLES:-/nonexistent}" ]; then
  python3 benchmarks/stack_report.py "$NBKIT_STACK_SAMPLES" --md "$OUT/stacks.md" > /dev/null
fi
