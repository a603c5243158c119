"""One vLLM run's process group: a stop leaves nothing of the group behind when it returns.

A stand-in server (a Python child) that forks a member of its group and dies first, as vLLM's API
server does when it is killed while its engine-core process lives on.
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from engine_sidecar.vllm.process import EngineProcess

# The group leader starts a member that ignores SIGTERM, and exits at once.
_LEADER = """
import signal, subprocess, sys
member = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
"""


async def test_a_stop_after_the_server_died_returns_only_once_its_group_is_gone() -> None:
    proc = await EngineProcess.start([sys.executable, "-c", _LEADER], dict(os.environ))
    assert await proc.wait() == 0  # the server is gone; its member is not
    os.killpg(proc.pid, 0)  # the group still has a member: this does not raise
    status = await asyncio.wait_for(proc.stop(timeout_s=1.0), 5.0)
    assert status == 0
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)


async def test_a_stop_of_a_running_group_ends_every_member() -> None:
    proc = await EngineProcess.start(
        [sys.executable, "-c", _LEADER + "import time; time.sleep(60)\n"], dict(os.environ))
    await asyncio.sleep(0.5)  # the member is started
    await asyncio.wait_for(proc.stop(timeout_s=0.5), 5.0)
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
