"""Stand-ins for the heavy modules vLLM and SGLang import at module level (torch,
transformers, ...), installed into ``sys.modules`` by this suite's conftest only.

A stand-in module answers every attribute with a permissive object that can be
called, subclassed, indexed, iterated (empty), compared and used as a decorator,
so module-level code such as ``torch.float16``, ``class X(nn.Module)`` or
``@torch.compile`` imports. Nothing of it is shipped in the package."""

from __future__ import annotations

import abc
import importlib.abc
import importlib.machinery
import sys
import types

#: top-level names replaced by stand-ins (heavy or GPU-only); everything else must really be installed.
HEAVY = (
    "torch",
    "torchvision",
    "torchaudio",
    "transformers",
    "triton",
    "tokenizers",
    "safetensors",
    "xformers",
    "flashinfer",
    "sgl_kernel",
    "xgrammar",
    "tvm_ffi",
    "gguf",
    "compressed_tensors",
    "opentelemetry",
    "IPython",
    "vllm._C",
    "vllm._moe_C",
    "vllm.vllm_flash_attn",
    # vLLM Ascend (its platform plugin in an API server): the NPU build of torch, and
    # what the vLLM modules its patches import need beyond the API server's usual
    "torch_npu",
    "einops",
    "ijson",
    "mistral_common",
    "uvicorn",
)


#: dunder names that introspection probes for; a stand-in must not claim them
PROBED = frozenset(
    "__wrapped__ __signature__ __origin__ __args__ __parameters__ __func__ __self__ __isabstractmethod__"
    " __annotations__ __dataclass_fields__ __get_pydantic_json_schema__"
    " __pydantic_core_schema__ __modify_schema__ __get_validators__ __set_name__ __get__ __set__ __delete__ __fspath__ __path__ __file__"
    " __objclass__ __text_signature__ __code__ __globals__ __qualname__ __module__ __name__ __doc__"
    " __supertype__".split()  # __supertype__: msgspec unwraps NewTypes while the attribute exists
)


#: module attributes that feature probes (``hasattr(torch, "npu")``) must not find
ABSENT = frozenset({"npu", "musa", "mlu", "hpu"})


def infer_schema(fn, *args, mutates_args=(), **kwargs) -> str:
    """torch.library.infer_schema, roughly: one ``Tensor name`` per parameter, one ``Tensor``
    per returned value. vLLM's IR ops (vllm/ir/op.py) compare these strings and split them
    at " -> "; a stand-in object each call would never compare equal."""
    import inspect

    sig = inspect.signature(fn)
    params = ", ".join(f"Tensor {name}" for name in sig.parameters)
    ret = sig.return_annotation
    n = len(getattr(ret, "__args__", ())) if getattr(ret, "__origin__", None) is tuple else 1
    return f"({params}) -> " + ("Tensor" if n == 1 else "(" + ", ".join(["Tensor"] * n) + ")")


#: stand-in attributes (of stand-in classes and modules) with a real value, by full name:
#: no HIP or CUDA build (so feature probes take the CPU path); a schema string per function.
VALUES = {
    "torch.version.hip": None,
    "torch.version.cuda": None,
    "torch.library.infer_schema": infer_schema,
    # vLLM 0.34 checks at import that array typecodes match these dtypes' sizes.
    "torch.int32.itemsize": 4,
    "torch.int64.itemsize": 8,
    "torch.float32.itemsize": 4,
}


class _Meta(abc.ABCMeta):  # ABCMeta: stand-in classes mix with ABC bases
    def __new__(mcls, name, bases, namespace, **kwargs):  # class X(Base, total=False)
        return super().__new__(mcls, name, bases, namespace)

    def __init__(cls, name, bases, namespace, **kwargs):
        super().__init__(name, bases, namespace)
    def __getattr__(cls, name):
        if name in PROBED:
            raise AttributeError(name)
        full = f"{cls.__dict__.get('_full', cls.__name__)}.{name}"
        return VALUES[full] if full in VALUES else standin_class(full)

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], (Anything, _Meta)):
            return args[0]  # used as a decorator
        return super().__call__(*args, **kwargs)

    def __getitem__(cls, item):
        return cls

    def __iter__(cls):
        return iter(())

    def __setitem__(cls, key, value):
        pass

    def register(cls, *args, **kwargs):  # transformers' Auto*.register, not ABCMeta's
        return args[0] if args else cls

    def __contains__(cls, item):
        return False

    def __int__(cls):
        return 0

    __index__ = __int__

    def __float__(cls):
        return 0.0

    def __add__(cls, other):
        return other if isinstance(other, str) else cls

    __radd__ = __add__

    def __len__(cls):
        return 0

    def __or__(cls, other):
        return cls

    __ror__ = __or__


class Anything(metaclass=_Meta):
    """Any attribute, any call, any base class."""

    def __init__(self, *args, **kwargs):
        self.__dict__["_name"] = args[0] if args and isinstance(args[0], str) else "standin"

    def __getattr__(self, name):
        if name in PROBED or name == "_name":
            raise AttributeError(name)
        if name == "name":  # a library's or a device's name is a string (``hasattr(torch.ops, lib.m.name)``)
            return self._name
        return Anything(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs and not isinstance(args[0], Anything):
            return args[0]  # used as a decorator
        return Anything(f"{self._name}()")

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        from pydantic_core import core_schema

        return core_schema.any_schema()

    def __mro_entries__(self, bases):
        return (Anything,)

    def __getitem__(self, item):
        return Anything(f"{self._name}[]")

    def __iter__(self):
        return iter(())

    def __setitem__(self, key, value):
        pass

    def __contains__(self, item):
        return False

    def __len__(self):
        return 0

    def __bool__(self):
        return False

    def __int__(self):
        return 0

    def __index__(self):
        return 0

    def __float__(self):
        return 0.0

    def __or__(self, other):
        return self

    __ror__ = __or__

    def __add__(self, other):
        return other if isinstance(other, str) else self

    __radd__ = __add__

    def __eq__(self, other):
        return self is other

    def __lt__(self, other):
        return False

    __le__ = __gt__ = __ge__ = __lt__

    def __hash__(self):
        return id(self)

    def __repr__(self):
        return f"<stand-in {self._name}>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def standin_class(name: str) -> type:
    """A fresh subclass of :class:`Anything` (a real class: issubclass and pydantic accept it)."""
    return _Meta(name.rsplit(".", 1)[-1], (Anything,), {"__module__": name.rsplit(".", 1)[0], "_full": name})


class StandinModule(types.ModuleType):
    def __init__(self, name):
        super().__init__(name)
        self.__path__ = []  # a package: submodules import too
        self.__version__ = "0.0.0+standin"
        self.__spec__ = importlib.machinery.ModuleSpec(name, _Finder, is_package=True)

    def __getattr__(self, name):
        if (name.startswith("__") and name.endswith("__")) or name in ABSENT:
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        value = VALUES[full] if full in VALUES else standin_class(full)
        setattr(self, name, value)  # the same object on every access
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    @staticmethod
    def _heavy(fullname: str) -> bool:
        return any(fullname == h or fullname.startswith(h + ".") for h in HEAVY)

    def find_spec(self, fullname, path=None, target=None):
        if self._heavy(fullname):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return StandinModule(spec.name)

    def exec_module(self, module):
        pass


_Finder = _Finder()


def install() -> None:
    """Puts the stand-in finder first on ``sys.meta_path`` (idempotent)."""
    if _Finder not in sys.meta_path:
        sys.meta_path.insert(0, _Finder)


def uninstall() -> None:
    """Removes the finder and every stand-in module from ``sys.modules``."""
    if _Finder in sys.meta_path:
        sys.meta_path.remove(_Finder)
    for name in [n for n, m in sys.modules.items() if isinstance(m, StandinModule)]:
        del sys.modules[name]


def _same(self, *args):
    return self


# Arithmetic on a stand-in (``-torch.finfo(...).max``, ``x * 2``) gives the stand-in back.
for _op in (
    "neg pos abs invert sub rsub mul rmul truediv rtruediv floordiv rfloordiv mod rmod pow rpow"
    " and rand xor rxor lshift rshift matmul"
).split():
    setattr(Anything, f"__{_op}__", _same)
    setattr(_Meta, f"__{_op}__", _same)


# -- SGLang's native page hash ---------------------------------------------------------
# sglang.srt.mem_cache.cpp_utils.native_hash JIT-compiles hash_binding.cpp through
# torch.utils.cpp_extension, which the torch stand-in cannot do. ``native_page_hash`` is
# a Python port of its ``get_hash`` for token ids below 2^32: page i's digest is
# SHA-256(digest i-1, if any, + the page's words as little-endian u32), where a page's
# words are its token ids, or for a bigram key (EAGLE) the pairs (t[j], t[j+1]) of its
# positions, flattened; returned as hex, one per page when ``page_size`` is given, else
# one for the whole key. A test puts it in place of the extension with
# ``monkeypatch.setattr(native_hash, "_load_native_hash_module", lambda: NATIVE_HASH)``.


def native_page_hash(raw, logical_len, unit_width, is_bigram, prior_digest, page_size=None):
    import array as _array
    import hashlib

    if unit_width != (2 if is_bigram else 1):
        raise NotImplementedError("the native hash stand-in covers plain and bigram token keys only")
    tokens = list(raw[: logical_len + 1 if is_bigram else logical_len])
    if any(not 0 <= t < 2**32 for t in tokens):
        raise NotImplementedError("the native hash stand-in covers token ids below 2^32 only")

    def words(start, end):
        if not is_bigram:
            return tokens[start:end]
        return [w for j in range(start, end) for w in (tokens[j], tokens[j + 1])]

    def page(chunk, prior):
        digest = hashlib.sha256()
        if prior is not None:
            digest.update(prior)
        digest.update(_array.array("I", chunk).tobytes())  # little-endian on the Linux hosts SGLang supports
        return digest.digest()

    if page_size is None:
        return page(words(0, logical_len), prior_digest).hex()
    out = []
    for start in range(0, logical_len, page_size):
        prior_digest = page(words(start, min(start + page_size, logical_len)), prior_digest)
        out.append(prior_digest.hex())
    return out


NATIVE_HASH = types.SimpleNamespace(get_hash=native_page_hash)
