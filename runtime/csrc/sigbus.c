/* ggufswap.runtime._sigbus: a SIGBUS guard for shard files served from private mappings.
 *
 * A mapped file that shrinks under its mapping (open(O_RDONLY|O_TRUNC) truncates a file without
 * breaking a read lease) turns every access past its new end into SIGBUS, whose default action
 * kills the process; Python cannot handle it (its handlers run later, in the main thread, and the
 * faulting instruction would fault again). This handler, for an address inside a registered
 * mapping, replaces the pages past the file's current end with anonymous zero pages (one mmap
 * MAP_FIXED), counts the fault on the mapping, and returns: the access is retried and reads
 * zeros. The runtime's lease watcher sees the count (or the size) and takes the file's tensors
 * out of service; nothing is served from those zeros (runtime/mapping.py).
 *
 * Any other SIGBUS goes to the handler that was installed before (faulthandler's, a host's), or
 * to the default action. The handler uses only async-signal-safe calls (fstat, mmap, sigaction,
 * raise) and atomics; the table of ranges is written under the GIL and read lock-free.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_RANGES 65536

typedef struct {
    _Atomic uintptr_t start; /* 0: a free entry */
    _Atomic size_t length;
    _Atomic int fd;
    _Atomic long faults;
} range_t;

static range_t ranges[MAX_RANGES];
static _Atomic size_t used = 0; /* entries [0, used) may be in use */
static struct sigaction previous;
static int installed = 0;
static long page_size = 4096;

static void chain(int signum, siginfo_t *info, void *context) {
    if (previous.sa_flags & SA_SIGINFO) {
        if (previous.sa_sigaction != NULL) {
            previous.sa_sigaction(signum, info, context);
            return;
        }
    } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(signum);
        return;
    }
    /* The default action: restore it; a fault recurs when this returns, a sent signal is sent
     * again, and either ends the process as it would have without this guard. */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(SIGBUS, &dfl, NULL);
    if (info == NULL || info->si_code <= 0) {
        raise(signum);
    }
}

static void on_sigbus(int signum, siginfo_t *info, void *context) {
    if (info != NULL && info->si_code > 0) { /* a fault, not a signal someone sent */
        uintptr_t address = (uintptr_t)info->si_addr;
        size_t n = atomic_load(&used);
        for (size_t i = 0; i < n; i++) {
            uintptr_t start = atomic_load(&ranges[i].start);
            size_t length = atomic_load(&ranges[i].length);
            if (start == 0 || address < start || address >= start + length) {
                continue;
            }
            struct stat st;
            uintptr_t size = 0;
            if (fstat(atomic_load(&ranges[i].fd), &st) == 0 && st.st_size > 0) {
                size = (uintptr_t)st.st_size;
            }
            uintptr_t mask = ~((uintptr_t)page_size - 1);
            uintptr_t from = (start + size + (uintptr_t)page_size - 1) & mask;
            if (from > (address & mask)) {
                from = address & mask;
            }
            uintptr_t end = (start + length + (uintptr_t)page_size - 1) & mask;
            void *done = mmap((void *)from, end - from, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            if (done != MAP_FAILED) {
                atomic_fetch_add(&ranges[i].faults, 1);
                return;
            }
            break;
        }
    }
    chain(signum, info, context);
}

static PyObject *guard_install(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    struct sigaction current;
    if (sigaction(SIGBUS, NULL, &current) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigbus) {
        Py_RETURN_FALSE; /* ours, and first in line */
    }
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    /* Whoever was installed (again) after us is chained from now on. */
    if (sigaction(SIGBUS, &action, &previous) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    installed = 1;
    Py_RETURN_TRUE;
}

static PyObject *guard_register(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long start, length;
    int fd;
    if (!PyArg_ParseTuple(args, "KKi", &start, &length, &fd)) {
        return NULL;
    }
    if (start == 0 || length == 0) {
        PyErr_SetString(PyExc_ValueError, "a guarded range needs a start and a length");
        return NULL;
    }
    size_t n = atomic_load(&used);
    for (size_t i = 0; i <= n && i < MAX_RANGES; i++) {
        if (atomic_load(&ranges[i].start) != 0) {
            continue;
        }
        atomic_store(&ranges[i].length, (size_t)length);
        atomic_store(&ranges[i].fd, fd);
        atomic_store(&ranges[i].faults, 0);
        atomic_store(&ranges[i].start, (uintptr_t)start); /* published last */
        if (i == n) {
            atomic_store(&used, n + 1);
        }
        return PyLong_FromSize_t(i);
    }
    PyErr_Format(PyExc_OSError, "the SIGBUS guard holds at most %d mapped files", MAX_RANGES);
    return NULL;
}

static int entry_of(PyObject *args, size_t *entry) {
    Py_ssize_t i;
    if (!PyArg_ParseTuple(args, "n", &i)) {
        return -1;
    }
    if (i < 0 || (size_t)i >= atomic_load(&used)) {
        PyErr_Format(PyExc_ValueError, "no guarded range %zd", i);
        return -1;
    }
    *entry = (size_t)i;
    return 0;
}

static PyObject *guard_unregister(PyObject *self, PyObject *args) {
    (void)self;
    size_t i;
    if (entry_of(args, &i) != 0) {
        return NULL;
    }
    atomic_store(&ranges[i].start, 0);
    Py_RETURN_NONE;
}

static PyObject *guard_faults(PyObject *self, PyObject *args) {
    (void)self;
    size_t i;
    if (entry_of(args, &i) != 0) {
        return NULL;
    }
    return PyLong_FromLong(atomic_load(&ranges[i].faults));
}

static PyObject *guard_suspects(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    /* Before every batch: the entries whose file is now shorter than its mapping, or that
     * absorbed a fault. One fstat per guarded file, without the GIL's Python work. */
    PyObject *found = PyList_New(0);
    if (found == NULL) {
        return NULL;
    }
    size_t n = atomic_load(&used);
    for (size_t i = 0; i < n; i++) {
        if (atomic_load(&ranges[i].start) == 0) {
            continue;
        }
        struct stat st;
        int shrank = fstat(atomic_load(&ranges[i].fd), &st) == 0 &&
                     (uintptr_t)st.st_size < atomic_load(&ranges[i].length);
        if (!shrank && atomic_load(&ranges[i].faults) == 0) {
            continue;
        }
        PyObject *entry = PyLong_FromSize_t(i);
        if (entry == NULL || PyList_Append(found, entry) != 0) {
            Py_XDECREF(entry);
            Py_DECREF(found);
            return NULL;
        }
        Py_DECREF(entry);
    }
    return found;
}

static PyObject *guard_is_installed(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    struct sigaction current;
    if (sigaction(SIGBUS, NULL, &current) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(installed && (current.sa_flags & SA_SIGINFO) &&
                           current.sa_sigaction == on_sigbus);
}

static PyMethodDef methods[] = {
    {"install", guard_install, METH_NOARGS,
     "Install the handler (again, first in line, if another was installed after it); "
     "True if it was not the current handler."},
    {"is_installed", guard_is_installed, METH_NOARGS, "Whether the handler is the current one."},
    {"register", guard_register, METH_VARARGS,
     "register(start, length, fd) -> entry: guard a mapping of the file open as fd."},
    {"unregister", guard_unregister, METH_VARARGS, "unregister(entry): stop guarding a range."},
    {"suspects", guard_suspects, METH_NOARGS,
     "suspects() -> the entries whose file shrank under the mapping or that absorbed a fault."},
    {"faults", guard_faults, METH_VARARGS,
     "faults(entry) -> the faults absorbed in the range (pages past the file's end)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sigbus", "A SIGBUS guard for mapped shard files.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__sigbus(void) {
    long size = sysconf(_SC_PAGESIZE);
    if (size > 0) {
        page_size = size;
    }
    return PyModule_Create(&module);
}
