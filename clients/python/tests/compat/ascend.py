"""vLLM Ascend in this test process, as it is in a vLLM API server on an NPU host.

vLLM Ascend is installed beside vLLM (.ci/test: ``pip install --no-deps --target``
into the same folder, ``vllm_ascend`` with its entry points). Its platform plugin
(entry point ``vllm.platform_plugins``: ``vllm_ascend:register``) makes vLLM's
``current_platform`` its ``NPUPlatform``, and when the API server builds its config
(``EngineArgs.create_engine_config``, and ``make_arg_parser`` before it)
``NPUPlatform.pre_register_and_update`` applies its global patches
(``vllm_ascend.patch.platform``) to vLLM's modules. :func:`start_api_server` does
the same here, under the stand-ins (``torch_npu`` among them)."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys


def installed() -> bool:
    """Whether vLLM Ascend's platform plugin is where vLLM's plugin loader looks."""
    return any(e.value == "vllm_ascend:register" for e in importlib.metadata.entry_points(group="vllm.platform_plugins"))


def start_api_server() -> object:
    """vLLM Ascend's platform set up as in an API server; returns vLLM's ``current_platform``."""
    import torch

    importlib.import_module("torch_npu")
    # Importing the real torch_npu registers its device module as ``torch.npu``.
    torch.npu = importlib.import_module("torch_npu.npu")
    torch.npu.is_available = lambda: True  # an NPU host (SGLang's is_npu() asks, in this process too)
    from vllm.platforms import current_platform

    assert type(current_platform).__name__ == "NPUPlatform", f"vLLM's platform is {current_platform!r}"
    # vllm/engine/arg_utils.py, EngineArgs.create_engine_config: the platform's
    # patches, then the general plugins (vLLM Ascend's, once per process: they
    # register connectors and loaders that refuse a second registration).
    current_platform.pre_register_and_update()
    assert "vllm_ascend.patch.platform" in sys.modules
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    return current_platform


#: dpcoord's plugins (clients/python/pyproject.toml: the route hook, the stat logger):
#: the only ones the hook fixture lets vLLM load again (``VLLM_PLUGINS``) once vLLM
#: Ascend's have run in this process
DPCOORD_PLUGINS = "dpcoord_route,dpcoord"


def patches() -> list[str]:
    """The modules of vLLM Ascend's platform patches applied in this process."""
    return sorted(m for m in sys.modules if m.startswith("vllm_ascend.patch.platform."))
