#!/usr/bin/env bash
# The GPU-only checks in one go, on a host with CUDA, with or without vLLM installed:
#   0. KV-A1..A5 on CUDA through production's worker path (uniproc at world size 1, the
#      multiproc topology at world size 2 where there are 2 GPUs; each result names the
#      production entry point it went through): FLASH_ATTN and the seam stand-ins;
#   1. KV-A6 (free-memory-sized allocation probed past 2^31 and 2^32 bytes) must pass;
#   2. KV-L7 (the paged read path) on CUDA: the conforming stand-in paged backends
#      (tests/paged_standins.py) must pass, each seeded misread must fail naming the first
#      wrong block; FLASH_ATTN must pass where vLLM's compiled kernels are installed and is
#      reported as skipped where they are not (the bundle carries no compiled vLLM);
#   3. xdist device pinning with -n auto: every xdist worker sees exactly one GPU, and
#      no two workers share one.
# Writes OUT/REPORT.md (and gpu.json, xdist.json, a6.json, env.json, per-step logs).
#
# Usage: tools/gpu_checks.sh [OUT_DIR]
#   PYTHON=...            the interpreter (default python3)
#   KVCONFORM_BUNDLE=DIR  a bundle from tools/build_gpu_bundle.py: a host without vLLM;
#                         its wheels and vLLM / vllm-omni sources are unpacked under OUT/env
#   KVCONFORM_GPU_ARGS    extra pytest options, e.g. "--kv-memory-fraction 0.3"
#   KVCONFORM_A6_BACKENDS backends for KV-A (default FLASH_ATTN; the seams run too)
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"

py="${PYTHON:-python3}"
out="${1:-${KVCONFORM_GPU_OUT:-$(mktemp -d -t kvconform-gpu-XXXX)}}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
read -r -a extra <<< "${KVCONFORM_GPU_ARGS:-}"
status=0
started=$(date +%s)
plugin=()
if [ -n "${KVCONFORM_BUNDLE:-}" ]; then
    "$py" "$KVCONFORM_BUNDLE/install.py" "$KVCONFORM_BUNDLE" "$out/env"
    export PYTHONPATH="$out/env/src:$out/env/site:$repo${PYTHONPATH:+:$PYTHONPATH}"
    plugin=(-p pytest_kvconform.plugin)   # not installed there: no pytest11 entry point
else
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
fi
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"

if ! "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_checks: torch sees no CUDA device; run this on a GPU host" >&2
    exit 2
fi
ngpu=$("$py" -c 'import torch; print(torch.cuda.device_count())')
echo "gpu_checks: $ngpu CUDA device(s); output in $out"

# 0. the environment, and whether vLLM / vllm-omni import on this torch ---------------
"$py" - "$out/env.json" <<'EOF' || status=1
import json, sys, time, traceback
import torch
env = {"python": sys.version.split()[0], "torch": torch.__version__,
       "cuda": torch.version.cuda, "devices": []}
for i in range(torch.cuda.device_count()):
    free, total = torch.cuda.mem_get_info(i)
    env["devices"].append({"index": i, "name": torch.cuda.get_device_name(i),
                           "free_bytes": free, "total_bytes": total})
for mod in ("vllm", "vllm_omni.diffusion.diffusion_kv.paged_attention_adapter",
            "vllm_omni.diffusion.diffusion_kv.initialization"):
    t = time.monotonic()
    try:
        __import__(mod)
        env[f"import {mod}"] = f"ok in {time.monotonic() - t:.1f}s"
    except Exception:
        env[f"import {mod}"] = traceback.format_exc(limit=-6)
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(json.dumps(env, indent=1))
sys.exit(0 if all(v.startswith("ok") for k, v in env.items() if k.startswith("import")) else 1)
EOF

# 1-2. KV-A6 and KV-L7 -------------------------------------------------------------------
a6=()
for b in ${KVCONFORM_A6_BACKENDS:-FLASH_ATTN}; do a6+=(--kv-backend "$b"); done
l7=()
for b in FLASH_ATTN PAGED_OK PAGED_OK_BS PAGED_NO_TABLE PAGED_BAD_STRIDE PAGED_TRUNCATES; do
    l7+=(--kv-backend "$b")
done
t=$(date +%s)
"$py" -m pytest ${plugin[@]+"${plugin[@]}"} -p tests.paged_standins --kv-conformance -p no:cacheprovider \
    -p no:xdist -q -rs -k "(kv_a and not PAGED_) or kv_l7" "${a6[@]}" "${l7[@]}" \
    --kv-report "$out/gpu.json" ${extra[@]+"${extra[@]}"} > "$out/gpu.log" 2>&1 || true
echo "$(( $(date +%s) - t ))" > "$out/gpu.seconds"
tail -25 "$out/gpu.log"

# KV-A6's allocation as the control plane sizes it now (bytes, probe pages and offsets).
"$py" - "$out/a6.json" <<'EOF' || status=1
import json, sys
import torch
from pytest_kvconform import cases, compat, oracle
from pytest_kvconform.checks import adoption, adoption_bytes
from pytest_kvconform.adapters.control_plane import build_control_plane
fraction = 0.5
case = next(c for c in cases.load_cases([]) if c.world_size == 1)
free = compat.device_free_memory("cuda:0")
cp = build_control_plane(False, case, device="cuda:0", available_memory=[int(free * fraction)])
config = cp.rank_configs[0]
tensor = config.kv_cache_tensors[0]
geom = adoption._geometry(config, len(tensor.layers))
pages = adoption_bytes._far_pages(cp.pinned, geom, tensor.offset)
probes = [{"layer": l, "block": b,
           "byte_offset": oracle.page_start(cp.pinned, geom, l, b, tensor.offset)}
          for l, b in pages]
rec = {"case": case.id, "free_bytes": free, "fraction": fraction, "layout": cp.pinned,
       "allocation_bytes": max(t.size for t in config.kv_cache_tensors),
       "num_blocks": config.num_blocks, "probes": probes,
       "past_2_31": any(p["byte_offset"] >= 2**31 for p in probes),
       "past_2_32": any(p["byte_offset"] >= 2**32 for p in probes)}
json.dump(rec, open(sys.argv[1], "w"), indent=1)
print(f"gpu_checks: KV-A6 sizing: {rec['allocation_bytes']} bytes ({rec['layout']}), "
      f"far probes at {[p['byte_offset'] for p in probes]}")
EOF

# 3. xdist pinning with -n auto ----------------------------------------------------------
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
    (pathlib.Path(os.environ["KVCONFORM_PINNING_DIR"]) / worker_id).write_text(
        f"{visible} {torch.cuda.get_device_name(0)}")
EOF
t=$(date +%s)
KVCONFORM_PINNING_DIR="$probe/seen" KVCONFORM_PINNING_TESTS=$((ngpu * 8)) \
    "$py" -m pytest ${plugin[@]+"${plugin[@]}"} --kv-conformance -p no:cacheprovider -q -n auto \
    "$probe/test_pinning.py" -k "pinning or kv_l1" --kv-report "$out/xdist.json" \
    > "$out/xdist.log" 2>&1 || status=1
echo "$(( $(date +%s) - t ))" > "$out/xdist.seconds"
tail -5 "$out/xdist.log"

# 4. the report: verdicts per check, and REPORT.md ------------------------------------
"$py" "$repo/tools/gpu_report.py" "$out" "$ngpu" "$(( $(date +%s) - started ))" || status=1
echo "gpu_checks: $([ $status -eq 0 ] && echo OK || echo FAILED); report in $out/REPORT.md"
exit $status
