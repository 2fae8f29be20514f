"""Register the repo's rlinfer packages in a site dir without installing them (stdlib only).

On the device there is no network and no build backend (hatchling is not in the image), so an
editable install is impossible; the packages' sources are put on ``PYTHONPATH`` instead. That
alone registers no entry points, and rlinfer finds backends through the ``rlinfer.backends``
entry-point group and pytest finds the conformance kit through ``pytest11``. This script writes,
for each package, a minimal ``NAME-VERSION.dist-info`` (METADATA, entry_points.txt, INSTALLER,
RECORD) into SITE, read off the package's own pyproject.toml, plus ``SITE/bin/<script>`` wrappers
for ``[project.scripts]``.

    python3 dev/gpu/register_dists.py --site /tmp/vllm_site rlinfer_core conformance rlinfer_vllm
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def dist_info_name(name: str, version: str) -> str:
    """Wheel-style dist-info dir name (PEP 427 escaping)."""
    return f"{re.sub(r'[-_.]+', '_', name)}-{version}.dist-info"


def register(package_dir: Path, site: Path) -> list[str]:
    """Write the dist-info (and script wrappers) for one package; return what was written."""
    project = tomllib.loads((package_dir / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    for old in site.glob(f"{re.sub(r'[-_.]+', '_', name)}-*.dist-info"):
        shutil.rmtree(old)
    info = site / dist_info_name(name, version)
    info.mkdir(parents=True)
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Summary: {project.get('description', '')}", f"Requires-Python: {project.get('requires-python', '')}"]
    meta += [f"Requires-Dist: {req}" for req in project.get("dependencies", [])]
    (info / "METADATA").write_text("\n".join(meta) + "\n")
    groups = dict(project.get("entry-points", {}))
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    lines = []
    for group, entries in groups.items():
        lines.append(f"[{group}]")
        lines += [f"{key} = {value}" for key, value in entries.items()]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    (info / "INSTALLER").write_text("rlinfer-gpu-register\n")
    (info / "RECORD").write_text("")
    written = [str(info)]
    for script, target in project.get("scripts", {}).items():
        module, _, func = target.partition(":")
        path = site / "bin" / script
        path.parent.mkdir(exist_ok=True)
        path.write_text(
            f"#!/usr/bin/env python3\nimport sys\nfrom {module} import {func}\n\n"
            f"if __name__ == '__main__':  # engines spawn processes that re-import this file\n"
            f"    sys.exit({func}())\n"
        )
        path.chmod(0o755)
        written.append(str(path))
    return written


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--site", type=Path, required=True, help="the --target dir that is on PYTHONPATH")
    parser.add_argument("packages", nargs="+", help="package folders of the repo, e.g. rlinfer_core rlinfer_vllm")
    args = parser.parse_args(argv)
    args.site.mkdir(parents=True, exist_ok=True)
    for package in args.packages:
        for path in register(REPO / package, args.site):
            print("registered", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
