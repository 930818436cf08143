"""Build the optional C extensions: `engine.quant._kernels` (GGUF-block matmuls, see engine/quant/)
and `host.sandbox.wasm._wit_values` (host-call values converted in C, see host/sandbox/wasm/wit_codec.py).

Everything else is declared in pyproject.toml. The extensions need only a C compiler and the
Python headers (no torch headers, so pip's isolated build never pulls a torch). If one cannot be
built, the install still succeeds: the engine runs its torch path (warning once at load) and the
host converts host-call values with wasmtime-py's Python converters.
No -march flag: SIMD code is compiled per function (target attributes) and chosen at run time.
"""
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, PlatformError

KERNEL_SOURCES = ["engine/quant/module.c", "engine/quant/pool.c", "engine/quant/kernels_scalar.c",
                  "engine/quant/kernels_avx2.c", "engine/quant/norm.c",
                  "engine/quant/decode_attention.c", "engine/quant/matmul.c",
                  "engine/quant/decoder.c", "engine/quant/decoder_py.c", "engine/quant/lora.c",
                  "engine/quant/interleaved.c", "engine/quant/interleaved_avx2.c",
                  "engine/quant/decode_attention_avx2.c", "engine/quant/kernels_avx512.c",
                  "engine/quant/decode_attention_avx512.c", "engine/quant/prefill_attention.c",
                  "engine/quant/interleaved_avx512.c", "engine/quant/interleaved_act8.c",
                  "engine/quant/interleaved_act8_avx512.c", "engine/quant/kquant_act8.c",
                  "engine/quant/kquant_act8_avx512.c",
                  "engine/quant/prefill_attention_avx2.c", "engine/quant/prefill_attention_avx512.c"]
BUILD_ERRORS = (CCompilerError, CompileError, ExecError, PlatformError, OSError)


class OptionalBuildExt(build_ext):
    """build_ext that reports a failed compile instead of failing the install."""

    def run(self) -> None:
        try:
            super().run()
        except BUILD_ERRORS as error:
            self._skip("the C extensions", error)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except BUILD_ERRORS as error:
            self._skip(ext.name, error)

    @staticmethod
    def _skip(name: str, error: Exception) -> None:
        print(f"WARNING: {name} was not built ({type(error).__name__}: {error}); the engine "
              "uses its slower torch path on the CPU without engine.quant._kernels, the host "
              "wasmtime-py's Python converters without host.sandbox.wasm._wit_values", file=sys.stderr)


def extensions() -> list[Extension]:
    if sys.platform == "win32":       # the thread pool is pthreads
        return []
    return [Extension("engine.quant._kernels", sources=KERNEL_SOURCES,
                      depends=["engine/quant/formats.h", "engine/quant/pool.h", "engine/quant/norm.h",
                               "engine/quant/decode_attention.h", "engine/quant/matmul.h",
                               "engine/quant/prefill_attention.h",
                               "engine/quant/decoder.h", "engine/quant/lora.h", "engine/quant/fast_exp.h",
                               "engine/quant/avx2_math.h"],
                      extra_compile_args=["-O3", "-std=c11", "-pthread"],
                      extra_link_args=["-pthread"]),
            Extension("host.sandbox.wasm._wit_values",
                      sources=["host/sandbox/wasm/wit_values.c", "host/sandbox/wasm/wit_lift.c",
                               "host/sandbox/wasm/wit_lower.c"],
                      depends=["host/sandbox/wasm/wit_values.h"], extra_compile_args=["-O2", "-std=c11"])]


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
