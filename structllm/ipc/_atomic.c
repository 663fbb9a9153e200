/* Memory ordering for the shared-memory rings, in one place.
 *
 * A ring's producer writes a frame, then publishes the new tail; its consumer reads
 * the tail, then the frame. The tail store must not become visible before the frame's
 * bytes (release), and the frame's bytes must not be read before the tail (acquire);
 * the same holds for the head in the other direction. On x86-64 (TSO) plain aligned
 * 8-byte moves already have these semantics and the builtins below compile to MOV; on
 * aarch64 (e.g. Grace Hopper) they compile to STLR / LDAR, which a plain store from
 * Python (memoryview) would not give.
 *
 * fence() is a full (sequentially consistent) barrier for the sleep/wake handshake:
 * "I store my sleeping flag, then load the ring's counter" against "I store the
 * counter, then load the sleeping flag" (Dekker's pattern) needs StoreLoad ordering,
 * which even x86 does not give without MFENCE or a locked instruction.
 *
 * Addresses are raw integers (the ring computes them once from its mapping); each must
 * be 8-byte aligned and stay mapped while used.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static int get_addr(PyObject *o, uint64_t **out) {
    unsigned long long a = PyLong_AsUnsignedLongLong(o);
    if (a == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (a & 7) {
        PyErr_SetString(PyExc_ValueError, "address is not 8-byte aligned");
        return -1;
    }
    *out = (uint64_t *)(uintptr_t)a;
    return 0;
}

static PyObject *load_acquire(PyObject *self, PyObject *arg) {
    uint64_t *p;
    if (get_addr(arg, &p)) return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(p, __ATOMIC_ACQUIRE));
}

static PyObject *store_release(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t *p;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "store_release(address, value)");
        return NULL;
    }
    if (get_addr(args[0], &p)) return NULL;
    unsigned long long v = PyLong_AsUnsignedLongLong(args[1]);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    __atomic_store_n(p, (uint64_t)v, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *fence(PyObject *self, PyObject *unused) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"load_acquire", load_acquire, METH_O, "load_acquire(address) -> int: 64-bit load with acquire ordering"},
    {"store_release", (PyCFunction)(void (*)(void))store_release, METH_FASTCALL,
     "store_release(address, value): 64-bit store with release ordering"},
    {"fence", fence, METH_NOARGS, "fence(): full sequentially consistent memory barrier"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_atomic", NULL, -1, methods};

PyMODINIT_FUNC PyInit__atomic(void) { return PyModule_Create(&module); }
