"""The release-day drift check (.ci/engines-drift) on the vLLM releases at hand,
without the network: its comparisons on vLLM 0.32.0 against 0.33.0 (what is known
to differ between them), its fingerprints against the route hook's own, and its
reading of the wire formats against msgspec's."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
COMPAT = Path(__file__).parent / "compat"


def _load():
    spec = importlib.util.spec_from_file_location("engines_drift", REPO / ".ci" / "engines_drift.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["engines_drift"] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


drift = _load()
WINDOW = [line.strip() for line in (COMPAT / "vllm-releases.txt").read_text().splitlines() if line[:1].isdigit()]


def folder(release: str) -> Path:
    """Where .ci/test installed vLLM ``release``: the virtualenv, or its own folder."""
    if release == drift.pinned("vllm"):
        return drift.site_packages()
    path = drift.venv() / "vllm" / release
    assert drift.installed(path, "vllm") == release, (
        f"vLLM {release} is not installed in {path}: run .ci/test (pip install --no-deps --target {path} vllm=={release})"
    )
    return path


def statuses(findings) -> dict[str, str]:
    return {f.name: f.status for f in findings}


@pytest.mark.parametrize("release", WINDOW)
def test_its_fingerprints_are_the_hooks(release):
    from dpcoord import vllm_route

    found = {name: drift.fingerprint(drift.method_source(folder(release), module, name)[1]) for module, name in vllm_route.SEAMS}
    assert found == vllm_route.TESTED[release]


def test_the_seams_that_changed_from_0_32_to_0_33():
    from dpcoord import vllm_route

    found = drift.compare_seams("vllm", vllm_route.SEAMS, vllm_route.TESTED["0.33.0"], folder("0.32.0"), folder("0.33.0"))
    assert statuses(found) == {
        "DPLBAsyncMPClient.get_core_engine_for_request": "changed",
        "DPAsyncMPClient.add_request_async": "changed",
        "DPAsyncMPClient.get_core_engine_for_request": "unchanged",
        "AsyncMPClient.add_request_async": "unchanged",
        "OutputProcessor.abort_requests": "unchanged",
        "OutputProcessor.process_outputs": "changed",
    }
    pick = found[0]
    assert pick.detail == "b7f86dbfd4a18280 -> 964adc43fd38ab32"
    assert pick.diff[:2] == [
        "--- vllm 0.33.0: vllm/v1/engine/core_client.py DPLBAsyncMPClient.get_core_engine_for_request",
        "+++ vllm 0.32.0: vllm/v1/engine/core_client.py DPLBAsyncMPClient.get_core_engine_for_request",
    ]
    assert all(f.diff == [] for f in found if f.status == "unchanged")


def test_the_formats_and_families_from_0_32_to_0_33():
    old, new = folder("0.32.0"), folder("0.33.0")
    [kv_events] = drift.VLLM_FORMATS
    found = drift.compare_format(kv_events, old, new)
    assert statuses(found) == {
        "KVEventBatch": "unchanged",
        "BlockStored": "changed",  # 0.33 added lookahead_token_ids
        "BlockRemoved": "unchanged",
        "AllBlocksCleared": "unchanged",
    }
    assert found[1].detail == "15 -> 14 fields"
    assert [l for l in found[1].diff if l[:1] in "+-" and l[:3] not in ("---", "+++")] == ["-lookahead_token_ids"]
    assert set(statuses(drift.compare_stats(old, new)).values()) == {"unchanged"}
    families = drift.check_families(drift.scraped_families(), old)
    assert [f.name for f in families] == [
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ]
    assert {f.status for f in families} == {"present"}
    assert drift.check_families(["vllm:prompt_tokens", "vllm:no_such_family"], old)[1].status == "missing"


def test_struct_layouts_are_msgspecs(real):
    """The fields in the order msgspec encodes them, and the options that shape them."""
    formats = drift.VLLM_FORMATS + drift.SGLANG_FORMATS
    assert len(formats) == 3
    for fmt in formats:
        module = importlib.import_module(fmt.relpath.removesuffix(".py").replace("/", "."))
        site = Path(module.__file__).parents[fmt.relpath.count("/")]  # the folder it was imported from
        for name in fmt.structs:
            cls = getattr(module, name)
            config = cls.__struct_config__
            options = [
                f"array_like={config.array_like}" if config.array_like else "",
                f"tag={config.tag!r}" if config.tag is not None else "",
                f"omit_defaults={config.omit_defaults}" if config.omit_defaults else "",
            ]
            head = "options: " + (", ".join(o for o in options if o) or "none")
            assert drift.struct_layout(site, fmt.relpath, name) == (fmt.relpath, [head, *cls.__struct_fields__]), name


def test_the_stats_it_checks_are_the_ones_dpcoord_reads():
    sources = "".join((REPO / "clients/python/dpcoord" / f).read_text() for f in ("vllm_plugin.py", "vllm_route.py"))
    for reads in drift.STATS_READ.values():
        for attribute in reads:
            assert all(name in sources for name in attribute.split("|")), attribute


def test_an_absent_hook_is_reported_not_checked():
    assert drift.hook_tables("dpcoord.no_such_hook") is None
    engine = drift.Engine("SGLang", "sglang", "0.5.23", "0.5.23")
    engine.sections.append(drift.Section("the route hook's seams", "seams", note="not checked: no hook"))
    lines = drift.report([engine])
    assert "   not checked: no hook" in lines
    assert "seams not checked" in lines[-2] and lines[-1] == "no drift (exit 0)"


def test_a_failed_run_is_counted():
    run = drift.parse_pytest(
        1,
        "..F.\nERROR    dpcoord.vllm:vllm_route.py:155 a log line\n"
        "FAILED clients/python/tests/compat/test_vllm_route.py::test_x - AssertionError\n"
        "1 failed, 3 passed in 2.00s\n",
    )
    assert (run.status, run.counts, run.summary) == ("failed", {"failed": 1, "passed": 3}, "1 failed, 3 passed in 2.00s")
    assert run.failures == ["FAILED clients/python/tests/compat/test_vllm_route.py::test_x - AssertionError"]
    assert run.failed_ids == ["clients/python/tests/compat/test_vllm_route.py::test_x"]
    assert run.drifted and drift.parse_pytest(0, "4 passed in 1.00s\n").counts == {"passed": 4}
