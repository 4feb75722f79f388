#!/usr/bin/env bash
# GPU check (about 8 minutes on one CUDA GPU): CUDA-marked tests, pinned vs pageable device-to-host
# bandwidth, the save benchmark at 4 GiB per rank with the state on the GPU (ours thread and process
# persist against DCP at its best), a 1 GiB restore into a GPU model, and the goals of issue 19 as
# ratios (durable / disk floor <= 1.15, restore cold / cold-read floor <= 1.2, peak extra RSS).
#
#   bash benchmarks/gpu_check.sh                 # results under $OUT (default: a fresh temp dir)
#   PYTHON=python3 OUT=/tmp/gpu bash benchmarks/gpu_check.sh
#
# Environment: PYTHON (default python3; on the device machine python3 is the one holding PyTorch),
# OUT (where gpu.json, d2h.json and the logs go), GPU_CHECK_SIZE_GIB (default 4),
# GPU_CHECK_ALLOW_CPU=1 (dry run of the script's flow on a machine without CUDA, at 0.25 GiB).
# Exits non-zero when any step fails (no GPU, a failing test, a benchmark error).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d -t gpu_check.XXXXXX)}
SIZE=${GPU_CHECK_SIZE_GIB:-4}
ALLOW_CPU=${GPU_CHECK_ALLOW_CPU:-0}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
fail=0
t_start=$(date +%s)
section() { echo; echo "=== [$(( $(date +%s) - t_start ))s] $*"; }
bad() { echo "FAIL: $*"; fail=1; }

section "devices"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi -L || bad "nvidia-smi -L"
else
  echo "nvidia-smi not found"
  [ "$ALLOW_CPU" = 1 ] || bad "nvidia-smi not found"
fi
if ! "$PY" -c 'import sys, torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 3)'; then
  if [ "$ALLOW_CPU" = 1 ]; then
    echo "no CUDA device: dry run on the CPU (GPU_CHECK_ALLOW_CPU=1)"; SIZE=0.25
  else
    bad "torch sees no CUDA device"; exit 1
  fi
fi

section "CUDA tests: pytest -m cuda"
ignore=()
"$PY" -c 'import torchdata' 2>/dev/null || { echo "torchdata missing: ignoring tests/test_example_resume.py (no CUDA tests in it)"; ignore=(--ignore=tests/test_example_resume.py); }
timeout 150 "$PY" -m pytest -m cuda -q -p no:cacheprovider "${ignore[@]}" tests/ 2>&1 | tee "$OUT/pytest_cuda.log"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || bad "pytest -m cuda exited $rc"

section "device-to-host bandwidth: 1 GiB, pinned vs pageable"
timeout 90 "$PY" - "$OUT/d2h.json" <<'EOF' || bad "D2H bandwidth probe"
import json, statistics, sys, time
import torch
if not torch.cuda.is_available():
    print("skipped: no CUDA device"); sys.exit(0)
n = 1 << 30
src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(7)
res = {"bytes": n, "gpu": torch.cuda.get_device_name()}
for kind in ("pinned", "pageable"):
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=(kind == "pinned")).fill_(0)  # pre-faulted
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times = times[1:]  # first copy is a warm-up
    assert bool((dst[:: 1 << 20] == 7).all()), "copy did not land"
    res[kind] = {"median_gb_s": n / statistics.median(times) / 1e9, "best_gb_s": n / min(times) / 1e9,
                 "median_s": statistics.median(times)}
    print(f"{kind:9s} D2H: {res[kind]['median_gb_s']:.1f} GB/s median, {res[kind]['best_gb_s']:.1f} best "
          f"({res[kind]['median_s'] * 1e3:.1f} ms per GiB)")
    del dst
json.dump(res, open(sys.argv[1], "w"), indent=2)
EOF

section "save benchmark: ${SIZE} GiB per rank, 2 reps"
timeout 300 "$PY" benchmarks/save_blocking.py --size-gib "$SIZE" --reps 2 \
  --methods memcpy,ours_thread,ours_thread_overlap,ours_process,dcp_async_stager \
  --json "$OUT/gpu.json" >"$OUT/gpu_stdout.json" 2> >(tee "$OUT/save_blocking.log" >&2)
rc=$?
[ "$rc" = 0 ] || bad "save_blocking.py exited $rc"
if [ -s "$OUT/gpu.json" ]; then
  "$PY" - "$OUT/gpu.json" <<'EOF' || bad "benchmark summary"
import json, sys
d = json.load(open(sys.argv[1]))
f = d["floors"]
print(f"state {d['state_bytes'] / 2**30:.2f} GiB in {d['n_tensors']} tensors on {d['machine']['device']} "
      f"({d['machine'].get('gpu', '')}); floors: memcpy {f['memcpy_s']:.3f} s, disk {f['disk_s']:.2f} s")
print(f"{'method':22s} {'blocking s':>10s} {'safe s':>8s} {'durable s':>9s} {'blk/memcpy':>10s} {'dur/disk':>8s} {'RSS/state':>9s}")
errors = 0
for name, m in d["methods"].items():
    if "blocking_s" not in m:
        print(f"{name:22s} ERROR {m.get('error')}"); errors += 1; continue
    print(f"{name:22s} {m['blocking_s']:10.3f} {m['safe_s']:8.3f} {m['durable_s']:9.2f} "
          f"{m['blocking_over_memcpy']:10.2f} {m['durable_over_disk']:8.2f} {m['extra_rss_over_state']:9.2f}")
sys.exit(1 if errors else 0)
EOF
fi

RSIZE=1; [ "$SIZE" = 0.25 ] && RSIZE=0.25
RDEV=cuda; "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' || RDEV=cpu
section "restore benchmark: ${RSIZE} GiB into a model on $RDEV, 2 reps"
timeout 180 "$PY" benchmarks/restore.py --size-gib "$RSIZE" --reps 2 --device "$RDEV" \
  --methods ours,ours_fresh,ours_noverify,torch_load,dcp_load \
  --json "$OUT/restore.json" >/dev/null 2> >(tee "$OUT/restore.log" >&2)
rc=$?
[ "$rc" = 0 ] || bad "restore.py exited $rc"

section "goals (issue 19) as ratios"
"$PY" - "$OUT" <<'EOF' || bad "goal summary"
import json, os, sys
out = sys.argv[1]
def load(name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) and os.path.getsize(p) else None
d2h, save, rest = load("d2h.json"), load("gpu.json"), load("restore.json")
if d2h and "pinned" in d2h:
    print(f"D2H GB/s: pinned {d2h['pinned']['median_gb_s']:.1f}, pageable {d2h['pageable']['median_gb_s']:.1f} "
          f"(pinned / pageable {d2h['pinned']['median_gb_s'] / d2h['pageable']['median_gb_s']:.2f}x)")
if save:
    print(f"save, {save['state_bytes'] / 2**30:.2f} GiB per rank on {save['machine']['device']}: memcpy floor "
          f"{save['floors']['memcpy_s']:.3f} s, disk floor {save['floors']['disk_s']:.2f} s")
    for name in ("ours_thread", "ours_thread_overlap", "ours_process", "dcp_async_stager"):
        m = save["methods"].get(name, {})
        if "durable_over_disk" not in m:
            print(f"  {name:20s} no result: {m.get('error')}")
            continue
        goal = ("ok" if m["durable_over_disk"] <= 1.15 else "MISSED") if name.startswith("ours") else "peer"
        print(f"  {name:20s} blocking {m['blocking_s']:.3f} s ({m['blocking_over_memcpy']:.2f}x memcpy), durable "
              f"{m['durable_s']:.2f} s = {m['durable_over_disk']:.2f}x disk (goal <= 1.15: {goal}), "
              f"peak extra RSS {m['extra_rss_over_state']:.2f}x state")
if rest:
    print(f"restore, {rest['state_bytes'] / 2**30:.2f} GiB into a model on {rest['machine']['device']}: cold-read "
          f"floor {rest['floors']['cold_read_s']:.2f} s")
    for name, m in rest["methods"].items():
        rss = m["peak_rss_bytes"] / rest["state_bytes"]
        ok = m["cold_over_read"] <= 1.2 and rss <= 1.1
        goal = ("ok" if ok else "MISSED") if name.startswith("ours") else "peer"
        print(f"  {name:20s} cold {m['cold_s']:.2f} s = {m['cold_over_read']:.2f}x read, warm {m['warm_s']:.2f} s, "
              f"peak extra RSS {rss:.2f}x state (goal <= 1.2x read and <= 1.1x state: {goal})")
EOF

section "done: results in $OUT"
ls -l "$OUT"
[ "$fail" = 0 ] && echo "GPU CHECK PASSED" || echo "GPU CHECK FAILED"
exit "$fail"
