"""The packaged conformance suite. A backend adopts it with one test file::

from rlinfer_conformance.suite import *  # noqa: F403
"""

from rlinfer_conformance.suite.test_agent import *  # noqa: F403
from rlinfer_conformance.suite.test_architectures import *  # noqa: F403
from rlinfer_conformance.suite.test_control import *  # noqa: F403
from rlinfer_conformance.suite.test_deterministic import *  # noqa: F403
from rlinfer_conformance.suite.test_discard_weights import *  # noqa: F403
from rlinfer_conformance.suite.test_faults import *  # noqa: F403
from rlinfer_conformance.suite.test_fidelity import *  # noqa: F403
from rlinfer_conformance.suite.test_generate import *  # noqa: F403
from rlinfer_conformance.suite.test_hidden_states import *  # noqa: F403
from rlinfer_conformance.suite.test_invalid import *  # noqa: F403
from rlinfer_conformance.suite.test_lifecycle import *  # noqa: F403
from rlinfer_conformance.suite.test_memory import *  # noqa: F403
from rlinfer_conformance.suite.test_meta import *  # noqa: F403
from rlinfer_conformance.suite.test_multimodal import *  # noqa: F403
from rlinfer_conformance.suite.test_negative import *  # noqa: F403
from rlinfer_conformance.suite.test_out_of_memory import *  # noqa: F403
from rlinfer_conformance.suite.test_quantized_reload import *  # noqa: F403
from rlinfer_conformance.suite.test_routing import *  # noqa: F403
from rlinfer_conformance.suite.test_sampling_controls import *  # noqa: F403
from rlinfer_conformance.suite.test_staged_weights import *  # noqa: F403
from rlinfer_conformance.suite.test_start_without_weights import *  # noqa: F403
from rlinfer_conformance.suite.test_stateful import *  # noqa: F403
from rlinfer_conformance.suite.test_tool_loop import *  # noqa: F403
from rlinfer_conformance.suite.test_weights import *  # noqa: F403
from rlinfer_conformance.suite.test_weights_delta import *  # noqa: F403
