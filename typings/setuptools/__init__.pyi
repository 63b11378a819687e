# Only the names setup.py calls.
from typing import Any

def setup(**attributes: Any) -> Any: ...
