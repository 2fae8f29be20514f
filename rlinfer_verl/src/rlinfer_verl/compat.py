"""The verl versions this plugin supports, checked at import with an error naming the range.

verl 0.9 is the first release that loads the ``verl.plugins`` entry points at ``import verl``
(``verl/__init__.py``) and the one whose rollout classes this plugin follows
(``verl/workers/rollout/replica.py``, ``base.py``). The installed version is read from the
package metadata, so the check imports nothing of verl (it runs while ``verl`` itself imports).
"""

from __future__ import annotations

from importlib import metadata

from packaging.version import Version

#: the verl releases rlinfer-verl supports (the pin in rlinfer_verl/pyproject.toml)
SUPPORTED_RANGE = ">=0.9,<0.10"


class UnsupportedVerlVersion(ImportError):
    """verl is missing or outside :data:`SUPPORTED_RANGE`."""


def check_verl_version(installed: str | None = None) -> str:
    """Return the installed verl version (or ``installed``, for tests) when it is in
    :data:`SUPPORTED_RANGE`; raise UnsupportedVerlVersion naming the range otherwise."""
    from packaging.specifiers import SpecifierSet

    if installed is None:
        try:
            installed = metadata.version("verl")
        except metadata.PackageNotFoundError:
            raise UnsupportedVerlVersion(
                f"rlinfer-verl needs verl{SUPPORTED_RANGE}, and verl is not installed "
                f"(pip install 'verl{SUPPORTED_RANGE}')"
            ) from None
    if Version(installed) not in SpecifierSet(SUPPORTED_RANGE):
        raise UnsupportedVerlVersion(
            f"rlinfer-verl supports verl{SUPPORTED_RANGE}; verl {installed} is installed "
            f"(pip install 'verl{SUPPORTED_RANGE}')"
        )
    return installed
