"""Build the GPU bundle: what a CUDA host without vLLM needs to run tools/gpu_checks.sh.

Run with the default environment's interpreter (vLLM 0.30 + vllm-omni 0.30 installed):

    $ENVPY tools/build_gpu_bundle.py [--out dist/gpu-bundle] [--no-download] [--check-py312]

1. Trace: the GPU checks' selection (KV-A3/A6, KV-L1, KV-L7 with the stand-in paged
   backends and FLASH_ATTN) runs here in-process, and every module it imported is noted.
2. Sources: the traced modules of ``vllm`` and ``vllm_omni`` (``.py`` only, with their
   packages' ``__init__.py``; no compiled ``.so`` such as ``vllm._C`` or
   ``vllm_flash_attn``) go to ``src/``, with the two distributions' metadata (version,
   entry points), so ``importlib.metadata`` reports the versions the checks ran against.
3. Wheels: every other traced distribution the CUDA image lacks (it has python3.12,
   torch, triton, transformers and their requirements) as a cp312 manylinux wheel of the
   version installed here, fetched with ``pip download --python-version 3.12
   --only-binary=:all: --no-deps``; plus pytest and pytest-xdist with their helpers.
4. ``MANIFEST.json`` (modules, wheels, sizes); the bundle's size is printed, and the
   build fails above ``--max-mib`` (default 48, well under a device call's 64 MiB).

``--check-py312`` then checks the bundle with this machine's python3.12: the wheels
unpack, every bundled source byte-compiles, and every module-level import in the bundled
sources resolves to the bundle, its wheels, the standard library or the image's packages.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the CUDA image already has: torch, triton, transformers and what they require.
IMAGE_HAS = {
    "torch", "triton", "transformers", "numpy", "huggingface-hub", "tokenizers",
    "safetensors", "pyyaml", "regex", "requests", "packaging", "filelock", "tqdm",
    "typing-extensions", "jinja2", "markupsafe", "sympy", "mpmath", "networkx", "fsspec",
    "setuptools", "certifi", "charset-normalizer", "idna", "urllib3", "hf-xet",
    "typer-slim", "typer", "click", "shellingham", "httpx", "httpcore", "h11", "anyio", "sniffio",
}
# Never bundled: ours (copied as source), compiled-kernel carriers, the image's CUDA libs.
NOT_WHEELED = {"vllm", "vllm-omni", "pytest-kvconform"}
ALWAYS_WHEELED = ("pytest", "pluggy", "iniconfig", "pygments", "pytest-xdist", "execnet")
# Imported for real under python3.12 by --check-py312 (they need no torch).
PY312_IMPORTS = ("pytest", "xdist", "pytest_kvconform.plugin", "pytest_kvconform.cli", "zmq",
                 "msgspec", "pydantic", "aiohttp", "cbor2", "cloudpickle", "psutil", "PIL",
                 "openai", "fastapi")
# Stand-ins for the image's pure-Python packages in that real import (this env's copies).
PY312_IMAGE_PURE = ("typing-extensions", "packaging", "pyyaml", "requests", "idna", "certifi",
                    "urllib3", "anyio", "httpx", "httpcore", "h11", "sniffio", "jinja2",
                    "markupsafe", "filelock", "tqdm", "typing-inspection")
# Where the import closure starts (found by import_closure for vLLM 0.30 + vllm-omni 0.30;
# it only saves iterations: the closure still grows from here, and the verification run
# still has to reproduce the full environment's outcomes).
CLOSURE_SEED = (
    "aenum", "aiohappyeyeballs", "aiohttp", "aiosignal", "annotated-doc", "annotated-types",
    "apache-tvm-ffi", "attrs", "cachetools", "cbor2", "cloudpickle", "diffusers", "einops",
    "fastapi", "frozenlist", "httpx2", "llguidance", "loguru", "msgspec", "multidict",
    "omegaconf", "openai", "openai-harmony", "partial-json-parser", "pillow", "prettytable",
    "prometheus-client", "propcache", "psutil", "py-cpuinfo", "pybase64", "pydantic",
    "pydantic-core", "pyzmq", "starlette", "tiktoken", "typing-inspection", "uvloop",
    "xgrammar", "yarl",
)
PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_29_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux2010_x86_64", "manylinux1_x86_64", "any")
# What the GPU checks import (plugin, KV-A workers, KV-L7 drivers); the wheels are the
# import closure of these on top of the image, found by importing them here with -S.
ENTRY_MODULES = (
    "pytest_kvconform.plugin", "pytest_kvconform.session.run", "pytest_kvconform.workers.pool",
    "pytest_kvconform.checks.adoption", "pytest_kvconform.checks.paged",
    "vllm_omni.diffusion.attention.backends.registry",
    "vllm_omni.diffusion.attention.backends.flash_attn",
    "vllm_omni.diffusion.attention.backends.sdpa",
    "vllm_omni.diffusion.diffusion_kv.initialization",
    "vllm_omni.diffusion.diffusion_kv.paged_attention_adapter",
    "vllm_omni.diffusion.diffusion_kv.model_runner_backend",
    "vllm_omni.diffusion.vllm_config", "vllm.distributed.device_communicators.shm_broadcast",
    "vllm.v1.worker.gpu.attn_utils", "xdist.plugin",
)
TRACE_SELECTION = ("kv_l7 or kv_a or kv_l1")
TRACE_BACKENDS = ("PAGED_OK", "PAGED_OK_BS", "FLASH_ATTN", "TORCH_SDPA")
PLUGIN_FILES = ("pytest_kvconform", "conformance_cases", "tests/__init__.py",
                "tests/paged_standins.py", "tools/gpu_checks.sh", "pyproject.toml")

_TRACE = r"""
import json, sys
import pytest


class Outcomes:
    def __init__(self):
        self.seen = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.seen[report.nodeid] = report.outcome


outcomes = Outcomes()
code = pytest.main(json.loads(sys.argv[1]), plugins=[outcomes])
for name in json.loads(sys.argv[3]):  # what the device run imports beyond this CPU run
    try:
        __import__(name)
    except Exception as exc:
        print(f"trace: importing {name} failed: {exc!r}")
mods = {name: getattr(m, "__file__", None) for name, m in list(sys.modules.items())}
json.dump({"exit": int(code), "modules": mods, "outcomes": outcomes.seen},
          open(sys.argv[2], "w"))
"""


def trace(python: str, path: list[str] | None = None) -> dict:
    """Run the GPU checks' selection here on CPU: imported modules and test outcomes.

    With ``path``, the interpreter runs without its site-packages (``-S``) on exactly
    those directories: the bundle's view of the world, minus the Python version.
    """
    args = ["--kv-conformance", "-p", "no:cacheprovider", "-p", "no:xdist",
            "-p", "tests.paged_standins", "-q", "-k", TRACE_SELECTION,
            "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml")]
    for name in TRACE_BACKENDS:
        args += ["--kv-backend", name]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trace.json"
        dirs = [str(ROOT), os.environ.get("PYTHONPATH", "")] if path is None else \
            [*path, str(ROOT)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(dirs), VLLM_LOGGING_LEVEL="WARNING")
        flags = [] if path is None else ["-S"]
        if path is not None:  # not installed there: no pytest11 entry point
            args = ["-p", "pytest_kvconform.plugin", *args]
        quiet = None if os.environ.get("KVCONFORM_BUNDLE_DEBUG") else subprocess.DEVNULL
        subprocess.run([python, *flags, "-c", _TRACE, json.dumps(args), str(out),
                        json.dumps(ENTRY_MODULES)], cwd=tmp,
                       env=env, check=False, stdout=quiet)
        if not out.exists():
            raise SystemExit("build_gpu_bundle: the trace run wrote nothing")
        result = json.loads(out.read_text())
    if result["exit"] not in (0, 1):  # 1: some clause failed; the imports are what count
        raise SystemExit(f"build_gpu_bundle: trace run exited {result['exit']}")
    return result


def copy_sources(modules: dict[str, str | None], dest: Path) -> list[str]:
    """The traced vllm / vllm_omni modules' .py files, with their packages' __init__.py."""
    copied: dict[Path, Path] = {}  # path in the bundle -> its site-packages
    for name, file in modules.items():
        top = name.partition(".")[0]
        if not file or top not in ("vllm", "vllm_omni"):
            continue
        path = Path(file)
        if path.suffix != ".py":
            continue  # compiled extensions stay behind
        site = site_of(top.replace("_", "-"))
        rel = path.relative_to(site)
        copied[rel] = site
        for parent in rel.parents:
            init = parent / "__init__.py"
            if parent != Path(".") and (site / init).exists():
                copied[init] = site
    for rel, site in sorted(copied.items()):
        target = dest / "src" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(site / rel, target)
    for dist in ("vllm", "vllm-omni"):
        info = md.distribution(dist)
        meta = dest / "src" / f"{dist.replace('-', '_')}-{info.version}.dist-info"
        meta.mkdir(parents=True, exist_ok=True)
        for fname in ("METADATA", "entry_points.txt", "top_level.txt"):
            text = info.read_text(fname)
            if text is not None:
                (meta / fname).write_text(text)
    return sorted(str(p) for p in copied)


def needed_distributions(modules: dict[str, str | None]) -> dict[str, str]:
    """{distribution: version} behind the traced top-level modules, less image and ours."""
    by_top = md.packages_distributions()
    stdlib = set(sys.stdlib_module_names)
    wanted: dict[str, str] = {}
    for name in {m.partition(".")[0] for m in modules}:
        if name in stdlib or name.startswith("_") or name in ("tests", "pytest_kvconform"):
            continue
        for dist in by_top.get(name, []):
            key = dist.lower().replace("_", "-")
            if key in IMAGE_HAS or key in NOT_WHEELED or key.startswith(("nvidia-", "cuda-")):
                continue
            wanted[key] = md.version(dist)
    for dist in ALWAYS_WHEELED:
        wanted[dist] = md.version(dist)
    return dict(sorted(wanted.items()))


def top_level_modules(dists: list[str]) -> list[str]:
    """The importable top-level names the given distributions install."""
    wanted = {d.lower().replace("_", "-") for d in dists}
    return sorted(top for top, owners in md.packages_distributions().items()
                  if any(o.lower().replace("_", "-") in wanted for o in owners))


def site_of(dist: str) -> Path:
    """The site-packages directory a distribution is installed in.

    Not this interpreter's own purelib: a clone's tox environment sees the heavy packages
    from a shared environment's site-packages (toxfile.py).
    """
    return Path(str(md.distribution(dist).locate_file("")))


def filtered_site(dists: list[str], dest: Path) -> Path:
    """A directory holding links to just these distributions' files from this env."""
    dest.mkdir(parents=True, exist_ok=True)
    for dist in dists:
        try:
            files = md.distribution(dist).files or []
            site = site_of(dist)
        except md.PackageNotFoundError:
            continue
        for top in {f.parts[0] for f in files if f.parts and f.parts[0] != ".."}:
            link = dest / top
            if (site / top).exists() and not link.exists():
                link.symlink_to(site / top)
    return dest


def import_closure(src: Path, start: list[str]) -> list[str]:
    """Distributions to wheel: grown from ``start`` until ENTRY_MODULES import with -S
    on the bundle's sources, the image's distributions and these (this env's copies)."""
    import re

    by_top = md.packages_distributions()
    wheeled = list(start)
    code = "".join(f"import {m}\n" for m in ENTRY_MODULES) + "print('imports ok')\n"
    for _ in range(100):
        with tempfile.TemporaryDirectory() as tmp:
            site = filtered_site(sorted(IMAGE_HAS) + wheeled, Path(tmp) / "site")
            env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR",
                       PYTHONPATH=os.pathsep.join([str(src), str(site), str(ROOT)]))
            done = subprocess.run([sys.executable, "-S", "-c", code], env=env,
                                  capture_output=True, text=True, check=False)
        if "imports ok" in done.stdout:
            return sorted(set(wheeled))
        missing = re.findall(r"No module named '([\w.]+)'", done.stderr)
        top = missing[-1].partition(".")[0] if missing else ""
        owners = by_top.get(top, []) if top not in ("vllm", "vllm_omni") else []
        if not owners:
            raise SystemExit(f"build_gpu_bundle: import closure stuck:\n{done.stderr[-3000:]}")
        wheeled += [o.lower().replace("_", "-") for o in owners]
    raise SystemExit("build_gpu_bundle: import closure did not converge")


def verify_here(dest: Path, wheeled: list[str], reference: dict) -> int:
    """Re-run the selection on the bundle's sources plus only the image's and wheeled
    distributions (this env's copies); the outcomes must equal the full run's."""
    with tempfile.TemporaryDirectory() as tmp:
        site = filtered_site(sorted(IMAGE_HAS) + wheeled, Path(tmp) / "site")
        result = trace(sys.executable, [str(dest / "src"), str(site)])
    vllm_from = result["modules"].get("vllm") or ""
    want, got = reference["outcomes"], result["outcomes"]
    diff = {k: (v, got.get(k)) for k, v in want.items() if got.get(k) != v}
    print(f"build_gpu_bundle: verify (bundle sources + {len(wheeled)} wheeled and the image's "
          f"distributions only, vllm from {vllm_from}): {len(got)} results, "
          f"{len(diff)} differ from the full environment's")
    for nodeid, (was, now) in sorted(diff.items()):
        print(f"  {nodeid}: {was} -> {now}")
    return 1 if diff or not got else 0


def download(wanted: dict[str, str], dest: Path) -> dict[str, str]:
    """cp312 wheels of the installed versions; returns {distribution: problem} for misses."""
    wheels = dest / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    missing: dict[str, str] = {}
    for dist, version in wanted.items():
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels),
               "--python-version", "3.12", "--only-binary=:all:",
               *[arg for tag in PLATFORMS for arg in ("--platform", tag)],
               f"{dist}=={version}"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            missing[dist] = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
    return missing


def copy_plugin(dest: Path) -> None:
    for rel in PLUGIN_FILES:
        src = ROOT / rel
        target = dest / "repo" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, target)


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --- the python3.12 check -----------------------------------------------------------

_RESOLVE = r"""
import ast, importlib.util, json, sys
from pathlib import Path
src, image = Path(sys.argv[1]), set(json.loads(sys.argv[2]))
unresolved, checked = {}, 0
for path in src.rglob("*.py"):
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:  # module level only: guarded and lazy imports are optional
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.partition(".")[0]
            checked += 1
            if top in image or top in sys.stdlib_module_names:
                continue
            try:
                found = importlib.util.find_spec(name) is not None
            except (ImportError, ValueError):
                found = importlib.util.find_spec(top) is not None
            if not found:
                unresolved.setdefault(name, str(path.relative_to(src)))
print(json.dumps({"checked": checked, "unresolved": unresolved}))
"""
def image_modules() -> list[str]:
    """Top-level modules of what the image has (as installed here), plus the stdlib's."""
    return [*top_level_modules(sorted(IMAGE_HAS)), "pkg_resources", "_distutils_hack"]


def check_py312(dest: Path) -> int:
    """Unpack the wheels and resolve the bundled sources' imports under python3.12."""
    py = shutil.which("python3.12")
    if py is None:
        print("build_gpu_bundle: no python3.12 on this machine; import check not run")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        sys.path.insert(0, str(ROOT / "tools"))
        from gpu_bundle_install import install_wheels

        installed = install_wheels(dest / "wheels", site)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(dest / "src"), str(site), str(dest / "repo")]), PYENV_VERSION="3.12.1")
        compiled = subprocess.run([py, "-m", "compileall", "-q", "-d", "src",
                                   str(dest / "src"), str(dest / "repo")],
                                  env=env, capture_output=True, text=True, check=False)
        for d in (dest / "src", dest / "repo"):
            for cache in d.rglob("__pycache__"):
                shutil.rmtree(cache)
        done = subprocess.run([py, "-c", _RESOLVE, str(dest / "src"),
                               json.dumps(image_modules())], env=env, capture_output=True,
                              text=True, check=False)
        version = subprocess.run([py, "--version"], env=env, capture_output=True, text=True,
                                 check=False).stdout.strip()
        image = filtered_site(list(PY312_IMAGE_PURE), Path(tmp) / "image")
        real_env = dict(env, PYTHONPATH=env["PYTHONPATH"] + os.pathsep + str(image))
        real = subprocess.run([py, "-c", "".join(f"import {m}\n" for m in PY312_IMPORTS)],
                              env=real_env, capture_output=True, text=True, check=False)
    if done.returncode:
        print(done.stderr[-3000:])
        return 1
    result = json.loads(done.stdout)
    print(f"build_gpu_bundle: {version}: {len(installed)} wheels unpacked; compileall "
          f"{'ok' if compiled.returncode == 0 else 'FAILED'}; "
          f"{result['checked']} module-level imports checked, "
          f"{len(result['unresolved'])} unresolved")
    print(f"build_gpu_bundle: {version}: imported {', '.join(PY312_IMPORTS)}: "
          f"{'ok' if real.returncode == 0 else 'FAILED'}")
    if real.returncode:
        print(real.stderr[-3000:])
    if compiled.returncode:
        print(compiled.stdout[-3000:], compiled.stderr[-3000:])
    for name, where in sorted(result["unresolved"].items()):
        print(f"  unresolved: {name} (imported by {where})")
    return 1 if compiled.returncode or real.returncode or result["unresolved"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dist" / "gpu-bundle")
    parser.add_argument("--max-mib", type=float, default=48.0)
    parser.add_argument("--no-download", action="store_true",
                        help="reuse the wheels already in OUT/wheels")
    parser.add_argument("--check-py312", action="store_true")
    ns = parser.parse_args(argv)
    dest: Path = ns.out
    keep = dest / "wheels" if ns.no_download else None
    if dest.exists():
        for child in dest.iterdir():
            if child != keep:
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    dest.mkdir(parents=True, exist_ok=True)
    print("build_gpu_bundle: tracing the GPU checks' selection here ...", flush=True)
    full = trace(sys.executable)
    modules = full["modules"]
    sources = copy_sources(modules, dest)
    traced = needed_distributions(modules)
    print("build_gpu_bundle: import closure over the image ...", flush=True)
    closure = import_closure(dest / "src", [*ALWAYS_WHEELED, *CLOSURE_SEED])
    wanted = {d: md.version(d) for d in closure}
    print(f"build_gpu_bundle: {len(wanted)} distributions to wheel ...", flush=True)
    missing = {} if ns.no_download else download(wanted, dest)
    copy_plugin(dest)
    shutil.copy2(ROOT / "tools" / "gpu_bundle_install.py", dest / "install.py")
    status = verify_here(dest, sorted(wanted), full)
    if ns.check_py312:
        status |= check_py312(dest)
    # The sources travel packed (a third of their size); install.py unpacks them.
    shutil.make_archive(str(dest / "src"), "gztar", root_dir=dest / "src")
    shutil.rmtree(dest / "src")
    wheels = sorted(p.name for p in (dest / "wheels").glob("*.whl"))
    sizes = {part: size_of(dest / part) if (dest / part).is_dir() else
             (dest / part).stat().st_size for part in ("src.tar.gz", "wheels", "repo")}
    manifest = {"python": "3.12", "sources": sources, "distributions": wanted,
                "traced_not_wheeled": sorted(set(traced) - set(wanted)),
                "wheels": wheels, "missing_wheels": missing, "sizes": sizes,
                "image_has": sorted(IMAGE_HAS)}
    (dest / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    total = size_of(dest)
    print(f"build_gpu_bundle: {len(sources)} vllm/vllm_omni sources "
          f"({sizes['src.tar.gz'] / 2**20:.1f} MiB packed), {len(wheels)} wheels "
          f"({sizes['wheels'] / 2**20:.1f} MiB), plugin {sizes['repo'] / 2**20:.1f} MiB")
    print(f"build_gpu_bundle: bundle size {total} bytes = {total / 2**20:.1f} MiB in {dest}")
    for dist, why in missing.items():
        print(f"build_gpu_bundle: no cp312 wheel for {dist}: {why}")
    if total > ns.max_mib * 2**20:
        print(f"build_gpu_bundle: over the {ns.max_mib} MiB limit", file=sys.stderr)
        status = 1
    if missing:
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
