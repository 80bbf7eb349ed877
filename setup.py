"""Build the native cache-bypassing reader as part of `pip install -e .`.

There is deliberately no pure-Python fallback: without a C compiler the
install fails here, loudly, rather than at the first expert load.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "native._bypassio",
            sources=["native/bypassio.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
            libraries=["pthread"],
            optional=False,
        )
    ]
)
