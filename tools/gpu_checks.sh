#!/usr/bin/env bash
# The GPU-only checks in one go, on a host with CUDA:
#   1. KV-A6 (free-memory-sized allocation probed past 2^31 and 2^32 bytes) must pass;
#      KV-L7 (the paged read path) runs too and is reported, but is not implemented yet
#      (it skips), so it does not decide the outcome;
#   2. xdist device pinning with -n auto: every xdist worker sees exactly one GPU, and
#      no two workers share one.
# Usage: tools/gpu_checks.sh [OUT_DIR]   (PYTHON=... picks the interpreter; extra pytest
# options in KVCONFORM_GPU_ARGS, e.g. "--kv-memory-fraction 0.3 --kv-backend FLASH_ATTN").
set -euo pipefail
cd "$(dirname "$0")/.."

py="${PYTHON:-python}"
out="${1:-${KVCONFORM_GPU_OUT:-$(mktemp -d -t kvconform-gpu-XXXX)}}"
mkdir -p "$out"
read -r -a extra <<< "${KVCONFORM_GPU_ARGS:-}"
status=0

if ! "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_checks: torch sees no CUDA device; run this on a GPU host" >&2
    exit 2
fi
ngpu=$("$py" -c 'import torch; print(torch.cuda.device_count())')
echo "gpu_checks: $ngpu CUDA device(s); output in $out"

# 1. KV-L7 and KV-A6 -------------------------------------------------------------------
"$py" -m pytest --kv-conformance -p no:cacheprovider -p no:xdist -q -rs \
    -k "kv_l7 or kv_a6" --kv-report "$out/gpu.json" "${extra[@]}" || status=1
"$py" - "$out/gpu.json" <<'EOF' || status=1
import json, sys

results = json.load(open(sys.argv[1]))["results"]
for r in results:
    if r["clause"] == "KV-L7":
        print(f"gpu_checks: (KV-L7, informational) {r['nodeid']}: {r['status']} {r['reason']}")
gpu = [r for r in results if r["clause"] == "KV-A6"]
bad = [r for r in gpu if r["status"] not in ("passed", "xfailed")
       and not (r["status"] == "skipped" and r.get("skip_kind") == "backend")]
for r in bad:
    print(f"gpu_checks: {r['nodeid']}: {r['status']}: {r['reason']}", file=sys.stderr)
print(f"gpu_checks: KV-A6: {len(gpu)} results, {len(bad)} not passed")
sys.exit(1 if bad or not gpu else 0)
EOF

# 2. xdist pinning with -n auto ----------------------------------------------------------
probe="$out/pinning"
rm -rf "$probe" && mkdir -p "$probe/seen"
cat > "$probe/test_pinning.py" <<'EOF'
import os
import pathlib

import pytest
import torch


@pytest.mark.parametrize("i", range(int(os.environ["KVCONFORM_PINNING_TESTS"])))
def test_pinning(kv_device, worker_id, i):
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    assert kv_device == "cuda:0", kv_device
    assert visible and "," not in visible, visible
    assert torch.cuda.device_count() == 1
    (pathlib.Path(os.environ["KVCONFORM_PINNING_DIR"]) / worker_id).write_text(visible)
EOF
KVCONFORM_PINNING_DIR="$probe/seen" KVCONFORM_PINNING_TESTS=$((ngpu * 8)) \
    "$py" -m pytest --kv-conformance -p no:cacheprovider -q -n auto "$probe/test_pinning.py" \
    -k "pinning or kv_l1" --kv-report "$out/xdist.json" || status=1
"$py" - "$probe/seen" "$ngpu" <<'EOF' || status=1
import pathlib, sys

seen = {p.name: p.read_text() for p in pathlib.Path(sys.argv[1]).iterdir()}
ngpu = int(sys.argv[2])
print(f"gpu_checks: xdist workers -> CUDA_VISIBLE_DEVICES: {seen}")
ok = len(seen) == ngpu and len(set(seen.values())) == len(seen)
if not ok:
    print(f"gpu_checks: expected {ngpu} workers on {ngpu} distinct GPUs", file=sys.stderr)
sys.exit(0 if ok else 1)
EOF

echo "gpu_checks: $([ $status -eq 0 ] && echo OK || echo FAILED); reports in $out"
exit $status
