/* The served call's per-call checks of baked tensors and watched Python state, in C.
 *
 * The same checks as clika_runtime/state/unchanged.py (the reference, and the fallback where
 * this file is not built), without what Python's maps, tuples and lists cost a call: each is
 * an object allocated, tracked by the garbage collector and freed, and the collections they
 * trigger run inside served calls. Both answer False where a value cannot be read or compared
 * (the miss path then looks carefully); an exception that is not an Exception (KeyboardInterrupt)
 * is raised.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *version_name;  /* "_version", interned */

/* An Exception raised while checking: cleared, and the answer is False (0). Anything else: -1. */
static int
unreadable(void)
{
    if (PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

static PyObject *
answer(int result)
{
    if (result < 0)
        return NULL;
    return PyBool_FromLong(result);
}

/* fn(x) == expected, identity first; 1 yes, 0 no (or unreadable), -1 raised. */
static int
called_equal(PyObject *fn, PyObject *x, PyObject *expected)
{
    PyObject *got = PyObject_CallOneArg(fn, x);
    if (got == NULL)
        return unreadable();
    int same = PyObject_RichCompareBool(got, expected, Py_EQ);
    Py_DECREF(got);
    return same < 0 ? unreadable() : same;
}

/* The sum of the tensors' version counters equals ``versions``. */
static int
versions_equal(PyObject *tensors, PyObject *versions)
{
    PyObject *total = PyLong_FromLong(0);
    if (total == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tensors); i++) {
        PyObject *version = PyObject_GetAttr(PyTuple_GET_ITEM(tensors, i), version_name);
        if (version == NULL) {
            Py_DECREF(total);
            return unreadable();
        }
        PyObject *sum = PyNumber_Add(total, version);
        Py_DECREF(version);
        Py_DECREF(total);
        if (sum == NULL)
            return unreadable();
        total = sum;
    }
    int same = PyObject_RichCompareBool(total, versions, Py_EQ);
    Py_DECREF(total);
    return same < 0 ? unreadable() : same;
}

/* data_ptr(slots[i][names[i]]) == placed[i] for every i. */
static int
placed_equal(PyObject *data_ptr, PyObject *slots, PyObject *names, PyObject *placed)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(slots); i++) {
        PyObject *tensor = PyObject_GetItem(PyTuple_GET_ITEM(slots, i), PyTuple_GET_ITEM(names, i));
        if (tensor == NULL)
            return unreadable();
        int same = called_equal(data_ptr, tensor, PyTuple_GET_ITEM(placed, i));
        Py_DECREF(tensor);
        if (same != 1)
            return same;
    }
    return 1;
}

/* fn(xs[i]) == expected[i] for every i. */
static int
all_called_equal(PyObject *fn, PyObject *xs, PyObject *expected)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(xs); i++) {
        int same = called_equal(fn, PyTuple_GET_ITEM(xs, i), PyTuple_GET_ITEM(expected, i));
        if (same != 1)
            return same;
    }
    return 1;
}

static int
tuples(PyObject *const *args, Py_ssize_t first, Py_ssize_t count)
{
    for (Py_ssize_t i = first; i < count; i++) {
        if (!PyTuple_Check(args[i])) {
            PyErr_Format(PyExc_TypeError, "argument %zd must be a tuple", i + 1);
            return 0;
        }
    }
    return 1;
}

static PyObject *
weights_unchanged(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    /* (data_ptr, versioned, versions, slots, names, placed, tensors, pointers) */
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "weights_unchanged takes 8 arguments");
        return NULL;
    }
    if (!tuples(args, 1, 2) || !tuples(args, 3, 8))
        return NULL;
    if (PyTuple_GET_SIZE(args[3]) != PyTuple_GET_SIZE(args[4]) || PyTuple_GET_SIZE(args[3]) != PyTuple_GET_SIZE(args[5])
        || PyTuple_GET_SIZE(args[6]) != PyTuple_GET_SIZE(args[7])) {
        PyErr_SetString(PyExc_ValueError, "weights_unchanged: tuples of different lengths");
        return NULL;
    }
    int same = versions_equal(args[1], args[2]);
    if (same == 1)
        same = placed_equal(args[0], args[3], args[4], args[5]);
    if (same == 1)
        same = all_called_equal(args[0], args[6], args[7]);
    return answer(same);
}

static PyObject *
state_unchanged(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    /* (sized, sizes, readers, containers, values) */
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "state_unchanged takes 5 arguments");
        return NULL;
    }
    if (!tuples(args, 0, 5))
        return NULL;
    if (PyTuple_GET_SIZE(args[0]) != PyTuple_GET_SIZE(args[1]) || PyTuple_GET_SIZE(args[2]) != PyTuple_GET_SIZE(args[3])
        || PyTuple_GET_SIZE(args[2]) != PyTuple_GET_SIZE(args[4])) {
        PyErr_SetString(PyExc_ValueError, "state_unchanged: tuples of different lengths");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[0]); i++) {
        Py_ssize_t size = PyObject_Size(PyTuple_GET_ITEM(args[0], i));
        if (size < 0)
            return answer(unreadable());
        Py_ssize_t was = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[1], i));
        if (was == -1 && PyErr_Occurred())
            return answer(unreadable());
        if (size != was)
            Py_RETURN_FALSE;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[2]); i++) {
        int same = called_equal(PyTuple_GET_ITEM(args[2], i), PyTuple_GET_ITEM(args[3], i),
                                PyTuple_GET_ITEM(args[4], i));
        if (same != 1)
            return answer(same);
    }
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"weights_unchanged", (PyCFunction)(void (*)(void))weights_unchanged, METH_FASTCALL,
     "weights_unchanged(data_ptr, versioned, versions, slots, names, placed, tensors, pointers) -> bool"},
    {"state_unchanged", (PyCFunction)(void (*)(void))state_unchanged, METH_FASTCALL,
     "state_unchanged(sized, sizes, readers, containers, values) -> bool"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef definition = {
    PyModuleDef_HEAD_INIT, "_unchanged",
    "The served call's checks of baked tensors and watched state, in C (see unchanged.py).", -1, methods,
};

PyMODINIT_FUNC
PyInit__unchanged(void)
{
    version_name = PyUnicode_InternFromString("_version");
    if (version_name == NULL)
        return NULL;
    return PyModule_Create(&definition);
}
