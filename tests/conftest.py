"""Shared harness: one local Ray cluster per test session (starting one costs ~4 s), torch on
one thread for the modules that ask (`one_thread`), and the CPU hog of the load harness
(`pytest --cpu-hog N`, `make test-under-load`; docs/testing.md).

Tests wait on events, never on fixed sleeps: `until(what, condition)` from tests/waiting.py.
What several files build the same way (the in-process `World`, the engine `Recorder`, the
engine tests' prompts) is in tests/harness.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from waiting import _test_clock  # noqa: F401  (every test's deadline starts with it)

from laminar.cores import CLAIMS_ENV
from laminar.runtime import ray_env_defaults

ray_env_defaults()  # what a job laminar starts gives its Ray processes (nice 0, no auth)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the trainer cores other laminar jobs on this machine pin (laminar.cores): this session's own
# folder, so a job in another test session or a benchmark beside it does not turn `auto` off here
os.environ[CLAIMS_ENV] = tempfile.mkdtemp(prefix="laminar-test-claims-")

# A busy loop at normal priority: one process keeps one core busy for as long as it lives.
HOG = "while True: pass"
_hogs: list[subprocess.Popen] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-hog", type=int, default=0, metavar="N",
        help="run N busy-loop processes at normal priority for the whole session (the load "
             "harness: `make test-under-load` runs one per core)")


def pytest_configure(config: pytest.Config) -> None:
    n = config.getoption("--cpu-hog")
    if n < 0:
        raise pytest.UsageError(f"--cpu-hog={n}: give a number of busy-loop processes >= 0")
    for _ in range(n):
        _hogs.append(subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.DEVNULL))


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(os.environ[CLAIMS_ENV], ignore_errors=True)
    for p in _hogs:
        p.kill()
    for p in _hogs:
        p.wait()
    _hogs.clear()


def pytest_report_header(config: pytest.Config) -> str | None:
    if not _hogs:
        return None
    return (f"load harness: {len(_hogs)} busy-loop processes at normal priority "
            f"(pids {', '.join(str(p.pid) for p in _hogs)}) on {os.cpu_count()} cores")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _hogs:
        dead = [p.pid for p in _hogs if p.poll() is not None]
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        terminalreporter.write_line(
            f"load harness: {len(_hogs)} busy-loop processes ran the whole session"
            + (f" (but {dead} had exited: the load was lower)" if dead else "")
            + f"; load average now {load}")


@pytest.fixture(scope="session")
def ray_cluster():
    """A real embedded Ray cluster, shared by every test that asks for it."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=True,
                 configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`):
    tiny matmuls gain nothing from a second thread, and on a shared 2-core machine OpenMP
    waiting on a busy core makes every op slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
