"""`make lab` works: JupyterLab from the project's venv starts headless, lists the chapters,
has the ipywidgets manager for the live explorer, and runs a chapter's cells in the venv's
``python3`` kernel.

The server is started as `make lab` starts it (same root, same environment variables), on a
free port with a random token and no browser. Its REST API lists ``book/``; a session is opened
on the first chapter of the toc exactly as JupyterLab opens a notebook (``POST /api/sessions``),
and every code cell is sent over the kernel's websocket (``/api/kernels/<id>/channels``, the
JSON protocol JupyterLab speaks). Each cell must reply ``ok`` without an error output.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# `make lab`'s environment (RUN_ENV in the Makefile): the chapters' kernel sees the same.
LAB_ENV = {"TRITON_INTERPRET": "1", "JUPYTER_PREFER_ENV_PATH": "1", "PYTHONHASHSEED": "0"}
START_TIMEOUT_S = 120.0
CELL_TIMEOUT_S = 600.0

pytestmark = pytest.mark.timeout(1200)

jupyterlab = pytest.importorskip("jupyterlab", reason="JupyterLab is in the book extra")
tornado_websocket = pytest.importorskip("tornado.websocket")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_chapter() -> str:
    """The first chapter of the toc (a short one: the book starts gently)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_site import toc_files

    return next(f for f in toc_files(REPO / "_toc.yml")[1:]) + ".ipynb"


class Lab:
    def __init__(self, tmp: Path):
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            **LAB_ENV,
            # Nothing from ~/.jupyter or ~/.local: a fresh user's view of the venv.
            "JUPYTER_CONFIG_DIR": str(tmp / "config"),
            "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
            "JUPYTERLAB_SETTINGS_DIR": str(tmp / "lab-settings"),
            "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "lab-workspaces"),
        }
        self.log = open(tmp / "lab.log", "w+")  # noqa: SIM115  (closed in stop())
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyterlab",
                "--no-browser",
                "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={self.port}",
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={REPO}",
                "--LabApp.default_url=/lab/tree/book",
                # CI runs as root; the extension manager would ask PyPI when its panel opens.
                "--allow-root",
                "--LabApp.extension_manager=readonly",
            ],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                self.get("/api/status")
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = self.output()
                    self.stop()
                    pytest.fail(f"JupyterLab did not start:\n{log[-4000:]}")
                time.sleep(0.5)

    def request(self, method: str, path: str, body: dict | None = None) -> bytes:
        req = urllib.request.Request(
            self.base + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.read()

    def get(self, path: str) -> dict | list:
        return json.loads(self.request("GET", path))

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    server = Lab(tmp_path_factory.mktemp("jupyterlab"))
    yield server
    server.stop()


def test_lab_lists_the_chapters(lab):
    listing = lab.get("/api/contents/book")
    notebooks = {item["name"] for item in listing["content"] if item["type"] == "notebook"}
    on_disk = {p.name for p in (REPO / "book").glob("*.ipynb")}
    assert notebooks == on_disk
    assert Path(first_chapter()).name in notebooks


def test_lab_has_the_python3_kernel_of_this_venv(lab):
    specs = lab.get("/api/kernelspecs")
    assert specs["default"] == "python3"
    argv = specs["kernelspecs"]["python3"]["spec"]["argv"]
    # "python" is started as the server's own interpreter (jupyter_client), i.e. this venv's.
    assert argv[0] in ("python", sys.executable), argv


def test_lab_page_loads_the_widget_manager(lab):
    """ipywidgets' JupyterLab extension is what makes the explorer live in Lab."""
    page = lab.request("GET", "/lab").decode()
    config = json.loads(re.search(r'id="jupyter-config-data"[^>]*>(.*?)</script>', page, re.S)[1])
    names = {ext["name"] for ext in config.get("federated_extensions", [])}
    assert "@jupyter-widgets/jupyterlab-manager" in names, sorted(names)


def message(msg_type: str, content: dict, session: str) -> dict:
    return {
        "header": {
            "msg_id": uuid.uuid4().hex,
            "msg_type": msg_type,
            "session": session,
            "username": "test",
            "version": "5.3",
            "date": datetime.now(UTC).isoformat(),
        },
        "parent_header": {},
        "metadata": {},
        "content": content,
        "channel": "shell",
        "buffers": [],
    }


async def run_cells(lab: Lab, kernel_id: str, cells: list[str]) -> list[dict]:
    """Execute ``cells`` in order on the kernel; per cell, its reply status and outputs."""
    from tornado.httpclient import HTTPRequest

    url = f"ws://127.0.0.1:{lab.port}/api/kernels/{kernel_id}/channels"
    ws = await tornado_websocket.websocket_connect(
        HTTPRequest(url, headers={"Authorization": f"token {lab.token}"})
    )
    session = uuid.uuid4().hex
    results = []
    try:
        for code in cells:
            msg = message(
                "execute_request",
                {
                    "code": code,
                    "silent": False,
                    "store_history": True,
                    "user_expressions": {},
                    "allow_stdin": False,
                    "stop_on_error": True,
                },
                session,
            )
            await ws.write_message(json.dumps(msg))
            result: dict = {"code": code, "status": None, "outputs": [], "idle": False}
            while result["status"] is None or not result["idle"]:
                raw = await asyncio.wait_for(ws.read_message(), CELL_TIMEOUT_S)
                if raw is None:
                    raise ConnectionError("kernel websocket closed")
                reply = json.loads(raw)
                if reply.get("parent_header", {}).get("msg_id") != msg["header"]["msg_id"]:
                    continue
                kind = reply["header"]["msg_type"]
                if kind == "execute_reply":
                    result["status"] = reply["content"]["status"]
                elif kind == "status" and reply["content"]["execution_state"] == "idle":
                    result["idle"] = True
                elif kind in ("stream", "execute_result", "display_data", "error"):
                    result["outputs"].append({"type": kind, **reply["content"]})
            results.append(result)
            if result["status"] != "ok":
                break
    finally:
        ws.close()
    return results


def test_lab_runs_a_chapter_in_its_kernel(lab):
    chapter = first_chapter()
    nb = json.loads((REPO / chapter).read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    probe = (
        "import json, os, sys, kvcache, ipywidgets\n"
        "print(json.dumps({'python': sys.executable, 'cwd': os.getcwd(),"
        " 'triton_interpret': os.environ.get('TRITON_INTERPRET')}))"
    )
    session = json.loads(
        lab.request(
            "POST",
            "/api/sessions",
            {
                "path": chapter,
                "name": Path(chapter).name,
                "type": "notebook",
                "kernel": {"name": "python3"},
            },
        )
    )
    try:
        results = asyncio.run(run_cells(lab, session["kernel"]["id"], [*cells, probe]))
    finally:
        lab.request("DELETE", f"/api/sessions/{session['id']}")
    failed = [
        r for r in results if r["status"] != "ok" or any(o["type"] == "error" for o in r["outputs"])
    ]
    assert not failed, (
        f"{chapter}: cell failed in the Lab kernel:\n{failed[0]['code'][:500]}\n"
        f"{[o for o in failed[0]['outputs'] if o['type'] == 'error']}"
    )
    assert len(results) == len(cells) + 1
    probe_out = json.loads("".join(o.get("text", "") for o in results[-1]["outputs"]))
    # Not resolved: the venv's python is a link to the base interpreter, which other venvs share.
    assert Path(probe_out["python"]).absolute() == Path(sys.executable).absolute(), (
        f"the python3 kernel runs {probe_out['python']}, not this venv's {sys.executable}"
    )
    assert Path(probe_out["cwd"]).resolve() == (REPO / chapter).parent.resolve()
    assert probe_out["triton_interpret"] == "1"
