/* The step core: a profiler's step and phase boundaries on the training thread, in C.
 *
 * Core(boundaries).enter and .exit are what stepprof's scopes call at every boundary (the
 * profiler's _enter and _exit).  For the common boundaries they do, in one C call, what
 * Boundaries.enter/exit and StepMeasure.begin_step/end_step/begin_phase/end_phase do
 * (stepprof/_recorder/measure.py and boundaries.py), on the same Python objects: the Step,
 * OpenPhase and PhaseTotals they make, the thread's ThreadSteps, the profiler's counters.
 * Every other boundary (the first step, another thread's, a closed or broken profiler, an
 * orphaned scope, a distributed exchange, explain_peak's
 * watched phases, a batch whose size must be inferred, phases left open) goes to Boundaries
 * untouched: the core decides that before it changes anything.
 *
 * Python owns the state and the rules that need more than arithmetic; the core reads and
 * writes the objects' __slots__ through their offsets (checked at configure_core) and the
 * Boundaries' attributes through its __dict__.  It calls Python where Python owns the work:
 * the step clock, the backend's cross() when it is not one the core knows (the host's does
 * nothing; the compiled CUDA boundary's is called directly with its event pool), the sync
 * tracker, the hooks, the collector.  An exception from any of them goes to Boundaries'
 * entry_failed/exit_failed, which leave the thread's context as Python's own path would.
 * tests/test_core.py holds the two paths to the same records and objects.  Pure CPython API.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <structmember.h>
#include <limits.h>
#include <string.h>

/* -- names --------------------------------------------------------------------------- */

enum {
    /* Boundaries' attributes (its __dict__) */
    B_CLOSED, B_CLOSING, B_BROKEN, B_THREADS, B_HOOKS, B_SLOT, B_BUDGET, B_EXCHANGE, B_CLOCK, B_WARMUP,
    B_PP_EVERY, B_STEADY, B_LAST_PEAK, B_PP_AT, B_COUNTERS, B_NEXT, B_SYNC, B_COLLECTOR, B_PENDING,
    B_WRITER, B_INLINE, B_OPEN, B_BEGIN_PHASE, B_END_PHASE,
    /* methods and other attributes */
    M_MAX_SYNCS, M_ON_SYNC, M_BEGIN, M_END, M_WATCH, M_ENSURE, M_DEFERRED,
    M_FAILED, M_ERROR, M_THREAD, M_CATCH_UP_AT, M_HARVEST_AT, M_CATCH_UP, M_START, M_HARVEST,
    M_WARN_ASYNC, M_APPEND, M_ON_STEP_BEGIN, M_ON_STEP_END, M_TIMING, M_MEMORY, M_NAME_,
    M_TYPE, M_MESSAGE, M_ATTACHED, M_CORE_PLAN, M_INTERVAL_AT, M_SYNC_PLAN, M_COUNT, M_WAITS, M_SITES,
    M_OTHER_THREADS, M_MECHANISM,
    N_KEYS
};

static const char* const KEYS[N_KEYS] = {
    "closed", "closing", "broken", "threads", "hooks", "slot", "_budget", "_exchange", "_clock", "_warmup",
    "_phase_peaks_every", "_steady", "_last_peak", "_phase_peaks_at", "_counters", "next_index", "_sync",
    "_collector", "_pending", "_writer", "_inline", "_open", "begin_phase", "end_phase",
    "max_syncs", "on_sync", "begin", "end", "watch_syncs", "ensure", "deferred",
    "failed", "error", "thread", "catch_up_at", "harvest_at", "catch_up", "start", "harvest",
    "warn_async", "append", "on_step_begin", "on_step_end", "has_device_timing",
    "has_device_memory", "__name__", "type", "message", "attached", "core_plan", "interval_at", "sync_plan",
    "count", "waits", "sites", "other_threads", "mechanism",
};

static PyObject* K[N_KEYS];

/* -- the classes' slots -------------------------------------------------------------- */

/* Each class the core touches, with the offsets of the slots it reads or writes. */
enum { C_STEP, C_PHASE, C_TOTALS, C_CTX, C_THREADS, C_HOOKS, C_SLOT, C_TRACKER, N_CLASSES };

static const char* const STEP_F[] = {
    "index", "name", "warmup", "batch_size", "t0", "t1", "start_mark", "end_mark", "peak", "reserved",
    "rss", "phases", "overhead_ns", "error", "syncs", "syncs_reason", "counters", "phase_peaks", "backend",
    "ctx", "thread", "shared", "queued", "sampled", "data_wait_ns", "data_ns", "batch_reason", "tokens", NULL};
enum { S_INDEX, S_NAME, S_WARMUP, S_BATCH, S_T0, S_T1, S_START, S_END, S_PEAK, S_RESERVED, S_RSS,
       S_PHASES, S_OVERHEAD, S_ERROR, S_SYNCS, S_SYNCS_REASON, S_COUNTERS, S_PHASE_PEAKS, S_BACKEND,
       S_CTX, S_THREAD, S_SHARED, S_QUEUED, S_SAMPLED, S_DATA_WAIT, S_DATA, S_BATCH_REASON, S_TOKENS };
static const char* const PHASE_F[] = {"key", "ctx", "mark", "t0", "peak", "syncs", NULL};
enum { P_KEY, P_CTX, P_MARK, P_T0, P_PEAK, P_SYNCS };
static const char* const TOTALS_F[] = {"t0", "wall_ns", "marks", "peak", "count", "syncs", NULL};
enum { T_T0, T_WALL, T_MARKS, T_PEAK, T_COUNT, T_SYNCS };
static const char* const CTX_F[] = {
    "tid", "thread", "step", "stack", "last_top_mark", "tracker", "watching", "hooked", "last_exit",
    "data_ns", "batch", "tokens", NULL};
enum { X_TID, X_THREAD, X_STEP, X_STACK, X_LAST_TOP, X_TRACKER, X_WATCHING, X_HOOKED, X_LAST_EXIT,
       X_DATA, X_BATCH, X_TOKENS };
static const char* const THREADS_F[] = {"main", NULL};
static const char* const HOOKS_F[] = {"begin", "end", NULL};
static const char* const SLOT_F[] = {"backend", "read_rss", "awaiting", NULL};
enum { L_BACKEND, L_READ_RSS, L_AWAITING };
static const char* const TRACKER_F[] = {
    "mechanism", "_sites", "_by_key", "_open", "count", "other_threads", "max_syncs", "on_sync", "budget_armed",
    "_last_user", "_last_child", "deferred", "attached", NULL};
enum { R_MECHANISM, R_SITES, R_BY_KEY, R_OPEN, R_COUNT, R_OTHER, R_MAX, R_ON_SYNC, R_ARMED, R_LAST_USER,
       R_LAST_CHILD, R_DEFERRED, R_ATTACHED };

static const char* const* const FIELDS[N_CLASSES] = {STEP_F, PHASE_F, TOTALS_F, CTX_F, THREADS_F, HOOKS_F, SLOT_F,
                                                     TRACKER_F};

#define MAX_FIELDS 32
typedef struct {
    PyTypeObject* type;
    Py_ssize_t off[MAX_FIELDS];  /* the named fields' offsets, in FIELDS' order */
    /* A new object's slots: every __slots__ member's offset, and its value in an object that
     * the class's own __init__ made (a fresh empty dict or list where that one's is one). */
    Py_ssize_t n_all;
    Py_ssize_t all_off[MAX_FIELDS];
    PyObject* all_default[MAX_FIELDS];
} Class;

static Class CLS[N_CLASSES];
static int configured = 0;
static PyObject* NO_BATCH;       /* stepprof._batch.NO_BATCH */
static PyObject* LIGHT_PHASE;    /* boundaries.LIGHT_PHASE: a phase of a light step's token */
static PyObject* ERROR_MESSAGE;  /* measure.error_message */
static PyObject* DEFAULT_STEP;   /* "step" */
static PyObject* DEFAULT_PHASE;  /* "phase" */
static PyObject* MINUS_ONE;
static PyObject* ZERO_;
static PyObject* TRACKERS;       /* _syncs._trackers: thread id -> its attached trackers, innermost last */
static PyObject* NO_PHASES;      /* () */
static long F_MARK, F_READ, F_RESET, F_PUSH, F_POP;
/* What the fast path returns when it leaves the boundary to Boundaries, having changed nothing. */
static PyObject SLOW_;
#define SLOW (&SLOW_)

#define SLOT(obj, c, f) (*(PyObject**)((char*)(obj) + CLS[c].off[f]))

/* Set a slot to a new reference to v. */
static void set_slot(PyObject* obj, int c, int f, PyObject* v) {
    PyObject** p = (PyObject**)((char*)obj + CLS[c].off[f]);
    PyObject* old = *p;
    *p = Py_NewRef(v);
    Py_XDECREF(old);
}

/* Set a slot, stealing v (NULL: an error already set, nothing changed). */
static int steal_slot(PyObject* obj, int c, int f, PyObject* v) {
    if (v == NULL) return -1;
    PyObject** p = (PyObject**)((char*)obj + CLS[c].off[f]);
    PyObject* old = *p;
    *p = v;
    Py_XDECREF(old);
    return 0;
}

/* The offset of ``type``'s __slots__ member ``name``; 0 (and an error) when it is not one (_fold.c). */
Py_ssize_t slot_offset(PyTypeObject* type, const char* name);

static void class_clear(Class* k) {
    for (Py_ssize_t i = 0; i < k->n_all; i++) Py_CLEAR(k->all_default[i]);
    k->n_all = 0;
    Py_CLEAR(k->type);
}

/* Take a class's offsets, and every slot's value in ``proto`` (an instance its __init__ made),
 * into ``k`` (zeroed). */
static int take_class(Class* k, int c, PyObject* type, PyObject* proto) {
    if (!PyType_Check(type) || (proto != Py_None && !Py_IS_TYPE(proto, (PyTypeObject*)type))) {
        PyErr_SetString(PyExc_TypeError, "configure_core: a class and an instance of it");
        return -1;
    }
    PyTypeObject* t = (PyTypeObject*)type;
    if (t->tp_dictoffset != 0 || (t->tp_flags & Py_TPFLAGS_HAVE_GC) == 0 || t->tp_base != &PyBaseObject_Type) {
        PyErr_Format(PyExc_TypeError, "configure_core: %s must be a __slots__ class of object, without __dict__", t->tp_name);
        return -1;
    }
    for (int i = 0; FIELDS[c][i] != NULL; i++) {
        if ((k->off[i] = slot_offset(t, FIELDS[c][i])) == 0) return -1;
    }
    k->type = (PyTypeObject*)Py_NewRef(type);
    if (proto != Py_None) {
        PyObject* slots = PyObject_GetAttrString(type, "__slots__");
        if (slots == NULL) return -1;
        PyObject* seq = PySequence_Fast(slots, "configure_core: __slots__ must be a sequence");
        Py_DECREF(slots);
        if (seq == NULL) return -1;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        if (n > MAX_FIELDS) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_TypeError, "configure_core: %s has more than %d slots", t->tp_name, MAX_FIELDS);
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject* name = PySequence_Fast_GET_ITEM(seq, i);
            const char* utf8 = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
            Py_ssize_t off = utf8 != NULL ? slot_offset(t, utf8) : 0;
            if (off == 0) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "configure_core: a slot name is not a str");
                Py_DECREF(seq);
                return -1;
            }
            PyObject* v = *(PyObject**)((char*)proto + off);
            if (v == NULL) {
                PyErr_Format(PyExc_TypeError, "configure_core: %s() leaves the slot %U unset", t->tp_name, name);
                Py_DECREF(seq);
                return -1;
            }
            if ((PyDict_CheckExact(v) && PyDict_GET_SIZE(v) != 0) || (PyList_CheckExact(v) && PyList_GET_SIZE(v) != 0) ||
                (!PyDict_CheckExact(v) && !PyList_CheckExact(v) && PyObject_IS_GC(v) && !PyTuple_CheckExact(v))) {
                PyErr_Format(PyExc_TypeError, "configure_core: %s's default %U is a mutable object the core cannot copy",
                             t->tp_name, name);
                Py_DECREF(seq);
                return -1;
            }
            k->all_off[k->n_all] = off;
            k->all_default[k->n_all++] = Py_NewRef(v);
        }
        Py_DECREF(seq);
    }
    return 0;
}

/* A new object of class c with its __init__'s defaults (fresh dicts and lists). */
static PyObject* make(int c) {
    Class* k = &CLS[c];
    PyObject* obj = k->type->tp_alloc(k->type, 0);
    if (obj == NULL) return NULL;
    for (Py_ssize_t i = 0; i < k->n_all; i++) {
        PyObject* v = k->all_default[i];
        if (PyDict_CheckExact(v)) v = PyDict_New();
        else if (PyList_CheckExact(v)) v = PyList_New(0);
        else Py_INCREF(v);
        if (v == NULL) {
            Py_DECREF(obj);
            return NULL;
        }
        *(PyObject**)((char*)obj + k->all_off[i]) = v;
    }
    return obj;
}

/* A phase's totals wait with its step until the harvest, up to HARVEST_AT steps: the totals,
 * their marks list and its (start, end) pairs are taken out of the cyclic GC's lists, so that
 * its collections (one every 700 objects that stay) no longer walk them, nor promote them to
 * the oldest generation, whose full collections walk the whole heap (GC time 1.2 -> 0.95 µs a
 * 3-phase step on the 2-core CPU, without the base's occasional full collections).  Safe
 * because none of them can be part of a cycle: the totals hold ints and that list, the list
 * holds the pairs, a pair holds two marks (the backend's events, or None), and nothing they hold
 * points back; reference counting frees them as before.  The pairs are untracked where made. */
static void untrack_totals(PyObject* total) {
    PyObject_GC_UnTrack(total);
    PyObject_GC_UnTrack(SLOT(total, C_TOTALS, T_MARKS));
}

/* -- small helpers ------------------------------------------------------------------- */

/* A Boundaries attribute (borrowed; NULL without an error when it is missing). */
static inline PyObject* bget(PyObject* d, int key) {
    return PyDict_GetItemWithError(d, K[key]);
}

static int as_ll(PyObject* v, long long* out) {
    if (!PyLong_CheckExact(v)) {
        PyErr_SetString(PyExc_TypeError, "stepprof core: expected an int");
        return -1;
    }
    *out = PyLong_AsLongLong(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* The step clock's reading, in ns. */
static int tick(PyObject* clock, long long* out) {
    PyObject* r = PyObject_CallNoArgs(clock);
    if (r == NULL) return -1;
    int rc = as_ll(r, out);
    Py_DECREF(r);
    return rc;
}

static int set_ll(PyObject* obj, int c, int f, long long v) {
    return steal_slot(obj, c, f, PyLong_FromLongLong(v));
}

/* slot += v, for an int slot */
static int add_ll(PyObject* obj, int c, int f, long long v) {
    long long now;
    if (as_ll(SLOT(obj, c, f), &now) < 0) return -1;
    return set_ll(obj, c, f, now + v);
}

static int bset(PyObject* d, int key, PyObject* v) {
    return PyDict_SetItem(d, K[key], v);
}

static int call_void(PyObject* r) {
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* -- the object ---------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject* b;              /* the Boundaries */
    PyObject* d;              /* its __dict__ */
    PyObject* enter;          /* b.enter: the boundaries the core leaves to Python */
    PyObject* exit;           /* b.exit */
    PyObject* entry_failed;   /* b.entry_failed */
    PyObject* exit_failed;    /* b.exit_failed */
    PyObject* unwatch;        /* b._unwatch */
    /* The last backend's plan (Backend.core_plan): how a boundary crosses on it. */
    PyObject* plan_for;       /* the backend it is for */
    int how;                  /* 0: nothing to do (the host); 1: the compiled CUDA boundary; 2: call cross() */
    PyObject* fn;             /* 1: the boundary function; 2: the backend's cross */
    PyObject* events;         /* 1: the event pool (a list) */
    PyObject* create;         /* 1: makes an event */
    PyObject* index;          /* 1: the device index */
    long mask;                /* 1: the flags the C boundary takes */
    /* The sync watch's fast case on backend sync_for (its sync_plan(), None where it has none). */
    PyObject* sync_for;
    PyObject* sync_fn;        /* sync_for.sync_plan */
    PyObject* sync_plan;      /* its last result: (mechanism, checks), or NULL */
    Py_ssize_t fast_entries, fast_exits;  /* boundaries done here (tests read them) */
} Core;

static int core_traverse(Core* self, visitproc visit, void* arg) {
    Py_VISIT(self->b);
    Py_VISIT(self->d);
    Py_VISIT(self->enter);
    Py_VISIT(self->exit);
    Py_VISIT(self->entry_failed);
    Py_VISIT(self->exit_failed);
    Py_VISIT(self->unwatch);
    Py_VISIT(self->plan_for);
    Py_VISIT(self->fn);
    Py_VISIT(self->events);
    Py_VISIT(self->create);
    Py_VISIT(self->index);
    Py_VISIT(self->sync_for);
    Py_VISIT(self->sync_fn);
    Py_VISIT(self->sync_plan);
    return 0;
}

static int core_clear(Core* self) {
    Py_CLEAR(self->b);
    Py_CLEAR(self->d);
    Py_CLEAR(self->enter);
    Py_CLEAR(self->exit);
    Py_CLEAR(self->entry_failed);
    Py_CLEAR(self->exit_failed);
    Py_CLEAR(self->unwatch);
    Py_CLEAR(self->plan_for);
    Py_CLEAR(self->fn);
    Py_CLEAR(self->events);
    Py_CLEAR(self->create);
    Py_CLEAR(self->index);
    Py_CLEAR(self->sync_for);
    Py_CLEAR(self->sync_fn);
    Py_CLEAR(self->sync_plan);
    return 0;
}

static void core_dealloc(Core* self) {
    PyObject_GC_UnTrack(self);
    core_clear(self);
    Py_TYPE(self)->tp_free((PyObject*)self);
}

static PyObject* core_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
    PyObject* b;
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "stepprof core: configure_core() first");
        return NULL;
    }
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0) {
        PyErr_SetString(PyExc_TypeError, "Core(boundaries) takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O:Core", &b)) return NULL;
    Core* self = (Core*)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->b = Py_NewRef(b);
    self->d = PyObject_GenericGetDict(b, NULL);
    if (self->d == NULL || (self->enter = PyObject_GetAttrString(b, "enter")) == NULL ||
        (self->exit = PyObject_GetAttrString(b, "exit")) == NULL ||
        (self->entry_failed = PyObject_GetAttrString(b, "entry_failed")) == NULL ||
        (self->exit_failed = PyObject_GetAttrString(b, "exit_failed")) == NULL ||
        (self->unwatch = PyObject_GetAttrString(b, "_unwatch")) == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject*)self;
}

/* -- the backend --------------------------------------------------------------------- */

/* Make the plan for backend ``b`` current (0), or -1 with an error. */
static int plan(Core* self, PyObject* b) {
    if (b == self->plan_for) return 0;
    PyObject* p;
    PyObject* fn = PyObject_GetAttr(b, K[M_CORE_PLAN]);
    if (fn != NULL) {
        p = PyObject_CallNoArgs(fn);
        Py_DECREF(fn);
    } else if (PyErr_ExceptionMatches(PyExc_AttributeError)) {  /* a backend without one: its cross() */
        PyErr_Clear();
        PyObject* cross = PyObject_GetAttrString(b, "cross");
        p = cross == NULL ? NULL : Py_BuildValue("(iN)", 2, cross);
    } else {
        p = NULL;
    }
    if (p == NULL) return -1;
    long how;
    if (!PyTuple_CheckExact(p) || PyTuple_GET_SIZE(p) < 1 || (how = PyLong_AsLong(PyTuple_GET_ITEM(p, 0))) < 0 ||
        how > 2 || (how == 1 && PyTuple_GET_SIZE(p) != 6) || (how == 2 && PyTuple_GET_SIZE(p) != 2) ||
        (how == 1 && !PyList_CheckExact(PyTuple_GET_ITEM(p, 2)))) {
        Py_DECREF(p);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "stepprof core: a backend's core_plan() is malformed");
        return -1;
    }
    long mask = 0;
    if (how == 1 && (mask = PyLong_AsLong(PyTuple_GET_ITEM(p, 5))) == -1 && PyErr_Occurred()) {
        Py_DECREF(p);
        return -1;
    }
    Py_CLEAR(self->fn);
    Py_CLEAR(self->events);
    Py_CLEAR(self->create);
    Py_CLEAR(self->index);
    if (how >= 1) self->fn = Py_NewRef(PyTuple_GET_ITEM(p, 1));
    if (how == 1) {
        self->events = Py_NewRef(PyTuple_GET_ITEM(p, 2));
        self->create = Py_NewRef(PyTuple_GET_ITEM(p, 3));
        self->index = Py_NewRef(PyTuple_GET_ITEM(p, 4));
    }
    self->how = (int)how;
    self->mask = mask;
    Py_XSETREF(self->plan_for, Py_NewRef(b));
    Py_DECREF(p);
    return 0;
}

/* Split a boundary's result into its mark and memory read (new references). */
static int split(PyObject* r, PyObject** mark, PyObject** mem) {
    if (r == NULL) return -1;
    if (!PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r) != 2) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_TypeError, "stepprof core: a boundary must return (mark, memory)");
        return -1;
    }
    *mark = Py_NewRef(PyTuple_GET_ITEM(r, 0));
    *mem = Py_NewRef(PyTuple_GET_ITEM(r, 1));
    Py_DECREF(r);
    if (*mem != Py_None && (!PyTuple_CheckExact(*mem) || PyTuple_GET_SIZE(*mem) < 2)) {
        Py_CLEAR(*mark);
        Py_CLEAR(*mem);
        PyErr_SetString(PyExc_TypeError, "stepprof core: a memory read must be a tuple (peak, reserved, ...)");
        return -1;
    }
    return 0;
}

/* The step's NVTX name, "<name> <index>" (new reference). */
typedef struct {
    PyObject* name;   /* the name, or NULL */
    PyObject* index;  /* with an index: "<name> <index>" */
} Label;

static PyObject* label_text(Label* l) {
    if (l->name == NULL) Py_RETURN_NONE;
    if (l->index == NULL) return Py_NewRef(l->name);
    return PyUnicode_FromFormat("%U %S", l->name, l->index);
}

/* Backend.cross(flags, name) on backend b (whose plan is current): the mark and memory read
 * (new references; None where none).  As CompiledCudaBackend.cross for the compiled boundary. */
static int cross(Core* self, long flags, Label* l, PyObject** mark, PyObject** mem) {
    *mark = *mem = NULL;
    if (self->how == 0) {
        *mark = Py_NewRef(Py_None);
        *mem = Py_NewRef(Py_None);
        return 0;
    }
    PyObject* text = NULL;
    if (self->how == 2) {
        if ((text = label_text(l)) == NULL) return -1;
        PyObject* argv[2] = {PyLong_FromLong(flags), text};
        if (argv[0] == NULL) {
            Py_DECREF(text);
            return -1;
        }
        PyObject* r = PyObject_Vectorcall(self->fn, argv, 2, NULL);
        Py_DECREF(argv[0]);
        Py_DECREF(text);
        return split(r, mark, mem);
    }
    flags &= self->mask;
    if (!flags) {
        *mark = Py_NewRef(Py_None);
        *mem = Py_NewRef(Py_None);
        return 0;
    }
    /* A mark takes a pooled event (made when the pool is empty); without one, the call gets 0. */
    PyObject* events = self->events;
    int pooled = (flags & F_MARK) != 0;
    PyObject* ev;
    Py_ssize_t n = PyList_GET_SIZE(events);
    if (!pooled) {
        ev = Py_NewRef(ZERO_);
    } else if (n > 0) {
        ev = Py_NewRef(PyList_GET_ITEM(events, n - 1));
        if (PyList_SetSlice(events, n - 1, n, NULL) < 0) {
            Py_DECREF(ev);
            return -1;
        }
    } else if ((ev = PyObject_CallOneArg(self->create, self->index)) == NULL) {
        return -1;
    }
    text = flags & F_PUSH ? label_text(l) : Py_NewRef(Py_None);
    PyObject* argv[4] = {self->index, ev, text == NULL ? NULL : PyLong_FromLong(flags), text};
    PyObject* r = argv[2] == NULL ? NULL : PyObject_Vectorcall(self->fn, argv, 4, NULL);
    Py_XDECREF(argv[2]);
    Py_XDECREF(text);
    int rc = split(r, mark, mem);
    if (pooled && (rc < 0 || *mark == Py_None)) {  /* no mark came of it: the event goes back */
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        if (PyList_Append(events, ev) < 0 && rc == 0) {
            rc = -1;
            Py_CLEAR(*mark);
            Py_CLEAR(*mem);
            Py_XDECREF(t);
            Py_XDECREF(v);
            Py_XDECREF(tb);
        } else {
            PyErr_Restore(t, v, tb);
        }
    }
    Py_DECREF(ev);
    return rc;
}

static int attr_true(PyObject* obj, int key) {
    PyObject* v = PyObject_GetAttr(obj, K[key]);
    if (v == NULL) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* Fold a memory read's peak into the step and every open phase (StepMeasure._fold_peak). */
static int fold_peak(PyObject* ctx, PyObject* step, PyObject* mem) {
    PyObject* peak = PyTuple_GET_ITEM(mem, 0);
    int gt = PyObject_RichCompareBool(peak, SLOT(step, C_STEP, S_PEAK), Py_GT);
    if (gt < 0) return -1;
    if (gt) set_slot(step, C_STEP, S_PEAK, peak);
    PyObject* stack = SLOT(ctx, C_CTX, X_STACK);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(stack); i++) {
        PyObject* ph = PyList_GET_ITEM(stack, i);
        if (!Py_IS_TYPE(ph, CLS[C_PHASE].type)) {
            PyErr_SetString(PyExc_TypeError, "stepprof core: a phase stack holds a foreign object");
            return -1;
        }
        if ((gt = PyObject_RichCompareBool(peak, SLOT(ph, C_PHASE, P_PEAK), Py_GT)) < 0) return -1;
        if (gt) set_slot(ph, C_PHASE, P_PEAK, peak);
    }
    return 0;
}

/* Whether the calling thread is ctx's. */
static int own_thread(PyObject* ctx) {
    PyObject* tid = SLOT(ctx, C_CTX, X_TID);
    if (!PyLong_CheckExact(tid)) return 0;
    unsigned long v = PyLong_AsUnsignedLong(tid);
    if (v == (unsigned long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return v == PyThread_get_thread_ident();
}

/* Hand the pending exception to ``handler(*args, exc)``: what it returns (a token), or NULL
 * when it raised (the user's exception again, or stepprof's usage error). */
static PyObject* hand_over(PyObject* handler, PyObject* const* args, Py_ssize_t n) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (v == NULL) {  /* (cannot happen: an error is set) */
        Py_XDECREF(t);
        Py_XDECREF(tb);
        PyErr_SetString(PyExc_SystemError, "stepprof core: no exception to hand over");
        return NULL;
    }
    if (tb != NULL) PyException_SetTraceback(v, tb);
    PyObject* argv[4];
    for (Py_ssize_t i = 0; i < n; i++) argv[i] = args[i];
    argv[n] = v;
    PyObject* r = PyObject_Vectorcall(handler, argv, n + 1, NULL);
    Py_XDECREF(t);
    Py_DECREF(v);
    Py_XDECREF(tb);
    return r;
}

/* -- entry --------------------------------------------------------------------------- */

/* -- the sync watch ------------------------------------------------------------------ */

/* Whether every check of a sync plan (_syncs.Check) holds: 1 or 0, 0 too where the
 * attribute or the item is missing (an empty filter list: ensure() puts it back); -1 on any
 * other error, which the entry's failure takes, as an error in the route's ensure() would be. */
static int checks_pass(PyObject* checks) {
    if (!PyTuple_CheckExact(checks)) return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(checks); i++) {
        PyObject* c = PyTuple_GET_ITEM(checks, i);
        if (!PyTuple_CheckExact(c) || PyTuple_GET_SIZE(c) != 4) return 0;
        PyObject *obj = PyTuple_GET_ITEM(c, 0), *attr = PyTuple_GET_ITEM(c, 1), *want = PyTuple_GET_ITEM(c, 3);
        PyObject* v = attr == Py_None ? PyObject_CallNoArgs(obj) : PyObject_GetAttr(obj, attr);
        if (v != NULL && PyTuple_GET_ITEM(c, 2) != Py_None) Py_SETREF(v, PyObject_GetItem(v, PyTuple_GET_ITEM(c, 2)));
        if (v == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_LookupError) && !PyErr_ExceptionMatches(PyExc_AttributeError))
                return -1;
            PyErr_Clear();
            return 0;
        }
        int ok = v == want;
        if (!ok && PyLong_CheckExact(want)) ok = PyObject_RichCompareBool(v, want, Py_EQ);
        Py_DECREF(v);
        if (ok <= 0) return ok;
    }
    return 1;
}

/* SyncTracker.begin on its slots (a sync-free step's empty dicts are kept).  0 or -1. */
static int begin_tracker(PyObject* t, PyObject* stack, PyObject* max_syncs, PyObject* on_sync, int armed) {
    for (int f = R_SITES; f <= R_BY_KEY; f++) {
        PyObject* d = SLOT(t, C_TRACKER, f);
        if (!PyDict_CheckExact(d) || PyDict_GET_SIZE(d) != 0) {
            if (steal_slot(t, C_TRACKER, f, PyDict_New()) < 0) return -1;
        }
    }
    set_slot(t, C_TRACKER, R_OPEN, stack);
    set_slot(t, C_TRACKER, R_LAST_USER, Py_None);
    set_slot(t, C_TRACKER, R_LAST_CHILD, Py_None);
    set_slot(t, C_TRACKER, R_COUNT, ZERO_);
    set_slot(t, C_TRACKER, R_OTHER, ZERO_);
    set_slot(t, C_TRACKER, R_DEFERRED, Py_None);
    set_slot(t, C_TRACKER, R_MAX, max_syncs);
    set_slot(t, C_TRACKER, R_ON_SYNC, on_sync);
    set_slot(t, C_TRACKER, R_ARMED, armed && max_syncs != Py_None ? Py_True : Py_False);
    return 0;
}

/* _syncs.attach(tracker) on the context's thread.  0 or -1. */
static int attach_tracker(PyObject* ctx, PyObject* t) {
    set_slot(t, C_TRACKER, R_ATTACHED, Py_True);  /* first, as attach() does */
    PyObject* tid = SLOT(ctx, C_CTX, X_TID);
    PyObject* stack = PyDict_GetItemWithError(TRACKERS, tid);
    if (stack != NULL) return PyList_CheckExact(stack) ? PyList_Append(stack, t) : call_void(PyObject_CallMethodOneArg(stack, K[M_APPEND], t));
    if (PyErr_Occurred()) return -1;
    PyObject* one = PyList_New(1);
    if (one == NULL) return -1;
    PyList_SET_ITEM(one, 0, Py_NewRef(t));
    int r = PyDict_SetItem(TRACKERS, tid, one);
    Py_DECREF(one);
    return r;
}

/* Its backend's watch where its sync plan's checks all hold (the tracker attached here), else
 * backend.watch_syncs (and the plan made anew once that counts).  The step's syncs_reason, or
 * NULL with an error. */
static PyObject* watch_backend(Core* self, PyObject* ctx, PyObject* b, PyObject* tracker) {
    int fast = 0;
    if (self->sync_for == b && self->sync_plan != NULL && Py_IS_TYPE(tracker, CLS[C_TRACKER].type) &&
        (fast = checks_pass(PyTuple_GET_ITEM(self->sync_plan, 1))) < 0)
        return NULL;
    if (fast) {
        set_slot(tracker, C_TRACKER, R_MECHANISM, PyTuple_GET_ITEM(self->sync_plan, 0));
        return attach_tracker(ctx, tracker) < 0 ? NULL : Py_NewRef(Py_None);
    }
    PyObject* reason = PyObject_CallMethodOneArg(b, K[M_WATCH], tracker);
    if (reason != Py_None) return reason;
    if (self->sync_for != b) {
        Py_XSETREF(self->sync_fn, PyObject_GetAttr(b, K[M_SYNC_PLAN]));
        if (self->sync_fn == NULL && !PyErr_ExceptionMatches(PyExc_AttributeError)) goto fail;
        PyErr_Clear();
        Py_XSETREF(self->sync_for, Py_NewRef(b));
    }
    Py_CLEAR(self->sync_plan);
    if (self->sync_fn != NULL) {
        PyObject* p = PyObject_CallNoArgs(self->sync_fn);
        if (p == NULL) goto fail;
        if (PyTuple_CheckExact(p) && PyTuple_GET_SIZE(p) == 2) self->sync_plan = p;
        else Py_DECREF(p);
    }
    return reason;
fail:
    Py_DECREF(reason);
    return NULL;
}

/* The sync watch of a new step (StepMeasure._watch). */
static int watch(Core* self, PyObject* ctx, PyObject* step, PyObject* b, int timing, int warmup, PyObject* budget) {
    PyObject* tracker = SLOT(ctx, C_CTX, X_TRACKER);
    PyObject* reason;
    if (!timing) {
        reason = PyObject_CallMethodOneArg(b, K[M_WATCH], tracker);
        if (steal_slot(step, C_STEP, S_SYNCS_REASON, reason) < 0) return -1;
        set_slot(ctx, C_CTX, X_WATCHING, Py_False);
        return 0;
    }
    PyObject* sync = bget(self->d, B_SYNC);
    if (sync == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "stepprof core: Boundaries has no _sync");
        return -1;
    }
    PyObject* max_syncs = budget != NULL ? PyTuple_GET_ITEM(budget, 0) : Py_None;
    PyObject* on_sync = budget != NULL ? PyTuple_GET_ITEM(budget, 1) : Py_None;
    int given = PyObject_IsTrue(on_sync);
    if (given < 0) return -1;
    max_syncs = max_syncs == Py_None ? PyObject_GetAttr(sync, K[M_MAX_SYNCS]) : Py_NewRef(max_syncs);
    if (max_syncs == NULL) return -1;
    on_sync = given ? Py_NewRef(on_sync) : PyObject_GetAttr(sync, K[M_ON_SYNC]);
    if (on_sync == NULL) {
        Py_DECREF(max_syncs);
        return -1;
    }
    int r;
    PyObject* stack = SLOT(ctx, C_CTX, X_STACK);
    if (Py_IS_TYPE(tracker, CLS[C_TRACKER].type)) {
        r = begin_tracker(tracker, stack, max_syncs, on_sync, !warmup);
    } else {
        PyObject* argv[5] = {tracker, stack, max_syncs, on_sync, warmup ? Py_False : Py_True};
        r = call_void(PyObject_VectorcallMethod(K[M_BEGIN], argv, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL));
    }
    Py_DECREF(max_syncs);
    Py_DECREF(on_sync);
    if (r < 0 || (reason = watch_backend(self, ctx, b, tracker)) == NULL) return -1;
    set_slot(ctx, C_CTX, X_WATCHING, reason == Py_None ? Py_True : Py_False);
    return steal_slot(step, C_STEP, S_SYNCS_REASON, reason);
}

/* Whether the core may open this thread's step itself (1), or Boundaries must (0; -1 on an
 * error): the profiler's state as the core knows it, no exchange, a chosen backend, no open
 * phase; phase_peaks_every (*every) and the next index (*next) within 64 bits. */
static int entry_is_ours(PyObject* d, PyObject* ctx, long long* every, long long* next) {
    PyObject* hooks = bget(d, B_HOOKS);
    PyObject* slot = bget(d, B_SLOT);
    PyObject* nx = bget(d, B_NEXT);
    PyObject* open_steps = bget(d, B_OPEN);
    if (hooks == NULL || !Py_IS_TYPE(hooks, CLS[C_HOOKS].type) || slot == NULL || !Py_IS_TYPE(slot, CLS[C_SLOT].type) ||
        bget(d, B_CLOCK) == NULL || nx == NULL || !PyLong_CheckExact(nx) || bget(d, B_WARMUP) == NULL ||
        open_steps == NULL || !PyDict_CheckExact(open_steps) || bget(d, B_BUDGET) == NULL ||
        bget(d, B_EXCHANGE) != Py_None || SLOT(slot, C_SLOT, L_AWAITING) != Py_None ||
        SLOT(slot, C_SLOT, L_BACKEND) == Py_None || !PyTuple_CheckExact(SLOT(hooks, C_HOOKS, 0)) ||
        !PyList_CheckExact(SLOT(ctx, C_CTX, X_STACK)) || PyList_GET_SIZE(SLOT(ctx, C_CTX, X_STACK)) != 0)
        return PyErr_Occurred() ? -1 : 0;
    /* Numbers the core keeps in C: one past 64 bits (phase_peaks_every=2**64) is Python's. */
    PyObject* pp = bget(d, B_PP_EVERY);
    int overflow = 0;
    if (pp == NULL || !PyLong_CheckExact(pp) || (*every = PyLong_AsLongLongAndOverflow(pp, &overflow), overflow) ||
        (*next = PyLong_AsLongLongAndOverflow(nx, &overflow), overflow) || *next >= LLONG_MAX / 2)
        return PyErr_Occurred() ? -1 : 0;
    return 1;
}

/* The new step's own fields (its batch, the data wait since the thread's last exit), made the
 * thread's open step; the hooks told.  A new reference, or NULL. */
static PyObject* new_step(PyObject* d, PyObject* ctx, PyObject* slot, PyObject* name, PyObject* index, int warmup,
                           PyObject* batch_size, PyObject* batch_reason, long long t_in) {
    PyObject* open_steps = bget(d, B_OPEN);
    PyObject* hooks = bget(d, B_HOOKS);
    PyObject* step = make(C_STEP);
    long long last_exit, data_ns;
    if (step == NULL) return NULL;
    set_slot(step, C_STEP, S_INDEX, index);
    set_slot(step, C_STEP, S_NAME, name);
    set_slot(step, C_STEP, S_WARMUP, warmup ? Py_True : Py_False);
    set_slot(step, C_STEP, S_BATCH, batch_size);
    set_slot(step, C_STEP, S_BATCH_REASON, batch_reason);
    if (as_ll(SLOT(ctx, C_CTX, X_LAST_EXIT), &last_exit) < 0 || as_ll(SLOT(ctx, C_CTX, X_DATA), &data_ns) < 0) goto fail;
    if (last_exit && set_ll(step, C_STEP, S_DATA_WAIT, t_in - last_exit) < 0) goto fail;
    if (data_ns >= 0) {
        set_slot(step, C_STEP, S_DATA, SLOT(ctx, C_CTX, X_DATA));
        set_slot(ctx, C_CTX, X_DATA, MINUS_ONE);
    }
    set_slot(ctx, C_CTX, X_BATCH, Py_None);
    if (SLOT(ctx, C_CTX, X_TOKENS) != Py_None) {  /* the tokens of the batch iterate() saw */
        set_slot(step, C_STEP, S_TOKENS, SLOT(ctx, C_CTX, X_TOKENS));
        set_slot(ctx, C_CTX, X_TOKENS, Py_None);
    }
    set_slot(step, C_STEP, S_CTX, ctx);
    set_slot(step, C_STEP, S_THREAD, SLOT(ctx, C_CTX, X_THREAD));
    set_slot(step, C_STEP, S_BACKEND, SLOT(slot, C_SLOT, L_BACKEND));
    set_slot(ctx, C_CTX, X_STEP, step);  /* from here on, an interrupt closes the step instead of undoing it */
    if (PyDict_SetItem(open_steps, SLOT(ctx, C_CTX, X_TID), step) < 0) goto fail;
    if (PyDict_GET_SIZE(open_steps) > 1) {  /* another thread's step is open: neither has a peak of its own */
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        while (PyDict_Next(open_steps, &pos, &k, &v)) {
            if (Py_IS_TYPE(v, CLS[C_STEP].type)) set_slot(v, C_STEP, S_SHARED, Py_True);
            else if (PyObject_SetAttrString(v, "shared", Py_True) < 0) goto fail;
        }
    }
    if (SLOT(ctx, C_CTX, X_HOOKED) == Py_True) {
        PyObject* begin = Py_NewRef(SLOT(hooks, C_HOOKS, 0));  /* (retire() replaces it: this loop goes on) */
        for (Py_ssize_t h = 0; h < PyTuple_GET_SIZE(begin); h++) {
            if (call_void(PyObject_CallMethodOneArg(PyTuple_GET_ITEM(begin, h), K[M_ON_STEP_BEGIN], index)) < 0) {
                Py_DECREF(begin);
                goto fail;
            }
        }
        Py_DECREF(begin);
    }
    if (set_ll(step, C_STEP, S_T0, t_in) < 0) goto fail;
    return step;
fail:
    Py_DECREF(step);
    return NULL;
}

/* The step's backend (the host's slot chooses one now: CUDA, once the training code initialised
 * it), set on it, with whether it times (*timing) and reads memory (*memory).  A new reference. */
static PyObject* step_backend(Core* self, PyObject* step, PyObject* slot, int* timing, int* memory) {
    PyObject* b = Py_NewRef(SLOT(slot, C_SLOT, L_BACKEND));
    *timing = attr_true(b, M_TIMING);
    if (*timing == 0) {
        Py_SETREF(b, PyObject_CallMethodNoArgs(slot, K[M_ENSURE]));
        if (b == NULL) return NULL;
        *timing = attr_true(b, M_TIMING);
    }
    set_slot(step, C_STEP, S_BACKEND, b);
    *memory = *timing < 0 ? -1 : attr_true(b, M_MEMORY);
    if (*memory < 0 || plan(self, b) < 0) {
        Py_DECREF(b);
        return NULL;
    }
    return b;
}

/* Under overhead_budget, past warm-up: one step in k in full.  1 when this step is a light one
 * (the clock and the sync count only, done here), 0 when it is full, -1 on an error. */
static int light_step(Core* self, PyObject* ctx, PyObject* step, PyObject* b, int timing, PyObject* budget,
                      PyObject* budget_, PyObject* clock, long long i, long long t_in) {
    PyObject* d = self->d;
    PyObject* k = PyObject_CallMethodOneArg(budget_, K[M_INTERVAL_AT], SLOT(step, C_STEP, S_INDEX));
    long long kk = 0, t0;
    if (k == NULL || as_ll(k, &kk) < 0 || kk < 1) {
        if (k != NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "stepprof core: an interval below 1");
        Py_XDECREF(k);
        return -1;
    }
    if (i % kk == 0) {
        set_slot(step, C_STEP, S_SAMPLED, k);
        Py_DECREF(k);
        return 0;
    }
    Py_DECREF(k);
    set_slot(step, C_STEP, S_SAMPLED, ZERO_);
    if (bset(d, B_COUNTERS, Py_None) < 0 || watch(self, ctx, step, b, timing, 0, budget) < 0) return -1;
    if (tick(clock, &t0) < 0 || set_ll(step, C_STEP, S_T0, t0) < 0 || set_ll(step, C_STEP, S_OVERHEAD, t0 - t_in) < 0)
        return -1;
    return 1;
}

/* Whether this step reads its phases' peaks (phase_peaks_every=n, n != 1): during warm-up, until
 * the peak is steady, and every n-th step after.  0, or -1 on an error. */
static int choose_phase_peaks(PyObject* d, PyObject* step, long long n, int warmup, long long i) {
    if (n != 1) {
        long long steady = 0, at = 0;
        PyObject* s = bget(d, B_STEADY);
        PyObject* a = bget(d, B_PP_AT);
        if (s == NULL || a == NULL || as_ll(s, &steady) < 0 || as_ll(a, &at) < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "stepprof core: no _steady");
            return -1;
        }
        set_slot(step, C_STEP, S_PHASE_PEAKS, n > 0 && (warmup || steady < 2 || i - at >= n) ? Py_True : Py_False);
    }
    if (SLOT(step, C_STEP, S_PHASE_PEAKS) == Py_True && bset(d, B_PP_AT, SLOT(step, C_STEP, S_INDEX)) < 0) return -1;
    return 0;
}

/* The full step's entry at the device: the sync watch, then one boundary crossing (mark, reset
 * the peak, push the range; the allocator's counters read once, as their baseline).  0 or -1. */
static int enter_device(Core* self, PyObject* ctx, PyObject* step, PyObject* b, int timing, int memory,
                        int warmup, PyObject* budget, PyObject* clock, long long t_in) {
    PyObject* d = self->d;
    PyObject *mark = NULL, *mem = NULL;
    long long t0;
    long flags = F_MARK | F_RESET | F_PUSH;
    PyObject* counters = bget(d, B_COUNTERS);
    if (counters == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "stepprof core: no _counters");
        return -1;
    }
    if (counters == Py_None && memory) flags |= F_READ;  /* once: the baseline of the allocator's counters */
    if (watch(self, ctx, step, b, timing, warmup, budget) < 0) return -1;
    Label l = {SLOT(step, C_STEP, S_NAME), SLOT(step, C_STEP, S_INDEX)};
    if (cross(self, flags, &l, &mark, &mem) < 0) goto fail;
    if (mem != Py_None) {
        PyObject* rest = PyTuple_GetSlice(mem, 2, PyTuple_GET_SIZE(mem));
        if (rest == NULL) goto fail;
        int r = bset(d, B_COUNTERS, PyTuple_GET_SIZE(rest) ? rest : Py_None);
        Py_DECREF(rest);
        if (r < 0) goto fail;
    }
    set_slot(step, C_STEP, S_START, mark);
    set_slot(ctx, C_CTX, X_LAST_TOP, mark);
    if (tick(clock, &t0) < 0 || set_ll(step, C_STEP, S_T0, t0) < 0 || set_ll(step, C_STEP, S_OVERHEAD, t0 - t_in) < 0)
        goto fail;
    Py_DECREF(mark);
    Py_DECREF(mem);
    return 0;
fail:
    Py_XDECREF(mark);
    Py_XDECREF(mem);
    return -1;
}

/* Open a step (StepMeasure.begin_step; under overhead_budget a light one too).  SLOW when
 * Boundaries must. */
static PyObject* begin_step(Core* self, PyObject* ctx, PyObject* const* args, Py_ssize_t nargs) {
    PyObject* d = self->d;
    PyObject* name = args[0];
    PyObject* batch_size = args[1];
    PyObject* budget = nargs > 3 ? args[3] : NULL;
    PyObject* batch_reason = nargs > 4 ? args[4] : Py_None;
    PyObject* batch = nargs > 5 ? args[5] : NO_BATCH;
    if (batch_size == Py_None && batch != NO_BATCH) return SLOW;  /* its size is inferred in Python */
    if (name != Py_None && !PyUnicode_CheckExact(name)) return SLOW;
    if (budget != NULL && (!PyTuple_CheckExact(budget) || PyTuple_GET_SIZE(budget) != 2)) return SLOW;
    if (budget != NULL && PyTuple_GET_ITEM(budget, 0) == Py_None && PyTuple_GET_ITEM(budget, 1) == Py_None) budget = NULL;
    long long n, i, t_in;
    int ours = entry_is_ours(d, ctx, &n, &i);
    if (ours <= 0) return ours < 0 ? NULL : SLOW;
    if (name == Py_None || PyUnicode_GET_LENGTH(name) == 0) name = DEFAULT_STEP;
    PyObject *step = NULL, *b = NULL;
    PyObject* slot = bget(d, B_SLOT);
    PyObject* clock = bget(d, B_CLOCK);
    PyObject* warm = bget(d, B_WARMUP);
    PyObject* index = Py_NewRef(bget(d, B_NEXT));
    if (tick(clock, &t_in) < 0) goto fail;
    {
        PyObject* following = PyLong_FromLongLong(i + 1);
        if (following == NULL || bset(d, B_NEXT, following) < 0) {
            Py_XDECREF(following);
            goto fail;
        }
        Py_DECREF(following);
    }
    PyObject* cbatch = SLOT(ctx, C_CTX, X_BATCH);
    if (batch_size == Py_None && batch_reason == Py_None && cbatch != Py_None) {
        if (!PyTuple_CheckExact(cbatch) || PyTuple_GET_SIZE(cbatch) != 2) {
            PyErr_SetString(PyExc_TypeError, "stepprof core: a thread's batch must be (size, reason)");
            goto fail;
        }
        batch_size = PyTuple_GET_ITEM(cbatch, 0);
        batch_reason = PyTuple_GET_ITEM(cbatch, 1);
    }
    int warmup = PyObject_RichCompareBool(index, warm, Py_LT);
    int timing, memory, light = 0;
    if (warmup < 0 || (step = new_step(d, ctx, slot, name, index, warmup, batch_size, batch_reason, t_in)) == NULL ||
        (b = step_backend(self, step, slot, &timing, &memory)) == NULL)
        goto fail;
    PyObject* budget_ = bget(d, B_BUDGET);
    if (budget_ != NULL && budget_ != Py_None && !warmup &&
        (light = light_step(self, ctx, step, b, timing, budget, budget_, clock, i, t_in)) < 0)
        goto fail;
    if (!light && (choose_phase_peaks(d, step, n, warmup, i) < 0 ||
                   enter_device(self, ctx, step, b, timing, memory, warmup, budget, clock, t_in) < 0))
        goto fail;
    Py_DECREF(b);
    Py_DECREF(index);
    self->fast_entries++;
    return step;
fail:
    Py_XDECREF(b);
    Py_XDECREF(step);
    Py_DECREF(index);
    {
        PyObject* argv[3] = {ctx, Py_None, ZERO_};  /* the entry's context: ctx, open_step None, depth 0 */
        return hand_over(self->entry_failed, argv, 3);
    }
}

/* Open a phase of ``step`` (StepMeasure.begin_phase).  SLOW when Boundaries must. */
static PyObject* begin_phase(Core* self, PyObject* ctx, PyObject* step, PyObject* name) {
    PyObject* d = self->d;
    PyObject* clock = bget(d, B_CLOCK);
    PyObject* stack = SLOT(ctx, C_CTX, X_STACK);
    if (clock == NULL || bget(d, B_BEGIN_PHASE) != NULL || !PyList_CheckExact(stack) ||
        (name != Py_None && !PyUnicode_CheckExact(name))) {
        if (PyErr_Occurred()) return NULL;
        return SLOW;
    }
    Py_ssize_t depth = PyList_GET_SIZE(stack);
    PyObject* top = depth ? PyList_GET_ITEM(stack, depth - 1) : NULL;
    if (top != NULL && (!Py_IS_TYPE(top, CLS[C_PHASE].type) || Py_REFCNT(top) <= 1)) return SLOW;  /* orphaned: Python closes it */
    if (name == Py_None || PyUnicode_GET_LENGTH(name) == 0) name = DEFAULT_PHASE;
    PyObject *ph = NULL, *mark = NULL, *mem = NULL, *key = NULL, *depth_obj = NULL;
    long long t_in, t0;
    PyObject* b = SLOT(step, C_STEP, S_BACKEND);  /* a step ends on the backend it began on */
    if (tick(clock, &t_in) < 0 || plan(self, b) < 0) goto fail;
    Label l = {name, NULL};
    if (top != NULL) {  /* nested: the enclosing phase's peak so far, and a start event of its own */
        key = PyUnicode_FromFormat("%U/%U", SLOT(top, C_PHASE, P_KEY), name);
        if (key == NULL || (ph = make(C_PHASE)) == NULL) goto fail;
        set_slot(ph, C_PHASE, P_KEY, key);
        set_slot(ph, C_PHASE, P_CTX, ctx);
        if (SLOT(step, C_STEP, S_PHASE_PEAKS) == Py_True) {
            if (cross(self, F_MARK | F_READ | F_RESET | F_PUSH, &l, &mark, &mem) < 0) goto fail;
            set_slot(ph, C_PHASE, P_MARK, mark);
            if (mem != Py_None && fold_peak(ctx, step, mem) < 0) goto fail;
        } else {
            if (cross(self, F_MARK | F_PUSH, &l, &mark, &mem) < 0) goto fail;
            set_slot(ph, C_PHASE, P_MARK, mark);
        }
        if (PyList_Append(stack, ph) < 0) goto fail;
    } else {  /* top level: it starts at the last top-level boundary's mark */
        if ((ph = make(C_PHASE)) == NULL) goto fail;
        set_slot(ph, C_PHASE, P_KEY, name);
        set_slot(ph, C_PHASE, P_CTX, ctx);
        if (PyList_Append(stack, ph) < 0) goto fail;
        if (cross(self, F_PUSH, &l, &mark, &mem) < 0) goto fail;
        set_slot(ph, C_PHASE, P_MARK, SLOT(ctx, C_CTX, X_LAST_TOP));
    }
    if (tick(clock, &t0) < 0 || set_ll(ph, C_PHASE, P_T0, t0) < 0 || add_ll(step, C_STEP, S_OVERHEAD, t0 - t_in) < 0)
        goto fail;
    Py_XDECREF(key);
    Py_XDECREF(mark);
    Py_XDECREF(mem);
    self->fast_entries++;
    return ph;
fail:
    Py_XDECREF(key);
    Py_XDECREF(mark);
    Py_XDECREF(mem);
    Py_XDECREF(ph);
    if ((depth_obj = PyLong_FromSsize_t(depth)) == NULL) return NULL;
    {
        PyObject* argv[3] = {ctx, step, depth_obj};
        PyObject* r = hand_over(self->entry_failed, argv, 3);
        Py_DECREF(depth_obj);
        return r;
    }
}

/* enter(name, batch_size, step, budget=(None, None), batch_reason=None, batch=NO_BATCH) -> token */
static PyObject* core_enter(Core* self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject* d = self->d;
    PyObject* r = SLOW;
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)  /* by keyword: Python's */
        return PyObject_Vectorcall(self->enter, args, nargs, kwnames);
    if (nargs >= 3 && nargs <= 6 && bget(d, B_CLOSED) == Py_False && bget(d, B_CLOSING) == Py_False &&
        bget(d, B_BROKEN) == Py_None) {
        PyObject* threads = bget(d, B_THREADS);
        PyObject* ctx = threads != NULL && Py_IS_TYPE(threads, CLS[C_THREADS].type) ? SLOT(threads, C_THREADS, 0) : NULL;
        if (ctx != NULL && Py_IS_TYPE(ctx, CLS[C_CTX].type) && own_thread(ctx)) {
            PyObject* open_step = SLOT(ctx, C_CTX, X_STEP);
            PyObject* is_step = args[2];
            if (open_step == Py_None) {
                r = begin_step(self, ctx, args, nargs);
            } else if (is_step == Py_False && Py_IS_TYPE(open_step, CLS[C_STEP].type) &&
                       Py_REFCNT(open_step) > 2 /* else orphaned: Python closes it */) {
                PyObject* sampled = SLOT(open_step, C_STEP, S_SAMPLED);
                if (sampled == Py_None || (PyLong_CheckExact(sampled) && PyLong_AsLong(sampled) > 0)) {
                    r = begin_phase(self, ctx, open_step, args[0]);
                } else if (PyLong_CheckExact(sampled) && PyLong_AsLong(sampled) == 0) {
                    self->fast_entries++;
                    return Py_NewRef(LIGHT_PHASE);  /* a phase of a light step: not measured */
                }
                if (r == SLOW && PyErr_Occurred()) PyErr_Clear();  /* (an int past a long: Python's) */
            }
        }
    }
    if (r != SLOW) return r;
    if (PyErr_Occurred()) return NULL;
    return PyObject_Vectorcall(self->enter, args, nargs, NULL);
}

/* -- exit ---------------------------------------------------------------------------- */

/* Close ``ph``, the innermost phase of ``step`` (StepMeasure.end_phase). */
static PyObject* end_phase(Core* self, PyObject* ctx, PyObject* step, PyObject* ph) {
    PyObject* d = self->d;
    PyObject* clock = bget(d, B_CLOCK);
    PyObject* phases = SLOT(step, C_STEP, S_PHASES);
    if (clock == NULL || bget(d, B_END_PHASE) != NULL || !PyDict_CheckExact(phases)) {
        if (PyErr_Occurred()) return NULL;
        return SLOW;
    }
    PyObject* stack = SLOT(ctx, C_CTX, X_STACK);
    PyObject *end = NULL, *mem = NULL, *total = NULL, *pair = NULL;
    long long t_in, t1, pt0;
    long flags = F_MARK | F_POP;
    if (SLOT(step, C_STEP, S_PHASE_PEAKS) == Py_True) flags |= F_READ | F_RESET;
    if (tick(clock, &t_in) < 0 || plan(self, SLOT(step, C_STEP, S_BACKEND)) < 0) goto fail;
    Label l = {NULL, NULL};
    if (cross(self, flags, &l, &end, &mem) < 0) goto fail;
    if (mem != Py_None && fold_peak(ctx, step, mem) < 0) goto fail;
    if (PyList_GET_SIZE(stack) == 0 || PyList_GET_ITEM(stack, PyList_GET_SIZE(stack) - 1) != ph) {
        PyErr_SetString(PyExc_RuntimeError, "stepprof core: the phase stack changed during a boundary");
        goto fail;
    }
    if (PyList_GET_ITEM(stack, 0) == ph) set_slot(ctx, C_CTX, X_LAST_TOP, end);
    PyObject* key = SLOT(ph, C_PHASE, P_KEY);
    total = PyDict_GetItemWithError(phases, key);
    if (total != NULL) {
        if (!Py_IS_TYPE(total, CLS[C_TOTALS].type)) {
            PyErr_SetString(PyExc_TypeError, "stepprof core: a step's phases hold a foreign object");
            total = NULL;
            goto fail;
        }
        Py_INCREF(total);
    } else {
        if (PyErr_Occurred() || (total = make(C_TOTALS)) == NULL) goto fail;
        untrack_totals(total);
        set_slot(total, C_TOTALS, T_T0, SLOT(ph, C_PHASE, P_T0));  /* its first run: keys run one after another */
        if (PyDict_SetItem(phases, key, total) < 0) goto fail;
    }
    if (as_ll(SLOT(ph, C_PHASE, P_T0), &pt0) < 0 || add_ll(total, C_TOTALS, T_WALL, t_in - pt0) < 0) goto fail;
    if ((pair = PyTuple_Pack(2, SLOT(ph, C_PHASE, P_MARK), end)) == NULL) goto fail;
    PyObject_GC_UnTrack(pair);  /* (see untrack_totals) */
    if (PyList_Append(SLOT(total, C_TOTALS, T_MARKS), pair) < 0) goto fail;
    int gt = PyObject_RichCompareBool(SLOT(ph, C_PHASE, P_PEAK), SLOT(total, C_TOTALS, T_PEAK), Py_GT);
    if (gt < 0) goto fail;
    if (gt) set_slot(total, C_TOTALS, T_PEAK, SLOT(ph, C_PHASE, P_PEAK));
    if (add_ll(total, C_TOTALS, T_COUNT, 1) < 0 ||
        steal_slot(total, C_TOTALS, T_SYNCS, PyNumber_Add(SLOT(total, C_TOTALS, T_SYNCS), SLOT(ph, C_PHASE, P_SYNCS))) < 0)
        goto fail;
    if (PyList_SetSlice(stack, PyList_GET_SIZE(stack) - 1, PyList_GET_SIZE(stack), NULL) < 0) goto fail;
    if (tick(clock, &t1) < 0 || add_ll(step, C_STEP, S_OVERHEAD, t1 - t_in) < 0) goto fail;
    Py_DECREF(end);
    Py_DECREF(mem);
    Py_DECREF(total);
    Py_DECREF(pair);
    self->fast_exits++;
    Py_RETURN_NONE;
fail:
    Py_XDECREF(end);
    Py_XDECREF(mem);
    Py_XDECREF(total);
    Py_XDECREF(pair);
    {
        PyObject* argv[1] = {ph};
        return hand_over(self->exit_failed, argv, 1);
    }
}

/* The element-wise difference of two tuples of ints, as map(sub, a, b) (new reference). */
static PyObject* minus(PyObject* a, PyObject* b) {
    Py_ssize_t n = PyTuple_GET_SIZE(a) < PyTuple_GET_SIZE(b) ? PyTuple_GET_SIZE(a) : PyTuple_GET_SIZE(b);
    PyObject* out = PyTuple_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject* v = PyNumber_Subtract(PyTuple_GET_ITEM(a, i), PyTuple_GET_ITEM(b, i));
        if (v == NULL) Py_CLEAR(out);
        else PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

/* The memory read at a step's exit (StepMeasure.end_step, after the boundary). */
static int step_memory(PyObject* d, PyObject* step, PyObject* mem) {
    PyObject* last = bget(d, B_LAST_PEAK);
    PyObject* steady = bget(d, B_STEADY);
    PyObject* previous = bget(d, B_COUNTERS);
    if (last == NULL || steady == NULL || previous == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "stepprof core: Boundaries lacks its memory state");
        return -1;
    }
    PyObject* peak = SLOT(step, C_STEP, S_PEAK);
    int same = PyObject_RichCompareBool(peak, last, Py_EQ);
    if (same < 0) return -1;
    if (same) {
        long long s;
        if (as_ll(steady, &s) < 0) return -1;
        PyObject* v = PyLong_FromLongLong(s + 1);
        if (v == NULL || bset(d, B_STEADY, v) < 0) {
            Py_XDECREF(v);
            return -1;
        }
        Py_DECREF(v);
    } else if (bset(d, B_STEADY, ZERO_) < 0 || bset(d, B_LAST_PEAK, peak) < 0) {
        return -1;
    }
    set_slot(step, C_STEP, S_RESERVED, PyTuple_GET_ITEM(mem, 1));
    PyObject* counters = PyTuple_GetSlice(mem, 2, PyTuple_GET_SIZE(mem));
    if (counters == NULL) return -1;
    if (PyTuple_GET_SIZE(counters) == 0) Py_SETREF(counters, Py_NewRef(Py_None));
    Py_INCREF(previous);  /* (the dict's reference goes below) */
    if (counters != Py_None && previous != Py_None) {
        if (!PyTuple_CheckExact(previous) || steal_slot(step, C_STEP, S_COUNTERS, minus(counters, previous)) < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "stepprof core: _counters must be a tuple");
            Py_DECREF(previous);
            Py_DECREF(counters);
            return -1;
        }
    }
    int rc = bset(d, B_COUNTERS, counters);
    Py_DECREF(previous);
    Py_DECREF(counters);
    return rc;
}

/* Hand a step to the collector (the end of StepMeasure.end_step). */
static int queue(Core* self, PyObject* ctx, PyObject* step, long long t_in, PyObject* clock, int timing) {
    PyObject* d = self->d;
    PyObject* pending = bget(d, B_PENDING);
    PyObject* collector = bget(d, B_COLLECTOR);
    PyObject* closing = bget(d, B_CLOSING);
    PyObject* inline_ = bget(d, B_INLINE);
    if (pending == NULL || collector == NULL || closing == NULL || inline_ == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "stepprof core: Boundaries lacks its collector");
        return -1;
    }
    long long now;
    if (closing == Py_True)  /* another thread is closing: it writes what was pending when it began */
        return call_void(PyObject_CallMethodOneArg(pending, K[M_APPEND], step));
    if (inline_ == Py_True) {  /* inline mode: harvest older steps here (the harvest times itself) */
        if (tick(clock, &now) < 0 || add_ll(step, C_STEP, S_OVERHEAD, now - t_in) < 0 ||
            call_void(PyObject_CallMethodNoArgs(collector, K[M_HARVEST])) < 0 ||
            call_void(PyObject_CallMethodOneArg(pending, K[M_APPEND], step)) < 0)
            return -1;
        if (!timing && call_void(PyObject_CallMethodNoArgs(collector, K[M_HARVEST])) < 0) return -1;
        if (tick(clock, &now) < 0) return -1;
        return set_ll(ctx, C_CTX, X_LAST_EXIT, now);
    }
    PyObject* error = PyObject_GetAttr(collector, K[M_ERROR]);
    if (error == NULL) return -1;
    int warn = error != Py_None;
    Py_DECREF(error);
    if (!warn) {
        PyObject* writer = bget(d, B_WRITER);
        if (writer != NULL && writer != Py_None) {
            PyObject* failed = PyObject_GetAttr(writer, K[M_FAILED]);
            if (failed == NULL) return -1;
            warn = failed != Py_None;
            Py_DECREF(failed);
        } else if (PyErr_Occurred()) {
            return -1;
        }
    }
    if (warn && call_void(PyObject_CallMethodNoArgs(collector, K[M_WARN_ASYNC])) < 0) return -1;
    if (tick(clock, &now) < 0 || add_ll(step, C_STEP, S_OVERHEAD, now - t_in) < 0 ||
        call_void(PyObject_CallMethodOneArg(pending, K[M_APPEND], step)) < 0 || set_ll(ctx, C_CTX, X_LAST_EXIT, now) < 0)
        return -1;
    PyObject* thread = PyObject_GetAttr(collector, K[M_THREAD]);
    if (thread == NULL) return -1;
    Py_DECREF(thread);
    if (thread == Py_None) {
        if (call_void(PyObject_CallMethodNoArgs(collector, K[M_START])) < 0 || tick(clock, &now) < 0) return -1;
        return set_ll(ctx, C_CTX, X_LAST_EXIT, now);
    }
    PyObject* at = PyObject_GetAttr(collector, K[M_CATCH_UP_AT]);
    PyObject* most = at == NULL ? NULL : PyObject_GetAttr(collector, K[M_HARVEST_AT]);
    long long catch_up_at, harvest_at;
    Py_ssize_t waiting = PyObject_Size(pending);
    int bad = most == NULL || waiting < 0 || as_ll(at, &catch_up_at) < 0 || as_ll(most, &harvest_at) < 0;
    Py_XDECREF(at);
    Py_XDECREF(most);
    if (bad) return -1;
    if (now >= catch_up_at || waiting > harvest_at) {
        PyObject* n = PyLong_FromLongLong(now);
        PyObject* took = n == NULL ? NULL : PyObject_CallMethodOneArg(collector, K[M_CATCH_UP], n);
        Py_XDECREF(n);
        if (took == NULL) return -1;
        int yes = PyObject_IsTrue(took);
        Py_DECREF(took);
        if (yes < 0) return -1;
        if (yes) {  /* the harvest is stepprof's time, not the data wait */
            if (tick(clock, &now) < 0) return -1;
            return set_ll(ctx, C_CTX, X_LAST_EXIT, now);
        }
    }
    return 0;
}

/* SyncTracker.end: for a sync-free step, on its slots; else its own.  A new reference. */
static PyObject* end_tracker(PyObject* t) {
    if (!Py_IS_TYPE(t, CLS[C_TRACKER].type) || SLOT(t, C_TRACKER, R_COUNT) != ZERO_ ||
        SLOT(t, C_TRACKER, R_OTHER) != ZERO_ || !PyDict_CheckExact(SLOT(t, C_TRACKER, R_SITES)) ||
        PyDict_GET_SIZE(SLOT(t, C_TRACKER, R_SITES)) != 0)
        return PyObject_CallMethodNoArgs(t, K[M_END]);
    PyObject* sites = PyList_New(0);
    PyObject* d = sites != NULL ? PyDict_New() : NULL;
    if (d == NULL || PyDict_SetItem(d, K[M_COUNT], ZERO_) < 0 || PyDict_SetItem(d, K[M_WAITS], ZERO_) < 0 ||
        PyDict_SetItem(d, K[M_SITES], sites) < 0 || PyDict_SetItem(d, K[M_OTHER_THREADS], ZERO_) < 0 ||
        PyDict_SetItem(d, K[M_MECHANISM], SLOT(t, C_TRACKER, R_MECHANISM)) < 0) {
        Py_XDECREF(sites);
        Py_XDECREF(d);
        return NULL;
    }
    Py_DECREF(sites);
    set_slot(t, C_TRACKER, R_LAST_USER, Py_None);
    set_slot(t, C_TRACKER, R_LAST_CHILD, Py_None);
    set_slot(t, C_TRACKER, R_OPEN, NO_PHASES);
    return d;
}

/* StepMeasure._unwatch where the step's backend gave a sync plan at its last watch (its
 * unwatch_syncs is then _syncs.detach) and the tracker is its thread's innermost: 1 done, 0
 * left to _unwatch. */
static int detach_tracker(Core* self, PyObject* ctx, PyObject* b) {
    PyObject* t = SLOT(ctx, C_CTX, X_TRACKER);
    if (self->sync_for != b || self->sync_plan == NULL || !Py_IS_TYPE(t, CLS[C_TRACKER].type)) return 0;
    PyObject* tid = SLOT(ctx, C_CTX, X_TID);
    PyObject* stack = PyDict_GetItemWithError(TRACKERS, tid);
    Py_ssize_t n = stack != NULL && PyList_CheckExact(stack) ? PyList_GET_SIZE(stack) : 0;
    if (n == 0 || PyList_GET_ITEM(stack, n - 1) != t) return PyErr_Occurred() ? -1 : 0;
    set_slot(ctx, C_CTX, X_WATCHING, Py_False);
    if (n == 1 ? PyDict_DelItem(TRACKERS, tid) < 0 : PyList_SetSlice(stack, n - 1, n, NULL) < 0) return -1;
    set_slot(t, C_TRACKER, R_ATTACHED, Py_False);
    return 1;
}

/* The step's syncs from its tracker, and the watch undone.  *deferred: the "trace" route's
 * budget error (a new reference), which the exit raises when the user's code raised nothing
 * (*exc is then it).  0 or -1. */
static int end_syncs(Core* self, PyObject* ctx, PyObject* step, PyObject** exc, PyObject** deferred) {
    PyObject* tracker = SLOT(ctx, C_CTX, X_TRACKER);
    if (SLOT(ctx, C_CTX, X_WATCHING) == Py_True) {
        if (steal_slot(step, C_STEP, S_SYNCS, end_tracker(tracker)) < 0) return -1;
        if (*exc == Py_None) {
            if ((*deferred = PyObject_GetAttr(tracker, K[M_DEFERRED])) == NULL) return -1;
            if (*deferred != Py_None) *exc = *deferred;  /* the "trace" route's: exit raises it */
        }
    }
    if (SLOT(ctx, C_CTX, X_WATCHING) == Py_True || attr_true(tracker, M_ATTACHED) != 0) {
        if (PyErr_Occurred()) return -1;
        int done = detach_tracker(self, ctx, SLOT(step, C_STEP, S_BACKEND));
        if (done < 0 || (!done && call_void(PyObject_CallOneArg(self->unwatch, ctx)) < 0)) return -1;
    }
    return 0;
}

/* Each hook's on_step_end(step, raised), when the thread's steps are hooked.  0 or -1. */
static int end_hooks(PyObject* ctx, PyObject* hooks, PyObject* step, PyObject* raised) {
    if (SLOT(ctx, C_CTX, X_HOOKED) != Py_True) return 0;
    PyObject* end = Py_NewRef(SLOT(hooks, C_HOOKS, 1));  /* (retire() replaces it: this loop goes on) */
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(end); i++) {
        PyObject* argv[3] = {PyTuple_GET_ITEM(end, i), step, raised};
        PyObject* r = PyObject_VectorcallMethod(K[M_ON_STEP_END], argv, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (call_void(r) < 0) {
            Py_DECREF(end);
            return -1;
        }
    }
    Py_DECREF(end);
    return 0;
}

/* The step's error, {"type": ..., "message": ...}, from the exception.  0 or -1. */
static int set_error(PyObject* step, PyObject* exc) {
    PyObject* type_name = PyObject_GetAttr((PyObject*)Py_TYPE(exc), K[M_NAME_]);
    PyObject* message = type_name == NULL ? NULL : PyObject_CallOneArg(ERROR_MESSAGE, exc);
    PyObject* error = message == NULL ? NULL : PyDict_New();
    if (error == NULL || PyDict_SetItem(error, K[M_TYPE], type_name) < 0 ||
        PyDict_SetItem(error, K[M_MESSAGE], message) < 0) {
        Py_XDECREF(type_name);
        Py_XDECREF(message);
        Py_XDECREF(error);
        return -1;
    }
    Py_DECREF(type_name);
    Py_DECREF(message);
    return steal_slot(step, C_STEP, S_ERROR, error);
}

/* Boundaries.exit: a step over its budget on the "trace" route raises at its exit (when the
 * user's code raised nothing).  None, or NULL with the budget's error set. */
static PyObject* raise_deferred(PyObject* tracker) {
    PyObject* deferred = PyObject_GetAttr(tracker, K[M_DEFERRED]);
    if (deferred == NULL) return NULL;
    if (deferred == Py_None) {
        Py_DECREF(deferred);
        Py_RETURN_NONE;
    }
    if (PyObject_SetAttr(tracker, K[M_DEFERRED], Py_None) == 0)
        PyErr_SetObject((PyObject*)Py_TYPE(deferred), deferred);
    Py_DECREF(deferred);
    return NULL;
}

/* Close a step with no phase left open (StepMeasure.end_step; ``light``: one without device
 * boundaries, under overhead_budget). */
static PyObject* end_step(Core* self, PyObject* ctx, PyObject* step, PyObject* exc, int light) {
    PyObject* d = self->d;
    PyObject* clock = bget(d, B_CLOCK);
    PyObject* hooks = bget(d, B_HOOKS);
    PyObject* slot = bget(d, B_SLOT);
    PyObject* open_steps = bget(d, B_OPEN);
    if (clock == NULL || hooks == NULL || !Py_IS_TYPE(hooks, CLS[C_HOOKS].type) || slot == NULL ||
        !Py_IS_TYPE(slot, CLS[C_SLOT].type) || open_steps == NULL || !PyDict_CheckExact(open_steps) ||
        !PyTuple_CheckExact(SLOT(hooks, C_HOOKS, 1))) {
        if (PyErr_Occurred()) return NULL;
        return SLOW;
    }
    PyObject* raised = exc;  /* the user's exception (the hooks get this one) */
    PyObject* deferred = NULL;
    PyObject *mark = NULL, *mem = NULL;
    long long t_in;
    int timing = 0, memory = 0;
    PyObject* b = SLOT(step, C_STEP, S_BACKEND);
    if (tick(clock, &t_in) < 0 || set_ll(step, C_STEP, S_T1, t_in) < 0 || plan(self, b) < 0 ||
        (timing = attr_true(b, M_TIMING)) < 0 || (memory = attr_true(b, M_MEMORY)) < 0)
        goto fail;
    Label l = {NULL, NULL};
    if (light) {  /* a light step (overhead_budget): no device boundary */
        mark = Py_NewRef(Py_None);
        mem = Py_NewRef(Py_None);
    } else if (cross(self, F_MARK | F_READ | F_POP, &l, &mark, &mem) < 0) {
        goto fail;
    } else {
        set_slot(step, C_STEP, S_END, mark);
    }
    if ((mem != Py_None && fold_peak(ctx, step, mem) < 0) || end_syncs(self, ctx, step, &exc, &deferred) < 0 ||
        (mem != Py_None && step_memory(d, step, mem) < 0))
        goto fail;
    if (!memory && !light &&
        steal_slot(step, C_STEP, S_RSS, PyObject_CallNoArgs(SLOT(slot, C_SLOT, L_READ_RSS))) < 0)
        goto fail;
    if (end_hooks(ctx, hooks, step, raised) < 0 || (exc != Py_None && set_error(step, exc) < 0)) goto fail;
    set_slot(ctx, C_CTX, X_STEP, Py_None);
    set_slot(ctx, C_CTX, X_LAST_TOP, Py_None);
    if (PyDict_DelItem(open_steps, SLOT(ctx, C_CTX, X_TID)) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError)) goto fail;
        PyErr_Clear();
    }
    set_slot(step, C_STEP, S_QUEUED, Py_True);
    if (queue(self, ctx, step, t_in, clock, timing) < 0) goto fail;
    Py_DECREF(mark);
    Py_DECREF(mem);
    Py_XDECREF(deferred);
    self->fast_exits++;
    if (raised == Py_None) return raise_deferred(SLOT(ctx, C_CTX, X_TRACKER));
    Py_RETURN_NONE;
fail:
    Py_XDECREF(mark);
    Py_XDECREF(mem);
    Py_XDECREF(deferred);
    {
        PyObject* argv[1] = {step};
        return hand_over(self->exit_failed, argv, 1);
    }
}

/* exit(token, exc) */
static PyObject* core_exit(Core* self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject* d = self->d;
    PyObject* r = SLOW;
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) != 0)
        return PyObject_Vectorcall(self->exit, args, nargs, kwnames);
    if (nargs == 2 && args[0] == LIGHT_PHASE) {
        self->fast_exits++;
        Py_RETURN_NONE;  /* a phase of a light step: nothing was measured */
    }
    if (nargs == 2 && bget(d, B_CLOSED) == Py_False && bget(d, B_CLOSING) == Py_False &&
        bget(d, B_BROKEN) == Py_None) {
        PyObject* token = args[0];
        if (Py_IS_TYPE(token, CLS[C_STEP].type)) {
            PyObject* ctx = SLOT(token, C_STEP, S_CTX);
            PyObject* sampled = SLOT(token, C_STEP, S_SAMPLED);
            if (Py_IS_TYPE(ctx, CLS[C_CTX].type) && SLOT(ctx, C_CTX, X_STEP) == token &&
                PyList_CheckExact(SLOT(ctx, C_CTX, X_STACK)) && PyList_GET_SIZE(SLOT(ctx, C_CTX, X_STACK)) == 0 &&
                (sampled == Py_None || PyLong_CheckExact(sampled)) && bget(d, B_EXCHANGE) == Py_None &&
                !PyErr_Occurred())
                r = end_step(self, ctx, token, args[1], sampled != Py_None && PyLong_AsLong(sampled) == 0);
        } else if (Py_IS_TYPE(token, CLS[C_PHASE].type)) {
            PyObject* ctx = SLOT(token, C_PHASE, P_CTX);
            if (Py_IS_TYPE(ctx, CLS[C_CTX].type)) {
                PyObject* step = SLOT(ctx, C_CTX, X_STEP);
                PyObject* stack = SLOT(ctx, C_CTX, X_STACK);
                if (Py_IS_TYPE(step, CLS[C_STEP].type) && PyList_CheckExact(stack) && PyList_GET_SIZE(stack) > 0 &&
                    PyList_GET_ITEM(stack, PyList_GET_SIZE(stack) - 1) == token)
                    r = end_phase(self, ctx, step, token);
            }
        }
    }
    if (r != SLOW) return r;
    if (PyErr_Occurred()) return NULL;
    return PyObject_Vectorcall(self->exit, args, nargs, NULL);
}

static PyObject* core_counts(Core* self, PyObject* unused) {
    (void)unused;
    return Py_BuildValue("(nn)", self->fast_entries, self->fast_exits);
}

static PyMethodDef core_methods[] = {
    {"enter", (PyCFunction)(void (*)(void))core_enter, METH_FASTCALL | METH_KEYWORDS,
     "enter(name, batch_size, step, budget=(None, None), batch_reason=None, batch=NO_BATCH) -> token: "
     "Boundaries.enter, in C where it can be"},
    {"exit", (PyCFunction)(void (*)(void))core_exit, METH_FASTCALL | METH_KEYWORDS,
     "exit(token, exc): Boundaries.exit, in C where it can be"},
    {"counts", (PyCFunction)core_counts, METH_NOARGS, "counts() -> (entries, exits) done in C"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stepprof_fold.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Core(boundaries): the step core of a profiler's Boundaries (see stepprof/_core.c)",
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_new = core_new,
    .tp_methods = core_methods,
};

/* configure_core(Step, step, OpenPhase, phase, PhaseTotals, totals, ThreadSteps, Threads,
 *                ActiveHooks, BackendSlot, NO_BATCH, LIGHT_PHASE, error_message,
 *                (MARK, READ, RESET, PUSH, POP), SyncTracker, _syncs._trackers) */
static PyObject* configure_core(PyObject* self, PyObject* args) {
    (void)self;
    PyObject *step_t, *step, *phase_t, *phase, *totals_t, *totals, *ctx_t, *threads_t, *hooks_t, *slot_t;
    PyObject *no_batch, *light_phase, *error_message, *tracker_t, *trackers;
    long f[5];
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOO(lllll)OO!:configure_core", &step_t, &step, &phase_t, &phase, &totals_t,
                          &totals, &ctx_t, &threads_t, &hooks_t, &slot_t, &no_batch, &light_phase, &error_message,
                          &f[0], &f[1], &f[2], &f[3], &f[4], &tracker_t, &PyDict_Type, &trackers))
        return NULL;
    /* Into new tables first, swapped in at once: a step core in use on another thread never
     * sees a table half made (configuring runs Python's allocator, which may switch threads). */
    Class fresh[N_CLASSES];
    memset(fresh, 0, sizeof fresh);
    PyObject* types[N_CLASSES] = {step_t, phase_t, totals_t, ctx_t, threads_t, hooks_t, slot_t, tracker_t};
    PyObject* protos[N_CLASSES] = {step, phase, totals, Py_None, Py_None, Py_None, Py_None, Py_None};
    for (int c = 0; c < N_CLASSES; c++) {
        if (take_class(&fresh[c], c, types[c], protos[c]) < 0) {
            for (int i = 0; i <= c; i++) class_clear(&fresh[i]);
            return NULL;
        }
    }
    if (!PyCallable_Check(error_message)) {
        for (int i = 0; i < N_CLASSES; i++) class_clear(&fresh[i]);
        PyErr_SetString(PyExc_TypeError, "configure_core: error_message must be callable");
        return NULL;
    }
    Class old[N_CLASSES];
    memcpy(old, CLS, sizeof CLS);
    memcpy(CLS, fresh, sizeof CLS);
    PyObject* old_no_batch = NO_BATCH;
    PyObject* old_light = LIGHT_PHASE;
    PyObject* old_message = ERROR_MESSAGE;
    Py_XSETREF(TRACKERS, Py_NewRef(trackers));
    NO_BATCH = Py_NewRef(no_batch);
    LIGHT_PHASE = Py_NewRef(light_phase);
    ERROR_MESSAGE = Py_NewRef(error_message);
    F_MARK = f[0], F_READ = f[1], F_RESET = f[2], F_PUSH = f[3], F_POP = f[4];
    configured = 1;
    for (int i = 0; i < N_CLASSES; i++) class_clear(&old[i]);
    Py_XDECREF(old_no_batch);
    Py_XDECREF(old_light);
    Py_XDECREF(old_message);
    Py_RETURN_NONE;
}

/* checks_pass(checks) -> bool: the step core's own test of a sync plan's checks (for the tests). */
static PyObject* checks_pass_py(PyObject* self, PyObject* checks) {
    (void)self;
    int r = checks_pass(checks);
    return r < 0 ? NULL : PyBool_FromLong(r);
}

static PyMethodDef core_functions[] = {
    {"configure_core", configure_core, METH_VARARGS,
     "configure_core(Step, a Step, OpenPhase, an OpenPhase, PhaseTotals, a PhaseTotals, ThreadSteps, Threads, "
     "ActiveHooks, BackendSlot, NO_BATCH, LIGHT_PHASE, error_message, (MARK, READ, RESET, PUSH, POP), SyncTracker, "
     "_syncs._trackers)"},
    {"checks_pass", checks_pass_py, METH_O, "checks_pass(checks) -> bool: whether every check of a sync plan holds"},
    {NULL, NULL, 0, NULL},
};

/* Called by the module's init (_fold.c): add Core and configure_core to module m. */
int stepprof_core_add(PyObject* m) {
    for (int i = 0; i < N_KEYS; i++) {
        if ((K[i] = PyUnicode_InternFromString(KEYS[i])) == NULL) return -1;
    }
    if ((DEFAULT_STEP = PyUnicode_InternFromString("step")) == NULL ||
        (DEFAULT_PHASE = PyUnicode_InternFromString("phase")) == NULL || (MINUS_ONE = PyLong_FromLong(-1)) == NULL ||
        (ZERO_ = PyLong_FromLong(0)) == NULL || (NO_PHASES = PyTuple_New(0)) == NULL)
        return -1;
    if (PyType_Ready(&CoreType) < 0) return -1;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject*)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        return -1;
    }
    return PyModule_AddFunctions(m, core_functions);
}
