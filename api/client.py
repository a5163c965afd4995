"""The SDK's former import path: ``from phloem.api.client import Client`` keeps working for one
release, with a ``DeprecationWarning``. Import from ``phloem.api`` instead (docs/sdk.md)."""

import warnings

from phloem.api.sdk import *  # noqa: F403
from phloem.api.sdk import __all__ as __all__

warnings.warn("phloem.api.client is deprecated: import the SDK from phloem.api "
              "(from phloem.api import Client)", DeprecationWarning, stacklevel=2)
