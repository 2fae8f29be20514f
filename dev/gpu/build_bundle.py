"""Build the offline wheel bundles that the GPU device machine installs (vLLM and SGLang).

The device image (Python 3.12, torch 2.11.0+cu130) has no network and no vllm/sglang, and a
``run`` call carries at most 64 MiB. So, here on a machine with a registry:

1. resolve each engine's dependency closure for CPython 3.12 / manylinux x86_64 (``pip install
   --dry-run --report``, nothing installed);
2. leave out what the image already has (``dev/gpu/image_packages.txt``) unless the engine must
   shadow it (KEEP), and what is not needed to start and generate (DROP);
3. download the rest (``pip download --no-deps``);
4. prune the big wheels (files that the Hopper path never imports) and rewrite their RECORD;
5. split everything into parts of at most ``--part-mib`` MiB: ``.gpu/parts/<engine>-partNN/``,
   each holding ``<engine>/`` files (wheels, or ``.chunkNN`` pieces of a wheel larger than a
   part) plus ``<engine>/MANIFEST.json`` (every wheel's sha256 and its pieces).

``dev/gpu/stage.sh`` and ``dev/gpu/install.sh`` reassemble and install them on the device; docs/gpu.md
says which ``run`` calls carry which part. Run: ``python3 dev/gpu/build_bundle.py [vllm] [sglang] [ray]``
(all three without arguments; naming one rebuilds only its parts, the others' stay as they are).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20

PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(5, 40)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
    "any",
]
TARGET_ARGS = [
    "--only-binary=:all:",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    "--abi",
    "cp312",
    "--abi",
    "abi3",
    "--abi",
    "none",
    *(arg for p in PLATFORMS for arg in ("--platform", p)),
]

# Pure-Python needs of the rlinfer packages themselves that the image lacks.
RLINFER_EXTRA = ["cattrs>=24.1"]

# The Ray of the CPU venvs (rlinfer_ray's pyproject needs ray>=2.40); it has cp312 wheels.
RAY_PIN = "ray==2.60.0"

# Not needed to start an engine and generate on Hopper (ENGINES.md, verified on an H100), and big.
COMMON_DROP = {
    "tokenspeed-triton",
    "tilelang",
    "pynvvideocodec",
    "z3-solver",
    "torchcodec",
    "nvidia-cutlass-dsl-libs-cu12",
}
# The CUDA compiler toolchain as wheels (pulled in by humming-kernels[cu13]); the image has
# CUDA 13.0's nvcc/nvvm/nvdisasm/cccl itself. 131 MiB; --with-toolchain keeps them.
TOOLCHAIN = {
    "nvidia-nvvm",
    "nvidia-cuda-nvcc",
    "nvidia-cuda-crt",
    "nvidia-cuda-nvdisasm",
    "nvidia-cuda-cccl",
}


@dataclass(frozen=True)
class Prune:
    """Members to delete from one wheel (fnmatch patterns on the archive path)."""

    package: str
    patterns: tuple[str, ...]


@dataclass
class EngineRecipe:
    """What one engine bundle holds."""

    name: str
    requirements: list[str]
    keep: set[str] = field(default_factory=set)  # image packages that must be shadowed anyway
    drop: set[str] = field(default_factory=set)
    prune: list[Prune] = field(default_factory=list)


RECIPES = {
    "vllm": EngineRecipe(
        name="vllm",
        requirements=["vllm==0.26.0", *RLINFER_EXTRA],
        drop=set(COMMON_DROP),
        prune=[
            Prune(
                "vllm",
                (
                    "vllm/vllm_flash_attn/_vllm_fa2_C*.so",  # FA2 is pre-Hopper; import is try/except, sm90 uses FA3
                    "vllm/vllm-rs",  # the Rust front-end binary (not used in-process)
                    "vllm/third_party/fmha_sm100/*",  # Blackwell-only
                    "vllm/third_party/deep_gemm/_C.cpython-31[013]-*.so",  # other Pythons' copies
                    "vllm/third_party/deep_gemm/_C.cpython-314-*.so",
                    "vllm/entrypoints/serve/instrumentator/static/swagger-ui*",
                ),
            ),
        ],
    ),
    "sglang": EngineRecipe(
        name="sglang",
        requirements=["sglang==0.5.16", *RLINFER_EXTRA],
        # sglang 0.5.16 pins transformers==5.12.1 (the image has 5.17) and matching tokenizers/protobuf.
        keep={"transformers", "tokenizers", "protobuf"},
        drop=set(COMMON_DROP),
        prune=[
            Prune(
                "sglang-kernel",
                (
                    "sgl_kernel/flash_ops*",  # FA3 (1.1 GB unpacked); only the fa3 attention backend imports it
                    "sgl_kernel/sm100/*",
                    "sgl_kernel/*infllm_ops*",
                ),
            ),
        ],
    ),
    # Ray for rlinfer-ray's pool (the image has none). Its own site dir (/tmp/ray_site),
    # next to either engine's. A local ``ray.init(include_dashboard=False)`` + actors + placement
    # groups need ray/_raylet.so, ray/core (gcs_server, raylet), ray/_private (incl. the runtime-env
    # agent and its vendored aiohttp), ray/dashboard's Python (the per-node dashboard agent the
    # raylet starts), ray/util, ray/thirdparty_files; not the Java worker or the AI libraries.
    "ray": EngineRecipe(
        name="ray",
        requirements=[RAY_PIN],
        prune=[
            Prune(
                "ray",
                (
                    "ray/jars/*",  # the Java worker (30.7 MiB compressed)
                    "ray/rllib/*",
                    "ray/data/*",
                    "ray/serve/*",
                    "ray/tune/*",
                    "ray/train/*",
                    "ray/llm/*",
                    "ray/dashboard/client/build/*",  # the web UI's assets (the dashboard is off)
                ),
            ),
        ],
    ),
}


def norm(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path) -> set[str]:
    """Names (normalised) of the packages already in the GPU image."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(norm(line.split("==", 1)[0]))
    return names


def pip(*args: str) -> None:
    """Run pip of this interpreter, failing loudly."""
    cmd = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(cmd[:12]), "..." if len(cmd) > 12 else "", flush=True)
    subprocess.run(cmd, check=True)


def resolve(recipe: EngineRecipe, work: Path, reuse: bool = False) -> list[tuple[str, str]]:
    """The engine's full dependency closure for the device (name, version), nothing installed.

    With ``reuse``, a report resolved earlier for the same requirements is used again.
    """
    report = work / f"{recipe.name}-resolve.json"
    stamp = work / f"{recipe.name}-resolve.requirements"
    wanted = "\n".join(recipe.requirements)
    if reuse and report.exists() and stamp.exists() and stamp.read_text() == wanted:
        data = json.loads(report.read_text())
        return [(norm(item["metadata"]["name"]), item["metadata"]["version"]) for item in data["install"]]
    stamp.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as target:
        pip(
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            *TARGET_ARGS,
            "--target",
            target,
            "--report",
            str(report),
            *recipe.requirements,
        )
    stamp.write_text(wanted)
    data = json.loads(report.read_text())
    return [(norm(item["metadata"]["name"]), item["metadata"]["version"]) for item in data["install"]]


def select(recipe: EngineRecipe, closure: list[tuple[str, str]], image: set[str]) -> tuple[list[str], list[str]]:
    """Split the closure into (pins to bundle, names left out with the reason)."""
    bundle, left_out = [], []
    for name, version in closure:
        if name in recipe.drop:
            left_out.append(f"{name}=={version} (not needed to start/generate)")
        elif name in image and name not in recipe.keep:
            left_out.append(f"{name}=={version} (in the image)")
        else:
            bundle.append(f"{name}=={version}")
    return bundle, left_out


def download(pins: list[str], dest: Path) -> None:
    """Fetch exactly these wheels (no dependency resolution)."""
    dest.mkdir(parents=True, exist_ok=True)
    pip("download", "--no-deps", "--quiet", *TARGET_ARGS, "-d", str(dest), *pins)


def _record_name(names: list[str]) -> str:
    for n in names:
        if n.endswith(".dist-info/RECORD"):
            return n
    raise ValueError("wheel has no RECORD")


def prune_wheel(wheel: Path, patterns: tuple[str, ...]) -> list[str]:
    """Rewrite ``wheel`` in place without the members matching ``patterns``; return them.

    Kept members are copied byte for byte, so their RECORD hashes stay right; deleted members
    are removed from RECORD too, so the wheel stays valid for any installer.
    """
    with zipfile.ZipFile(wheel) as src:
        infos = src.infolist()
        removed = [i.filename for i in infos if any(fnmatch.fnmatch(i.filename, p) for p in patterns)]
        if not removed:
            return []
        gone = set(removed)
        record = _record_name([i.filename for i in infos])
        tmp = wheel.with_suffix(".pruning")
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as dst:
            for info in infos:
                if info.filename in gone:
                    continue
                if info.filename == record:
                    lines = src.read(record).decode().splitlines()
                    kept = [ln for ln in lines if ln.split(",", 1)[0] not in gone]
                    dst.writestr(info, "\n".join(kept) + "\n")
                else:
                    # copy the compressed stream as is (fast; no recompression of big .so files)
                    with src.open(info) as fin, dst.open(info, "w") as fout:
                        shutil.copyfileobj(fin, fout, 16 * MIB)
    tmp.replace(wheel)
    return removed


def sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(8 * MIB), b""):
            h.update(block)
    return h.hexdigest()


def split_into_parts(engine: str, wheel_dir: Path, parts_root: Path, part_bytes: int) -> dict[str, object]:
    """Cut wheels into pieces <= part_bytes, pack them first-fit-decreasing into part dirs."""
    for old in parts_root.glob(f"{engine}-part*"):
        shutil.rmtree(old)
    reserve = 64 * 1024  # room for the manifest copy in every part
    budget = part_bytes - reserve
    pieces: list[tuple[str, int, Path, int, int]] = []  # (piece name, size, source, offset, length)
    manifest: dict[str, object] = {"engine": engine, "wheels": {}}
    wheels_meta: dict[str, object] = {}
    for wheel in sorted(wheel_dir.glob("*.whl")):
        size = wheel.stat().st_size
        names = []
        if size <= budget:
            pieces.append((wheel.name, size, wheel, 0, size))
            names.append(wheel.name)
        else:
            for k, offset in enumerate(range(0, size, budget)):
                length = min(budget, size - offset)
                chunk = f"{wheel.name}.chunk{k:02d}"
                pieces.append((chunk, length, wheel, offset, length))
                names.append(chunk)
        wheels_meta[wheel.name] = {"sha256": sha256(wheel), "bytes": size, "pieces": names}
    manifest["wheels"] = wheels_meta

    bins: list[list[tuple[str, int, Path, int, int]]] = []
    fill: list[int] = []
    for piece in sorted(pieces, key=lambda p: -p[1]):
        for i, used in enumerate(fill):
            if used + piece[1] <= budget:
                bins[i].append(piece)
                fill[i] += piece[1]
                break
        else:
            bins.append([piece])
            fill.append(piece[1])

    part_names = [f"{engine}-part{i + 1:02d}" for i in range(len(bins))]
    manifest["parts"] = {name: sorted(p[0] for p in b) for name, b in zip(part_names, bins, strict=True)}
    for name, content in zip(part_names, bins, strict=True):
        out = parts_root / name / engine
        out.mkdir(parents=True)
        for piece_name, _, source, offset, length in content:
            with source.open("rb") as fin, (out / piece_name).open("wb") as fout:
                fin.seek(offset)
                remaining = length
                while remaining:
                    block = fin.read(min(8 * MIB, remaining))
                    fout.write(block)
                    remaining -= len(block)
        (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def dir_bytes(path: Path) -> int:
    """Total size of the files under path."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build(recipe: EngineRecipe, out: Path, image: set[str], part_mib: int, reuse: bool) -> dict[str, object]:
    """Resolve, select, download, prune and split one engine's bundle; return a summary."""
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    wheel_dir = out / "wheels" / recipe.name
    closure = resolve(recipe, work, reuse)
    bundle, left_out = select(recipe, closure, image)
    if wheel_dir.exists() and not reuse:
        shutil.rmtree(wheel_dir)
    wanted = set(bundle)
    if wheel_dir.exists():  # --reuse: drop wheels no longer wanted, fetch only what is missing
        have = {}
        for w in wheel_dir.glob("*.whl"):
            parts = w.name.split("-")
            have[f"{norm(parts[0])}=={parts[1]}"] = w
        for pin, w in have.items():
            if pin not in wanted:
                w.unlink()
        missing = sorted(wanted - set(have))
    else:
        missing = sorted(wanted)
    if missing:
        download(missing, wheel_dir)
    raw_bytes = dir_bytes(wheel_dir)
    pruned: dict[str, list[str]] = {}
    for rule in recipe.prune:
        for wheel in wheel_dir.glob(f"{rule.package.replace('-', '_')}-*.whl"):
            before = wheel.stat().st_size
            removed = prune_wheel(wheel, rule.patterns)
            pruned[wheel.name] = removed
            after = wheel.stat().st_size
            print(f"pruned {wheel.name}: {before / MIB:.1f} -> {after / MIB:.1f} MiB, {len(removed)} files")
    manifest = split_into_parts(recipe.name, wheel_dir, out / "parts", part_mib * MIB)
    part_map = manifest["parts"]
    assert isinstance(part_map, dict)
    summary: dict[str, object] = {
        "engine": recipe.name,
        "requirements": recipe.requirements,
        "wheels": len(bundle),
        "downloaded_mib": round(raw_bytes / MIB, 1),
        "bundle_mib": round(dir_bytes(wheel_dir) / MIB, 1),
        "parts": {name: round(dir_bytes(out / "parts" / name) / MIB, 1) for name in part_map},
        "bundled": sorted(bundle),
        "left_out": sorted(left_out),
        "pruned": pruned,
    }
    (out / f"{recipe.name}-summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # checked by hand: Python 3.11's argparse tests a nargs="*" default (even []) against choices
    parser.add_argument("engines", nargs="*", metavar="ENGINE", help=f"among {sorted(RECIPES)} (default: all)")
    parser.add_argument("--out", type=Path, default=REPO / ".gpu")
    parser.add_argument("--part-mib", type=int, default=58, help="max MiB per part (a run carries <= 64 MiB)")
    parser.add_argument("--image-packages", type=Path, default=REPO / "dev" / "gpu" / "image_packages.txt")
    parser.add_argument("--reuse", action="store_true", help="keep already downloaded wheels")
    parser.add_argument("--with-toolchain", action="store_true", help="bundle the CUDA compiler wheels too")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.engines) - set(RECIPES))
    if unknown:
        parser.error(f"unknown engine(s) {unknown}; choose from {sorted(RECIPES)}")
    image = image_packages(args.image_packages)
    for engine in args.engines or sorted(RECIPES):
        recipe = RECIPES[engine]
        if not args.with_toolchain:
            recipe.drop |= TOOLCHAIN
        s = build(recipe, args.out, image, args.part_mib, args.reuse)
        print(
            f"{engine}: {s['wheels']} wheels, downloaded {s['downloaded_mib']} MiB, "
            f"bundle {s['bundle_mib']} MiB in {len(s['parts'])} parts"  # type: ignore[arg-type]
        )
        for name, mib in s["parts"].items():  # type: ignore[attr-defined]
            print(f"  {name}: {mib} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
