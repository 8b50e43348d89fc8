#!/usr/bin/env bash
# One warm GPU session (device tool), step by step; every step is one device call:
#   bash benchmarks/gpu_session.sh setup      # NCCL 2.32.3 from .gpu-extras/nccl-sm90.xz (one call; made by
#                                             # benchmarks/slim_nccl.py) or from parts p0..p5, wheels, etcd, project
#   bash benchmarks/gpu_session.sh part K     # K = 0..4: copy .gpu-extras/pK (only without the .xz)
#   bash benchmarks/gpu_session.sh check      # after setup in the same call: tests and runtime tests side by side
#   bash benchmarks/gpu_session.sh measure    # lifecycle, NCCL refit (1 and 4 rounds at once), churn nccl4py + gloo
#   bash benchmarks/gpu_session.sh tests      # GPU tests (several NCCL ranks on GPU 0)
#   bash benchmarks/gpu_session.sh bench      # lifecycle, NCCL refit and churn benchmarks
#   bash benchmarks/gpu_session.sh churn      # churn with and without connecting ahead (nccl4py)
#   bash benchmarks/gpu_session.sh digest     # digest GB/s against a plain copy on the GPU
#   bash benchmarks/gpu_session.sh wave       # issues 36, 35, 37: IPC tests, colocated benches, deltas, RL step
#                                             # (WAVE_STEPS picks; *_mps steps run under an MPS daemon)
#   bash benchmarks/gpu_session.sh all        # the whole GPU suite in parallel lanes, then kernels,
#                                             # lifecycle and churn benchmarks: one table, < 10 min
#   bash benchmarks/gpu_session.sh chaos      # issue 39's recovery cells: kill x30 and kill+kill x10 on nccl4py,
#                                             # kill x8 on torch's NCCL groups (their shrink), ~7 min
# Logs and JSON land in $OUT. .gpu-extras/ comes from ../shared/tools/gpu-extras/prepare.sh.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
env_ready() {
  [ -f /tmp/nccl/libnccl.so.2 ] && export LD_PRELOAD=/tmp/nccl/libnccl.so.2
  export ETCD_BIN=/tmp/etcd/usr/bin/etcd
}
case "${1:-}" in
  part)
    mkdir -p /tmp/nccl && cp ".gpu-extras/p$2" /tmp/nccl/ && ls -la /tmp/nccl ;;
  setup)
    mkdir -p /tmp/nccl
    if [ -f .gpu-extras/nccl-sm90.xz ]; then
      got=$(python3 benchmarks/slim_nccl.py --restore .gpu-extras/nccl-sm90.xz -o /tmp/nccl/libnccl.so.2)
      [ "$got" = "$(cat .gpu-extras/nccl-sm90.xz.sha256)" ] && echo "libnccl 2.32.3 (sm_90 only) restored" \
        || { echo "sha256 mismatch"; rm -f /tmp/nccl/libnccl.so.2; }
    elif cp .gpu-extras/p5 /tmp/nccl/ && [ "$(ls /tmp/nccl/p? | wc -l)" = 6 ]; then
      cat /tmp/nccl/p? > /tmp/nccl/libnccl.so.2
      [ "$(sha256sum /tmp/nccl/libnccl.so.2 | cut -d' ' -f1)" = "$(cat .gpu-extras/sha256)" ] \
        && echo "libnccl 2.32.3 assembled" || { echo "sha256 mismatch"; rm -f /tmp/nccl/libnccl.so.2; }
    else
      echo "only $(ls /tmp/nccl/p? | wc -l) of 6 parts: NCCL 2.28.9 stays (no grow)"
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile .gpu-extras/whl/*.whl 2>&1 | tail -2
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | grep -v -i warn | tail -2
    dpkg -x .gpu-extras/deb/*.deb /tmp/etcd
    env_ready
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    python3 -c "import torch, triton, nccl.core as nc; print('torch', torch.__version__, 'torch nccl', torch.cuda.nccl.version(), 'triton', triton.__version__); print(nc.get_version())" 2>&1 | tee -a "$OUT/gpu.txt"
    python3 -c "from elastic_refit.membership import probe_runtime; import json; print(json.dumps(probe_runtime().to_json()))" | tee -a "$OUT/gpu.txt"
    "$ETCD_BIN" --version | head -1
    # The slim library must run NCCL's kernels: one shrink/grow cycle on 4 ranks, else 2.28.9 stays.
    if [ "${SMOKE:-1}" = 1 ] && [ -f /tmp/nccl/libnccl.so.2 ] && ! timeout 90 python3 benchmarks/bench_nccl_lifecycle.py --ranks 4 --repeat 1 \
        --backend nccl4py --json > "$OUT/smoke.json" 2> "$OUT/smoke.err"; then
      echo "NCCL 2.32.3 smoke failed; NCCL 2.28.9 stays:"; tail -5 "$OUT/smoke.err"; rm -f /tmp/nccl/libnccl.so.2
    fi ;;
  check)  # correctness, two pytest runs side by side (timings here are not measurements)
    env_ready
    export ELASTIC_REFIT_CHAOS_RESULTS="$OUT/chaos_nccl.jsonl"
    timeout "${CHECK_TIMEOUT:-480}" python3 -m pytest -q -p no:cacheprovider --timeout 300 -rfE \
      tests/gpu/test_runtime_nccl.py > "$OUT/runtime.log" 2>&1 &
    timeout "${CHECK_TIMEOUT:-480}" python3 -m pytest -q -p no:cacheprovider --timeout 200 -rfE \
      tests/gpu/test_nccl_world.py tests/gpu/test_kernels_gpu.py tests/gpu/test_transport_gpu.py \
      tests/integration/test_membership_gpu.py > "$OUT/world.log" 2>&1
    wait
    for f in world runtime; do echo "== $f"; grep -E "passed|failed|FAILED|ERROR" "$OUT/$f.log" | tail -12; done ;;
  measure)  # one benchmark at a time
    env_ready
    timeout 150 python3 benchmarks/bench_nccl_lifecycle.py --ranks 4 8 --repeat 10 --backend nccl4py --json \
      2>"$OUT/lifecycle.err" | grep -v -E "^[0-9]{4}-[0-9]{2}-[0-9]{2} |^\s*$" > "$OUT/lifecycle.json"
    python3 -c "import json,sys; [print(r) for r in json.load(open(sys.argv[1]))]" "$OUT/lifecycle.json"
    for rounds in 1 4; do
      timeout 170 python3 -m elastic_refit.cli bench --model qwen3-30b-a3b --layers 1 --source tp=2,pp=2 \
        --destination tp=2,dp=2 --domain-size 1 --backend nccl4py --repeat 3 --bucket-mib 32 \
        --concurrent-rounds $rounds 2>/dev/null | tee -a "$OUT/bench_nccl.txt"
    done
    for b in nccl4py gloo; do
      timeout 100 python3 benchmarks/bench_nccl_churn.py --backend $b --versions 10 --kill-at 4 --json \
        2>/dev/null > "$OUT/churn_$b.json"
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], {k: d.get(k) for k in ('shrink','grow','rebuild','recovery_s','passed','epochs')})" "$OUT/churn_$b.json" $b
    done ;;
  tests)
    env_ready
    shift
    export ELASTIC_REFIT_CHAOS_RESULTS="$OUT/chaos_nccl.jsonl"
    timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider --timeout 150 -rfE "${@:-tests/gpu}" 2>&1 \
      | tee "$OUT/${LOG:-gpu_tests}.log" | grep -E -v "^\s*$|^[0-9-]+ [0-9:]+ \[" | tail -60 ;;
  bench)
    env_ready
    timeout 180 python3 benchmarks/bench_nccl_lifecycle.py --ranks 4 8 --repeat "${REPEAT:-10}" --backend nccl4py nccl \
      --json 2>"$OUT/lifecycle.err" > "$OUT/lifecycle.json"; tail -3 "$OUT/lifecycle.err"
    python3 -c "import json,sys; [print(r) for r in json.load(open(sys.argv[1]))]" "$OUT/lifecycle.json"
    timeout 150 python3 -m elastic_refit.cli bench --model qwen3-30b-a3b --layers 1 --source tp=2,pp=2 \
      --destination tp=2,dp=2 --domain-size 1 --backend nccl4py --repeat 3 --bucket-mib 32 \
      2>"$OUT/bench_nccl.err" | tee "$OUT/bench_nccl.txt"; tail -3 "$OUT/bench_nccl.err"
    timeout 110 python3 benchmarks/bench_nccl_churn.py --backend nccl4py --versions "${VERSIONS:-10}" --kill-at 4 \
      2>"$OUT/churn.err" | tee "$OUT/churn.txt"; grep -E "committed|killed|FAIL" "$OUT/churn.err" | tail -4 ;;
  churn)  # first refit after a shrink and after a grow against steady state, with and without connecting ahead
    env_ready
    for variant in ${CHURN_ORDER:-on off}; do
      flag=$([ $variant = off ] && echo --no-connect-ahead)
      timeout "${CHURN_TIMEOUT:-150}" python3 benchmarks/bench_nccl_churn.py --backend nccl4py --versions "${VERSIONS:-14}" \
        --kill-at 4 $flag --json 2>"/tmp/churn_$variant.err" > "$OUT/churn_$variant.json"
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('connect ahead', sys.argv[2], {k: d.get(k) for k in ('shrink','grow','rebuild','recovery_s','passed','epochs','connect_ahead_s','refits')})" "$OUT/churn_$variant.json" $variant \
        || tail -5 "/tmp/churn_$variant.err"
    done ;;
  digest)  # what the source checks cost on the GPU: digest against a plain copy
    env_ready
    for mib in 256 1024; do python3 benchmarks/bench_digest.py --device cuda --mib $mib --repeat 10; done ;;
  final)  # one call after setup: lifecycle, runtime on NCCL, churn, then the data-path table
    env_ready
    timeout 100 python3 benchmarks/bench_nccl_lifecycle.py --ranks 4 8 --repeat 10 --backend nccl4py --json \
      2>"$OUT/lifecycle.err" | grep -v -E "^[0-9]{4}-[0-9]{2}-[0-9]{2} |^\s*$" > "$OUT/lifecycle.json"; grep -E "fast_path" "$OUT/lifecycle.err" | head -3
    python3 -c "import json,sys; [print(r) for r in json.load(open(sys.argv[1]))]" "$OUT/lifecycle.json"
    LOG=runtime TESTS_TIMEOUT=150 bash "$0" tests tests/gpu/test_runtime_nccl.py -k "killed or restart_inside"
    timeout 80 python3 benchmarks/bench_nccl_churn.py --backend nccl4py --versions 10 --kill-at 4 \
      2>"$OUT/churn.err" | tee "$OUT/churn.txt"
    LOG=world TESTS_TIMEOUT="${WORLD_TIMEOUT:-170}" bash "$0" tests tests/gpu/test_nccl_world.py ;;
  colocated)  # issue 36: IPC tests, then the colocated bench on one and two "hosts" (one at a time)
    env_ready
    LOG=ipc_tests TESTS_TIMEOUT=200 bash "$0" tests tests/gpu/test_ipc_gpu.py tests/gpu/test_delta_gpu.py -s
    timeout 170 python3 benchmarks/bench_colocated.py --layers 8 --repeat 3 2>"$OUT/colocated.err" | tee "$OUT/colocated.txt" \
      || tail -20 "$OUT/colocated.err"
    timeout 120 python3 benchmarks/bench_colocated.py --layers 8 --repeat 3 --hosts 2 --methods ipc,nccl4py \
      2>"$OUT/colocated2.err" | tee "$OUT/colocated2.txt" || tail -20 "$OUT/colocated2.err" ;;
  wave)  # issues 36, 35, 37 in one call after setup: IPC tests, colocated benches, deltas, the RL step
        # (every step has its own deadline, WAVE_*_S overrides them; logs and JSON in $OUT)
    env_ready
    export ELASTIC_REFIT_CHAOS_RESULTS="$OUT/chaos_wave.jsonl"
    PYSPY=$(command -v py-spy || true)
    rl_async() {  # the RL step's async mode under MPS into $OUT/$name; py-spy (a wheel in .gpu-extras/whl,
                  # installed by setup) samples engine i0's GIL when present
      with_mps step "$name" "${WAVE_RL_S:-150}" python3 benchmarks/bench_rl_step.py --out "$OUT/$name" --device cuda \
        --backend nccl4py --steps "${WAVE_RL_STEPS:-4}" --kill-at 0 --new-tokens 48 --modes async-staged \
        ${PYSPY:+--gil-profiler "$PYSPY"}
    }
    step() {  # NAME SECONDS COMMAND...: stdout to NAME.txt, stderr to NAME.err, exit code and seconds to NAME.rc
      local name=$1 secs=$2 t; shift 2; t=$(date +%s)
      timeout -k 10 "$secs" "$@" > "$OUT/$name.txt" 2> "$OUT/$name.err"
      echo "$? $(( $(date +%s) - t ))" | tee "$OUT/$name.rc" | sed "s/^/$name rc, s: /"
    }
    with_mps() {  # COMMAND...: run it with an MPS daemon up (processes' kernels run side by side)
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
      mkdir -p /tmp/mps /tmp/mps-log && nvidia-cuda-mps-control -d && "$@"
      echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    }
    xd=$(python3 -c "import xdist" 2>/dev/null && echo "-n 3")
    steps=${WAVE_STEPS:-ipc_tests colocated colocated2 delta rl}
    for name in $steps; do
      case $name in
        # shellcheck disable=SC2086
        ipc_tests) step $name "${WAVE_TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider $xd --timeout 140 -rfE \
          tests/gpu/test_ipc_gpu.py tests/gpu/test_colocated_runtime_gpu.py tests/gpu/test_delta_gpu.py ;;
        colocated) step $name "${WAVE_COLOCATED_S:-100}" python3 benchmarks/bench_colocated.py --layers "${WAVE_LAYERS:-8}" --repeat "${WAVE_REPEAT:-3}" \
          --baseline-repeat 1 ;;
        colocated2) step $name "${WAVE_COLOCATED_S:-80}" python3 benchmarks/bench_colocated.py --layers "${WAVE_LAYERS:-8}" --repeat "${WAVE_REPEAT:-3}" \
          --hosts 2 --methods ipc,nccl4py ;;
        delta) step $name "${WAVE_DELTA_S:-110}" python3 benchmarks/bench_delta.py --device cuda --backend nccl4py \
          --steps "${WAVE_DELTA_STEPS:-10}" --refit-hidden 1024 --refit-layers 6 --json ${WAVE_DELTA_ARGS:-} ;;
        rl) step $name "${WAVE_RL_S:-220}" python3 benchmarks/bench_rl_step.py --out "$OUT/rl" --device cuda \
          --backend nccl4py --steps "${WAVE_RL_STEPS:-4}" --kill-at 3 --new-tokens 48 ;;
        rl_mps)  # the async mode with the processes' kernels side by side (MPS), as on GPUs of their own
          rl_async ;;
        rl_mps_poll0)  # rl_mps with the constant 0.5 ms poll of before (beside rl_mps: what the backoff buys)
          ELASTIC_REFIT_NCCL_POLL_MAX_S=0.0005 rl_async ;;
        rl_mps_perbox)  # rl_mps with each bucket's digests box by box, as before kernels.digests (beside rl_mps)
          ELASTIC_REFIT_BUCKET_DIGESTS=per-box rl_async ;;
        digest_boxes)  # a bucket's check box by box against one launch (kernels.digests), beside a copy
          for boxes in 64 512 4096; do
            step ${name}_$boxes "${WAVE_DIGEST_S:-40}" python3 benchmarks/bench_digest.py --device cuda --mib 64 \
              --boxes $boxes --repeat 20
          done ;;
        rl_mps_ctas)  # rl_mps with the runtime's communicators capped at WAVE_RL_MAX_CTAS CTAs (default 2)
          ELASTIC_REFIT_NCCL_MAX_CTAS="${WAVE_RL_MAX_CTAS:-2}" rl_async ;;
        colocated_mps)  # IPC refit (and WAVE_COLOCATED_METHODS) and the copy ceiling, kernels side by side (MPS)
          with_mps step $name "${WAVE_COLOCATED_S:-100}" python3 benchmarks/bench_colocated.py --layers "${WAVE_LAYERS:-8}" \
            --repeat "${WAVE_REPEAT:-3}" --baseline-repeat 1 --methods "${WAVE_COLOCATED_METHODS:-ipc}" ;;
        delta_mps)  # the delta step with the 8 ranks' kernels side by side (MPS), as on GPUs of their own
          with_mps step $name "${WAVE_DELTA_MPS_S:-60}" python3 benchmarks/bench_delta.py --device cuda --backend nccl4py \
            --steps "${WAVE_DELTA_MPS_STEPS:-10}" --refit-hidden 1024 --refit-layers 6 --json --skip-trajectory ;;
        delta_profile_mps)  # where a delta refit's time goes op by op (torch.profiler per rank), under MPS
          with_mps step $name "${WAVE_DELTA_MPS_S:-90}" python3 benchmarks/profile_delta.py --device cuda \
            --out "$OUT/delta_profile" ;;
        churn_debug)  # 4-rank churn with NCCL's INIT/P2P/NET log, timestamped (where a first refit's excess goes)
          TZ=UTC NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,NET NCCL_DEBUG_TIMESTAMP_LEVELS=ALL \
            NCCL_DEBUG_TIMESTAMP_FORMAT="[%T.%6f] " NCCL_DEBUG_FILE="$OUT/nccl.%h.%p.log" \
            step $name "${WAVE_CHURN_S:-60}" python3 benchmarks/bench_nccl_churn.py --backend nccl4py --ranks 4 --json ;;
        churn4)  # 4-rank churn, connect-ahead at its default 4 MiB per direction (beside churn4_ca64)
          step $name "${WAVE_CHURN_S:-60}" python3 benchmarks/bench_nccl_churn.py --backend nccl4py --ranks 4 --json ;;
        churn4_ca64)  # the same with 64 MiB per direction ahead (does a warmer socket path shorten the first refit?)
          ELASTIC_REFIT_CONNECT_AHEAD_MIB=64 step $name "${WAVE_CHURN_S:-60}" python3 benchmarks/bench_nccl_churn.py \
            --backend nccl4py --ranks 4 --json ;;
        codec)  # the delta encode's forms part by part, then the codec against a copy
          step sweep "${WAVE_SWEEP_S:-80}" python3 benchmarks/sweep_delta_encode.py --densities 0.015 0.037 0.095 \
            --blocks 4096 --warps 4 8
          step $name "${WAVE_CODEC_S:-60}" python3 benchmarks/bench_delta.py --device cuda --codec-only \
            --codec-mib 256,2048 ;;
        *) echo "wave: unknown step $name" >&2 ;;
      esac
    done
    for f in $steps; do echo "== $f"; grep -v -E "^\s*$" "$OUT/$f.txt" | tail -25; done ;;
  chaos)  # issue 39: the must-show's kill cells on nccl4py, then torch's NCCL groups (shrink through
          # the etcd store's clone); each cell's trials kept as a tarball, one summary line each
    env_ready
    cell() {  # NAME SECONDS ARGS...: one chaos run, its JSON, stderr and kept trials
      local name=$1 secs=$2 t; shift 2; t=$(date +%s); rm -rf /tmp/elastic-refit-chaos-*
      timeout -k 10 "$secs" python3 -m elastic_refit.cli chaos --matrix full --seed 31 --keep-logs \
        --results "$OUT/$name.jsonl" --json "$@" > "$OUT/$name.json" 2> "$OUT/$name.err"
      echo "$name rc $? $(( $(date +%s) - t ))s"
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('passed', 'trials', \
'recovery_p50_s', 'recovery_p99_s', 'recovery_max_s', 'torn', 'lost', 'hung', 'leaked')})" "$OUT/$name.json" \
        2>/dev/null || tail -3 "$OUT/$name.err"
      tar czf "$OUT/trials_$name.tgz" /tmp/elastic-refit-chaos-* 2>/dev/null; rm -rf /tmp/elastic-refit-chaos-*
    }
    cell kill "${CHAOS_KILL_S:-260}" --faults kill --trials "${CHAOS_KILL_TRIALS:-30}" --backend nccl4py
    cell kill_kill "${CHAOS_KK_S:-140}" --faults kill+kill --trials "${CHAOS_KK_TRIALS:-10}" --backend nccl4py
    cell torch_kill "${CHAOS_TORCH_S:-120}" --faults kill --trials "${CHAOS_TORCH_TRIALS:-8}" --backend nccl ;;
  kernels)  # issue 39: pack/unpack against a plain copy, eager
    env_ready
    timeout "${KERNELS_TIMEOUT:-120}" python3 benchmarks/bench_kernels.py 2>&1 | tee "$OUT/kernels.txt" | tail -40 ;;
  all)  # issue 39: the whole GPU suite (two pytest-xdist lanes side by side), then the GPU
        # benchmarks one at a time; one table at the end (benchmarks/gpu_all_table.py). Sized
        # to end within 10 minutes: every step has its own deadline (ALL_* overrides them).
    t_all=$(date +%s)
    if [ "${ALL_SETUP:-1}" = 1 ] && { [ ! -x /tmp/etcd/usr/bin/etcd ] || ! python3 -c "import nccl.core, aetcd, structlog" 2>/dev/null; }; then
      SMOKE=0 bash "$0" setup > "$OUT/setup.log" 2>&1; tail -4 "$OUT/setup.log"  # a fresh machine
    fi
    env_ready
    export ELASTIC_REFIT_CHAOS_RESULTS="$OUT/chaos_nccl.jsonl"
    # Parallel workers are safe: etcd and stores take free ports per test, and every NCCL rank
    # is a host of its own per process (NCCL_HOSTID with its pid, testing/processes.py).
    xdist() { python3 -c "import xdist" 2>/dev/null && echo "-n $1 --dist load"; }
    lane() {  # NAME WORKERS SECONDS FILES...: one pytest run, its JUnit report and exit code
      local name=$1 workers=$2 secs=$3 t; shift 3; t=$(date +%s)
      python3 -m pytest --collect-only -q -p no:cacheprovider "$@" 2>/dev/null | tail -1 > "$OUT/$name.collected"
      # shellcheck disable=SC2046
      timeout -s INT -k 30 "$secs" python3 -m pytest -q -p no:cacheprovider $(xdist "$workers") \
        --timeout "${ALL_TEST_TIMEOUT:-150}" --timeout-method thread -rfE --durations 20 \
        --junitxml "$OUT/$name.xml" "$@" > "$OUT/$name.log" 2>&1
      echo "$? $(( $(date +%s) - t ))" > "$OUT/$name.rc"
    }
    runtime=(tests/gpu/test_runtime_nccl.py tests/gpu/test_runtime_fp8_nccl.py)
    mapfile -t rest < <(grep -rl "pytest.mark.gpu" tests --include='test_*.py' | sort | grep -v -x -F "${runtime[@]/#/-e}")
    lane runtime "${ALL_RUNTIME_WORKERS:-4}" "${ALL_TESTS_S:-300}" "${runtime[@]}" &
    lane rest "${ALL_WORKERS:-4}" "${ALL_TESTS_S:-300}" "${rest[@]}" &
    wait
    bench() {  # NAME SECONDS COMMAND...: one benchmark's JSON (stdout) and exit code
      local name=$1 secs=$2 t; shift 2; t=$(date +%s)
      timeout -k 10 "$secs" "$@" > "$OUT/$name.json" 2> "$OUT/$name.err"
      echo "$? $(( $(date +%s) - t ))" > "$OUT/$name.rc"
    }
    bench kernels "${ALL_KERNELS_S:-70}" python3 benchmarks/bench_kernels.py --device cuda --repeats 5 --json
    bench lifecycle "${ALL_LIFECYCLE_S:-70}" python3 benchmarks/bench_nccl_lifecycle.py --ranks 4 8 \
      --repeat "${REPEAT:-5}" --backend nccl4py --json
    for ranks in ${ALL_CHURN_RANKS:-4 8}; do  # the must-show's two sizes (2 trainers + 2 or 6 inference ranks)
      bench "churn$ranks" "${ALL_CHURN_S:-100}" python3 benchmarks/bench_nccl_churn.py --backend nccl4py \
        --ranks "$ranks" --versions "${VERSIONS:-22}" --kill-at 4 --json
    done
    for name in runtime rest; do grep -E "^(FAILED|ERROR)|slowest|^[0-9.]+s (call|setup|teardown)" "$OUT/$name.log" \
      | head -30 > "$OUT/$name.summary"; done
    python3 benchmarks/gpu_all_table.py "$OUT" --total-s "$(( $(date +%s) - t_all ))" | tee "$OUT/all_table.md" ;;
  *) echo "usage: $0 setup | part K | check | measure | tests [pytest args] | bench | churn | digest | final | colocated | wave | chaos | kernels | all" >&2; exit 2 ;;
esac
