/*
 * Cache-bypassing batched reads of file ranges into a mapped region.
 *
 * open_file()  opens a file with O_DIRECT (Linux) or F_NOCACHE (macOS); when
 *              the filesystem refuses O_DIRECT it falls back to buffered reads
 *              followed by posix_fadvise(DONTNEED), and says so in the mode it
 *              returns.
 * Pool.read()  runs a batch of (fd, file_offset, length, region_offset[, mode])
 *              reads on a persistent pthread pool with the GIL released and
 *              returns (status, delivered, transferred, service_ns) per read.
 * advise()     WILLNEED / DONTNEED readahead advice (F_RDADVISE on macOS).
 *
 * Staging: a Pool may be given one staging buffer per thread (the caller
 * backs it with huge pages). A direct read longer than `stage_above` bytes
 * then lands in the thread's staging buffer and is copied to its place. Why:
 * the kernel builds one DMA segment per physically contiguous run of the
 * destination, a device caps segments per request (max_segments), and a
 * shared-memory slab on 4 KiB pages therefore splits a multi-MiB read into
 * several requests; a disk that serves requests one after another (virtio
 * behind a VMM) is faster with one large request. Counters say how many
 * reads and bytes were staged and how long the copies took.
 *
 * Linux AIO: a Pool made with aio=True keeps one kernel AIO context per
 * thread and runs a call's direct reads (those not staged) from the calling
 * thread: one io_submit for all of them and io_getevents until every one is
 * in (one wake-up for all of them), instead of one pool thread and one blocking
 * pread per range. A load of nine ranges then wakes the caller once, not nine
 * pool threads each sleeping in its own read; on a host whose cores also
 * compute, each wake-up is time taken from the computation. A read the
 * kernel returns short or failed is read again with pread (which reports end
 * of file and errors as the pool does), a range it refuses to queue is read
 * with pread at once, and a call that finds every context busy runs on the
 * threads; the counters say how often. Without io_setup (macOS, a refused
 * syscall) every read runs on the threads, and the pool says why (`aio`
 * attribute).
 *
 * Alignment contract (checked in every mode, so a layout that works buffered
 * also works direct): the region address is a multiple of the block size,
 * region_offset is congruent to file_offset modulo the block size, and the
 * range rounded out to whole blocks lies inside the region. Direct reads write
 * that whole rounded range (the slack holds neighbouring file bytes); other
 * modes write only the requested bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/aio_abi.h>
#include <linux/fs.h>
#include <sys/syscall.h>
#define HAVE_AIO 1
#else
#define HAVE_AIO 0
#endif

enum { MODE_DIRECT = 0, MODE_NOCACHE = 1, MODE_DONTNEED = 2, MODE_BUFFERED = 3, MODE_COUNT = 4 };
static const char *const MODE_NAMES[MODE_COUNT] = {"direct", "nocache", "dontneed", "buffered"};

/* A read that hit end of file before every requested byte arrived. */
#define STATUS_SHORT_READ (-1)
#define MIN_BLOCK 512
#define MAX_BLOCK (1 << 20)
/* Linux caps one read at 0x7ffff000 bytes; stay well below, block aligned. */
#define MAX_CHUNK ((int64_t)1 << 30)
/* Keep every offset far from int64 overflow when rounding. */
#define MAX_OFFSET ((int64_t)1 << 60)
#define DONTNEED_PAGE ((int64_t)4096)
/* Ranges one AIO context holds in flight; a call with more submits them in rounds. */
#define AIO_DEPTH 256

static int64_t round_down(int64_t value, int64_t block) { return value - value % block; }
static int64_t round_up(int64_t value, int64_t block) { return round_down(value + block - 1, block); }
static int is_valid_block(long long block) {
    return block >= MIN_BLOCK && block <= MAX_BLOCK && (block & (block - 1)) == 0;
}
static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ------------------------------------------------------------------ open */

static int set_nocache(int fd) {
#ifdef __APPLE__
    return fcntl(fd, F_NOCACHE, 1);
#else
    (void)fd;
    errno = ENOTSUP;
    return -1;
#endif
}

/* Some filesystems accept O_DIRECT at open and refuse it at the first read:
 * probe one block so the fallback happens here, not at the first load. */
static int probe_direct(int fd, long long block) {
    struct stat st;
    if (fstat(fd, &st) != 0) return errno;
    if (st.st_size == 0) return 0;
    void *buffer = NULL;
    if (posix_memalign(&buffer, (size_t)block, (size_t)block) != 0) return ENOMEM;
    int result = 0;
    for (;;) {
        ssize_t n = pread(fd, buffer, (size_t)block, 0);
        if (n >= 0) break;
        if (errno == EINTR) continue;
        result = errno;
        break;
    }
    free(buffer);
    return result;
}

static PyObject *bypass_open(PyObject *module, PyObject *args, PyObject *kwargs) {
    (void)module;
    static char *kwlist[] = {"path", "mode", "block_size", "refuse_direct", NULL};
    PyObject *path = NULL;
    const char *requested = "auto";
    long long block = 4096;
    int refuse_direct = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O&|sLp", kwlist, PyUnicode_FSConverter, &path,
                                     &requested, &block, &refuse_direct))
        return NULL;
    const char *name = PyBytes_AS_STRING(path);
    int want_bypass = strcmp(requested, "auto") == 0 || strcmp(requested, "direct") == 0;
    int strict = strcmp(requested, "direct") == 0;
    if (!want_bypass && strcmp(requested, "dontneed") != 0 && strcmp(requested, "buffered") != 0) {
        PyErr_Format(PyExc_ValueError, "mode must be auto, direct, dontneed or buffered, got '%s'", requested);
        Py_DECREF(path);
        return NULL;
    }
    if (!is_valid_block(block)) {
        PyErr_Format(PyExc_ValueError, "block_size must be a power of two in [%d, %d], got %lld",
                     MIN_BLOCK, MAX_BLOCK, block);
        Py_DECREF(path);
        return NULL;
    }
    int fd = -1, mode = strcmp(requested, "buffered") == 0 ? MODE_BUFFERED : MODE_DONTNEED;
    int error = 0, fallback_errno = 0;
    Py_BEGIN_ALLOW_THREADS
    if (want_bypass) {
#if defined(O_DIRECT)
        if (refuse_direct) {
            fd = -1;
            errno = EINVAL;
        } else {
            fd = open(name, O_RDONLY | O_CLOEXEC | O_DIRECT);
        }
        if (fd >= 0) {
            int probe = probe_direct(fd, block);
            if (probe == 0) {
                mode = MODE_DIRECT;
            } else {
                close(fd);
                fd = -1;
                errno = probe;
            }
        }
        if (fd < 0) {
            /* EINVAL is how Linux says "this filesystem does not do O_DIRECT". */
            if (errno != EINVAL || strict) error = errno;
            else fallback_errno = EINVAL;
        }
#elif defined(__APPLE__)
        fd = open(name, O_RDONLY | O_CLOEXEC);
        if (fd < 0) error = errno;
        else if (set_nocache(fd) == 0) mode = MODE_NOCACHE;
        else if (strict) { error = errno; close(fd); fd = -1; }
        else fallback_errno = errno;
#else
        if (strict) error = ENOTSUP;
        else fallback_errno = ENOTSUP;
#endif
    }
    if (fd < 0 && error == 0) {
        fd = open(name, O_RDONLY | O_CLOEXEC);
        if (fd < 0) error = errno;
    }
    Py_END_ALLOW_THREADS
    (void)set_nocache;
    (void)fallback_errno;
    if (error != 0) {
        errno = error;
        PyObject *path_str = PyUnicode_DecodeFSDefault(name);
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path_str);
        Py_XDECREF(path_str);
        Py_DECREF(path);
        return NULL;
    }
    Py_DECREF(path);
#if !defined(POSIX_FADV_DONTNEED)
    if (mode == MODE_DONTNEED) mode = MODE_BUFFERED; /* nothing to advise with: say so */
#endif
    return Py_BuildValue("(is)", fd, MODE_NAMES[mode]);
}

/* ---------------------------------------------------------------- advise */

static int advise_range(int fd, int64_t offset, int64_t length, int willneed) {
#if defined(POSIX_FADV_WILLNEED)
    return posix_fadvise(fd, (off_t)offset, (off_t)length,
                         willneed ? POSIX_FADV_WILLNEED : POSIX_FADV_DONTNEED);
#elif defined(__APPLE__)
    if (!willneed) return 0; /* macOS has no DONTNEED; F_NOCACHE already bypasses */
    while (length > 0) {
        int count = length > INT32_MAX ? INT32_MAX : (int)length;
        struct radvisory advice = {.ra_offset = (off_t)offset, .ra_count = count};
        if (fcntl(fd, F_RDADVISE, &advice) != 0) return errno;
        offset += count;
        length -= count;
    }
    return 0;
#else
    (void)fd; (void)offset; (void)length; (void)willneed;
    return 0;
#endif
}

static PyObject *bypass_advise(PyObject *module, PyObject *args, PyObject *kwargs) {
    (void)module;
    static char *kwlist[] = {"fd", "offset", "length", "advice", NULL};
    int fd;
    long long offset, length;
    const char *advice;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iLLs", kwlist, &fd, &offset, &length, &advice))
        return NULL;
    int willneed = strcmp(advice, "willneed") == 0;
    if (!willneed && strcmp(advice, "dontneed") != 0) {
        PyErr_Format(PyExc_ValueError, "advice must be willneed or dontneed, got '%s'", advice);
        return NULL;
    }
    if (offset < 0 || length < 0 || offset > MAX_OFFSET || length > MAX_OFFSET) {
        PyErr_Format(PyExc_ValueError, "advise range must be non-negative, got offset %lld length %lld",
                     offset, length);
        return NULL;
    }
    int error;
    Py_BEGIN_ALLOW_THREADS
    error = advise_range(fd, offset, length, willneed);
    Py_END_ALLOW_THREADS
    if (error != 0) {
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

/* ----------------------------------------------------------- block sizes */

static PyObject *bypass_block_sizes(PyObject *module, PyObject *arg) {
    (void)module;
    long fd_value = PyLong_AsLong(arg);
    if (fd_value == -1 && PyErr_Occurred()) return NULL;
    if (fd_value < 0 || fd_value > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "fd must be a file descriptor, got %ld", fd_value);
        return NULL;
    }
    int fd = (int)fd_value;
    struct stat st;
    struct statvfs vfs;
    if (fstat(fd, &st) != 0 || fstatvfs(fd, &vfs) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    long long device_logical = -1;
#if defined(BLKSSZGET)
    if (S_ISBLK(st.st_mode)) {
        int size = 0;
        if (ioctl(fd, BLKSSZGET, &size) == 0) device_logical = size;
    }
#endif
    return Py_BuildValue("{s:L,s:L,s:L,s:L}", "st_blksize", (long long)st.st_blksize, "f_bsize",
                         (long long)vfs.f_bsize, "f_frsize", (long long)vfs.f_frsize, "device_logical",
                         device_logical);
}

/* ------------------------------------------------------------------ pool */

struct batch;

typedef struct op {
    struct op *next;
    struct batch *batch;
    char *region;
    int64_t block, offset, length, dest;
    int fd, mode, status;
    int64_t delivered, transferred, ns;
    int64_t staged, copy_ns; /* bytes that went through staging, time spent copying them */
    int by_aio;              /* this call may submit it through kernel AIO (direct, not staged) */
    int settled;             /* an AIO op has its result */
    /* rounded range in region coordinates, for validation */
    int64_t astart, aend;
} op_t;

typedef struct batch {
    int remaining;
    pthread_cond_t done;
} batch_t;

struct pool_object;

typedef struct {
    struct pool_object *pool;
    char *stage; /* this thread's staging buffer, NULL without staging */
} worker_t;

typedef struct pool_object {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t work;
    op_t *head, *tail;
    pthread_t *threads;
    worker_t *workers;
    int nthreads;
    int closing;
    int joined;
    Py_buffer staging; /* held for the pool's life when staging is on */
    int has_staging;
    int64_t stage_stride, stage_above;
    /* guarded by mu */
    int64_t staged_ops, staged_bytes, copy_ns;
    /* Linux AIO (see the top): idle contexts, and what they did; guarded by mu */
    int aio_asked, aio_errno; /* errno of the io_setup that failed, 0 when aio runs or was not asked */
    int aio_round;            /* ranges submitted at once: the contexts' depth, at most AIO_DEPTH */
#if HAVE_AIO
    aio_context_t *contexts;
    int idle_contexts, ncontexts;
#endif
    int64_t aio_calls, aio_ranges, aio_reread, aio_refused, aio_busy;
} PoolObject;

static void run_op(op_t *op, char *stage, int64_t stride, int64_t stage_above) {
    int64_t started = now_ns();
    int64_t block = op->block;
    int aligned = op->mode == MODE_DIRECT;
    int64_t want_end = op->offset + op->length;
    int64_t start = aligned ? round_down(op->offset, block) : op->offset;
    int64_t end = aligned ? round_up(want_end, block) : want_end;
    /* Region address that corresponds to file position `start`. */
    char *base = op->region + (op->dest - (op->offset - start));
    int64_t pos = start, transferred = 0, staged = 0, copy_ns = 0;
    int status = 0;
    int staging = stage != NULL && aligned && end - start > stage_above;
    int64_t limit = staging ? stride : MAX_CHUNK;
    while (pos < want_end) {
        /* O_DIRECT needs every read to start on a block boundary, so after a
         * short read we re-read from the block that holds `pos`. */
        int64_t from = aligned ? round_down(pos, block) : pos;
        int64_t count = end - from;
        if (count > limit) count = limit;
        ssize_t n = pread(op->fd, staging ? stage : base + (from - start), (size_t)count, (off_t)from);
        if (n < 0) {
            if (errno == EINTR) continue;
            status = errno;
            break;
        }
        if (n == 0 || from + n <= pos) {
            status = STATUS_SHORT_READ;
            break;
        }
        if (staging) {
            /* The same bytes a direct read would have written, slack included. */
            int64_t copy_started = now_ns();
            memcpy(base + (from - start), stage, (size_t)n);
            copy_ns += now_ns() - copy_started;
            staged += n;
        }
        transferred += n;
        pos = from + n;
    }
#if defined(POSIX_FADV_DONTNEED)
    /* The kernel drops only whole pages inside the range: round outward so
     * the partial pages at either end do not stay cached. */
    if (op->mode == MODE_DONTNEED) {
        int64_t first = round_down(start, DONTNEED_PAGE), last = round_up(end, DONTNEED_PAGE);
        posix_fadvise(op->fd, (off_t)first, (off_t)(last - first), POSIX_FADV_DONTNEED);
    }
#endif
    int64_t got = pos - op->offset;
    op->delivered = status == 0 ? op->length : (got < 0 ? 0 : (got > op->length ? op->length : got));
    op->status = status;
    op->transferred = transferred;
    op->staged = staged;
    op->copy_ns = copy_ns;
    op->ns = now_ns() - started;
}

#if HAVE_AIO
/* The rounded range of a direct op: its file start and length, and where in the region it lands. */
static int64_t direct_range(const op_t *op, int64_t *start, char **base) {
    *start = round_down(op->offset, op->block);
    *base = op->region + (op->dest - (op->offset - *start));
    return round_up(op->offset + op->length, op->block) - *start;
}

/* The kernel's answer for one range: in full (end of file may cut the rounded tail, never a
 * requested byte), else read again with pread, which says what went wrong. */
static void aio_settle(op_t *op, int64_t res, int64_t *reread) {
    int64_t start;
    char *base;
    direct_range(op, &start, &base);
    op->settled = 1;
    if (res >= 0 && start + res >= op->offset + op->length) {
        op->status = 0;
        op->delivered = op->length;
        op->transferred = res;
        op->ns = now_ns() - op->ns;
        return;
    }
    run_op(op, NULL, 0, 0);
    (*reread)++;
}

/* Run `n` direct ops through one AIO context from this thread; every op has its result on return
 * and no read is in flight. Returns 0, or -1 when the context had to be destroyed (not reusable). */
static int aio_run(aio_context_t ctx, int depth, op_t **ops, Py_ssize_t n, int64_t *reread, int64_t *refused) {
    struct iocb cbs[AIO_DEPTH], *queue[AIO_DEPTH];
    struct io_event events[AIO_DEPTH];
    for (Py_ssize_t round = 0; round < n; round += depth) {
        int count = (int)(n - round < depth ? n - round : depth);
        for (int i = 0; i < count; i++) {
            op_t *op = ops[round + i];
            int64_t start;
            char *base;
            int64_t length = direct_range(op, &start, &base);
            memset(&cbs[i], 0, sizeof(cbs[i]));
            cbs[i].aio_data = (uint64_t)(uintptr_t)op;
            cbs[i].aio_lio_opcode = IOCB_CMD_PREAD;
            cbs[i].aio_fildes = (uint32_t)op->fd;
            cbs[i].aio_buf = (uint64_t)(uintptr_t)base;
            cbs[i].aio_nbytes = (uint64_t)length;
            cbs[i].aio_offset = start;
            queue[i] = &cbs[i];
            op->ns = now_ns(); /* submit time until settled */
        }
        int pending = 0;
        for (int next = 0; next < count;) {
            long queued = syscall(SYS_io_submit, ctx, (long)(count - next), queue + next);
            if (queued > 0) {
                next += (int)queued;
                pending += (int)queued;
            } else if (queued < 0 && errno == EINTR) {
                continue;
            } else { /* the kernel would not queue this range (e.g. EAGAIN): read it here */
                op_t *op = (op_t *)(uintptr_t)queue[next]->aio_data;
                run_op(op, NULL, 0, 0);
                op->settled = 1;
                (*refused)++;
                next++;
            }
        }
        while (pending > 0) {
            /* min_nr = every range still pending: since Linux 6.7 the kernel wakes the waiter only
             * once that many are in (before, at each completion: the same result, more wake-ups).
             * With min_nr 1 a load of nine ranges woke this thread about once per range. */
            long got = syscall(SYS_io_getevents, ctx, (long)pending, (long)pending, events, NULL);
            if (got < 0 && errno == EINTR) continue;
            if (got < 0) {
                /* Cannot happen with a context of ours; if it does, io_destroy waits for what is in
                 * flight, so no read writes the region after we return, and pread reads it again. */
                syscall(SYS_io_destroy, ctx);
                for (int i = 0; i < count; i++)
                    if (!ops[round + i]->settled) aio_settle(ops[round + i], -1, reread);
                for (Py_ssize_t rest = round + count; rest < n; rest++) run_op(ops[rest], NULL, 0, 0);
                return -1;
            }
            for (long i = 0; i < got; i++) aio_settle((op_t *)(uintptr_t)events[i].data, events[i].res, reread);
            pending -= (int)got;
        }
    }
    return 0;
}
#endif

static void *pool_main(void *arg) {
    worker_t *worker = (worker_t *)arg;
    PoolObject *pool = worker->pool;
    pthread_mutex_lock(&pool->mu);
    for (;;) {
        while (pool->head == NULL && !pool->closing) pthread_cond_wait(&pool->work, &pool->mu);
        op_t *op = pool->head;
        if (op == NULL) break; /* closing and drained */
        pool->head = op->next;
        if (pool->head == NULL) pool->tail = NULL;
        pthread_mutex_unlock(&pool->mu);
        run_op(op, worker->stage, pool->stage_stride, pool->stage_above);
        pthread_mutex_lock(&pool->mu);
        if (op->staged > 0) {
            pool->staged_ops++;
            pool->staged_bytes += op->staged;
            pool->copy_ns += op->copy_ns;
        }
        batch_t *batch = op->batch; /* op may be freed once remaining hits 0 */
        if (--batch->remaining == 0) pthread_cond_signal(&batch->done);
    }
    pthread_mutex_unlock(&pool->mu);
    return NULL;
}

static void pool_shutdown(PoolObject *pool) {
    if (pool->threads == NULL || pool->joined) return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&pool->mu);
    pool->closing = 1;
    pthread_cond_broadcast(&pool->work);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 0; i < pool->nthreads; i++) pthread_join(pool->threads[i], NULL);
    Py_END_ALLOW_THREADS
    pool->joined = 1;
}

/* Take the staging buffer: `threads` strides of `stride` bytes, each aligned
 * for O_DIRECT at MAX_BLOCK. */
static int take_staging(PoolObject *self, PyObject *staging, int threads, long long stride, long long above) {
    if (stride < MAX_BLOCK || stride % MAX_BLOCK != 0 || stride > MAX_CHUNK) {
        PyErr_Format(PyExc_ValueError, "stage_stride must be a positive multiple of %d up to %lld, got %lld",
                     MAX_BLOCK, (long long)MAX_CHUNK, stride);
        return -1;
    }
    if (above < 0) {
        PyErr_Format(PyExc_ValueError, "stage_above must be >= 0, got %lld", above);
        return -1;
    }
    if (PyObject_GetBuffer(staging, &self->staging, PyBUF_WRITABLE) != 0) return -1;
    if ((uintptr_t)self->staging.buf % MAX_BLOCK != 0 || self->staging.len < (Py_ssize_t)threads * stride) {
        PyErr_Format(PyExc_ValueError,
                     "staging must be %d-byte aligned and hold %d x %lld bytes, got %zd bytes at %p", MAX_BLOCK,
                     threads, stride, self->staging.len, self->staging.buf);
        PyBuffer_Release(&self->staging);
        return -1;
    }
    self->has_staging = 1;
    self->stage_stride = stride;
    self->stage_above = above;
    return 0;
}

/* One AIO context per pool thread (a reader per thread calls read); aio_errno says why not. */
static void setup_aio(PoolObject *self, int contexts, int depth) {
    self->aio_asked = 1;
#if HAVE_AIO
    self->contexts = calloc((size_t)contexts, sizeof(aio_context_t));
    if (self->contexts == NULL) {
        self->aio_errno = ENOMEM;
        return;
    }
    for (int i = 0; i < contexts; i++) {
        if (syscall(SYS_io_setup, (long)depth, &self->contexts[i]) != 0) {
            self->aio_errno = errno;
            for (int j = 0; j < i; j++) syscall(SYS_io_destroy, self->contexts[j]);
            free(self->contexts);
            self->contexts = NULL;
            return;
        }
    }
    self->ncontexts = self->idle_contexts = contexts;
    self->aio_round = depth < AIO_DEPTH ? depth : AIO_DEPTH;
#else
    (void)contexts, (void)depth;
    self->aio_errno = ENOSYS;
#endif
}

static void teardown_aio(PoolObject *self) {
#if HAVE_AIO
    for (int i = 0; i < self->idle_contexts; i++) syscall(SYS_io_destroy, self->contexts[i]);
    free(self->contexts);
    self->contexts = NULL;
    self->ncontexts = self->idle_contexts = 0;
#else
    (void)self;
#endif
}

static int Pool_init(PoolObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"threads", "staging", "stage_stride", "stage_above", "aio", "aio_depth", NULL};
    int threads = 4, aio = 0, aio_depth = AIO_DEPTH;
    PyObject *staging = Py_None;
    long long stride = 0, above = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|iOLLpi", kwlist, &threads, &staging, &stride, &above, &aio,
                                     &aio_depth))
        return -1;
    if (aio_depth < 1) {
        PyErr_Format(PyExc_ValueError, "aio_depth must be >= 1, got %d", aio_depth);
        return -1;
    }
    if (self->threads != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Pool is already initialised");
        return -1;
    }
    if (threads < 1 || threads > 1024) {
        PyErr_Format(PyExc_ValueError, "threads must be in [1, 1024], got %d", threads);
        return -1;
    }
    if (staging != Py_None && take_staging(self, staging, threads, stride, above) != 0) return -1;
    self->threads = calloc((size_t)threads, sizeof(pthread_t));
    self->workers = calloc((size_t)threads, sizeof(worker_t));
    if (self->threads == NULL || self->workers == NULL) {
        free(self->threads);
        free(self->workers);
        self->threads = NULL;
        self->workers = NULL;
        if (self->has_staging) PyBuffer_Release(&self->staging);
        self->has_staging = 0;
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < threads; i++) {
        self->workers[i].pool = self;
        self->workers[i].stage = self->has_staging ? (char *)self->staging.buf + (int64_t)i * stride : NULL;
    }
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->work, NULL);
    /* Pool threads block every signal so Python's main thread receives them
     * (and its poll is the one interrupted). */
    sigset_t all, previous;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &previous);
    int error = 0;
    for (int i = 0; i < threads; i++) {
        error = pthread_create(&self->threads[i], NULL, pool_main, &self->workers[i]);
        if (error != 0) break;
        self->nthreads = i + 1;
    }
    pthread_sigmask(SIG_SETMASK, &previous, NULL);
    if (error != 0) {
        pool_shutdown(self);
        errno = error;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (aio) setup_aio(self, threads, aio_depth);
    return 0;
}

static void Pool_dealloc(PoolObject *self) {
    if (self->threads != NULL) {
        pool_shutdown(self);
        pthread_cond_destroy(&self->work);
        pthread_mutex_destroy(&self->mu);
        free(self->threads);
        free(self->workers);
    }
    teardown_aio(self); /* no read is in flight: every read returns with its ranges in */
    /* After the join: no thread reads the staging buffer any more. */
    if (self->has_staging) PyBuffer_Release(&self->staging);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int parse_i64(PyObject *item, Py_ssize_t index, const char *name, int64_t *out) {
    long long value = PyLong_AsLongLong(item);
    if (value == -1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "op %zd: %s must be an integer, got %R", index, name, item);
        return -1;
    }
    if (value < 0 || value > MAX_OFFSET) {
        PyErr_Format(PyExc_ValueError, "op %zd: %s must be in [0, 2**60], got %lld", index, name, value);
        return -1;
    }
    *out = value;
    return 0;
}

static int parse_op(PyObject *item, Py_ssize_t index, op_t *op) {
    PyObject *fast = PySequence_Fast(item, "op must be a sequence");
    if (fast == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **fields = PySequence_Fast_ITEMS(fast);
    int64_t fd = 0, mode = -1;
    int rc = -1;
    if (n != 4 && n != 5) {
        PyErr_Format(PyExc_ValueError, "op %zd must be (fd, file_offset, length, region_offset[, mode]), got %R",
                     index, item);
        goto done;
    }
    if (parse_i64(fields[0], index, "fd", &fd) || parse_i64(fields[1], index, "file_offset", &op->offset) ||
        parse_i64(fields[2], index, "length", &op->length) ||
        parse_i64(fields[3], index, "region_offset", &op->dest))
        goto done;
    if (fd > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "op %zd: fd %lld is not a file descriptor", index, (long long)fd);
        goto done;
    }
    op->fd = (int)fd;
    if (n == 5) {
        if (parse_i64(fields[4], index, "mode", &mode)) goto done;
        if (mode >= MODE_COUNT) {
            PyErr_Format(PyExc_ValueError, "op %zd: mode must be in [0, %d), got %lld", index, MODE_COUNT,
                         (long long)mode);
            goto done;
        }
        op->mode = (int)mode;
    } else {
#if defined(O_DIRECT)
        int flags = fcntl(op->fd, F_GETFL);
        op->mode = flags >= 0 && (flags & O_DIRECT) ? MODE_DIRECT : MODE_BUFFERED;
#else
        op->mode = MODE_BUFFERED;
#endif
    }
    rc = 0;
done:
    Py_DECREF(fast);
    return rc;
}

static int compare_astart(const void *left, const void *right) {
    const op_t *a = *(op_t *const *)left, *b = *(op_t *const *)right;
    return a->astart < b->astart ? -1 : a->astart > b->astart;
}

/* A rounded read may write only slack, never bytes another op was asked to
 * deliver, unless both map the same file bytes to the same place. */
static int check_overlaps(op_t *ops, Py_ssize_t n) {
    op_t **order = malloc((size_t)n * sizeof(op_t *));
    if (order == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) order[i] = &ops[i];
    qsort(order, (size_t)n, sizeof(op_t *), compare_astart);
    int rc = 0;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        op_t *a = order[i];
        if (a->length == 0) continue;
        for (Py_ssize_t j = i + 1; j < n && order[j]->astart < a->aend; j++) {
            op_t *b = order[j];
            if (b->length == 0) continue;
            int same_mapping = a->fd == b->fd && a->dest - a->offset == b->dest - b->offset;
            int requested = a->dest < b->dest + b->length && b->dest < a->dest + a->length;
            int a_hits_b = a->astart < b->dest + b->length && b->dest < a->aend;
            int b_hits_a = b->astart < a->dest + a->length && a->dest < b->aend;
            if ((requested && !same_mapping) || (!same_mapping && (a_hits_b || b_hits_a))) {
                PyErr_Format(PyExc_ValueError,
                             "ops %zd and %zd overlap in the region: [%lld, %lld) rounded to [%lld, %lld) and "
                             "[%lld, %lld) rounded to [%lld, %lld) with block size %lld",
                             a - ops, b - ops, (long long)a->dest, (long long)(a->dest + a->length),
                             (long long)a->astart, (long long)a->aend, (long long)b->dest,
                             (long long)(b->dest + b->length), (long long)b->astart, (long long)b->aend,
                             (long long)a->block);
                rc = -1;
                break;
            }
        }
    }
    free(order);
    return rc;
}

static PyObject *Pool_read(PoolObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"region", "ops", "block_size", NULL};
    PyObject *region, *ops_obj;
    long long block = 4096;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO|L", kwlist, &region, &ops_obj, &block)) return NULL;
    if (!is_valid_block(block)) {
        PyErr_Format(PyExc_ValueError, "block_size must be a power of two in [%d, %d], got %lld", MIN_BLOCK,
                     MAX_BLOCK, block);
        return NULL;
    }
    if (self->threads == NULL || self->closing) {
        PyErr_SetString(PyExc_ValueError, "read on a closed Pool");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(ops_obj, "ops must be a sequence of tuples");
    if (seq == NULL) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(region, &view, PyBUF_WRITABLE) != 0) {
        Py_DECREF(seq);
        return NULL;
    }
    PyObject *result = NULL;
    op_t *ops = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if ((uintptr_t)view.buf % (uintptr_t)block != 0) {
        PyErr_Format(PyExc_ValueError, "region address %p is not aligned to the block size %lld", view.buf, block);
        goto done;
    }
    ops = calloc(n > 0 ? (size_t)n : 1, sizeof(op_t));
    if (ops == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    batch_t batch = {.remaining = 0};
    Py_ssize_t queued = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        op_t *op = &ops[i];
        if (parse_op(PySequence_Fast_GET_ITEM(seq, i), i, op) != 0) goto done;
        op->region = view.buf;
        op->block = block;
        op->batch = &batch;
        if (op->offset % block != op->dest % block) {
            PyErr_Format(PyExc_ValueError,
                         "op %zd: region_offset %lld is not congruent to file_offset %lld modulo the block "
                         "size %lld",
                         i, (long long)op->dest, (long long)op->offset, block);
            goto done;
        }
        op->astart = op->dest - op->offset % block;
        op->aend = op->astart + (round_up(op->offset + op->length, block) - round_down(op->offset, block));
        if (op->astart < 0 || op->aend > (int64_t)view.len) {
            PyErr_Format(PyExc_ValueError,
                         "op %zd: region range [%lld, %lld) (rounded to the block size %lld from "
                         "region_offset %lld length %lld) is outside the region of %zd bytes",
                         i, (long long)op->astart, (long long)op->aend, block, (long long)op->dest,
                         (long long)op->length, view.len);
            goto done;
        }
        if (op->length > 0) queued++;
    }
    if (check_overlaps(ops, n) != 0) goto done;
    if (queued > 0) {
        int closed = 0;
        op_t **direct = calloc((size_t)queued, sizeof(op_t *));
        if (direct == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        /* The ranges kernel AIO may take: direct, not staged (staging needs a pool thread's buffer). */
        Py_ssize_t ndirect = 0;
        for (Py_ssize_t i = 0; i < n && HAVE_AIO && self->aio_round > 0; i++) {
            op_t *op = &ops[i];
            int staged = self->has_staging &&
                         round_up(op->offset + op->length, block) - round_down(op->offset, block) > self->stage_above;
            if (op->length > 0 && op->mode == MODE_DIRECT && !staged) {
                op->by_aio = 1; /* through AIO, unless no context is idle */
                direct[ndirect++] = op;
            }
        }
        pthread_cond_init(&batch.done, NULL);
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&self->mu);
        if (self->closing) {
            closed = 1;
        } else {
#if HAVE_AIO
            int64_t reread = 0, refused = 0;
            aio_context_t ctx = 0;
            if (ndirect > 0 && self->idle_contexts > 0) ctx = self->contexts[--self->idle_contexts];
            else if (ndirect > 0) self->aio_busy++; /* more callers than contexts: on the threads */
#endif
            for (Py_ssize_t i = 0; i < n; i++) {
                op_t *op = &ops[i];
                if (op->length == 0) continue;
#if HAVE_AIO
                if (ctx != 0 && op->by_aio) continue;
#endif
                batch.remaining++;
                op->next = NULL;
                if (self->tail) self->tail->next = op;
                else self->head = op;
                self->tail = op;
            }
            if (batch.remaining > 0) pthread_cond_broadcast(&self->work);
#if HAVE_AIO
            if (ctx != 0) {
                pthread_mutex_unlock(&self->mu);
                int reusable = aio_run(ctx, self->aio_round, direct, ndirect, &reread, &refused) == 0;
                pthread_mutex_lock(&self->mu);
                if (reusable) self->contexts[self->idle_contexts++] = ctx;
                else if (--self->ncontexts == 0) self->aio_round = 0; /* the last one: threads from now on */
                self->aio_calls++;
                self->aio_ranges += ndirect;
                self->aio_reread += reread;
                self->aio_refused += refused;
            }
#endif
            (void)ndirect;
            while (batch.remaining > 0) pthread_cond_wait(&batch.done, &self->mu);
        }
        pthread_mutex_unlock(&self->mu);
        Py_END_ALLOW_THREADS
        pthread_cond_destroy(&batch.done);
        free(direct);
        if (closed) {
            PyErr_SetString(PyExc_ValueError, "read on a closed Pool");
            goto done;
        }
    }
    result = PyList_New(n);
    if (result == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *entry = Py_BuildValue("(iLLL)", ops[i].status, (long long)ops[i].delivered,
                                        (long long)ops[i].transferred, (long long)ops[i].ns);
        if (entry == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, entry);
    }
done:
    free(ops);
    PyBuffer_Release(&view);
    Py_DECREF(seq);
    return result;
}

static PyObject *Pool_close(PoolObject *self, PyObject *unused) {
    (void)unused;
    pool_shutdown(self);
    Py_RETURN_NONE;
}

static PyObject *Pool_get_threads(PoolObject *self, void *closure) {
    (void)closure;
    return PyLong_FromLong(self->nthreads);
}

static PyObject *Pool_get_closed(PoolObject *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(self->threads == NULL || self->closing);
}

static PyMethodDef Pool_methods[] = {
    {"read", (PyCFunction)(void (*)(void))Pool_read, METH_VARARGS | METH_KEYWORDS,
     "read(region, ops, block_size=4096) -> list[(status, delivered, transferred, service_ns)]\n\n"
     "Run every op (fd, file_offset, length, region_offset[, mode]) on the pool with the GIL released.\n"
     "status is 0, an errno, or -1 for end of file before the requested bytes."},
    {"close", (PyCFunction)Pool_close, METH_NOARGS, "Finish queued reads and join the threads."},
    {NULL, NULL, 0, NULL},
};

static PyObject *Pool_get_staging(PoolObject *self, void *closure) {
    (void)closure;
    pthread_mutex_t *mu = &self->mu;
    long long ops = 0, bytes = 0, ns = 0;
    if (self->threads != NULL) {
        pthread_mutex_lock(mu);
        ops = self->staged_ops, bytes = self->staged_bytes, ns = self->copy_ns;
        pthread_mutex_unlock(mu);
    }
    return Py_BuildValue("(iLLLLL)", self->has_staging, (long long)self->stage_stride,
                         (long long)self->stage_above, ops, bytes, ns);
}

static PyObject *Pool_get_aio(PoolObject *self, void *closure) {
    (void)closure;
    long long counts[5] = {0, 0, 0, 0, 0};
    int contexts = 0;
    if (self->threads != NULL) {
        pthread_mutex_lock(&self->mu);
#if HAVE_AIO
        contexts = self->ncontexts;
#endif
        counts[0] = self->aio_calls, counts[1] = self->aio_ranges, counts[2] = self->aio_reread;
        counts[3] = self->aio_refused, counts[4] = self->aio_busy;
        pthread_mutex_unlock(&self->mu);
    }
    return Py_BuildValue("(iiiLLLLL)", self->aio_asked, self->aio_errno, contexts, counts[0], counts[1], counts[2],
                         counts[3], counts[4]);
}

static PyGetSetDef Pool_getset[] = {
    {"aio", (getter)Pool_get_aio, NULL,
     "(asked, setup_errno, contexts, calls, ranges, reread, refused, busy): the Linux AIO path", NULL},
    {"staging", (getter)Pool_get_staging, NULL,
     "(enabled, stage_stride, stage_above, staged_ops, staged_bytes, copy_ns)", NULL},
    {"threads", (getter)Pool_get_threads, NULL, "number of pool threads", NULL},
    {"closed", (getter)Pool_get_closed, NULL, "whether close() was called", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "native._bypassio.Pool",
    .tp_basicsize = sizeof(PoolObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pool(threads=4, staging=None, stage_stride=0, stage_above=0, aio=False, aio_depth=256): persistent\n"
              "pthread pool for batched positional reads; with `staging` (threads x stage_stride writable bytes)\n"
              "direct reads longer than stage_above go through the thread's staging stride and are copied into\n"
              "place; with `aio` (Linux) the other direct reads are submitted from the caller's thread.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = Pool_methods,
    .tp_getset = Pool_getset,
};

/* ---------------------------------------------------------------- module */

static PyMethodDef module_methods[] = {
    {"open_file", (PyCFunction)(void (*)(void))bypass_open, METH_VARARGS | METH_KEYWORDS,
     "open_file(path, mode='auto', block_size=4096, refuse_direct=False) -> (fd, mode_used)"},
    {"advise", (PyCFunction)(void (*)(void))bypass_advise, METH_VARARGS | METH_KEYWORDS,
     "advise(fd, offset, length, advice) with advice 'willneed' or 'dontneed'"},
    {"block_sizes", (PyCFunction)bypass_block_sizes, METH_O,
     "block_sizes(fd) -> {st_blksize, f_bsize, f_frsize, device_logical}"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "native._bypassio", "Cache-bypassing batched reads into a mapped region.", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__bypassio(void) {
    if (PyType_Ready(&PoolType) < 0) return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    Py_INCREF(&PoolType);
    if (PyModule_AddObject(module, "Pool", (PyObject *)&PoolType) < 0) {
        Py_DECREF(&PoolType);
        Py_DECREF(module);
        return NULL;
    }
    PyObject *modes = Py_BuildValue("(ssss)", MODE_NAMES[0], MODE_NAMES[1], MODE_NAMES[2], MODE_NAMES[3]);
    if (modes == NULL || PyModule_AddObject(module, "MODES", modes) < 0 ||
        PyModule_AddIntConstant(module, "STATUS_SHORT_READ", STATUS_SHORT_READ) < 0 ||
        PyModule_AddIntConstant(module, "MIN_BLOCK", MIN_BLOCK) < 0 ||
        PyModule_AddIntConstant(module, "MAX_BLOCK", MAX_BLOCK) < 0 ||
        PyModule_AddIntConstant(module, "HAVE_AIO", HAVE_AIO) < 0 ||
#if defined(O_DIRECT)
        PyModule_AddIntConstant(module, "HAVE_O_DIRECT", 1) < 0
#else
        PyModule_AddIntConstant(module, "HAVE_O_DIRECT", 0) < 0
#endif
    ) {
        Py_XDECREF(modes);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
