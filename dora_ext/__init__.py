"""dora-ext: multi-version streaming rollout, complete-group pipelining and staleness-aware
sampling for verl and slime. The scheduler is `dora_ext.core.Scheduler`."""

from .config import MODES, ConfigError, DoraConfig
from .hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["MODES", "ConfigError", "DoraConfig", "hookimpl", "__version__"]
