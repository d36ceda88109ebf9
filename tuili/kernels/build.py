"""Compile the C kernels in csrc/ once per machine and source version, cache and load them.

Standard library only (no torch), so that it can be loaded and tested on its own.

The compiler is `$TUILI_CC`, else `cc`, else `gcc`, run with FLAGS and then
`$TUILI_KERNEL_CFLAGS` (e.g. `-march=x86-64-v3`, to build and test the code paths of CPUs without
AVX-512). The library goes to `$TUILI_KERNEL_CACHE` (default `~/.cache/tuili/kernels/`) under a
name that carries a hash of the sources, the flags, the compiler's version and the CPU's feature
flags (the code is built with -march=native), so an edit, other flags, another compiler or
another CPU builds a new file instead of loading a stale one. Two
processes may build at once: each writes a private temporary file and renames it into place,
which is atomic, so a reader never sees a half-written library (both files are identical).

Failures (no compiler, a compile error, an unwritable cache, a library the loader refuses) are
not errors: `load()` returns the reason, logged once at INFO, and callers keep their torch code.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tuili.kernels import layout

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
FLAGS = (
    "-O3",
    "-march=native",
    "-std=c11",
    "-ffp-contract=off",  # a*b + c rounds like torch's separate ops; the C code asks for fusion explicitly
    "-fno-math-errno",
    # Values are the same; only the floating-point exception flags, which nothing reads, may differ.
    # Without it GCC 12 keeps on AVX2 every loop with a select next to arithmetic scalar (it
    # if-converts possibly trapping operations only with AVX-512's masks): silu, sigmoid, the
    # exp of softmax (docs/kernels.md, Code paths).
    "-fno-trapping-math",
    "-fopenmp",
    "-fPIC",
)
COMPILE_TIMEOUT_S = 120  # per source file, and for the link


@dataclass(frozen=True)
class Build:
    """The outcome of one attempt to build and load the library."""

    library: ctypes.CDLL | None
    reason: str | None  # why library is None


def load() -> Build:
    """The compiled library, compiled first unless the cache holds it."""
    try:
        path = _compile()
    except _BuildError as error:
        log.info("native CPU kernels unavailable, using the torch code: %s", error)
        return Build(None, str(error))
    try:
        return Build(ctypes.CDLL(str(path)), None)
    except OSError as error:  # the dynamic loader refused the file
        log.info("native CPU kernels unavailable, using the torch code: cannot load %s: %s", path, error)
        return Build(None, f"cannot load the compiled kernels {path}: {error}")


class _BuildError(Exception):
    pass


def _compile() -> Path:
    """The path of the compiled library, compiling it unless the cache already holds it."""
    compiler, flags = _compiler(), _flags()
    target = _library_path(compiler, flags)
    if target.is_file():
        return target
    cache = target.parent
    try:
        cache.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=".so", dir=cache)
        os.close(handle)
    except OSError as error:
        raise _BuildError(f"cannot write to the kernel cache {cache}: {error}") from error
    try:
        with tempfile.TemporaryDirectory(prefix=f".{target.stem}.", dir=cache) as objects:
            _compile_and_link(compiler, flags, sorted(SOURCE_DIR.glob("*.c")), Path(objects), temporary)
        os.replace(temporary, target)  # atomic: a concurrent builder's file is identical
    except (OSError, subprocess.SubprocessError) as error:
        raise _BuildError(f"compiling with {compiler!r} failed: {error}") from error
    finally:
        Path(temporary).unlink(missing_ok=True)
    log.info("compiled the native CPU kernels into %s", target)
    return target


def library_path() -> Path:
    """Where this process's library is cached, built or not: the file named by the hash of the
    sources, the flags (`$TUILI_KERNEL_CFLAGS` included), the compiler's version and the CPU.
    Raises RuntimeError when no compiler runs."""
    try:
        return _library_path(_compiler(), _flags())
    except _BuildError as error:
        raise RuntimeError(str(error)) from error


def _compiler() -> str:
    compiler = os.environ.get("TUILI_CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise _BuildError("no C compiler found (looked for $TUILI_CC, cc and gcc)")
    return compiler


def _flags() -> list[str]:
    return [*FLAGS, *layout.compiler_defines(), *shlex.split(os.environ.get("TUILI_KERNEL_CFLAGS", ""))]


def _library_path(compiler: str, flags: list[str]) -> Path:
    """The cache folder and the library's name in it (see the module's docstring)."""
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise _BuildError(f"C compiler {compiler!r} does not run: {error}") from error
    digest = hashlib.sha256()
    for part in [
        *(p.name + p.read_text() for p in sorted(SOURCE_DIR.glob("*.[ch]"))),
        *flags,
        version,
        _cpu_id(),
    ]:
        digest.update(part.encode())
    cache = Path(os.environ.get("TUILI_KERNEL_CACHE") or Path.home() / ".cache" / "tuili" / "kernels")
    return cache / f"tuili_cpu_{digest.hexdigest()[:16]}.so"


def _compile_and_link(compiler: str, flags: list[str], sources: list[Path], objects: Path, library: str) -> None:
    """Each source to an object file in `objects`, as many at once as this process has cores
    (the largest first, so that the longest compiles do not start last), then the shared
    library: on two cores the first build of a machine takes ~7 s instead of ~13."""

    def run(command: list[str]) -> None:
        result = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if result.returncode != 0:
            raise _BuildError(f"compiling failed ({' '.join(command)}):\n{result.stderr.strip()[-2000:]}")

    largest_first = sorted(sources, key=lambda source: source.stat().st_size, reverse=True)
    outputs = [str(objects / f"{source.stem}.o") for source in largest_first]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=max(1, min(cores, len(sources)))) as pool:
        compiles = [pool.submit(run, [compiler, *flags, "-c", str(source), "-o", output])
                    for source, output in zip(largest_first, outputs, strict=True)]
        for compiled in compiles:
            compiled.result()  # the first failure, in the order submitted
    run([compiler, *flags, "-shared", "-o", library, *outputs])


def _cpu_id() -> str:
    """What -march=native compiles for: the machine and, on Linux, the CPU's feature flags."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {flags}"
