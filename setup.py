"""The compiled parts: the CPU digest's word sum (elastic_refit/transport/_digest.c) and a
box's delta (elastic_refit/transport/_delta.c).

Everything else is in pyproject.toml. The extension is optional: where it cannot be built
(no compiler, no Python headers) the install goes on and digests and deltas run in numpy,
with the same values."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("elastic_refit.transport._digest", ["elastic_refit/transport/_digest.c"],
                             extra_compile_args=["-O3"], optional=True),
                   Extension("elastic_refit.transport._delta", ["elastic_refit/transport/_delta.c"],
                             extra_compile_args=["-O3"], optional=True)])
