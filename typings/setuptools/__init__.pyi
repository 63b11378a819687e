# Only the names setup.py uses.
from typing import Any

class Extension:
    def __init__(self, name: str, sources: list[str], *, extra_compile_args: list[str] = ...,
                 optional: bool = ..., **attributes: Any) -> None: ...

def setup(**attributes: Any) -> Any: ...
