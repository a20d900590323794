"""A checkpoint's file: safetensors, the manifest and a SHA-256 in its header, written atomically, checked on read."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
from typing import Any

import numpy as np
import safetensors.numpy

from distrib.errors import CheckpointError
from distrib.file_paths import file_in_the_way, names_a_folder

# The header's `__metadata__` (strings only, as safetensors requires): FORMAT_KEY names the format, MANIFEST_KEY
# holds the manifest as JSON, CHECKSUM_KEY the SHA-256 of the manifest and every tensor's bytes in manifest order.
FORMAT = "distrib-checkpoint/2"
FORMAT_KEY, MANIFEST_KEY, CHECKSUM_KEY = "format", "distrib_manifest", "sha256"
_VERSION_1_MAGIC = b"distrib-checkpoint\n"

# The NumPy dtypes a safetensors file holds and safetensors.numpy reads back (bfloat16 through ml_dtypes).
_DTYPES = ("bool", "uint8", "int8", "uint16", "int16", "float16", "bfloat16", "uint32", "int32", "float32", "uint64",
           "int64", "float64")

# Temporaries: a folder ".<name>.<pid>.<8 hex>.tmp" beside the checkpoint (a long name is cut and given a
# digest), the file written inside it: safetensors writes a temporary of its own beside the file it is given,
# which a killed save would leave behind under a name of safetensors' choosing. Earlier versions wrote the file
# itself under that name; a stale one is removed as well.
_TEMPORARY_TAIL = len(".") + len(".4194304.") + 8 + len(".tmp")


def write(path: str | os.PathLike, arrays: dict[str, np.ndarray], manifest: dict) -> None:
    """Writes `arrays` (by key, in manifest order) and `manifest` to `path` atomically.

    The file is written in a temporary folder beside `path`, flushed to disk and renamed onto `path`, so a
    crash leaves the previous checkpoint intact; an exception leaves no temporary, and the temporaries that
    killed saves of `path` left behind (safetensors' own among them) are removed first. A path that cannot hold a file (a folder, under a
    file) is refused before anything is written; every OSError names `path`, never the temporary.
    """
    path = check_target(path)
    directory = os.path.dirname(path)
    manifest_json = json.dumps(manifest, sort_keys=True)
    digest = hashlib.sha256(manifest_json.encode())
    tensors = {}
    for key, array in arrays.items():
        _check_dtype(key, array.dtype)
        tensors[key] = np.asarray(array, dtype=array.dtype.newbyteorder("<"), order="C")
        digest.update(tensors[key].reshape(-1).view(np.uint8))
    metadata = {FORMAT_KEY: FORMAT, MANIFEST_KEY: manifest_json, CHECKSUM_KEY: digest.hexdigest()}
    try:
        os.makedirs(directory, exist_ok=True)
        remove_stale_temporaries(path)
    except OSError as exc:
        raise _write_error(exc, path) from exc
    scratch = os.path.join(directory, f"{_temporary_prefix(path)}{os.getpid()}.{secrets.token_hex(4)}.tmp")
    temporary = os.path.join(scratch, "checkpoint")
    created = False
    try:
        # created here first: an unwritable folder then fails as an OSError with its errno, where safetensors
        # raises its own error type naming a temporary of its own
        os.mkdir(scratch, 0o700)
        created = True
        os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        _save_file(tensors, temporary, metadata)
        os.chmod(temporary, _new_file_mode())  # safetensors makes its files owner-only
        file = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(file)
        finally:
            os.close(file)
        os.replace(temporary, path)
    except BaseException as exc:
        if created:
            shutil.rmtree(scratch, ignore_errors=True)
        if isinstance(exc, OSError):
            raise _write_error(exc, path) from exc
        raise
    shutil.rmtree(scratch, ignore_errors=True)
    with contextlib.suppress(OSError):  # makes the rename durable; not every system can open a folder
        folder = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def check_target(path: str | os.PathLike | bytes) -> str:
    """`path` as an absolute str, once it can name a checkpoint file: not a folder, nor under a file.

    Raises:
      TypeError: `path` is not a str, bytes or os.PathLike.
      IsADirectoryError, NotADirectoryError, FileExistsError (OSErrors): `path` is a folder (or ends in a
        separator), a file stands where a folder of it must be, or something other than a file is at `path`.
    """
    given = decode(path)
    absolute = os.path.abspath(given)
    if names_a_folder(given):
        raise _os_error(errno.EISDIR, f"A checkpoint's path must name a file, not a folder. Received: {given!r}.")
    if os.path.lexists(absolute) and not os.path.isfile(absolute):
        raise _os_error(errno.EEXIST, f"A checkpoint's path must name a regular file or nothing yet: the save "
                                      f"replaces it. Received: {given!r}, which is not a regular file.")
    folder = file_in_the_way(absolute)
    if folder is not None:
        raise _os_error(errno.ENOTDIR, f"A checkpoint's path must lie in a folder, and {folder!r} is a file. "
                                       f"Received: {given!r}.")
    return absolute


def decode(path: str | os.PathLike | bytes) -> str:
    """`path` as a str (bytes decoded as the file system does), or a TypeError."""
    try:
        return os.fsdecode(path)
    except TypeError:
        raise TypeError(f"A checkpoint's path must be a str, bytes or os.PathLike. Received: "
                        f"{type(path).__name__}.") from None


def _save_file(tensors: dict, filename: str, metadata: dict) -> None:
    """safetensors.numpy.save_file, its I/O errors raised as OSErrors (it raises its own type, errno in the text)."""
    try:
        safetensors.numpy.save_file(tensors, filename, metadata=metadata)
    except safetensors.SafetensorError as exc:
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None:
            raise
        raise _os_error(int(code.group(1)), os.strerror(int(code.group(1)))) from exc


def _write_error(exc: OSError, path: str) -> OSError:
    """`exc` as the same kind of OSError naming the checkpoint's path (not a temporary's) and why."""
    reason = exc.strerror or str(exc)
    where = os.fsdecode(exc.filename) if isinstance(exc.filename, (str, bytes)) else ""
    if where and path.startswith(where.rstrip(os.sep) + os.sep):
        reason += f": {where!r}"  # a folder of the path, which could not be made
    return _os_error(exc.errno, f"Checkpoint.save could not write the file. Received: {path!r} ({reason}).")


def _os_error(code: int | None, message: str) -> OSError:
    """The OSError subclass that errno `code` maps to (PermissionError for EACCES...), with `message` as its text."""
    kind = type(OSError(code, "")) if code is not None else OSError
    error = kind(message)
    error.errno = code
    return error


def _new_file_mode() -> int:
    """The mode `open()` gives a new file: 0o666 less the umask (read from /proc where it can be, since setting
    the umask to read it changes it for every thread meanwhile)."""
    try:
        with open("/proc/self/status") as status:
            umask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def remove_stale_temporaries(path: str | os.PathLike) -> list[str]:
    """Removes the temporaries of saves of `path` whose process is gone (killed mid-save), folders with what is in
    them; returns their paths."""
    path = os.path.abspath(os.fsdecode(path))
    pattern = re.compile(re.escape(_temporary_prefix(path)) + r"(\d+)\.[0-9a-f]{8}\.tmp")
    removed = []
    with os.scandir(os.path.dirname(path)) as entries:
        for entry in entries:
            match = pattern.fullmatch(entry.name)
            if match and not _process_alive(int(match.group(1))):
                with contextlib.suppress(FileNotFoundError):
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path)
                    else:
                        os.remove(entry.path)
                    removed.append(entry.path)
    return removed


def read(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """The manifest and the arrays by key of the checkpoint at `path`, once its format and checksum are verified."""
    path = decode(path)
    with open(path, "rb") as file:
        data = file.read()
    where = f"Checkpoint {path!r}"
    metadata, tensor_names = _header(data, where)
    try:
        loaded = safetensors.numpy.load(data)
    except Exception as exc:  # safetensors raises its own error type for every kind of damage
        raise CheckpointError(f"{where} is truncated or damaged: {exc}. Restore an earlier checkpoint.") from exc
    manifest_json, checksum = metadata.get(MANIFEST_KEY), metadata.get(CHECKSUM_KEY)
    if not isinstance(manifest_json, str) or not isinstance(checksum, str):
        raise CheckpointError(f"{where} is damaged: its header lacks the {MANIFEST_KEY!r} or {CHECKSUM_KEY!r} entry.")
    try:
        manifest = json.loads(manifest_json)
    except ValueError as exc:
        raise CheckpointError(f"{where} has an unreadable manifest: {exc}.") from exc
    entries = validate_manifest(manifest, where)
    if set(loaded) != {entry["key"] for entry in entries} or len(loaded) != len(entries):
        raise CheckpointError(f"{where} is damaged: its manifest lists {sorted(e['key'] for e in entries)} but the "
                              f"file holds the tensors {sorted(loaded)}.")
    digest = hashlib.sha256(manifest_json.encode())
    arrays = {}
    for entry in entries:
        array = arrays[entry["key"]] = np.asarray(loaded[entry["key"]], order="C")
        digest.update(array.reshape(-1).view(np.uint8))
    if digest.hexdigest() != checksum:
        raise CheckpointError(f"{where} is corrupted: its SHA-256 checksum does not match its contents. Restore an "
                              f"earlier checkpoint.")
    return manifest, arrays


def validate_manifest(manifest: Any, where: str) -> list[dict]:
    """The manifest's entries, once every field the restore reads has the right kind; else a CheckpointError."""
    def fail(rule: str, received: Any) -> CheckpointError:
        return CheckpointError(f"{where} has a malformed manifest: {rule}. Received: {received!r}.")

    if not isinstance(manifest, dict):
        raise fail("the manifest is a JSON object", type(manifest).__name__)
    entries, metadata = manifest.get("entries"), manifest.get("metadata")
    if not isinstance(entries, list):
        raise fail("'entries' is a list", entries)
    if not isinstance(metadata, dict) or not all(isinstance(v, dict) for v in metadata.values()):
        raise fail("'metadata' maps each Checkpoint's path to a dict", metadata)
    owners = manifest.get("owners", {})  # absent from the files of distrib versions that did not record it
    if not isinstance(owners, dict) or not all(isinstance(kind, str) for kind in owners.values()):
        raise fail("'owners' maps each owner's key to the name of its class", owners)
    fields = {"key": str, "variable": str, "aggregation": str, "owner": (str, type(None)), "name": (str, type(None))}
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise fail(f"entry {index} is a JSON object", entry)
        for field, kind in fields.items():
            if not isinstance(entry.get(field), kind):
                raise fail(f"entry {index} has a {field!r} of type {_kind_name(kind)}", entry.get(field))
        if entry["owner"] is not None and entry["name"] is None:
            raise fail(f"entry {index} of owner {entry['owner']!r} has a 'name'", entry)
    return entries


def describe(data: bytes) -> str:
    """What the bytes of a file that is not a distrib checkpoint look like, for the error that refuses it."""
    if not data:
        return "an empty file"
    if data.startswith(_VERSION_1_MAGIC):
        return "a checkpoint in distrib's format 1 (written before checkpoints became safetensors files)"
    for magic, kind in ((b"PK\x03\x04", "a zip archive (a PyTorch .pt file or a NumPy .npz?)"),
                        (b"\x93NUMPY", "a NumPy .npy file"), (b"\x89HDF\r\n", "an HDF5 file (a Keras .h5?)"),
                        (b"\x80", "a Python pickle"), (b"\x1f\x8b", "a gzip file")):
        if data.startswith(magic):
            return kind
    return f"not a safetensors file (it starts with {data[:16]!r})"


# -- helpers ------------------------------------------------------------------------------------------------

def _header(data: bytes, where: str) -> tuple[dict, list[str]]:
    """The header's metadata and tensor names, once the bytes are a safetensors file of this format."""
    size = int.from_bytes(data[:8], "little") if len(data) >= 8 else None
    raw = data[8:8 + size] if size is not None else b""
    looks_like_ours = FORMAT.encode() in data[:4096] or data[8:9] == b"{"  # a safetensors header, cut short
    try:
        header = json.loads(raw) if size is not None and 8 + size <= len(data) else None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        if looks_like_ours:
            raise CheckpointError(f"{where} is truncated or damaged: its header is incomplete or not valid JSON "
                                  f"({len(data)} bytes in the file). Restore an earlier checkpoint.")
        raise CheckpointError(f"restore needs a file written by Checkpoint.save (a safetensors file). Received: "
                              f"{where[len('Checkpoint '):]}, {describe(data)}.")
    metadata = header.get("__metadata__")
    names = sorted(k for k in header if k != "__metadata__")
    format_ = metadata.get(FORMAT_KEY) if isinstance(metadata, dict) else None
    if isinstance(format_, str) and format_.startswith("distrib-checkpoint/") and format_ != FORMAT:
        raise CheckpointError(f"{where} has format {format_!r}; this distrib reads {FORMAT!r}. Use the distrib "
                              f"version that wrote it.")
    if format_ != FORMAT:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise CheckpointError(f"restore needs a file written by Checkpoint.save. Received: "
                              f"{where[len('Checkpoint '):]}, a safetensors file of {len(names)} tensors ({shown}) "
                              f"whose header names no distrib format (format {format_!r}, this distrib reads "
                              f"{FORMAT!r}).")
    return metadata, names


def _check_dtype(key: str, dtype: np.dtype) -> None:
    if dtype.name not in _DTYPES:
        raise TypeError(f"A checkpoint saves variables of the dtypes a safetensors file holds ({', '.join(_DTYPES)}). "
                        f"Received: {key!r} of dtype {dtype}.")


def _temporary_prefix(path: str) -> str:
    """".<name>." for the checkpoint `path`, its name cut (and a digest added) so that a temporary fits NAME_MAX."""
    directory, name = os.path.split(path)
    try:
        name_max = os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    if len(os.fsencode(name)) + _TEMPORARY_TAIL <= name_max:
        return f".{name}."
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:8]
    cut = name
    while len(os.fsencode(cut)) + len(digest) + 1 + _TEMPORARY_TAIL > name_max:
        cut = cut[:-1]
    return f".{cut}~{digest}."


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM  # exists, owned by another user
    return True


def _kind_name(kind: type | tuple) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
