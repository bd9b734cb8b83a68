"""A stand-in for torchvision, on the path of tests/helpers/vllm_greedy.py's process only,
where it runs vLLM's own Qwen3.5: vLLM's `qwen3_5` module imports its vision-language code,
which imports transformers' image processors, which import torchvision when they load. The
torchvision release for this torch has no CPU wheel (docs/limitations.md), and a text-only
model never calls it. Any `torchvision.*` module and attribute resolves to an inert object."""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0"


class _Inert:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()

    def __getattr__(self, name):
        return _Inert()

    def __mro_entries__(self, bases):
        return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Inert()
