"""A restricted unpickler for the pickled formats of vLLM's trainer-side code, and nothing else.

rollbus never pickles on its own wires, but real trainers send two vLLM formats that are pickles: the IPC
handles of ``/update_weights`` (``ipc_handles_pickled``, behind ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``)
and what ``StatelessProcessGroup.broadcast_obj`` puts into the TCPStore at a collective rendezvous.
:func:`restricted_loads` resolves a global only when it is on the caller's allow-list, a set of
``(module, qualname)`` pairs or a mapping from them to an inert stand-in to hand the pickle instead (the
named module is then never imported); anything else is an :class:`UnsafePickleError` naming the global,
raised before anything is called.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle
from collections.abc import Callable, Mapping
from typing import Any

# Globals that plain-data pickles may name (protocol 0/1 pickles and some containers); protocol 2+ pickles
# of ints, floats, str, bytes, lists, tuples, dicts and None name none.
PLAIN_DATA: frozenset[tuple[str, str]] = frozenset({
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytearray"), ("builtins", "complex"),
    ("builtins", "slice"), ("builtins", "range"), ("collections", "OrderedDict"),
    ("_codecs", "encode"),  # protocol < 3 pickles write bytes through it
})


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle names a global outside the allow-list (the attribute ``global_name`` says which)."""

    def __init__(self, global_name: str, what: str):
        self.global_name = global_name
        super().__init__(f"{what}: refused to unpickle global {global_name!r} (not on the allow-list)")


class _Restricted(pickle.Unpickler):
    def __init__(self, stream: io.BytesIO, allowed: Any, what: str, persistent: Callable[[Any], Any] | None):
        super().__init__(stream)
        self._allowed, self._what, self._persistent = allowed, what, persistent

    def find_class(self, module: str, name: str) -> Any:
        # Python 2 names (protocol < 3 pickles), mapped as pickle's fix_imports does
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) not in self._allowed:
            raise UnsafePickleError(f"{module}.{name}", self._what)
        stand_in = self._allowed.get((module, name)) if isinstance(self._allowed, Mapping) else None
        return stand_in if stand_in is not None else super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise pickle.UnpicklingError(f"{self._what}: persistent ids are not allowed")
        return self._persistent(pid)


def restricted_loads(data: bytes | bytearray | memoryview | io.BytesIO,
                     allowed: frozenset[tuple[str, str]] | Mapping[tuple[str, str], Any] = PLAIN_DATA,
                     what: str = "pickle", persistent_load: Callable[[Any], Any] | None = None) -> Any:
    """Unpickle `data` (or the next pickle of a BytesIO stream), resolving only the allowed globals (in a
    mapping, a None value means the real global). Raises UnsafePickleError (naming the global) or
    pickle.UnpicklingError / EOFError / ValueError on malformed input; `what` prefixes the message.
    Persistent ids are refused unless `persistent_load` (which sees the id, built from allowed parts) is given."""
    if isinstance(data, bytes | bytearray | memoryview):
        data = io.BytesIO(bytes(data))
    elif not isinstance(data, io.BytesIO):
        raise pickle.UnpicklingError(f"{what}: expected bytes, got {type(data).__name__}")
    return _Restricted(data, allowed, what, persistent_load).load()
