"""Build the native code as part of `pip install -e .`: the cache-bypassing reader, the
lease words (atomics on the shared residency map) and the slot-to-stack copy.

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
        ),
        Extension(
            "native._slotcopy",
            sources=["native/slotcopy.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
            optional=False,
        ),
        Extension(
            "native._leasewords",
            sources=["native/leasewords.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
            optional=False,
        ),
    ]
)
