"""The route hook and the stats plugin on every vLLM release of the support window
(vllm-releases.txt): this suite's vLLM tests run again, in a child pytest, on each
release other than the one this run imports, from the folder .ci/test installed it
in (``<virtualenv>/vllm/<release>``, made by ``pip install --no-deps --target``).
And on each vLLM release vLLM Ascend runs on (ascend-releases.txt), from the folder
.ci/test installed it in with vLLM Ascend beside it: there the suite runs vLLM as
vLLM Ascend's platform plugin patches it in an API server (ascend.py), and
ascend_checks.py too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BASE_ENV, PINNED

HERE = Path(__file__).parent


def releases(name: str) -> list[str]:
    return [line.strip() for line in (HERE / name).read_text().splitlines() if line[:1].isdigit()]


WINDOW = releases("vllm-releases.txt")
ASCEND = releases("ascend-releases.txt")
#: the release requirements.txt installs into the virtualenv itself
VENV_RELEASE = next(
    line.split("==")[1].strip() for line in (HERE / "requirements.txt").read_text().splitlines() if line.startswith("vllm==")
)
#: the tests of the hook and the plugin, run on every release
TESTS = ("test_vllm_route.py", "test_vllm_books.py", "test_vllm_plugin.py")


def home(release: str) -> Path:
    return Path(sys.prefix) / "vllm" / release


@pytest.mark.parametrize(
    "release, ascend",
    [(r, False) for r in WINDOW if r != PINNED["vllm"]] + [(r, True) for r in ASCEND],
    ids=lambda v: {True: "vLLM Ascend", False: "vLLM"}.get(v, v) if isinstance(v, bool) else v,
)
def test_the_hook_and_the_plugin_pass_on_each_release(release, ascend, dpcoord_bin, tmp_path):
    env = {k: v for k, v in BASE_ENV.items() if k not in ("DPCOORD_VLLM_HOME", "PYTHONPATH", "VLLM_PLUGINS")}
    env["DPCOORD_BIN"] = str(Path(dpcoord_bin).resolve())  # the child runs in clients/python
    tests = TESTS
    if release != VENV_RELEASE or ascend:
        folder = home(release)
        assert (folder / f"vllm-{release}.dist-info").is_dir(), (
            f"vLLM {release} is not installed in {folder}: run .ci/test (pip install --no-deps --target {folder} vllm=={release})"
        )
        env["DPCOORD_VLLM_HOME"] = str(folder)
    if ascend:
        assert (folder / f"vllm_ascend-{release}.dist-info").is_dir(), (
            f"vLLM Ascend {release} is not installed in {folder}: run .ci/test"
            f" (pip install --no-deps --only-binary vllm-ascend --target {folder} vllm-ascend=={release})"
        )
        env["HOME"] = str(tmp_path)  # vLLM Ascend's profiling plugin writes ~/.config/vllm_ascend
        tests = (*TESTS, "ascend_checks.py")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(str(HERE / t) for t in tests)],
        cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=900,
    )
    last = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0 and " passed" in last and "failed" not in last, (
        f"vLLM {release}{' (vLLM Ascend)' if ascend else ''}: {last}\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
    )
