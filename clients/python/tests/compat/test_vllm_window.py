"""The route hook and the stats plugin on every vLLM release of the support window
(vllm-releases.txt): this suite's vLLM tests run again, in a child pytest, on each
release other than the one this run imports, from the folder .ci/test installed it
in (``<virtualenv>/vllm/<release>``, made by ``pip install --no-deps --target``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BASE_ENV, PINNED

HERE = Path(__file__).parent
WINDOW = [line.strip() for line in (HERE / "vllm-releases.txt").read_text().splitlines() if line[:1].isdigit()]
#: the release requirements.txt installs into the virtualenv itself
VENV_RELEASE = next(
    line.split("==")[1].strip() for line in (HERE / "requirements.txt").read_text().splitlines() if line.startswith("vllm==")
)
#: the tests of the hook and the plugin, run on every release
TESTS = ("test_vllm_route.py", "test_vllm_books.py", "test_vllm_plugin.py")


def home(release: str) -> Path:
    return Path(sys.prefix) / "vllm" / release


@pytest.mark.parametrize("release", [r for r in WINDOW if r != PINNED["vllm"]])
def test_the_hook_and_the_plugin_pass_on_each_release(release, dpcoord_bin):
    env = {k: v for k, v in BASE_ENV.items() if k not in ("DPCOORD_VLLM_HOME", "PYTHONPATH")}
    env["DPCOORD_BIN"] = dpcoord_bin
    if release != VENV_RELEASE:
        folder = home(release)
        assert (folder / f"vllm-{release}.dist-info").is_dir(), (
            f"vLLM {release} is not installed in {folder}: run .ci/test (pip install --no-deps --target {folder} vllm=={release})"
        )
        env["DPCOORD_VLLM_HOME"] = str(folder)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(str(HERE / t) for t in TESTS)],
        cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=900,
    )
    last = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0 and " passed" in last and "failed" not in last, (
        f"vLLM {release}: {last}\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
    )
