"""Build the optional C kernels `engine.quant._kernels` (GGUF-block matmuls, see engine/quant/).

Everything else is declared in pyproject.toml. The extension needs only a C compiler and the
Python headers (no torch headers, so pip's isolated build never pulls a torch). If it cannot be
built, the install still succeeds and the engine runs its torch path, warning once at load.
No -march flag: SIMD code is compiled per function (target attributes) and chosen at run time.
"""
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, PlatformError

KERNEL_SOURCES = ["engine/quant/module.c", "engine/quant/pool.c", "engine/quant/kernels_scalar.c",
                  "engine/quant/kernels_avx2.c", "engine/quant/norm.c",
                  "engine/quant/decode_attention.c", "engine/quant/matmul.c",
                  "engine/quant/decoder.c", "engine/quant/decoder_py.c",
                  "engine/quant/interleaved.c", "engine/quant/interleaved_avx2.c",
                  "engine/quant/decode_attention_avx2.c"]
BUILD_ERRORS = (CCompilerError, CompileError, ExecError, PlatformError, OSError)


class OptionalBuildExt(build_ext):
    """build_ext that reports a failed compile instead of failing the install."""

    def run(self) -> None:
        try:
            super().run()
        except BUILD_ERRORS as error:
            self._skip(error)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except BUILD_ERRORS as error:
            self._skip(error)

    @staticmethod
    def _skip(error: Exception) -> None:
        print(f"WARNING: engine.quant._kernels was not built ({type(error).__name__}: {error}); "
              "the engine will use its slower torch path on the CPU", file=sys.stderr)


def kernel_extension() -> list[Extension]:
    if sys.platform == "win32":       # the thread pool is pthreads
        return []
    return [Extension("engine.quant._kernels", sources=KERNEL_SOURCES,
                      depends=["engine/quant/formats.h", "engine/quant/pool.h", "engine/quant/norm.h",
                               "engine/quant/decode_attention.h", "engine/quant/matmul.h",
                               "engine/quant/decoder.h", "engine/quant/fast_exp.h"],
                      extra_compile_args=["-O3", "-std=c11", "-pthread"],
                      extra_link_args=["-pthread"])]


setup(ext_modules=kernel_extension(), cmdclass={"build_ext": OptionalBuildExt})
