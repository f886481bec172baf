"""Compile the fixed-order CPU kernels (``c/``: ``fixed_order.h`` and the kernel files) once per machine, load them.

The library is built on first use with the machine's C compiler (``$CC``, else ``cc``, ``gcc`` or
``clang``), for this CPU (``-march=native``), with OpenMP where the compiler has it; the same
GNU OpenMP runtime that PyTorch loads (``libgomp.so.1``) then runs the kernels' parallel loops,
so they share PyTorch's threads. It is cached under ``$RLRUNBOOK_CACHE_DIR/kernels/<key>/`` where
the key hashes the sources, the flags, the compiler's version and the CPU's feature flags: a cache
shared by two machines never hands one the other's build. A build is written under a temporary
name and renamed into place, so concurrent first uses are safe.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

from rlrunbook.errors import RlrunbookError
from rlrunbook.models.cache import build_atomically, default_cache_dir

SOURCE_DIR = Path(__file__).with_name("c")
SOURCES = tuple(sorted(SOURCE_DIR.glob("*.c")))  # compiled together into one library
HEADERS = tuple(sorted(SOURCE_DIR.glob("*.h")))
LIBRARY_NAME = "libfixed_order.so"
BASE_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-ffp-contract=fast", "-fno-fast-math", "-Wno-psabi")
# Tried in order: the first set the compiler accepts is used (OpenMP and -march=native are optional). The
# instructions are this CPU's, the scheduling generic: in a virtual machine GCC 12 can take a Sapphire Rapids for a
# Rocket Lake, whose tuning made the float32 product kernels 9x slower there (8 against 72 GFLOP/s per core).
FLAG_SETS = (("-march=native", "-mtune=generic", "-fopenmp"), ("-fopenmp",), ("-march=native", "-mtune=generic"), ())


class KernelBuildError(RlrunbookError, RuntimeError):
    """The fixed-order kernels could not be compiled or loaded on this machine."""


def find_compiler() -> str | None:
    """The C compiler to use: ``$CC`` if set, else the first of cc, gcc, clang on the PATH."""
    chosen = os.environ.get("CC")
    if chosen:
        return chosen
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _missing_compiler() -> KernelBuildError:
    return KernelBuildError(
        "the default numerics (TINKER_LOCAL_NUMERICS=invariant) compute on CPU with fixed-order kernels that are "
        "compiled on first use, and no C compiler was found ($CC, cc, gcc, clang). Install one (Debian/Ubuntu: "
        "apt install gcc) or set TINKER_LOCAL_NUMERICS=native (the libraries' own kernels: sampler and trainer "
        "then agree only within the parity gates).")


def _compile(compiler: str, folder: Path, flag_sets=FLAG_SETS) -> None:
    errors = []
    for extra in flag_sets:
        command = [compiler, *BASE_FLAGS, *extra, *map(str, SOURCES), "-o", str(folder / LIBRARY_NAME), "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        if result.returncode == 0:
            (folder / "flags.txt").write_text(" ".join(command[1:]) + "\n")
            return
        errors.append(f"$ {' '.join(command)}\n{result.stderr.strip()[-2000:]}")
    raise KernelBuildError("compiling the fixed-order CPU kernels failed:\n" + "\n".join(errors))


def library_folder(compiler: str) -> Path:
    """Where this machine's build of the kernels lives (see the module docstring for the key)."""
    digest = hashlib.sha256()
    sources = b"".join(path.name.encode() + b"\0" + path.read_bytes() for path in (*SOURCES, *HEADERS))
    for part in (sources, repr((BASE_FLAGS, FLAG_SETS)).encode(), _compiler_version(compiler).encode(),
                 _cpu_flags().encode(), platform.machine().encode()):
        digest.update(part)
        digest.update(b"\0")
    return default_cache_dir() / "kernels" / digest.hexdigest()[:20]


@functools.cache
def load_library() -> ctypes.CDLL:
    """The compiled kernels, built first if this machine has no build yet."""
    import torch  # noqa: F401  (loaded first, so the kernels' libgomp.so.1 resolves to PyTorch's copy)

    compiler = find_compiler()
    if compiler is None:
        raise _missing_compiler()
    folder = build_atomically(library_folder(compiler), lambda tmp: _compile(compiler, tmp))
    try:
        library = ctypes.CDLL(str(folder / LIBRARY_NAME))
    except OSError as error:
        raise KernelBuildError(f"loading the fixed-order CPU kernels from {folder} failed ({error}); remove that "
                               "folder to rebuild them.") from None
    _declare(library)
    return library


def load_variant(folder: Path, flags: tuple[str, ...]) -> ctypes.CDLL:
    """The kernels compiled with ``flags`` in place of ``-march=native`` into ``folder`` (not cached): another
    CPU's build, run on this one, to show that the results do not depend on the vector width."""
    compiler = find_compiler()
    if compiler is None:
        raise _missing_compiler()
    _compile(compiler, folder, (flags,))
    library = ctypes.CDLL(str(folder / LIBRARY_NAME))
    _declare(library)
    return library


def _declare(library: ctypes.CDLL) -> None:
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    signatures = {
        "gemm_nt": (i, [p, i, i64, p, i, i64, p, p, i, i64, i64, i64, i64, i]),
        "gemm_seq": (i, [p, i, i64, i64, p, i, i64, p, p, i, i64, i64, i64, i64, i]),
        "row_sumsq": (None, [p, i, i64, i64, i64, p, i]),
        "row_logsumexp": (None, [p, i64, i64, i64, p, i]),
        "gather_rows": (None, [p, i64, p, i64, i]),
        "log_softmax_at_grad": (None, [p, i64, p, p, p, p, i64, i64, i]),
        "exp_f32": (None, [p, p, i64, i]),
        "sigmoid_f32": (None, [p, p, i64, i]),
        "rope_table": (None, [p, i64, p, i64, p, p]),
        "attention_fwd": (i, [p, p, p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, i64, i64, i, i, f, i]),
        "attention_bwd": (i, [p, p, p, p, p, p, p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, i64, i64,
                              i, i, f, i]),
        "rms_norm": (i, [p, i64, i64, i64, p, f, p, i64, i, i]),
        "add_rms_norm": (i, [p, p, p, i64, i64, p, f, p, i, i]),
        "rotary": (i, [p, i64, i64, i64, i64, p, p, i, i]),
        "rotary_grad": (i, [p, i64, i64, i64, i64, p, p, i, i]),
        "silu_mul": (i, [p, i64, i64, i64, p, i, i]),
        "lora_linears": (i, [p, i, i64, i64, i64, p, i64, p, p, i64, p, i, i64, i, p, p, p, p, p, i, i, p, p, i]),
        "code_weight": (i, [p, i64, i64, i64, i, p, p, p, i]),
        "decode_weight": (None, [i, p, p, p, i64, i64, p]),
        "gemm_nt_coded": (i, [p, i64, i, p, p, p, p, p, i, i64, i64, i64, i64, i]),
        "cached_attention": (i, [p, i64, p, p, i64, p, p, p, p, i64, i64, i64, i64, i64, i, f, p, p, p, i64, i]),
        "add_scaled": (i, [p, i64, p, i64, f, p, i64, i64, i, i]),
        "lora_added": (i, [p, i64, p, i64, p, i64, f, p, i64, i64, i64, i64, i, i, i]),
        "silu_mul_rows": (i, [p, i64, p, i64, p, i64, i64, i, i]),
        "silu_mul_rows_backward": (i, [p, i64, p, i64, p, i64, p, p, i64, i64, i64, i, i]),
        "decode_layers": (i, [p, p, i64, i64, i, i64, p, p, p, i64, p, p, p, i64, i64, i64, i64, p, p, p, p, p, i64,
                              i, p, p, i]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(library, name)
        function.restype = restype
        function.argtypes = argtypes
