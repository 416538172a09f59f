/* The collector's per-record work in C: fold_step (the summary's StepTotals.add, below) and
 * build_step (a full CUDA step's record, further down: stepprof/_recorder/collector.py).
 *
 * fold_step(totals, record) does what StepTotals.add(record) does, on the same Python
 * accumulators, and returns the same bool; it returns NotImplemented, having changed nothing,
 * for the records it leaves to Python: a step left out for a reason other than warm-up, an
 * error or a malformed wall time (flops_counted, explained, compiled), and numbers whose
 * arithmetic a double would not reproduce (an int past 2**52, a product past a float's range).
 * Python owns the rules and the constants (configure()); tests/test_fold.py holds the two
 * paths to the same accumulators on fuzzed records.  Pure CPython API: no torch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <structmember.h> /* PyMemberDef */

#define ABI 1

static Py_ssize_t spikes_kept = 32, settle_every = 4096, table_cap = 256;

enum {
    K_STEP, K_DEVICE, K_NAME, K_TFLOPS, K_MFU, K_COMPILES, K_WARMUP, K_ERROR, K_WALL, K_COUNTED,
    K_EXPLAINED, K_COMPILED, K_GPU, K_BUSY, K_OVERHEAD, K_PEAK, K_RESERVED, K_RSS, K_BATCH, K_SPS,
    K_WAIT, K_WAIT_IN, K_DATA, K_ALLOC, K_SYNCS, K_PHASES, K_ENERGY, K_ENERGY_SPAN, K_UNAVAIL,
    K_COUNT, K_MECHANISM, K_OTHER_THREADS, K_SITES, K_DEVICE_ALLOC, K_RETRIES, K_WHERE, K_KIND, K_MFU_DS, K_TPS,
    /* attributes */
    A_STEPS, A_WARMUP, A_ERRORS, A_MALFORMED, A_MEASURED, A_FIRST_STEP, A_LAST_STEP, A_FIRST_MEASURED,
    A_DEVICES, A_NAMES, A_WALL, A_GPU, A_SPAN, A_BUSY, A_SPS_, A_TPS, A_SYNCS, A_TFLOPS, A_MFU, A_MFU_DS, A_OVERHEAD,
    A_DATA_WAIT, A_WAIT_IN, A_OVERHEAD_SUM, A_WAIT_SUM, A_LOOP_SUM, A_DATA_SUM, A_DATA_STEPS,
    A_BATCH_SIZES, A_PEAK, A_RESERVED, A_RESERVED_LAST, A_RSS, A_ALLOC, A_ALLOC_STEPS,
    A_DEVICE_ALLOC_STEPS, A_SYNC_STEPS, A_SYNC_MECHANISM, A_OTHER_THREADS, A_SITES, A_PHASES,
    A_SPIKES, A_STEP_REASONS, A_FLOPS_REQUESTED, A_ENERGY_STEPS, A_ENERGY_UJ, A_ENERGY_SPAN_US,
    A_ENERGY_SAMPLES, A_ENERGY_BATCHED_UJ, A_ENERGY_REASON, A_SINCE_SETTLE, A_VALUE, A_BUF, A_ADD,
    A_AT, A_TAKE_FLOPS, A_TAKE_COMPILES, A_TAKE_REASONS, A_SETTLE, A_COUNT_PH,
    N_NAMES
};

static const char* const NAMES[N_NAMES] = {
    "step", "device", "name", "tflops_per_s", "mfu", "compiles", "warmup", "error", "wall_ms",
    "flops_counted", "explained", "compiled", "gpu_ms", "gpu_busy", "overhead_us",
    "peak_allocated_bytes", "reserved_bytes", "host_rss_bytes", "batch_size", "samples_per_s",
    "data_wait_ms", "data_wait_in_step_ms", "data_ms", "allocator", "syncs", "phases", "energy_j",
    "energy_span_ms", "unavailable", "count", "mechanism", "other_threads", "sites",
    "num_device_alloc", "num_alloc_retries", "where", "kind", "mfu_datasheet", "tokens_per_s",
    "steps", "warmup", "errors", "malformed", "measured", "first_step", "last_step",
    "first_measured", "devices", "names", "wall", "gpu", "span", "busy", "sps", "tps", "syncs", "tflops",
    "mfu", "mfu_datasheet", "overhead", "data_wait", "wait_in", "overhead_sum_ns", "data_wait_sum_ns",
    "loop_sum_ns", "data_sum_ns", "data_steps", "batch_sizes", "peak", "reserved", "reserved_last",
    "rss", "alloc", "alloc_steps", "steps_with_device_alloc", "sync_steps", "sync_mechanism",
    "other_threads", "sites", "phases", "spikes", "step_reasons", "flops_requested",
    "energy_steps", "energy_uj", "energy_span_us", "energy_samples", "energy_batched_uj",
    "energy_reason", "since_settle", "value", "buf", "add", "at", "_take_flops_state",
    "_take_compiles", "_take_reasons", "settle", "count",
};

static PyObject* S[N_NAMES];
static PyObject* ZERO;

/* The record's value for key k (borrowed; NULL when absent). */
#define GET(d, k) PyDict_GetItemWithError((d), S[k])

static int is_num(PyObject* x) { return x != NULL && (PyFloat_CheckExact(x) || PyLong_CheckExact(x)); }

/* A number as a double, exact: 0 on success, 1 when a double would not reproduce Python's
 * arithmetic on it (an int past 2**52), -1 on an error. */
static int as_double(PyObject* x, double* out) {
    if (PyFloat_CheckExact(x)) {
        *out = PyFloat_AS_DOUBLE(x);
        return 0;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow || v > (1LL << 52) || v < -(1LL << 52)) return 1;
    *out = (double)v;
    return 0;
}

/* Python's round(x) for a finite double, as an int object. */
static PyObject* round_int(double x) { return PyLong_FromDouble(nearbyint(x)); }

/* -- the accumulators, read and written through their slots' offsets -- */

/* Each __slots__ attribute's offset in its object, found by configure() from the classes' member
 * descriptors: StepTotals' and PhaseTotals' accumulators by name, and each accumulator's own
 * ``value`` (or a sketch's ``buf``).  fold_step checks every object's type before it uses an
 * offset, so a class that changed shape is an error, never a stray write. */
static Py_ssize_t off_tot[N_NAMES], off_ph[N_NAMES];
static Py_ssize_t off_value, off_counter, off_table, off_reasons, off_heap, off_buf, off_since;
static PyTypeObject *T_TOTALS, *T_PHASE, *T_SUM, *T_MAX, *T_FIRST, *T_LAST, *T_COUNTER, *T_TABLE,
    *T_SKETCH, *T_REASONS, *T_LARGEST;

#define SLOT(o, off) ((PyObject**)((char*)(o) + (off)))

static PyObject* wrong_shape(PyObject* o, const char* want) {
    PyErr_Format(PyExc_TypeError, "stepprof's C fold expected a %s, not %.100s: rebuild it (`stepprof build`)",
                 want, Py_TYPE(o)->tp_name);
    return NULL;
}

/* The accumulator in ``owner``'s slot at ``off`` (borrowed), checked to be a ``type``. */
static PyObject* acc(PyObject* owner, Py_ssize_t off, PyTypeObject* type) {
    PyObject* a = off > 0 ? *SLOT(owner, off) : NULL;
    if (a == NULL) {
        PyErr_SetString(PyExc_AttributeError, "an accumulator of stepprof's aggregate is unset");
        return NULL;
    }
    return Py_TYPE(a) == type ? a : wrong_shape(a, type->tp_name);
}

/* The container in accumulator ``a``'s slot at ``off`` (borrowed), checked to be exactly a
 * ``type`` (a dict or a list); ``what`` names the shape in the error. */
static PyObject* inner(PyObject* a, Py_ssize_t off, PyTypeObject* type, const char* what) {
    PyObject* c = *SLOT(a, off);
    return c != NULL && Py_TYPE(c) == type ? c : wrong_shape(a, what);
}

static void put(PyObject* o, Py_ssize_t off, PyObject* v) {
    PyObject** p = SLOT(o, off);
    PyObject* old = *p;
    Py_INCREF(v);
    *p = v;
    Py_XDECREF(old);
}

/* <a>.value += n, for a Sum in ``owner``'s slot at ``off``. */
static int sum_add_at(PyObject* owner, Py_ssize_t off, PyObject* n) {
    PyObject* a = acc(owner, off, T_SUM);
    if (a == NULL) return -1;
    PyObject* old = *SLOT(a, off_value);
    PyObject* sum = old ? PyNumber_Add(old, n) : NULL;
    if (sum == NULL) return -1;
    put(a, off_value, sum);
    Py_DECREF(sum);
    return 0;
}

static PyObject* ONE;
#define sum_add(t, a, n) sum_add_at((t), off_tot[a], (n))
#define sum_one(t, a) sum_add_at((t), off_tot[a], ONE)

static int set_value(PyObject* totals, int a, PyObject* x) {
    PyObject* v = acc(totals, off_tot[a], T_LAST);
    if (v == NULL) return -1;
    put(v, off_value, x);
    return 0;
}

/* First: set when None. */
static int first_add(PyObject* totals, int a, PyObject* x) {
    PyObject* v = acc(totals, off_tot[a], T_FIRST);
    if (v == NULL) return -1;
    PyObject* old = *SLOT(v, off_value);
    if (old == NULL || old == Py_None) put(v, off_value, x);
    return 0;
}

/* Max: the value None, or x greater than it. */
static int max_at(PyObject* owner, Py_ssize_t off, PyObject* x) {
    PyObject* v = acc(owner, off, T_MAX);
    if (v == NULL) return -1;
    PyObject* old = *SLOT(v, off_value);
    int greater = old == NULL || old == Py_None ? 1 : PyObject_RichCompareBool(x, old, Py_GT);
    if (greater < 0) return -1;
    if (greater) put(v, off_value, x);
    return 0;
}
#define max_part(t, a, x) max_at((t), off_tot[a], (x))

/* A sketch's buf.append(x). */
static int sketch_at(PyObject* owner, Py_ssize_t off, PyObject* x) {
    PyObject* sk = acc(owner, off, T_SKETCH);
    if (sk == NULL) return -1;
    PyObject* buf = inner(sk, off_buf, &PyList_Type, "sketch with a list buffer");
    if (buf == NULL) return -1;
    return PyList_Append(buf, x);
}
#define sketch_add(t, a, x) sketch_at((t), off_tot[a], (x))

/* Counter.add(key): += 1 when present, else the accumulator's own add (its cap). */
static int counter_add(PyObject* totals, int a, PyObject* key) {
    PyObject* c = acc(totals, off_tot[a], T_COUNTER);
    PyObject* table = c ? inner(c, off_counter, &PyDict_Type, "counter with a dict") : NULL;
    if (table == NULL) return -1;
    PyObject* n = PyDict_GetItemWithError(table, key);
    if (n != NULL) {
        PyObject* m = PyNumber_Add(n, ONE);
        int rc = m ? PyDict_SetItem(table, key, m) : -1;
        Py_XDECREF(m);
        return rc;
    }
    if (PyErr_Occurred()) return -1;
    PyObject* r = PyObject_CallMethodOneArg(c, S[A_ADD], key);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* -- what the record holds, read before anything changes -- */

typedef struct {
    PyObject *idx, *wall, *gpu, *span, *batch, *wait, *inside, *data, *alloc, *syncs, *phases,
        *energy, *energy_span, *unavailable;
    double wall_d, wait_d, inside_d;
    PyObject *overhead_ns, *wait_ns, *loop_ns, *data_ns, *energy_uj, *energy_span_us; /* owned */
    int timed;
} Parsed;

static void parsed_clear(Parsed* p) {
    Py_CLEAR(p->overhead_ns);
    Py_CLEAR(p->wait_ns);
    Py_CLEAR(p->loop_ns);
    Py_CLEAR(p->data_ns);
    Py_CLEAR(p->energy_uj);
    Py_CLEAR(p->energy_span_us);
}

/* round(x * scale) into *out for a number x: 0 done, 1 leave the record to Python, -1 error. */
static int scaled(PyObject* x, double scale, PyObject** out) {
    double d;
    int rc = as_double(x, &d);
    if (rc) return rc;
    d *= scale;
    if (!isfinite(d)) return 1;
    *out = round_int(d);
    return *out ? 0 : -1;
}

#define TRY(expr)                 \
    do {                          \
        int rc_ = (expr);         \
        if (rc_) return rc_;      \
    } while (0)

/* StepTotals._add_energy's sums for a step with energy (µJ, span µs, as ints): the step counted,
 * and with an int batch_size over 0, its samples and their energy.  0 or -1. */
static int sum_energy(PyObject* totals, PyObject* uj, PyObject* span_us, PyObject* batch) {
    int rc = sum_one(totals, A_ENERGY_STEPS);
    if (!rc) rc = sum_add(totals, A_ENERGY_UJ, uj);
    if (!rc) rc = sum_add(totals, A_ENERGY_SPAN_US, span_us);
    if (!rc && batch != NULL && PyLong_CheckExact(batch)) {
        int gt = PyObject_RichCompareBool(batch, ZERO, Py_GT);
        rc = gt < 0 ? -1 : 0;
        if (gt > 0) rc = sum_add(totals, A_ENERGY_SAMPLES, batch);
        if (gt > 0 && !rc) rc = sum_add(totals, A_ENERGY_BATCHED_UJ, uj);
    }
    return rc;
}

/* The timed step's numbers: 0 parsed, 1 leave it to Python, -1 error. */
static int parse_timed(PyObject* r, Parsed* p) {
    p->gpu = GET(r, K_GPU);
    if (p->gpu == NULL && PyErr_Occurred()) return -1;
    p->span = p->wall;
    if (is_num(p->gpu)) {
        int gt = PyObject_RichCompareBool(p->gpu, p->wall, Py_GT);
        if (gt < 0) return -1;
        if (gt) p->span = p->gpu;
    }
    PyObject* x = GET(r, K_OVERHEAD);
    if (is_num(x)) TRY(scaled(x, 1e3, &p->overhead_ns));
    p->wait = GET(r, K_WAIT);
    if (is_num(p->wait)) {
        TRY(as_double(p->wait, &p->wait_d));
        TRY(as_double(p->wall, &p->wall_d));
        TRY(scaled(p->wait, 1e6, &p->wait_ns));
        p->inside = GET(r, K_WAIT_IN);
        double loop = p->wait_d + p->wall_d;
        if (is_num(p->inside)) {
            TRY(as_double(p->inside, &p->inside_d));
            loop -= p->inside_d;
        } else {
            p->inside = NULL;
        }
        loop *= 1e6;
        if (!isfinite(loop)) return 1;
        if ((p->loop_ns = round_int(loop)) == NULL) return -1;
        p->data = GET(r, K_DATA);
        if (is_num(p->data)) TRY(scaled(p->data, 1e6, &p->data_ns));
        else p->data = NULL;
    } else {
        p->wait = NULL;
        p->wait_d = -1.0;
    }
    p->energy = GET(r, K_ENERGY);
    if (p->energy != NULL) {
        p->energy_span = GET(r, K_ENERGY_SPAN);
        if (is_num(p->energy) && is_num(p->energy_span)) {
            int ge = PyObject_RichCompareBool(p->energy, ZERO, Py_GE);
            int gt = PyObject_RichCompareBool(p->energy_span, ZERO, Py_GT);
            if (ge < 0 || gt < 0) return -1;
            if (ge && gt) {
                TRY(scaled(p->energy, 1e6, &p->energy_uj));
                TRY(scaled(p->energy_span, 1e3, &p->energy_span_us));
            }
        }
    }
    return PyErr_Occurred() ? -1 : 0;
}

/* -- a timed step's figures (StepTotals._add_timed) -- */

static int add_phase(PyObject* ph, PyObject* entry, int counted) {
    if (Py_TYPE(ph) != T_PHASE) {
        wrong_shape(ph, T_PHASE->tp_name);
        return -1;
    }
    TRY(sum_add_at(ph, off_ph[A_STEPS], ONE));
    PyObject* x = GET(entry, K_WALL);
    if (is_num(x)) TRY(sketch_at(ph, off_ph[A_WALL], x));
    x = GET(entry, K_GPU);
    if (is_num(x)) TRY(sketch_at(ph, off_ph[A_GPU], x));
    x = GET(entry, K_PEAK);
    if (is_num(x)) TRY(max_at(ph, off_ph[A_PEAK], x));
    x = GET(entry, K_SYNCS);
    if (x != NULL && PyLong_CheckExact(x) && counted) {
        TRY(sum_add_at(ph, off_ph[A_SYNCS], x));
        TRY(sum_add_at(ph, off_ph[A_SYNC_STEPS], ONE));
    }
    x = GET(entry, K_COUNT);
    TRY(sum_add_at(ph, off_ph[A_COUNT_PH], x != NULL && PyLong_CheckExact(x) ? x : ONE));
    return PyErr_Occurred() ? -1 : 0;
}

static int add_phases(PyObject* totals, PyObject* phases, int counted) {
    PyObject* tableacc = acc(totals, off_tot[A_PHASES], T_TABLE);
    PyObject* table = tableacc ? inner(tableacc, off_table, &PyDict_Type, "table with a dict") : NULL;
    if (table == NULL) return -1;
    Py_INCREF(table);  /* (at() may add to it) */
    Py_ssize_t pos = 0;
    PyObject *key, *entry;
    int rc = 0;
    while (!rc && PyDict_Next(phases, &pos, &key, &entry)) {
        PyObject* ph = PyDict_GetItemWithError(table, key);
        Py_XINCREF(ph);
        if (ph == NULL && !PyErr_Occurred()) ph = PyObject_CallMethodOneArg(tableacc, S[A_AT], key);
        if (ph == NULL) rc = -1;
        else if (ph != Py_None && PyDict_CheckExact(entry)) rc = add_phase(ph, entry, counted);
        Py_XDECREF(ph);
    }
    Py_DECREF(table);
    return rc;
}

/* The allocator's counters summed; *allocs and *retries: the step's (new refs). */
static int add_allocator(PyObject* totals, PyObject* alloc, PyObject** allocs, PyObject** retries) {
    TRY(sum_one(totals, A_ALLOC_STEPS));
    PyObject* c = acc(totals, off_tot[A_ALLOC], T_COUNTER);
    PyObject* table = c ? inner(c, off_counter, &PyDict_Type, "counter with a dict") : NULL;
    if (table == NULL) return -1;
    Py_INCREF(table);
    Py_ssize_t pos = 0;
    PyObject *key, *n;
    int rc = 0;
    while (!rc && PyDict_Next(alloc, &pos, &key, &n)) {
        if (!PyLong_CheckExact(n)) continue;
        PyObject* old = PyDict_GetItemWithError(table, key);
        if (old == NULL) {
            rc = PyErr_Occurred() ? -1 : 0;
            continue;
        }
        PyObject* m = PyNumber_Add(old, n);
        rc = m ? PyDict_SetItem(table, key, m) : -1;
        Py_XDECREF(m);
    }
    Py_DECREF(table);
    if (rc) return rc;
    PyObject* a = GET(alloc, K_DEVICE_ALLOC);
    if (a != NULL && PyLong_CheckExact(a)) {
        int gt = PyObject_RichCompareBool(a, ZERO, Py_GT);
        if (gt < 0) return -1;
        if (gt) TRY(sum_one(totals, A_DEVICE_ALLOC_STEPS));
    } else {
        a = ZERO;
    }
    PyObject* t = GET(alloc, K_RETRIES);
    if (t == NULL || !PyLong_CheckExact(t)) t = ZERO;
    Py_INCREF(a);
    Py_INCREF(t);
    *allocs = a;
    *retries = t;
    return PyErr_Occurred() ? -1 : 0;
}

/* A site already in SyncSites' table, with a str where and kind and an int count: its entry's
 * count and steps, in C; any other site (new, odd, or a full table's) through SyncSites.add.
 * The sites go in their order either way. */
static int add_one_site(PyObject* sites, PyObject* table, PyObject* site) {
    if (!PyDict_CheckExact(site)) return 0;
    PyObject* n = GET(site, K_COUNT);
    if (n == NULL || !PyLong_CheckExact(n)) return PyErr_Occurred() ? -1 : 0;
    PyObject* where = GET(site, K_WHERE);
    PyObject* kind = where != NULL ? GET(site, K_KIND) : NULL;
    PyObject* entry = NULL;
    if (PyErr_Occurred()) return -1;
    if (where != NULL && kind != NULL && PyUnicode_CheckExact(where) && PyUnicode_CheckExact(kind)) {
        PyObject* key = PyTuple_Pack(2, where, kind);
        if (key == NULL) return -1;
        entry = PyDict_GetItemWithError(table, key);
        Py_DECREF(key);
        if (entry == NULL && PyErr_Occurred()) return -1;
    }
    if (entry == NULL || !PyList_CheckExact(entry) || PyList_GET_SIZE(entry) != 3) {
        PyObject* one = PyList_New(1);
        if (one == NULL) return -1;
        PyList_SET_ITEM(one, 0, Py_NewRef(site));
        PyObject* res = PyObject_CallMethodOneArg(sites, S[A_ADD], one);
        Py_DECREF(one);
        Py_XDECREF(res);
        return res ? 0 : -1;
    }
    PyObject* count = PyNumber_Add(PyList_GET_ITEM(entry, 0), n);
    PyObject* steps = count ? PyNumber_Add(PyList_GET_ITEM(entry, 2), ONE) : NULL;
    if (steps == NULL) {
        Py_XDECREF(count);
        return -1;
    }
    PyList_SetItem(entry, 0, count);  /* (steals the references) */
    PyList_SetItem(entry, 2, steps);
    return 0;
}

static int add_sites(PyObject* sites, PyObject* list) {
    PyObject* table = PyObject_GetAttr(sites, S[A_VALUE]);
    if (table == NULL) return -1;
    int rc = 0;
    if (!PyDict_CheckExact(table)) rc = (wrong_shape(sites, "sync sites with a dict"), -1);
    Py_INCREF(list);  /* (a site's Python add may run arbitrary code: keep both alive) */
    for (Py_ssize_t i = 0; !rc && i < PyList_GET_SIZE(list); i++) {
        PyObject* site = Py_NewRef(PyList_GET_ITEM(list, i));
        rc = add_one_site(sites, table, site);
        Py_DECREF(site);
    }
    Py_DECREF(list);
    Py_DECREF(table);
    return rc;
}

/* The step's syncs; *count: its count (borrowed), or NULL when it did not count them. */
static int add_syncs(PyObject* totals, PyObject* syncs, PyObject** count) {
    PyObject* c = GET(syncs, K_COUNT);
    if (c == NULL || !PyLong_CheckExact(c)) {
        *count = NULL;
        return PyErr_Occurred() ? -1 : 0;
    }
    *count = c;
    TRY(sum_one(totals, A_SYNC_STEPS));
    TRY(sketch_add(totals, A_SYNCS, c));
    PyObject* x = GET(syncs, K_MECHANISM);
    if (x != NULL && PyUnicode_CheckExact(x)) TRY(set_value(totals, A_SYNC_MECHANISM, x));
    x = GET(syncs, K_OTHER_THREADS);
    if (x != NULL && PyLong_CheckExact(x)) {
        int truth = PyObject_IsTrue(x);
        if (truth < 0) return -1;
        if (truth) TRY(sum_add(totals, A_OTHER_THREADS, x));
    }
    x = GET(syncs, K_SITES);
    if (x != NULL && PyList_CheckExact(x) && PyList_GET_SIZE(x) > 0) {
        PyObject* sites = *SLOT(totals, off_tot[A_SITES]);
        if (sites == NULL || add_sites(sites, x) < 0) return -1;
    }
    return PyErr_Occurred() ? -1 : 0;
}

static int add_spike(PyObject* totals, Parsed* p, PyObject* idx, PyObject* allocs, PyObject* retries,
                     PyObject* syncs) {
    PyObject* heapacc = acc(totals, off_tot[A_SPIKES], T_LARGEST);
    PyObject* heap = heapacc ? inner(heapacc, off_heap, &PyList_Type, "heap with a list") : NULL;
    if (heap == NULL) return -1;
    if (PyList_GET_SIZE(heap) >= spikes_kept) {
        PyObject* least = PyList_GET_ITEM(heap, 0);
        if (!PyTuple_CheckExact(least) || PyTuple_GET_SIZE(least) == 0) {
            wrong_shape(least, "spike tuple");
            return -1;
        }
        int takes = PyObject_RichCompareBool(p->span, PyTuple_GET_ITEM(least, 0), Py_GT);
        if (takes <= 0) return takes;
    }
    PyObject* t = Py_BuildValue("(OOOOOd)", p->span, idx, allocs, retries, syncs, p->wait_d);
    PyObject* res = t ? PyObject_CallMethodOneArg(heapacc, S[A_ADD], t) : NULL;
    Py_XDECREF(t);
    Py_XDECREF(res);
    return res ? 0 : -1;
}

static int take_reasons(PyObject* totals, PyObject* unavailable) {
    PyObject* r = acc(totals, off_tot[A_STEP_REASONS], T_REASONS);
    if (r == NULL) return -1;
    PyObject* table = *SLOT(r, off_reasons);
    if (table == NULL) {
        wrong_shape(r, "table");
        return -1;
    }
    Py_INCREF(table);
    int news = 0;
    if (PyDict_CheckExact(table) && PyDict_GET_SIZE(table) < table_cap) {
        Py_ssize_t pos = 0;
        PyObject *key, *why;
        while (!news && PyDict_Next(unavailable, &pos, &key, &why)) {
            int has = PyDict_Contains(table, key);
            if (has < 0) {
                Py_DECREF(table);
                return -1;
            }
            news = !has;
        }
    }
    Py_DECREF(table);
    if (!news) return 0;
    PyObject* res = PyObject_CallMethodOneArg(totals, S[A_TAKE_REASONS], unavailable);
    Py_XDECREF(res);
    return res ? 0 : -1;
}

/* A timed step's times, memory, batch and input wait (the first part of _add_timed). */
static int add_figures(PyObject* totals, PyObject* r, Parsed* p) {
    TRY(sketch_add(totals, A_WALL, p->wall));
    TRY(sketch_add(totals, A_SPAN, p->span));
    if (is_num(p->gpu)) TRY(sketch_add(totals, A_GPU, p->gpu));
    PyObject* x = GET(r, K_BUSY);
    if (is_num(x)) TRY(sketch_add(totals, A_BUSY, x));
    x = GET(r, K_OVERHEAD);
    if (is_num(x)) TRY(sketch_add(totals, A_OVERHEAD, x));
    if (p->overhead_ns) TRY(sum_add(totals, A_OVERHEAD_SUM, p->overhead_ns));
    /* memory */
    x = GET(r, K_PEAK);
    if (is_num(x)) TRY(max_part(totals, A_PEAK, x));
    x = GET(r, K_RESERVED);
    if (is_num(x)) {
        TRY(set_value(totals, A_RESERVED_LAST, x));
        TRY(max_part(totals, A_RESERVED, x));
    }
    x = GET(r, K_RSS);
    if (x != NULL && PyLong_CheckExact(x)) TRY(set_value(totals, A_RSS, x));
    PyObject* batch = GET(r, K_BATCH);
    if (batch != NULL && PyLong_CheckExact(batch)) {
        TRY(counter_add(totals, A_BATCH_SIZES, batch));
        x = GET(r, K_SPS);
        if (is_num(x)) TRY(sketch_add(totals, A_SPS_, x));
    }
    x = GET(r, K_TPS);
    if (is_num(x)) TRY(sketch_add(totals, A_TPS, x));
    if (p->wait != NULL) {
        TRY(sketch_add(totals, A_DATA_WAIT, p->wait));
        TRY(sum_add(totals, A_WAIT_SUM, p->wait_ns));
        if (p->inside != NULL) TRY(sketch_add(totals, A_WAIT_IN, p->inside));
        TRY(sum_add(totals, A_LOOP_SUM, p->loop_ns));
        if (p->data_ns != NULL) {
            TRY(sum_add(totals, A_DATA_SUM, p->data_ns));
            TRY(sum_one(totals, A_DATA_STEPS));
        }
    }
    return PyErr_Occurred() ? -1 : 0;
}

static int add_timed(PyObject* totals, PyObject* r, Parsed* p) {
    TRY(add_figures(totals, r, p));
    PyObject *batch = GET(r, K_BATCH), *allocs = NULL, *retries = NULL;
    PyObject* x = GET(r, K_ALLOC);
    if (x != NULL && PyDict_CheckExact(x)) {
        if (add_allocator(totals, x, &allocs, &retries)) {
            Py_XDECREF(allocs);
            Py_XDECREF(retries);
            return -1;
        }
    } else {
        allocs = Py_NewRef(ZERO);
        retries = Py_NewRef(ZERO);
    }
    int rc = 0;
    PyObject* n_syncs = NULL;
    x = GET(r, K_SYNCS);
    if (x != NULL && PyDict_CheckExact(x)) rc = add_syncs(totals, x, &n_syncs);
    if (!rc) {
        x = GET(r, K_PHASES);
        if (x != NULL && PyDict_CheckExact(x) && PyDict_GET_SIZE(x) > 0)
            rc = add_phases(totals, x, n_syncs != NULL);
    }
    if (!rc && p->energy != NULL) {
        if (p->energy_uj != NULL) {
            rc = sum_energy(totals, p->energy_uj, p->energy_span_us, batch);
        } else {
            PyObject* reasons = GET(r, K_UNAVAIL);
            PyObject* why = reasons != NULL && PyDict_CheckExact(reasons) ? GET(reasons, K_ENERGY) : NULL;
            if (why != NULL && PyUnicode_CheckExact(why)) rc = set_value(totals, A_ENERGY_REASON, why);
            else if (PyErr_Occurred()) rc = -1;
        }
    }
    if (!rc && GET(r, K_TFLOPS) != NULL) {
        x = GET(r, K_TFLOPS);
        if (is_num(x)) rc = sketch_add(totals, A_TFLOPS, x);
        x = rc ? NULL : GET(r, K_MFU);
        if (is_num(x)) rc = sketch_add(totals, A_MFU, x);
        x = rc ? NULL : GET(r, K_MFU_DS);
        if (is_num(x)) rc = sketch_add(totals, A_MFU_DS, x);
    }
    if (!rc) {
        PyObject* syncs_or = n_syncs != NULL ? n_syncs : NULL;
        PyObject* minus = syncs_or ? NULL : PyLong_FromLong(-1);
        rc = add_spike(totals, p, p->idx, allocs, retries, syncs_or ? syncs_or : minus);
        Py_XDECREF(minus);
    }
    Py_DECREF(allocs);
    Py_DECREF(retries);
    if (rc) return rc;
    x = GET(r, K_UNAVAIL);
    if (x != NULL && PyDict_CheckExact(x) && PyDict_GET_SIZE(x) > 0) TRY(take_reasons(totals, x));
    /* since_settle: a plain int */
    PyObject* since = *SLOT(totals, off_since);
    if (since == NULL || !PyLong_CheckExact(since)) {
        wrong_shape(totals, "StepTotals with an int since_settle");
        return -1;
    }
    long n = PyLong_AsLong(since) + 1;
    if (n == 0 && PyErr_Occurred()) return -1;
    if (n >= settle_every) {
        PyObject* res = PyObject_CallMethodNoArgs(totals, S[A_SETTLE]);
        Py_XDECREF(res);
        return res ? 0 : -1;
    }
    PyObject* v = PyLong_FromLong(n);
    if (v == NULL) return -1;
    put(totals, off_since, v);
    Py_DECREF(v);
    return 0;
}

enum { TIMED, WARMUP_, ERROR_, MALFORMED_, PYTHON_ };

/* _rules.left_out, for the reasons this fold takes; PYTHON_ for the others. */
static int classify(PyObject* r, Parsed* p) {
    if (GET(r, K_WARMUP) == Py_True) return WARMUP_;
    PyObject* e = GET(r, K_ERROR);
    if (e != NULL && e != Py_None) return ERROR_;
    p->wall = GET(r, K_WALL);
    if (!is_num(p->wall)) return MALFORMED_;
    if (GET(r, K_COUNTED) == Py_True || GET(r, K_EXPLAINED) == Py_True || GET(r, K_COMPILED) == Py_True)
        return PYTHON_;
    return TIMED;
}

static PyObject* call1(PyObject* obj, int name, PyObject* a) {
    return PyObject_CallMethodOneArg(obj, S[name], a);
}

static PyObject* fold_step(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "fold_step(totals, record) takes 2 arguments");
        return NULL;
    }
    if (!PyDict_CheckExact(args[1])) Py_RETURN_NOTIMPLEMENTED;
    PyObject *totals = args[0], *r = args[1];
    if (T_TOTALS == NULL || Py_TYPE(totals) != T_TOTALS) Py_RETURN_NOTIMPLEMENTED;  /* (not configured) */
    Parsed p = {0};
    int kind = classify(r, &p);
    if (PyErr_Occurred()) return NULL;
    if (kind == PYTHON_) Py_RETURN_NOTIMPLEMENTED;
    PyObject* idx = GET(r, K_STEP);
    p.idx = idx != NULL && PyLong_CheckExact(idx) ? idx : NULL;
    if (kind == TIMED) {
        int rc = parse_timed(r, &p);
        if (rc) {
            parsed_clear(&p);
            if (rc > 0 && !PyErr_Occurred()) Py_RETURN_NOTIMPLEMENTED;
            return NULL;
        }
    }
    PyObject* minus = PyLong_FromLong(-1);
    PyObject* out = NULL;
    if (minus == NULL) goto done;
    /* every step: how many, its index, device and name */
    if (sum_one(totals, A_STEPS)) goto done;
    if (p.idx != NULL && (first_add(totals, A_FIRST_STEP, p.idx) || set_value(totals, A_LAST_STEP, p.idx)))
        goto done;
    PyObject* x = GET(r, K_DEVICE);
    if (x != NULL && PyUnicode_CheckExact(x) && counter_add(totals, A_DEVICES, x)) goto done;
    x = GET(r, K_NAME);
    if (x != NULL && PyUnicode_CheckExact(x) && counter_add(totals, A_NAMES, x)) goto done;
    if (GET(r, K_TFLOPS) != NULL) {
        PyObject* mfu = GET(r, K_MFU);
        PyObject* mfu_ds = mfu == NULL || mfu == Py_None ? NULL : GET(r, K_MFU_DS);
        int news = mfu == NULL || mfu == Py_None || mfu_ds == NULL || mfu_ds == Py_None;
        if (!news) {
            PyObject* req = acc(totals, off_tot[A_FLOPS_REQUESTED], T_MAX);
            PyObject* v = req ? *SLOT(req, off_value) : NULL;
            if (v == NULL) goto done;
            news = PyObject_Not(v);
            if (news < 0) goto done;
        }
        if (news) {
            PyObject* res = call1(totals, A_TAKE_FLOPS, r);
            if (res == NULL) goto done;
            Py_DECREF(res);
        }
    }
    if (GET(r, K_COMPILES) != NULL) {
        PyObject* res = PyObject_CallMethodObjArgs(totals, S[A_TAKE_COMPILES], r, p.idx ? p.idx : minus, NULL);
        if (res == NULL) goto done;
        Py_DECREF(res);
    }
    if (PyErr_Occurred()) goto done;
    if (kind != TIMED) {
        if (sum_one(totals, kind == WARMUP_ ? A_WARMUP : kind == ERROR_ ? A_ERRORS : A_MALFORMED)) goto done;
        out = Py_NewRef(Py_False);
        goto done;
    }
    if (sum_one(totals, A_MEASURED)) goto done;
    if (p.idx != NULL) {
        int nonneg = PyObject_RichCompareBool(p.idx, ZERO, Py_GE);
        if (nonneg < 0 || (nonneg && first_add(totals, A_FIRST_MEASURED, p.idx))) goto done;
    }
    if (p.idx == NULL) p.idx = minus;
    if (add_timed(totals, r, &p)) goto done;
    out = Py_NewRef(Py_True);
done:
    Py_XDECREF(minus);
    parsed_clear(&p);
    return out;
}

/* The offset of ``type``'s __slots__ member ``name``; 0 (and an error) when it is not one. */
Py_ssize_t slot_offset(PyTypeObject* type, const char* name) {  /* (_core.c's too) */
    PyObject* d = PyObject_GetAttrString((PyObject*)type, name);
    if (d == NULL) return 0;
    Py_ssize_t off = 0;
    if (Py_IS_TYPE(d, &PyMemberDescr_Type) && ((PyMemberDescrObject*)d)->d_member->type == 16 /* T_OBJECT_EX */)
        off = ((PyMemberDescrObject*)d)->d_member->offset;
    else
        PyErr_Format(PyExc_TypeError, "%s.%s is not a __slots__ member", type->tp_name, name);
    Py_DECREF(d);
    return off;
}

static PyObject* configure(PyObject* self, PyObject* args) {
    (void)self;
    Py_ssize_t spikes, settle, cap;
    PyTypeObject* t[11];
    if (!PyArg_ParseTuple(args, "nnnO!O!O!O!O!O!O!O!O!O!O!", &spikes, &settle, &cap, &PyType_Type, &t[0],
                          &PyType_Type, &t[1], &PyType_Type, &t[2], &PyType_Type, &t[3], &PyType_Type, &t[4],
                          &PyType_Type, &t[5], &PyType_Type, &t[6], &PyType_Type, &t[7], &PyType_Type, &t[8],
                          &PyType_Type, &t[9], &PyType_Type, &t[10]))
        return NULL;
    T_TOTALS = t[0], T_PHASE = t[1], T_SUM = t[2], T_MAX = t[3], T_FIRST = t[4], T_LAST = t[5];
    T_COUNTER = t[6], T_TABLE = t[7], T_SKETCH = t[8], T_REASONS = t[9], T_LARGEST = t[10];
    for (int i = 0; i < 11; i++) Py_INCREF(t[i]);  /* (kept for the process's life) */
    for (int a = A_STEPS; a <= A_ENERGY_REASON; a++) {
        PyObject* d = PyObject_GetAttr((PyObject*)T_TOTALS, S[a]);
        if (d == NULL) {
            PyErr_Clear();
            off_tot[a] = 0;
            continue;
        }
        Py_DECREF(d);
        if ((off_tot[a] = slot_offset(T_TOTALS, NAMES[a])) == 0) return NULL;
    }
    static const int phase_fields[] = {A_STEPS, A_WALL, A_GPU, A_PEAK, A_SYNCS, A_SYNC_STEPS, A_COUNT_PH};
    for (size_t i = 0; i < sizeof phase_fields / sizeof *phase_fields; i++) {
        int a = phase_fields[i];
        if ((off_ph[a] = slot_offset(T_PHASE, NAMES[a])) == 0) return NULL;
    }
    off_value = slot_offset(T_SUM, "value");
    for (int i = 3; i < 6 && off_value; i++) {
        if (slot_offset(t[i], "value") != off_value) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Sum, Max, First and Last must share one value slot");
            return NULL;
        }
    }
    if (!off_value || !(off_counter = slot_offset(T_COUNTER, "value")) || !(off_table = slot_offset(T_TABLE, "value")) ||
        !(off_buf = slot_offset(T_SKETCH, "buf")) || !(off_reasons = slot_offset(T_REASONS, "value")) ||
        !(off_heap = slot_offset(T_LARGEST, "value")) || !(off_since = slot_offset(T_TOTALS, "since_settle")))
        return NULL;
    spikes_kept = spikes;
    settle_every = settle;
    table_cap = cap;
    Py_RETURN_NONE;
}

/* == build_step: the step record of a completed step (stepprof/_recorder/collector.py) ==
 *
 * build_step(step, device, start_unix_s, phase_peaks_why) builds the dict that
 * build_step_record builds for a full step of a CUDA-like backend (device timing and memory,
 * no reasons of its own), or returns NotImplemented, having read only, for every other step:
 * one with an error, one another thread's step overlapped, one whose events or memory reads
 * are missing, numbers past 2**52.  configure_build() gives it the Step class, the record's
 * keys in their declared order (_schema.STEP_CORE_FIELDS), the allocator's counter names and
 * the reasons' texts: Python owns them.  tests/test_fold.py holds both to the same records. */

enum { B_INDEX, B_NAME, B_WARMUP, B_BATCH, B_T0, B_T1, B_PEAK, B_RESERVED, B_PHASES, B_OVERHEAD, B_ERROR,
       B_SYNCS, B_SYNCS_REASON, B_COUNTERS, B_PHASE_PEAKS, B_THREAD, B_SHARED, B_SAMPLED, B_WAIT, B_DATA,
       B_WAIT_IN, B_GLOBAL, B_BATCH_REASON, B_TIMES, B_RSS, B_BACKEND, B_START_MARK, B_END_MARK, B_FLAT, B_TOKENS,
       N_STEP };
static const char* const STEP_SLOTS[N_STEP] = {
    "index", "name", "warmup", "batch_size", "t0", "t1", "peak", "reserved", "phases", "overhead_ns",
    "error", "syncs", "syncs_reason", "counters", "phase_peaks", "thread", "shared", "sampled",
    "data_wait_ns", "data_ns", "wait_in_ns", "global_step", "batch_reason", "times", "rss", "backend",
    "start_mark", "end_mark", "flat", "tokens"};
enum { P_T0, P_WALL, P_MARKS, P_PEAK, P_COUNT, P_SYNCS, N_PT };
static const char* const PT_SLOTS[N_PT] = {"t0", "wall_ns", "marks", "peak", "count", "syncs"};
static Py_ssize_t off_step[N_STEP], off_pt[N_PT];
static PyTypeObject *T_STEP, *T_PT;
/* The record's keys: schema_version, kind, the core fields in order, then the optional ones. */
enum { R_SCHEMA, R_KIND, R_STEP, R_NAME, R_WARMUP, R_DEVICE, R_START, R_WALL, R_GPU, R_BUSY, R_PEAK, R_RESERVED,
       R_BATCH, R_SPS, R_WAIT, R_PHASES, R_OVERHEAD, R_ERROR, R_SYNCS, R_ALLOC, R_UNAVAIL, N_CORE };
/* What build_step fills, in order: the Python side takes it only while the declaration agrees. */
static const char* const BUILD_FIELDS[N_CORE] = {
    "schema_version", "kind", "step", "name", "warmup", "device", "start_unix_s", "wall_ms", "gpu_ms", "gpu_busy",
    "peak_allocated_bytes", "reserved_bytes", "batch_size", "samples_per_s", "data_wait_ms", "phases",
    "overhead_us", "error", "syncs", "allocator", "unavailable"};
enum { O_THREAD, O_SAMPLED, O_DATA, O_WAIT_IN, O_PEAK_PHASE, O_GLOBAL, O_RSS, N_OPT };
enum { PH_WALL, PH_GPU, PH_PEAK, PH_COUNT, PH_SYNCS, PH_START, N_PH };
enum { W_NO_PREVIOUS, W_OUTSIDE, W_NO_BATCH, W_NO_TIME, W_RANGE, W_ZERO_WALL, W_NOT_COUNTED, W_NOT_READ,
       U_SPS, U_BATCH, U_SYNCS, U_PH_SYNCS, U_WAIT, U_PEAK_PHASE, U_PH_PEAK, U_BUSY, U_GPU, U_PH_GPU, U_PEAK,
       U_RESERVED, U_ALLOC, U_RSS, N_WHY };
static PyObject *core_keys[N_CORE], *opt_keys[N_OPT], *ph_keys[N_PH], *why[N_WHY], *alloc_names, *schema_version,
    *kind_step;
/* The reasons' texts come from Python by these names; the U_ keys are field names. */
static const char* const WHY_NAMES[N_WHY] = {
    "no_previous", "outside_phases", "no_batch", "no_time", "past_range", "zero_wall", "not_counted", "not_read",
    "samples_per_s", "batch_size", "syncs", "phases.syncs", "data_wait_ms", "peak_phase",
    "phases.peak_allocated_bytes", "gpu_busy", "gpu_ms", "phases.gpu_ms", "peak_allocated_bytes",
    "reserved_bytes", "allocator", "host_rss_bytes"};
static int build_ready;
/* harvest_steps' names */
static PyObject *s_popleft, *s_late, *s_fill, *s_peak_seen, *s_run_id, *s_overhead_us, *s_unavailable, *s_append,
    *s_option, *s_name, *s_rank, *s_key, *s_by_name, *s_last_key, *s_fold, *EMPTY_BYTES, *KW_OPTION;
static PyObject* SLASH;

/* why[] from the texts by name (a missing one names itself); the field names are the C's. */
static int whys_from(PyObject* texts) {
    for (int i = 0; i < N_WHY; i++) {
        PyObject* v;
        if (i >= U_SPS) v = PyUnicode_InternFromString(WHY_NAMES[i]);
        else {
            v = PyDict_GetItemString(texts, WHY_NAMES[i]);
            if (v == NULL || !PyUnicode_CheckExact(v)) {
                PyErr_Format(PyExc_ValueError, "configure_build: the reasons lack a str %s", WHY_NAMES[i]);
                return -1;
            }
            Py_INCREF(v);
        }
        if (v == NULL) return -1;
        Py_XSETREF(why[i], v);
    }
    return PyDict_GET_SIZE(texts) == U_SPS ? 0 : (PyErr_SetString(PyExc_ValueError,
        "configure_build: the reasons hold names this build does not know: rebuild it (`stepprof build`)"), -1);
}

static int keys_from(PyObject* seq, PyObject** out, Py_ssize_t n, const char* what) {
    if (!PyTuple_CheckExact(seq) || PyTuple_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "configure_build: %s must be a tuple of %zd", what, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XSETREF(out[i], Py_NewRef(PyTuple_GET_ITEM(seq, i)));
    }
    return 0;
}

static PyObject* configure_build(PyObject* self, PyObject* args) {
    (void)self;
    PyTypeObject *step, *pt;
    PyObject *core, *opt, *ph, *whys, *allocs, *version;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!O", &PyType_Type, &step, &PyType_Type, &pt, &PyTuple_Type, &core,
                          &PyTuple_Type, &opt, &PyTuple_Type, &ph, &PyDict_Type, &whys, &PyTuple_Type, &allocs,
                          &version))
        return NULL;
    for (int i = 0; i < N_STEP; i++)
        if ((off_step[i] = slot_offset(step, STEP_SLOTS[i])) == 0) return NULL;
    for (int i = 0; i < N_PT; i++)
        if ((off_pt[i] = slot_offset(pt, PT_SLOTS[i])) == 0) return NULL;
    if (keys_from(core, core_keys, N_CORE, "the core keys") || keys_from(opt, opt_keys, N_OPT, "the optional keys") ||
        keys_from(ph, ph_keys, N_PH, "the phase keys") || whys_from(whys))
        return NULL;
    Py_XSETREF(alloc_names, Py_NewRef(allocs));
    Py_XSETREF(schema_version, Py_NewRef(version));
    Py_XSETREF(kind_step, PyUnicode_InternFromString("step"));
    Py_XSETREF(SLASH, PyUnicode_InternFromString("/"));
    PyObject** interned[] = {&s_popleft, &s_late, &s_fill, &s_peak_seen, &s_run_id, &s_overhead_us, &s_unavailable,
                             &s_append, &s_option, &s_name, &s_rank, &s_key, &s_by_name, &s_last_key, &s_fold};
    const char* names[] = {"popleft", "late", "fill", "peak_seen", "run_id", "overhead_us", "unavailable", "append",
                           "option", "name", "rank", "key", "by_name", "last_key", "fold"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if ((*interned[i] = *interned[i] ? *interned[i] : PyUnicode_InternFromString(names[i])) == NULL) return NULL;
    if (EMPTY_BYTES == NULL && (EMPTY_BYTES = PyBytes_FromStringAndSize(NULL, 0)) == NULL) return NULL;
    if (KW_OPTION == NULL && (KW_OPTION = PyTuple_Pack(1, s_option)) == NULL) return NULL;
    T_STEP = (PyTypeObject*)Py_NewRef(step);
    T_PT = (PyTypeObject*)Py_NewRef(pt);
    build_ready = kind_step != NULL && SLASH != NULL;
    Py_RETURN_NONE;
}

/* An int as a long long within +-``bound`` (1 when it is not one: leave the step to Python). */
static int int_within(PyObject* x, long long bound, long long* out) {
    if (x == NULL || !PyLong_CheckExact(x)) return 1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow || v > bound || v < -bound) return 1;
    *out = v;
    return 0;
}

/* An int slot within 2**52, where a double holds it exactly. */
static int small_int(PyObject* x, long long* out) { return int_within(x, 1LL << 52, out); }

/* A reading of the step clock (perf_counter_ns: CLOCK_MONOTONIC, since boot) or a time on it:
 * only differences of two reach a double, so past 2**52 (52 days up) is fine. */
static int time_int(PyObject* x, long long* out) { return int_within(x, 1LL << 62, out); }

#define STEP(o, i) (*SLOT((o), off_step[i]))
#define PT(o, i) (*SLOT((o), off_pt[i]))

/* Put a new reference (stolen) under key; -1 on an error (it is released). */
static int put_new(PyObject* d, PyObject* key, PyObject* v) {
    if (v == NULL) return -1;
    int rc = PyDict_SetItem(d, key, v);
    Py_DECREF(v);
    return rc;
}

static PyObject* ms_of(long long ns) { return PyFloat_FromDouble((double)ns / 1e6); }

/* The phases' figures; 1 to leave the step to Python.  *no_peak: a phase without a peak.
 * ``times`` NULL: a host step's, without GPU time. */
static int build_phases(PyObject* s, PyObject* phases, PyObject* times, long long t0, int counted, PyObject* out,
                        int* no_peak) {
    Py_ssize_t pos = 0, at = 1, nt = times != NULL ? PyTuple_GET_SIZE(times) : 0;
    PyObject *key, *total;
    while (PyDict_Next(phases, &pos, &key, &total)) {
        if (Py_TYPE(total) != T_PT) return 1;
        PyObject* marks = PT(total, P_MARKS);
        long long pt0, wall, peak;
        if (marks == NULL || !PyList_CheckExact(marks)) return 1;
        int rc = time_int(PT(total, P_T0), &pt0);
        if (!rc) rc = small_int(PT(total, P_WALL), &wall);
        if (!rc) rc = small_int(PT(total, P_PEAK), &peak);
        if (rc) return rc;
        Py_ssize_t n = PyList_GET_SIZE(marks);
        if (times != NULL && at + n > nt) return 1;
        double pg = 0.0;
        for (Py_ssize_t i = at; times != NULL && i < at + n; i++) {
            PyObject* ms = PyTuple_GET_ITEM(times, i);
            if (!PyFloat_CheckExact(ms)) return 1;  /* (a mark not read: None) */
            pg += PyFloat_AS_DOUBLE(ms);
        }
        at += n;
        PyObject* count = PT(total, P_COUNT);
        PyObject* syncs = PT(total, P_SYNCS);
        if (count == NULL || syncs == NULL) return 1;
        PyObject* ph = PyDict_New();
        if (ph == NULL) return -1;
        if (put_new(ph, ph_keys[PH_WALL], ms_of(wall)) ||
            (times != NULL ? put_new(ph, ph_keys[PH_GPU], PyFloat_FromDouble(pg))
                           : PyDict_SetItem(ph, ph_keys[PH_GPU], Py_None)) ||
            PyDict_SetItem(ph, ph_keys[PH_PEAK], peak >= 0 ? PT(total, P_PEAK) : Py_None) ||
            PyDict_SetItem(ph, ph_keys[PH_COUNT], count) ||
            PyDict_SetItem(ph, ph_keys[PH_SYNCS], counted ? syncs : Py_None) ||
            put_new(ph, ph_keys[PH_START], ms_of(pt0 - t0)) || PyDict_SetItem(out, key, ph)) {
            Py_DECREF(ph);
            return -1;
        }
        Py_DECREF(ph);
        if (peak < 0) *no_peak = 1;
    }
    (void)s;
    return 0;
}

/* _peak_phase: the innermost phase whose peak is the step's (the first among equals), or NULL
 * (borrowed; NULL with no error: none reached it). */
static PyObject* peak_phase(PyObject* phases, PyObject* peak, int* err) {
    Py_ssize_t pos = 0, depth = -1;
    PyObject *key, *figures, *best = NULL;
    while (PyDict_Next(phases, &pos, &key, &figures)) {
        PyObject* p = PyDict_GetItemWithError(figures, ph_keys[PH_PEAK]);
        int eq = p == NULL ? 0 : PyObject_RichCompareBool(p, peak, Py_EQ);
        Py_ssize_t slashes = eq > 0 ? PyUnicode_Count(key, SLASH, 0, PY_SSIZE_T_MAX) : 0;
        if (eq < 0 || slashes < 0 || PyErr_Occurred()) {
            *err = 1;
            return NULL;
        }
        if (eq && slashes > depth) {
            best = key;
            depth = slashes;
        }
    }
    return best;
}

/* ``x or fallback``, for a reason that may be None or "" (borrowed). */
static PyObject* or_else(PyObject* x, PyObject* fallback) {
    return x != NULL && PyUnicode_CheckExact(x) && PyUnicode_GET_LENGTH(x) > 0 ? x : fallback;
}

/* What build_step reads from a step (borrowed), and the figures it makes (owned: busy, sps, wait). */
typedef struct {
    PyObject *s, *device, *start, *times, *reserved, *counters, *phases, *syncs, *batch, *sampled, *thread, *global,
        *peak_obj, *gpu;
    long long t0, t1, peak, overhead, wait_ns, data_ns, in_ns, nbatch;
    double wall, g;
    PyObject *ph, *unavailable, *busy, *sps, *wait, *best;
} View;

/* Read the step: 0 this path takes it, 1 leave it to Python, -1 an error.  Nothing is changed. */
static int take_step(View* v) {
    PyObject* s = v->s;
    PyObject *error = STEP(s, B_ERROR), *shared = STEP(s, B_SHARED);
    v->times = STEP(s, B_TIMES), v->reserved = STEP(s, B_RESERVED), v->counters = STEP(s, B_COUNTERS);
    v->phases = STEP(s, B_PHASES), v->syncs = STEP(s, B_SYNCS), v->batch = STEP(s, B_BATCH);
    v->sampled = STEP(s, B_SAMPLED), v->thread = STEP(s, B_THREAD), v->global = STEP(s, B_GLOBAL);
    v->peak_obj = STEP(s, B_PEAK);
    PyObject *times = v->times, *counters = v->counters, *syncs = v->syncs, *batch = v->batch;
    if (error != Py_None || shared != Py_False || times == NULL || !PyTuple_CheckExact(times) ||
        PyTuple_GET_SIZE(times) < 1 || !PyFloat_CheckExact(PyTuple_GET_ITEM(times, 0)) || v->reserved == NULL ||
        !PyLong_CheckExact(v->reserved) || counters == NULL || !PyTuple_CheckExact(counters) ||
        PyTuple_GET_SIZE(counters) != PyTuple_GET_SIZE(alloc_names) || v->phases == NULL ||
        !PyDict_CheckExact(v->phases) || syncs == NULL || (syncs != Py_None && !PyDict_CheckExact(syncs)) ||
        batch == NULL || (batch != Py_None && !PyLong_CheckExact(batch)) || v->sampled == NULL ||
        v->thread == NULL || v->global == NULL || !PyFloat_CheckExact(v->start) || STEP(s, B_TOKENS) != Py_None)
        return 1;  /* (a step with tokens: Python adds tokens_per_s) */
    v->nbatch = 0;
    int rc = time_int(STEP(s, B_T0), &v->t0);
    if (!rc) rc = time_int(STEP(s, B_T1), &v->t1);
    if (!rc) rc = small_int(v->peak_obj, &v->peak);
    if (!rc) rc = small_int(STEP(s, B_OVERHEAD), &v->overhead);
    if (!rc) rc = small_int(STEP(s, B_WAIT), &v->wait_ns);
    if (!rc) rc = small_int(STEP(s, B_DATA), &v->data_ns);
    if (!rc) rc = small_int(STEP(s, B_WAIT_IN), &v->in_ns);
    if (!rc && batch != Py_None) rc = small_int(batch, &v->nbatch);
    if (rc) return rc;
    if (v->peak < 0) return 1;
    v->gpu = PyTuple_GET_ITEM(times, 0);
    v->wall = (double)(v->t1 - v->t0) / 1e6, v->g = PyFloat_AS_DOUBLE(v->gpu);
    return 0;
}

/* samples_per_s over the step's span (_samples_per_s), or its reason: 0, 1 (leave it), -1. */
static int rate_of(View* v) {
    PyObject* u = v->unavailable;
    if (v->batch == Py_None) {
        PyObject* br = STEP(v->s, B_BATCH_REASON);
        int has = br != NULL && br != Py_None;
        if (has && !PyUnicode_CheckExact(br)) return 1;
        return PyDict_SetItem(u, why[U_SPS], or_else(br, why[W_NO_BATCH])) ||
                       (has && PyDict_SetItem(u, why[U_BATCH], br))
                   ? -1
                   : 0;
    }
    double span = v->g > v->wall ? v->g : v->wall;
    if (span <= 0) return PyDict_SetItem(u, why[U_SPS], why[W_NO_TIME]);
    double rate = (double)v->nbatch / (span / 1e3);
    if (isinf(rate)) return PyDict_SetItem(u, why[U_SPS], why[W_RANGE]);
    return (v->sps = PyFloat_FromDouble(rate)) == NULL ? -1 : 0;
}

/* samples_per_s, the syncs' reason and data_wait_ms, with their reasons, in build_step_record's
 * order (both builds): 0, 1 (leave it), -1. */
static int rate_syncs_wait(View* v) {
    PyObject* u = v->unavailable;
    TRY(rate_of(v));
    if (v->syncs == Py_None) {
        PyObject* sr = STEP(v->s, B_SYNCS_REASON);
        if (sr != NULL && sr != Py_None && !PyUnicode_CheckExact(sr)) return 1;
        PyObject* w = or_else(sr, why[W_NOT_COUNTED]);
        TRY(PyDict_SetItem(u, why[U_SYNCS], w));
        if (PyDict_GET_SIZE(v->ph) > 0) TRY(PyDict_SetItem(u, why[U_PH_SYNCS], w));
    }
    if (v->wait_ns < 0) {
        TRY(PyDict_SetItem(u, why[U_WAIT], why[W_NO_PREVIOUS]));
    } else {
        double w = (double)v->wait_ns / 1e6;
        if (v->in_ns >= 0) w += (double)v->in_ns / 1e6;
        if ((v->wait = PyFloat_FromDouble(w)) == NULL) return -1;
    }
    return 0;
}

/* The figures after the phases, with their reasons, in build_step_record's order: 0, 1, -1. */
static int figures_of(View* v, PyObject* peaks_why, int no_peak) {
    PyObject* u = v->unavailable;
    if (no_peak) {
        PyObject* w = STEP(v->s, B_PHASE_PEAKS) == Py_True ? why[W_NOT_READ] : peaks_why;
        TRY(PyDict_SetItem(u, why[U_PH_PEAK], w));
    }
    if (v->wall > 0) {
        if ((v->busy = PyFloat_FromDouble(v->g / v->wall)) == NULL) return -1;
    } else {
        TRY(PyDict_SetItem(u, why[U_BUSY], why[W_ZERO_WALL]));
    }
    TRY(rate_syncs_wait(v));
    if (PyDict_GET_SIZE(v->ph) > 0) {
        PyObject* phwhy = PyDict_GetItemWithError(u, why[U_PH_PEAK]);
        if (phwhy != NULL) return PyDict_SetItem(u, why[U_PEAK_PHASE], phwhy);
        int err = 0;
        v->best = peak_phase(v->ph, v->peak_obj, &err);
        if (err) return -1;
        if (v->best == NULL) return PyDict_SetItem(u, why[U_PEAK_PHASE], why[W_OUTSIDE]);
    }
    return PyErr_Occurred() ? -1 : 0;
}

/* The record, its keys in step_record's order and the optional ones in build_step_record's. */
static int assemble(View* v, PyObject* record) {
    PyObject* alloc = PyDict_New();
    if (alloc == NULL) return -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(alloc_names); i++) {
        if (PyDict_SetItem(alloc, PyTuple_GET_ITEM(alloc_names, i), PyTuple_GET_ITEM(v->counters, i))) {
            Py_DECREF(alloc);
            return -1;
        }
    }
    PyObject* s = v->s;
    PyObject* const values[N_CORE] = {
        schema_version, kind_step, STEP(s, B_INDEX), STEP(s, B_NAME), STEP(s, B_WARMUP), v->device, v->start, NULL,
        v->gpu, v->busy ? v->busy : Py_None, v->peak_obj, v->reserved, v->batch, v->sps ? v->sps : Py_None,
        v->wait ? v->wait : Py_None, v->ph, NULL, Py_None, v->syncs, alloc, v->unavailable};
    int bad = 0;
    for (int i = 0; i < N_CORE && !bad; i++) {
        if (i == R_WALL) bad = put_new(record, core_keys[i], PyFloat_FromDouble(v->wall));
        else if (i == R_OVERHEAD) bad = put_new(record, core_keys[i], PyFloat_FromDouble((double)v->overhead / 1e3));
        else bad = PyDict_SetItem(record, core_keys[i], values[i]);
    }
    Py_DECREF(alloc);
    if (!bad && v->thread != Py_None) bad = PyDict_SetItem(record, opt_keys[O_THREAD], v->thread);
    if (!bad && v->sampled != Py_None) bad = PyDict_SetItem(record, opt_keys[O_SAMPLED], Py_True);
    if (!bad && v->data_ns >= 0) bad = put_new(record, opt_keys[O_DATA], ms_of(v->data_ns));
    if (!bad && v->in_ns >= 0) bad = put_new(record, opt_keys[O_WAIT_IN], ms_of(v->in_ns));
    if (!bad && PyDict_GET_SIZE(v->ph) > 0)
        bad = PyDict_SetItem(record, opt_keys[O_PEAK_PHASE], v->best ? v->best : Py_None);
    if (!bad && v->global != Py_None) bad = PyDict_SetItem(record, opt_keys[O_GLOBAL], v->global);
    return bad ? -1 : 0;
}

static PyObject* build_step(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "build_step(step, device, start_unix_s, phase_peaks_why)");
        return NULL;
    }
    View v = {0};
    v.s = args[0], v.device = args[1], v.start = args[2];
    if (!build_ready || Py_TYPE(v.s) != T_STEP) Py_RETURN_NOTIMPLEMENTED;
    int rc = take_step(&v);  /* (read first: a step this path does not take is left untouched) */
    if (rc < 0) return NULL;
    if (rc) Py_RETURN_NOTIMPLEMENTED;
    PyObject *record = PyDict_New(), *out = NULL;
    v.unavailable = PyDict_New();
    v.ph = PyDict_New();
    int no_peak = 0;
    rc = record && v.unavailable && v.ph ? 0 : -1;
    if (!rc && PyDict_GET_SIZE(v.phases) > 0)
        rc = build_phases(v.s, v.phases, v.times, v.t0, v.syncs != Py_None, v.ph, &no_peak);
    if (!rc) rc = figures_of(&v, args[3], no_peak);
    if (!rc) rc = assemble(&v, record);
    if (rc > 0 && !PyErr_Occurred()) out = Py_NewRef(Py_NotImplemented);
    else if (rc == 0) out = Py_NewRef(record);
    Py_XDECREF(v.busy);
    Py_XDECREF(v.sps);
    Py_XDECREF(v.wait);
    Py_XDECREF(record);
    Py_XDECREF(v.unavailable);
    Py_XDECREF(v.ph);
    return out;
}

/* == build_host_step: the record of a full step on the host (no device timing or memory) ==
 *
 * build_host_step(step, device, start_unix_s, reasons) builds what build_step_record builds for
 * a full step of a host backend, whose device figures are all null: ``reasons`` holds the
 * backend's texts for them (collector.host_reasons, made once per backend), in HOST_REASONS'
 * order.  NotImplemented, having read only, for a step it does not take: device figures present
 * (a light step or another backend's), numbers past 2**52. */

/* The host's reasons: no GPU (its phases' too), no peak (its phases' too), reserved, allocator, RSS. */
enum { H_GPU, H_PEAK, H_RESERVED, H_ALLOC, H_RSS, N_HOST };

/* The host record's figures and reasons, in build_step_record's order: 0, 1 (leave it), -1. */
static int host_figures(View* v, PyObject* reasons, PyObject* rss) {
    PyObject* u = v->unavailable;
    PyObject* gpu = PyTuple_GET_ITEM(reasons, H_GPU);
    TRY(PyDict_SetItem(u, why[U_GPU], gpu));
    TRY(PyDict_SetItem(u, why[U_BUSY], gpu));
    int no_peak = 0;
    if (PyDict_GET_SIZE(v->phases) > 0) {
        int rc = build_phases(v->s, v->phases, NULL, v->t0, v->syncs != Py_None, v->ph, &no_peak);
        if (rc) return rc;
        TRY(PyDict_SetItem(u, why[U_PH_GPU], PyTuple_GET_ITEM(reasons, H_GPU)));
        if (no_peak) TRY(PyDict_SetItem(u, why[U_PH_PEAK], PyTuple_GET_ITEM(reasons, H_PEAK)));
    }
    TRY(PyDict_SetItem(u, why[U_PEAK], PyTuple_GET_ITEM(reasons, H_PEAK)));
    TRY(PyDict_SetItem(u, why[U_RESERVED], PyTuple_GET_ITEM(reasons, H_RESERVED)));
    TRY(PyDict_SetItem(u, why[U_ALLOC], PyTuple_GET_ITEM(reasons, H_ALLOC)));
    if (rss == Py_None) TRY(PyDict_SetItem(u, why[U_RSS], PyTuple_GET_ITEM(reasons, H_RSS)));
    TRY(rate_syncs_wait(v));
    if (PyDict_GET_SIZE(v->ph) > 0) TRY(PyDict_SetItem(u, why[U_PEAK_PHASE], PyTuple_GET_ITEM(reasons, H_PEAK)));
    return 0;
}

static PyObject* build_host_step(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "build_host_step(step, device, start_unix_s, reasons)");
        return NULL;
    }
    View v = {0};
    v.s = args[0], v.device = args[1], v.start = args[2];
    PyObject* reasons = args[3];
    if (!build_ready || Py_TYPE(v.s) != T_STEP || !PyTuple_CheckExact(reasons) || PyTuple_GET_SIZE(reasons) != N_HOST ||
        !PyFloat_CheckExact(v.start))
        Py_RETURN_NOTIMPLEMENTED;
    for (int i = 0; i < N_HOST; i++)
        if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(reasons, i))) Py_RETURN_NOTIMPLEMENTED;
    PyObject* s = v.s;
    PyObject *error = STEP(s, B_ERROR), *rss = STEP(s, B_RSS);
    v.times = STEP(s, B_TIMES), v.reserved = STEP(s, B_RESERVED), v.counters = STEP(s, B_COUNTERS);
    v.phases = STEP(s, B_PHASES), v.syncs = STEP(s, B_SYNCS), v.batch = STEP(s, B_BATCH);
    v.sampled = STEP(s, B_SAMPLED), v.thread = STEP(s, B_THREAD), v.global = STEP(s, B_GLOBAL);
    if (error == NULL || (error != Py_None && !PyDict_CheckExact(error)) || rss == NULL ||
        (rss != Py_None && !PyLong_CheckExact(rss)) || v.times == NULL || !PyTuple_CheckExact(v.times) ||
        PyTuple_GET_SIZE(v.times) != 0 || v.reserved != Py_None || v.counters != Py_None || v.phases == NULL ||
        !PyDict_CheckExact(v.phases) || v.syncs == NULL || (v.syncs != Py_None && !PyDict_CheckExact(v.syncs)) ||
        v.batch == NULL || (v.batch != Py_None && !PyLong_CheckExact(v.batch)) || v.sampled == NULL ||
        v.thread == NULL || v.global == NULL || STEP(s, B_TOKENS) != Py_None)
        Py_RETURN_NOTIMPLEMENTED;
    long long peak;
    int rc = time_int(STEP(s, B_T0), &v.t0);
    if (!rc) rc = time_int(STEP(s, B_T1), &v.t1);
    if (!rc) rc = small_int(STEP(s, B_PEAK), &peak);
    if (!rc) rc = small_int(STEP(s, B_OVERHEAD), &v.overhead);
    if (!rc) rc = small_int(STEP(s, B_WAIT), &v.wait_ns);
    if (!rc) rc = small_int(STEP(s, B_DATA), &v.data_ns);
    if (!rc) rc = small_int(STEP(s, B_WAIT_IN), &v.in_ns);
    if (!rc && v.batch != Py_None) rc = small_int(v.batch, &v.nbatch);
    if (!rc && peak >= 0) rc = 1;  /* (a host step has no peak) */
    if (rc < 0) return NULL;
    if (rc) Py_RETURN_NOTIMPLEMENTED;
    v.wall = (double)(v.t1 - v.t0) / 1e6, v.g = 0.0;
    PyObject *record = PyDict_New(), *out = NULL;
    v.unavailable = PyDict_New();
    v.ph = PyDict_New();
    rc = record && v.unavailable && v.ph ? host_figures(&v, reasons, rss) : -1;
    if (!rc) {
        PyObject* s_ = v.s;
        PyObject* const values[N_CORE] = {
            schema_version, kind_step, STEP(s_, B_INDEX), STEP(s_, B_NAME), STEP(s_, B_WARMUP), v.device, v.start,
            NULL, Py_None, Py_None, Py_None, Py_None, v.batch, v.sps ? v.sps : Py_None, v.wait ? v.wait : Py_None,
            v.ph, NULL, error, v.syncs, Py_None, v.unavailable};
        for (int i = 0; i < N_CORE && !rc; i++) {
            if (i == R_WALL) rc = put_new(record, core_keys[i], PyFloat_FromDouble(v.wall));
            else if (i == R_OVERHEAD) rc = put_new(record, core_keys[i], PyFloat_FromDouble((double)v.overhead / 1e3));
            else rc = PyDict_SetItem(record, core_keys[i], values[i]);
        }
        if (!rc) rc = PyDict_SetItem(record, opt_keys[O_RSS], rss);
        if (!rc && v.thread != Py_None) rc = PyDict_SetItem(record, opt_keys[O_THREAD], v.thread);
        if (!rc && v.sampled != Py_None) rc = PyDict_SetItem(record, opt_keys[O_SAMPLED], Py_True);
        if (!rc && v.data_ns >= 0) rc = put_new(record, opt_keys[O_DATA], ms_of(v.data_ns));
        if (!rc && v.in_ns >= 0) rc = put_new(record, opt_keys[O_WAIT_IN], ms_of(v.in_ns));
        if (!rc && PyDict_GET_SIZE(v.ph) > 0) rc = PyDict_SetItem(record, opt_keys[O_PEAK_PHASE], Py_None);
        if (!rc && v.global != Py_None) rc = PyDict_SetItem(record, opt_keys[O_GLOBAL], v.global);
        if (rc) rc = -1;
    }
    if (rc > 0 && !PyErr_Occurred()) out = Py_NewRef(Py_NotImplemented);
    else if (rc == 0) out = Py_NewRef(record);
    Py_XDECREF(v.sps);
    Py_XDECREF(v.wait);
    Py_XDECREF(record);
    Py_XDECREF(v.unavailable);
    Py_XDECREF(v.ph);
    return out;
}

/* == harvest_steps: the collector's harvest of common steps (stepprof/_recorder/collector.py) ==
 *
 * harvest_steps(plan, pending, limit, batch) -> (written, logged) does what Collector.harvest's
 * loop does for each step at the head of ``pending`` (a deque), at most ``limit`` of them, while
 * the step is one the plan covers: read its events, build its record (build_step or
 * build_host_step), give it the late hook's fields, release its marks, add the collector's share
 * of ``overhead_us``, then log and fold it, or hold it behind the records that wait.  It stops,
 * with the step left at the head untouched but for its events' times, at the first step whose
 * events are still running or that the build leaves to Python; the Python loop then takes that
 * step.  Builder.plan (collector.py) makes the plan only where the hooks' per-record work is nil or
 * constant (Hook.quiet) and no budget runs; its items, by the P_ names below, are Python's. */

enum { P_BACKEND, P_DEVICE, P_HOST, P_PEAKS_WHY, P_UNIX0, P_CLOCK0, P_SHARE, P_LATE_FIELDS, P_LATE_REASONS,
       P_LATE, P_HELD, P_ENCODE, P_READ, P_RELEASE, P_KEEP_END, P_RUN_ID, P_ADD_STEP, P_PEAK_OWNERS, P_SPAN,
       P_FOLD, P_BEFORE, N_PLAN };

/* A step's marks as Step.flat_marks gives them (new), or NULL with no error: leave it to Python. */
static PyObject* flat_marks(PyObject* s) {
    PyObject *phases = STEP(s, B_PHASES), *start = STEP(s, B_START_MARK), *end = STEP(s, B_END_MARK);
    if (phases == NULL || !PyDict_CheckExact(phases) || start == NULL || end == NULL) return NULL;
    if (PyDict_GET_SIZE(phases) == 0) return PyTuple_Pack(2, start, end);
    PyObject* out = PyList_New(0);
    if (out == NULL || PyList_Append(out, start) || PyList_Append(out, end)) goto fail;
    Py_ssize_t pos = 0;
    PyObject *key, *total;
    while (PyDict_Next(phases, &pos, &key, &total)) {
        PyObject* marks = Py_TYPE(total) == T_PT ? PT(total, P_MARKS) : NULL;
        if (marks == NULL || !PyList_CheckExact(marks)) goto fail;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(marks); i++) {
            PyObject* pair = PyList_GET_ITEM(marks, i);
            if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
                PyList_Append(out, PyTuple_GET_ITEM(pair, 0)) || PyList_Append(out, PyTuple_GET_ITEM(pair, 1)))
                goto fail;
        }
    }
    PyObject* t = PyList_AsTuple(out);
    Py_DECREF(out);
    return t;
fail:
    Py_XDECREF(out);
    return NULL;
}

/* The step's events read into ``times`` (and ``flat``): 0 read, 1 leave it (not done, or not
 * this path's), -1 an error. */
static int read_times(PyObject* s, PyObject* read) {
    PyObject* times = STEP(s, B_TIMES);
    if (times == NULL) return 1;
    if (times != Py_None) return 0;
    if (read == Py_None) {  /* the host: no marks, nothing to wait for */
        PyObject* empty = PyTuple_New(0);
        if (empty == NULL) return -1;
        put(s, off_step[B_TIMES], empty);
        Py_DECREF(empty);
        return 0;
    }
    PyObject* flat = flat_marks(s);
    if (flat == NULL) return PyErr_Occurred() ? -1 : 1;
    PyObject* got = PyObject_CallOneArg(read, flat);
    if (got == NULL || got == Py_None) {
        Py_DECREF(flat);
        Py_XDECREF(got);
        return got == NULL ? -1 : 1;
    }
    put(s, off_step[B_TIMES], got);
    put(s, off_step[B_FLAT], flat);
    Py_DECREF(got);
    Py_DECREF(flat);
    return 0;
}

/* EnergyHook._span_of and the token late() gives, to the same bits, for a training-thread step
 * whose span starts at or after the first sample: (start, end), the hook's span state moved on.
 * Py_None (new), with nothing read or changed, where late() must see the step (another thread's,
 * no sample yet, or one after its start: late() then nulls its fields with the reason); NULL on
 * an error.  ``span`` is EnergyHook.span_plan()'s ([prev_end, lag], the sampler's times, the
 * step clock). */
static PyObject* energy_span(PyObject* span, PyObject* s) {
    if (!PyTuple_CheckExact(span) || PyTuple_GET_SIZE(span) != 3) return Py_NewRef(Py_None);
    PyObject *state = PyTuple_GET_ITEM(span, 0), *times = PyTuple_GET_ITEM(span, 1), *steps = STEP(s, B_TIMES);
    if (!PyList_CheckExact(state) || PyList_GET_SIZE(state) != 2 || !PyList_CheckExact(times) ||
        STEP(s, B_THREAD) != Py_None || PyList_GET_SIZE(times) == 0 || steps == NULL || !PyTuple_CheckExact(steps))
        return Py_NewRef(Py_None);
    PyObject* p = PyList_GET_ITEM(state, 0);
    long long t0, t1, first, prev = 0, lag, start, end, now;
    int has_prev = p != Py_None;
    int rc = time_int(STEP(s, B_T0), &t0) || time_int(STEP(s, B_T1), &t1) ||
             time_int(PyList_GET_ITEM(times, 0), &first) || (has_prev && time_int(p, &prev)) ||
             time_int(PyList_GET_ITEM(state, 1), &lag);
    if (rc) return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    PyObject* g = PyTuple_GET_SIZE(steps) ? PyTuple_GET_ITEM(steps, 0) : Py_None;  /* Step.gpu_ms() */
    double ns = 0.0;
    if (g != Py_None) {
        if (!PyFloat_CheckExact(g)) return Py_NewRef(Py_None);
        ns = nearbyint(PyFloat_AS_DOUBLE(g) * 1e6);  /* round(gpu_ms * 1e6): ties to even */
        if (!(fabs(ns) < (double)(1LL << 52))) return Py_NewRef(Py_None);  /* (NaN too: late() raises) */
    }
    if (has_prev) start = prev;
    else start = g != Py_None ? t0 : t0 + lag;
    if (start < first) return Py_NewRef(Py_None);
    if (g != Py_None) {
        long long from = has_prev && prev > t0 ? prev : t0;  /* (the start before the previous end moves it) */
        end = from + (long long)ns;
        if (end < t1) end = t1;
    } else {
        end = t1 + lag;
    }
    PyObject* r = PyObject_CallNoArgs(PyTuple_GET_ITEM(span, 2));
    if (r == NULL) return NULL;
    rc = time_int(r, &now);
    Py_DECREF(r);
    if (rc) {  /* (the clock was read: late() may not read it again) */
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "the step clock gave no int of nanoseconds");
        return NULL;
    }
    if (end > now) end = now;
    if (end < t1) end = t1;  /* its end event had completed by now */
    if (has_prev && end < prev) end = prev;
    PyObject *e = PyLong_FromLongLong(end), *l = PyLong_FromLongLong(end - t1);
    PyObject* token = e && l ? Py_BuildValue("(LO)", start, e) : NULL;
    if (token != NULL) {
        PyList_SetItem(state, 0, Py_NewRef(e));
        PyList_SetItem(state, 1, Py_NewRef(l));
    }
    Py_XDECREF(e);
    Py_XDECREF(l);
    return token;
}

/* A read step's marks into the backend's event pool (Backend.event_pool), as its release_marks
 * does: each distinct mark (by identity) once, none of None and ``keep``; 0 or -1.  A step's
 * few marks are compared pairwise; the thousands of a phase inside a long loop go through a set. */
static int give_back(PyObject* pool, PyObject* flat, PyObject* keep) {
    if (flat == NULL || !PyTuple_CheckExact(flat)) {
        PyErr_SetString(PyExc_TypeError, "harvest_steps: a step's marks are not a tuple");
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(flat);
    PyObject* seen = n > 32 ? PySet_New(NULL) : NULL;
    if (n > 32 && seen == NULL) return -1;
    int rc = 0;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        PyObject* m = PyTuple_GET_ITEM(flat, i);
        int skip = m == Py_None || m == keep;
        if (!skip && seen != NULL) {
            PyObject* id = PyLong_FromVoidPtr(m);
            skip = id == NULL ? -1 : PySet_Contains(seen, id);
            if (skip == 0) skip = PySet_Add(seen, id) ? -1 : 0;
            Py_XDECREF(id);
        }
        for (Py_ssize_t j = 0; j < i && skip == 0 && seen == NULL; j++) skip = m == PyTuple_GET_ITEM(flat, j);
        if (skip < 0 || (skip == 0 && PyList_Append(pool, m))) rc = -1;
    }
    Py_XDECREF(seen);
    return rc;
}

/* RunAggregate.add_step(record) (P_ADD_STEP), without its frames for the common step: one that
 * has the run's only name so far and no rank (P_FOLD: the aggregate's name groups and totals)
 * has its group noted and is folded here, as StepTotals.add does; True when it was timed. */
static PyObject* add_step(PyObject* plan, PyObject* record) {
    PyObject* fold = PyTuple_GET_ITEM(plan, P_FOLD);
    if (fold != Py_None && PyTuple_CheckExact(fold) && PyTuple_GET_SIZE(fold) == 2) {
        PyObject *groups = PyTuple_GET_ITEM(fold, 0), *totals = PyTuple_GET_ITEM(fold, 1);
        PyObject* name = PyDict_GetItemWithError(record, s_name);
        int rank = name != NULL ? PyDict_Contains(record, s_rank) : 0;
        if (PyErr_Occurred() || rank < 0) return NULL;
        if (name != NULL && PyUnicode_CheckExact(name) && !rank) {
            PyObject *key = PyObject_GetAttr(groups, s_key), *by_name = key ? PyObject_GetAttr(groups, s_by_name) : NULL;
            int same = by_name == Py_None && key != NULL && PyUnicode_CheckExact(key) ? PyUnicode_Compare(name, key) == 0 : 0;
            Py_XDECREF(key);
            Py_XDECREF(by_name);
            if (PyErr_Occurred()) return NULL;
            if (same) {
                if (PyObject_SetAttr(groups, s_last_key, name)) return NULL;
                PyObject* args[2] = {totals, record};
                PyObject* timed = fold_step(NULL, args, 2);
                if (timed != Py_NotImplemented) return timed;
                Py_DECREF(timed);
                return PyObject_CallMethodOneArg(totals, s_fold, record);
            }
        }
    }
    return PyObject_CallOneArg(PyTuple_GET_ITEM(plan, P_ADD_STEP), record);
}

/* A read step's marks given back (P_RELEASE): into the backend's pool, else through its
 * release_marks; P_KEEP_END: but its end mark, which a hook still needs.  0 or -1. */
static int release_marks(PyObject* plan, PyObject* s) {
    PyObject* release = PyTuple_GET_ITEM(plan, P_RELEASE);
    if (release == Py_None) return 0;
    PyObject* keep = PyTuple_GET_ITEM(plan, P_KEEP_END) == Py_True ? STEP(s, B_END_MARK) : Py_None;
    if (PyList_CheckExact(release)) return give_back(release, STEP(s, B_FLAT), keep);
    PyObject* res = PyObject_CallFunctionObjArgs(release, STEP(s, B_FLAT), keep, NULL);
    Py_XDECREF(res);
    return res == NULL ? -1 : 0;
}

/* The late fields: the constant ones, or the hook's token (new; Py_None when it has none). */
static PyObject* late_fields(PyObject* plan, PyObject* s, PyObject* record) {
    PyObject *fields = PyTuple_GET_ITEM(plan, P_LATE_FIELDS), *late = PyTuple_GET_ITEM(plan, P_LATE);
    if (fields != Py_None) {
        PyObject* u = PyDict_GetItemWithError(record, s_unavailable);
        if (u == NULL || !PyDict_CheckExact(u)) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a step record without its unavailable dict");
            return NULL;
        }
        if (PyDict_Update(record, fields) || PyDict_Update(u, PyTuple_GET_ITEM(plan, P_LATE_REASONS))) return NULL;
        return Py_NewRef(Py_None);
    }
    if (late == Py_None) return Py_NewRef(Py_None);
    PyObject* span = PyTuple_GET_ITEM(plan, P_SPAN);
    if (span != Py_None) {
        PyObject* token = energy_span(span, s);
        if (token != Py_None) return token;
        Py_DECREF(token);
    }
    return PyObject_CallMethodObjArgs(late, s_late, s, record, NULL);
}

/* record["overhead_us"] += share */
static int add_share(PyObject* record, PyObject* share) {
    PyObject* x = PyDict_GetItemWithError(record, s_overhead_us);
    if (x == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "overhead_us");
        return -1;
    }
    PyObject* sum = PyNumber_Add(x, share);
    if (sum == NULL) return -1;
    int rc = PyDict_SetItem(record, s_overhead_us, sum);
    Py_DECREF(sum);
    return rc;
}

/* Each owner's peak_seen = max(peak_seen, the step's peak) (MemoryHook.after_record's). */
static int track_peak(PyObject* owners, PyObject* s) {
    PyObject* peak = STEP(s, B_PEAK);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(owners); i++) {
        PyObject* o = PyTuple_GET_ITEM(owners, i);
        PyObject* seen = PyObject_GetAttr(o, s_peak_seen);
        if (seen == NULL) return -1;
        int more = PyObject_RichCompareBool(peak, seen, Py_GT);
        Py_DECREF(seen);
        if (more < 0 || (more && PyObject_SetAttr(o, s_peak_seen, peak))) return -1;
    }
    return 0;
}

/* HeldRecords.hold's work for a record with no record after it: folded now, encoded now, and
 * queued as held.py's flat tuple (line, name, batch_size, timed, b"", 0, *token); 0 or -1. */
/* The record's line as the log holds it (new): stamped with run_id, encoded as LogSink.encode does
 * (P_ENCODE: orjson.dumps, its option, and _log.encode_line for a record orjson refuses); b""
 * without a log. */
static PyObject* encode(PyObject* plan, PyObject* record) {
    PyObject *enc = PyTuple_GET_ITEM(plan, P_ENCODE), *run_id = PyTuple_GET_ITEM(plan, P_RUN_ID);
    if (!PyTuple_CheckExact(enc) || PyTuple_GET_SIZE(enc) != 3) {
        PyErr_SetString(PyExc_TypeError, "harvest_steps: an encoder of another shape");
        return NULL;
    }
    if (run_id == Py_None) return Py_NewRef(EMPTY_BYTES);
    if (PyDict_SetItem(record, s_run_id, run_id)) return NULL;
    PyObject* a[2] = {record, PyTuple_GET_ITEM(enc, 1)};
    PyObject* line = PyObject_Vectorcall(PyTuple_GET_ITEM(enc, 0), a, 1, KW_OPTION);
    if (line == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {  /* (orjson.JSONEncodeError is one) */
        PyErr_Clear();  /* a value JSON cannot hold: encode_line repairs the record */
        line = PyObject_CallOneArg(PyTuple_GET_ITEM(enc, 2), record);
    }
    return line;
}

static int hold(PyObject* plan, PyObject* s, PyObject* record, PyObject* token, PyObject* held) {
    PyObject *timed = NULL, *line = NULL, *head = NULL, *entry = NULL, *res = NULL;
    int rc = -1;
    if (token != Py_None && !PyTuple_CheckExact(token)) {
        PyErr_SetString(PyExc_TypeError, "harvest_steps: a late hook's token must be a tuple");
        return -1;
    }
    if ((timed = add_step(plan, record)) == NULL) goto done;
    if ((line = encode(plan, record)) == NULL) goto done;
    head = Py_BuildValue("(OOOOOn)", line, STEP(s, B_NAME), STEP(s, B_BATCH), timed, EMPTY_BYTES, (Py_ssize_t)0);
    if (head == NULL) goto done;
    entry = token == Py_None ? Py_NewRef(head) : PySequence_Concat(head, token);
    if (entry == NULL) goto done;
    res = PyObject_CallMethodOneArg(held, s_append, entry);
    rc = res == NULL ? -1 : 0;
done:
    Py_XDECREF(timed);
    Py_XDECREF(line);
    Py_XDECREF(head);
    Py_XDECREF(entry);
    Py_XDECREF(res);
    return rc;
}

/* The step's record, logged and folded now, or held: 1 logged, 0 not, -1 an error.  Steals ``token``. */
static int deliver(PyObject* plan, PyObject* s, PyObject* record, PyObject* token, PyObject* batch) {
    PyObject* held = PyTuple_GET_ITEM(plan, P_HELD);
    Py_ssize_t waiting = PyObject_Length(held);
    int rc = -1;
    if (waiting < 0) goto done;
    if (token != Py_None && waiting == 0) {  /* its late fields may be known already */
        PyObject* filled = PyObject_CallMethodObjArgs(PyTuple_GET_ITEM(plan, P_LATE), s_fill, token, Py_False, NULL);
        if (filled == NULL) goto done;
        if (filled != Py_None) {
            PyObject* u = PyDict_GetItemWithError(record, s_unavailable);
            if (!PyTuple_CheckExact(filled) || PyTuple_GET_SIZE(filled) != 2 || u == NULL ||
                PyDict_Update(record, PyTuple_GET_ITEM(filled, 0)) || PyDict_Update(u, PyTuple_GET_ITEM(filled, 1))) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a late hook's fill() gave no (fields, reasons)");
                Py_DECREF(filled);
                goto done;
            }
            Py_SETREF(token, Py_NewRef(Py_None));
        }
        Py_DECREF(filled);
    }
    if (token == Py_None && waiting == 0) {  /* its line into the batch, encoded now: the dict dies young */
        int logged = PyTuple_GET_ITEM(plan, P_RUN_ID) != Py_None && batch != Py_None;
        if (logged && PyDict_SetItem(record, s_run_id, PyTuple_GET_ITEM(plan, P_RUN_ID))) goto done;
        PyObject* timed = add_step(plan, record);
        if (timed == NULL) goto done;
        Py_DECREF(timed);
        if (logged) {
            PyObject* line = encode(plan, record);
            if (line == NULL || PyList_Append(batch, line)) {
                Py_XDECREF(line);
                goto done;
            }
            Py_DECREF(line);
        }
        rc = logged;
    } else if (hold(plan, s, record, token, held) == 0) {
        rc = 0;
    }
done:
    Py_DECREF(token);
    return rc;
}

static PyObject* harvest_steps(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "harvest_steps(plan, pending, limit, batch)");
        return NULL;
    }
    PyObject *plan = args[0], *pending = args[1], *batch = args[3];
    Py_ssize_t limit = PyLong_AsSsize_t(args[2]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    if (!PyTuple_CheckExact(plan) || PyTuple_GET_SIZE(plan) != N_PLAN || (batch != Py_None && !PyList_CheckExact(batch))) {
        PyErr_SetString(PyExc_TypeError, "harvest_steps: a plan of another shape: rebuild stepprof's C module");
        return NULL;
    }
    if (!build_ready) return Py_BuildValue("(nn)", (Py_ssize_t)0, (Py_ssize_t)0);
    PyObject *b = PyTuple_GET_ITEM(plan, P_BACKEND), *host = PyTuple_GET_ITEM(plan, P_HOST);
    PyObject *unix0 = PyTuple_GET_ITEM(plan, P_UNIX0), *clock0 = PyTuple_GET_ITEM(plan, P_CLOCK0);
    PyObject* owners = PyTuple_GET_ITEM(plan, P_PEAK_OWNERS);
    long long c0, before = LLONG_MAX;
    PyObject* until = PyTuple_GET_ITEM(plan, P_BEFORE);
    if (!PyFloat_CheckExact(unix0) || time_int(clock0, &c0) || !PyTuple_CheckExact(owners) ||
        (until != Py_None && small_int(until, &before))) {
        if (PyErr_Occurred()) return NULL;
        return Py_BuildValue("(nn)", (Py_ssize_t)0, (Py_ssize_t)0);
    }
    Py_ssize_t written = 0, logged = 0;
    while (written < limit) {
        Py_ssize_t n = PyObject_Length(pending);
        if (n < 0) return NULL;
        if (n == 0) break;
        PyObject* s = PySequence_GetItem(pending, 0);
        if (s == NULL) return NULL;
        long long t0, index;
        PyObject* sampled = Py_TYPE(s) == T_STEP ? STEP(s, B_SAMPLED) : NULL;
        int rc = sampled == NULL || sampled != Py_None || STEP(s, B_BACKEND) != b || time_int(STEP(s, B_T0), &t0) ||
                 small_int(STEP(s, B_INDEX), &index) || index >= before;
        if (rc && PyErr_Occurred()) rc = -1;
        if (!rc) rc = read_times(s, PyTuple_GET_ITEM(plan, P_READ));
        PyObject* record = NULL;
        if (!rc) {
            PyObject* start = PyFloat_FromDouble(PyFloat_AS_DOUBLE(unix0) + (double)(t0 - c0) / 1e9);
            if (start == NULL) rc = -1;
            else {
                PyObject* a[4] = {s, PyTuple_GET_ITEM(plan, P_DEVICE), start,
                                  host != Py_None ? host : PyTuple_GET_ITEM(plan, P_PEAKS_WHY)};
                record = host != Py_None ? build_host_step(NULL, a, 4) : build_step(NULL, a, 4);
                Py_DECREF(start);
                if (record == NULL) rc = -1;
                else if (record == Py_NotImplemented) {
                    rc = 1;
                    Py_CLEAR(record);
                }
            }
        }
        if (rc) {
            Py_DECREF(s);
            if (rc < 0) return NULL;
            break;
        }
        PyObject* popped = PyObject_CallMethodNoArgs(pending, s_popleft);
        Py_XDECREF(popped);
        PyObject* token = popped ? late_fields(plan, s, record) : NULL;
        int ok = token != NULL;
        ok = ok && !release_marks(plan, s);
        ok = ok && !add_share(record, PyTuple_GET_ITEM(plan, P_SHARE)) && !track_peak(owners, s);
        int got = -1;
        if (ok) got = deliver(plan, s, record, token, batch);
        else Py_XDECREF(token);
        Py_DECREF(record);
        Py_DECREF(s);
        if (got < 0) return NULL;
        logged += got;
        written++;
    }
    return Py_BuildValue("(nn)", written, logged);
}

/* == fill_energy: the energy of the records that wait for it (stepprof/_recorder/energy.py) ==
 *
 * fill_energy(entries, times, mj, limit, final, dumps, add_late, out[, fold])
 * -> (entries, lines, last start) completes what EnergyHook.fill and HeldRecords._write do for the
 * records at the head of ``entries`` (held.py's tuples) whose span the samples (``times``, ``mj``:
 * the Sampler's lists) cover, at most ``limit`` of them: each one's ``energy_j`` interpolated as
 * energy._at does, to the last bit, its line given the two fields, the summary told (for a timed
 * step: folded into ``fold``'s totals while the run has one name, else ``add_late``), its lines
 * appended to ``out``.  It stops at the first record
 * that must still wait, and leaves to Python one it cannot complete so (no sample before its
 * start, a sampler that stopped, numbers past 2**53); ``last start`` is the last span's start
 * (None: none), from which the caller trims the samples. */

#define EXACT (1LL << 53)

/* bisect_left(ts, t) over a list of ints (0 found, 1 leave it to Python, -1 an error). */
static int bisect_ts(PyObject* ts, Py_ssize_t n, long long t, Py_ssize_t* at) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        long long v;
        int rc = time_int(PyList_GET_ITEM(ts, mid), &v);
        if (rc) return rc;
        if (v < t) lo = mid + 1;
        else hi = mid;
    }
    *at = lo;
    return 0;
}

/* The counter at host time t, within the samples, as energy._at computes it (0, 1, -1). */
static int counter_at(PyObject* ts, PyObject* mj, Py_ssize_t n, long long t, double* out) {
    Py_ssize_t i;
    long long ti, m1;
    int rc = bisect_ts(ts, n, t, &i);
    if (rc || i >= n) return rc ? rc : 1;
    if ((rc = time_int(PyList_GET_ITEM(ts, i), &ti)) || (rc = small_int(PyList_GET_ITEM(mj, i), &m1))) return rc;
    if (ti == t) {
        *out = (double)m1;
        return 0;
    }
    if (i == 0) return 1;
    long long t0, m0;
    if ((rc = time_int(PyList_GET_ITEM(ts, i - 1), &t0)) || (rc = small_int(PyList_GET_ITEM(mj, i - 1), &m0))) return rc;
    long long dm = m1 - m0, dt = t - t0, den = ti - t0;
    /* Python's int product is exact and its int / int correctly rounded: so is this while both stay below 2**53 */
    if (den <= 0 || den >= EXACT || dm < 0 || dm >= EXACT || dt < 0 || (dm > 0 && dt > (EXACT - 1) / dm)) return 1;
    *out = (double)m0 + (double)(dm * dt) / (double)den;
    return 0;
}

/* An entry's parts: (line, name, batch_size, timed, after, count after[, start, end]), and its
 * energy in J (*energy) when it has a span.  0: ready; 1: not one fill_energy takes (Python's
 * fill does); 2: its sample is still to come; -1: an error. */
static int entry_energy(PyObject* e, PyObject* ts, PyObject* mj, int final, long long* start, long long* end,
                        long long* n_after, double* energy) {
    Py_ssize_t size = PyTuple_CheckExact(e) ? PyTuple_GET_SIZE(e) : 0;
    int rc = (size != 6 && size != 8) || !PyBytes_CheckExact(PyTuple_GET_ITEM(e, 0)) ||
             !PyBytes_CheckExact(PyTuple_GET_ITEM(e, 4)) || small_int(PyTuple_GET_ITEM(e, 5), n_after);
    if (!rc && size == 8) rc = time_int(PyTuple_GET_ITEM(e, 6), start) || time_int(PyTuple_GET_ITEM(e, 7), end);
    *energy = 0.0;
    if (rc || size != 8) return rc ? (PyErr_Occurred() ? -1 : 1) : 0;
    Py_ssize_t n = Py_MIN(PyList_GET_SIZE(ts), PyList_GET_SIZE(mj));  /* (the sampler appends mj first) */
    long long first = 0, latest = 0;
    double a = 0.0, z = 0.0;
    rc = n == 0 || time_int(PyList_GET_ITEM(ts, 0), &first) || time_int(PyList_GET_ITEM(ts, n - 1), &latest);
    if (!rc && !final && latest < *end) return 2;  /* (or, past the patience, never: EnergyHook.fill says why) */
    if (!rc) rc = *start < first || *end > latest;
    if (!rc) rc = counter_at(ts, mj, n, *end, &z);
    if (!rc) rc = counter_at(ts, mj, n, *start, &a);
    if (rc) return (rc < 0 || PyErr_Occurred()) ? -1 : 1;
    *energy = (z - a) / 1e3;
    return 0;
}

/* '{...}\n' -> '{..., "energy_j": ..., "energy_span_ms": ...}\n', the fields encoded by ``dumps``
 * (orjson's, as the Python path's).  A new reference (the line itself when it is too short to
 * hold an object), or NULL. */
static PyObject* filled_line(PyObject* line, PyObject* fields, PyObject* dumps) {
    if (PyBytes_GET_SIZE(line) < 2) return Py_NewRef(line);
    PyObject* js = PyObject_CallOneArg(dumps, fields);
    if (js == NULL) return NULL;
    if (!PyBytes_CheckExact(js) || PyBytes_GET_SIZE(js) < 2) {
        Py_DECREF(js);
        PyErr_SetString(PyExc_TypeError, "fill_energy: dumps gave no JSON object");
        return NULL;
    }
    Py_ssize_t a = PyBytes_GET_SIZE(line) - 2, b = PyBytes_GET_SIZE(js) - 1;
    PyObject* filled = PyBytes_FromStringAndSize(NULL, a + 1 + b + 1);
    if (filled != NULL) {
        char* p = PyBytes_AS_STRING(filled);
        memcpy(p, PyBytes_AS_STRING(line), a);
        p[a] = ',';
        memcpy(p + a + 1, PyBytes_AS_STRING(js) + 1, b);
        p[a + 1 + b] = '\n';
    }
    Py_DECREF(js);
    return filled;
}

/* RunAggregate.add_late for a timed record's energy, without its frames, where the run has one
 * name so far (``fold``: the aggregate's name groups and totals, add_step's P_FOLD) and
 * StepTotals._add_energy would sum the figures: 1 folded, 0 left to add_late, -1 an error. */
static int fold_energy(PyObject* fold, double energy, double span_ms, PyObject* batch) {
    if (fold == NULL || !PyTuple_CheckExact(fold) || PyTuple_GET_SIZE(fold) != 2) return 0;
    PyObject *groups = PyTuple_GET_ITEM(fold, 0), *totals = PyTuple_GET_ITEM(fold, 1);
    double uj_d = energy * 1e6, us_d = span_ms * 1e3;
    if (T_TOTALS == NULL || Py_TYPE(totals) != T_TOTALS || !(energy >= 0 && span_ms > 0) || !isfinite(uj_d) ||
        !isfinite(us_d))
        return 0;
    PyObject* by_name = PyObject_GetAttr(groups, s_by_name);
    if (by_name == NULL) return -1;
    int one_name = by_name == Py_None;
    Py_DECREF(by_name);
    if (!one_name) return 0;  /* (the name groups get it too: add_late) */
    PyObject *uj = round_int(uj_d), *us = uj != NULL ? round_int(us_d) : NULL;
    int rc = us == NULL ? -1 : sum_energy(totals, uj, us, batch);
    Py_XDECREF(uj);
    Py_XDECREF(us);
    return rc ? -1 : 1;
}

/* A timed record's energy into the summary: folded in C (fold_energy), else
 * add_late({**fields, "unavailable": {}}, name, batch_size, timed).  0 or -1. */
static int add_late_energy(PyObject* add_late, PyObject* fold, PyObject* fields, PyObject* e, double energy,
                           double span_ms) {
    int timed = PyObject_IsTrue(PyTuple_GET_ITEM(e, 3));
    if (timed <= 0) return timed;
    int folded = fold_energy(fold, energy, span_ms, PyTuple_GET_ITEM(e, 2));
    if (folded) return folded < 0 ? -1 : 0;
    PyObject* u = PyDict_New();
    PyObject* r = u ? PyDict_Copy(fields) : NULL;
    PyObject* res = r && !PyDict_SetItem(r, s_unavailable, u)
        ? PyObject_CallFunctionObjArgs(add_late, r, PyTuple_GET_ITEM(e, 1), PyTuple_GET_ITEM(e, 2),
                                       PyTuple_GET_ITEM(e, 3), NULL)
        : NULL;
    int ok = res != NULL;
    Py_XDECREF(res);
    Py_XDECREF(r);
    Py_XDECREF(u);
    return ok ? 0 : -1;
}

/* The entry's line (its energy filled in, when it has a span) and the lines after it, appended
 * to ``out``; its energy to the summary.  0 or -1. */
static int write_entry(PyObject* e, long long start, long long end, double energy, PyObject* dumps,
                       PyObject* add_late, PyObject* fold, PyObject* out) {
    PyObject *line = PyTuple_GET_ITEM(e, 0), *after = PyTuple_GET_ITEM(e, 4), *filled = NULL, *full = NULL;
    int ok = 1;
    if (PyTuple_GET_SIZE(e) == 8) {
        double span_ms = (double)(end - start) / 1e6;
        PyObject* fields = Py_BuildValue("{sdsd}", "energy_j", energy, "energy_span_ms", span_ms);
        ok = fields != NULL && (filled = filled_line(line, fields, dumps)) != NULL &&
             add_late_energy(add_late, fold, fields, e, energy, span_ms) == 0;
        Py_XDECREF(fields);
    }
    if (ok) {
        PyObject* base = filled ? filled : line;
        full = PyBytes_GET_SIZE(after) ? PySequence_Concat(base, after) : Py_NewRef(base);
        ok = full != NULL && !PyList_Append(out, full);
    }
    Py_XDECREF(filled);
    Py_XDECREF(full);
    return ok ? 0 : -1;
}

static PyObject* fill_energy(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8 && nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "fill_energy(entries, times, mj, limit, final, dumps, add_late, out[, fold])");
        return NULL;
    }
    PyObject *entries = args[0], *ts = args[1], *mj = args[2], *dumps = args[5], *add_late = args[6], *out = args[7];
    PyObject* fold = nargs > 8 ? args[8] : NULL;
    Py_ssize_t limit = PyLong_AsSsize_t(args[3]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    int final = PyObject_IsTrue(args[4]);
    if (final < 0) return NULL;
    if (!build_ready || !PyList_CheckExact(ts) || !PyList_CheckExact(mj) || !PyList_CheckExact(out))
        return Py_BuildValue("(nnO)", (Py_ssize_t)0, (Py_ssize_t)0, Py_None);
    Py_ssize_t done = 0, lines = 0;
    long long last = 0;
    int spans = 0;
    while (done < limit) {
        Py_ssize_t left = PyObject_Length(entries);
        if (left < 0) return NULL;
        if (left == 0) break;
        PyObject* e = PySequence_GetItem(entries, 0);
        if (e == NULL) return NULL;
        long long start = 0, end = 0, n_after = 0;
        double energy;
        int rc = entry_energy(e, ts, mj, final, &start, &end, &n_after, &energy);
        if (rc) {
            Py_DECREF(e);
            if (rc < 0) return NULL;
            break;
        }
        PyObject* popped = PyObject_CallMethodNoArgs(entries, s_popleft);  /* (first, as HeldRecords._write) */
        if (popped == NULL || write_entry(e, start, end, energy, dumps, add_late, fold, out) < 0) {
            Py_XDECREF(popped);
            Py_DECREF(e);
            return NULL;
        }
        Py_DECREF(popped);
        done++;
        lines += 1 + (Py_ssize_t)n_after;
        if (PyTuple_GET_SIZE(e) == 8) last = start, spans = 1;
        Py_DECREF(e);
    }
    PyObject* last_obj = spans ? PyLong_FromLongLong(last) : Py_NewRef(Py_None);
    if (last_obj == NULL) return NULL;
    return Py_BuildValue("(nnN)", done, lines, last_obj);
}

/* -- The sanitiser's fast check (stepprof/_sanitise.py): whether a record read from a log is
 * valid as it is, so that sanitise() may hand it on unchanged.  It says yes only where the
 * Python pass would change nothing and note nothing; anything else (an undeclared key, a value
 * to convert, cut or refuse, a missing required field) is left to the Python pass, which then
 * does all the work.  The declaration reaches C from Python (configure_sanitise) as a table of
 * specs, tests/test_fold.py holds the two to the same answers on the fuzzers' records. */

enum { SZ_FLOAT, SZ_INT, SZ_STR, SZ_BOOL, SZ_OBJ, SZ_MAP, SZ_LIST, SZ_FREE };
typedef struct {
    int code;
    double lo, hi;          /* a number's range */
    Py_ssize_t max_items;   /* a map's or list's size */
    Py_ssize_t sub;         /* SZ_OBJ: its fields' dict in sz_objs; SZ_MAP, SZ_LIST: the value's spec */
} SzSpec;
static SzSpec* sz_specs;
static Py_ssize_t sz_str_max, sz_key_max;
static PyObject *sz_objs, *sz_kinds;  /* [{key: spec index}], {kind: (fields' index, required keys)} */

/* An exact int or float within [lo, hi]; an int only if ``ints``; ints past 2**53 are left to Python. */
static int sz_number(PyObject* v, double lo, double hi, int ints) {
    double x;
    if (PyLong_CheckExact(v)) {
        int over = 0;
        long long n = PyLong_AsLongLongAndOverflow(v, &over);
        if (over || n > (1LL << 53) || n < -(1LL << 53)) return 0;
        x = (double)n;
    } else if (!ints && PyFloat_CheckExact(v)) {
        x = PyFloat_AS_DOUBLE(v);
    } else {
        return 0;
    }
    return lo <= x && x <= hi;
}

static int sz_obj(PyObject* d, Py_ssize_t fields);

/* Whether ``v`` (not None) is valid as it is for spec ``i``. */
static int sz_value(PyObject* v, Py_ssize_t i) {
    const SzSpec* sp = &sz_specs[i];
    Py_ssize_t pos = 0, n;
    PyObject *k, *x;
    switch (sp->code) {
    case SZ_FLOAT: return sz_number(v, sp->lo, sp->hi, 0);
    case SZ_INT: return sz_number(v, sp->lo, sp->hi, 1);
    case SZ_STR: return PyUnicode_CheckExact(v) && PyUnicode_GET_LENGTH(v) <= sz_str_max;
    case SZ_BOOL: return PyBool_Check(v);
    case SZ_OBJ: return PyDict_CheckExact(v) && sz_obj(v, sp->sub);
    case SZ_MAP:
        if (!PyDict_CheckExact(v) || PyDict_GET_SIZE(v) > sp->max_items) return 0;
        while (PyDict_Next(v, &pos, &k, &x)) {
            if (!PyUnicode_CheckExact(k) || PyUnicode_GET_LENGTH(k) > sz_key_max) return 0;
            if (x != Py_None && !sz_value(x, sp->sub)) return 0;
        }
        return 1;
    case SZ_LIST:
        if (!PyList_CheckExact(v) || (n = PyList_GET_SIZE(v)) > sp->max_items) return 0;
        for (Py_ssize_t j = 0; j < n; j++) {
            x = PyList_GET_ITEM(v, j);
            if (x != Py_None && !sz_value(x, sp->sub)) return 0;
        }
        return 1;
    default: return 0;  /* free-form (a calibration): Python keeps what it may */
    }
}

/* Whether every key of ``d`` is declared in fields' dict ``fields`` and its value valid as it is. */
static int sz_obj(PyObject* d, Py_ssize_t fields) {
    PyObject* specs = PyList_GET_ITEM(sz_objs, fields);
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(d, &pos, &k, &v)) {
        PyObject* at = PyUnicode_CheckExact(k) ? PyDict_GetItemWithError(specs, k) : NULL;
        if (at == NULL) {
            PyErr_Clear();
            return 0;
        }
        if (v != Py_None && !sz_value(v, PyLong_AsSsize_t(at))) return 0;
    }
    return 1;
}

/* valid_as_is(record) -> bool */
static PyObject* valid_as_is(PyObject* self, PyObject* record) {
    (void)self;
    if (sz_kinds == NULL || !PyDict_CheckExact(record)) Py_RETURN_FALSE;
    PyObject* kind = GET(record, K_KIND);
    PyObject* entry = kind != NULL && PyUnicode_CheckExact(kind) ? PyDict_GetItemWithError(sz_kinds, kind) : NULL;
    if (entry == NULL) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    PyObject* required = PyTuple_GET_ITEM(entry, 1);
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(required); j++) {
        PyObject* x = PyDict_GetItemWithError(record, PyTuple_GET_ITEM(required, j));
        if (x == NULL || x == Py_None) {
            PyErr_Clear();
            Py_RETURN_FALSE;
        }
    }
    return PyBool_FromLong(sz_obj(record, PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 0))));
}

/* Whether the objects (dicts of spec indices below n) or the kinds ((object index, tuple))
 * are not what valid_as_is indexes without checking (then a ValueError is set). */
static int sz_tables_wrong(PyObject* objs, PyObject* kinds, Py_ssize_t n) {
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(objs); i++) {
        PyObject* d = PyList_GET_ITEM(objs, i);
        if (!PyDict_CheckExact(d)) goto wrong;
        pos = 0;
        while (PyDict_Next(d, &pos, &k, &v)) {
            Py_ssize_t at = PyLong_Check(v) ? PyLong_AsSsize_t(v) : -1;
            if (!PyUnicode_CheckExact(k) || at < 0 || at >= n) goto wrong;
        }
    }
    pos = 0;
    while (PyDict_Next(kinds, &pos, &k, &v)) {
        if (!PyTuple_CheckExact(v) || PyTuple_GET_SIZE(v) != 2 || !PyTuple_CheckExact(PyTuple_GET_ITEM(v, 1)))
            goto wrong;
        Py_ssize_t at = PyLong_Check(PyTuple_GET_ITEM(v, 0)) ? PyLong_AsSsize_t(PyTuple_GET_ITEM(v, 0)) : -1;
        if (at < 0 || at >= PyList_GET_SIZE(objs)) goto wrong;
    }
    return 0;
wrong:
    PyErr_Clear();
    PyErr_SetString(PyExc_ValueError, "configure_sanitise: a table is not what valid_as_is reads");
    return 1;
}

/* configure_sanitise(specs, objs, kinds, str_max, key_max): specs [(code, lo, hi, max_items, sub)]. */
static PyObject* configure_sanitise(PyObject* self, PyObject* args) {
    (void)self;
    PyObject *specs, *objs, *kinds;
    Py_ssize_t str_max, key_max;
    if (!PyArg_ParseTuple(args, "O!O!O!nn", &PyList_Type, &specs, &PyList_Type, &objs, &PyDict_Type, &kinds,
                          &str_max, &key_max))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(specs);
    SzSpec* table = PyMem_Calloc(n ? n : 1, sizeof(SzSpec));
    if (table == NULL) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        SzSpec* sp = &table[i];
        if (!PyArg_ParseTuple(PyList_GET_ITEM(specs, i), "iddnn", &sp->code, &sp->lo, &sp->hi, &sp->max_items,
                              &sp->sub)) {
            PyMem_Free(table);
            return NULL;
        }
        Py_ssize_t limit = sp->code == SZ_OBJ ? PyList_GET_SIZE(objs) : n;
        if ((sp->code == SZ_OBJ || sp->code == SZ_MAP || sp->code == SZ_LIST) && (sp->sub < 0 || sp->sub >= limit)) {
            PyMem_Free(table);
            PyErr_Format(PyExc_ValueError, "configure_sanitise: spec %zd points past its table", i);
            return NULL;
        }
    }
    if (sz_tables_wrong(objs, kinds, n)) {
        PyMem_Free(table);
        return NULL;
    }
    PyMem_Free(sz_specs);
    sz_specs = table;
    sz_str_max = str_max;
    sz_key_max = key_max;
    Py_XSETREF(sz_objs, Py_NewRef(objs));
    Py_XSETREF(sz_kinds, Py_NewRef(kinds));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"fold_step", (PyCFunction)(void (*)(void))fold_step, METH_FASTCALL,
     "fold_step(totals, record): StepTotals.add(record) in C, or NotImplemented (nothing changed)."},
    {"build_step", (PyCFunction)(void (*)(void))build_step, METH_FASTCALL,
     "build_step(step, device, start_unix_s, phase_peaks_why): the step record, or NotImplemented."},
    {"build_host_step", (PyCFunction)(void (*)(void))build_host_step, METH_FASTCALL,
     "build_host_step(step, device, start_unix_s, reasons): a host step's record, or NotImplemented."},
    {"harvest_steps", (PyCFunction)(void (*)(void))harvest_steps, METH_FASTCALL,
     "harvest_steps(plan, pending, limit, batch) -> (written, logged): Collector.harvest's loop for the steps "
     "its plan covers."},
    {"fill_energy", (PyCFunction)(void (*)(void))fill_energy, METH_FASTCALL,
     "fill_energy(entries, times, mj, limit, final, dumps, add_late, out[, fold]) -> (entries, lines, last start): "
     "the energy of the held records whose span the samples cover."},
    {"configure_build", configure_build, METH_VARARGS,
     "configure_build(Step, PhaseTotals, core keys, optional keys, phase keys, reasons, allocator names, "
     "schema version)"},
    {"configure", configure, METH_VARARGS,
     "configure(spikes_kept, settle_every, table_cap, StepTotals, PhaseTotals, Sum, Max, First, Last, Counter, "
     "Table, Sketch, FirstByKey, Largest): the constants and classes fold_step works on"},
    {"valid_as_is", valid_as_is, METH_O,
     "valid_as_is(record) -> bool: whether sanitise() would hand the record on unchanged (False: ask it)."},
    {"configure_sanitise", configure_sanitise, METH_VARARGS,
     "configure_sanitise(specs, objs, kinds, str_max, key_max): the declaration valid_as_is checks against"},
    {NULL, NULL, 0, NULL},
};

int stepprof_core_add(PyObject* m); /* _core.c: the step core */

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "stepprof_fold", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_stepprof_fold(void) {
    for (int i = 0; i < N_NAMES; i++) {
        if ((S[i] = PyUnicode_InternFromString(NAMES[i])) == NULL) return NULL;
    }
    if ((ZERO = PyLong_FromLong(0)) == NULL || (ONE = PyLong_FromLong(1)) == NULL) return NULL;
    PyObject* m = PyModule_Create(&module);
    PyObject* fields = PyTuple_New(N_CORE);
    for (int i = 0; fields != NULL && i < N_CORE; i++) {
        PyObject* name = PyUnicode_InternFromString(BUILD_FIELDS[i]);
        if (name == NULL) Py_CLEAR(fields);
        else PyTuple_SET_ITEM(fields, i, name);
    }
    if (m == NULL || fields == NULL || PyModule_AddIntConstant(m, "ABI", ABI) < 0 ||
        PyModule_AddObject(m, "BUILD_FIELDS", fields) < 0 || (fields = NULL, stepprof_core_add(m) < 0)) {
        Py_XDECREF(fields);
        Py_XDECREF(m);
        return NULL;
    }
    return m;
}
