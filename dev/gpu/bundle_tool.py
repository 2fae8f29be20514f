"""Device-side helpers for the staged wheel bundles (stdlib only; runs under the image's python3).

    python3 dev/gpu/bundle_tool.py status   --stage /tmp/gpu_stage [ENGINE ...]
    python3 dev/gpu/bundle_tool.py assemble --stage /tmp/gpu_stage ENGINE   # join chunks, check sha256
    python3 dev/gpu/bundle_tool.py pythonpath SITE_DIR                     # SITE_DIR + its .pth dirs

``status`` says, per engine, which parts are still to be staged. ``assemble`` leaves only whole,
verified wheels in ``STAGE/ENGINE/wheels/`` and exits 1 (naming the missing parts) if any piece is
missing or any hash is wrong. ``pythonpath`` exists because a ``--target`` install is put on
``PYTHONPATH``, where Python does not read ``.pth`` files (nvidia-cutlass-dsl relies on one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path


def load_manifest(engine_dir: Path) -> dict[str, object]:
    """The bundle manifest that every part of the engine carries."""
    path = engine_dir / "MANIFEST.json"
    if not path.exists():
        raise SystemExit(f"bundle: nothing staged for {engine_dir.name} ({path} missing)")
    data: dict[str, object] = json.loads(path.read_text())
    return data


def missing_parts(engine_dir: Path, manifest: dict[str, object]) -> list[str]:
    """Parts that hold at least one piece not yet staged (assembled wheels count as staged)."""
    wheels = manifest["wheels"]
    parts = manifest["parts"]
    assert isinstance(wheels, dict) and isinstance(parts, dict)
    done = {p.name for p in (engine_dir / "wheels").glob("*.whl")}
    staged = {p.name for p in engine_dir.iterdir()}
    missing = []
    for part, pieces in parts.items():
        for piece in pieces:
            wheel = piece.split(".whl", 1)[0] + ".whl"
            if piece not in staged and wheel not in done:
                missing.append(part)
                break
    return missing


def sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cmd_status(stage: Path, engines: list[str]) -> int:
    """Print what is staged; return 0 when every named engine is complete."""
    engines = engines or sorted(p.name for p in stage.iterdir() if (p / "MANIFEST.json").exists())
    rc = 0
    for engine in engines:
        engine_dir = stage / engine
        if not (engine_dir / "MANIFEST.json").exists():
            print(f"{engine}: nothing staged")
            rc = 1
            continue
        manifest = load_manifest(engine_dir)
        parts = manifest["parts"]
        assert isinstance(parts, dict)
        missing = missing_parts(engine_dir, manifest)
        print(
            f"{engine}: {len(parts) - len(missing)}/{len(parts)} parts staged"
            + (f"; missing {missing}" if missing else "; complete")
        )
        rc = rc or (1 if missing else 0)
    return rc


def cmd_assemble(stage: Path, engine: str) -> int:
    """Join chunked wheels, verify every wheel's sha256, move wheels into ENGINE/wheels/."""
    engine_dir = stage / engine
    manifest = load_manifest(engine_dir)
    missing = missing_parts(engine_dir, manifest)
    if missing:
        print(f"{engine}: cannot assemble, parts not staged yet: {missing}", file=sys.stderr)
        return 1
    out = engine_dir / "wheels"
    out.mkdir(exist_ok=True)
    wheels = manifest["wheels"]
    assert isinstance(wheels, dict)
    bad = []
    for name, meta in wheels.items():
        target = out / name
        if not target.exists():
            tmp = out / (name + ".tmp")
            with tmp.open("wb") as fout:
                for piece in meta["pieces"]:
                    with (engine_dir / piece).open("rb") as fin:
                        while block := fin.read(8 << 20):
                            fout.write(block)
            tmp.replace(target)
            for piece in meta["pieces"]:
                (engine_dir / piece).unlink()
        if target.stat().st_size != meta["bytes"] or sha256(target) != meta["sha256"]:
            bad.append(name)
            target.unlink()
    if bad:
        print(f"{engine}: corrupt wheels removed, stage their parts again: {bad}", file=sys.stderr)
        return 1
    total = sum(int(m["bytes"]) for m in wheels.values())
    print(f"{engine}: {len(wheels)} wheels verified ({total / (1 << 20):.1f} MiB) in {out}")
    return 0


# ``import ...; sys.path.insert(0, os.path.join(PKG.__path__[0], 'SUB'))`` (nvidia-cutlass-dsl)
_PTH_JOIN = re.compile(r"os\.path\.join\(\s*(\w+)\.__path__\[0\]\s*,\s*['\"]([^'\"]+)['\"]\s*\)")


def pth_dirs(site: Path) -> list[Path]:
    """Directories that SITE's .pth files would add to sys.path (without executing them).

    Plain path lines are taken as they are; import lines are understood only in the
    ``os.path.join(PKG.__path__[0], 'SUB')`` form, resolved to ``SITE/PKG/SUB``.
    """
    found: list[Path] = []
    for pth in sorted(site.glob("*.pth")):
        for raw in pth.read_text().splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith(("import ", "import\t")):
                found += [site / pkg / sub for pkg, sub in _PTH_JOIN.findall(line)]
            else:
                found.append(site / line)
    return [p.resolve() for p in found if p.is_dir()]


def cmd_pythonpath(site: Path) -> int:
    """Print SITE plus the directories its .pth files name."""
    entries = [str(site)]
    for path in pth_dirs(site):
        if str(path) not in entries:
            entries.append(str(path))
    print(":".join(entries))
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("status")
    p.add_argument("--stage", type=Path, default=Path("/tmp/gpu_stage"))
    p.add_argument("engines", nargs="*")
    p = sub.add_parser("assemble")
    p.add_argument("--stage", type=Path, default=Path("/tmp/gpu_stage"))
    p.add_argument("engine")
    p = sub.add_parser("pythonpath")
    p.add_argument("site", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "status":
        return cmd_status(args.stage, args.engines)
    if args.cmd == "assemble":
        return cmd_assemble(args.stage, args.engine)
    return cmd_pythonpath(args.site)


if __name__ == "__main__":
    sys.exit(main())
