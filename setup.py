"""Build hook: generate the gRPC/protobuf stubs from protos/ before packaging.

Runs for wheels and for editable installs alike; the same generator is also
`python -m specdec.protogen`.
"""
import importlib.util
import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent


def _generate() -> None:
    # Load the generator by path: importing the specdec package here would pull
    # in its runtime dependencies, which a build environment does not have.
    spec = importlib.util.spec_from_file_location("_protogen", ROOT / "specdec" / "protogen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.generate(ROOT / "protos", ROOT)


class BuildPyWithProtos(build_py):
    def run(self):
        _generate()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
