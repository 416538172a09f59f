"""The compiled step boundary: the backend over a fake extension, load(), build(), the CLI;
and, on a GPU, the real extension against torch's own figures."""

from __future__ import annotations

import json
import statistics
import os
import subprocess
import sys
import types

import pytest
import torch

import stepprof
from stepprof import _native
from stepprof._device import compiled
from stepprof._device.backend import MARK, POP, PUSH, READ, RESET
from stepprof._device.compiled import CompiledCudaBackend
from stepprof._errors import BuildError

from stepprof._recorder.profiler import _make_profiler

from .conftest import steps
from .fakes import FakeEvent, FakeGpu
from .report_helpers import cli


class FakeBoundary:
    """The compiled boundary's C API in Python, over a FakeGpu: events are int handles."""

    ABI = compiled.ABI
    NVTX = True
    CUDA = True
    MARK, READ, RESET, PUSH, POP = MARK, READ, RESET, PUSH, POP

    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self.events: dict[int, FakeEvent | None] = {}  # handle -> its last record (None: never)
        self.created: list[tuple[int, int]] = []
        self.destroyed: list[int] = []
        self.boundaries: list[tuple[int, int, int, str | None]] = []
        self.synchronized: list[int] = []
        self.reads: list[tuple] = []
        self.capturing = False
        self._next = 0x7F00_0000

    def _recorded(self, ev: int) -> FakeEvent:
        if self.events.get(ev) is None:
            raise RuntimeError("stepprof boundary: cudaEventQuery failed: invalid resource handle")
        return self.events[ev]

    def event_create(self, device: int) -> int:
        self._next += 0x40
        self.events[self._next] = None
        self.created.append((device, self._next))
        return self._next

    def event_destroy(self, ev: int) -> None:
        del self.events[ev]
        self.destroyed.append(ev)

    def event_query(self, ev: int) -> bool:
        return self.gpu.is_done(self._recorded(ev))

    def event_elapsed_ms(self, a: int, b: int) -> float:
        return self.gpu.elapsed_ms(self._recorded(a), self._recorded(b))

    def read_marks(self, marks: tuple) -> tuple | None:
        times = self.gpu.read_marks(tuple(None if m is None else self._recorded(m) for m in marks))
        self.reads.append((marks, times))
        return times

    def event_synchronize(self, ev: int) -> None:
        self.synchronized.append(ev)
        self.gpu.host_ns = max(self.gpu.host_ns, self._recorded(ev).t_ns)

    def boundary(self, device: int, ev: int, flags: int, name: str | None):
        self.boundaries.append((device, ev, flags, name))
        if flags & POP:
            self.gpu.range_pop()
        mark = None
        if flags & MARK and ev and not self.capturing:
            self.events[ev] = self.gpu.mark()
            mark = ev
        mem = self.gpu.read_memory() if flags & READ else None
        if flags & RESET:
            self.gpu.reset_peak()
        if flags & PUSH:
            self.gpu.range_push(name)
        return mark, mem


@pytest.fixture
def torch_cuda_calls(monkeypatch):
    """The torch calls CudaBackend.__init__ looks up, present on a CPU build too; and a tool
    attached to NVTX (else no range is pushed)."""
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda i: {}, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", lambda i: None, raising=False)
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/a/tool/libinjection.so")


def backend(gpu: FakeGpu, **kw) -> tuple[CompiledCudaBackend, FakeBoundary]:
    module = FakeBoundary(gpu)
    kw.setdefault("syncs", "off")
    return CompiledCudaBackend(0, module, **kw), module


# -- the backend over a fake extension ---------------------------------------------


def test_cross_is_one_call_that_marks_reads_and_resets(torch_cuda_calls, gpu):
    b, m = backend(gpu)
    assert b.boundary == "compiled" and b.has_device_timing and b.index == 0
    gpu.alloc(100)
    start, mem = b.cross(MARK | READ | RESET | PUSH, "step 1")
    assert isinstance(start, int) and mem == (100, 100, 0, 0, 0, 0)
    assert m.boundaries == [(0, start, MARK | READ | RESET | PUSH, "step 1")]
    assert gpu.ranges == ["+step 1"]
    gpu.launch(3.0)
    end, _ = b.cross(MARK | READ | POP)
    assert end != start and len(m.created) == 2 and gpu.ranges == ["+step 1", "-"]
    assert not b.is_done(end)
    gpu.wait_idle()
    assert b.is_done(start) and b.is_done(end) and b.is_done(None)
    assert b.elapsed_ms(start, end) == pytest.approx(3.0)


def test_released_events_are_reused_and_a_boundary_without_a_mark_uses_none(torch_cuda_calls, gpu):
    b, m = backend(gpu)
    first = b.mark()
    b.release(first)
    b.release(None)
    assert b.mark() == first and len(m.created) == 1  # from the pool, not a new event
    b.cross(READ | RESET)
    assert m.boundaries[-1] == (0, 0, READ | RESET, None)  # no event taken for a boundary without MARK
    assert len(m.created) == 1


def test_an_unrecorded_event_goes_back_to_the_pool_during_a_graph_capture(torch_cuda_calls, gpu):
    b, m = backend(gpu)
    m.capturing = True
    mark, mem = b.cross(MARK | READ)
    assert mark is None and mem is not None
    m.capturing = False
    again = b.mark()
    assert again is not None and len(m.created) == 1  # the same event, now recorded


def test_an_error_in_the_call_returns_the_event_to_the_pool(torch_cuda_calls, gpu):
    b, m = backend(gpu)
    gpu.fail_on = "read_memory"
    with pytest.raises(RuntimeError, match="fake failure"):
        b.cross(MARK | READ)
    gpu.fail_on = None
    b.mark()
    assert len(m.created) == 1


def test_nvtx_off_masks_push_and_pop(torch_cuda_calls, gpu):
    b, m = backend(gpu, nvtx=False)
    b.cross(MARK | PUSH, "step 1")
    b.cross(MARK | POP)
    assert [f for _, _, f, _ in m.boundaries] == [MARK, MARK] and gpu.ranges == []


def test_without_a_tool_attached_to_nvtx_no_range_is_pushed(torch_cuda_calls, gpu, monkeypatch):
    monkeypatch.delenv("NVTX_INJECTION64_PATH")
    b, m = backend(gpu)                      # nvtx=True, the default
    b.cross(MARK | PUSH, "step 1")
    b.cross(MARK | POP)
    assert [f for _, _, f, _ in m.boundaries] == [MARK, MARK] and gpu.ranges == []
    module = FakeBoundary(gpu)
    module.NVTX = False                      # nor through torch
    b = CompiledCudaBackend(0, module, syncs="off")
    b.cross(MARK | PUSH, "step 1")
    assert not b._py_ranges and not hasattr(b, "_push")


def test_an_extension_built_without_nvtx_pushes_the_ranges_through_torch(torch_cuda_calls, gpu):
    module = FakeBoundary(gpu)
    module.NVTX = False
    b = CompiledCudaBackend(0, module, syncs="off")
    pushed: list[str] = []
    b._push, b._pop = (lambda name: pushed.append("+" + name)), (lambda: pushed.append("-"))
    b.cross(MARK | READ | RESET | PUSH, "step 1")
    b.cross(MARK | POP)
    assert pushed == ["+step 1", "-"] and gpu.ranges == []
    assert [f for _, _, f, _ in module.boundaries] == [MARK | READ | RESET, MARK]


def test_every_backend_call_works_on_int_handles(torch_cuda_calls, gpu):
    b, m = backend(gpu)
    gpu.alloc(50)
    assert b.read_memory()[:2] == (50, 50)
    gpu.free(50)
    b.reset_peak()
    assert b.read_memory()[0] == 0
    a = b.mark()
    gpu.launch(2.0)
    z = b.mark()
    b.wait([a, None, z])
    assert m.synchronized == [a, z] and b.is_done(z)
    b.release(a)
    b.release(z)
    del b
    assert sorted(m.destroyed) == sorted([a, z])  # pooled events are destroyed with the backend


def test_the_collector_reads_a_step_and_its_phases_in_one_call(torch_cuda_calls, gpu, log):
    b, m = backend(gpu)
    with _make_profiler(log, backend=b, clock=gpu.clock, collect_every_s=None, warmup=0) as prof:
        for _ in range(3):
            with prof.step():
                for name, ms in (("forward", 2.0), ("backward", 3.0), ("forward", 1.0)):
                    with prof.measure(name):
                        gpu.launch(ms)
            gpu.wait_idle()
    recs = steps(log)
    assert [r["phases"]["forward"]["gpu_ms"] for r in recs] == pytest.approx([3.0] * 3)
    assert [r["phases"]["backward"]["gpu_ms"] for r in recs] == pytest.approx([3.0] * 3)
    assert [r["gpu_ms"] for r in recs] == pytest.approx([6.0] * 3)
    # One read per step (the step's pair, forward's two runs, backward's), each completed
    # when it was read: nothing is queried or timed one mark at a time.
    read = [marks for marks, times in m.reads if times is not None]
    assert len(read) == 3 and all(len(r) == 8 for r in read)
    # (start, end, forward's runs (start, e1) and (e2, e3), backward's (e1, e2)): top-level
    # phases share the boundary events, and each goes back to the pool once.
    assert all(r[2] == r[0] and r[6] == r[3] and r[7] == r[4] and len(set(r)) == 5 for r in read)
    assert len(m.created) <= 10


def test_a_profiler_on_the_compiled_backend_records_gpu_time_and_peaks(torch_cuda_calls, gpu, log):
    b, m = backend(gpu)
    with _make_profiler(log, backend=b, clock=gpu.clock, collect_every_s=None, warmup=0) as prof:
        for i in range(4):
            with prof.step():
                gpu.alloc(1000 * (i + 1))
                gpu.launch(5.0)
                gpu.host(1.0)
                gpu.free(1000 * (i + 1))
            gpu.wait_idle()
    recs = steps(log)
    assert [r["gpu_ms"] for r in recs] == pytest.approx([5.0] * 4)
    assert [r["peak_allocated_bytes"] for r in recs] == [1000, 2000, 3000, 4000]
    assert all(r["device"] == "cuda:0" for r in recs)
    assert 0 < len(m.created) <= 4  # events came back to the pool and were reused


# -- cache_dir, load() ---------------------------------------------------------------


def test_cache_dir_is_keyed_by_torch_cuda_python_and_source(monkeypatch, tmp_path):
    monkeypatch.setenv("STEPPROF_CACHE_DIR", str(tmp_path))
    d = compiled.cache_dir()
    parent, key = os.path.split(d)
    assert parent == str(tmp_path / "boundary")
    assert key.startswith(f"torch-{torch.__version__}-cuda-{torch.version.cuda}-{sys.implementation.cache_tag}-")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu128")
    other = compiled.cache_dir()
    assert other != d and "torch-2.11.0+cu128-cuda-12.8-" in other
    src = tmp_path / "boundary.cpp"
    src.write_text("// another source\n")
    monkeypatch.setattr(compiled, "_SOURCE", str(src))
    assert compiled.cache_dir()[-12:] != other[-12:]  # the source's hash


def test_cache_dir_falls_back_to_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("STEPPROF_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compiled.cache_dir().startswith(str(tmp_path / "xdg" / "stepprof" / "boundary") + os.sep)
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compiled.cache_dir().startswith(str(tmp_path / "home" / ".cache" / "stepprof" / "boundary"))


@pytest.fixture
def cuda_torch(monkeypatch, tmp_path):
    """A torch that says it has CUDA 12.8, with stepprof's cache in tmp_path."""
    monkeypatch.setenv("STEPPROF_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.version, "cuda", "12.8")


def test_load_on_a_cpu_torch_without_a_build_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("STEPPROF_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.version, "cuda", None)
    module, reason = compiled.load()
    assert module is None and f"not built for torch {torch.__version__} (CPU)" in reason


def test_load_without_a_build_says_to_run_stepprof_build(cuda_torch):
    module, reason = compiled.load()
    assert module is None
    assert "not built" in reason and "CUDA 12.8" in reason and torch.__version__ in reason
    assert reason.endswith("run `stepprof build`")
    assert compiled.status() == {"built": False, "path": None, "reason": reason}


def test_a_corrupt_library_is_a_reason_not_a_crash(cuda_torch):
    d = compiled.cache_dir()
    os.makedirs(d)
    with open(os.path.join(d, "stepprof_boundary.so"), "wb") as f:
        f.write(b"\x7fELF not really a library")
    module, reason = compiled.load()
    assert module is None and "did not load (ImportError" in reason and "run `stepprof build`" in reason


def _built(monkeypatch, fake) -> None:
    """Pretend the library exists and loading it gives ``fake``."""
    d = compiled.cache_dir()
    os.makedirs(d)
    open(os.path.join(d, "stepprof_boundary.so"), "wb").close()
    import importlib.machinery

    loader = importlib.machinery.ExtensionFileLoader
    monkeypatch.setattr(loader, "create_module", lambda self, spec: types.ModuleType(spec.name))
    monkeypatch.setattr(
        loader, "exec_module",
        lambda self, module: module.__dict__.update(
            {k: getattr(fake, k) for k in ("ABI", "NVTX", "CUDA", "MARK", "READ", "RESET", "PUSH", "POP")}),
    )


def test_load_checks_the_abi_and_the_flags(monkeypatch, cuda_torch, gpu):
    from stepprof import _registry

    fake = FakeBoundary(gpu)
    fake.ABI = compiled.ABI + 1
    _built(monkeypatch, fake)
    module, reason = compiled.load()
    assert module is None and f"C API {compiled.ABI + 1}, this stepprof needs {compiled.ABI}" in reason
    _registry.reset()  # load() answers once per process; the registry forgets the answer
    fake.ABI, fake.RESET = compiled.ABI, 64
    module, reason = compiled.load()
    assert module is None and "flag RESET is 64, stepprof's is 4" in reason
    _registry.reset()
    fake.RESET = RESET
    module, reason = compiled.load()
    assert reason is None and module.ABI == compiled.ABI
    assert compiled.load()[0] is module  # cached
    status = compiled.status()
    assert status["built"] and status["path"].endswith("stepprof_boundary.so")


def test_load_never_raises(monkeypatch, cuda_torch):
    def boom():
        raise OSError("disk on fire")

    monkeypatch.setattr(compiled, "cache_dir", boom)
    module, reason = compiled.load()
    assert module is None and "OSError: disk on fire" in reason


# -- build() -------------------------------------------------------------------------


@pytest.fixture
def tools(monkeypatch, tmp_path, cuda_torch):
    """Every tool build() checks for is there; a test takes one away."""
    from torch.utils import cpp_extension

    home = tmp_path / "cuda"
    (home / "include").mkdir(parents=True)
    (home / "include" / "cuda_runtime_api.h").write_text("")
    (home / "include" / "crt").mkdir()
    (home / "include" / "crt" / "host_defines.h").write_text("")
    (home / "lib64").mkdir()
    (home / "lib64" / "libcudart.so").write_text("")
    monkeypatch.setattr(compiled, "_wheel_cuda", lambda: None)  # no nvidia-* wheels: the toolkit
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(compiled.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(home))
    loads: list[dict] = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: loads.append(kw) or FakeBoundary(FakeGpu()))
    return loads


def test_build_compiles_into_the_cache_dir(tools):
    report = compiled.build()
    assert report.path == os.path.join(compiled.cache_dir(), "stepprof_boundary.so") and report.seconds >= 0
    (kw,) = tools
    assert kw["name"] == "stepprof_boundary" and kw["build_directory"] == compiled.cache_dir()
    assert kw["sources"][0].endswith("boundary.cpp") and os.path.isfile(kw["sources"][0])
    assert kw["with_cuda"] is False
    assert kw["extra_cflags"] == ["-O2", "-DSTEPPROF_CUDA=1", "-DSTEPPROF_CUDA_HEADERS=1"]
    home = cpp_extension_home()
    assert kw["extra_include_paths"] == [os.path.join(home, "include")]
    assert kw["extra_ldflags"] == ["-lc10_cuda", os.path.join(home, "lib64", "libcudart.so"),
                                   f"-Wl,-rpath,{os.path.join(home, 'lib64')}"]
    assert kw["verbose"] is False
    assert compiled.load()[1] is None  # the module just built is the one loaded
    with pytest.raises(attrs_frozen_error()):
        report.seconds = 0.0


def cpp_extension_home():
    from torch.utils import cpp_extension

    return cpp_extension.CUDA_HOME


def test_the_wheels_headers_and_runtime_come_before_a_toolkit(monkeypatch, tmp_path, cuda_torch):
    """A pip-installed CUDA 12 torch brings the runtime's headers and library in nvidia-*
    wheels: the build uses those, and no toolkit (CUDA_HOME) is needed."""
    from torch.utils import cpp_extension

    site = tmp_path / "site"
    for pkg, lib in (("cuda_runtime", "libcudart.so.12"), ("nvtx", None)):
        (site / "nvidia" / pkg / "include").mkdir(parents=True)
        if lib:
            inc = site / "nvidia" / pkg / "include"
            (inc / "cuda_runtime_api.h").write_text("")
            (inc / "crt").mkdir()
            (inc / "crt" / "host_defines.h").write_text("")
            (site / "nvidia" / pkg / "lib").mkdir()
            (site / "nvidia" / pkg / "lib" / lib).write_text("")
    monkeypatch.setattr(compiled.sys, "path", [str(site)])
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    how = compiled._cuda_build()
    base = site / "nvidia" / "cuda_runtime"
    assert how.how == "the nvidia-* wheels' headers" and how.cflags == ["-DSTEPPROF_CUDA_HEADERS=1"]
    assert how.includes == [str(base / "include"), str(site / "nvidia" / "nvtx" / "include")]
    assert how.ldflags[1] == str(base / "lib" / "libcudart.so.12")


def test_without_complete_headers_the_boundary_builds_against_the_runtime_torch_loads(
        monkeypatch, tmp_path, cuda_torch):
    """The CUDA 13 wheels ship cuda_runtime_api.h without crt/ (it comes with nvcc), and there
    may be no toolkit: the boundary then declares the runtime calls it makes and finds them
    in the libcudart torch loaded, by soname."""
    from torch.utils import cpp_extension

    inc = tmp_path / "site" / "nvidia" / "cu13" / "include"
    inc.mkdir(parents=True)
    (inc / "cuda_runtime_api.h").write_text("")
    (inc.parent / "lib").mkdir()
    (inc.parent / "lib" / "libcudart.so.13").write_text("")
    monkeypatch.setattr(compiled.sys, "path", [str(tmp_path / "site")])
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    how = compiled._cuda_build()
    assert how.cflags == ["-DSTEPPROF_CUDA_HEADERS=0", "-DSTEPPROF_CUDART_MAJOR=13"]
    assert how.includes == [] and how.ldflags == ["-ldl"] and "libcudart.so.13" in how.how


def attrs_frozen_error():
    import attrs

    return attrs.exceptions.FrozenInstanceError


@pytest.mark.parametrize(
    "take_away, words",
    [
        ("compiler", ["no C++ compiler", "no `c++` on PATH", "apt-get install g++", "$CXX"]),
        ("cxx", ["no C++ compiler", "$CXX is 'clang++-99', not found"]),
        ("ninja", ["ninja is not installed", "pip install ninja"]),
    ],
)
def test_build_names_what_is_missing_and_the_fix(monkeypatch, tools, tmp_path, take_away, words):
    from torch.utils import cpp_extension

    if take_away == "compiler":
        monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    elif take_away == "cxx":
        monkeypatch.setenv("CXX", "clang++-99")
        monkeypatch.setattr(compiled.shutil, "which", lambda name: None if name == "clang++-99" else name)
    else:
        monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with pytest.raises(BuildError) as info:
        compiled.build()
    msg = str(info.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg
    assert tools == []  # nothing was compiled


def test_a_compile_error_is_a_build_error_with_the_compilers_message(monkeypatch, tools):
    from torch.utils import cpp_extension

    def fail(**kw):
        raise RuntimeError("Error building extension 'stepprof_boundary': boundary.cpp:12: error: oops")

    monkeypatch.setattr(cpp_extension, "load", fail)
    with pytest.raises(BuildError, match="boundary.cpp:12: error: oops") as info:
        compiled.build()
    assert "stepprof build --verbose" in str(info.value)


def test_build_on_a_cpu_torch_builds_the_host_core(monkeypatch, tools):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(FakeBoundary, "CUDA", False)
    report = compiled.build()
    (kw,) = tools
    assert kw["extra_cflags"] == ["-O2", "-DSTEPPROF_CUDA=0"] and kw["extra_ldflags"] == []
    assert kw["extra_include_paths"] == [] and "cuda-None" in report.path


# -- the CLI -------------------------------------------------------------------------


def test_stepprof_build_prints_where_it_went(capsys, tools):
    rc, out, _ = cli(capsys, "build", "--verbose")
    assert rc == 0 and compiled.cache_dir() in out and " s)" in out
    assert tools[0]["verbose"] is True
    assert f"the C module (the step core, the fold of the summary and report) is ready in {_native.cache_dir()}" in out


def test_stepprof_build_with_a_missing_tool_prints_the_reason_and_exits_1(monkeypatch, capsys, tools):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    rc, out, err = cli(capsys, "build")
    assert rc == 1 and out.count("\n") == 1 and "C module" in out  # (the C module needs no ninja)
    assert err.count("\n") == 1 and "pip install ninja" in err


def test_stepprof_env_shows_the_boundary(monkeypatch, capsys, cuda_torch):
    rc, out, _ = cli(capsys, "env")
    line = next(x for x in out.splitlines() if x.startswith("step boundary"))
    env = json.loads(cli(capsys, "env", "--json")[1])["boundary"]
    if torch.cuda.is_available():
        assert env["used"] == "python" and "stepprof build" in env["reason"] and "python: " in line
    else:
        assert env["used"] == "none" and env["reason"].startswith("CUDA is not available")
        assert "none: CUDA is not available" in line
    assert env["saving_us"] == compiled.SAVING_US


def test_stepprof_env_shows_a_loaded_boundary_as_compiled(monkeypatch, capsys):
    from stepprof import _env

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(compiled, "status", lambda: {"built": True, "path": "/c/b.so", "reason": None})
    assert _env._boundary(None) == {
        "used": "compiled", "path": "/c/b.so", "reason": None, "saving_us": compiled.SAVING_US}
    monkeypatch.setattr(compiled, "status", lambda: {"built": False, "path": None, "reason": "not built"})
    row = _env._boundary_row(_env._boundary(None))
    saving = compiled.SAVING_US["h200_launch_bound_step"]
    assert row == (f"python: not built; `stepprof build` compiles one that saves ~{saving:.0f} µs a step "
                   f"on a host-bound H200 loop")


# -- on a GPU ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built():
    """`stepprof build` (compiles, or finds the cache), then load()."""
    proc = subprocess.run(
        [sys.executable, "-m", "stepprof", "build"], capture_output=True, text=True, timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the compiled boundary is ready in" in proc.stdout
    module, reason = compiled._load()
    assert reason is None, reason
    return module


def _torch_figures(dev: int) -> tuple[int, ...]:
    s = torch._C._cuda_memoryStats(dev)
    return (
        s["allocated_bytes"]["all"]["peak"], s["reserved_bytes"]["all"]["current"],
        s["num_alloc_retries"], s["num_sync_all_streams"], s["num_device_alloc"], s["num_device_free"],
    )


@pytest.mark.cuda
def test_the_built_boundary_loads_with_the_flags_and_abi(built):
    assert built.ABI == compiled.ABI and built.CUDA is True
    # NVTX ranges go through the extension where it was built with NVTX's headers (a toolkit's),
    # else through torch's bindings (CompiledCudaBackend._py_ranges).
    assert isinstance(built.NVTX, bool)
    assert (built.MARK, built.READ, built.RESET, built.PUSH, built.POP) == (MARK, READ, RESET, PUSH, POP)


@pytest.mark.cuda
def test_a_read_equals_torchs_figures_and_reset_resets_the_peak(built):
    dev = torch.cuda.current_device()
    before = torch.cuda.memory_allocated(dev)  # what earlier tests left allocated
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device=dev)
    del x
    torch.cuda.synchronize()
    _, mem = built.boundary(dev, 0, READ, None)
    assert mem == _torch_figures(dev)
    assert mem[0] >= 64 * 2**20
    _, mem = built.boundary(dev, 0, RESET | READ, None)  # READ comes before RESET
    assert mem[0] >= before + 64 * 2**20
    _, after = built.boundary(dev, 0, READ, None)
    assert after[0] == torch.cuda.memory_allocated(dev) < before + 64 * 2**20
    assert after == _torch_figures(dev)


@pytest.mark.cuda
def test_elapsed_between_compiled_marks_agrees_with_torch_events(built):
    dev = torch.cuda.current_device()
    b = CompiledCudaBackend(dev, built)
    a = torch.randn(4096, 4096, device=dev)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ratios = []
    for _ in range(5):
        start, _ = b.cross(MARK)
        t0.record()
        for _ in range(20):
            a @ a
        t1.record()
        end, _ = b.cross(MARK)
        b.wait([end])
        assert b.is_done(start) and b.is_done(end)
        ratios.append(b.elapsed_ms(start, end) / t0.elapsed_time(t1))
        b.release(start)
        b.release(end)
    assert sorted(ratios)[2] == pytest.approx(1.0, rel=0.05)


@pytest.mark.cuda
def test_a_mark_inside_a_graph_capture_is_none_and_the_capture_succeeds(built):
    dev = torch.cuda.current_device()
    b = CompiledCudaBackend(dev, built, syncs="off")
    x = torch.ones(1024, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x * 2  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mark, mem = b.cross(MARK | READ | RESET)
        y = x * 2
    assert mark is None and mem is not None
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 2.0))
    assert b.mark() is not None  # outside the capture, the pooled event records


@pytest.mark.cuda
def test_a_bad_event_handle_raises_and_torch_still_works(built):
    dev = torch.cuda.current_device()
    ev = built.event_create(dev)
    with pytest.raises(RuntimeError, match="cudaEventElapsedTime failed"):
        built.event_elapsed_ms(ev, ev)  # never recorded
    with pytest.raises(RuntimeError, match="event handle 0"):
        built.event_query(0)
    built.event_destroy(ev)
    x = torch.ones(1000, device=dev) * 3  # the next kernel launch and its check still succeed
    torch.cuda.synchronize()
    assert x.sum().item() == 3000.0
    assert torch.cuda.current_stream().query()


@pytest.mark.cuda
def test_read_marks_waits_for_every_end_and_reads_each_pair(built):
    dev = torch.cuda.current_device()
    b = CompiledCudaBackend(dev, built, syncs="off")
    a = torch.randn(2048, 2048, device=dev)
    marks = [b.mark()]
    for _ in range(10):  # 10 pairs: past the call's small buffers (16 marks)
        a @ a
        marks.append(b.mark())
    torch.cuda._sleep(50_000_000)  # the last end is still running when it is read
    last = b.mark()
    flat = tuple(m for i in range(10) for m in (marks[i], marks[i + 1])) + (marks[0], last)
    assert built.read_marks(flat) is None
    b.wait([last])
    times = built.read_marks(flat)
    assert len(times) == 11
    for i in range(10):
        assert times[i] == pytest.approx(built.event_elapsed_ms(marks[i], marks[i + 1]), abs=1e-3)
    assert times[10] == pytest.approx(built.event_elapsed_ms(marks[0], last), abs=1e-3)
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):  # a start still running on another stream, its end done
        torch.cuda._sleep(50_000_000)
        started = b.mark()
    ended = b.mark()
    b.wait([ended])
    assert built.read_marks((started, ended)) is None  # not read yet (not lost as None)
    b.wait([started])
    assert built.read_marks((started, ended))[0] is not None
    never = built.event_create(dev)  # never recorded: queries as done, has no time
    assert built.read_marks((None, marks[1], marks[0], None, marks[0], never)) == (None, None, None)
    assert built.read_marks(()) == ()
    with pytest.raises(TypeError, match="even number of marks"):
        built.read_marks((marks[0],))
    with pytest.raises(TypeError, match="even number of marks"):
        built.read_marks([marks[0], marks[1]])
    built.event_destroy(never)
    x = torch.ones(1000, device=dev) * 3  # no error is left for the user's next check
    torch.cuda.synchronize()
    assert x.sum().item() == 3000.0


@pytest.mark.cuda
def test_a_profiler_on_the_real_compiled_backend(built, log):
    dev = torch.cuda.current_device()
    b = CompiledCudaBackend(dev, built, syncs="off")
    a = torch.randn(2048, 2048, device=dev)
    with _make_profiler(log, backend=b, warmup=0) as prof:
        for _ in range(5):
            with prof.step():
                a @ a
    recs = steps(log)
    assert len(recs) == 5 and all(r["gpu_ms"] > 0 and r["peak_allocated_bytes"] > 0 for r in recs)


@pytest.mark.cuda
def test_the_compiled_and_python_boundaries_agree_on_the_same_steps(built, tmp_path):
    """One deterministic GPU-bound step, run alternately under each boundary (as the user
    would choose it: Profiler(boundary=...)): the same peak to the byte on every step,
    phases included, the same median GPU time within 0.5%, and every field that is not a
    time equal."""
    torch.manual_seed(0)
    dev = torch.device("cuda", torch.cuda.current_device())
    layers = [m for _ in range(4) for m in (torch.nn.Linear(4096, 4096, dtype=torch.bfloat16), torch.nn.ReLU())]
    model = torch.nn.Sequential(*layers).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)

    def step(prof):
        with prof.step(batch_size=4096):
            with prof.measure("forward"):
                loss = model(x).float().pow(2).mean()
            with prof.measure("backward"):
                loss.backward()
            with prof.measure("optimizer"):
                opt.step()
                opt.zero_grad(set_to_none=True)

    profs = {b: stepprof.Profiler(str(tmp_path / f"{b}.jsonl"), boundary=b, phase_peaks_every=1)
             for b in ("compiled", "python")}
    for _ in range(30):
        for prof in profs.values():
            step(prof)
    # "compiled": every boundary but the first step's in the step core (stepprof/_core.c); "python": none
    assert profs["compiled"]._core.counts() == (30 * 4 - 1, 30 * 4) and profs["python"]._core is None
    summaries = {b: p.close() for b, p in profs.items()}
    assert {b: s.boundary for b, s in summaries.items()} == {"compiled": "compiled", "python": "python"}
    compiled_steps, python_steps = (steps(str(tmp_path / f"{b}.jsonl"))[2:] for b in ("compiled", "python"))
    times = {"start_unix_s", "wall_ms", "gpu_ms", "gpu_busy", "samples_per_s", "data_wait_ms", "overhead_us",
             "energy_j", "energy_span_ms", "run_id"}
    phase_times = {"wall_ms", "gpu_ms", "start_ms"}
    for c, p in zip(compiled_steps, python_steps, strict=True):
        assert c["peak_allocated_bytes"] == p["peak_allocated_bytes"] > 0
        for ph in ("forward", "backward", "optimizer"):
            assert c["phases"][ph]["peak_allocated_bytes"] == p["phases"][ph]["peak_allocated_bytes"]
        assert c["reserved_bytes"] == p["reserved_bytes"]
        assert c.keys() == p.keys()
        assert {k: v for k, v in c.items() if k not in times | {"phases", "unavailable"}} == {
            k: v for k, v in p.items() if k not in times | {"phases", "unavailable"}}
        timed = {"energy_j", "energy_span_ms"}  # whether a sample covers the step yet is a matter of time
        assert c["unavailable"].keys() - timed == p["unavailable"].keys() - timed
        assert {n: {k: v for k, v in f.items() if k not in phase_times} for n, f in c["phases"].items()} == {
            n: {k: v for k, v in f.items() if k not in phase_times} for n, f in p["phases"].items()}
    median_c = statistics.median(r["gpu_ms"] for r in compiled_steps)
    median_p = statistics.median(r["gpu_ms"] for r in python_steps)
    assert median_c == pytest.approx(median_p, rel=0.005)
    for ph in ("forward", "backward", "optimizer"):
        ph_c = statistics.median(r["phases"][ph]["gpu_ms"] for r in compiled_steps)
        ph_p = statistics.median(r["phases"][ph]["gpu_ms"] for r in python_steps)
        assert ph_c == pytest.approx(ph_p, rel=0.01, abs=0.005)


# -- choosing the boundary: Profiler(boundary=...) -------------------------------------


@pytest.fixture
def fake_built(monkeypatch, torch_cuda_calls):
    """CUDA up on device 0, and the compiled boundary 'built': load() returns a fake module."""
    from stepprof._device import select

    gpu = FakeGpu()
    module = FakeBoundary(gpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(select.compiled, "load", lambda: (module, None))
    return module


@pytest.mark.parametrize("boundary, chosen", [("auto", "compiled"), ("compiled", "compiled"), ("python", "python")])
def test_a_built_boundary_is_used_unless_python_is_asked_for(fake_built, boundary, chosen):
    from stepprof._device.select import select_backend

    b = select_backend(None, syncs="off", boundary=boundary)
    assert b.boundary == chosen and b.index == 0
    assert isinstance(b, CompiledCudaBackend) == (chosen == "compiled")


def test_without_a_build_auto_falls_back_to_python_and_compiled_is_refused_up_front(monkeypatch, torch_cuda_calls):
    from stepprof._device import select

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    why = "the compiled boundary is not built for torch 9.9 (run `stepprof build`)"
    monkeypatch.setattr(select.compiled, "load", lambda: (None, why))
    assert select.select_backend(None, syncs="off", boundary="auto").boundary == "python"
    with pytest.raises(stepprof.ConfigError, match=r"boundary='compiled', but the compiled boundary is not built"):
        stepprof.Profiler(None, boundary="compiled")
    select.check_compiled("auto")  # auto and python never raise
    select.check_compiled("python")


def test_the_summary_and_the_report_say_which_boundary_ran(tmp_path, torch_cuda_calls):
    from stepprof._recorder.profiler import _make_profiler
    from stepprof._report.build import build_report, report_log
    from stepprof._report.render import render

    log = str(tmp_path / "run.jsonl")
    gpu = FakeGpu()
    for b in (backend(gpu)[0], gpu):  # the compiled boundary, then the Python one (FakeGpu's)
        prof = _make_profiler(log, backend=b, clock=gpu.clock, collect_every_s=None)
        with prof.step():
            gpu.launch(1.0)
            gpu.host(1.0)
        summary = prof.close()
        assert summary.boundary == b.boundary
        assert ("`stepprof build`" in str(summary)) == (b.boundary == "python")
    report = report_log(log)
    assert [r.boundary for r in report.runs] == ["compiled", "python"]
    assert render(build_report([log])).count("`stepprof build` compiles the C one") == 1
