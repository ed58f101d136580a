"""docs/rl.md's retry snippet runs as written across a real abort pause: its first tries get the 503 a
paused engine answers, and it returns the completion once the engine resumes."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server_helpers import start_server, tiny_model_with_tokenizer

pytestmark = pytest.mark.timeout(300)
DOC = Path(__file__).resolve().parent.parent / "docs" / "rl.md"


def retry_snippet() -> str:
    text = DOC.read_text()
    section = text[text.index("### New requests during a pause"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_documented_retry_rides_out_an_abort_pause(tmp_path, smollm2_dir) -> None:
    folder = tiny_model_with_tokenizer("llama", tmp_path / "m", smollm2_dir, vocab_size=49152)
    s = start_server(tmp_path, str(folder), "--max-model-len", "256",
                     "--additional-config", '{"rl_config": {"enabled": true}}')
    try:
        assert httpx.post(s.url + "/pause", params={"mode": "abort"}, timeout=30).status_code == 200
        script = retry_snippet().replace("http://127.0.0.1:8000", s.url)
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        deadline = time.monotonic() + 60
        while '"POST /v1/completions HTTP/1.1" 503' not in s.log():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the snippet never met the paused engine"
            time.sleep(0.05)  # polling the server log with a deadline
        assert httpx.post(s.url + "/resume", timeout=30).status_code == 200
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert out.strip(), "the snippet printed no completion"
    finally:
        s.stop()
