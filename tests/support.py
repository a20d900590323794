"""Helpers shared by the tests: arrays from other libraries, and writing into results that may be read-only."""

import numpy as np
import pytest


def overwrite(array: np.ndarray, value) -> bool:
    """Writes `value` into every element; False when the array is read-only (immutable, like a tensor)."""
    if not array.flags.writeable:
        with pytest.raises(ValueError):
            array[...] = value
        return False
    array[...] = value
    return True


class DLPackOnly:
    """An array from another library that exports itself only through DLPack."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()
