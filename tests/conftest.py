"""Shared fixtures: live servers on free ports, started once per test session."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import importlib.abc
import pytest

if TYPE_CHECKING:
    from loadtest.server import ServerProcess


def _triton_interpreter_without_a_gpu() -> None:
    """Without a GPU, Triton kernels (`kernels/triton_per_head.py`) run under Triton's
    interpreter. Triton decides it when a function is decorated, its own library's helpers
    (tl.zeros, tl.sum, ...) included, so this must precede the first import of triton (SGLang
    imports it); the environment variable is then removed, so that the servers the tests start
    do not inherit it, and the in-process switch keeps later kernels interpreted."""
    import torch

    if torch.cuda.is_available() or "triton" in sys.modules:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError:
        return
    finally:
        del os.environ["TRITON_INTERPRET"]
    triton.knobs.runtime.interpret = True


_triton_interpreter_without_a_gpu()


def _a_share_of_the_cores_per_worker() -> None:
    """With several pytest-xdist workers, the servers each worker starts get that worker's share
    of the cores (inherited by the scheduler processes), as the local cluster gives its workers:
    otherwise two busy servers with a thread per core each spin against each other (a SmolLM2
    test module took 2.6x its time alone, one test 5.7x)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        try:  # imported only here: it needs the server's packages (the HTTP stack)
            from sgl_kvc.server_process import cpu_share_env
        except ImportError:  # a machine without them (`.ci/gpu`'s core stage) starts no server
            return
        os.environ.update(cpu_share_env(workers))


_a_share_of_the_cores_per_worker()


def _an_inductor_cache_per_cpu_capability() -> None:
    """PyTorch 2.13's on-disk inductor cache does not tell kernels compiled under one ATen CPU
    capability from another's: after a default run, a run under `ATEN_CPU_CAPABILITY=avx2` on the
    same machine loads the cached kernel of SGLang's compiled vocabulary mask
    (`get_masked_input_and_mask`, used with `--tp-size 2`) and gets garbage token ids, and its
    scheduler dies in the embedding. A fresh cache compiles it right, so each capability gets its
    own cache folder (the servers the tests start inherit it). A folder the user chose is kept."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    import torch
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    capability = torch.backends.cpu.get_cpu_capability().lower()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}-{capability}"


_an_inductor_cache_per_cpu_capability()

# The servers the tests start are idle when a test module is done with them: SIGKILL at once rather
# than the 5 s SGLang takes to notice a SIGTERM (`sgl_kvc.server_process.stop_all`); about 30
# servers a run. A test of the graceful stop passes its own wait.
os.environ.setdefault("SGLKVC_STOP_GRACE_S", "0")


# What a machine with only PyTorch and Triton lacks (a GPU image with no SGLang, `.ci/gpu`): SGLang
# and the HTTP server stack sgl-kvc's server runs on.
SERVING_PACKAGES = ("sglang", "sgl_kernel", "fastapi", "starlette", "uvicorn", "openai")


class _NoSGLang(importlib.abc.MetaPathFinder):
    """`--without-sglang`: importing SGLang or its server stack fails, as on a machine that has
    only PyTorch (and Triton): the plain-torch core (`tests/core`) must not need them."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname.split(".", 1)[0] in SERVING_PACKAGES:
            raise ModuleNotFoundError(f"No module named {fullname!r} (--without-sglang)", name=fullname)
        return None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--without-sglang", action="store_true",
        help="make `import sglang` (and its server stack) fail, to prove the tests run on PyTorch alone (tests/core)",
    )
    parser.addoption(
        "--fuzz-seed", type=int, default=None,
        help="the first seed of the request-mix fuzz test and of the hostile-client suite (default: each "
             "server's own CI seed)",
    )
    parser.addoption(
        "--fuzz-bursts", type=int, default=None,
        help="bursts of concurrent requests the request-mix fuzz test (default 3) and the hostile-client "
             "suite (default 1) send to each server (a longer run: more)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--without-sglang"):
        sys.meta_path.insert(0, _NoSGLang())
    # pytest-xdist's `--dist loadfile` orders the files by their number of tests unless told
    # not to (`--loadscope-reorder`, on by default), which put the few long SmolLM2 tests last,
    # undoing `LONGEST_FIRST`: the files go in the order collected (below).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# The modules that take longest (several servers, or the 30-layer model), started first: with
# two workers taking one file at a time, a long file left for the end keeps one worker busy
# alone while the other idles.
LONGEST_FIRST = ("test_smollm2_pass_keys.py", "test_smollm2.py", "test_tensor_parallel.py",
                 "test_fp8_serving.py", "test_failure_isolation.py", "test_long_prompts.py", "test_scheduler_moments.py",
                 "test_cluster.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order kept within
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """`SGLKVC_INSTAFAIL=1`: a failure's traceback is printed when it happens, not at the end of
    the run: a run cut short by its time box (`.ci/gpu` on a leased GPU) still says why each test
    that ran failed. With pytest-xdist this runs in the controller, on the workers' reports."""
    if report.failed and os.environ.get("SGLKVC_INSTAFAIL") == "1":
        text = report.longreprtext
        print(f"\n!! {report.nodeid} ({report.when}) failed:\n{text[-4000:]}\n", file=sys.stderr, flush=True)


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """Tiny tensors on a shared 2-core machine: intra-op threads only add wake-up latency."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def request_mix(request: pytest.FixtureRequest):
    """`run(server, ci_seed)`: the request-mix fuzz test (`tests/request_mix.py`) against a live
    server: `--fuzz-bursts` bursts of 12 concurrent requests from seed `--fuzz-seed` (else
    `ci_seed`). Returns what it sent."""
    from request_mix import run_bursts

    seed, bursts = request.config.getoption("--fuzz-seed"), request.config.getoption("--fuzz-bursts")

    def run(server: ServerProcess, ci_seed: int, **kw) -> dict[str, int]:
        counts = run_bursts(server, ci_seed if seed is None else seed, 3 if bursts is None else bursts,
                            per_burst=12, **kw)
        print(f"request mix: {counts}")
        return counts

    return run


@pytest.fixture(scope="session")
def hostile_documents(request: pytest.FixtureRequest):
    """`run(server, ci_seed, flags, long)`: the hostile-client suite for shared documents and KVzip
    (`tests/hostile_documents.py`) against a live server: bursts of about 16 hostile requests and 6
    of the request mix at once, `--fuzz-bursts` of them (default 1) from seed `--fuzz-seed` (else
    `ci_seed`). `flags`: the server's command line (what a document always keeps on it follows);
    `long`: the tokens of a document its clients hang up on while it is compressed. Returns what
    it sent."""
    from hostile_documents import Target, document_floor_of, run_bursts

    seed, bursts = request.config.getoption("--fuzz-seed"), request.config.getoption("--fuzz-bursts")

    def run(server: ServerProcess, ci_seed: int, flags: list[str], long: int) -> dict[str, int]:
        info = server.get("/server_info").json()
        target = Target(model=server.get("/v1/models").json()["data"][0]["id"], floor=document_floor_of(flags),
                        max_prompt=int(info["max_req_input_len"]) - 1, long=long)
        counts = run_bursts(server, target, ci_seed if seed is None else seed, 1 if bursts is None else bursts,
                            hostile=16, ordinary=6)
        print(f"hostile clients: {counts}")
        return counts

    return run


@pytest.fixture(scope="session", autouse=True)
def prelauncher(request: pytest.FixtureRequest) -> Iterator[None]:
    """One process per worker that has imported SGLang forks the CPU servers the tests start
    (`sgl_kvc/prelaunch.py`): each saves the 10-11 s of CPU its launcher spends importing, about
    half of a server's start. `SGLKVC_PRELAUNCH=0` starts every server as usual;
    `SGLKVC_PRELAUNCH_LOG=FILE` keeps the prelauncher's log (what it forked, what it refused)."""
    import subprocess
    import tempfile

    import torch

    if (request.config.getoption("--without-sglang") or os.environ.get("SGLKVC_PRELAUNCH") == "0"
            or torch.cuda.is_available()):  # CUDA does not survive a fork
        yield
        return
    from sgl_kvc.prelaunch import SOCKET_ENV, pid_file

    folder = Path(tempfile.mkdtemp(prefix="kvc-pre-"))  # a short path: a Unix socket's is at most 107 bytes
    path = str(folder / "sock")
    log = open(folder / "prelauncher.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "sgl_kvc.prelaunch", path], stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT)
    pid_file(path).write_text(str(proc.pid))
    os.environ[SOCKET_ENV] = path
    try:
        yield
    finally:
        del os.environ[SOCKET_ENV]
        proc.kill()
        proc.wait()
        log.close()
        import shutil

        if os.environ.get("SGLKVC_PRELAUNCH_LOG"):
            shutil.copy(folder / "prelauncher.log", os.environ["SGLKVC_PRELAUNCH_LOG"])
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def standin_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("standins") / "standins.log"


@pytest.fixture(scope="session")
def kvc_server(standin_log: Path, demo_model_path: str) -> Iterator[ServerProcess]:
    """`python -m sgl_kvc.launch` on the demo model, default flags (policy none). The model is
    built first, here: a launcher that builds it uses torch and then spawns its workers."""
    from loadtest.server import ServerProcess

    env = {"SGLKVC_STANDIN_LOG": str(standin_log)}
    with ServerProcess.launch(
        [sys.executable, "-m", "sgl_kvc.launch", "--model-path", "demo"], env=env
    ) as server:
        yield server


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A compaction trace file (`SGLKVC_TRACE`) for the module's compressing server."""
    return tmp_path_factory.mktemp("trace") / "compactions.jsonl"


@pytest.fixture(scope="session")
def demo_model_path() -> str:
    from sgl_kvc.model import ensure_demo_model

    return str(ensure_demo_model())


@pytest.fixture(scope="session")
def openai_client(kvc_server: ServerProcess):
    from request_mix import openai_client

    return openai_client(kvc_server.url, timeout=600)


def pytest_report_header(config: pytest.Config) -> str:
    return f"sgl-kvc tests; SGLKVC_CACHE={os.environ.get('SGLKVC_CACHE', '(default)')}"
