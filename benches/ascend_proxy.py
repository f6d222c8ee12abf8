#!/usr/bin/env python3
"""vLLM Ascend's load-balance proxy for external DP, for the `proxy` part of
benches/dpcoord (the third arm, beside direct and `dpcoord proxy`).

The proxy is vLLM Ascend's own example,
examples/external_online_dp/dp_load_balance_proxy_server.py of release
v0.23.0 (tag v0.23.0, commit 5cb98caaadeff42b5b62b996e34bb2aaa29d20fd),
run unmodified. No copy of it is kept in this repository: `prepare` takes
it from the vllm-ascend 0.23.0 source distribution on the package index pip
uses, both pinned by SHA-256 (the file is the same as at the tag).

Usage:
  ascend_proxy.py prepare DIR
      Makes DIR/venv with what the script needs ("fastapi<0.124.0", httpx
      and uvicorn, as its header says; uvicorn with its `standard` extra,
      uvloop and httptools, as a vLLM install has them through fastapi's)
      and writes the script to DIR. Does nothing that is already done.
      Prints `python=PATH`, `script=PATH` and the versions installed.
  ascend_proxy.py serve SCRIPT ARG...
      Runs SCRIPT as __main__ with ARG... (with DIR/venv/bin/python). The
      script imports `init_logger` from `vllm.logger`, which pulls in torch;
      without vLLM installed a stand-in module gives it `logging.getLogger`,
      which is what vLLM's returns for a logger named `__main__` (vLLM
      configures only the `vllm` logger tree). It exits when its parent
      does, so an orphan cannot linger.
"""

import hashlib
import io
import json
import logging
import os
import re
import runpy
import subprocess
import sys
import tarfile
import threading
import time
import types
import urllib.parse
import urllib.request

PACKAGE = "vllm-ascend"
SDIST = "vllm_ascend-0.23.0.tar.gz"
SDIST_SHA256 = "a58db76eaffcf328b13b315a0db3a57d381a8947d01057ddcefe4ad02372b242"
MEMBER = "vllm_ascend-0.23.0/examples/external_online_dp/dp_load_balance_proxy_server.py"
SCRIPT = "dp_load_balance_proxy_server.py"
SCRIPT_SHA256 = "990bb615a5c7b7fe958fa582c2570085af038dcb8a749f5b12f77b2d749cb90a"
REQUIREMENTS = ["fastapi<0.124.0", "httpx", "uvicorn[standard]"]
VERSIONS_OF = ["fastapi", "starlette", "httpx", "uvicorn", "uvloop", "httptools"]
TIMEOUT_S = 120


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def venv_python(venv):
    return os.path.join(venv, "bin", "python")


def make_venv(venv):
    """DIR/venv with REQUIREMENTS, once (a stamp file records them)."""
    stamp = os.path.join(venv, ".dpcoord-bench")
    want = " ".join(REQUIREMENTS)
    if os.path.exists(stamp) and open(stamp).read() == want:
        return
    if not os.path.exists(venv_python(venv)):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=TIMEOUT_S)
    pip = [venv_python(venv), "-m", "pip", "install", "--quiet", *REQUIREMENTS]
    subprocess.run(pip, check=True, timeout=10 * TIMEOUT_S)
    with open(stamp, "w") as f:
        f.write(want)


def index_url(venv):
    """The simple index pip installs from: its configuration, else its default."""
    url = os.environ.get("PIP_INDEX_URL")
    if url:
        return url
    got = subprocess.run(
        [venv_python(venv), "-m", "pip", "config", "get", "global.index-url"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if got.returncode == 0 and got.stdout.strip():
        return got.stdout.strip()
    default = "from pip._internal.models.index import PyPI; print(PyPI.simple_url)"
    return subprocess.run(
        [venv_python(venv), "-c", default], capture_output=True, text=True, check=True, timeout=TIMEOUT_S
    ).stdout.strip()


def sdist_url(index):
    """The sdist's URL on the project's simple page (PEP 691 JSON, else PEP 503 HTML)."""
    page = urllib.parse.urljoin(index.rstrip("/") + "/", PACKAGE + "/")
    accept = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
    req = urllib.request.Request(page, headers={"Accept": accept})
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
        kind, body = r.headers.get("Content-Type", ""), r.read().decode()
    if "json" in kind:
        for f in json.loads(body)["files"]:
            if f["filename"] == SDIST:
                return urllib.parse.urljoin(page, f["url"])
    else:
        for href in re.findall(r'href="([^"]+)"', body):
            if urllib.parse.urlparse(href).path.endswith("/" + SDIST) or href.split("#")[0] == SDIST:
                return urllib.parse.urljoin(page, href)
    raise SystemExit(f"{SDIST} is not on {page}")


def fetch_script(venv, path):
    """Writes the proxy script to `path` from the pinned sdist, once."""
    if os.path.exists(path) and sha256(open(path, "rb").read()) == SCRIPT_SHA256:
        return
    url = sdist_url(index_url(venv))
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r:
        data = r.read()
    if sha256(data) != SDIST_SHA256:
        raise SystemExit(f"{SDIST}: SHA-256 {sha256(data)}, expected {SDIST_SHA256}")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        script = tar.extractfile(MEMBER).read()
    if sha256(script) != SCRIPT_SHA256:
        raise SystemExit(f"{MEMBER}: SHA-256 {sha256(script)}, expected {SCRIPT_SHA256}")
    with open(path + ".part", "wb") as f:
        f.write(script)
    os.replace(path + ".part", path)


def prepare(folder):
    os.makedirs(folder, exist_ok=True)
    venv = os.path.join(folder, "venv")
    make_venv(venv)
    script = os.path.join(folder, SCRIPT)
    fetch_script(venv, script)
    report = "from importlib.metadata import version as v; print(' '.join(f'{n} {v(n)}' for n in %r))"
    versions = subprocess.run(
        [venv_python(venv), "-c", report % VERSIONS_OF], capture_output=True, text=True, check=True, timeout=TIMEOUT_S
    ).stdout.strip()
    print(f"python={venv_python(venv)}")
    print(f"script={script}")
    print(f"versions={versions}")


def exit_with_parent():
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def serve(script, args):
    threading.Thread(target=exit_with_parent, daemon=True).start()
    try:
        import vllm.logger  # noqa: F401
    except ImportError:
        vllm = types.ModuleType("vllm")
        stand_in = types.ModuleType("vllm.logger")
        stand_in.init_logger = logging.getLogger
        vllm.logger = stand_in
        sys.modules["vllm"], sys.modules["vllm.logger"] = vllm, stand_in
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "prepare":
        prepare(sys.argv[2])
    elif len(sys.argv) >= 3 and sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3:])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
