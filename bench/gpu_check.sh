#!/usr/bin/env bash
# The extraction tests on a lent GPU machine: CUDA, bfloat16, tiny models of every family and the
# committed toy model. Run from the repo root (the device tool's `run` starts there):
#
#     bash bench/gpu_check.sh
#
# 1. installs .whl/wheels.tar.xz (bench/gpu_wheels.sh builds it; the machine has no network) and any
#    loose .whl/*.whl into /tmp/site with pip --target, then PYTHONPATH=/tmp/site:$PWD, so agnosia
#    runs from this checkout without being installed and the carried transformers 5.24 wins over
#    the image's 5.17;
# 2. prints the GPU, Python, torch, transformers and store-library versions, and stops early if
#    CUDA or the carried packages are missing;
# 3. runs tests/extract/test_accelerator.py alone (-s: its timings table goes to the log): each case
#    extracts on cuda/bf16 and on cpu/fp32 and compares the stores;
# 4. runs tests/extract and tests/lab with AGNOSIA_TEST_DEVICE=cuda AGNOSIA_TEST_DTYPE=bfloat16
#    (pytest -n 8; no -x, so one device run reports every failure).
#
# With $OUT set (the device tool sets it) the log, the accelerator's JSON report, the per-comparison
# tolerance use (close-stats.jsonl) and a JUnit XML land there. Exit status: 0 when everything passed.
#
# Overrides, for trying the script's logic on a machine without a GPU (then test_accelerator skips):
#   PY=.venv/bin/python GPU_CHECK_SKIP_INSTALL=1 AGNOSIA_TEST_DEVICE=cpu bash bench/gpu_check.sh
# GPU_CHECK_WHEELS (default .whl), GPU_CHECK_SITE (/tmp/site), GPU_CHECK_WORKERS (8),
# GPU_CHECK_ACCEL_TIMEOUT (240 s), GPU_CHECK_SUITE_TIMEOUT (300 s), GPU_CHECK_PATHS (tests/extract tests/lab).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
SITE=${GPU_CHECK_SITE:-/tmp/site}
WORKERS=${GPU_CHECK_WORKERS:-8}
ACCEL_TIMEOUT=${GPU_CHECK_ACCEL_TIMEOUT:-240}
SUITE_TIMEOUT=${GPU_CHECK_SUITE_TIMEOUT:-300}
read -r -a TEST_PATHS <<< "${GPU_CHECK_PATHS:-tests/extract tests/lab}"
export AGNOSIA_TEST_DEVICE=${AGNOSIA_TEST_DEVICE:-cuda}
export AGNOSIA_TEST_DTYPE=${AGNOSIA_TEST_DTYPE:-bfloat16}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONDONTWRITEBYTECODE=1

RESULTS=""  # where the log and reports go: $OUT when set
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  RESULTS=$OUT
fi

main() {
  local t0=$SECONDS
  echo "== agnosia GPU check: $(date -u +%FT%TZ), $(hostname), repo $(pwd)"

  # ---------------------------------------------------------------- 1. wheels
  if [ "${GPU_CHECK_SKIP_INSTALL:-0}" != 1 ]; then
    local stage=/tmp/agnosia-wheels
    rm -rf "$stage" && mkdir -p "$stage"
    if [ -f "$WHEELS/wheels.tar.xz" ]; then
      "$PY" -c 'import sys, tarfile; t = tarfile.open(sys.argv[1]); t.extractall(sys.argv[2], **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))' \
        "$WHEELS/wheels.tar.xz" "$stage" || { echo "FAIL: cannot unpack $WHEELS/wheels.tar.xz"; return 2; }
    fi
    cp "$WHEELS"/*.whl "$stage"/ 2>/dev/null || true
    local n
    n=$(ls "$stage"/*.whl 2>/dev/null | wc -l)
    if [ "$n" -eq 0 ]; then
      echo "FAIL: no wheels in $WHEELS (run bench/gpu_wheels.sh here first and carry .whl)"; return 2
    fi
    echo "== installing $n wheels into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$stage"/*.whl \
      || { echo "FAIL: pip install of the carried wheels"; return 2; }
    export PYTHONPATH="$SITE:$PWD"
  else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
  echo "PYTHONPATH=$PYTHONPATH"

  # ---------------------------------------------------------------- 2. environment
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader || true
  else
    echo "(no nvidia-smi)"
  fi
  "$PY" - <<'EOF' || { echo "FAIL: environment check"; return 2; }
import importlib, os, sys
from pathlib import Path

print("python", sys.version.split()[0], sys.executable)
import torch
print("torch", torch.__version__, "| cuda", torch.version.cuda, "| available", torch.cuda.is_available(),
      "| threads", torch.get_num_threads())
if torch.cuda.is_available():
    print("device 0:", torch.cuda.get_device_name(0), "| bf16 supported", torch.cuda.is_bf16_supported())
elif os.environ["AGNOSIA_TEST_DEVICE"].startswith("cuda"):
    sys.exit("CUDA is not available but AGNOSIA_TEST_DEVICE=" + os.environ["AGNOSIA_TEST_DEVICE"])
versions = {}
for name in ("transformers", "huggingface_hub", "tokenizers", "safetensors", "torchvision", "accelerate", "numpy",
             "pandas", "pyarrow", "PIL", "zarr", "numcodecs", "duckdb", "pydantic", "google_crc32c", "num2words",
             "dask", "distributed", "yaml", "pytest", "xdist"):
    try:
        mod = importlib.import_module(name)
        versions[name] = (getattr(mod, "__version__", "?"), str(Path(mod.__file__).parent))
    except Exception as err:  # noqa: BLE001 - report every missing piece, then stop
        versions[name] = (f"MISSING ({type(err).__name__}: {err})", "")
for name, (v, where) in versions.items():
    print(f"  {name:16s} {v:12s} {where}")
import transformers

if not transformers.__version__.startswith("5.24"):
    sys.exit(f"transformers {transformers.__version__} at {transformers.__file__}: expected the carried 5.24.x")
missing = [n for n, (v, _) in versions.items() if v.startswith("MISSING") and n not in ("torchvision", "accelerate", "xdist")]
if missing:
    sys.exit(f"missing: {missing}")
import extract, lab, store  # noqa: E401 - resolved from this checkout through PYTHONPATH

repo = Path.cwd().resolve()
for mod in (extract, lab, store):
    assert Path(mod.__file__).resolve().is_relative_to(repo), f"{mod.__name__} from {mod.__file__}, not {repo}"
assert (lab.DEFAULT_CHECKPOINT / "model.safetensors").is_file(), f"no toy checkpoint at {lab.DEFAULT_CHECKPOINT}"
print("agnosia from", repo, "| toy checkpoint", lab.DEFAULT_CHECKPOINT)
EOF
  echo "== test device ${AGNOSIA_TEST_DEVICE}, dtype ${AGNOSIA_TEST_DTYPE} (setup $((SECONDS - t0)) s)"

  # ---------------------------------------------------------------- 3. accelerator vs cpu
  local rc_accel rc_suite t1=$SECONDS
  AGNOSIA_ACCEL_REPORT="${RESULTS:+$RESULTS/accelerator.json}" timeout -k 10 "$ACCEL_TIMEOUT" \
    "$PY" -m pytest -q -s -rfEs -p no:cacheprovider tests/extract/test_accelerator.py \
    ${RESULTS:+--junitxml="$RESULTS/junit-accelerator.xml"}
  rc_accel=$?
  echo "== test_accelerator.py: exit $rc_accel in $((SECONDS - t1)) s"

  # ---------------------------------------------------------------- 4. the suite on the device
  t1=$SECONDS
  local stats=${RESULTS:+$RESULTS/close-stats.jsonl}
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} AGNOSIA_TEST_CLOSE_STATS="$stats" timeout -k 10 "$SUITE_TIMEOUT" \
    "$PY" -m pytest -q -rfEs -p no:cacheprovider -n "$WORKERS" --durations=10 "${TEST_PATHS[@]}" \
    --ignore tests/extract/test_accelerator.py ${RESULTS:+--junitxml="$RESULTS/junit-suite.xml"}
  rc_suite=$?
  echo "== ${TEST_PATHS[*]} on ${AGNOSIA_TEST_DEVICE}/${AGNOSIA_TEST_DTYPE}: exit $rc_suite in $((SECONDS - t1)) s"
  if [ -n "$stats" ] && [ -s "$stats" ]; then
    "$PY" - "$stats" <<'EOF' || true
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
worst = {}
for r in rows:
    if r["used"] >= worst.get(r["test"], {"used": -1})["used"]:
        worst[r["test"]] = r
print(f"== reduced-dtype comparisons: {len(rows)}; largest share of the bound used (fails above 1):")
for r in sorted(worst.values(), key=lambda r: -r["used"])[:8]:
    print(f"  {r['used']:.3f}  {r['test']}  {r['what']}")
EOF
  fi

  echo "== done in $((SECONDS - t0)) s: accelerator exit $rc_accel, suite exit $rc_suite"
  [ "$rc_accel" -eq 0 ] && [ "$rc_suite" -eq 0 ]
}

if [ -n "$RESULTS" ]; then
  main 2>&1 | tee "$RESULTS/gpu-check.log"
  exit "${PIPESTATUS[0]}"
fi
main
