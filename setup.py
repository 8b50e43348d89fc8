"""The one compiled part: the CPU digest's word sum (elastic_refit/transport/_digest.c).

Everything else is in pyproject.toml. The extension is optional: where it cannot be built
(no compiler, no Python headers) the install goes on and digests run in numpy, with the
same values."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("elastic_refit.transport._digest", ["elastic_refit/transport/_digest.c"],
                             extra_compile_args=["-O3"], optional=True)])
