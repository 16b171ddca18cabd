"""`llm` (Simon Willison's command-line client, PyPI) pointed at `serve --http` through its
extra-openai-models.yaml, as docs/editors.md tells its users: the real CLI as a subprocess, the
real server on loopback (tiny model). Its answer must be the one the openai client gets."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from test_http import Server

LLM = shutil.which("llm", path=os.path.dirname(sys.executable) + os.pathsep +
                   os.environ.get("PATH", ""))


@pytest.mark.skipif(LLM is None, reason="the `llm` CLI is not installed (pip install llm; "
                                        "install.sh's test extra has it)")
def test_llm_cli_chats_with_the_server(tiny_path, tmp_path):
    server = Server(tiny_path, tmp_path)
    try:
        config = tmp_path / "llm-config"
        config.mkdir()
        (config / "extra-openai-models.yaml").write_text(
            f'- model_id: localspec\n  model_name: {tiny_path.stem}\n'
            f'  api_base: "{server.base}/v1"\n')
        env = {**os.environ, "LLM_USER_PATH": str(config), "OPENAI_API_KEY": "unused"}
        out = subprocess.run([LLM, "-m", "localspec", "--no-log", "-o", "temperature", "0",
                              "-o", "max_tokens", "12", "hello there"], capture_output=True,
                             env=env, timeout=120)
        assert out.returncode == 0, out.stderr.decode()
        direct = server.client(key="unused").chat.completions.create(
            model=tiny_path.stem, messages=[{"role": "user", "content": "hello there"}],
            temperature=0, max_tokens=12)
        assert out.stdout.decode().strip() == direct.choices[0].message.content.strip() != ""
    finally:
        server.close()
