"""Started with this directory on PYTHONPATH (tests/crash.py), a process gets the tests' fault injection
(crash_injection.py) in gradcomp's training loop as soon as the loop's module is imported."""

import importlib.abc
import importlib.util
import os
import sys

TARGET = "gradcomp.experiments.run.runner"


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)  # find the module the usual way, then patch it once it has run
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):
            run(module)
            sys.path.insert(0, os.path.dirname(__file__))
            try:
                import crash_injection
            finally:
                sys.path.pop(0)
            crash_injection.install(module)

        loader.exec_module = exec_module
        return spec


if os.environ.get("GCTEST_CRASH_AT_STEP"):
    sys.meta_path.insert(0, _AfterImport())
