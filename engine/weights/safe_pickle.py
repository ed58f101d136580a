"""A restricted unpickler for the pickled formats of vLLM's trainer-side code, and nothing else.

rollbus never pickles on its own wires. Two vLLM formats are pickles, and real trainers send them:
the IPC handles of ``/update_weights`` (``ipc_handles_pickled``, behind vLLM's opt-in variable
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``) and the small objects ``StatelessProcessGroup.broadcast_obj``
puts into the TCPStore during a collective rendezvous. Plain ``pickle.loads`` runs whatever callable a
pickle names; :func:`restricted_loads` resolves a global only when it is on the caller's allow-list and
refuses anything else with :class:`UnsafePickleError` naming the global, before anything is called.

An allow-list is a set of ``(module, qualname)`` pairs, or a mapping from such pairs to the object to hand
the pickle instead of importing the real one (an inert stand-in, so that a caller can check what a pickle
asks for before anything runs). :data:`PLAIN_DATA` admits only what the standard
containers need (nothing: ints, floats, str, bytes, lists, tuples, dicts, sets and None need no global
in protocol 2+ pickles, except the few below).
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle
from collections.abc import Callable, Iterable, Mapping
from typing import Any

# Globals that plain-data pickles may name (protocol 0/1 pickles and some containers).
PLAIN_DATA: frozenset[tuple[str, str]] = frozenset({
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "bytearray"),
    ("builtins", "complex"),
    ("builtins", "slice"),
    ("builtins", "range"),
    ("collections", "OrderedDict"),
    ("_codecs", "encode"),  # protocol < 3 pickles write bytes through it
})


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle names a global outside the allow-list (the attribute ``global_name`` says which)."""

    def __init__(self, global_name: str, what: str):
        self.global_name = global_name
        super().__init__(f"{what}: refused to unpickle global {global_name!r} (not on the allow-list)")


class _Restricted(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: frozenset[tuple[str, str]] | Mapping[tuple[str, str], Any], what: str,
                 persistent_load: Callable[[Any], Any] | None = None):
        super().__init__(io.BytesIO(data))
        self._allowed = allowed
        self._what = what
        self._persistent = persistent_load

    def find_class(self, module: str, name: str) -> Any:
        # Python 2 names (protocol < 3 pickles), mapped as pickle's own fix_imports does; no Python 3
        # module carries these names.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) not in self._allowed:
            raise UnsafePickleError(f"{module}.{name}", self._what)
        stand_in = self._allowed.get((module, name)) if isinstance(self._allowed, Mapping) else None
        if stand_in is not None:
            return stand_in  # the caller's stand-in; the named module is never imported
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is not None:
            return self._persistent(pid)
        raise pickle.UnpicklingError(f"{self._what}: persistent ids are not allowed")


def allow(*extra: Iterable[tuple[str, str]] | tuple[str, str]) -> frozenset[tuple[str, str]]:
    """PLAIN_DATA plus the given (module, qualname) pairs or iterables of them."""
    out = set(PLAIN_DATA)
    for item in extra:
        if isinstance(item, tuple) and len(item) == 2 and all(isinstance(x, str) for x in item):
            out.add(item)  # type: ignore[arg-type]
        else:
            out.update(item)  # type: ignore[arg-type]
    return frozenset(out)


def restricted_loads(data: bytes | bytearray | memoryview,
                     allowed: frozenset[tuple[str, str]] | Mapping[tuple[str, str], Any] = PLAIN_DATA,
                     what: str = "pickle", persistent_load: Callable[[Any], Any] | None = None) -> Any:
    """Unpickle `data`, resolving only the allowed globals. Raises UnsafePickleError (naming the global)
    or pickle.UnpicklingError / EOFError / ValueError on malformed input; `what` prefixes the message.
    Persistent ids are refused unless `persistent_load` (which sees the id, already built from allowed
    parts only) is given.

    Stand-ins: `allowed` given as a mapping resolves each allowed global to its value (None: the real
    global); the named module is then never imported. For types of packages this process does not have
    (vLLM's ``ncclUniqueId`` in a pickle from a vLLM trainer) or an inert replacement of a callable
    (torch's rebuild functions in IPC handles)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise pickle.UnpicklingError(f"{what}: expected bytes, got {type(data).__name__}")
    return _Restricted(bytes(data), allowed, what, persistent_load).load()
