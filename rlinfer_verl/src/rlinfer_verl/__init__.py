"""rlinfer as a verl rollout: ``rollout.name: rlinfer`` runs verl's rollouts on rlinfer engines.

Installed next to verl 0.9 (:data:`rlinfer_verl.compat.SUPPORTED_RANGE`, checked here at import),
``import verl`` loads the ``verl.plugins`` entry point :func:`rlinfer_verl.plugin.register`. See
docs/verl.md.
"""

from __future__ import annotations

import logging

from rlinfer_verl.compat import SUPPORTED_RANGE, UnsupportedVerlVersion, check_verl_version

try:
    VERL_VERSION = check_verl_version()
except UnsupportedVerlVersion as _exc:
    # verl swallows a plugin's import error (logged at debug level): say it where users look
    logging.getLogger(__name__).error("%s", _exc)
    raise

__all__ = ["SUPPORTED_RANGE", "VERL_VERSION", "UnsupportedVerlVersion", "check_verl_version"]
