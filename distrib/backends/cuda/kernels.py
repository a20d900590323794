"""The kernels of kernels/*.cu: their launch tables (pure), and their launches through CuPy's RawModule.

- `pack_w<W>` / `unpack_w<W>` (pack.cu) gather the members of a pack into its flat buffer, or scatter the flat
  buffer into the members, in one launch, moving W-byte words (W = 1, 2, 4, 8 or 16).
- `reduce_<type>` (reduce.cu) sums same-device arrays in order into one or more outputs and divides for a mean.
- `<rule>_<dtype>` (optimizer.cu) applies an optimizer's update to every same-device tensor of one dtype in one
  launch: rule "sgd", "momentum", "nesterov" or "adam" over float16, float32 or float64 parameters.

The sources live in the top-level kernels/ folder, ship inside the wheel as the package distrib.kernels, and
compile with NVRTC on first use, once per device (CuPy caches the binaries on disk).
"""

from __future__ import annotations

import importlib.resources
import operator
import re
import threading
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np

from distrib.plan import dtype_name

SOURCES = importlib.resources.files("distrib.kernels")  # kernels/ in a checkout, distrib/kernels/ when installed
OPTIONS = ("--std=c++17",)
BLOCK = 256
MAX_BLOCKS = 8192  # grid-stride loops cover the rest; more blocks only add scheduling work
WORD_SIZES = (16, 8, 4, 2, 1)
WORDS_PER_THREAD = 8  # pack.cu's kWordsPerThread: each block moves tiles of BLOCK * WORDS_PER_THREAD words
UPDATE_SLOTS = {"sgd": 0, "momentum": 1, "nesterov": 1, "adam": 2}  # optimizer.cu's rules and their slot counts
UPDATE_DTYPES = {"float16": "float32", "float32": "float32", "float64": "float64"}  # parameter -> math dtype


_INCLUDE = re.compile(r'^#include "([\w.]+)"$', re.MULTILINE)


def source(name: str) -> str:
    """The CUDA C source of `name` (e.g. "pack.cu"), with its local `#include "x.cuh"` lines inlined.

    Inlining keeps NVRTC free of include paths, which would have to point into the installed package.
    """
    return _INCLUDE.sub(lambda match: source(match.group(1)), (SOURCES / name).read_text())


def blocks(count: int) -> int:
    """Blocks of BLOCK threads for a grid-stride loop over `count` items."""
    return max(1, min(MAX_BLOCKS, -(-count // BLOCK)))


def word_size(addresses: Iterable[int]) -> int:
    """The widest word of WORD_SIZES bytes that divides every address (or byte offset) given.

    Example:
      >>> word_size([0x7f0000000200, 4000, 8000])
      16
      >>> word_size([0x7f0000000200, 4002])
      2
    """
    return _widest_word(int(np.bitwise_or.reduce(np.fromiter(addresses, np.int64), initial=0)))


def _widest_word(combined: int) -> int:
    """The widest of WORD_SIZES dividing every address whose bits OR to `combined`: its lowest set bit, at most."""
    width = WORD_SIZES[0]
    while combined % width:
        width //= 2
    return width


def move_table(member_pointers: Sequence[int], member_nbytes: Sequence[int],
               flat_pointer: int) -> tuple[int, np.ndarray]:
    """The word size and int64 table of a pack or unpack launch: member pointers, then word offsets.

    Member m owns words [offsets[m], offsets[m + 1]) of the flat buffer; the table's offsets run from 0 to
    the total word count, so the kernel reads the total as `offsets[count]`.

    Example:
      >>> width, table = move_table([0x1000, 0x2000], [12, 4], 0x3000)
      >>> width, table.tolist()
      (4, [4096, 8192, 0, 3, 4])
    """
    byte_offsets = np.zeros(len(member_nbytes) + 1, np.int64)
    np.cumsum(member_nbytes, out=byte_offsets[1:])
    pointers = np.asarray(member_pointers, np.int64)
    combined = flat_pointer | int(np.bitwise_or.reduce(pointers, initial=0) | np.bitwise_or.reduce(byte_offsets))
    width = _widest_word(combined)  # one OR over every address: a Python loop over 1,000 members cost ~100 us
    return width, np.concatenate([pointers, byte_offsets // width])


def check_aligned(kernel: str, pointers: np.ndarray, width: int, unit: str = "elements") -> None:
    """Raises ValueError unless every address in `pointers` is a multiple of `width`, the kernel's element size.

    Every kernel reads each type at its own size, and reduce.cu's Pair<T> is aligned to both parts (one wide load
    per complex value): a misaligned read is a sticky CUDA error that ends the context, so it is refused here.

    Example:
      >>> check_aligned("reduce_complex64", np.array([0x1000, 0x2008]), 8, "(real, imaginary) pairs")
    """
    combined = int(np.bitwise_or.reduce(pointers, initial=0))
    if combined % width:
        bad = next(int(p) for p in pointers if p % width)
        raise ValueError(f"{kernel} reads {unit} aligned to {width} bytes. Received: an array at {bad:#x}, off "
                         f"that alignment (a view of other memory?); pass a copy.")


def update_kernel(rule: str, dtype: str) -> str:
    """The optimizer.cu kernel applying `rule` to parameters of `dtype` (a key of UPDATE_SLOTS, UPDATE_DTYPES)."""
    return f"{rule}_{dtype}"


def update_groups(keys: Sequence[Any]) -> dict[Any, list[int]]:
    """The positions of the tensors each optimizer launch updates: one launch per key (device, dtype), in order.

    Example:
      >>> update_groups([(0, "float32"), (0, "float16"), (0, "float32")])
      {(0, 'float32'): [0, 2], (0, 'float16'): [1]}
    """
    groups: dict[Any, list[int]] = {}
    for position, key in enumerate(keys):
        groups.setdefault(key, []).append(position)
    return groups


def update_table(params: Sequence[int], grads: Sequence[int], slots: Sequence[Sequence[int]],
                 sizes: Sequence[int]) -> np.ndarray:
    """The int64 table of an optimizer launch: parameter, gradient and slot pointers, then element offsets.

    `slots[t]` holds tensor t's slot pointers; the table lists them slot by slot (every tensor's first slot, then
    every tensor's second), and tensor t owns elements [offsets[t], offsets[t + 1]).

    Example:
      >>> update_table([0x10, 0x20], [0x30, 0x40], [(0x50, 0x70), (0x60, 0x80)], [3, 5]).tolist()
      [16, 32, 48, 64, 80, 96, 112, 128, 0, 3, 8]
    """
    offsets = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    by_slot = np.asarray(slots, np.int64).reshape(len(sizes), -1).T.ravel()
    return np.concatenate([np.asarray(params, np.int64), np.asarray(grads, np.int64), by_slot, offsets])


_POINTER, _NBYTES = operator.attrgetter("data.ptr"), operator.attrgetter("nbytes")  # C-level, per member


class MoveLaunch(NamedTuple):
    """A pack or unpack launch ready to go, its table on the device (Kernels.prepare_move); call it to launch it on
    the current stream."""

    kernel: Any
    grid: int
    args: tuple  # (the flat's address, the table on the device, member count)

    def __call__(self) -> None:
        self.kernel((self.grid,), (BLOCK,), self.args)


class Kernels:
    """Compiled kernels, launched on the current device and stream."""

    def __init__(self):
        self._modules: dict[str, Any] = {}
        self._functions: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    def function(self, file: str, name: str) -> Any:
        """The RawKernel `name` of `file`; CuPy compiles it for each device on its first launch there."""
        function = self._functions.get((file, name))
        if function is None:
            import cupy

            with self._lock:
                module = self._modules.get(file)
                if module is None:
                    module = self._modules[file] = cupy.RawModule(code=source(file), options=OPTIONS)
                function = self._functions[(file, name)] = module.get_function(name)
        return function

    def move(self, flat: Any, members: Sequence[Any], pack: bool) -> None:
        """Copies contiguous `members` into `flat` in order (pack) or `flat` into them (unpack): one launch."""
        launch = self.prepare_move(flat, members, pack)
        if launch is not None:
            launch()

    def prepare_move(self, flat: Any, members: Sequence[Any], pack: bool) -> "MoveLaunch | None":
        """The launch that `move` makes, with its table already on the device, to make again while `flat` and
        `members` keep their memory (reused unpack outputs): None when there is nothing to move. Building the table
        costs Python per member, which for 1,000 small members takes longer than the kernel."""
        import cupy

        count = len(members)
        pointers = np.fromiter(map(_POINTER, members), np.int64, count)
        width, table = move_table(pointers, np.fromiter(map(_NBYTES, members), np.int64, count), flat.data.ptr)
        words = int(table[-1])
        if not words:
            return None
        kernel = self.function("pack.cu", f"{'pack' if pack else 'unpack'}_w{width}")
        # the flat by address: a launch kept with reused outputs must not hold a reference that keeps them from idling
        return MoveLaunch(kernel, blocks(-(-words // WORDS_PER_THREAD)),
                          (np.uint64(flat.data.ptr), cupy.asarray(table), np.int32(count)))

    def reduce(self, wire: str, count: int, sources: Sequence[Any], outputs: Sequence[Any], divisor: int = 1) -> None:
        """outputs[k][:count] = sum of sources[j][:count] in order (in `wire` type elements), divided by `divisor`.

        Raises:
          ValueError: an array's address is not a multiple of its itemsize (arrays.aligned makes one that is).
        """
        import cupy

        if count:
            table = np.array([a.data.ptr for a in (*sources, *outputs)], np.int64)
            unit = "(real, imaginary) pairs" if wire.startswith("complex") else "elements"
            check_aligned(f"reduce_{wire}", table, sources[0].dtype.itemsize, unit)
            kernel = self.function("reduce.cu", f"reduce_{wire}")
            kernel((blocks(count),), (BLOCK,), (cupy.asarray(table), np.int32(len(sources)),
                                                 np.int32(len(outputs)), np.int64(count), np.int32(divisor)))

    def update(self, rule: str, params: Sequence[Any], grads: Sequence[Any], slots: Sequence[Sequence[Any]],
               coefficients: Sequence[Any]) -> None:
        """Applies `rule` in place to contiguous params of one dtype and their slots (math dtype): one launch.

        Raises:
          ValueError: an array's address is not a multiple of its itemsize (a gradient viewed from other memory).
        """
        import cupy

        dtype = dtype_name(params[0].dtype)
        table = update_table([p.data.ptr for p in params], [g.data.ptr for g in grads],
                             [[s.data.ptr for s in tensor_slots] for tensor_slots in slots], [p.size for p in params])
        total = int(table[-1])
        if total:
            math = np.dtype(UPDATE_DTYPES[dtype]).type
            name, count = update_kernel(rule, dtype), len(params)
            check_aligned(name, table[:count], params[0].dtype.itemsize)
            check_aligned(name, table[count:count * (2 + UPDATE_SLOTS[rule])], np.dtype(math).itemsize)
            kernel = self.function("optimizer.cu", name)
            kernel((blocks(total),), (BLOCK,), (cupy.asarray(table), np.int32(len(params)),
                                                 *(math(c) for c in coefficients)))
