// stepprof's compiled step boundary: one C call does a boundary's device work.
//
// A plain CPython extension module (no pybind11: METH_FASTCALL functions that
// parse their positional arguments themselves), built by
// stepprof._device.compiled.build() with torch.utils.cpp_extension.load().
// Events are cudaEvent_t handles passed to Python as ints.  Every CUDA or c10
// error becomes a RuntimeError; nothing here aborts the process.
//
// The flags and their order are those of stepprof/_device/backend.py
// (BoundaryOps.cross): POP, MARK, READ, RESET, PUSH.  The Python loader checks
// that the numbers below agree with it, and that ABI is the one it expects.

//
// Built with STEPPROF_CUDA=0 (a CPU torch), it is the host core: the same module
// without the CUDA functions, with host_rss() for the host's step boundary.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cerrno>
#include <cstdlib>
#include <exception>

#include <unistd.h>

#ifndef STEPPROF_CUDA
#define STEPPROF_CUDA 1
#endif

// STEPPROF_CUDA_HEADERS=0: the CUDA runtime's headers are not complete here (the
// nvidia-* wheels of a pip-installed CUDA 13 torch lack crt/), so the few runtime entry
// points used below are declared here and found in the libcudart that torch has already
// loaded (libcudart.so.STEPPROF_CUDART_MAJOR, its soname), and the device, stream and allocator are reached
// through c10's device-generic interfaces.  With the headers, c10's CUDA ones are used.
#ifndef STEPPROF_CUDA_HEADERS
#define STEPPROF_CUDA_HEADERS 1
#endif

#if STEPPROF_CUDA && STEPPROF_CUDA_HEADERS
#include <cuda_runtime_api.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define STEPPROF_NVTX 1
#else
#define STEPPROF_NVTX 0
#endif

namespace {
using Guard = c10::cuda::CUDAGuard;
cudaStream_t current_stream(c10::DeviceIndex dev) {
  return c10::cuda::getCurrentCUDAStream(dev).stream();
}
auto device_stats(c10::DeviceIndex dev) {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(dev);
}
void reset_peak(c10::DeviceIndex dev) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(dev);
}
bool resolve_runtime() {
  return true;
}
} // namespace

#elif STEPPROF_CUDA
#include <dlfcn.h>

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Device.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#define STEPPROF_NVTX 0

#define STEPPROF_STR2(x) #x
#define STEPPROF_STR(x) STEPPROF_STR2(x)
#define STEPPROF_CUDART "libcudart.so." STEPPROF_STR(STEPPROF_CUDART_MAJOR)

namespace {
typedef int cudaError_t;
typedef struct CUevent_st* cudaEvent_t;
typedef struct CUstream_st* cudaStream_t;
typedef int cudaStreamCaptureStatus;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorInvalidValue = 1;
constexpr cudaError_t cudaErrorInvalidResourceHandle = 400;
constexpr cudaError_t cudaErrorNotReady = 600;
constexpr unsigned int cudaEventDefault = 0;
constexpr cudaStreamCaptureStatus cudaStreamCaptureStatusNone = 0;

struct Runtime {
  cudaError_t (*eventCreateWithFlags)(cudaEvent_t*, unsigned int);
  cudaError_t (*eventDestroy)(cudaEvent_t);
  cudaError_t (*eventQuery)(cudaEvent_t);
  cudaError_t (*eventElapsedTime)(float*, cudaEvent_t, cudaEvent_t);
  cudaError_t (*eventSynchronize)(cudaEvent_t);
  cudaError_t (*eventRecord)(cudaEvent_t, cudaStream_t);
  cudaError_t (*streamIsCapturing)(cudaStream_t, cudaStreamCaptureStatus*);
  cudaError_t (*getLastError)(void);
  const char* (*getErrorString)(cudaError_t);
  const char* (*getErrorName)(cudaError_t);
} rt;

template <typename F>
bool find(void* lib, F* out, const char* name, const char* alt) {
  void* p = dlsym(lib, name);
  if (p == nullptr && alt != nullptr) {
    p = dlsym(lib, alt);
  }
  if (p == nullptr) {
    PyErr_Format(PyExc_ImportError, "stepprof boundary: %s is not in %s", name, STEPPROF_CUDART);
    return false;
  }
  *out = reinterpret_cast<F>(p);
  return true;
}

// The runtime torch loaded (found by its soname; loaded now if torch has not).
bool resolve_runtime() {
  void* lib = dlopen(STEPPROF_CUDART, RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) {
    lib = dlopen(STEPPROF_CUDART, RTLD_NOW | RTLD_LOCAL);
  }
  if (lib == nullptr) {
    const char* why = dlerror();
    PyErr_Format(PyExc_ImportError, "stepprof boundary: cannot load %s: %s", STEPPROF_CUDART,
                 why != nullptr ? why : "unknown error");
    return false;
  }
  return find(lib, &rt.eventCreateWithFlags, "cudaEventCreateWithFlags", nullptr) &&
      find(lib, &rt.eventDestroy, "cudaEventDestroy", nullptr) &&
      find(lib, &rt.eventQuery, "cudaEventQuery", nullptr) &&
      find(lib, &rt.eventElapsedTime, "cudaEventElapsedTime", "cudaEventElapsedTime_v2") &&
      find(lib, &rt.eventSynchronize, "cudaEventSynchronize", nullptr) &&
      find(lib, &rt.eventRecord, "cudaEventRecord", nullptr) &&
      find(lib, &rt.streamIsCapturing, "cudaStreamIsCapturing", nullptr) &&
      find(lib, &rt.getLastError, "cudaGetLastError", nullptr) &&
      find(lib, &rt.getErrorString, "cudaGetErrorString", nullptr) &&
      find(lib, &rt.getErrorName, "cudaGetErrorName", nullptr);
}

#define cudaEventCreateWithFlags rt.eventCreateWithFlags
#define cudaEventDestroy rt.eventDestroy
#define cudaEventQuery rt.eventQuery
#define cudaEventElapsedTime rt.eventElapsedTime
#define cudaEventSynchronize rt.eventSynchronize
#define cudaEventRecord rt.eventRecord
#define cudaStreamIsCapturing rt.streamIsCapturing
#define cudaGetLastError rt.getLastError
#define cudaGetErrorString rt.getErrorString
#define cudaGetErrorName rt.getErrorName

const c10::impl::DeviceGuardImplInterface* cuda_impl() {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
}

// Sets the current device for its scope, as c10::cuda::CUDAGuard does.
class Guard {
 public:
  explicit Guard(c10::DeviceIndex dev)
      : original_(cuda_impl()->exchangeDevice(c10::Device(c10::DeviceType::CUDA, dev))) {}
  ~Guard() {
    cuda_impl()->uncheckedSetDevice(original_);
  }
  Guard(const Guard&) = delete;
  Guard& operator=(const Guard&) = delete;

 private:
  c10::Device original_;
};

cudaStream_t current_stream(c10::DeviceIndex dev) {
  const auto* impl = cuda_impl();
  return static_cast<cudaStream_t>(
      impl->getStreamNativeHandle(impl->getStream(c10::Device(c10::DeviceType::CUDA, dev))));
}
auto device_stats(c10::DeviceIndex dev) {
  return c10::getDeviceAllocator(c10::DeviceType::CUDA)->getDeviceStats(dev);
}
void reset_peak(c10::DeviceIndex dev) {
  c10::getDeviceAllocator(c10::DeviceType::CUDA)->resetPeakStats(dev);
}
} // namespace

#else
#define STEPPROF_NVTX 0
#endif

namespace {

// Bump when a function's arguments, results or meaning change.
constexpr long kABI = 2;

constexpr long kMARK = 1;
constexpr long kREAD = 2;
constexpr long kRESET = 4;
constexpr long kPUSH = 8;
constexpr long kPOP = 16;

#if STEPPROF_CUDA
// Raise RuntimeError for a failed CUDA call.  The error is also taken off the
// runtime's last-error slot, where the user's next kernel-launch check would
// otherwise find it.
PyObject* cuda_error(const char* what, cudaError_t err) {
  (void)cudaGetLastError();
  PyErr_Format(
      PyExc_RuntimeError,
      "stepprof boundary: %s failed: %s (%s)",
      what,
      cudaGetErrorString(err),
      cudaGetErrorName(err));
  return nullptr;
}

PyObject* cxx_error(const char* what, const char* message) {
  (void)cudaGetLastError();
  PyErr_Format(
      PyExc_RuntimeError, "stepprof boundary: %s failed: %s", what, message);
  return nullptr;
}

#endif

bool check_nargs(const char* fn, Py_ssize_t nargs, Py_ssize_t want) {
  if (nargs == want) {
    return true;
  }
  PyErr_Format(
      PyExc_TypeError,
      "%s() takes %zd positional arguments (%zd given)",
      fn,
      want,
      nargs);
  return false;
}

bool as_long(PyObject* obj, long* out) {
  *out = PyLong_AsLong(obj);
  return !(*out == -1 && PyErr_Occurred());
}

#if STEPPROF_CUDA
bool as_device(PyObject* obj, c10::DeviceIndex* out) {
  long dev = 0;
  if (!as_long(obj, &dev)) {
    return false;
  }
  if (dev < 0 || dev > 127) {
    PyErr_Format(PyExc_ValueError, "device index must be 0..127 (got %ld)", dev);
    return false;
  }
  *out = static_cast<c10::DeviceIndex>(dev);
  return true;
}

// An event handle; 0 (no event) is refused where an event is needed.
bool as_event(PyObject* obj, cudaEvent_t* out, bool allow_null) {
  void* p = PyLong_AsVoidPtr(obj);
  if (p == nullptr && PyErr_Occurred()) {
    return false;
  }
  if (p == nullptr && !allow_null) {
    PyErr_SetString(PyExc_RuntimeError, "stepprof boundary: event handle 0 is not an event");
    return false;
  }
  *out = static_cast<cudaEvent_t>(p);
  return true;
}

// event_create(device) -> int
PyObject* event_create(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  c10::DeviceIndex dev = 0;
  if (!check_nargs("event_create", nargs, 1) || !as_device(args[0], &dev)) {
    return nullptr;
  }
  cudaEvent_t ev = nullptr;
  cudaError_t err = cudaSuccess;
  try {
    Guard guard(dev);
    err = cudaEventCreateWithFlags(&ev, cudaEventDefault);
  } catch (const c10::Error& e) {
    return cxx_error("event_create", e.what_without_backtrace());
  } catch (const std::exception& e) {
    return cxx_error("event_create", e.what());
  }
  if (err != cudaSuccess) {
    return cuda_error("cudaEventCreateWithFlags", err);
  }
  return PyLong_FromVoidPtr(ev);
}

// event_destroy(ev)
PyObject* event_destroy(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  cudaEvent_t ev = nullptr;
  if (!check_nargs("event_destroy", nargs, 1) || !as_event(args[0], &ev, false)) {
    return nullptr;
  }
  cudaError_t err = cudaEventDestroy(ev);
  if (err != cudaSuccess) {
    return cuda_error("cudaEventDestroy", err);
  }
  Py_RETURN_NONE;
}

// event_query(ev) -> bool: whether the work before the event's record has completed.
PyObject* event_query(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  cudaEvent_t ev = nullptr;
  if (!check_nargs("event_query", nargs, 1) || !as_event(args[0], &ev, false)) {
    return nullptr;
  }
  cudaError_t err = cudaEventQuery(ev);
  if (err == cudaSuccess) {
    Py_RETURN_TRUE;
  }
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError(); // as torch does: not an error for the user's next check
    Py_RETURN_FALSE;
  }
  return cuda_error("cudaEventQuery", err);
}

// event_elapsed_ms(start, end) -> float
PyObject* event_elapsed_ms(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  cudaEvent_t a = nullptr;
  cudaEvent_t b = nullptr;
  if (!check_nargs("event_elapsed_ms", nargs, 2) || !as_event(args[0], &a, false) ||
      !as_event(args[1], &b, false)) {
    return nullptr;
  }
  float ms = 0.0f;
  cudaError_t err = cudaEventElapsedTime(&ms, a, b);
  if (err != cudaSuccess) {
    return cuda_error("cudaEventElapsedTime", err);
  }
  return PyFloat_FromDouble(static_cast<double>(ms));
}

// event_synchronize(ev): wait for the event, without the GIL.
PyObject* event_synchronize(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  cudaEvent_t ev = nullptr;
  if (!check_nargs("event_synchronize", nargs, 1) || !as_event(args[0], &ev, false)) {
    return nullptr;
  }
  cudaError_t err = cudaSuccess;
  Py_BEGIN_ALLOW_THREADS
  err = cudaEventSynchronize(ev);
  Py_END_ALLOW_THREADS
  if (err != cudaSuccess) {
    return cuda_error("cudaEventSynchronize", err);
  }
  Py_RETURN_NONE;
}

// read_marks(marks) -> (ms or None, ...) or None
//
// A step's device times in one call: `marks` is a tuple (start, end, start, end, ...)
// of event handles or None.  Each pair's elapsed time, in order, None where a mark is None
// or its time cannot be read (an event never recorded); but the result is None (nothing
// read) as soon as an event has not completed (a pair without a start: its end is queried).
// No query precedes an elapsed time: cudaEventElapsedTime says cudaErrorNotReady itself, so
// a step costs one CUDA call a pair, not two.  RuntimeError when a call fails otherwise
// (a broken context).  The GIL is kept: the calls never block
// (about a microsecond each), and letting go of it hands it to the training thread, which
// the collector then waits for until the switch interval forces it back (5 ms a step:
// on the H200, a third of the collector thread's samples were that wait).
// A step may hold any number of phase runs (a phase inside a loop of thousands): the bound
// only keeps the scratch's size from overflowing.
constexpr Py_ssize_t kMaxMarks = Py_ssize_t(1) << 26;

// read_marks' scratch: on the stack for up to eight pairs, else on the heap.
struct MarkScratch {
  cudaEvent_t ev_small[16];
  float ms_small[8];
  bool ok_small[8];
  cudaEvent_t* ev = ev_small;
  float* ms = ms_small;
  bool* ok = ok_small;
  void* big = nullptr;

  MarkScratch() = default;
  MarkScratch(const MarkScratch&) = delete;
  MarkScratch& operator=(const MarkScratch&) = delete;
  ~MarkScratch() { PyMem_Free(big); }

  // Room for n marks (n / 2 pairs); false with MemoryError set.
  bool fit(Py_ssize_t n) {
    if (n <= 16) {
      return true;
    }
    big = PyMem_Malloc(n * (sizeof(cudaEvent_t) + sizeof(float) + sizeof(bool)));
    if (big == nullptr) {
      PyErr_NoMemory();
      return false;
    }
    ev = static_cast<cudaEvent_t*>(big);
    ms = reinterpret_cast<float*>(ev + n);
    ok = reinterpret_cast<bool*>(ms + n / 2);
    return true;
  }
};

// Each mark's event (nullptr for None); false with an error set.
bool events_of(PyObject* marks, cudaEvent_t* ev) {
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(marks); ++i) {
    PyObject* m = PyTuple_GET_ITEM(marks, i);
    ev[i] = nullptr;
    if (m != Py_None && !as_event(m, &ev[i], false)) {
      return false;
    }
  }
  return true;
}

// Each pair's elapsed time into ms[p] (ok[p] false where a mark is None or the time cannot
// be read: an event never recorded, or made without timing).  cudaErrorNotReady at the first
// event that has not completed, another error where a call failed so, else cudaSuccess.
// An error is cleared, as torch does for a query: it is no error for the user's next check.
cudaError_t elapsed_all(const cudaEvent_t* ev, Py_ssize_t pairs, float* ms, bool* ok) {
  for (Py_ssize_t p = 0; p < pairs; ++p) {
    ok[p] = false;
    cudaEvent_t start = ev[2 * p], end = ev[2 * p + 1];
    if (end == nullptr) {
      continue;
    }
    cudaError_t err = start != nullptr ? cudaEventElapsedTime(&ms[p], start, end) : cudaEventQuery(end);
    if (err == cudaSuccess) {
      ok[p] = start != nullptr;
      continue;
    }
    (void)cudaGetLastError();
    if (err != cudaErrorInvalidResourceHandle && err != cudaErrorInvalidValue) {
      return err;  // cudaErrorNotReady: read again later
    }
  }
  return cudaSuccess;
}

// (ms or None, ...) for the pairs read.
PyObject* times_tuple(const float* ms, const bool* ok, Py_ssize_t pairs) {
  PyObject* out = PyTuple_New(pairs);
  if (out == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t p = 0; p < pairs; ++p) {
    PyObject* v = ok[p] ? PyFloat_FromDouble(static_cast<double>(ms[p])) : Py_NewRef(Py_None);
    if (v == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, p, v);
  }
  return out;
}

PyObject* read_marks(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!check_nargs("read_marks", nargs, 1)) {
    return nullptr;
  }
  PyObject* marks = args[0];
  if (!PyTuple_Check(marks) || PyTuple_GET_SIZE(marks) % 2 != 0 ||
      PyTuple_GET_SIZE(marks) > kMaxMarks) {
    PyErr_Format(PyExc_TypeError,
                 "read_marks() takes a tuple of an even number of marks, at most %zd (got %s)",
                 kMaxMarks, Py_TYPE(marks)->tp_name);
    return nullptr;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(marks);
  MarkScratch scratch;
  if (!scratch.fit(n) || !events_of(marks, scratch.ev)) {
    return nullptr;
  }
  cudaError_t err = elapsed_all(scratch.ev, n / 2, scratch.ms, scratch.ok);
  if (err == cudaErrorNotReady) {
    Py_RETURN_NONE;
  }
  if (err != cudaSuccess) {
    return cuda_error("cudaEventElapsedTime", err);
  }
  return times_tuple(scratch.ms, scratch.ok, n / 2);
}

// (peak allocated, reserved, num_alloc_retries, num_sync_all_streams,
//  num_device_alloc, num_device_free), from one read of the allocator's stats.
PyObject* read_memory(c10::DeviceIndex dev) {
  const auto stats = device_stats(dev);
  // [0] is the aggregate over the pools (StatType::AGGREGATE, whose namespace moved).
  const long long values[6] = {
      static_cast<long long>(stats.allocated_bytes[0].peak),
      static_cast<long long>(stats.reserved_bytes[0].current),
      static_cast<long long>(stats.num_alloc_retries),
      static_cast<long long>(stats.num_sync_all_streams),
      static_cast<long long>(stats.num_device_alloc),
      static_cast<long long>(stats.num_device_free),
  };
  PyObject* mem = PyTuple_New(6);
  if (mem == nullptr) {
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < 6; ++i) {
    PyObject* v = PyLong_FromLongLong(values[i]);
    if (v == nullptr) {
      Py_DECREF(mem);
      return nullptr;
    }
    PyTuple_SET_ITEM(mem, i, v);
  }
  return mem;
}

#if STEPPROF_NVTX
// Push an NVTX range named `name` (None: an empty name).  A str NVTX cannot take
// as UTF-8 (a lone surrogate) is pushed with the character replaced.
bool push_range(PyObject* name) {
  if (name == Py_None) {
    nvtxRangePushA("");
    return true;
  }
  if (!PyUnicode_Check(name)) {
    PyErr_Format(PyExc_TypeError, "range name must be str or None (got %s)", Py_TYPE(name)->tp_name);
    return false;
  }
  const char* utf8 = PyUnicode_AsUTF8AndSize(name, nullptr);
  if (utf8 != nullptr) {
    nvtxRangePushA(utf8);
    return true;
  }
  PyErr_Clear();
  PyObject* bytes = PyUnicode_AsEncodedString(name, "utf-8", "replace");
  if (bytes == nullptr) {
    return false;
  }
  nvtxRangePushA(PyBytes_AS_STRING(bytes));
  Py_DECREF(bytes);
  return true;
}
#endif

// boundary(device, ev, flags, name) -> (mark or None, mem or None)
//
// In this order: POP the innermost NVTX range; MARK: record `ev` on the device's
// current stream (not while that stream captures a CUDA graph; ev 0 records
// nothing), mark = ev; READ the allocator's figures; RESET its peak; PUSH a
// range named `name`.
PyObject* boundary(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  c10::DeviceIndex dev = 0;
  cudaEvent_t ev = nullptr;
  long flags = 0;
  if (!check_nargs("boundary", nargs, 4) || !as_device(args[0], &dev) ||
      !as_event(args[1], &ev, true) || !as_long(args[2], &flags)) {
    return nullptr;
  }
  PyObject* name = args[3];
  PyObject* mark = Py_None;
  PyObject* mem = nullptr;
  const char* step = "boundary";
  try {
#if STEPPROF_NVTX
    if (flags & kPOP) {
      nvtxRangePop();
    }
#endif
    if ((flags & kMARK) && ev != nullptr) {
      step = "the event record";
      Guard guard(dev);
      cudaStream_t stream = current_stream(dev);
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      cudaError_t err = cudaStreamIsCapturing(stream, &capture);
      if (err != cudaSuccess) {
        return cuda_error("cudaStreamIsCapturing", err);
      }
      if (capture == cudaStreamCaptureStatusNone) {
        err = cudaEventRecord(ev, stream);
        if (err != cudaSuccess) {
          return cuda_error("cudaEventRecord", err);
        }
        mark = args[1];
      }
    }
    if (flags & kREAD) {
      step = "the allocator stats read";
      mem = read_memory(dev);
      if (mem == nullptr) {
        return nullptr;
      }
    }
    if (flags & kRESET) {
      step = "the peak reset";
      reset_peak(dev);
    }
#if STEPPROF_NVTX
    if ((flags & kPUSH) && !push_range(name)) {
      Py_XDECREF(mem);
      return nullptr;
    }
#else
    (void)name;
#endif
  } catch (const c10::Error& e) {
    Py_XDECREF(mem);
    return cxx_error(step, e.what_without_backtrace());
  } catch (const std::exception& e) {
    Py_XDECREF(mem);
    return cxx_error(step, e.what());
  }
  if (mem == nullptr) {
    mem = Py_None;
    Py_INCREF(mem);
  }
  PyObject* result = PyTuple_New(2);
  if (result == nullptr) {
    Py_DECREF(mem);
    return nullptr;
  }
  Py_INCREF(mark);
  PyTuple_SET_ITEM(result, 0, mark);
  PyTuple_SET_ITEM(result, 1, mem);
  return result;
}

#endif  // STEPPROF_CUDA

// host_rss(fd, page_bytes) -> int: this process's resident set in bytes, from one
// pread of /proc/self/statm (kept open as fd).  The GIL is kept: the read takes about
// a microsecond, and letting go of the GIL there hands it to the collector thread in
// the middle of the user's step.  OSError when the read fails.
PyObject* host_rss(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long fd = 0;
  long page = 0;
  if (!check_nargs("host_rss", nargs, 2) || !as_long(args[0], &fd) || !as_long(args[1], &page)) {
    return nullptr;
  }
  char buf[256];
  ssize_t n = pread(static_cast<int>(fd), buf, sizeof(buf) - 1, 0);
  if (n < 0) {
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  buf[n] = '\0';
  char* end = nullptr;
  (void)std::strtoull(buf, &end, 10);  // the first field: the total program size
  errno = 0;
  unsigned long long resident = std::strtoull(end, &end, 10);
  if (errno != 0 || end == buf) {
    PyErr_SetString(PyExc_OSError, "stepprof host_rss: /proc/self/statm could not be parsed");
    return nullptr;
  }
  return PyLong_FromUnsignedLongLong(resident * static_cast<unsigned long long>(page));
}

#define STEPPROF_FN(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(f))

PyMethodDef methods[] = {
#if STEPPROF_CUDA
    {"event_create", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(event_create)),
     METH_FASTCALL, "event_create(device) -> int: a new timing event on the device."},
    {"event_destroy", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(event_destroy)),
     METH_FASTCALL, "event_destroy(ev)"},
    {"event_query", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(event_query)),
     METH_FASTCALL, "event_query(ev) -> bool: whether the event has completed."},
    {"event_elapsed_ms",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(event_elapsed_ms)),
     METH_FASTCALL, "event_elapsed_ms(start, end) -> float"},
    {"event_synchronize",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(event_synchronize)),
     METH_FASTCALL, "event_synchronize(ev): wait for the event (releases the GIL)."},
    {"read_marks", STEPPROF_FN(read_marks), METH_FASTCALL,
     "read_marks((start, end, ...)) -> (ms or None, ...) or None: a step's device times, None "
     "until every event has completed (keeps the GIL: it never blocks)."},
    {"boundary", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(boundary)),
     METH_FASTCALL,
     "boundary(device, ev, flags, name) -> (mark or None, mem or None): POP, MARK, READ, RESET, "
     "PUSH, by flags."},
#endif
    {"host_rss", STEPPROF_FN(host_rss), METH_FASTCALL,
     "host_rss(fd, page_bytes) -> int: the resident set, from /proc/self/statm (keeps the GIL)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "stepprof_boundary",
    "stepprof's compiled step boundary (see stepprof/_device/compiled.py).",
    -1,
    methods,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
};

} // namespace

PyMODINIT_FUNC PyInit_stepprof_boundary(void) {
#if STEPPROF_CUDA
  if (!resolve_runtime()) {
    return nullptr;
  }
#endif
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) {
    return nullptr;
  }
  if (PyModule_AddIntConstant(m, "ABI", kABI) < 0 || PyModule_AddIntConstant(m, "MARK", kMARK) < 0 ||
      PyModule_AddIntConstant(m, "READ", kREAD) < 0 ||
      PyModule_AddIntConstant(m, "RESET", kRESET) < 0 ||
      PyModule_AddIntConstant(m, "PUSH", kPUSH) < 0 || PyModule_AddIntConstant(m, "POP", kPOP) < 0 ||
      PyModule_AddObjectRef(m, "NVTX", STEPPROF_NVTX ? Py_True : Py_False) < 0 ||
      PyModule_AddObjectRef(m, "CUDA", STEPPROF_CUDA ? Py_True : Py_False) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
