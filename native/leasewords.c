/*
 * Lease words: the residency map and per-slot reader counts in shared memory,
 * operated on with C11-style atomics (Python has none).
 *
 * The region (64-bit words, at a byte offset of a writable buffer) holds
 *   header   [0] magic, [1] the coordinator's processed-message count,
 *   state    [HEADER + s]            readers of slot s (low 32 bits) | CLAIMED
 *   gen      [HEADER + S + s]        slot s's publication generation
 *   map      [HEADER + 2S + l*E + e] 0, or (generation << 32) | (slot + 1)
 *
 * One writer (the coordinator) decides residency; readers (the GPU worker)
 * only count themselves in and out:
 *   lease    all-or-nothing for a layer's experts: per expert, read its map
 *            word, add a reader to its slot, and keep the count only if the
 *            slot is not CLAIMED and its generation still is the map word's;
 *            otherwise take every count back and report a miss.
 *   claim    sets CLAIMED (new readers back out) and returns the readers
 *            still in; the writer waits for zero before it changes the slot.
 *   withdraw (claimed) bumps the generation and clears the slot's map word,
 *            so a reader holding an old map word can never enter.
 *   publish  (claimed) writes the map word, then clears CLAIMED with an
 *            atomic AND so a backing-out reader's transient count survives.
 * Every operation is sequentially consistent.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#define HEADER 8
#define MAGIC 0x6d6f65736c616231ULL /* "moeslab1" */
#define CLAIMED ((uint64_t)1 << 32)
#define READERS(word) ((word) & 0xffffffffULL)
#define SEQ __ATOMIC_SEQ_CST

typedef struct {
    Py_buffer view;
    uint64_t *words;
    Py_ssize_t slots, layers, experts;
} Region;

static Py_ssize_t region_words(Py_ssize_t slots, Py_ssize_t layers, Py_ssize_t experts) {
    return HEADER + 2 * slots + layers * experts;
}

/* Parse (buffer, offset, slots, layers, experts) and check the region fits. */
static int region_open(Region *r, PyObject *buffer, Py_ssize_t offset, Py_ssize_t slots, Py_ssize_t layers,
                       Py_ssize_t experts) {
    if (offset < 0 || offset % 8 || slots < 1 || layers < 1 || experts < 1 || slots > 0x7fffffff ||
        experts > (1 << 20) || layers > (1 << 16)) {
        PyErr_Format(PyExc_ValueError,
                     "lease words: bad geometry offset=%zd slots=%zd layers=%zd experts=%zd", offset, slots,
                     layers, experts);
        return -1;
    }
    if (PyObject_GetBuffer(buffer, &r->view, PyBUF_WRITABLE) < 0) return -1;
    Py_ssize_t need = offset + 8 * region_words(slots, layers, experts);
    if (r->view.len < need || ((uintptr_t)r->view.buf + offset) % 8) {
        PyErr_Format(PyExc_ValueError, "lease words: buffer of %zd bytes cannot hold %zd bytes at offset %zd",
                     r->view.len, need - offset, offset);
        PyBuffer_Release(&r->view);
        return -1;
    }
    r->words = (uint64_t *)((char *)r->view.buf + offset);
    r->slots = slots;
    r->layers = layers;
    r->experts = experts;
    return 0;
}

#define OPEN(r, args, fmt, ...)                                                                    \
    PyObject *buffer_;                                                                             \
    Py_ssize_t offset_, slots_, layers_, experts_;                                                 \
    if (!PyArg_ParseTuple(args, "Onnnn" fmt, &buffer_, &offset_, &slots_, &layers_, &experts_,     \
                          ##__VA_ARGS__))                                                          \
        return NULL;                                                                               \
    if (region_open(&r, buffer_, offset_, slots_, layers_, experts_) < 0) return NULL;

static uint64_t *state_of(Region *r, Py_ssize_t slot) { return &r->words[HEADER + slot]; }
static uint64_t *gen_of(Region *r, Py_ssize_t slot) { return &r->words[HEADER + r->slots + slot]; }
static uint64_t *map_of(Region *r, Py_ssize_t layer, Py_ssize_t expert) {
    return &r->words[HEADER + 2 * r->slots + layer * r->experts + expert];
}

static int check_slot(Region *r, Py_ssize_t slot) {
    if (slot < 0 || slot >= r->slots) {
        PyErr_Format(PyExc_ValueError, "slot %zd is outside the %zd slots", slot, r->slots);
        return -1;
    }
    return 0;
}

static int check_key(Region *r, Py_ssize_t layer, Py_ssize_t expert) {
    if (layer < 0 || layer >= r->layers || expert < 0 || expert >= r->experts) {
        PyErr_Format(PyExc_ValueError, "layer %zd expert %zd is outside %zd layers x %zd experts", layer, expert,
                     r->layers, r->experts);
        return -1;
    }
    return 0;
}

/* init(buf, off, S, L, E): every slot claimed and unpublished, no reader, nothing processed. */
static PyObject *lw_init(PyObject *self, PyObject *args) {
    (void)self;
    Region r;
    OPEN(r, args, "")
    Py_ssize_t n = region_words(r.slots, r.layers, r.experts);
    for (Py_ssize_t i = 1; i < n; i++) __atomic_store_n(&r.words[i], 0, SEQ);
    for (Py_ssize_t s = 0; s < r.slots; s++) __atomic_store_n(state_of(&r, s), CLAIMED, SEQ);
    __atomic_store_n(&r.words[0], MAGIC, SEQ);
    PyBuffer_Release(&r.view);
    Py_RETURN_NONE;
}

/* lease(buf, off, S, L, E, layer, experts) -> tuple of slots, or None (a miss: no count kept). */
static PyObject *lw_lease(PyObject *self, PyObject *args) {
    (void)self;
    Region r;
    Py_ssize_t layer;
    PyObject *experts;
    OPEN(r, args, "nO", &layer, &experts)
    PyObject *seq = PySequence_Fast(experts, "experts must be a sequence");
    PyObject *result = NULL;
    Py_ssize_t n = seq ? PySequence_Fast_GET_SIZE(seq) : 0, got = 0;
    Py_ssize_t held[256];
    if (!seq) goto done;
    if (n > 256) {
        PyErr_Format(PyExc_ValueError, "lease of %zd experts; at most 256", n);
        goto done;
    }
    if (__atomic_load_n(&r.words[0], SEQ) != MAGIC) {
        PyErr_SetString(PyExc_ValueError, "lease words are not initialised");
        goto done;
    }
    for (; got < n; got++) {
        Py_ssize_t expert = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, got));
        if (expert == -1 && PyErr_Occurred()) goto undo;
        if (check_key(&r, layer, expert) < 0) goto undo;
        uint64_t entry = __atomic_load_n(map_of(&r, layer, expert), SEQ);
        Py_ssize_t slot = (Py_ssize_t)(entry & 0xffffffffULL) - 1;
        if (slot < 0 || slot >= r.slots) goto miss;
        uint64_t old = __atomic_fetch_add(state_of(&r, slot), 1, SEQ);
        if ((old & CLAIMED) || __atomic_load_n(gen_of(&r, slot), SEQ) != (entry >> 32)) {
            __atomic_fetch_sub(state_of(&r, slot), 1, SEQ);
            goto miss;
        }
        held[got] = slot;
    }
    result = PyTuple_New(n);
    if (!result) goto undo;
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(result, i, PyLong_FromSsize_t(held[i]));
    goto done;
miss:
    result = Py_None;
    Py_INCREF(result);
undo:
    for (Py_ssize_t i = 0; i < got; i++) __atomic_fetch_sub(state_of(&r, held[i]), 1, SEQ);
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&r.view);
    return result;
}

/* release(buf, off, S, L, E, slots): take back one reader count per slot. */
static PyObject *lw_release(PyObject *self, PyObject *args) {
    (void)self;
    Region r;
    PyObject *slots;
    OPEN(r, args, "O", &slots)
    PyObject *seq = PySequence_Fast(slots, "slots must be a sequence");
    PyObject *result = NULL;
    if (!seq) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) { /* check all before changing any */
        Py_ssize_t slot = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i));
        if ((slot == -1 && PyErr_Occurred()) || check_slot(&r, slot) < 0) goto done;
        uint64_t times = 0; /* a slot listed k times takes back k counts: it must hold k */
        for (Py_ssize_t j = 0; j < n; j++)
            if (PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, j)) == slot) times++;
        if (READERS(__atomic_load_n(state_of(&r, slot), SEQ)) < times) {
            PyErr_Format(PyExc_ValueError, "release of slot %zd %llu time(s), which has fewer readers", slot,
                         (unsigned long long)times);
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++)
        __atomic_fetch_sub(state_of(&r, PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i))), 1, SEQ);
    result = Py_None;
    Py_INCREF(result);
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&r.view);
    return result;
}

/* claim(buf, off, S, L, E, slot) -> readers still in (0: the slot is the writer's). */
static PyObject *lw_claim(PyObject *self, PyObject *args) {
    (void)self;
    Region r;
    Py_ssize_t slot;
    OPEN(r, args, "n", &slot)
    PyObject *result = NULL;
    if (check_slot(&r, slot) == 0)
        result = PyLong_FromUnsignedLongLong(READERS(__atomic_or_fetch(state_of(&r, slot), CLAIMED, SEQ)));
    PyBuffer_Release(&r.view);
    return result;
}

/* withdraw(buf, off, S, L, E, slot, layer, expert): a claimed slot leaves the map (layer -1: no entry). */
static PyObject *lw_withdraw(PyObject *self, PyObject *args) {
    (void)self;
    Region r;
    Py_ssize_t slot, layer, expert;
    OPEN(r, args, "nnn", &slot, &layer, &expert)
    PyObject *result = NULL;
    if (check_slot(&r, slot) < 0 || (layer >= 0 && check_key(&r, layer, expert) < 0)) goto done;
    if (!(__atomic_load_n(state_of(&r, slot), SEQ) & CLAIMED)) {
        PyErr_Format(PyExc_ValueError, "withdraw of slot %zd, which is not claimed", slot);
        goto done;
    }
    __atomic_add_fetch(gen_of(&r, slot), 1, SEQ);
    if (layer >= 0) {
        uint64_t *entry = map_of(&r, layer, expert);
        uint64_t seen = __atomic_load_n(entry, SEQ);
        if ((Py_ssize_t)(seen & 0xffffffffULL) == slot + 1) __atomic_store_n(entry, 0, SEQ);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&r.view);
    return result;
}

/* publish(buf, off, S, L, E, slot, layer, expert): a claimed slot's expert becomes leasable. */
static PyObject *lw_publish(PyObject *self, PyObject *args) {
    (void)self;
    Region r;
    Py_ssize_t slot, layer, expert;
    OPEN(r, args, "nnn", &slot, &layer, &expert)
    PyObject *result = NULL;
    if (check_slot(&r, slot) < 0 || check_key(&r, layer, expert) < 0) goto done;
    if (!(__atomic_load_n(state_of(&r, slot), SEQ) & CLAIMED)) {
        PyErr_Format(PyExc_ValueError, "publish of slot %zd, which is not claimed", slot);
        goto done;
    }
    uint64_t generation = __atomic_load_n(gen_of(&r, slot), SEQ) & 0xffffffffULL;
    __atomic_store_n(gen_of(&r, slot), generation, SEQ);
    __atomic_store_n(map_of(&r, layer, expert), (generation << 32) | (uint64_t)(slot + 1), SEQ);
    __atomic_and_fetch(state_of(&r, slot), ~CLAIMED, SEQ);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&r.view);
    return result;
}

/* reset_readers(buf, off, S, L, E) -> counts dropped: the only reader is gone. */
static PyObject *lw_reset_readers(PyObject *self, PyObject *args) {
    (void)self;
    Region r;
    OPEN(r, args, "")
    unsigned long long dropped = 0;
    for (Py_ssize_t s = 0; s < r.slots; s++) {
        uint64_t seen = __atomic_load_n(state_of(&r, s), SEQ);
        while (!__atomic_compare_exchange_n(state_of(&r, s), &seen, seen & CLAIMED, 0, SEQ, SEQ)) {
        }
        dropped += READERS(seen);
    }
    PyBuffer_Release(&r.view);
    return PyLong_FromUnsignedLongLong(dropped);
}

/* word(buf, off, S, L, E, index) -> the raw word; set_word(..., index, value) (header words only). */
static PyObject *lw_word(PyObject *self, PyObject *args) {
    (void)self;
    Region r;
    Py_ssize_t index;
    OPEN(r, args, "n", &index)
    PyObject *result = NULL;
    if (index < 0 || index >= region_words(r.slots, r.layers, r.experts))
        PyErr_Format(PyExc_ValueError, "word %zd is outside the region", index);
    else
        result = PyLong_FromUnsignedLongLong(__atomic_load_n(&r.words[index], SEQ));
    PyBuffer_Release(&r.view);
    return result;
}

static PyObject *lw_set_header(PyObject *self, PyObject *args) {
    (void)self;
    Region r;
    Py_ssize_t index;
    unsigned long long value;
    OPEN(r, args, "nK", &index, &value)
    PyObject *result = NULL;
    if (index < 1 || index >= HEADER)
        PyErr_Format(PyExc_ValueError, "header word %zd: only words 1..%d may be set", index, HEADER - 1);
    else {
        __atomic_store_n(&r.words[index], (uint64_t)value, SEQ);
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&r.view);
    return result;
}

static PyObject *lw_region_bytes(PyObject *self, PyObject *args) {
    (void)self;
    Py_ssize_t slots, layers, experts;
    if (!PyArg_ParseTuple(args, "nnn", &slots, &layers, &experts)) return NULL;
    return PyLong_FromSsize_t(8 * region_words(slots, layers, experts));
}

static PyMethodDef methods[] = {
    {"init", lw_init, METH_VARARGS, "Every slot claimed and unpublished, no reader."},
    {"lease", lw_lease, METH_VARARGS, "All-or-nothing reader counts on a layer's experts: slots or None."},
    {"release", lw_release, METH_VARARGS, "Take back one reader count per slot."},
    {"claim", lw_claim, METH_VARARGS, "Bar new readers from a slot; the readers still in."},
    {"withdraw", lw_withdraw, METH_VARARGS, "A claimed slot leaves the map; its generation moves on."},
    {"publish", lw_publish, METH_VARARGS, "A claimed slot's expert becomes leasable."},
    {"reset_readers", lw_reset_readers, METH_VARARGS, "Drop every reader count (the reader died)."},
    {"word", lw_word, METH_VARARGS, "One raw word of the region."},
    {"set_header", lw_set_header, METH_VARARGS, "Store a header word."},
    {"region_bytes", lw_region_bytes, METH_VARARGS, "Bytes of a region for (slots, layers, experts)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_leasewords", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__leasewords(void) {
    PyObject *m = PyModule_Create(&module);
    if (m) PyModule_AddIntConstant(m, "HEADER", HEADER);
    return m;
}
