"""The restricted unpickler admits plain data and allow-listed globals only, naming whatever it refuses."""

import collections
import os
import pickle

import pytest

from engine.weights.safe_pickle import PLAIN_DATA, UnsafePickleError, restricted_loads

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_plain_data_round_trips(protocol):
    value = {"a": [1, 2.5, None, True], "b": (b"\x00\xff", "text"), "c": {3, 4},
             "d": collections.OrderedDict(x=1), "e": bytearray(b"zz")}
    assert restricted_loads(pickle.dumps(value, protocol=protocol)) == value


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_any_other_global_is_refused_by_name():
    with pytest.raises(UnsafePickleError) as e:
        restricted_loads(pickle.dumps(_Evil()), what="ipc_handles_pickled")
    assert e.value.global_name in ("posix.system", "os.system")
    assert "ipc_handles_pickled" in str(e.value) and "system" in str(e.value)


def test_allow_list_extends_plain_data():
    allowed = PLAIN_DATA | {("collections", "Counter")}
    assert PLAIN_DATA < allowed
    assert restricted_loads(pickle.dumps(collections.Counter("aab")), allowed) == collections.Counter("aab")
    with pytest.raises(UnsafePickleError):
        restricted_loads(pickle.dumps(collections.Counter("aab")))


@pytest.mark.parametrize("data", [b"", b"\x80\x04garbage", b"not a pickle"])
def test_malformed_input_raises_an_unpickling_error(data):
    with pytest.raises((pickle.UnpicklingError, EOFError, ValueError, KeyError)):
        restricted_loads(data)


def test_non_bytes_is_refused():
    with pytest.raises(pickle.UnpicklingError):
        restricted_loads("a string")  # type: ignore[arg-type]
